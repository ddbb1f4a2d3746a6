//! The fast decode path of the three served families (Mixtral, Qwen2-MoE, Gemma-4): one
//! decode step of a batch of sequences runs as a fixed handful of CubeCL launches per layer,
//! straight on the compute client (no Burn tensor ops, no host round trip inside a layer).
//!
//! - [`Decoder`] (`decoder.rs`) owns a model on the device, its paged KV cache and its
//!   experts' page table, and runs steps; [`DecoderBuilder`] (`builder.rs`) fixes its cache,
//!   budget and kernel choices and loads it from a checkpoint (`weights.rs`) or makes it
//!   with random weights (`synthetic.rs`).
//! - One file per family (`mixtral.rs`, `qwen2_moe.rs`, `gemma4.rs`) reads like its modeling
//!   file: embed → per layer the attention block and the feed-forward into the residual →
//!   final norm and head.
//! - `stages/` holds what those are made of: the attention block (fused QKV projection →
//!   RoPE + K/V append into the paged cache → paged attention → O projection), routing with
//!   the routed experts (router logits, on-device top-k that writes the grouped kernels'
//!   descriptors and gathers the normed rows → grouped bit-plane GEMVs for gate_up, with the
//!   activation in its epilogue, and down, or the grouped expert GEMM on the matrix units once
//!   the experts see several tokens each → weighted combine), the dense MLP, Gemma-4's
//!   epilogues, the final norm and LM head. No RMSNorm is a launch of its own: each is folded
//!   into the GEMMs or the gather that read its output.
//!
//! The host uploads the step's ids, positions and block tables once, and reads back the logits
//! (or, sampling greedily on the device, only the new ids) once. A step takes up to
//! [`Decoder::max_step_tokens`] tokens (sequences, or a prompt's tokens, each attending up to
//! its own position: [`Decoder::prefill`]). The experts' pages move through `pw_pages::device_mover` (on CUDA
//! asynchronous pinned copies: a step never waits for a raising).
//! The Burn-ops models in `pw-models` stay the reference the tests compare against.

mod builder;
mod config;
mod decoder;
mod experts;
mod gemma4;
mod mixtral;
mod paged;
mod qwen2_moe;
mod route_stats;
mod stages;
mod synthetic;
mod weights;

pub use builder::{DEFAULT_MAX_LOGIT_ROWS, DEFAULT_MAX_STEP_TOKENS, DecoderBuilder};
pub use config::{AttnLayer, DecodeConfig, Family};
pub use decoder::Decoder;
pub use experts::{ExpertBlocks, expert_weights, write_quantized_hf};
pub use paged::{ExpertCommit, ExpertMover, ExpertPage, PagedExperts, synthetic_block, synthetic_luts};
pub use route_stats::{RouteStats, RoutingCounts, route_stats_reference};
pub use stages::ExpertAct;

use pw_hf::Checkpoint;

fn read(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, DecodeError> {
    let t = ckpt.read_f32(name)?;
    if t.shape != shape {
        return Err(DecodeError::Shape { name: name.into(), expected: shape.to_vec(), got: t.shape });
    }
    Ok(t.data)
}

use weights::root;

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
