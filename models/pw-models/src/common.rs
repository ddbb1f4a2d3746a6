use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use burn::tensor::{Int, Tensor, backend::Backend};
use pw_format::{FormatError, MANIFEST_FILE};
use pw_hf::{Activation, Checkpoint, HfError, ModelConfig};
use pw_nn::{
    Act, ExpertKeys, ExpertLayout, Experts, GatedMlpConfig, KvCache, LoadError, Routing, WeightSource,
};

use crate::quantized::PwSource;
use crate::{Gemma4, Mixtral, Qwen2Moe};
use pw_linear::{Accountant, CommitReport, PageTable};

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
    /// The quantized checkpoint (`pagedweight.json` and its shards) is invalid.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The page table of the paged experts could not be built or settled.
    #[error("{dir}: paged experts: {reason}")]
    Pages {
        /// The model directory.
        dir: String,
        /// The cause.
        reason: String,
    },
    /// The expert weights do not fit the weight budget at any stored uniform bit-width.
    #[error(
        "{dir}: the expert weights need {needed} bytes at {bits} bits ({needed_gb:.3} GB), over the weight budget of {budget} bytes ({budget_gb:.3} GB)"
    )]
    Budget {
        /// The model directory.
        dir: String,
        /// The bit-width tried (the lowest stored, or the one asked for).
        bits: u8,
        /// Bytes of planes + LUTs at `bits`.
        needed: u64,
        /// `needed` in GB (10^9 bytes).
        needed_gb: f64,
        /// The budget in bytes.
        budget: u64,
        /// `budget` in GB.
        budget_gb: f64,
    },
    /// The requested bit-width is not stored by the checkpoint.
    #[error("{dir}: bit-width {bits} requested, but the checkpoint stores {range}")]
    Bits {
        /// The model directory.
        dir: String,
        /// The requested bit-width.
        bits: u8,
        /// What is stored.
        range: String,
    },
    /// A per-block allocation does not match the checkpoint's blocks.
    #[error("{dir}: {reason}")]
    Allocation {
        /// The model directory.
        dir: String,
        /// What is wrong.
        reason: String,
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

/// One MoE layer's expert bank, as the model loader built it.
#[derive(Debug, Clone)]
pub struct ExpertBank<B: Backend> {
    /// Decoder layer index.
    pub layer: usize,
    /// Where the bank's weights live in the source checkpoint.
    pub layout: ExpertLayout,
    /// Routed experts.
    pub num_experts: usize,
    /// Shape and activation of each expert.
    pub cfg: GatedMlpConfig,
    /// The bank itself: shares its parameters (and, under autodiff, their gradients) with the
    /// model's.
    pub experts: Experts<B>,
}

/// The decoder layer named in a tensor name or prefix such as `model.layers.3.mlp.experts`.
pub fn layer_of(prefix: &str) -> Option<usize> {
    let mut parts = prefix.split('.');
    while let Some(p) = parts.next() {
        if p == "layers" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

/// Wraps a source and records every expert bank built through it, in load order.
pub(crate) struct Recording<'s, B: Backend, S> {
    pub(crate) inner: &'s S,
    pub(crate) banks: RefCell<Vec<ExpertBank<B>>>,
}

impl<B: Backend, S: WeightSource<B>> WeightSource<B> for Recording<'_, B, S> {
    fn device(&self) -> B::Device {
        self.inner.device()
    }

    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }

    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.inner.read(name, expected)
    }

    fn experts(
        &self,
        keys: &ExpertKeys,
        num_experts: usize,
        cfg: GatedMlpConfig,
    ) -> Result<Experts<B>, LoadError> {
        let layout = keys.resolve(self.inner)?;
        let layer = layer_of(layout.prefix()).ok_or_else(|| {
            LoadError::Source(format!("expert bank `{}`: no `layers.N` in its name", layout.prefix()))
        })?;
        let experts = self.inner.experts(keys, num_experts, cfg)?;
        self.banks.borrow_mut().push(ExpertBank {
            layer,
            layout,
            num_experts,
            cfg,
            experts: experts.clone(),
        });
        Ok(experts)
    }
}

