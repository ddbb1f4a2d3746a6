//! The memory side of a model with paged experts (the fast path's decoder, or a Burn model's
//! page table on the reference path): one budget ([`Accountant`]) for the experts' pages and
//! the KV cache, and the planner between steps.
//!
//! - KV blocks are leased from the budget as sequences grow (before the step that needs them)
//!   and given back when sequences end.
//! - At every boundary (no step in flight): the routing counts of the sampled steps are folded
//!   into the planner, the KV memory target is computed from the free blocks less those the
//!   next steps will take (`D = max(0, T + 1 − F) · B_KV`, or memory to give back when
//!   `F > T + H`), the plan becomes
//!   the pages' desired bits, and the page table commits: lowerings at once, raisings when
//!   their copy has finished. Nothing waits for a transfer.
//! - A step that still finds no room (a long prompt between two boundaries) runs the same
//!   boundary first: between two decode launches is as safe as between two engine steps.

use std::time::{Duration, Instant};

use cubecl::prelude::*;
use pw_decode::{Decoder, ExpertCommit, ExpertPage, RoutingCounts};
use pw_linear::PageTable;
use pw_pages::{Accountant, Lease, PageId as Slot, Use};
use pw_planner::{
    KvPressureConfig, MemoryTarget, PageId, PageState, Planner, PlannerConfig, ResidualFactors,
    RoutingConfig, Snapshot, page_damage, plan,
};

use crate::hook::MemoryState;
use crate::model::StepError;
use crate::page_table::{PageLocation, PageTableView, PageView, PlannerDecision};

/// Who decides the experts' bit-widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPolicy {
    /// Every page stays at its initial bits (the KV cache gets what is left).
    Pinned,
    /// The planner lowers pages under KV pressure and raises them when the cache shrinks.
    Planner,
}

/// Memory options of a model with paged experts.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryOptions {
    /// Device bytes for the experts and the KV cache together (`None`: no limit; the KV cache
    /// is sized from the engine's KV budget and the planner has nothing to do).
    pub budget_bytes: Option<u64>,
    /// Pinned bits or the planner.
    pub policy: WeightPolicy,
    /// The planner's damage model, ablations and global floor.
    pub planner: PlannerConfig,
    /// Routing buckets and floors.
    pub routing: RoutingConfig,
    /// `T_blk`: free KV blocks at or below which pages are lowered.
    pub threshold_blocks: u64,
    /// `H`: free blocks above `T_blk` needed before memory goes back to the weights.
    pub give_back_blocks: u64,
    /// Routing counts are recorded on every n-th step (and downloaded at the boundary after it).
    pub routing_every: u64,
    /// Most bytes one boundary may start raising (0 = no limit), so that a give-back spreads
    /// its copies over several steps.
    pub max_raise_bytes: u64,
    /// How long after the last lowering memory may go back to the weights: while the cache
    /// keeps asking for room (sequences growing, prompts arriving), memory it frees for a moment
    /// stays with it instead of being copied into pages that the next lowering drops again.
    pub raise_after: Duration,
    /// How the calibration text was routed (from a PagedWeight checkpoint; empty: unknown):
    /// the planner's routing multiplier is then relative to it.
    pub calibration_routing: Vec<pw_format::LayerRouting>,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            budget_bytes: None,
            policy: WeightPolicy::Planner,
            planner: PlannerConfig::default(),
            routing: RoutingConfig::default(),
            threshold_blocks: 16,
            give_back_blocks: 16,
            routing_every: 1,
            max_raise_bytes: 0,
            raise_after: Duration::from_secs(1),
            calibration_routing: Vec::new(),
        }
    }
}

impl MemoryOptions {
    /// The most expert bytes the planner's floors can hold, with `experts` experts per sparse
    /// layer and `expert_bytes(b)` the experts' bytes with every page at `b` bits. With routing
    /// on, an expert is hot when its share is at least `hot_share` and the shares of a layer sum
    /// to its expert count, so at most `⌊experts / hot_share⌋` of them are hot at once: that
    /// fraction at the hot floor and the rest at the higher of the warm and cold floors bounds
    /// the floors' bytes whichever experts turn hot. Without routing, every page at the global
    /// floor.
    pub fn floor_bytes(&self, experts: usize, expert_bytes: impl Fn(u8) -> u64) -> u64 {
        let global = self.planner.floor_bits.max(3);
        if !self.planner.use_routing || experts == 0 {
            return expert_bytes(global.min(8));
        }
        let r = &self.routing;
        let hot = r.hot_floor_bits.max(global).min(8);
        let rest = r.warm_floor_bits.max(r.cold_floor_bits).max(global).min(8);
        if hot <= rest {
            return expert_bytes(rest);
        }
        let most_hot = if r.hot_share > 0.0 {
            ((experts as f64 / r.hot_share).floor() as usize).min(experts)
        } else {
            experts
        };
        let (h, n) = (most_hot as u128, experts as u128);
        let mixed = (h * expert_bytes(hot) as u128 + (n - h) * expert_bytes(rest) as u128).div_ceil(n);
        mixed as u64
    }
}

