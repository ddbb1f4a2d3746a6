//! One decoder for the three families: the attention half of a layer is shared (with Qwen's
//! biases and Gemma's head norms / K = V as switches), the feed-forward half branches on
//! [`Family`].

use std::path::Path;

use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{
    Activation, DenseGemm, DeviceArray, FUSED_ACT_MAX_TOKENS, GatedInput, GemmConfig, GemmaFfnOut, HeadNorm,
    LogitsLayout, MAX_TOKENS, MmaMode, RouteBuffers, RowLayout, RowNorm, add_rms_norm, ap_gemm_routed,
    ap_gemm_routed_gated, argmax, dense_gemm, dense_gemm_act, dense_gemm_normed, embed, gated_act,
    gemma_ffn_out, head_norm_rope_append, moe_combine, moe_route_gather, moe_route_gather_router,
    paged_decode_attention_strided, read_f32, read_u32, rope_append, router_fusable, softcap,
};
use pw_hf::{Checkpoint, ModelConfig};
use pw_kv::{BlockTables, DevicePools, SeqId};
use pw_pages::Accountant;

use crate::config::{DecodeConfig, Family};
use crate::experts::ExpertBlocks;
use crate::paged::{LayerPool, PagedExperts};
use crate::route_stats::RouteStats;
use crate::{DecodeError, read};

/// Gemma-4's extra per-layer weights.
struct GemmaLayer {
    pre_ff: DeviceArray,
    /// `router.scale · hidden^-0.5`: the router's weightless norm, scaled, as one RMSNorm weight.
    router_norm: DeviceArray,
    pre_ff2: DeviceArray,
    /// post_feedforward_layernorm_1 | _2 | post_feedforward_layernorm.
    post_norms: DeviceArray,
    per_expert_scale: DeviceArray,
    scalar: DeviceArray,
}

struct Layer {
    input_norm: DeviceArray,
    /// Fused Q|K|V (Q|K with K = V) projection, f16 `[proj_rows, H]`.
    wqkv: DeviceArray,
    bqkv: Option<DeviceArray>,
    /// Gemma's `q_norm | k_norm` weights.
    head_norms: Option<DeviceArray>,
    wo: DeviceArray,
    /// Mixtral/Qwen: the norm before the feed-forward; Gemma: the norm of the attention output.
    post_attn_norm: DeviceArray,
    inv_freq: DeviceArray,
    scale: DeviceArray,
    router: Option<DeviceArray>,
    /// Dense gate|up (`[mlp_rows, H]`, Qwen's shared expert with its gate row last) and down.
    mlp: Option<(DeviceArray, DeviceArray)>,
    gemma: Option<GemmaLayer>,
}

/// Per-step scratch buffers, sized for `MAX_TOKENS` tokens and the widest layer.
struct Scratch {
    h: DeviceArray,
    proj: DeviceArray,
    qkv: DeviceArray,
    attn: DeviceArray,
    o: DeviceArray,
    router_logits: DeviceArray,
    xg: DeviceArray,
    gate_up: DeviceArray,
    /// `act(gate) · up` of `gate_up`'s rows, in the gate half of rows shaped like them.
    expert_act: DeviceArray,
    down: DeviceArray,
    mlp_gu: DeviceArray,
    /// `act(gate)·up` of `mlp_gu` when the down GEMM does not fuse it.
    mlp_act: DeviceArray,
    mlp_out: DeviceArray,
    logits: DeviceArray,
    route: RouteBuffers,
    norm_params: DeviceArray,
    eps: DeviceArray,
    embed_scale: DeviceArray,
    softcap: DeviceArray,
    none: DeviceArray,
}

/// A MoE model of one of the three families on a CubeCL device, decoding batches of
/// sequences (in chunks of `MAX_TOKENS`) over a paged KV cache of `KV` elements (f16 on the GPU).
pub struct Decoder<R: Runtime, KV: Float + CubeElement> {
    client: ComputeClient<R>,
    cfg: DecodeConfig,
    embed: DeviceArray,
    final_norm: DeviceArray,
    lm_head: Option<DeviceArray>,
    layers: Vec<Layer>,
    /// The routed experts of every sparse layer under the weight page table.
    experts: PagedExperts<R>,
    /// Routing counts of the armed steps, for the planner.
    stats: RouteStats,
    gemm: GemmConfig,
    /// Router logits computed inside the routing launch (`moe_route_gather_router`) instead of
    /// a GEMM of their own: routers small enough to recompute in every routing cube.
    fused_router: bool,
    /// Where the routed experts' activation `act(gate) · up` is computed.
    expert_act: ExpertAct,
    /// Most tokens for which a dense MLP's down GEMM applies the activation in its loads.
    mlp_act_fused_max: usize,
    /// Where the dense GEMMs run (`DenseGemm::mma`).
    dense_mma: MmaMode,
    kv: DevicePools<R>,
    tables: BlockTables,
    s: Scratch,
    /// One greedy-id buffer per chunk of a step.
    ids_out: Vec<DeviceArray>,
    launches: usize,
    _kv: std::marker::PhantomData<KV>,
}

/// The Mixtral decoder of earlier versions: the same type.
pub type MixtralDecoder<R, KV> = Decoder<R, KV>;

/// Where dense weights come from: a checkpoint, or device-side random values.
trait Weights<R: Runtime> {
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

struct HfWeights<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    ckpt: &'a Checkpoint,
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

/// Random f16 matrices (uniform, `cols^-0.5` wide, times `gain` for the routers so routing is
/// not flat), unit norms, small biases: shapes and memory traffic of a real model.
struct SyntheticWeights<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    seed: u32,
    biases: bool,
}

