//! Reading Hugging Face checkpoints: `config.json` in every form the supported MoE families
//! use, and single-file or sharded safetensors in f32 / f16 / bf16.
//!
//! This crate knows nothing about tensors on a device: it hands out host `f32` data with a
//! shape, and every failure names the file, tensor or field at fault.

mod config;
mod error;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod mutate;
mod safetensors_io;

pub use config::{
    Activation, Gemma4Config, Gemma4LayerSpec, MAX_LAYERS, MixtralConfig, ModelConfig, Qwen2MoeConfig,
    RopeKind, RopeSpec,
};
pub use error::HfError;
pub use safetensors_io::{Checkpoint, DType, HostTensor};

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, HfError>;
