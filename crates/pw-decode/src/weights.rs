//! The dense weights of a served model (everything but the routed experts) as the decode
//! kernels read them, and their loading from a source: an HF checkpoint ([`HfWeights`]) or
//! device-side random values (`crate::synthetic`).

use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::DeviceArray;
use pw_hf::Checkpoint;

use crate::config::{DecodeConfig, Family};
use crate::{DecodeError, read};

/// Gemma-4's extra per-layer weights.
pub(crate) struct GemmaLayer {
    pub(crate) pre_ff: DeviceArray,
    /// `router.scale · hidden^-0.5`: the router's weightless norm, scaled, as one RMSNorm weight.
    pub(crate) router_norm: DeviceArray,
    pub(crate) pre_ff2: DeviceArray,
    /// post_feedforward_layernorm_1 | _2 | post_feedforward_layernorm.
    pub(crate) post_norms: DeviceArray,
    pub(crate) per_expert_scale: DeviceArray,
    pub(crate) scalar: DeviceArray,
}

/// A dense MLP: gate|up (`[mlp_rows, H]`, Qwen's shared expert with its gate row last, then
/// the router's rows where [`router_in_mlp`]) and down.
pub(crate) struct Mlp {
    pub(crate) gate_up: DeviceArray,
    pub(crate) down: DeviceArray,
}

/// One decoder layer's dense weights.
pub(crate) struct Layer {
    pub(crate) input_norm: DeviceArray,
    /// Fused Q|K|V (Q|K with K = V) projection, f16 `[proj_rows, H]`.
    pub(crate) wqkv: DeviceArray,
    pub(crate) bqkv: Option<DeviceArray>,
    /// Gemma's `q_norm | k_norm` weights.
    pub(crate) head_norms: Option<DeviceArray>,
    pub(crate) wo: DeviceArray,
    /// Mixtral/Qwen: the norm before the feed-forward; Gemma: the norm of the attention output.
    pub(crate) post_attn_norm: DeviceArray,
    pub(crate) inv_freq: DeviceArray,
    pub(crate) scale: DeviceArray,
    /// The router as a matrix of its own (absent where its rows sit in the MLP's gate|up).
    pub(crate) router: Option<DeviceArray>,
    pub(crate) mlp: Option<Mlp>,
    pub(crate) gemma: Option<GemmaLayer>,
}

/// The dense weights of the whole model.
pub(crate) struct DenseWeights {
    pub(crate) embed: DeviceArray,
    pub(crate) final_norm: DeviceArray,
    /// `None`: tied to the embedding.
    pub(crate) lm_head: Option<DeviceArray>,
    pub(crate) layers: Vec<Layer>,
}

impl DenseWeights {
    /// The LM head's matrix (the embedding when tied).
    pub(crate) fn head(&self) -> &DeviceArray {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Device bytes of the embedding, attention, routers, MLPs, norms and head.
    pub(crate) fn bytes(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let f16s = l.wqkv.len
                    + l.wo.len
                    + l.router.as_ref().map_or(0, |r| r.len)
                    + l.mlp.as_ref().map_or(0, |m| m.gate_up.len + m.down.len);
                let f32s = l.input_norm.len + l.post_attn_norm.len + l.bqkv.as_ref().map_or(0, |b| b.len);
                f16s * 2 + f32s * 4
            })
            .sum();
        per_layer
            + (self.embed.len + self.lm_head.as_ref().map_or(0, |x| x.len)) * 2
            + self.final_norm.len * 4
    }
}

/// Where dense weights come from: a checkpoint, or device-side random values.
pub(crate) trait Weights<R: Runtime> {
    /// The device.
    fn client(&self) -> &ComputeClient<R>;
    /// f16 matrix made of the row blocks `parts` (`(name, rows)`, an empty name: padding
    /// rows whose values are never read), `cols` wide.
    fn mat(&mut self, parts: &[(&str, usize)], cols: usize) -> Result<DeviceArray, DecodeError>;
    /// f32 vector on the host; `default` when the source lacks it (`None`: required).
    fn host(&mut self, name: &str, n: usize, default: Option<f32>) -> Result<Vec<f32>, DecodeError>;
    /// [`Self::host`], uploaded.
    fn vec(&mut self, name: &str, n: usize, default: Option<f32>) -> Result<DeviceArray, DecodeError> {
        let v = self.host(name, n, default)?;
        Ok(DeviceArray::from_slice(self.client(), &v))
    }
    /// f32 vector made of several (biases of a fused projection); `None` when the first is absent.
    fn vec_cat(&mut self, parts: &[(&str, usize)]) -> Result<Option<DeviceArray>, DecodeError>;
}