/// True when `dir` holds a quantized PagedWeight checkpoint (`pagedweight.json`).
pub fn is_quantized_dir(dir: impl AsRef<Path>) -> bool {
    dir.as_ref().join(MANIFEST_FILE).is_file()
}

/// A model loaded from a Hugging Face or a quantized checkpoint directory, with what the
/// loader learned about its experts.
#[derive(Debug)]
pub struct LoadedModel<B: Backend> {
    /// The model.
    pub model: AnyModel<B>,
    /// Its parsed `config.json`.
    pub config: ModelConfig,
    /// Every MoE layer's expert bank, in layer order.
    pub banks: Vec<ExpertBank<B>>,
    /// Bytes the expert weights occupy as stored: for a Hugging Face checkpoint the expert
    /// tensors' bytes (parameters × element size); for a quantized one the planes and LUTs
    /// of every block at [`Self::bits`].
    pub expert_bytes: u64,
    /// Bit-width the experts were dequantized at, or the uniform width the paged experts were
    /// committed at (`None` for a Hugging Face checkpoint and for a mixed allocation,
    /// [`LoadedModel::load_mixed`]).
    pub bits: Option<u8>,
    /// The page table of paged experts ([`Self::load_paged`]): the boundary API of a decode
    /// loop (desired bits, [`PageTable::boundary`] between steps, memory usage).
    pub pages: Option<PageTable>,
}

/// How [`LoadedModel::load_paged`] sizes and fills the page table.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PagedOptions {
    /// Uniform bit-width to commit (default: the highest that fits the budget, or the highest
    /// stored without one).
    pub bits: Option<u8>,
    /// The accountant's byte budget for weights (and, later, the KV cache); `None`: exactly
    /// what the experts need at the chosen bits.
    pub weight_budget: Option<u64>,
}

