//! Mixtral, Qwen1.5-MoE (`qwen2_moe`) and Gemma-4 MoE (`gemma4` text) as Burn modules,
//! generic over the backend and loaded from Hugging Face checkpoint directories.
//!
//! Each model file reads top to bottom like its transformers modeling file; the layers
//! live in `pw-nn`, checkpoint parsing in `pw-hf`.

mod common;
pub mod eval;
pub mod gemma4;
pub mod generate;
pub mod mixtral;
pub mod quantized;
pub mod qwen2_moe;
pub mod stream;

pub use common::{
    AnyModel, CausalLm, ExpertBank, HfSource, LoadedModel, ModelCache, ModelError, MoeTap, PagedOptions,
    Trace, is_quantized_dir, layer_of,
};
pub use gemma4::Gemma4;
pub use generate::{Sampler, SamplingConfig, generate};
pub use mixtral::Mixtral;
pub use quantized::{PwSource, expert_block_name};
pub use qwen2_moe::Qwen2Moe;
pub use stream::{LayerStream, StreamLayer};