/// The expert pages a [`PagedMemory`] plans over: the fast path's decoder, or the page table of
/// a Burn model's paged experts (the reference path).
pub(crate) trait ExpertStore {
    /// Every page in a fixed order; [`ExpertStore::set_desired`] takes indices into it.
    fn pages(&self) -> Vec<ExpertPage>;
    /// Every page's (desired, committed) bits in the order of [`ExpertStore::pages`] (what
    /// changes of a page between boundaries).
    fn page_bits(&self) -> Vec<(u8, u8)>;
    /// Asks for `bits` on page `index`; committed at the next [`ExpertStore::commit`].
    fn set_desired(&mut self, index: usize, bits: u8) -> Result<(), StepError>;
    /// The page table's safe point: lowerings commit at once, finished raisings commit, new
    /// raisings start.
    fn commit(&mut self) -> Result<ExpertCommit, StepError>;
    /// Committed bytes per bit-width (index = bits, 0..=8).
    fn bytes_by_bits(&self) -> [u64; 9];
    /// The routing counted since the last call (`None` where the store counts none).
    fn take_routing(&mut self) -> Result<Option<RoutingCounts>, StepError>;
    /// Whether the next step counts its routing.
    fn arm_routing(&mut self, armed: bool);
    /// Decoder layers and experts per sparse layer.
    fn shape(&self) -> (usize, usize);
}

impl<R: Runtime, KV: Float + CubeElement> ExpertStore for Decoder<R, KV> {
    fn pages(&self) -> Vec<ExpertPage> {
        self.experts().pages()
    }

    fn page_bits(&self) -> Vec<(u8, u8)> {
        self.experts().page_bits()
    }

    fn set_desired(&mut self, index: usize, bits: u8) -> Result<(), StepError> {
        self.experts_mut().set_desired(index, bits).map_err(err)
    }

    fn commit(&mut self) -> Result<ExpertCommit, StepError> {
        self.experts_mut().boundary().map_err(err)
    }

    fn bytes_by_bits(&self) -> [u64; 9] {
        self.experts().bytes_by_bits()
    }

    fn take_routing(&mut self) -> Result<Option<RoutingCounts>, StepError> {
        self.take_route_stats().map_err(err)
    }

    fn arm_routing(&mut self, armed: bool) {
        self.route_stats_mut().armed = armed;
    }

    fn shape(&self) -> (usize, usize) {
        (self.config().layers, self.config().experts)
    }
}

/// The experts of a Burn model loaded with [`LoadedModel::load_paged`](pw_models::LoadedModel::load_paged):
/// one [`PageTable`] for every layer, on the model's device (host arenas on ndarray). It
/// counts no routing, so the planner weighs experts by their calibration shares.
pub(crate) struct TablePages {
    table: PageTable,
    /// Every page with what does not change (key, range, bytes and sensitivity per width);
    /// the bits are read from the table.
    fixed: Vec<ExpertPage>,
    layers: usize,
    experts: usize,
}

impl TablePages {
    /// The pages of `table`, a model of `layers` decoder layers with `experts` per sparse layer.
    pub(crate) fn new(table: PageTable, layers: usize, experts: usize) -> Result<Self, StepError> {
        let fixed = (0..table.len())
            .map(|i| {
                let (info, b) = (table.info(Slot(i)).map_err(err)?, table.parent(Slot(i)).map_err(err)?);
                Ok(ExpertPage {
                    layer: info.key.layer,
                    expert: info.key.expert,
                    kind: info.key.kind,
                    desired: info.desired,
                    committed: info.committed,
                    min_bits: b.min_bits,
                    max_bits: b.max_bits,
                    bytes: (b.min_bits..=b.max_bits)
                        .map(|x| {
                            let (p, l) = b.bytes_at(x);
                            (p + l) as u64
                        })
                        .collect(),
                    sensitivity: b.sensitivity.clone(),
                    raising_to: None,
                })
            })
            .collect::<Result<_, StepError>>()?;
        Ok(Self { table, fixed, layers, experts })
    }

