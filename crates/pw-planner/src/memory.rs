//! The memory target from KV-cache pressure (DESIGN.md §2, Memory target) and the give-back rule.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// What the planner is asked to do at a boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryTarget {
    /// Lower pages until at least this many bytes are freed (relative to the desired state).
    Free(u64),
    /// Raise pages, spending at most this many bytes.
    Spare(u64),
    /// Leave the desired bit-widths as they are.
    Hold,
}

/// The KV-pressure rule and its give-back counterpart.
///
/// - Pressure: when the free KV blocks `F` fall to the threshold `T` or below, the weights must
///   free `D = max(0, T + 1 − F) · B_KV` bytes.
/// - Give-back: only when `F > T + H` (`H` = `give_back_margin_blocks`) are
///   `(F − T − H) · B_KV` bytes offered back to the weights. After such a give-back `F ≥ T + H`,
///   so the cache must grow by `H` more blocks before the next lowering: with `H ≥ 1`, the rule
///   cannot lower and raise on consecutive boundaries without the cache actually moving, which
///   is the hysteresis that keeps pages from oscillating.
/// - In flight: bytes that pending lowerings will free count against `D` (they have been asked
///   for already) and bytes that pending raisings will still allocate count for it, so a
///   target is never requested twice while commits land.
///
/// Defaults: `threshold_blocks = 16` (a decode step allocates at most one block per running
/// sequence, so 16 covers a batch of 16 without a stall while the planner reacts one step
/// later); `give_back_margin_blocks = 16` (a band as wide as the reserve: memory goes back to the
/// weights only after the cache has shrunk by a whole reserve); `min_give_back_bytes = 0`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvPressureConfig {
    /// `T_blk`: free blocks at or below which weights are lowered.
    pub threshold_blocks: u64,
    /// `H`: extra free blocks above `T_blk` that must exist before memory is given back.
    pub give_back_margin_blocks: u64,
    /// `B_KV`: bytes of one KV block (all layers).
    pub bytes_per_block: u64,
    /// Smallest give-back worth planning (smaller spare is held).
    pub min_give_back_bytes: u64,
}

impl KvPressureConfig {
    /// The default rule for KV blocks of `bytes_per_block` bytes.
    pub fn new(bytes_per_block: u64) -> Self {
        Self { threshold_blocks: 16, give_back_margin_blocks: 16, bytes_per_block, min_give_back_bytes: 0 }
    }

    /// Checks the values' domains.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.bytes_per_block == 0 {
            return Err(PlanError::Config { field: "bytes_per_block", reason: "must be > 0".into() });
        }
        if self.give_back_margin_blocks == 0 {
            return Err(PlanError::Config {
                field: "give_back_margin_blocks",
                reason: "must be >= 1, or lowering and giving back can alternate".into(),
            });
        }
        Ok(())
    }

    /// The target at a boundary with `free_blocks` free KV blocks and `(pending_free,
    /// pending_alloc)` bytes in flight (see [`crate::Snapshot::pending_bytes`]). A caller that
    /// counts the blocks the next steps will take as taken passes a negative count when they
    /// exceed the free ones, so that the whole shortfall is freed at once.
    pub fn target(&self, free_blocks: i64, pending: (u64, u64)) -> MemoryTarget {
        let (pending_free, pending_alloc) = (pending.0 as i128, pending.1 as i128);
        let b = self.bytes_per_block as i128;
        let (t, f) = (self.threshold_blocks as i128, free_blocks as i128);
        let need = (t + 1 - f).max(0) * b;
        if need > 0 {
            let d = need + pending_alloc - pending_free;
            return if d > 0 { MemoryTarget::Free(d as u64) } else { MemoryTarget::Hold };
        }
        let over = f - t - self.give_back_margin_blocks as i128;
        if over > 0 {
            let spare = over * b + pending_free - pending_alloc;
            if spare > 0 && spare >= self.min_give_back_bytes as i128 {
                return MemoryTarget::Spare(spare as u64);
            }
        }
        MemoryTarget::Hold
    }
}

/// Bytes of one KV block: `block_tokens` tokens × K and V × every layer's KV heads × head dim.
pub fn kv_block_bytes(
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_tokens: usize,
    dtype_bytes: usize,
) -> u64 {
    (2 * layers * kv_heads * head_dim * block_tokens * dtype_bytes) as u64
}