/// The tensors of an HF checkpoint, matrices rounded to f16.
pub(crate) struct HfWeights<'a, R: Runtime> {
    pub(crate) client: &'a ComputeClient<R>,
    pub(crate) ckpt: &'a Checkpoint,
}

impl<R: Runtime> Weights<R> for HfWeights<'_, R> {
    fn client(&self) -> &ComputeClient<R> {
        self.client
    }
    fn mat(&mut self, parts: &[(&str, usize)], cols: usize) -> Result<DeviceArray, DecodeError> {
        let mut all = Vec::new();
        for (name, rows) in parts {
            if name.is_empty() {
                all.extend(std::iter::repeat_n(f16::ZERO, rows * cols));
                continue;
            }
            all.extend(read(self.ckpt, name, &[*rows, cols])?.into_iter().map(f16::from_f32));
        }
        Ok(DeviceArray::from_slice(self.client, &all))
    }
    fn host(&mut self, name: &str, n: usize, default: Option<f32>) -> Result<Vec<f32>, DecodeError> {
        match default {
            Some(d) if !self.ckpt.contains(name) => Ok(vec![d; n]),
            _ => read(self.ckpt, name, &[n]),
        }
    }
    fn vec_cat(&mut self, parts: &[(&str, usize)]) -> Result<Option<DeviceArray>, DecodeError> {
        if !self.ckpt.contains(parts[0].0) {
            return Ok(None);
        }
        let mut all = Vec::new();
        for (name, n) in parts {
            all.extend(read(self.ckpt, name, &[*n])?);
        }
        Ok(Some(DeviceArray::from_slice(self.client, &all)))
    }
}

/// The prefix of the text model's tensors (`model.language_model` in multimodal Gemma-4).
pub(crate) fn root(ckpt: &Checkpoint) -> &'static str {
    if ckpt.contains("model.language_model.embed_tokens.weight") { "model.language_model" } else { "model" }
}

/// Elements per row of layer `l`'s dense MLP gate|up output: its rows, padded to a multiple
/// of 8 when Qwen's shared-expert gate row makes them odd, so that a reader of `act(gate)·up`
/// can load whole vectors.
pub(crate) fn mlp_stride(cfg: &DecodeConfig, l: usize) -> usize {
    let rows = cfg.mlp_rows(l);
    if rows > 2 * cfg.mlp_inter(l) { rows.next_multiple_of(8) } else { rows }
}

/// Whether layer `l`'s router rows sit in its dense MLP's gate|up matrix (after its rows and
/// padding): Qwen's shared expert reads the same norm(h) as the router, so one GEMM computes
/// both (Gemma's router has a norm of its own).
pub(crate) fn router_in_mlp(cfg: &DecodeConfig, l: usize) -> bool {
    cfg.family != Family::Gemma4 && cfg.sparse[l] && cfg.mlp_rows(l) > 0
}

/// Elements per row of layer `l`'s gate|up GEMM output: [`mlp_stride`], then, with
/// [`router_in_mlp`], the router logits padded to a multiple of 8.
pub(crate) fn gu_width(cfg: &DecodeConfig, l: usize) -> usize {
    mlp_stride(cfg, l) + if router_in_mlp(cfg, l) { cfg.experts.next_multiple_of(8) } else { 0 }
}

