use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::{HfError, Result};

/// Most decoder layers a config may declare: per-layer tables are sized from
/// `num_hidden_layers` while parsing, and no supported model comes near this.
pub const MAX_LAYERS: usize = 4096;

/// How the rotary frequencies are laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeKind {
    /// Every frequency pair of the head rotates (`rope_type: "default"`).
    Default,
    /// Gemma-4 "proportional": frequencies are computed over the whole head dimension but only
    /// the first `partial_rotary_factor · head_dim / 2` pairs rotate; the rest stay fixed.
    Proportional {
        /// Fraction of the frequency pairs that rotate.
        partial_rotary_factor: f64,
    },
}

/// Rotary position embedding parameters of one attention kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    /// Base wavelength θ.
    pub theta: f64,
    /// Frequency layout.
    pub kind: RopeKind,
    /// Linear position scaling (`factor`, 1.0 when absent).
    pub factor: f64,
}

impl RopeSpec {
    /// Inverse frequencies, one per rotate-half pair (`head_dim / 2` values).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let half = head_dim / 2;
        let rotating = match self.kind {
            RopeKind::Default => half,
            RopeKind::Proportional { partial_rotary_factor } => {
                ((partial_rotary_factor * head_dim as f64) as usize / 2).min(half)
            }
        };
        (0..half)
            .map(|i| {
                if i < rotating {
                    // Computed in f32 exactly as transformers does (exponent in f32, base in f64).
                    let exponent = (2 * i) as f32 / head_dim as f32;
                    (1.0 / (self.theta.powf(exponent as f64)) / self.factor) as f32
                } else {
                    0.0
                }
            })
            .collect()
    }
}

/// Gate activation of the gated MLPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU).
    Silu,
    /// tanh-approximated GELU (GeGLU, `gelu_pytorch_tanh`).
    GeluTanh,
    /// exact erf GELU.
    Gelu,
}

/// Mixtral (`model_type: "mixtral"`).
#[derive(Debug, Clone, PartialEq)]
pub struct MixtralConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Expert intermediate width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary parameters.
    pub rope: RopeSpec,
    /// Sliding attention window, if any.
    pub sliding_window: Option<usize>,
    /// Routed experts per layer.
    pub num_local_experts: usize,
    /// Experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Whether lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Expert activation.
    pub hidden_act: Activation,
    /// End-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
}

/// Qwen1.5-MoE (`model_type: "qwen2_moe"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2MoeConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Width of the dense MLP of `mlp_only_layers`.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary parameters.
    pub rope: RopeSpec,
    /// Sliding window per layer (`None` = full attention).
    pub layer_windows: Vec<Option<usize>>,
    /// Whether q/k/v projections carry biases.
    pub qkv_bias: bool,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Routed expert intermediate width.
    pub moe_intermediate_size: usize,
    /// Shared expert intermediate width (0 = no shared expert).
    pub shared_expert_intermediate_size: usize,
    /// Whether the top-k weights are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Per layer: whether it is a sparse MoE layer (else a dense MLP).
    pub sparse_layers: Vec<bool>,
    /// Whether lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// MLP activation.
    pub hidden_act: Activation,
    /// End-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
}

/// Attention geometry of one Gemma-4 layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemma4LayerSpec {
    /// Sliding (local) or full (global) attention.
    pub sliding: bool,
    /// Per-head width of this layer.
    pub head_dim: usize,
    /// Key/value heads of this layer.
    pub num_key_value_heads: usize,
    /// Whether V is taken from the K projection (no `v_proj`).
    pub k_eq_v: bool,
}

/// Gemma-4 text model (`gemma4_text`, or the `text_config` of a `gemma4` checkpoint).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Per-layer attention geometry.
    pub layers: Vec<Gemma4LayerSpec>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// Rotary parameters of sliding layers.
    pub rope_sliding: RopeSpec,
    /// Rotary parameters of full layers.
    pub rope_full: RopeSpec,
    /// `tanh(x / c) · c` on the logits, if set.
    pub final_logit_softcapping: Option<f64>,
    /// Whether the MoE block runs beside the dense MLP.
    pub enable_moe_block: bool,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k_experts: usize,
    /// Routed expert intermediate width.
    pub moe_intermediate_size: usize,
    /// Whether lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// MLP activation.
    pub hidden_activation: Activation,
    /// End-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
    /// Weights live under `model.language_model.` (multimodal checkpoint).
    pub multimodal: bool,
}