impl<B: Backend> LoadedModel<B> {
    /// Loads `dir`: a quantized checkpoint when it holds `pagedweight.json` (experts at `bits`,
    /// default the highest stored), else a Hugging Face checkpoint (`bits` must be `None`).
    pub fn load(dir: impl AsRef<Path>, bits: Option<u8>, device: &B::Device) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_dir(dir)?;
        let wrap = |source| ModelError::Load { dir: dir.display().to_string(), source };
        if is_quantized_dir(dir) {
            let ckpt = pw_format::Checkpoint::open(dir)?;
            let Some((lo, hi)) = ckpt.manifest().bit_range() else {
                return Err(ModelError::Format(FormatError::Manifest {
                    path: dir.join(MANIFEST_FILE),
                    reason: "no expert blocks".into(),
                }));
            };
            let bits = bits.unwrap_or(hi);
            if !(lo..=hi).contains(&bits) {
                let range = format!("bits {lo}..={hi}");
                return Err(ModelError::Bits { dir: dir.display().to_string(), bits, range });
            }
            let src = PwSource::<B>::new(&ckpt, bits, device);
            let (model, banks) = Self::build(&config, &src).map_err(wrap)?;
            let expert_bytes =
                ckpt.manifest().blocks.iter().map(|b| b.bytes_at(bits)).map(|(p, l)| (p + l) as u64).sum();
            Ok(Self { model, config, banks, expert_bytes, bits: Some(bits), pages: None })
        } else {
            if let Some(b) = bits {
                return Err(ModelError::Bits {
                    dir: dir.display().to_string(),
                    bits: b,
                    range: format!("unquantized weights (no {MANIFEST_FILE})"),
                });
            }
            let ckpt = Checkpoint::open(dir)?;
            let src = HfSource::<B>::new(&ckpt, device);
            let (model, banks) = Self::build(&config, &src).map_err(wrap)?;
            let mut expert_bytes = 0u64;
            for bank in &banks {
                for name in bank.layout.tensor_names(bank.num_experts) {
                    expert_bytes += ckpt.raw(&name)?.2.len() as u64;
                }
            }
            Ok(Self { model, config, banks, expert_bytes, bits: None, pages: None })
        }
    }

    /// Loads the quantized checkpoint in `dir` with every expert block at its own bit-width:
    /// `block_bits` maps each block name of the manifest to its bits (a block left out is an
    /// error, so an allocation cannot silently miss a block). `expert_bytes` is the planes and
    /// LUTs of every block at its bit-width.
    pub fn load_mixed(
        dir: impl AsRef<Path>,
        block_bits: &HashMap<String, u8>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = pw_format::Checkpoint::open(dir)?;
        let mut expert_bytes = 0u64;
        for b in &ckpt.manifest().blocks {
            let Some(&bits) = block_bits.get(&b.name) else {
                return Err(ModelError::Allocation {
                    dir: dir.display().to_string(),
                    reason: format!("no bit-width given for block `{}`", b.name),
                });
            };
            if !(b.min_bits..=b.max_bits).contains(&bits) {
                let range = format!("bits {}..={} for block `{}`", b.min_bits, b.max_bits, b.name);
                return Err(ModelError::Bits { dir: dir.display().to_string(), bits, range });
            }
            let (planes, lut) = b.bytes_at(bits);
            expert_bytes += (planes + lut) as u64;
        }
        let Some((_, hi)) = ckpt.manifest().bit_range() else {
            return Err(ModelError::Format(FormatError::Manifest {
                path: dir.join(MANIFEST_FILE),
                reason: "no expert blocks".into(),
            }));
        };
        let src = PwSource::<B>::new(&ckpt, hi, device).with_block_bits(block_bits.clone());
        let (model, banks) = Self::build(&config, &src)
            .map_err(|source| ModelError::Load { dir: dir.display().to_string(), source })?;
        Ok(Self { model, config, banks, expert_bytes, bits: None, pages: None })
    }

    /// Loads a quantized checkpoint with its experts paged: every expert block a page of one
    /// [`PageTable`] on `device` (planes + LUTs of the committed bits on the device, the 8-bit
    /// parents on the host), the banks [`PagedExperts`](pw_linear::PagedExperts) running the
    /// grouped kernel on CubeCL backends and the CPU reference elsewhere. With a budget the
    /// bits are the highest uniform width whose bytes fit it (or an error naming the numbers).
    pub fn load_paged(
        dir: impl AsRef<Path>,
        opts: PagedOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let dir_s = dir.display().to_string();
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = pw_format::Checkpoint::open(dir)?;
        let Some((lo, hi)) = ckpt.manifest().bit_range() else {
            return Err(ModelError::Format(FormatError::Manifest {
                path: dir.join(MANIFEST_FILE),
                reason: "no expert blocks".into(),
            }));
        };
        if let Some(b) = opts.bits.filter(|b| !(lo..=hi).contains(b)) {
            return Err(ModelError::Bits { dir: dir_s, bits: b, range: format!("bits {lo}..={hi}") });
        }
        let bytes_at = |b: u8| -> u64 {
            ckpt.manifest().blocks.iter().map(|e| e.bytes_at(b)).map(|(p, l)| (p + l) as u64).sum()
        };
        let top = opts.bits.unwrap_or(hi);
        let bits = match opts.weight_budget {
            None => top,
            Some(budget) => (lo..=top).rev().find(|&b| bytes_at(b) <= budget).ok_or_else(|| {
                let b = opts.bits.unwrap_or(lo);
                let needed = bytes_at(b);
                ModelError::Budget {
                    dir: dir_s.clone(),
                    bits: b,
                    needed,
                    needed_gb: needed as f64 / 1e9,
                    budget,
                    budget_gb: budget as f64 / 1e9,
                }
            })?,
        };
        if let (Some(asked), true) = (opts.bits, opts.weight_budget.is_some()) {
            // The budget fits a lower width only: say so rather than silently lowering.
            if bits != asked {
                let needed = bytes_at(asked);
                let budget = opts.weight_budget.unwrap_or(0);
                return Err(ModelError::Budget {
                    dir: dir_s,
                    bits: asked,
                    needed,
                    needed_gb: needed as f64 / 1e9,
                    budget,
                    budget_gb: budget as f64 / 1e9,
                });
            }
        }
        let (planes, luts, lut_slack) = pw_pages_arena(&ckpt, bits);
        // Without a budget: the bytes at `bits` plus the LUT headroom a raising needs (its new
        // LUT is held beside the committed one until it commits), so pages lowered through the
        // boundary API can be raised back.
        let budget = opts.weight_budget.unwrap_or_else(|| bytes_at(bits) + 2 * lut_slack as u64);
        let pages_err =
            |e: &dyn std::fmt::Display| ModelError::Pages { dir: dir_s.clone(), reason: e.to_string() };
        let table = PageTable::from_checkpoint(&ckpt, Accountant::new(budget), (planes, luts), device)
            .map_err(|e| pages_err(&e))?;
        table.set_desired_all(bits);
        table.settle().map_err(|e| pages_err(&e))?;
        let src = PwSource::<B>::paged(&ckpt, table.clone(), device);
        let (model, banks) =
            Self::build(&config, &src).map_err(|source| ModelError::Load { dir: dir_s.clone(), source })?;
        let expert_bytes = table.usage().weights;
        Ok(Self { model, config, banks, expert_bytes, bits: Some(bits), pages: Some(table) })
    }

    /// The decode loop's safe point: commits finished page moves and starts the next ones
    /// (see [`PageTable::boundary`]). Does nothing for a model without paged experts.
    pub fn boundary(&self) -> Result<Option<CommitReport>, ModelError> {
        self.pages
            .as_ref()
            .map(|p| p.boundary())
            .transpose()
            .map_err(|e| ModelError::Pages { dir: String::new(), reason: e.to_string() })
    }

    fn build(
        config: &ModelConfig,
        src: &impl WeightSource<B>,
    ) -> Result<(AnyModel<B>, Vec<ExpertBank<B>>), LoadError> {
        let rec = Recording { inner: src, banks: RefCell::new(Vec::new()) };
        let model = AnyModel::from_source(config, &rec)?;
        Ok((model, rec.banks.into_inner()))
    }
}

