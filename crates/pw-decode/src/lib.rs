//! The fast decode path of the three families (Mixtral, Qwen2-MoE, Gemma-4; one [`Decoder`]
//! with per-family branches): one decode step of a batch of sequences runs as a fixed handful
//! of CubeCL launches per layer, straight on the compute client (no Burn tensor ops, no host
//! round trip inside a layer). No RMSNorm is a launch of its own: each is folded into the
//! GEMMs or the gather that read its output (a per-token scale after the row reduction). The
//! Mixtral wiring, 8 launches per layer at one token per routed expert (9 above):
//!
//! 1. fused QKV projection of norm(h) (one f16 GEMM) → RoPE on Q and K + K/V append into the
//!    paged cache → paged decode attention;
//! 2. O projection added into the residual;
//! 3. one routing launch: router logits of norm(h) computed in every cube (a router of at most
//!    64k weights, `kernels_cubecl::router_fusable`: Mixtral's 8 × 4096; a larger one,
//!    e.g. Gemma-4's 128 × 2816, keeps its own GEMM, one more launch), on-device softmax/top-k
//!    that writes the grouped kernel's descriptors (and the planner's routing counts when
//!    armed), and the gather of the normed rows →
//!    grouped bit-plane GEMV for gate_up with the experts' SiLU(gate)·up in its epilogue (warp
//!    units of gate rows and their up rows; at two tokens per expert those took 100 registers
//!    per thread, so there the activation is a launch of its own, see [`ExpertAct`]) → grouped
//!    GEMV for down → weighted combine into the residual.
//!
//! Qwen2-MoE (10 per sparse layer, 6 per dense one) adds the q/k/v biases to the projection,
//! and its gated shared expert (or a dense layer's MLP) as gate|up GEMM (the router's rows in
//! the same GEMM: both read the same norm) → down GEMM reading act(gate)·up × sigmoid gate into
//! the residual. Gemma-4 (12: its router GEMM of its own) adds per-head Q/K/V norms (K = V
//! on full layers) in the RoPE + append launch, its sandwich norm on the attention output, a dense
//! GeGLU branch beside the experts, and one epilogue kernel (routing weights × per-expert
//! scale, combine, three norms, residual, layer scalar).
//!
//! The host uploads the step's ids, positions and block tables once, and reads back the logits
//! (or, sampling greedily on the device, only the new ids) once. A new sequence's prompt goes
//! through the same kernels 16 tokens per step, each attending up to its own position
//! ([`Decoder::prefill`]). The experts' pages move through `pw_pages::device_mover` (on CUDA
//! asynchronous pinned copies: a step never waits for a raising).
//! The Burn-ops models in `pw-models` stay the reference the tests compare against.

mod config;
mod decoder;
mod experts;
mod paged;
mod route_stats;

pub use config::{AttnLayer, DecodeConfig, Family};
pub use decoder::{Decoder, ExpertAct, MixtralDecoder};
pub use experts::{ExpertBlocks, expert_weights};
pub use paged::{ExpertCommit, ExpertMover, ExpertPage, PagedExperts, synthetic_block, synthetic_luts};
pub use route_stats::{RouteStats, RoutingCounts, route_stats_reference};

use pw_hf::Checkpoint;

fn read(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, DecodeError> {
    let t = ckpt.read_f32(name)?;
    if t.shape != shape {
        return Err(DecodeError::Shape { name: name.into(), expected: shape.to_vec(), got: t.shape });
    }
    Ok(t.data)
}

use decoder::root;

/// Why loading or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Reading the checkpoint or its config failed.
    #[error(transparent)]
    Hf(#[from] pw_hf::HfError),
    /// The model family or a setting is not supported by this path.
    #[error("{0}")]
    Unsupported(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Stored shape.
        got: Vec<usize>,
    },
    /// Quantizing an expert failed.
    #[error(transparent)]
    Format(#[from] pw_format::FormatError),
    /// The KV cache refused.
    #[error(transparent)]
    Kv(#[from] pw_kv::KvError),
    /// The weight page table refused.
    #[error(transparent)]
    Pages(#[from] pw_pages::PageError),
    /// A kernel launch failed.
    #[error(transparent)]
    Kernel(#[from] kernels_cubecl::KernelError),
}