    /// Committed bytes of every expert page.
    pub(crate) fn committed_bytes(&self) -> u64 {
        self.bytes_by_bits().iter().sum()
    }
}

impl ExpertStore for TablePages {
    fn pages(&self) -> Vec<ExpertPage> {
        self.fixed
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let info = self.table.info(Slot(i)).ok()?;
                let desired = if info.desired == 0 { info.committed } else { info.desired };
                Some(ExpertPage {
                    desired,
                    committed: info.committed,
                    raising_to: info.raising_to,
                    ..p.clone()
                })
            })
            .collect()
    }

    fn page_bits(&self) -> Vec<(u8, u8)> {
        self.table.bits()
    }

    fn set_desired(&mut self, index: usize, bits: u8) -> Result<(), StepError> {
        self.table.set_desired(Slot(index), bits).map_err(err)
    }

    fn commit(&mut self) -> Result<ExpertCommit, StepError> {
        let r = self.table.boundary().map_err(err)?;
        Ok(ExpertCommit {
            lowered: r.lowered.len(),
            raised: r.raised.len(),
            started: r.started.len(),
            deferred: r.deferred.len(),
            published: r.published as usize,
            relocations: r.relocating.len() + r.relocated.len(),
            times: r.times,
        })
    }

    fn bytes_by_bits(&self) -> [u64; 9] {
        self.table.bytes_by_bits()
    }

    fn take_routing(&mut self) -> Result<Option<RoutingCounts>, StepError> {
        Ok(None)
    }

    fn arm_routing(&mut self, _armed: bool) {}

    fn shape(&self) -> (usize, usize) {
        (self.layers, self.experts)
    }
}

/// Budget, initial bits and cache size of a load.
pub(crate) struct MemoryPlan {
    /// Bytes for the experts and the KV cache.
    pub(crate) budget: u64,
    /// The width every page starts at.
    pub(crate) initial_bits: u8,
    /// KV blocks of the cache.
    pub(crate) kv_blocks: usize,
    /// KV bytes the engine may reserve.
    pub(crate) kv_capacity: u64,
}

impl MemoryPlan {
    /// `expert_bytes(b)`: expert bytes with every page at `b` bits; `experts` per sparse layer.
    pub(crate) fn new(
        m: &MemoryOptions,
        experts: usize,
        block_bytes: u64,
        max_batch: usize,
        kv_budget_bytes: u64,
        expert_bytes: impl Fn(u8) -> u64,
        bits: u8,
    ) -> Result<Self, String> {
        let slack = (max_batch.max(1) as u64).saturating_mul(block_bytes);
        let Some(budget) = m.budget_bytes else {
            // No limit: the cache is sized from the engine's KV budget, the weights stay put.
            let kv_blocks = (kv_budget_bytes.div_ceil(block_bytes) as usize).saturating_add(max_batch.max(1));
            let budget = expert_bytes(bits).saturating_add((kv_blocks as u64).saturating_mul(block_bytes));
            return Ok(Self { budget, initial_bits: bits, kv_blocks, kv_capacity: kv_budget_bytes });
        };
        let reserve = match m.policy {
            WeightPolicy::Pinned => 0,
            WeightPolicy::Planner => (m.threshold_blocks + 1) * block_bytes,
        };
        // Start at the highest width (at most `bits`) that leaves the planner its free-block
        // reserve, or (pinned) room for one block per batch slot.
        let start_room = match m.policy {
            WeightPolicy::Pinned => slack,
            WeightPolicy::Planner => reserve,
        };
        let initial_bits =
            (3..=bits).rev().find(|&b| expert_bytes(b) + start_room <= budget).ok_or_else(|| {
                format!(
                    "a memory budget of {budget} bytes cannot hold the experts even at 3 bits ({} bytes) \
                     plus {} bytes of KV cache",
                    expert_bytes(3),
                    start_room
                )
            })?;
        let floor_bytes = match m.policy {
            WeightPolicy::Pinned => expert_bytes(initial_bits),
            WeightPolicy::Planner => m.floor_bytes(experts, &expert_bytes).min(expert_bytes(initial_bits)),
        };
        let kv_room = budget.saturating_sub(floor_bytes);
        let kv_capacity = kv_room.saturating_sub(reserve + slack);
        if kv_capacity == 0 {
            return Err(format!("a memory budget of {budget} bytes leaves no room for the KV cache"));
        }
        let kv_blocks = (kv_room / block_bytes) as usize + 1;
        Ok(Self { budget, initial_bits, kv_blocks, kv_capacity })
    }
}