/// A parsed `config.json` of one of the supported families.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// Mixtral.
    Mixtral(MixtralConfig),
    /// Qwen1.5-MoE.
    Qwen2Moe(Qwen2MoeConfig),
    /// Gemma-4 text MoE.
    Gemma4(Gemma4Config),
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join("config.json"))
    }

    /// Reads a config file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|source| HfError::Io { path: path.to_path_buf(), source })?;
        Self::from_json_str(&text, path)
    }

    /// Parses config JSON; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|source| HfError::Json { path: path.to_path_buf(), source })?;
        let root = Fields::root(&value, path)?;
        let model_type = root.req_str("model_type")?;
        match model_type.as_str() {
            "mixtral" => Ok(Self::Mixtral(parse_mixtral(&root)?)),
            "qwen2_moe" => Ok(Self::Qwen2Moe(parse_qwen2_moe(&root)?)),
            "gemma4_text" => Ok(Self::Gemma4(parse_gemma4(&root, false)?)),
            "gemma4" => {
                let text = root.child("text_config")?;
                Ok(Self::Gemma4(parse_gemma4(&text, true)?))
            }
            other => Err(root.err(
                "model_type",
                format!(
                    "unsupported model type `{other}` (expected mixtral, qwen2_moe, gemma4 or gemma4_text)"
                ),
            )),
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Mixtral(c) => c.vocab_size,
            Self::Qwen2Moe(c) => c.vocab_size,
            Self::Gemma4(c) => c.vocab_size,
        }
    }

    /// Routed experts of each decoder layer (0 for a layer with a dense MLP only).
    pub fn routed_experts(&self) -> Vec<usize> {
        match self {
            Self::Mixtral(c) => vec![c.num_local_experts; c.num_hidden_layers],
            Self::Qwen2Moe(c) => c.sparse_layers.iter().map(|&s| if s { c.num_experts } else { 0 }).collect(),
            Self::Gemma4(c) => vec![if c.enable_moe_block { c.num_experts } else { 0 }; c.layers.len()],
        }
    }

    /// End-of-sequence ids declared in config.json.
    pub fn eos_token_ids(&self) -> &[u32] {
        match self {
            Self::Mixtral(c) => &c.eos_token_ids,
            Self::Qwen2Moe(c) => &c.eos_token_ids,
            Self::Gemma4(c) => &c.eos_token_ids,
        }
    }
}

/// A JSON object plus where it came from, for error messages.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: PathBuf,
    prefix: String,
}

impl<'a> Fields<'a> {
    fn root(v: &'a Value, path: &Path) -> Result<Self> {
        let obj = v.as_object().ok_or_else(|| HfError::Config {
            path: path.to_path_buf(),
            field: "<root>".into(),
            message: "not a JSON object".into(),
        })?;
        Ok(Self { obj, path: path.to_path_buf(), prefix: String::new() })
    }

    fn name(&self, field: &str) -> String {
        format!("{}{}", self.prefix, field)
    }

    fn err(&self, field: &str, message: impl Into<String>) -> HfError {
        HfError::Config { path: self.path.clone(), field: self.name(field), message: message.into() }
    }

    /// The field, treating JSON `null` as absent.
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn child(&self, field: &str) -> Result<Fields<'a>> {
        let obj = self
            .get(field)
            .ok_or_else(|| self.err(field, "missing"))?
            .as_object()
            .ok_or_else(|| self.err(field, "not an object"))?;
        Ok(Fields { obj, path: self.path.clone(), prefix: format!("{}{}.", self.prefix, field) })
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.err(field, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn req_usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?.ok_or_else(|| self.err(field, "missing"))
    }

    /// `num_hidden_layers`: positive and at most [`MAX_LAYERS`], since per-layer tables are
    /// allocated from it before any tensor is read.
    fn layers(&self) -> Result<usize> {
        let n = self.positive("num_hidden_layers")?;
        if n > MAX_LAYERS {
            return Err(self.err(
                "num_hidden_layers",
                format!("{n} exceeds the {MAX_LAYERS} layers this reader allows"),
            ));
        }
        Ok(n)
    }

