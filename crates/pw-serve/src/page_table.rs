//! What `GET /v1/page-table` and the dashboard show: every expert page's bits, where it is and
//! what the planner thinks of it, the memory split and the planner's last decision.

use serde::Serialize;

/// Where a page's committed bits live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PageLocation {
    /// Resident on the device at its committed bits, nothing moving.
    Gpu,
    /// Resident, and a raising's copy towards `desired_bits` is in flight.
    InTransfer,
    /// Not resident (committed 0 bits).
    Host,
}

/// One expert page (layer, expert, gate_up | down).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PageView {
    /// Decoder layer.
    pub layer: usize,
    /// Expert.
    pub expert: usize,
    /// `gate_up` or `down`.
    pub kind: &'static str,
    /// Bits the planner asked for.
    pub desired_bits: u8,
    /// Bits the kernels read.
    pub committed_bits: u8,
    /// Resident, moving, or not resident.
    pub location: PageLocation,
    /// Device bytes at the committed bits (planes + LUT).
    pub bytes: u64,
    /// The expert's share of its layer's routing-weight mass (planner only).
    pub routing_share: Option<f64>,
    /// Its share on the calibration text, which the routing multiplier compares with (planner
    /// on a checkpoint that recorded it).
    pub calibration_share: Option<f64>,
    /// The planner's estimated damage of the page at its desired bits (planner only).
    pub damage: Option<f64>,
}

/// A plan that changed desired bits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlannerDecision {
    /// The model's boundary count when it was made.
    pub boundary: u64,
    /// `free` (lower pages for the KV cache) or `spare` (raise pages with memory given back).
    pub target: &'static str,
    /// Bytes to free or to spend.
    pub target_bytes: u64,
    /// Pages whose desired bits changed.
    pub pages_changed: usize,
    /// Desired expert bytes before and after the plan.
    pub bytes_before: u64,
    /// Desired expert bytes after the plan.
    pub bytes_after: u64,
    /// Whether the plan freed what was asked (false: pages are at their floors).
    pub met: bool,
}

/// The model's side of the page table: pages, the budget split and the last decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PageTableView {
    /// `planner` or `pinned`.
    pub policy: &'static str,
    /// The model's boundary count when the view was taken.
    pub boundary: u64,
    /// Decoder layers.
    pub layers: usize,
    /// Experts per sparse layer.
    pub experts: usize,
    /// Bytes for experts + KV.
    pub budget_bytes: u64,
    /// Committed expert bytes.
    pub expert_bytes: u64,
    /// Bytes of one KV block.
    pub block_bytes: u64,
    /// KV blocks the live sequences hold.
    pub kv_blocks_used: u64,
    /// KV blocks the budget still has room for.
    pub kv_blocks_free: u64,
    /// Committed bits averaged over expert bytes.
    pub mean_bits: f64,
    /// The last plan that changed desired bits, if any.
    pub last_decision: Option<PlannerDecision>,
    /// Every page, sparse layer by sparse layer, expert by expert, gate_up before down.
    pub pages: Vec<PageView>,
}

/// One point of the memory time line (taken at step boundaries, at most one per
/// [`HISTORY_EVERY`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HistorySample {
    /// Seconds since the engine started.
    pub t_s: f64,
    /// Committed bits averaged over expert bytes.
    pub mean_bits: f64,
    /// Committed expert bytes.
    pub expert_bytes: u64,
    /// KV bytes the live sequences hold.
    pub kv_bytes: u64,
    /// Bytes for experts + KV.
    pub budget_bytes: u64,
    /// Requests waiting (queued or preempted).
    pub queue: u64,
    /// Sequences running.
    pub active: u64,
}

/// Spacing of the time line's samples.
pub const HISTORY_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Samples the time line keeps (ten minutes at one per second).
pub const HISTORY_LEN: usize = 600;
