//! Transformer layers shared by the MoE model families, generic over the Burn backend.
//!
//! Every layer is built from a [`WeightSource`] (a checkpoint, or [`RandomInit`] for tests):
//! one code path creates and loads it, with shapes checked against its config.

pub mod attention;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod source;

pub use attention::{Attention, AttentionConfig, KvCache};
pub use linear::{Embedding, Linear};
pub use mlp::{Act, GatedMlp, GatedMlpConfig};
pub use moe::{
    DenseExperts, ExpertBank, ExpertKeys, ExpertLayout, ExpertRows, Experts, ExternalExperts, Router,
    RouterConfig, Routing, SharedExpert, SparseMoe,
};
pub use norm::{NormKind, RmsNorm};
pub use rope::Rope;
pub use source::{LoadError, RandomInit, WeightSource};