/// Loads every dense weight of a model of `cfg`'s shapes whose tensors are named under `root`.
pub(crate) fn load_dense<R: Runtime>(
    cfg: &DecodeConfig,
    root: &str,
    src: &mut dyn Weights<R>,
) -> Result<DenseWeights, DecodeError> {
    let h = cfg.hidden;
    let layers = (0..cfg.layers).map(|l| load_layer(cfg, &format!("{root}.layers.{l}"), l, src));
    let layers = layers.collect::<Result<Vec<_>, _>>()?;
    let embed = src.mat(&[(&format!("{root}.embed_tokens.weight"), cfg.vocab)], h)?;
    let final_norm = src.vec(&format!("{root}.norm.weight"), h, None)?;
    let lm_head = if cfg.tied { None } else { Some(src.mat(&[("lm_head.weight", cfg.vocab)], h)?) };
    Ok(DenseWeights { embed, final_norm, lm_head, layers })
}

/// Layer `l`'s weights, named under `p`.
fn load_layer<R: Runtime>(
    cfg: &DecodeConfig,
    p: &str,
    l: usize,
    src: &mut dyn Weights<R>,
) -> Result<Layer, DecodeError> {
    let (h, nh) = (cfg.hidden, cfg.heads);
    let a = &cfg.attn[l];
    let at = format!("{p}.self_attn");
    let (wqkv, bqkv) = load_qkv(cfg, &at, l, src)?;
    let head_norms = if cfg.family == Family::Gemma4 {
        let mut w = src.host(&format!("{at}.q_norm.weight"), a.head_dim, None)?;
        w.extend(src.host(&format!("{at}.k_norm.weight"), a.head_dim, None)?);
        Some(DeviceArray::from_slice(src.client(), &w))
    } else {
        None
    };
    let scale = cfg.attn_scale.unwrap_or((a.head_dim as f32).powf(-0.5));
    let mlp = load_mlp(cfg, p, l, src)?;
    let router = if !cfg.sparse[l] || router_in_mlp(cfg, l) { None } else { Some(load_router(cfg, p, src)?) };
    let gemma = if cfg.family == Family::Gemma4 { Some(load_gemma(cfg, p, src)?) } else { None };
    Ok(Layer {
        input_norm: src.vec(&format!("{p}.input_layernorm.weight"), h, None)?,
        wqkv,
        bqkv,
        head_norms,
        wo: src.mat(&[(&format!("{at}.o_proj.weight"), h)], nh * a.head_dim)?,
        post_attn_norm: src.vec(&format!("{p}.post_attention_layernorm.weight"), h, None)?,
        inv_freq: DeviceArray::from_slice(src.client(), &a.inv_freq),
        scale: DeviceArray::from_slice(src.client(), &[scale]),
        router,
        mlp,
        gemma,
    })
}

/// The fused Q|K|V projection (Q|K with K = V) of the attention named `at`, and its biases
/// where the source has them.
fn load_qkv<R: Runtime>(
    cfg: &DecodeConfig,
    at: &str,
    l: usize,
    src: &mut dyn Weights<R>,
) -> Result<(DeviceArray, Option<DeviceArray>), DecodeError> {
    let a = &cfg.attn[l];
    let (q_rows, kv_rows) = (cfg.heads * a.head_dim, a.kv_heads * a.head_dim);
    let mut projs = vec![("q_proj", q_rows), ("k_proj", kv_rows)];
    if !a.k_eq_v {
        projs.push(("v_proj", kv_rows));
    }
    let names = |what: &str| -> Vec<(String, usize)> {
        projs.iter().map(|(proj, rows)| (format!("{at}.{proj}.{what}"), *rows)).collect()
    };
    let (weights, biases) = (names("weight"), names("bias"));
    fn refs(v: &[(String, usize)]) -> Vec<(&str, usize)> {
        v.iter().map(|(n, r)| (n.as_str(), *r)).collect()
    }
    Ok((src.mat(&refs(&weights), cfg.hidden)?, src.vec_cat(&refs(&biases))?))
}