    fn positive(&self, field: &str) -> Result<usize> {
        let v = self.req_usize(field)?;
        if v == 0 {
            return Err(self.err(field, "must be positive"));
        }
        Ok(v)
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => {
                v.as_f64().map(Some).ok_or_else(|| self.err(field, format!("expected a number, got {v}")))
            }
        }
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(field)?.unwrap_or(default))
    }

    /// A finite number > 0 (rotary bases, scaling factors, norm epsilons: zero or a negative
    /// value would turn activations into NaN, not into an error).
    fn pos_f64_or(&self, field: &str, default: f64) -> Result<f64> {
        let v = self.f64_or(field, default)?;
        if !(v.is_finite() && v > 0.0) {
            return Err(self.err(field, format!("{v} must be a positive number")));
        }
        Ok(v)
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(field, format!("expected true or false, got {v}"))),
        }
    }

    fn req_str(&self, field: &str) -> Result<String> {
        self.get(field)
            .ok_or_else(|| self.err(field, "missing"))?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| self.err(field, "expected a string"))
    }

    fn opt_str(&self, field: &str) -> Result<Option<String>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => {
                v.as_str().map(|s| Some(s.to_string())).ok_or_else(|| self.err(field, "expected a string"))
            }
        }
    }

    fn activation(&self, field: &str, default: Activation) -> Result<Activation> {
        match self.opt_str(field)?.as_deref() {
            None => Ok(default),
            Some("silu") | Some("swish") => Ok(Activation::Silu),
            Some("gelu_pytorch_tanh") | Some("gelu_new") | Some("gelu_fast") => Ok(Activation::GeluTanh),
            Some("gelu") => Ok(Activation::Gelu),
            Some(other) => Err(self.err(field, format!("unsupported activation `{other}`"))),
        }
    }

    /// `eos_token_id`: an integer, a list of integers or absent.
    fn eos(&self) -> Result<Vec<u32>> {
        match self.get("eos_token_id") {
            None => Ok(Vec::new()),
            Some(Value::Number(n)) => Ok(vec![
                n.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| self.err("eos_token_id", "expected a token id (0..2^32)"))?,
            ]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| self.err("eos_token_id", "expected token ids (0..2^32)"))
                })
                .collect(),
            Some(v) => Err(self.err("eos_token_id", format!("unexpected value {v}"))),
        }
    }

    fn head_dim(&self) -> Result<usize> {
        match self.opt_usize("head_dim")? {
            Some(h) if h > 0 => Ok(h),
            _ => {
                let hidden = self.positive("hidden_size")?;
                let heads = self.positive("num_attention_heads")?;
                if !hidden.is_multiple_of(heads) {
                    return Err(self.err(
                        "num_attention_heads",
                        format!("does not divide hidden_size {hidden} and head_dim is not given"),
                    ));
                }
                Ok(hidden / heads)
            }
        }
    }

    /// Rotary parameters of a single-kind model: `rope_parameters` (transformers 5) or the
    /// legacy top-level `rope_theta` / `rope_scaling`.
    fn rope_single(&self, default_theta: f64) -> Result<RopeSpec> {
        if self.get("rope_parameters").is_some() {
            return self.child("rope_parameters")?.rope_spec(default_theta);
        }
        if self.get("rope_scaling").is_some() {
            let scaling = self.child("rope_scaling")?;
            let ty = scaling
                .opt_str("rope_type")?
                .or(scaling.opt_str("type")?)
                .unwrap_or_else(|| "default".into());
            if ty != "default" {
                return Err(scaling.err("rope_type", format!("unsupported rope type `{ty}`")));
            }
        }
        Ok(RopeSpec {
            theta: self.pos_f64_or("rope_theta", default_theta)?,
            kind: RopeKind::Default,
            factor: 1.0,
        })
    }

    /// This object is one rope-parameters dict.
    fn rope_spec(&self, default_theta: f64) -> Result<RopeSpec> {
        let ty = self.opt_str("rope_type")?.unwrap_or_else(|| "default".into());
        let theta = self.pos_f64_or("rope_theta", default_theta)?;
        let factor = self.pos_f64_or("factor", 1.0)?;
        let kind = match ty.as_str() {
            "default" => {
                let p = self.f64_or("partial_rotary_factor", 1.0)?;
                if p != 1.0 {
                    return Err(self.err(
                        "partial_rotary_factor",
                        "partial rotary embeddings are only supported with rope_type proportional",
                    ));
                }
                RopeKind::Default
            }
            "linear" => RopeKind::Default,
            "proportional" => {
                let p = self.f64_or("partial_rotary_factor", 1.0)?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(self.err("partial_rotary_factor", format!("{p} is outside (0, 1]")));
                }
                RopeKind::Proportional { partial_rotary_factor: p }
            }
            other => return Err(self.err("rope_type", format!("unsupported rope type `{other}`"))),
        };
        if ty == "default" && factor != 1.0 {
            return Err(self.err("factor", "a scaling factor needs rope_type linear or proportional"));
        }
        Ok(RopeSpec { theta, kind, factor })
    }

    fn layer_types(&self, n: usize) -> Result<Option<Vec<bool>>> {
        let Some(v) = self.get("layer_types") else {
            return Ok(None);
        };
        let arr = v.as_array().ok_or_else(|| self.err("layer_types", "expected a list"))?;
        if arr.len() != n {
            return Err(self.err("layer_types", format!("has {} entries for {n} layers", arr.len())));
        }
        arr.iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(self.err("layer_types", format!("unknown layer type {t}"))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn parse_mixtral(f: &Fields) -> Result<MixtralConfig> {
    let num_attention_heads = f.positive("num_attention_heads")?;
    let num_key_value_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
    check_gqa(f, num_attention_heads, num_key_value_heads)?;
    let cfg = MixtralConfig {
        vocab_size: f.positive("vocab_size")?,
        hidden_size: f.positive("hidden_size")?,
        intermediate_size: f.positive("intermediate_size")?,
        num_hidden_layers: f.layers()?,
        num_attention_heads,
        num_key_value_heads,
        head_dim: f.head_dim()?,
        rms_norm_eps: f.pos_f64_or("rms_norm_eps", 1e-5)?,
        rope: f.rope_single(1e6)?,
        sliding_window: f.opt_usize("sliding_window")?.filter(|&w| w > 0),
        num_local_experts: f.positive("num_local_experts")?,
        num_experts_per_tok: f.positive("num_experts_per_tok")?,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        hidden_act: f.activation("hidden_act", Activation::Silu)?,
        eos_token_ids: f.eos()?,
    };
    if cfg.num_experts_per_tok > cfg.num_local_experts {
        return Err(f.err("num_experts_per_tok", "exceeds num_local_experts"));
    }
    Ok(cfg)
}

fn check_gqa(f: &Fields, heads: usize, kv: usize) -> Result<()> {
    if kv == 0 || !heads.is_multiple_of(kv) {
        return Err(f.err("num_key_value_heads", format!("{kv} does not divide num_attention_heads {heads}")));
    }
    Ok(())
}

fn parse_qwen2_moe(f: &Fields) -> Result<Qwen2MoeConfig> {
    let n = f.layers()?;
    let num_attention_heads = f.positive("num_attention_heads")?;
    let num_key_value_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
    check_gqa(f, num_attention_heads, num_key_value_heads)?;
    let mlp_only: std::collections::BTreeSet<usize> = match f.get("mlp_only_layers") {
        None => Default::default(),
        Some(v) => v
            .as_array()
            .ok_or_else(|| f.err("mlp_only_layers", "expected a list"))?
            .iter()
            .map(|x| {
                x.as_u64().map(|x| x as usize).ok_or_else(|| f.err("mlp_only_layers", "expected integers"))
            })
            .collect::<Result<_>>()?,
    };
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    let num_experts = f.opt_usize("num_experts")?.unwrap_or(0);
    // As in transformers: sparse iff not listed as MLP-only, experts exist and (i+1) % step == 0.
    let sparse_layers = (0..n)
        .map(|i| !mlp_only.contains(&i) && num_experts > 0 && step > 0 && (i + 1).is_multiple_of(step))
        .collect();
    let window = f.opt_usize("sliding_window")?.filter(|&w| w > 0);
    let use_sliding = f.bool_or("use_sliding_window", false)?;
    let layer_windows = match f.layer_types(n)? {
        Some(types) => types.into_iter().map(|s| if s { window } else { None }).collect(),
        None => {
            let max_window_layers = f.opt_usize("max_window_layers")?.unwrap_or(n);
            (0..n).map(|i| if use_sliding && i >= max_window_layers { window } else { None }).collect()
        }
    };
    let cfg = Qwen2MoeConfig {
        vocab_size: f.positive("vocab_size")?,
        hidden_size: f.positive("hidden_size")?,
        intermediate_size: f.positive("intermediate_size")?,
        num_hidden_layers: n,
        num_attention_heads,
        num_key_value_heads,
        head_dim: f.head_dim()?,
        rms_norm_eps: f.pos_f64_or("rms_norm_eps", 1e-6)?,
        rope: f.rope_single(1e6)?,
        layer_windows,
        qkv_bias: f.bool_or("qkv_bias", true)?,
        num_experts,
        num_experts_per_tok: f.opt_usize("num_experts_per_tok")?.unwrap_or(0),
        moe_intermediate_size: f.opt_usize("moe_intermediate_size")?.unwrap_or(0),
        shared_expert_intermediate_size: f.opt_usize("shared_expert_intermediate_size")?.unwrap_or(0),
        norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
        sparse_layers,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        hidden_act: f.activation("hidden_act", Activation::Silu)?,
        eos_token_ids: f.eos()?,
    };
    if cfg.sparse_layers.iter().any(|&s| s) {
        if cfg.num_experts_per_tok == 0 || cfg.num_experts_per_tok > cfg.num_experts {
            return Err(f.err("num_experts_per_tok", format!("must be in 1..={}", cfg.num_experts)));
        }
        if cfg.moe_intermediate_size == 0 {
            return Err(f.err("moe_intermediate_size", "missing or zero"));
        }
    }
    Ok(cfg)
}

fn parse_gemma4(f: &Fields, multimodal: bool) -> Result<Gemma4Config> {
    let n = f.layers()?;
    if f.opt_usize("hidden_size_per_layer_input")?.unwrap_or(0) > 0 {
        return Err(f.err(
            "hidden_size_per_layer_input",
            "per-layer input embeddings (Gemma-4 E2B/E4B) are not supported; only the MoE layout is",
        ));
    }
    if f.opt_usize("num_kv_shared_layers")?.unwrap_or(0) > 0 {
        return Err(f.err("num_kv_shared_layers", "KV sharing across layers is not supported"));
    }
    if f.opt_str("use_bidirectional_attention")?.as_deref() == Some("all") {
        return Err(f.err("use_bidirectional_attention", "bidirectional attention is not supported"));
    }
    let sliding: Vec<bool> = match f.layer_types(n)? {
        Some(t) => t,
        // transformers default: 5 sliding then 1 full, and the last layer always full.
        None => (0..n).map(|i| !(i + 1).is_multiple_of(6) && i + 1 != n).collect(),
    };
    let head_dim = f.head_dim()?;
    let kv = f.positive("num_key_value_heads")?;
    let heads = f.positive("num_attention_heads")?;
    let k_eq_v = f.bool_or("attention_k_eq_v", false)?;

    let mut layers: Vec<Gemma4LayerSpec> = sliding
        .iter()
        .map(|&s| Gemma4LayerSpec { sliding: s, head_dim, num_key_value_heads: kv, k_eq_v: k_eq_v && !s })
        .collect();
    if f.get("per_layer_config").is_some() {
        // transformers >= 5.17 form: {"<layer index>": {"head_dim": .., "num_key_value_heads": ..}}.
        let plc = f.child("per_layer_config")?;
        for (key, _) in plc.obj.iter() {
            let idx: usize = key
                .parse()
                .ok()
                .filter(|&i: &usize| i < n)
                .ok_or_else(|| plc.err(key, "not a layer index"))?;
            let entry = plc.child(key)?;
            if let Some(h) = entry.opt_usize("head_dim")? {
                layers[idx].head_dim = h;
            }
            if let Some(k) = entry.opt_usize("num_key_value_heads")? {
                layers[idx].num_key_value_heads = k;
            }
        }
    } else {
        // Release form: flat `global_head_dim` / `num_global_key_value_heads` for full layers
        // (transformers defaults the former to 512).
        let global_head_dim = f.opt_usize("global_head_dim")?.unwrap_or(512);
        let global_kv = f.opt_usize("num_global_key_value_heads")?;
        for l in layers.iter_mut().filter(|l| !l.sliding) {
            l.head_dim = global_head_dim;
            if k_eq_v && let Some(k) = global_kv {
                l.num_key_value_heads = k;
            }
        }
    }
    for l in &layers {
        check_gqa(f, heads, l.num_key_value_heads)?;
        if !l.head_dim.is_multiple_of(2) {
            return Err(f.err("head_dim", "must be even for rotary embeddings"));
        }
    }

    let (rope_sliding, rope_full) = if f.get("rope_parameters").is_some() {
        let rp = f.child("rope_parameters")?;
        if rp.get("sliding_attention").is_some() || rp.get("full_attention").is_some() {
            (rp.child("sliding_attention")?.rope_spec(1e4)?, rp.child("full_attention")?.rope_spec(1e6)?)
        } else {
            let one = rp.rope_spec(1e4)?;
            (one, one)
        }
    } else {
        // Legacy flat form.
        let theta = f.pos_f64_or("rope_theta", 1e6)?;
        let local = f.pos_f64_or("rope_local_base_freq", 1e4)?;
        (
            RopeSpec { theta: local, kind: RopeKind::Default, factor: 1.0 },
            RopeSpec { theta, kind: RopeKind::Default, factor: 1.0 },
        )
    };

    let enable_moe_block = f.bool_or("enable_moe_block", false)?;
    let cfg = Gemma4Config {
        vocab_size: f.positive("vocab_size")?,
        hidden_size: f.positive("hidden_size")?,
        intermediate_size: f.positive("intermediate_size")?,
        num_attention_heads: heads,
        layers,
        rms_norm_eps: f.pos_f64_or("rms_norm_eps", 1e-6)?,
        sliding_window: f.opt_usize("sliding_window")?.unwrap_or(512),
        rope_sliding,
        rope_full,
        final_logit_softcapping: f.opt_f64("final_logit_softcapping")?,
        enable_moe_block,
        num_experts: f.opt_usize("num_experts")?.unwrap_or(0),
        top_k_experts: f.opt_usize("top_k_experts")?.unwrap_or(0),
        moe_intermediate_size: f.opt_usize("moe_intermediate_size")?.unwrap_or(0),
        tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
        hidden_activation: f.activation("hidden_activation", Activation::GeluTanh)?,
        eos_token_ids: f.eos()?,
        multimodal,
    };
    if enable_moe_block
        && (cfg.num_experts == 0
            || cfg.top_k_experts == 0
            || cfg.top_k_experts > cfg.num_experts
            || cfg.moe_intermediate_size == 0)
    {
        return Err(f.err(
            "enable_moe_block",
            "needs num_experts, top_k_experts <= num_experts and moe_intermediate_size",
        ));
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(s, Path::new("config.json"))
    }

    #[test]
    fn mixtral_legacy_rope_theta() {
        let c = parse(
            r#"{"model_type":"mixtral","vocab_size":32000,"hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"rope_theta":1000000.0,
            "rms_norm_eps":1e-5,"num_local_experts":8,"num_experts_per_tok":2,"sliding_window":null,
            "eos_token_id":2}"#,
        )
        .unwrap();
        let ModelConfig::Mixtral(c) = c else { panic!() };
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.sliding_window, None);
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn qwen_rope_theta_read_not_defaulted() {
        let c = parse(
            r#"{"model_type":"qwen2_moe","vocab_size":151936,"hidden_size":2048,"intermediate_size":5632,
            "num_hidden_layers":24,"num_attention_heads":16,"num_key_value_heads":16,"rope_theta":1000000.0,
            "num_experts":60,"num_experts_per_tok":4,"moe_intermediate_size":1408,
            "shared_expert_intermediate_size":5632,"norm_topk_prob":false,"decoder_sparse_step":1,
            "mlp_only_layers":[],"use_sliding_window":false,"sliding_window":32768,"max_window_layers":21}"#,
        )
        .unwrap();
        let ModelConfig::Qwen2Moe(c) = c else { panic!() };
        assert_eq!(c.rope.theta, 1e6);
        assert!(c.sparse_layers.iter().all(|&s| s));
        assert!(c.layer_windows.iter().all(Option::is_none));
        assert!(c.qkv_bias);
    }

    const GEMMA_RELEASE: &str = r#"{"model_type":"gemma4","text_config":{"model_type":"gemma4_text",
        "vocab_size":262144,"hidden_size":2816,"intermediate_size":2112,"num_hidden_layers":30,
        "num_attention_heads":16,"num_key_value_heads":8,"head_dim":256,"global_head_dim":512,
        "num_global_key_value_heads":2,"attention_k_eq_v":true,"sliding_window":1024,
        "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},
          "full_attention":{"rope_type":"proportional","partial_rotary_factor":0.25,"rope_theta":1000000.0}},
        "final_logit_softcapping":30.0,"enable_moe_block":true,"num_experts":128,"top_k_experts":8,
        "moe_intermediate_size":704,"hidden_size_per_layer_input":0,"eos_token_id":[1,106]}}"#;

    #[test]
    fn gemma4_release_flat_global_head_dim() {
        let ModelConfig::Gemma4(c) = parse(GEMMA_RELEASE).unwrap() else { panic!() };
        assert!(c.multimodal);
        assert_eq!(c.layers.len(), 30);
        let full: Vec<usize> = (0..30).filter(|&i| !c.layers[i].sliding).collect();
        assert_eq!(full, vec![5, 11, 17, 23, 29]);
        assert_eq!(c.layers[5].head_dim, 512);
        assert_eq!(c.layers[5].num_key_value_heads, 2);
        assert!(c.layers[5].k_eq_v);
        assert_eq!(c.layers[0].head_dim, 256);
        assert_eq!(c.layers[0].num_key_value_heads, 8);
        assert!(!c.layers[0].k_eq_v);
        // 0.25 of 512 / 2 = 64 rotating pairs out of 256.
        let f = c.rope_full.inv_freq(512);
        assert_eq!(f.len(), 256);
        assert!(f[..64].iter().all(|&x| x > 0.0) && f[64..].iter().all(|&x| x == 0.0));
        assert_eq!(c.eos_token_ids, vec![1, 106]);
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse(r#"{"model_type":"mixtral","vocab_size":10,"num_attention_heads":4}"#).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("config.json") && msg.contains("hidden_size"), "{msg}");
        let e = parse(&GEMMA_RELEASE.replace("\"num_experts\":128", "\"num_experts\":\"x\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("text_config.num_experts"), "{e}");
        let e = parse(r#"{"model_type":"llama"}"#).unwrap_err().to_string();
        assert!(e.contains("unsupported model type `llama`"), "{e}");
    }

    #[test]
    fn layer_count_is_bounded_before_tables_are_sized_from_it() {
        // 10^15 layers once asked for a 1 PB per-layer table while parsing.
        let q = r#"{"model_type":"qwen2_moe","vocab_size":8,"hidden_size":8,"intermediate_size":8,
            "num_hidden_layers":1000000000000000,"num_attention_heads":2}"#;
        let e = parse(q).unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers") && e.contains("exceeds the 4096 layers"), "{e}");
        let g = GEMMA_RELEASE.replace("\"num_hidden_layers\":30", "\"num_hidden_layers\":1000000000000000");
        let e = parse(&g).unwrap_err().to_string();
        assert!(e.contains("text_config.num_hidden_layers"), "{e}");
    }

    #[test]
    fn bad_numbers_are_errors_not_nan_or_truncation() {
        let m = r#"{"model_type":"mixtral","vocab_size":8,"hidden_size":8,"intermediate_size":8,
            "num_hidden_layers":1,"num_attention_heads":2,"num_local_experts":2,"num_experts_per_tok":1"#;
        for (extra, field) in [
            (r#","eos_token_id":4294967297}"#, "eos_token_id"),
            (r#","eos_token_id":[2,4294967296]}"#, "eos_token_id"),
            (r#","rope_theta":0}"#, "rope_theta"),
            (r#","rms_norm_eps":-1e-5}"#, "rms_norm_eps"),
            (r#","rope_parameters":{"rope_type":"linear","factor":0}}"#, "rope_parameters.factor"),
        ] {
            let e = parse(&format!("{m}{extra}")).unwrap_err().to_string();
            assert!(e.contains(&format!("field `{field}`")), "{extra}: {e}");
        }
        parse(&format!("{m}}}")).unwrap();
        let e =
            parse(&GEMMA_RELEASE.replace("\"partial_rotary_factor\":0.25", "\"partial_rotary_factor\":1.5"))
                .unwrap_err()
                .to_string();
        assert!(e.contains("partial_rotary_factor") && e.contains("outside (0, 1]"), "{e}");
    }
}
