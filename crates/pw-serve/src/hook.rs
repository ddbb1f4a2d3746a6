//! The call the engine makes between steps: where the planner computes the memory target and
//! commits page moves (no model call is in flight then).

use pw_pages::BoundaryTimes;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The engine's state at a step boundary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BoundaryState {
    /// Steps completed so far.
    pub step: u64,
    /// Sequences running.
    pub active: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Tokens generated in the step just finished.
    pub step_tokens: usize,
    /// KV bytes the live sequences hold now.
    pub kv_bytes_used: u64,
    /// KV bytes reserved by admission (each running sequence's prompt + max tokens).
    pub kv_bytes_reserved: u64,
    /// The KV budget.
    pub kv_budget_bytes: u64,
    /// Bytes of the model's weights.
    pub weight_bytes: u64,
    /// The paged memory after this boundary's commit (models with paged experts).
    pub memory: Option<MemoryState>,
    /// Where the step just finished and this boundary spent their time.
    pub timing: StepTiming,
}

/// The host-side time of one engine step and the boundary after it: each model call returns
/// once its results are on the host, so these are also the device's times for the calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTiming {
    /// Sequences of the step's decode call (0: no call).
    pub decode_seqs: usize,
    /// Time in the decode call.
    pub decode: Duration,
    /// Tokens of the step's prefill call (0: no call).
    pub prefill_tokens: usize,
    /// Time in the prefill call.
    pub prefill: Duration,
    /// Time in the boundary (the planner and the page commits).
    pub boundary: Duration,
}

/// The weight/KV memory of a model with paged experts, after its boundary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryState {
    /// Bytes for experts + KV (the accountant's budget).
    pub budget_bytes: u64,
    /// Bytes of one KV block.
    pub block_bytes: u64,
    /// Committed expert bytes per bit-width (index = bits, 0..=8).
    pub weight_bytes_by_bits: [u64; 9],
    /// Pages lowered so far.
    pub page_moves_down_total: u64,
    /// Pages raised so far.
    pub page_moves_up_total: u64,
    /// Raisings whose transfer started so far (each commits later as a move up, unless
    /// cancelled by a lowering).
    pub raisings_started_total: u64,
    /// Plans that lowered pages (KV pressure).
    pub planner_lower_total: u64,
    /// Plans that raised pages (memory given back).
    pub planner_raise_total: u64,
    /// Plans that could not free the target (every page at its floor).
    pub planner_unmet_total: u64,
    /// Raisings deferred (budget or fragmentation), counted per boundary.
    pub deferred_total: u64,
    /// KV blocks the live sequences hold.
    pub kv_blocks_used: u64,
    /// KV blocks the budget still has room for.
    pub kv_blocks_free: u64,
    /// Whether the last boundary changed nothing (no plan, no commit): an idle engine stops
    /// calling boundaries then.
    pub settled: bool,
    /// Plans the planner computed so far (whether or not they changed a page).
    pub plans_total: u64,
    /// Time boundaries spent planning so far (reading the routing statistics, the planner).
    pub plan_time: Duration,
    /// Layer page tables published so far (one per layer whose committed table changed).
    pub tables_published_total: u64,
    /// Time boundaries spent committing pages so far (lowerings, transfers started and
    /// finished, tables published).
    pub commit_time: Duration,
    /// The commits' time so far by part.
    pub commit_parts: BoundaryTimes,
}

impl MemoryState {
    /// Committed expert bytes.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes_by_bits.iter().sum()
    }

    /// Mean committed bits per weight byte, weighted by bytes (0 without experts).
    pub fn mean_bits(&self) -> f64 {
        let total = self.weight_bytes();
        if total == 0 {
            return 0.0;
        }
        self.weight_bytes_by_bits.iter().enumerate().map(|(b, &n)| b as f64 * n as f64).sum::<f64>()
            / total as f64
    }
}

/// Called by the engine between steps.
pub trait BoundaryHook: Send {
    /// One step has finished and the next has not started.
    fn on_boundary(&mut self, state: &BoundaryState);
}

/// What a [`UsageRecorder`] has seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageRecord {
    /// Boundaries seen.
    pub boundaries: u64,
    /// The latest state.
    pub last: BoundaryState,
    /// Highest KV bytes held.
    pub peak_kv_bytes_used: u64,
    /// Highest KV bytes reserved.
    pub peak_kv_bytes_reserved: u64,
    /// Most sequences running at once.
    pub peak_active: usize,
    /// Longest queue.
    pub peak_waiting: usize,
}

/// The default hook: changes nothing, records KV usage (clone it to read the record).
#[derive(Debug, Clone, Default)]
pub struct UsageRecorder {
    record: Arc<Mutex<UsageRecord>>,
}

impl UsageRecorder {
    /// A copy of the record so far.
    pub fn record(&self) -> UsageRecord {
        self.record.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl BoundaryHook for UsageRecorder {
    fn on_boundary(&mut self, s: &BoundaryState) {
        let mut r = self.record.lock().unwrap_or_else(|p| p.into_inner());
        r.boundaries += 1;
        r.peak_kv_bytes_used = r.peak_kv_bytes_used.max(s.kv_bytes_used);
        r.peak_kv_bytes_reserved = r.peak_kv_bytes_reserved.max(s.kv_bytes_reserved);
        r.peak_active = r.peak_active.max(s.active);
        r.peak_waiting = r.peak_waiting.max(s.waiting);
        r.last = s.clone();
    }
}