/// Counters and the planner.
pub(crate) struct PagedMemory {
    accountant: Accountant,
    kv: Lease,
    block_bytes: u64,
    planner: Option<Planner>,
    options: MemoryOptions,
    boundaries: u64,
    state: MemoryState,
    /// The planner's view of the pages: built at the first boundary, then only their bits
    /// refreshed (their sizes and sensitivities never change).
    snapshot: Snapshot,
    last_decision: Option<PlannerDecision>,
    /// When the planner last lowered pages (raising waits [`MemoryOptions::raise_after`]).
    last_lowering: Option<Instant>,
}

fn page_state(p: &ExpertPage) -> PageState {
    PageState {
        id: PageId { layer: p.layer, expert: p.expert, kind: p.kind },
        desired: p.desired,
        committed: p.committed,
        min_bits: p.min_bits,
        max_bits: p.max_bits,
        bytes: p.bytes.clone(),
        sensitivity: p.sensitivity.clone(),
    }
}

fn err(e: impl std::fmt::Display) -> StepError {
    StepError::failed(e.to_string())
}

impl PagedMemory {
    pub(crate) fn new(
        accountant: Accountant,
        block_bytes: u64,
        layers: usize,
        experts: usize,
        options: MemoryOptions,
    ) -> Result<Self, StepError> {
        let kv = accountant.lease(Use::Kv, 0).map_err(err)?;
        let planner = match options.policy {
            WeightPolicy::Pinned => None,
            WeightPolicy::Planner => {
                let kvc = KvPressureConfig {
                    threshold_blocks: options.threshold_blocks,
                    give_back_margin_blocks: options.give_back_blocks,
                    bytes_per_block: block_bytes,
                    min_give_back_bytes: 0,
                };
                let mut p =
                    Planner::new(layers, experts, options.planner.clone(), kvc, options.routing.clone())
                        .map_err(err)?;
                p.routing.set_calibration_routing(&options.calibration_routing).map_err(err)?;
                Some(p)
            }
        };
        let state =
            MemoryState { budget_bytes: accountant.usage().budget, block_bytes, ..Default::default() };
        Ok(Self {
            accountant,
            kv,
            block_bytes,
            planner,
            options,
            boundaries: 0,
            state,
            snapshot: Snapshot::default(),
            last_decision: None,
            last_lowering: None,
        })
    }

    /// Whether the planner samples the routing on some steps (the routing kernels then run
    /// with their statistics).
    pub(crate) fn samples_routing(&self) -> bool {
        self.planner.is_some()
    }

    /// Brings [`Self::snapshot`] up to date with `store`'s pages.
    fn refresh_snapshot(&mut self, store: &impl ExpertStore) {
        let bits = store.page_bits();
        if self.snapshot.pages.len() != bits.len() {
            self.snapshot = Snapshot { pages: store.pages().iter().map(page_state).collect() };
            return;
        }
        for (p, (desired, committed)) in self.snapshot.pages.iter_mut().zip(bits) {
            p.desired = desired;
            p.committed = committed;
        }
    }

    /// Free KV blocks the budget allows now.
    fn free_blocks(&self) -> u64 {
        self.accountant.free() / self.block_bytes
    }

    /// The prompt-residual factors the planner's damage uses from the next boundary on (`None`:
    /// no correction).
    pub(crate) fn set_residual(&mut self, factors: Option<ResidualFactors>) {
        if let Some(p) = &mut self.planner {
            p.residual = factors;
        }
    }

    /// Makes the KV lease cover `blocks` blocks, running the planner first if the budget has
    /// no room.
    pub(crate) fn reserve(&mut self, store: &mut impl ExpertStore, blocks: u64) -> Result<(), StepError> {
        let want = blocks * self.block_bytes;
        if want <= self.kv.bytes() {
            return Ok(());
        }
        let grow = |acct: &Accountant, kv: &mut Lease| -> bool {
            match acct.lease(Use::Kv, want - kv.bytes()) {
                Ok(l) => {
                    kv.absorb(l);
                    true
                }
                Err(_) => false,
            }
        };
        if grow(&self.accountant, &mut self.kv) {
            return Ok(());
        }
        if self.planner.is_some() {
            // Plan as if the missing blocks were already taken.
            let missing = (want - self.kv.bytes()).div_ceil(self.block_bytes);
            self.boundary(store, blocks, DemandBlocks { next: missing, until_done: missing })?;
            if grow(&self.accountant, &mut self.kv) {
                return Ok(());
            }
        }
        Err(StepError::OutOfMemory(format!(
            "the KV cache needs {blocks} blocks of {} bytes but the memory budget has room for {} more \
             ({} bytes of weights, {} of KV, budget {})",
            self.block_bytes,
            self.free_blocks(),
            self.accountant.usage().weights,
            self.kv.bytes(),
            self.accountant.usage().budget
        )))
    }

