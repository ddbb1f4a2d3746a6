use std::path::Path;

use burn::tensor::{Int, Tensor, backend::Backend};
use pw_hf::{Activation, Checkpoint, HfError, ModelConfig};
use pw_nn::{Act, KvCache, LoadError, Routing, WeightSource};

use crate::{Gemma4, Mixtral, Qwen2Moe};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading config.json or the safetensors failed.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// A tensor is missing or mis-shaped.
    #[error("{dir}: {source}")]
    Load {
        /// The model directory.
        dir: String,
        /// The cause.
        source: LoadError,
    },
}

/// [`WeightSource`] over a Hugging Face checkpoint.
pub struct HfSource<'a, B: Backend> {
    ckpt: &'a Checkpoint,
    device: B::Device,
}

impl<'a, B: Backend> HfSource<'a, B> {
    /// Reads from `ckpt` onto `device`.
    pub fn new(ckpt: &'a Checkpoint, device: &B::Device) -> Self {
        Self { ckpt, device: device.clone() }
    }
}

impl<B: Backend> WeightSource<B> for HfSource<'_, B> {
    fn device(&self) -> B::Device {
        self.device.clone()
    }

    fn has(&self, name: &str) -> bool {
        self.ckpt.contains(name)
    }

    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        let (_, shape) = self.ckpt.info(name).map_err(|e| match e {
            HfError::MissingTensor { .. } => LoadError::Missing { name: name.to_string() },
            other => LoadError::Source(other.to_string()),
        })?;
        // Scalars saved as [1] and [] are the same thing.
        let numel: usize = shape.iter().product();
        if shape != expected && !(numel == 1 && expected.iter().product::<usize>() == 1) {
            return Err(LoadError::Shape {
                name: name.to_string(),
                expected: expected.to_vec(),
                got: shape.to_vec(),
            });
        }
        self.ckpt.read_f32(name).map(|t| t.data).map_err(|e| LoadError::Source(e.to_string()))
    }
}

pub(crate) fn act(a: Activation) -> Act {
    match a {
        Activation::Silu => Act::Silu,
        Activation::GeluTanh => Act::GeluTanh,
        Activation::Gelu => Act::Gelu,
    }
}

/// One KV cache per layer.
#[derive(Debug, Clone)]
pub struct ModelCache<B: Backend> {
    /// Per-layer caches.
    pub layers: Vec<KvCache<B>>,
}

impl<B: Backend> ModelCache<B> {
    /// Empty caches for `n` layers.
    pub fn new(n: usize) -> Self {
        Self { layers: (0..n).map(|_| KvCache::new()).collect() }
    }

    /// Tokens already processed.
    pub fn seen(&self) -> usize {
        self.layers.first().map_or(0, KvCache::seen)
    }
}

/// Intermediate values recorded by a forward pass, for comparison with transformers.
#[derive(Debug, Clone)]
pub struct Trace<B: Backend> {
    /// Embedding output, then the output of every layer: `[batch, seq, hidden]` each.
    pub hidden: Vec<Tensor<B, 3>>,
    /// Per layer: its routing, if it is an MoE layer.
    pub routing: Vec<Option<Routing<B>>>,
}

impl<B: Backend> Default for Trace<B> {
    fn default() -> Self {
        Self { hidden: Vec::new(), routing: Vec::new() }
    }
}

impl<B: Backend> Trace<B> {
    pub(crate) fn record(
        trace: &mut Option<&mut Trace<B>>,
        h: &Tensor<B, 3>,
        r: Option<Routing<B>>,
        is_embedding: bool,
    ) {
        if let Some(t) = trace.as_deref_mut() {
            t.hidden.push(h.clone());
            if !is_embedding {
                t.routing.push(r);
            }
        }
    }
}

/// A decoder-only language model with a KV cache.
pub trait CausalLm<B: Backend> {
    /// Runs the new tokens `ids` after what `cache` holds and returns their logits.
    ///
    /// # Shapes
    /// - `ids`: `[batch, seq]`
    /// - output: `[batch, seq, vocab]`
    fn forward(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: &mut ModelCache<B>,
        trace: Option<&mut Trace<B>>,
    ) -> Tensor<B, 3>;

    /// An empty cache for this model.
    fn new_cache(&self) -> ModelCache<B>;

    /// Vocabulary size.
    fn vocab_size(&self) -> usize;
}

/// Any supported model, chosen by config.json.
#[derive(Debug)]
pub enum AnyModel<B: Backend> {
    /// Mixtral.
    Mixtral(Mixtral<B>),
    /// Qwen1.5-MoE.
    Qwen2Moe(Qwen2Moe<B>),
    /// Gemma-4 text MoE.
    Gemma4(Gemma4<B>),
}

impl<B: Backend> AnyModel<B> {
    /// Loads `dir/config.json` and its safetensors onto `device`.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(&config, &ckpt, device)
    }

    /// Builds the model of `config` from an opened checkpoint.
    pub fn from_checkpoint(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let src = HfSource::<B>::new(ckpt, device);
        let wrap = |source| ModelError::Load { dir: ckpt.dir().display().to_string(), source };
        Ok(match config {
            ModelConfig::Mixtral(c) => Self::Mixtral(Mixtral::load(c, &src).map_err(wrap)?),
            ModelConfig::Qwen2Moe(c) => Self::Qwen2Moe(Qwen2Moe::load(c, &src).map_err(wrap)?),
            ModelConfig::Gemma4(c) => Self::Gemma4(Gemma4::load(c, &src).map_err(wrap)?),
        })
    }
}

impl<B: Backend> CausalLm<B> for AnyModel<B> {
    fn forward(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: &mut ModelCache<B>,
        trace: Option<&mut Trace<B>>,
    ) -> Tensor<B, 3> {
        match self {
            Self::Mixtral(m) => m.forward(ids, cache, trace),
            Self::Qwen2Moe(m) => m.forward(ids, cache, trace),
            Self::Gemma4(m) => m.forward(ids, cache, trace),
        }
    }

    fn new_cache(&self) -> ModelCache<B> {
        match self {
            Self::Mixtral(m) => m.new_cache(),
            Self::Qwen2Moe(m) => m.new_cache(),
            Self::Gemma4(m) => m.new_cache(),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            Self::Mixtral(m) => m.vocab_size(),
            Self::Qwen2Moe(m) => m.vocab_size(),
            Self::Gemma4(m) => m.vocab_size(),
        }
    }
}