impl<R: Runtime> Weights<R> for SyntheticWeights<'_, R> {
    fn client(&self) -> &ComputeClient<R> {
        self.client
    }
    fn mat(&mut self, parts: &[(&str, usize)], cols: usize) -> Result<DeviceArray, DecodeError> {
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let gain = if parts.iter().any(|p| p.0.contains("router") || p.0.contains("gate.weight")) {
            4.0
        } else {
            1.0
        };
        let a = DeviceArray::empty::<R, f16>(self.client, rows * cols);
        self.seed += 1;
        kernels_cubecl::fill_uniform::<R, f16>(self.client, &a, self.seed, gain * (cols as f32).powf(-0.5))?;
        Ok(a)
    }
    fn host(&mut self, _name: &str, n: usize, default: Option<f32>) -> Result<Vec<f32>, DecodeError> {
        Ok(vec![default.unwrap_or(1.0); n])
    }
    fn vec_cat(&mut self, parts: &[(&str, usize)]) -> Result<Option<DeviceArray>, DecodeError> {
        if !self.biases {
            return Ok(None);
        }
        let n: usize = parts.iter().map(|p| p.1).sum();
        Ok(Some(DeviceArray::from_slice(self.client, &vec![0.01f32; n])))
    }
}

/// Where the decode step computes the routed experts' activation `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertAct {
    /// In the gate_up GEMV's epilogue: a warp unit holds gate and up rows of the same outputs
    /// (no launch of its own; where the launch shape has no GEMV, [`Self::Launch`]).
    GateUpEpilogue,
    /// A launch of its own between the gate_up and down GEMVs.
    Launch,
    /// Inside the down GEMV's staging of its input: every cube recomputes it for every column
    /// (for Mixtral 39 % of that kernel's stall samples at batch 1, ncu on the H200).
    InDown,
}

/// Elements per row of layer `l`'s dense MLP gate|up output: its rows, padded to a multiple
/// of 8 when Qwen's shared-expert gate row makes them odd, so that the down GEMM that reads
/// `act(gate)·up` from it (`dense_gemm_act`) can load whole vectors.
fn mlp_stride(cfg: &DecodeConfig, l: usize) -> usize {
    let rows = cfg.mlp_rows(l);
    if rows > 2 * cfg.mlp_inter(l) { rows.next_multiple_of(8) } else { rows }
}

/// Whether layer `l`'s router rows sit in its dense MLP's gate|up matrix (after its rows and
/// padding): Qwen's shared expert reads the same norm(h) as the router, so one GEMM computes
/// both (Gemma's router has a norm of its own).
fn router_in_mlp(cfg: &DecodeConfig, l: usize) -> bool {
    cfg.family != Family::Gemma4 && cfg.sparse[l] && cfg.mlp_rows(l) > 0
}

/// Elements per row of layer `l`'s gate|up GEMM output: [`mlp_stride`], then, with
/// [`router_in_mlp`], the router logits padded to a multiple of 8.
fn gu_width(cfg: &DecodeConfig, l: usize) -> usize {
    mlp_stride(cfg, l) + if router_in_mlp(cfg, l) { cfg.experts.next_multiple_of(8) } else { 0 }
}

/// The prefix of the text model's tensors (`model.language_model` in multimodal Gemma-4).
pub(crate) fn root(ckpt: &Checkpoint) -> &'static str {
    if ckpt.contains("model.language_model.embed_tokens.weight") { "model.language_model" } else { "model" }
}

impl<R: Runtime, KV: Float + CubeElement> Decoder<R, KV> {
    /// Loads the dense weights of an HF checkpoint (any supported family) in f16 and the
    /// experts from `experts`, with a KV cache of `kv_blocks` blocks of `block_size` tokens; no
    /// memory limit.
    pub fn load(
        client: &ComputeClient<R>,
        dir: impl AsRef<Path>,
        experts: &ExpertBlocks,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let unlimited = Accountant::new(u64::MAX);
        Self::load_paged(client, dir, experts.clone(), unlimited, kv_blocks, block_size, max_seq_len)
    }