    /// Gives back KV bytes beyond `blocks` blocks.
    pub(crate) fn shrink_to(&mut self, blocks: u64) {
        let want = blocks * self.block_bytes;
        if self.kv.bytes() > want {
            let extra = self.kv.bytes() - want;
            self.kv.shrink(extra);
        }
    }

    /// The boundary: the planner (if any) and the page table's commit. `used_blocks`: KV
    /// blocks the live sequences hold; `demand`: blocks the next steps will lease (counted as
    /// taken, so the planner makes room for them before they are asked for) and those the
    /// sequences may lease before they finish (no page is raised into them).
    pub(crate) fn boundary(
        &mut self,
        store: &mut impl ExpertStore,
        used_blocks: u64,
        demand: DemandBlocks,
    ) -> Result<MemoryState, StepError> {
        self.shrink_to(used_blocks);
        self.boundaries += 1;
        let mut changed = 0usize;
        // A give-back held until the cache has stopped asking for room.
        let mut held_back = false;
        let now = Instant::now();
        if self.planner.is_some() {
            self.refresh_snapshot(store);
        }
        if let Some(p) = self.planner.as_mut() {
            if let Some(rc) = store.take_routing()? {
                p.observe(rc.tokens.min(u32::MAX as u64) as u32, &rc.counts, &rc.mass).map_err(err)?;
            }
            let snapshot = &self.snapshot;
            // Free blocks once the demand is taken: negative when short, so that one plan frees
            // the whole shortfall.
            let free = i64::try_from(self.accountant.free() / self.block_bytes).unwrap_or(i64::MAX);
            let after = |blocks: u64| free.saturating_sub(i64::try_from(blocks).unwrap_or(i64::MAX));
            let mut target = p.kv.target(after(demand.next), snapshot.pending_bytes());
            if matches!(target, MemoryTarget::Spare(_)) {
                // Give back only what the sequences will not take before they finish.
                let later = after(demand.until_done);
                target = match p.kv.target(later, snapshot.pending_bytes()) {
                    spare @ MemoryTarget::Spare(_) => spare,
                    _ => MemoryTarget::Hold,
                };
            }
            if matches!(target, MemoryTarget::Spare(_))
                && snapshot.pages.iter().all(|p| p.desired >= p.max_bits)
            {
                // Every page already asks for its top width: nothing to give the memory to.
                target = MemoryTarget::Hold;
            }
            if let MemoryTarget::Spare(s) = target
                && self.options.max_raise_bytes > 0
            {
                target = MemoryTarget::Spare(s.min(self.options.max_raise_bytes));
            }
            if matches!(target, MemoryTarget::Spare(_))
                && self.last_lowering.is_some_and(|t| now.duration_since(t) < self.options.raise_after)
            {
                target = MemoryTarget::Hold;
                held_back = true;
            }
            if target != MemoryTarget::Hold {
                self.state.plans_total += 1;
                let plan =
                    plan(snapshot, Some(&p.routing), p.residual.as_ref(), target, &p.config).map_err(err)?;
                for (i, (page, &d)) in snapshot.pages.iter().zip(&plan.desired).enumerate() {
                    if page.desired != d {
                        store.set_desired(i, d)?;
                        changed += 1;
                    }
                }
                if changed > 0 {
                    let (name, bytes) = match target {
                        MemoryTarget::Free(b) => {
                            self.state.planner_lower_total += 1;
                            self.last_lowering = Some(now);
                            ("free", b)
                        }
                        MemoryTarget::Spare(b) => {
                            self.state.planner_raise_total += 1;
                            ("spare", b)
                        }
                        MemoryTarget::Hold => ("hold", 0),
                    };
                    self.last_decision = Some(PlannerDecision {
                        boundary: self.boundaries,
                        target: name,
                        target_bytes: bytes,
                        pages_changed: changed,
                        bytes_before: plan.bytes_before,
                        bytes_after: plan.bytes_after,
                        met: plan.met,
                    });
                }
                if !plan.met {
                    self.state.planner_unmet_total += 1;
                }
            }
            // Record the routing of the next step when it is a sampled one.
            store.arm_routing(self.boundaries.is_multiple_of(self.options.routing_every.max(1)));
        }
        let planned = Instant::now();
        self.state.plan_time += planned - now;
        let commit = store.commit()?;
        self.state.commit_time += planned.elapsed();
        self.state.commit_parts.add(&commit.times);
        self.state.page_moves_down_total += commit.lowered as u64;
        self.state.page_moves_up_total += commit.raised as u64;
        self.state.raisings_started_total += commit.started as u64;
        self.state.tables_published_total += commit.published as u64;
        self.state.deferred_total += commit.deferred as u64;
        self.state.weight_bytes_by_bits = store.bytes_by_bits();
        self.state.settled =
            !held_back && changed == 0 && commit.lowered + commit.raised + commit.started == 0;
        self.state.kv_blocks_used = used_blocks;
        self.state.kv_blocks_free = self.free_blocks();
        self.state.budget_bytes = self.accountant.usage().budget;
        Ok(self.state.clone())
    }

