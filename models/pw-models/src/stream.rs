//! A model run one decoder layer at a time, for passes over models larger than memory.
//!
//! [`LayerStream`] reads each layer from the checkpoint when a pass reaches it; the caller runs
//! all its sequences through that layer, keeps the hidden states and drops the layer before
//! asking for the next. A pass then holds the hidden states, one layer and, for a moment, the
//! embedding table — the layer-streamed calibration of `pw-calib` runs on this.

use std::cell::RefCell;

use burn::tensor::{Int, Tensor, backend::Backend};
use pw_hf::{Checkpoint, ModelConfig};
use pw_nn::KvCache;

use crate::common::{ExpertBank, HfSource, ModelError, MoeTap, Recording};
use crate::gemma4::Gemma4DecoderLayer;
use crate::mixtral::MixtralDecoderLayer;
use crate::qwen2_moe::Qwen2MoeDecoderLayer;
use crate::{Gemma4, Mixtral, Qwen2Moe};

/// One decoder layer of any supported family.
// One at a time, built once per layer: boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum StreamLayer<B: Backend> {
    /// A Mixtral layer.
    Mixtral(MixtralDecoderLayer<B>),
    /// A Qwen1.5-MoE layer (sparse or dense).
    Qwen2Moe(Qwen2MoeDecoderLayer<B>),
    /// A Gemma-4 layer.
    Gemma4(Gemma4DecoderLayer<B>),
}

impl<B: Backend> StreamLayer<B> {
    /// Runs the positions after what `kv` holds through the layer; also returns what its
    /// expert bank read (`None` for a layer without one).
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]`
    /// - output: `[batch, seq, hidden]`, the tap's input `[batch · seq, hidden]`
    pub fn forward(&self, h: Tensor<B, 3>, kv: &mut KvCache<B>) -> (Tensor<B, 3>, Option<MoeTap<B>>) {
        match self {
            Self::Mixtral(l) => l.forward(h, kv),
            Self::Qwen2Moe(l) => l.forward(h, kv),
            Self::Gemma4(l) => l.forward(h, kv),
        }
    }
}

/// A Hugging Face checkpoint read one layer at a time.
pub struct LayerStream<'c, B: Backend> {
    config: ModelConfig,
    src: HfSource<'c, B>,
    dir: String,
}

impl<'c, B: Backend> LayerStream<'c, B> {
    /// Streams the model of `config` from `ckpt` onto `device`.
    pub fn new(config: ModelConfig, ckpt: &'c Checkpoint, device: &B::Device) -> Self {
        Self { config, src: HfSource::new(ckpt, device), dir: ckpt.dir().display().to_string() }
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        match &self.config {
            ModelConfig::Mixtral(c) => c.num_hidden_layers,
            ModelConfig::Qwen2Moe(c) => c.num_hidden_layers,
            ModelConfig::Gemma4(c) => c.layers.len(),
        }
    }

    /// The model's first hidden state of each batch of `ids` (the embedding table is read once
    /// for the call and dropped after it).
    ///
    /// # Shapes
    /// - `ids`: per batch `[batch, seq]`
    /// - output: per batch `[batch, seq, hidden]`
    pub fn embed(&self, ids: Vec<Tensor<B, 2, Int>>) -> Result<Vec<Tensor<B, 3>>, ModelError> {
        let src = &self.src;
        let wrap = |source| ModelError::Load { dir: self.dir.clone(), source };
        let (table, scale) = match &self.config {
            ModelConfig::Mixtral(c) => (Mixtral::load_embedding(c, src).map_err(wrap)?, None),
            ModelConfig::Qwen2Moe(c) => (Qwen2Moe::load_embedding(c, src).map_err(wrap)?, None),
            ModelConfig::Gemma4(c) => {
                let (table, scale) = Gemma4::load_embedding(c, src).map_err(wrap)?;
                (table, Some(scale))
            }
        };
        Ok(ids
            .into_iter()
            .map(|ids| {
                let h = table.forward(ids);
                match scale {
                    Some(s) => h * s,
                    None => h,
                }
            })
            .collect())
    }

    /// Reads decoder layer `i`, with its expert bank when it has one (the bank shares the
    /// layer's parameters).
    pub fn layer(&self, i: usize) -> Result<(StreamLayer<B>, Option<ExpertBank<B>>), ModelError> {
        let rec = Recording { inner: &self.src, banks: RefCell::new(Vec::new()) };
        let layer = match &self.config {
            ModelConfig::Mixtral(c) => MixtralDecoderLayer::load(c, &rec, i).map(StreamLayer::Mixtral),
            ModelConfig::Qwen2Moe(c) => Qwen2MoeDecoderLayer::load(c, &rec, i).map(StreamLayer::Qwen2Moe),
            ModelConfig::Gemma4(c) => Gemma4DecoderLayer::load(c, &rec, i).map(StreamLayer::Gemma4),
        }
        .map_err(|source| ModelError::Load { dir: self.dir.clone(), source })?;
        Ok((layer, rec.banks.into_inner().pop()))
    }
}
