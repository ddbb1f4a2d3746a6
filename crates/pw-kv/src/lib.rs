//! The paged KV cache (as in PagedAttention): tokens live in fixed-size blocks drawn from one
//! pool, each sequence keeps a block table, and a finished or cancelled sequence returns its
//! blocks at once. One block id addresses the same slots in every layer's K and V pools, so a
//! sequence needs one table whatever the layers' head counts and widths (Gemma-4's full layers
//! have their own head dim; its sliding layers keep their old blocks, which is simple and costs
//! at most the window's share of memory).
//!
//! [`BlockTables`] is the host bookkeeping (pure, no device); [`DevicePools`] holds the per-layer
//! K/V pools on a CubeCL device and runs one decode step's append + attention through
//! `kernels-cubecl`. The byte figure the planner needs is [`KvGeometry::block_bytes`] (B_KV).

mod device;
mod tables;

pub use device::{DevicePools, StepArrays};
pub use tables::{BlockTables, SeqId};

/// Why a cache operation failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    /// Not enough free blocks for the request.
    #[error("KV cache full: sequence {seq} needs {needed} more block(s), {free} free")]
    OutOfBlocks {
        /// The sequence.
        seq: SeqId,
        /// Blocks the request needs.
        needed: usize,
        /// Blocks free now.
        free: usize,
    },
    /// The sequence would outgrow its block table.
    #[error("sequence {seq}: {tokens} tokens exceed the table's {max} tokens")]
    TooLong {
        /// The sequence.
        seq: SeqId,
        /// Tokens requested.
        tokens: usize,
        /// Tokens a table can address.
        max: usize,
    },
    /// The sequence is unknown (never added, or already freed).
    #[error("unknown sequence {0}")]
    UnknownSeq(SeqId),
    /// The sequence already exists.
    #[error("sequence {0} already exists")]
    DuplicateSeq(SeqId),
    /// The capacity cannot shrink below the blocks in use.
    #[error("cannot shrink to {want} blocks: {used} in use")]
    InUse {
        /// Blocks asked for.
        want: usize,
        /// Blocks in use.
        used: usize,
    },
    /// A kernel launch or device read failed.
    #[error("device: {0}")]
    Device(String),
}

/// One layer's cache geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerGeometry {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding window (0 = full attention).
    pub window: usize,
}

/// The cache geometry of a whole model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGeometry {
    /// Per layer.
    pub layers: Vec<LayerGeometry>,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes per cached element (2 for f16).
    pub elem_bytes: usize,
    /// Longest sequence, in tokens (sets the block table width).
    pub max_seq_len: usize,
}

impl KvGeometry {
    /// Bytes one block takes across all layers, K and V: the planner's B_KV.
    pub fn block_bytes(&self) -> usize {
        self.layers.iter().map(|l| 2 * self.block_size * l.n_kv_heads * l.head_dim * self.elem_bytes).sum()
    }

    /// Block table width: blocks one sequence may hold.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_seq_len.div_ceil(self.block_size)
    }

    /// Blocks that fit in `bytes`.
    pub fn blocks_in(&self, bytes: usize) -> usize {
        bytes / self.block_bytes().max(1)
    }

    /// The kernel shape of layer `i`.
    pub fn attn_shape(&self, i: usize) -> kernels_cubecl::PagedAttnShape {
        let l = self.layers[i];
        kernels_cubecl::PagedAttnShape {
            n_heads: l.n_heads,
            n_kv_heads: l.n_kv_heads,
            head_dim: l.head_dim,
            block_size: self.block_size,
            max_blocks: self.max_blocks_per_seq(),
            window: l.window,
        }
    }
}