    /// Every page's state and the memory split as the last boundary left them, with the
    /// planner's routing shares and damage estimates (see [`PageTableView`]).
    pub(crate) fn view(&self, store: &impl ExpertStore) -> Result<PageTableView, StepError> {
        let pages = store.pages();
        // Per page, from the planner: routing share, calibration share (when known), damage.
        let planned: Vec<(f64, Option<f64>, f64)> = match &self.planner {
            Some(p) => {
                let snapshot = Snapshot { pages: pages.iter().map(page_state).collect() };
                let desired: Vec<u8> = pages.iter().map(|x| x.desired).collect();
                let d = page_damage(&snapshot, &desired, Some(&p.routing), p.residual.as_ref(), &p.config)
                    .map_err(err)?;
                // Shares are relative to the layer's mean expert; the view gives fractions.
                let (r, n) = (&p.routing, p.routing.experts() as f64);
                pages
                    .iter()
                    .zip(d)
                    .map(|(x, damage)| {
                        let calibration = r.calibration_share(x.layer, x.expert).map(|s| s / n);
                        (r.share(x.layer, x.expert) / n, calibration, damage)
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        let views = pages
            .iter()
            .enumerate()
            .map(|(i, p)| PageView {
                layer: p.layer,
                expert: p.expert,
                kind: p.kind.name(),
                desired_bits: p.desired,
                committed_bits: p.committed,
                location: if p.committed == 0 {
                    PageLocation::Host
                } else if p.raising_to.is_some() {
                    PageLocation::InTransfer
                } else {
                    PageLocation::Gpu
                },
                bytes: p
                    .committed
                    .checked_sub(p.min_bits)
                    .and_then(|i| p.bytes.get(i as usize))
                    .copied()
                    .unwrap_or(0),
                routing_share: planned.get(i).map(|x| x.0),
                calibration_share: planned.get(i).and_then(|x| x.1),
                damage: planned.get(i).map(|x| x.2),
            })
            .collect();
        let (layers, experts) = store.shape();
        Ok(PageTableView {
            policy: if self.planner.is_some() { "planner" } else { "pinned" },
            boundary: self.boundaries,
            layers,
            experts,
            budget_bytes: self.accountant.usage().budget,
            expert_bytes: self.state.weight_bytes(),
            block_bytes: self.block_bytes,
            kv_blocks_used: self.state.kv_blocks_used,
            kv_blocks_free: self.free_blocks(),
            mean_bits: self.state.mean_bits(),
            last_decision: self.last_decision.clone(),
            pages: views,
        })
    }
}

/// KV blocks a boundary plans for (see [`crate::KvDemand`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DemandBlocks {
    /// Blocks the next steps lease.
    pub next: u64,
    /// Blocks the sequences may lease before they finish (at least `next`).
    pub until_done: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of 100 bytes per bit that commit whatever is asked at once.
    struct Pages(Vec<ExpertPage>);

    impl Pages {
        fn new(n: usize, bits: u8) -> Self {
            Self(
                (0..n)
                    .map(|e| ExpertPage {
                        layer: 0,
                        expert: e / 2,
                        kind: if e % 2 == 0 {
                            pw_format::BlockKind::GateUp
                        } else {
                            pw_format::BlockKind::Down
                        },
                        desired: bits,
                        committed: bits,
                        min_bits: 3,
                        max_bits: 8,
                        bytes: (3..=8).map(|b| b * 100).collect(),
                        sensitivity: (3..=8).map(|b| 1.0 / (1u64 << b) as f64).collect(),
                        raising_to: None,
                    })
                    .collect(),
            )
        }

        fn mean_desired(&self) -> f64 {
            self.0.iter().map(|p| p.desired as f64).sum::<f64>() / self.0.len() as f64
        }
    }

    impl ExpertStore for Pages {
        fn pages(&self) -> Vec<ExpertPage> {
            self.0.clone()
        }
        fn page_bits(&self) -> Vec<(u8, u8)> {
            self.0.iter().map(|p| (p.desired, p.committed)).collect()
        }
        fn set_desired(&mut self, index: usize, bits: u8) -> Result<(), StepError> {
            self.0[index].desired = bits;
            Ok(())
        }
        fn commit(&mut self) -> Result<ExpertCommit, StepError> {
            let mut c = ExpertCommit::default();
            for p in &mut self.0 {
                match p.desired.cmp(&p.committed) {
                    std::cmp::Ordering::Less => c.lowered += 1,
                    std::cmp::Ordering::Greater => c.raised += 1,
                    std::cmp::Ordering::Equal => {}
                }
                p.committed = p.desired;
            }
            Ok(c)
        }
        fn bytes_by_bits(&self) -> [u64; 9] {
            let mut b = [0; 9];
            for p in &self.0 {
                b[p.committed as usize] += p.committed as u64 * 100;
            }
            b
        }
        fn take_routing(&mut self) -> Result<Option<RoutingCounts>, StepError> {
            Ok(None)
        }
        fn arm_routing(&mut self, _armed: bool) {}
        fn shape(&self) -> (usize, usize) {
            (1, self.0.len() / 2)
        }
    }

    /// Memory of 100 blocks of 100 bytes (the store's bytes are not leased here: the budget is
    /// all KV) whose KV takes 90 blocks, 16 pages of 8 bits, after the boundary that lowered
    /// them (10 free blocks, at or below the threshold).
    fn pressed(raise_after: Duration) -> (PagedMemory, Pages, MemoryState) {
        let block = 100;
        let options =
            MemoryOptions { budget_bytes: Some(100 * block), raise_after, ..MemoryOptions::default() };
        let mut mem = PagedMemory::new(Accountant::new(100 * block), block, 1, 8, options).unwrap();
        let mut pages = Pages::new(16, 8);
        mem.reserve(&mut pages, 90).unwrap();
        let state = mem.boundary(&mut pages, 90, DemandBlocks::default()).unwrap();
        (mem, pages, state)
    }

    /// Memory freed right after a lowering stays with the KV cache for `raise_after`; the
    /// boundary reports itself unsettled meanwhile (so an idle engine comes back), then the
    /// pages go up.
    #[test]
    fn raising_waits_until_the_cache_has_stopped_asking_for_room() {
        let (mut mem, mut pages, state) = pressed(Duration::from_millis(200));
        assert!(state.page_moves_down_total > 0);
        assert_eq!(state.plans_total, 1);
        let lowered = pages.mean_desired();
        assert!(lowered < 8.0);
        // The sequences end: 100 free blocks, but the cache asked for room a moment ago.
        let state = mem.boundary(&mut pages, 0, DemandBlocks::default()).unwrap();
        assert_eq!(pages.mean_desired(), lowered);
        assert!(!state.settled);
        std::thread::sleep(Duration::from_millis(250));
        let state = mem.boundary(&mut pages, 0, DemandBlocks::default()).unwrap();
        assert!(pages.mean_desired() > lowered, "{}", pages.mean_desired());
        assert!(state.page_moves_up_total > 0);
    }

    /// Pages go up only into memory the sequences will not take before they finish: with
    /// every block free but 95 of them still to be taken, nothing is raised; once that demand
    /// is gone, pages go up.
    #[test]
    fn raising_leaves_what_the_sequences_take_before_they_finish() {
        let (mut mem, mut pages, _) = pressed(Duration::ZERO);
        let lowered = pages.mean_desired();
        assert!(lowered < 8.0);
        let later = DemandBlocks { next: 0, until_done: 95 };
        let state = mem.boundary(&mut pages, 0, later).unwrap();
        assert_eq!(pages.mean_desired(), lowered);
        assert_eq!(state.page_moves_up_total, 0);
        let state = mem.boundary(&mut pages, 0, DemandBlocks::default()).unwrap();
        assert!(pages.mean_desired() > lowered, "{}", pages.mean_desired());
        assert!(state.page_moves_up_total > 0);
    }

    /// Blocks the next steps take beyond the free ones are freed by one plan: the whole
    /// shortfall plus the threshold, not only the threshold's worth.
    #[test]
    fn one_plan_frees_the_whole_shortfall_of_the_next_steps() {
        let block = 100;
        let options = MemoryOptions { budget_bytes: Some(100 * block), ..MemoryOptions::default() };
        let threshold = options.threshold_blocks;
        let mut mem = PagedMemory::new(Accountant::new(100 * block), block, 1, 8, options).unwrap();
        let mut pages = Pages::new(16, 8);
        mem.reserve(&mut pages, 50).unwrap();
        // 50 blocks free, 80 asked for by the next steps: 30 short.
        mem.boundary(&mut pages, 50, DemandBlocks { next: 80, until_done: 80 }).unwrap();
        let decision = mem.last_decision.clone().expect("the shortfall is planned for");
        assert_eq!(decision.target, "free");
        assert_eq!(decision.target_bytes, (threshold + 1 + 30) * block);
    }

    /// Free memory with every page asking for its top width computes no plan (there is nothing
    /// to raise), and the boundary is settled; once pages are lower, the same free memory is
    /// planned for.
    #[test]
    fn free_memory_is_not_planned_for_when_every_page_is_at_its_top_width() {
        let block = 100;
        let options = MemoryOptions {
            budget_bytes: Some(100 * block),
            raise_after: Duration::ZERO,
            ..MemoryOptions::default()
        };
        let mut mem = PagedMemory::new(Accountant::new(100 * block), block, 1, 8, options).unwrap();
        let mut pages = Pages::new(16, 8);
        let state = mem.boundary(&mut pages, 0, DemandBlocks::default()).unwrap();
        assert_eq!(state.plans_total, 0);
        assert!(state.settled);
        let (mut mem, mut pages, state) = pressed(Duration::ZERO);
        let plans = state.plans_total;
        let state = mem.boundary(&mut pages, 0, DemandBlocks::default()).unwrap();
        assert_eq!(state.plans_total, plans + 1);
        assert!(state.page_moves_up_total > 0);
    }

    /// The snapshot a boundary refreshes from the pages' bits equals one built from the pages
    /// after lowerings and raisings.
    #[test]
    fn the_refreshed_snapshot_equals_one_built_from_the_pages() {
        let (mut mem, mut pages, _) = pressed(Duration::ZERO);
        let built = |p: &Pages| Snapshot { pages: p.pages().iter().map(page_state).collect() };
        pages.0[3].desired = 7;
        mem.refresh_snapshot(&pages);
        assert_eq!(mem.snapshot, built(&pages));
        assert!(mem.snapshot.pages.iter().any(|p| p.committed < 8));
        mem.boundary(&mut pages, 0, DemandBlocks::default()).unwrap();
        mem.refresh_snapshot(&pages);
        assert_eq!(mem.snapshot, built(&pages));
    }

    #[test]
    fn floor_bytes_bound_the_hot_experts_by_their_share() {
        let bytes = |b: u8| b as u64 * 100;
        let m = MemoryOptions::default();
        // 60 experts, hot at share >= 2: at most 30 hot at 5 bits, 30 at 3.
        assert_eq!(m.floor_bytes(60, bytes), 400);
        // 8 experts: at most 4 hot.
        assert_eq!(m.floor_bytes(8, bytes), 400);
        // 7 experts: at most 3 hot, the rest rounded up.
        assert_eq!(m.floor_bytes(7, bytes), (3 * 500 + 4 * 300u64).div_ceil(7));
        let mut any_hot = MemoryOptions::default();
        any_hot.routing.hot_share = 0.5;
        assert_eq!(any_hot.floor_bytes(60, bytes), 500);
        let mut no_routing = MemoryOptions::default();
        no_routing.planner.use_routing = false;
        assert_eq!(no_routing.floor_bytes(60, bytes), 300);
        no_routing.planner.floor_bits = 6;
        assert_eq!(no_routing.floor_bytes(60, bytes), 600);
        let mut high_rest = MemoryOptions::default();
        high_rest.routing.warm_floor_bits = 6;
        assert_eq!(high_rest.floor_bytes(60, bytes), 600);
    }
}