/// Arena sizes (plane words, LUT entries) for every block of `ckpt` at `bits`, the LUT arena
/// with a few of the largest LUTs of slack (raisings hold a new LUT beside the old one, and the
/// slack keeps the LUT arena from fragmenting into runs too short for them), and that slack.
fn pw_pages_arena(ckpt: &pw_format::Checkpoint, bits: u8) -> (usize, usize, usize) {
    let (mut planes, mut luts, mut slack) = (0, 0, 0);
    for e in &ckpt.manifest().blocks {
        let (p, l) = e.bytes_at(bits.clamp(e.min_bits, e.max_bits));
        planes += p / 4;
        luts += l / 2;
        slack = slack.max(e.bytes_at(e.max_bits).1 / 2);
    }
    (planes, luts + 4 * slack, 4 * slack)
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

/// What a decoder layer's expert bank read in one forward: its input and the router's choices.
#[derive(Debug, Clone)]
pub struct MoeTap<B: Backend> {
    /// `[tokens, hidden]`: the experts' input.
    pub input: Tensor<B, 2>,
    /// The router's choices for those tokens.
    pub routing: Routing<B>,
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
    /// Loads `dir/config.json` and its weights onto `device`: a Hugging Face checkpoint, or a
    /// quantized one (`pagedweight.json`) with its experts at the highest stored bit-width.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, ModelError> {
        Ok(LoadedModel::load(dir, None, device)?.model)
    }

    /// Builds the model of `config` from any weight source.
    pub fn from_source(config: &ModelConfig, src: &impl WeightSource<B>) -> Result<Self, LoadError> {
        Ok(match config {
            ModelConfig::Mixtral(c) => Self::Mixtral(Mixtral::load(c, src)?),
            ModelConfig::Qwen2Moe(c) => Self::Qwen2Moe(Qwen2Moe::load(c, src)?),
            ModelConfig::Gemma4(c) => Self::Gemma4(Gemma4::load(c, src)?),
        })
    }

    /// Builds the model of `config` from an opened checkpoint.
    pub fn from_checkpoint(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let src = HfSource::<B>::new(ckpt, device);
        Self::from_source(config, &src)
            .map_err(|source| ModelError::Load { dir: ckpt.dir().display().to_string(), source })
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