    /// [`Self::load`] with the experts' pages leasing from `accountant` (the budget the KV
    /// cache shares).
    pub fn load_paged(
        client: &ComputeClient<R>,
        dir: impl AsRef<Path>,
        experts: ExpertBlocks,
        accountant: Accountant,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let dir = dir.as_ref();
        let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(dir)?)?;
        let ckpt = Checkpoint::open(dir)?;
        if experts.blocks.len() != cfg.layers {
            return Err(DecodeError::Unsupported(format!(
                "{} expert layers for {} model layers",
                experts.blocks.len(),
                cfg.layers
            )));
        }
        if let Some(l) = (0..cfg.layers).find(|&l| cfg.sparse[l] == experts.blocks[l].is_empty()) {
            return Err(DecodeError::Unsupported(format!(
                "layer {l}: {} expert blocks for a {} layer",
                experts.blocks[l].len(),
                if cfg.sparse[l] { "sparse" } else { "dense" }
            )));
        }
        let paged =
            PagedExperts::new(client, cfg.moe_shape(), experts.blocks, &experts.bits, accountant, false)?;
        let mut src = HfWeights { client, ckpt: &ckpt };
        Self::build(client, cfg, root(&ckpt), &mut src, paged, kv_blocks, block_size, max_seq_len)
    }

    /// A model of `cfg`'s shapes with random weights made on the device (expert planes: hashed
    /// words; LUTs, dense weights: small uniform values; norms: ones), expert `e` of layer `l`
    /// committed at `bits(l, e)` bits, and its KV pools filled with small random values (so
    /// [`Self::fill_synthetic`] can stand for a prefill): for speed measurements of full-size
    /// models that are not available offline. No memory limit.
    pub fn synthetic(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        bits: &dyn Fn(usize, usize) -> u8,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let unlimited = Accountant::new(u64::MAX);
        Self::synthetic_paged(client, cfg, bits, unlimited, kv_blocks, block_size, max_seq_len)
    }

    /// [`Self::synthetic`] with the experts under a page table leasing from `accountant`:
    /// every page stores widths 3..=8 (see [`PagedExperts::synthetic`]).
    pub fn synthetic_paged(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        bits: &dyn Fn(usize, usize) -> u8,
        accountant: Accountant,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let paged = PagedExperts::synthetic(client, cfg.moe_shape(), &cfg.sparse, bits, accountant)?;
        Self::synthetic_around(client, cfg, paged, kv_blocks, block_size, max_seq_len)
    }

    /// [`Self::synthetic`] with random host parents copied through the experts' mover like a
    /// real checkpoint's (see [`PagedExperts::synthetic_host`]): for measuring page transfers
    /// while decoding. No memory limit.
    pub fn synthetic_host(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        bits: &dyn Fn(usize, usize) -> u8,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let unlimited = Accountant::new(u64::MAX);
        let paged = PagedExperts::synthetic_host(client, cfg.moe_shape(), &cfg.sparse, bits, unlimited)?;
        Self::synthetic_around(client, cfg, paged, kv_blocks, block_size, max_seq_len)
    }

    /// Random dense weights and KV pools around `paged`.
    fn synthetic_around(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        paged: PagedExperts<R>,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let mut src = SyntheticWeights { client, seed: 7, biases: cfg.family == Family::Qwen2Moe };
        let me = Self::build(client, cfg, "model", &mut src, paged, kv_blocks, block_size, max_seq_len)?;
        for l in 0..me.cfg.layers {
            let (k, v) = me.kv.layer(l);
            kernels_cubecl::fill_uniform::<R, KV>(client, k, 0x7000 + 2 * l as u32, 0.5)?;
            kernels_cubecl::fill_uniform::<R, KV>(client, v, 0x7001 + 2 * l as u32, 0.5)?;
        }
        Ok(me)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        root: &str,
        src: &mut dyn Weights<R>,
        experts: PagedExperts<R>,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let (h, nh, e) = (cfg.hidden, cfg.heads, cfg.experts);
        let gemma = cfg.family == Family::Gemma4;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let a = &cfg.attn[l];
            let (hd, kvh) = (a.head_dim, a.kv_heads);
            let p = format!("{root}.layers.{l}");
            let at = format!("{p}.self_attn");
            let (q, k, v) = (format!("{at}.q_proj"), format!("{at}.k_proj"), format!("{at}.v_proj"));
            let mut parts = vec![(format!("{q}.weight"), nh * hd), (format!("{k}.weight"), kvh * hd)];
            let mut bias_parts = vec![(format!("{q}.bias"), nh * hd), (format!("{k}.bias"), kvh * hd)];
            if !a.k_eq_v {
                parts.push((format!("{v}.weight"), kvh * hd));
                bias_parts.push((format!("{v}.bias"), kvh * hd));
            }
            fn refs(v: &[(String, usize)]) -> Vec<(&str, usize)> {
                v.iter().map(|(n, r)| (n.as_str(), *r)).collect()
            }
            let wqkv = src.mat(&refs(&parts), h)?;
            let bqkv = src.vec_cat(&refs(&bias_parts))?;
            let head_norms = if gemma {
                let mut w = src.host(&format!("{at}.q_norm.weight"), hd, None)?;
                w.extend(src.host(&format!("{at}.k_norm.weight"), hd, None)?);
                Some(DeviceArray::from_slice(client, &w))
            } else {
                None
            };
            let scale = cfg.attn_scale.unwrap_or((hd as f32).powf(-0.5));
            let mlp_prefix = match cfg.family {
                Family::Qwen2Moe if cfg.sparse[l] => format!("{p}.mlp.shared_expert"),
                _ => format!("{p}.mlp"),
            };
            let (mrows, minter) = (cfg.mlp_rows(l), cfg.mlp_inter(l));
            let mlp = if mrows > 0 {
                let (g, u, d) = (
                    format!("{mlp_prefix}.gate_proj.weight"),
                    format!("{mlp_prefix}.up_proj.weight"),
                    format!("{mlp_prefix}.down_proj.weight"),
                );
                let gate_row = format!("{p}.mlp.shared_expert_gate.weight");
                let mut gu = vec![(g.as_str(), minter), (u.as_str(), minter)];
                if mrows > 2 * minter {
                    gu.push((gate_row.as_str(), 1));
                }
                // Rows that pad the gate|up output to the stride its reader's vectors need.
                if mlp_stride(&cfg, l) > mrows {
                    gu.push(("", mlp_stride(&cfg, l) - mrows));
                }
                // The router reads the same norm(h): its rows follow, one GEMM for both.
                let router_name = format!("{p}.mlp.gate.weight");
                if router_in_mlp(&cfg, l) {
                    gu.push((router_name.as_str(), e));
                    gu.push(("", gu_width(&cfg, l) - mlp_stride(&cfg, l) - e));
                }
                Some((src.mat(&gu, h)?, src.mat(&[(d.as_str(), h)], minter)?))
            } else {
                None
            };
            let router = if !cfg.sparse[l] || router_in_mlp(&cfg, l) {
                None
            } else {
                Some(match cfg.family {
                    // transformers 5 may save the router as `mlp.gate`: fall back only when the
                    // Mixtral name is missing, and report that name if both are.
                    Family::Mixtral => match src.mat(&[(&format!("{p}.block_sparse_moe.gate.weight"), e)], h)
                    {
                        Err(first @ DecodeError::Hf(pw_hf::HfError::MissingTensor { .. })) => src
                            .mat(&[(&format!("{p}.mlp.gate.weight"), e)], h)
                            .map_err(|second| match second {
                                DecodeError::Hf(pw_hf::HfError::MissingTensor { .. }) => first,
                                other => other,
                            })?,
                        other => other?,
                    },
                    Family::Qwen2Moe => src.mat(&[(&format!("{p}.mlp.gate.weight"), e)], h)?,
                    Family::Gemma4 => src.mat(&[(&format!("{p}.router.proj.weight"), e)], h)?,
                })
            };
            let gemma_layer = if gemma {
                let inv_sqrt_h = (h as f32).powf(-0.5);
                let router_norm: Vec<f32> = src
                    .host(&format!("{p}.router.scale"), h, None)?
                    .into_iter()
                    .map(|s| s * inv_sqrt_h)
                    .collect();
                let mut post = src.host(&format!("{p}.post_feedforward_layernorm_1.weight"), h, None)?;
                post.extend(src.host(&format!("{p}.post_feedforward_layernorm_2.weight"), h, None)?);
                post.extend(src.host(&format!("{p}.post_feedforward_layernorm.weight"), h, None)?);
                Some(GemmaLayer {
                    pre_ff: src.vec(&format!("{p}.pre_feedforward_layernorm.weight"), h, None)?,
                    router_norm: DeviceArray::from_slice(client, &router_norm),
                    pre_ff2: src.vec(&format!("{p}.pre_feedforward_layernorm_2.weight"), h, None)?,
                    post_norms: DeviceArray::from_slice(client, &post),
                    per_expert_scale: src.vec(&format!("{p}.router.per_expert_scale"), e, None)?,
                    // transformers initialises the buffer to one when a checkpoint lacks it.
                    scalar: src.vec(&format!("{p}.layer_scalar"), 1, Some(1.0))?,
                })
            } else {
                None
            };
            layers.push(Layer {
                input_norm: src.vec(&format!("{p}.input_layernorm.weight"), h, None)?,
                wqkv,
                bqkv,
                head_norms,
                wo: src.mat(&[(&format!("{at}.o_proj.weight"), h)], nh * hd)?,
                post_attn_norm: src.vec(&format!("{p}.post_attention_layernorm.weight"), h, None)?,
                inv_freq: DeviceArray::from_slice(client, &a.inv_freq),
                scale: DeviceArray::from_slice(client, &[scale]),
                router,
                mlp,
                gemma: gemma_layer,
            });
        }
        let embed = src.mat(&[(&format!("{root}.embed_tokens.weight"), cfg.vocab)], h)?;
        let final_norm = src.vec(&format!("{root}.norm.weight"), h, None)?;
        let lm_head = if cfg.tied { None } else { Some(src.mat(&[("lm_head.weight", cfg.vocab)], h)?) };
        Ok(Self::assemble(
            client,
            cfg,
            embed,
            final_norm,
            lm_head,
            layers,
            experts,
            kv_blocks,
            block_size,
            max_seq_len,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        embed: DeviceArray,
        final_norm: DeviceArray,
        lm_head: Option<DeviceArray>,
        layers: Vec<Layer>,
        experts: PagedExperts<R>,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Self {
        let h = cfg.hidden;
        let geometry = cfg.kv_geometry(block_size, size_of::<KV>(), max_seq_len);
        let t = MAX_TOKENS;
        let widest = |f: &dyn Fn(usize) -> usize| (0..cfg.layers).map(f).max().unwrap_or(0).max(1);
        let scratch = |n: usize| DeviceArray::empty::<R, f32>(client, n);
        let s = Scratch {
            h: scratch(t * h),
            proj: scratch(t * widest(&|l| cfg.proj_rows(l))),
            qkv: scratch(t * widest(&|l| cfg.qkv_width(l))),
            attn: scratch(t * cfg.heads * widest(&|l| cfg.attn[l].head_dim)),
            o: scratch(t * h),
            router_logits: scratch(t * cfg.experts.max(1)),
            xg: scratch(t * cfg.top_k * h),
            gate_up: scratch(t * cfg.top_k * 2 * cfg.inter),
            expert_act: scratch(t * cfg.top_k * 2 * cfg.inter),
            down: scratch(t * cfg.top_k * h),
            mlp_gu: scratch(t * widest(&|l| gu_width(&cfg, l))),
            mlp_act: scratch(t * widest(&|l| cfg.mlp_inter(l))),
            mlp_out: scratch(t * h),
            logits: scratch(t * cfg.vocab),
            route: RouteBuffers::new(client, cfg.moe_shape()),
            norm_params: DeviceArray::from_slice(client, &[cfg.eps, 0.0]),
            eps: DeviceArray::from_slice(client, &[cfg.eps]),
            embed_scale: DeviceArray::from_slice(client, &[cfg.embed_scale]),
            softcap: DeviceArray::from_slice(client, &[cfg.softcap]),
            none: DeviceArray::from_slice(client, &[0.0f32]),
        };
        Self {
            client: client.clone(),
            embed,
            final_norm,
            lm_head,
            layers,
            stats: RouteStats::new(client, cfg.layers, cfg.experts.max(1)),
            experts,
            gemm: GemmConfig::for_client(client),
            fused_router: cfg.experts > 0 && router_fusable(client, cfg.moe_shape()),
            expert_act: ExpertAct::GateUpEpilogue,
            mlp_act_fused_max: FUSED_ACT_MAX_TOKENS,
            dense_mma: MmaMode::AUTO,
            kv: DevicePools::new::<KV>(client, &geometry, kv_blocks),
            tables: BlockTables::new(&geometry, kv_blocks),
            s,
            cfg,
            ids_out: Vec::new(),
            launches: 0,
            _kv: std::marker::PhantomData,
        }
    }

    /// The model's shapes.
    pub fn config(&self) -> &DecodeConfig {
        &self.cfg
    }

    /// The KV block tables (free/used blocks for admission and the planner).
    pub fn kv_tables(&self) -> &BlockTables {
        &self.tables
    }

    /// Device bytes of the KV pools.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Device bytes of the committed experts (planes + LUTs).
    pub fn expert_bytes(&self) -> usize {
        self.experts.committed_bytes() as usize
    }

    /// Device bytes of the committed experts of layer `l` (0 for a dense layer).
    pub fn layer_expert_bytes(&self, l: usize) -> usize {
        self.experts.layer_bytes(l) as usize
    }

    /// The experts' page tables.
    pub fn experts(&self) -> &PagedExperts<R> {
        &self.experts
    }

    /// The experts' page tables, to set desired bits and commit at a boundary (between steps).
    pub fn experts_mut(&mut self) -> &mut PagedExperts<R> {
        &mut self.experts
    }

    /// The routing counters: arm them before a step, download them after.
    pub fn route_stats_mut(&mut self) -> &mut RouteStats {
        &mut self.stats
    }

    /// Downloads and zeroes the routing counters of the armed steps.
    pub fn take_route_stats(&mut self) -> Result<Option<crate::RoutingCounts>, DecodeError> {
        Ok(self.stats.take(&self.client)?)
    }

    /// Bytes of one KV block (all layers, K and V).
    pub fn kv_block_bytes(&self) -> usize {
        self.kv.geometry().block_bytes()
    }

    /// Device bytes of the dense weights (embedding, attention, routers, MLPs, norms, head).
    pub fn dense_bytes(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let f16s = l.wqkv.len
                    + l.wo.len
                    + l.router.as_ref().map_or(0, |r| r.len)
                    + l.mlp.as_ref().map_or(0, |(a, b)| a.len + b.len);
                let f32s = l.input_norm.len + l.post_attn_norm.len + l.bqkv.as_ref().map_or(0, |b| b.len);
                f16s * 2 + f32s * 4
            })
            .sum();
        per_layer
            + (self.embed.len + self.lm_head.as_ref().map_or(0, |x| x.len)) * 2
            + self.final_norm.len * 4
    }

    /// Bytes of one expert's gate_up and down pages at the committed width, averaged over
    /// the experts of every sparse layer.
    pub fn expert_page_bytes(&self) -> usize {
        let n = self.experts.layers() * self.cfg.experts;
        self.expert_bytes() / n.max(1)
    }

    /// Re-commits the experts: expert `e` of layer `l` at `bits(l, e)` (both blocks), through
    /// the page table, waiting for every raising (for benchmarks between runs; a synthetic
    /// model's arenas hold 8 bits of every expert, so any mix fits).
    pub fn recommit_synthetic(&mut self, bits: &dyn Fn(usize, usize) -> u8) -> Result<(), DecodeError> {
        self.experts.commit_now(bits)
    }

    /// The expert kernels' launch shape (for benchmarks comparing kernel choices).
    pub fn gemm_config_mut(&mut self) -> &mut GemmConfig {
        &mut self.gemm
    }

    /// The compute client the decoder launches on.
    pub fn client(&self) -> &ComputeClient<R> {
        &self.client
    }

    /// Computes the router logits inside the routing launch (`on`, the default where the
    /// router is small enough, see `kernels_cubecl::router_fusable`) or with a GEMM of
    /// their own (for benchmarks comparing the two); returns whether the fused path is on
    /// (never for a router it cannot take).
    pub fn set_fused_router(&mut self, on: bool) -> bool {
        let cfg = &self.cfg;
        self.fused_router = on && cfg.experts > 0 && router_fusable(&self.client, cfg.moe_shape());
        self.fused_router
    }

    /// Where the routed experts' activation is computed (default
    /// [`ExpertAct::GateUpEpilogue`]; the others for benchmarks comparing them).
    pub fn set_expert_act(&mut self, at: ExpertAct) {
        self.expert_act = at;
    }

    /// Most tokens for which a dense MLP's down GEMM applies the activation in its loads
    /// (default [`FUSED_ACT_MAX_TOKENS`]); above it the activation is a launch of its own. For
    /// benchmarks comparing the two.
    pub fn set_mlp_act_fused_max(&mut self, tokens: usize) {
        self.mlp_act_fused_max = tokens;
    }

    /// Where the dense GEMMs (projections, dense MLPs, LM head) run (default
    /// [`MmaMode::Auto`]: on the matrix units from a few tokens where the device has them;
    /// the others for benchmarks comparing them).
    pub fn set_dense_mma(&mut self, mode: MmaMode) {
        self.dense_mma = mode;
    }

    /// Most tokens per routed work item (default `kernels_cubecl::ROUTE_CHUNK`; one of
    /// `ROUTE_CHUNK_CHOICES`): an expert with more tokens reads its weights once per item. For
    /// benchmarks comparing them; the routing buffers are rebuilt.
    pub fn set_route_chunk(&mut self, chunk: usize) -> Result<(), DecodeError> {
        self.s.route = RouteBuffers::with_chunk(&self.client, self.cfg.moe_shape(), chunk)?;
        Ok(())
    }

    /// Most tokens per routed work item (see [`Decoder::set_route_chunk`]).
    pub fn route_chunk(&self) -> usize {
        self.s.route.chunk()
    }

    /// Kernel launches of the last step (all chunks).
    pub fn last_launches(&self) -> usize {
        self.launches
    }

    /// Starts a sequence.
    pub fn add_sequence(&mut self, id: SeqId) -> Result<(), DecodeError> {
        Ok(self.tables.add(id)?)
    }

    /// Ends a sequence and frees its KV blocks.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<(), DecodeError> {
        self.tables.free(id)?;
        Ok(())
    }

    /// Appends `tokens` positions to a sequence's cache without computing them: whatever the
    /// pools hold there stands for their K/V (for benchmarks: a synthetic prefill of a context).
    pub fn fill_synthetic(&mut self, id: SeqId, tokens: usize) -> Result<(), DecodeError> {
        self.tables.append(id, tokens)?;
        Ok(())
    }

    /// One decode step: appends `token` to each listed sequence (distinct; any number, run in
    /// chunks of `MAX_TOKENS`) and returns each one's next-token logits, in batch order.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>, DecodeError> {
        self.launches = 0;
        let mut out = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(MAX_TOKENS) {
            self.enqueue(chunk, 0)?;
            let all = read_f32(&self.client, &self.s.logits)?;
            out.extend(all.chunks(self.cfg.vocab).take(chunk.len()).map(<[f32]>::to_vec));
        }
        Ok(out)
    }

    /// Prefills whole prompts: their tokens go through the decode kernels `MAX_TOKENS` at a
    /// time (one step per chunk, each token attending causally to the positions up to its
    /// own), so a prompt of `n` tokens costs `⌈n / MAX_TOKENS⌉` steps instead of `n`. Returns
    /// each prompt's next-token logits (after its last token), in order.
    pub fn prefill(&mut self, prompts: &[(SeqId, &[u32])]) -> Result<Vec<Vec<f32>>, DecodeError> {
        self.launches = 0;
        // (sequence, token, index of the prompt it ends)
        let flat: Vec<(SeqId, u32, Option<usize>)> = prompts
            .iter()
            .enumerate()
            .flat_map(|(i, &(s, p))| {
                p.iter().enumerate().map(move |(j, &tok)| (s, tok, (j + 1 == p.len()).then_some(i)))
            })
            .collect();
        let mut out = vec![Vec::new(); prompts.len()];
        for chunk in flat.chunks(MAX_TOKENS) {
            let batch: Vec<(SeqId, u32)> = chunk.iter().map(|f| (f.0, f.1)).collect();
            self.enqueue(&batch, 0)?;
            // Only chunks that end a prompt are read back (and waited for).
            if chunk.iter().any(|f| f.2.is_some()) {
                let all = read_f32(&self.client, &self.s.logits)?;
                for (row, f) in chunk.iter().enumerate() {
                    if let Some(i) = f.2 {
                        out[i] = all[row * self.cfg.vocab..][..self.cfg.vocab].to_vec();
                    }
                }
            }
        }
        Ok(out)
    }

    /// [`Self::step`] with greedy sampling on the device: only the new token ids come back.
    pub fn step_greedy(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<u32>, DecodeError> {
        self.enqueue_greedy(batch)?;
        self.read_greedy(batch.len())
    }

    /// Enqueues a greedy step without waiting for it (the host's share of a step); read the
    /// ids with [`Self::read_greedy`].
    pub fn enqueue_greedy(&mut self, batch: &[(SeqId, u32)]) -> Result<(), DecodeError> {
        self.launches = 0;
        for (i, chunk) in batch.chunks(MAX_TOKENS).enumerate() {
            if self.ids_out.len() <= i {
                self.ids_out.push(DeviceArray::empty::<R, u32>(&self.client, MAX_TOKENS));
            }
            self.enqueue(chunk, 0)?;
            argmax(&self.client, chunk.len(), self.cfg.vocab, &self.s.logits, &self.ids_out[i])?;
            self.launches += 1;
        }
        Ok(())
    }

    /// The ids of the last [`Self::enqueue_greedy`] of `n` sequences (waits for the step).
    pub fn read_greedy(&mut self, n: usize) -> Result<Vec<u32>, DecodeError> {
        let mut ids = Vec::with_capacity(n);
        for (i, buf) in self.ids_out.iter().enumerate().take(n.div_ceil(MAX_TOKENS)) {
            let got = read_u32(&self.client, buf)?;
            ids.extend_from_slice(&got[..(n - i * MAX_TOKENS).min(MAX_TOKENS)]);
        }
        Ok(ids)
    }

    /// Enqueues one chunk of at most `MAX_TOKENS` sequences; the logits land in `s.logits`.
    fn enqueue(&mut self, batch: &[(SeqId, u32)], _reserved: usize) -> Result<(), DecodeError> {
        let t = batch.len();
        if t == 0 {
            return Ok(());
        }
        if let Some(&(_, bad)) = batch.iter().find(|(_, tok)| *tok as usize >= self.cfg.vocab) {
            return Err(DecodeError::Unsupported(format!(
                "token id {bad} outside the vocabulary of {}",
                self.cfg.vocab
            )));
        }
        let seqs: Vec<SeqId> = batch.iter().map(|b| b.0).collect();
        // A sequence may come several times (consecutive tokens of its prompt). Reserve every
        // sequence's slots first so a full cache refuses the whole step.
        let mut counts: Vec<(SeqId, usize)> = Vec::new();
        for &s in &seqs {
            match counts.iter_mut().find(|c| c.0 == s) {
                Some(c) => c.1 += 1,
                None => counts.push((s, 1)),
            }
        }
        let needed: usize =
            counts.iter().map(|&(s, n)| self.tables.blocks_needed(s, n)).sum::<Result<_, _>>()?;
        if needed > self.tables.free_blocks() {
            return Err(pw_kv::KvError::OutOfBlocks {
                seq: seqs[0],
                needed,
                free: self.tables.free_blocks(),
            }
            .into());
        }
        let mut slots = Vec::with_capacity(t);
        let mut positions = Vec::with_capacity(t);
        for &s in &seqs {
            slots.push(self.tables.append(s, 1)?[0]);
            positions.push(self.tables.len(s)? as u32 - 1);
        }
        let c = &self.client;
        let cfg = &self.cfg;
        let s = &self.s;
        let dm = self.dense_mma;
        let step = self.kv.upload_tokens(c, &self.tables, &seqs, &slots, &positions)?;
        let ids: Vec<u32> = batch.iter().map(|b| b.1).collect();
        let ids = DeviceArray::from_slice(c, &ids);
        let pos = DeviceArray::from_slice(c, &positions);
        let meta = DeviceArray::from_slice(c, &[t as u32]);
        let (h, nh, e, i) = (cfg.hidden, cfg.heads, cfg.experts, cfg.inter);
        let shape = cfg.moe_shape();
        let mut n = 0usize;
        macro_rules! launch {
            ($e:expr) => {{
                $e?;
                n += 1;
            }};
        }
        // Every RMSNorm of the step is folded into the kernels that read its output (the
        // dense GEMMs' input and the experts' row gather), so none costs a launch.
        fn rn<'a>(w: &'a DeviceArray, params: &'a DeviceArray) -> Option<RowNorm<'a>> {
            Some(RowNorm { w, params })
        }
        let np = &s.norm_params;
        // Dense MLP, first half: gate|up GEMM of norm(x) into `s.mlp_gu` (with Qwen's router
        // logits after them, see `router_in_mlp`).
        let mlp_up = |x: &DeviceArray, nw: &DeviceArray, l: usize, (gu, _): &(DeviceArray, DeviceArray)| {
            let g = DenseGemm {
                n: gu_width(cfg, l),
                k: h,
                bias: false,
                accumulate: false,
                mma: dm,
                plain_rows: None,
            };
            dense_gemm_normed(c, g, t, &meta, x, rn(nw, np), gu, &s.none, &s.mlp_gu)?;
            Ok::<usize, DecodeError>(1)
        };
        // Second half: the down GEMM over act(gate)·up (· sigmoid of the shared expert's gate
        // row) into `out` (added when `acc`): the activation a launch of its own, or fused into
        // the down GEMM's loads up to `mlp_act_fused_max` tokens (none by default, see
        // `FUSED_ACT_MAX_TOKENS`).
        let fused_max = self.mlp_act_fused_max;
        let mlp_down = |l: usize, (_, dn): &(DeviceArray, DeviceArray), out: &DeviceArray, acc: bool| {
            let inter = cfg.mlp_inter(l);
            let a = GatedInput { act: cfg.act, stride: gu_width(cfg, l), gated: cfg.mlp_rows(l) > 2 * inter };
            let d = DenseGemm { n: h, k: inter, bias: false, accumulate: acc, mma: dm, plain_rows: None };
            if t <= fused_max {
                dense_gemm_act(c, d, t, &meta, &s.mlp_gu, a, dn, &s.none, out)?;
                return Ok::<usize, DecodeError>(1);
            }
            gated_act(c, t, inter, a, &s.mlp_gu, (&s.mlp_act, inter))?;
            dense_gemm(c, d, t, &meta, &s.mlp_act, dn, &s.none, out)?;
            Ok::<usize, DecodeError>(2)
        };
        // The routed experts of the gathered rows `s.xg` up to their outputs in `s.down`, with
        // their activation where `self.expert_act` says.
        let expert_act = self.expert_act;
        let experts = |ex: &LayerPool<'_>| {
            let (gu, dn) = (&s.route.desc_gate_up, &s.route.desc_down);
            let chunk = s.route.chunk();
            let routed = |desc, n, k, x, y, act| {
                ap_gemm_routed(c, self.gemm, ex.planes, ex.luts, desc, chunk, e, n, k, t, x, y, act)
            };
            let fused = expert_act == ExpertAct::GateUpEpilogue
                && ap_gemm_routed_gated(
                    c,
                    self.gemm,
                    ex.planes,
                    ex.luts,
                    gu,
                    chunk,
                    e,
                    2 * i,
                    h,
                    t,
                    &s.xg,
                    &s.gate_up,
                    cfg.act,
                )?;
            if fused {
                routed(dn, h, i, &s.gate_up, &s.down, Activation::Applied)?;
                return Ok::<usize, DecodeError>(2);
            }
            routed(gu, 2 * i, h, &s.xg, &s.gate_up, Activation::None)?;
            if expert_act == ExpertAct::InDown {
                routed(dn, h, i, &s.gate_up, &s.down, cfg.act)?;
                return Ok(2);
            }
            let a = GatedInput { act: cfg.act, stride: 2 * i, gated: false };
            gated_act(c, t * cfg.top_k, i, a, &s.gate_up, (&s.expert_act, 2 * i))?;
            routed(dn, h, i, &s.expert_act, &s.down, Activation::Applied)?;
            Ok(3)
        };

        launch!(embed(c, t, h, &ids, &self.embed, &s.embed_scale, &s.h));
        for (li, layer) in self.layers.iter().enumerate() {
            let a = &cfg.attn[li];
            let (hd, kvh, qkv_w) = (a.head_dim, a.kv_heads, cfg.qkv_width(li));
            // Attention: norm folded into the fused projection (+ biases) → ([head norms +]
            // RoPE + append in one launch) → paged attention → O projection into the residual
            // (Gemma: through its norm).
            let rows = cfg.proj_rows(li);
            let proj_out = if layer.head_norms.is_some() { &s.proj } else { &s.qkv };
            let g = DenseGemm {
                n: rows,
                k: h,
                bias: layer.bqkv.is_some(),
                accumulate: false,
                mma: dm,
                plain_rows: None,
            };
            launch!(dense_gemm_normed(
                c,
                g,
                t,
                &meta,
                &s.h,
                rn(&layer.input_norm, np),
                &layer.wqkv,
                layer.bqkv.as_ref().unwrap_or(&s.none),
                proj_out
            ));
            let attn_shape = self.kv.geometry().attn_shape(li);
            let (kp, vp) = self.kv.layer(li);
            if let Some(w) = &layer.head_norms {
                // Gemma-4: Q/K/V head norms, RoPE and the append in one launch.
                let g = HeadNorm {
                    heads: nh,
                    kv_heads: kvh,
                    head_dim: hd,
                    src_stride: rows,
                    qk_norm: true,
                    v_norm: true,
                    k_eq_v: a.k_eq_v,
                };
                launch!(head_norm_rope_append::<R, KV>(
                    c,
                    g,
                    t,
                    hd,
                    &s.proj,
                    w,
                    &s.eps,
                    &pos,
                    &layer.inv_freq,
                    &step.slots,
                    (&s.qkv, qkv_w),
                    kp,
                    vp
                ));
            } else {
                let layout = RowLayout { stride: qkv_w, k_off: nh * hd, v_off: (nh + kvh) * hd };
                launch!(rope_append::<R, KV>(
                    c,
                    attn_shape,
                    t,
                    layout,
                    hd,
                    &s.qkv,
                    &pos,
                    &layer.inv_freq,
                    &step.slots,
                    kp,
                    vp
                ));
            }
            launch!(paged_decode_attention_strided::<R, KV>(
                c,
                attn_shape,
                t,
                step.max_len,
                &s.qkv,
                qkv_w,
                kp,
                vp,
                &step.table,
                &step.lens,
                &layer.scale,
                &s.attn,
            ));
            let gemma = layer.gemma.as_ref();
            let o = DenseGemm {
                n: h,
                k: nh * hd,
                bias: false,
                accumulate: gemma.is_none(),
                mma: dm,
                plain_rows: None,
            };
            let o_out = if gemma.is_some() { &s.o } else { &s.h };
            launch!(dense_gemm(c, o, t, &meta, &s.attn, &layer.wo, &s.none, o_out));

            match gemma {
                None => {
                    // Mixtral / Qwen2-MoE: routed experts of norm(h) combined into the
                    // residual, plus the MLP (Qwen's gated shared expert or dense layer) of the
                    // same norm(h) added to it. Everything that reads h runs before the
                    // combine writes it; the additions keep their order (experts, then MLP).
                    let pn = &layer.post_attn_norm;
                    if let Some(ex) = self.experts.layer(li) {
                        // Router logits: computed in the routing launch itself when the router is
                        // small (Mixtral's 8 × 4096, see `router_fusable`), else their own GEMM,
                        // or beside the shared expert's gate|up rows in its GEMM. Then routing
                        // (+ statistics) and the gather of norm(h) in one launch.
                        let counters = self.stats.counters(shape, li, t)?;
                        let logits = match (&layer.router, &layer.mlp) {
                            (Some(router), _) if self.fused_router => {
                                launch!(moe_route_gather_router(
                                    c,
                                    shape,
                                    t,
                                    &meta,
                                    (router, &s.router_logits),
                                    ex.slots,
                                    &s.route,
                                    counters,
                                    &s.h,
                                    rn(pn, np),
                                    &s.xg
                                ));
                                None
                            }
                            (Some(router), _) => {
                                let g = DenseGemm {
                                    n: e,
                                    k: h,
                                    bias: false,
                                    accumulate: false,
                                    mma: dm,
                                    plain_rows: None,
                                };
                                launch!(dense_gemm_normed(
                                    c,
                                    g,
                                    t,
                                    &meta,
                                    &s.h,
                                    rn(pn, np),
                                    router,
                                    &s.none,
                                    &s.router_logits
                                ));
                                Some((&s.router_logits, LogitsLayout { stride: e, offset: 0 }))
                            }
                            (None, Some(w)) => {
                                n += mlp_up(&s.h, pn, li, w)?;
                                let at =
                                    LogitsLayout { stride: gu_width(cfg, li), offset: mlp_stride(cfg, li) };
                                Some((&s.mlp_gu, at))
                            }
                            (None, None) => {
                                return Err(DecodeError::Unsupported(format!("layer {li}: no router")));
                            }
                        };
                        if let Some(logits) = logits {
                            launch!(moe_route_gather(
                                c,
                                shape,
                                t,
                                &meta,
                                logits,
                                ex.slots,
                                &s.route,
                                counters,
                                &s.h,
                                rn(pn, np),
                                &s.xg
                            ));
                        }
                        if let (Some(_), Some(w)) = (&layer.router, &layer.mlp) {
                            n += mlp_up(&s.h, pn, li, w)?;
                        }
                        n += experts(&ex)?;
                        launch!(moe_combine(
                            c,
                            t,
                            cfg.top_k,
                            h,
                            &s.down,
                            &s.route.pos,
                            &s.route.weights,
                            &s.h
                        ));
                    } else if let Some(w) = &layer.mlp {
                        n += mlp_up(&s.h, pn, li, w)?;
                    }
                    if let Some(w) = &layer.mlp {
                        n += mlp_down(li, w, &s.h, true)?;
                    }
                }
                Some(gl) => {
                    // Gemma-4: h += norm(o); dense GeGLU branch and experts on the same
                    // residual, each through its norms (folded into their GEMMs and gather);
                    // one epilogue sums, norms, adds, scales.
                    launch!(add_rms_norm(c, t, h, &s.o, &layer.post_attn_norm, &s.eps, &s.h));
                    let (Some(router), Some(ex), Some(w)) =
                        (&layer.router, self.experts.layer(li), &layer.mlp)
                    else {
                        return Err(DecodeError::Unsupported("Gemma-4 layer without experts or MLP".into()));
                    };
                    n += mlp_up(&s.h, &gl.pre_ff, li, w)?;
                    n += mlp_down(li, w, &s.mlp_out, false)?;
                    let g =
                        DenseGemm { n: e, k: h, bias: false, accumulate: false, mma: dm, plain_rows: None };
                    launch!(dense_gemm_normed(
                        c,
                        g,
                        t,
                        &meta,
                        &s.h,
                        rn(&gl.router_norm, np),
                        router,
                        &s.none,
                        &s.router_logits
                    ));
                    let counters = self.stats.counters(shape, li, t)?;
                    let (lg, r) = ((&s.router_logits, LogitsLayout { stride: e, offset: 0 }), &s.route);
                    let pre_ff2 = rn(&gl.pre_ff2, np);
                    launch!(moe_route_gather(
                        c, shape, t, &meta, lg, ex.slots, r, counters, &s.h, pre_ff2, &s.xg
                    ));
                    n += experts(&ex)?;
                    let b = GemmaFfnOut {
                        logits: &s.router_logits,
                        per_expert_scale: &gl.per_expert_scale,
                        pos: &s.route.pos,
                        down: &s.down,
                        mlp: &s.mlp_out,
                        norms: &gl.post_norms,
                        scalar: &gl.scalar,
                        params: &s.eps,
                        h: &s.h,
                    };
                    launch!(gemma_ffn_out(c, t, e, cfg.top_k, h, b));
                }
            }
        }
        let head =
            DenseGemm { n: cfg.vocab, k: h, bias: false, accumulate: false, mma: dm, plain_rows: None };
        launch!(dense_gemm_normed(
            c,
            head,
            t,
            &meta,
            &s.h,
            rn(&self.final_norm, np),
            self.lm_head.as_ref().unwrap_or(&self.embed),
            &s.none,
            &s.logits
        ));
        if cfg.softcap > 0.0 {
            launch!(softcap(c, t, cfg.vocab, &meta, &s.logits, &s.softcap));
        }
        self.launches += n;
        Ok(())
    }
}