/// Layer `l`'s dense MLP, if it has one: Qwen's shared expert (with its gate row) on a sparse
/// layer, else the layer's `mlp`; its gate|up rows padded to [`mlp_stride`], then the router's
/// rows where [`router_in_mlp`].
fn load_mlp<R: Runtime>(
    cfg: &DecodeConfig,
    p: &str,
    l: usize,
    src: &mut dyn Weights<R>,
) -> Result<Option<Mlp>, DecodeError> {
    let (mrows, minter) = (cfg.mlp_rows(l), cfg.mlp_inter(l));
    if mrows == 0 {
        return Ok(None);
    }
    let prefix = match cfg.family {
        Family::Qwen2Moe if cfg.sparse[l] => format!("{p}.mlp.shared_expert"),
        _ => format!("{p}.mlp"),
    };
    let (g, u, d) = (
        format!("{prefix}.gate_proj.weight"),
        format!("{prefix}.up_proj.weight"),
        format!("{prefix}.down_proj.weight"),
    );
    let gate_row = format!("{p}.mlp.shared_expert_gate.weight");
    let mut gu = vec![(g.as_str(), minter), (u.as_str(), minter)];
    if mrows > 2 * minter {
        gu.push((gate_row.as_str(), 1));
    }
    // Rows that pad the gate|up output to the stride its reader's vectors need.
    if mlp_stride(cfg, l) > mrows {
        gu.push(("", mlp_stride(cfg, l) - mrows));
    }
    // The router reads the same norm(h): its rows follow, one GEMM for both.
    let router_name = format!("{p}.mlp.gate.weight");
    if router_in_mlp(cfg, l) {
        gu.push((router_name.as_str(), cfg.experts));
        gu.push(("", gu_width(cfg, l) - mlp_stride(cfg, l) - cfg.experts));
    }
    Ok(Some(Mlp { gate_up: src.mat(&gu, cfg.hidden)?, down: src.mat(&[(d.as_str(), cfg.hidden)], minter)? }))
}

/// The router of the layer named `p`, under its family's name.
fn load_router<R: Runtime>(
    cfg: &DecodeConfig,
    p: &str,
    src: &mut dyn Weights<R>,
) -> Result<DeviceArray, DecodeError> {
    let (e, h) = (cfg.experts, cfg.hidden);
    match cfg.family {
        // transformers 5 may save the router as `mlp.gate`: fall back only when the Mixtral
        // name is missing, and report that name if both are.
        Family::Mixtral => match src.mat(&[(&format!("{p}.block_sparse_moe.gate.weight"), e)], h) {
            Err(first @ DecodeError::Hf(pw_hf::HfError::MissingTensor { .. })) => {
                src.mat(&[(&format!("{p}.mlp.gate.weight"), e)], h).map_err(|second| match second {
                    DecodeError::Hf(pw_hf::HfError::MissingTensor { .. }) => first,
                    other => other,
                })
            }
            other => other,
        },
        Family::Qwen2Moe => src.mat(&[(&format!("{p}.mlp.gate.weight"), e)], h),
        Family::Gemma4 => src.mat(&[(&format!("{p}.router.proj.weight"), e)], h),
    }
}

/// Gemma-4's norms, router scales and layer scalar of the layer named `p`.
fn load_gemma<R: Runtime>(
    cfg: &DecodeConfig,
    p: &str,
    src: &mut dyn Weights<R>,
) -> Result<GemmaLayer, DecodeError> {
    let (h, e) = (cfg.hidden, cfg.experts);
    let inv_sqrt_h = (h as f32).powf(-0.5);
    let router_norm: Vec<f32> =
        src.host(&format!("{p}.router.scale"), h, None)?.into_iter().map(|s| s * inv_sqrt_h).collect();
    let mut post = src.host(&format!("{p}.post_feedforward_layernorm_1.weight"), h, None)?;
    post.extend(src.host(&format!("{p}.post_feedforward_layernorm_2.weight"), h, None)?);
    post.extend(src.host(&format!("{p}.post_feedforward_layernorm.weight"), h, None)?);
    Ok(GemmaLayer {
        pre_ff: src.vec(&format!("{p}.pre_feedforward_layernorm.weight"), h, None)?,
        router_norm: DeviceArray::from_slice(src.client(), &router_norm),
        pre_ff2: src.vec(&format!("{p}.pre_feedforward_layernorm_2.weight"), h, None)?,
        post_norms: DeviceArray::from_slice(src.client(), &post),
        per_expert_scale: src.vec(&format!("{p}.router.per_expert_scale"), e, None)?,
        // transformers initialises the buffer to one when a checkpoint lacks it.
        scalar: src.vec(&format!("{p}.layer_scalar"), 1, Some(1.0))?,
    })
}
