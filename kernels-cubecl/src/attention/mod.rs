//! Paged KV cache kernels: append one token's K/V per row into its cache block, attend one
//! query token per sequence over its blocks (decoding), or a prompt chunk's query tokens
//! together over their sequence's blocks ([`prefill`]).
//!
//! Pool layout (one K and one V pool per layer): `[slots, kv_heads · head_dim]` with
//! `slot = block · block_size + offset`, in the cache element type `KV` (f16 on the GPU). A
//! sequence's block table lists its blocks in token order, so token `t` lives in slot
//! `table[t / block_size] · block_size + t % block_size`.
//!
//! Attention mapping (split-context, "flash decoding"): a cube serves `hg` query heads that
//! share one KV head (GQA: K/V rows are read once for the group) over one chunk of the
//! context; its planes (warps) take interleaved runs of `unroll` tokens, lane `l` owning the
//! head dimensions `l, l + P, …` (`P` = plane size) so every K/V row is read coalesced. Each
//! plane keeps an online softmax (running max, sum, rescaled accumulator) per head; the planes
//! merge theirs through shared memory. With one chunk per sequence the cube writes the output;
//! otherwise it writes its unnormalised partial `(acc, m, l)` and [`paged_decode_combine_kernel`]
//! merges the chunks. Why: one plane walking 4096 tokens one at a time is latency-bound (a
//! dependent load, a plane reduction and two `exp` per token) and fills 32 of 132 SMs.

pub mod append;
pub mod decode;
pub mod prefill;
pub mod prefill_mma;
#[cfg(test)]
mod tests;

use crate::KernelError;

/// Geometry of one layer's paged KV cache and of its decode attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagedAttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: `n_heads` is a multiple).
    pub n_kv_heads: usize,
    /// Head dimension; a multiple of the plane size.
    pub head_dim: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Width of the block table: blocks a sequence may hold.
    pub max_blocks: usize,
    /// Sliding window (each query sees the last `window` tokens, itself included); 0 = none.
    pub window: usize,
}

impl PagedAttnShape {
    /// Elements of one cached token (one slot) in a K or V pool.
    pub fn slot_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn check(&self, plane_size: usize) -> Result<(), KernelError> {
        let bad = |reason: String| Err(KernelError::BadItem { item: 0, reason });
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(plane_size) {
            return bad(format!(
                "head_dim {} is not a multiple of the plane size {plane_size}",
                self.head_dim
            ));
        }
        if self.block_size == 0 || self.max_blocks == 0 {
            return bad("block_size and max_blocks must be positive".into());
        }
        Ok(())
    }
}

/// Where K and V sit in the rows of their source: row `s` at `s · stride`, K at `k_off`, V at
/// `v_off` (a fused QKV projection's output is one buffer with all three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    /// Elements per source row.
    pub stride: usize,
    /// Offset of K in a row.
    pub k_off: usize,
    /// Offset of V in a row.
    pub v_off: usize,
}
