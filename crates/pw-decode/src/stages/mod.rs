//! The stages the families' forward passes are made of, each a few CubeCL launches on the
//! compute client: the embedding, the attention block ([`attention`]), routing and the routed
//! experts ([`moe`]), the dense MLP ([`mlp`]), Gemma-4's epilogues and the final norm + LM
//! head. No RMSNorm is a launch of its own: each is folded into the GEMMs or the gather that
//! read its output (a per-token scale after the row reduction).

mod attention;
mod mlp;
mod moe;

pub(crate) use attention::AttnOut;
pub(crate) use mlp::MlpOut;
pub(crate) use moe::Logits;

use std::marker::PhantomData;

use cubecl::prelude::*;
use kernels_cubecl::{DenseGemm, GroupedMode, MmaMode, RouteBuffers, RowNorm, dense_gemm_normed, embed};
use kernels_cubecl::{DeviceArray, GemmConfig, KernelError};
use kernels_cubecl::{GemmaFfnOut, add_rms_norm, gemma_ffn_out, softcap};
use kernels_cubecl::{dense_gemm, gather_rows_normed};
use pw_kv::{DevicePools, StepArrays};

use crate::DecodeError;
use crate::config::DecodeConfig;
use crate::paged::PagedExperts;
use crate::route_stats::RouteStats;
use crate::weights::{GemmaLayer, gu_width};

/// Where the decode step computes the routed experts' activation `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertAct {
    /// In the gate_up GEMV's epilogue: a warp unit holds gate and up rows of the same outputs
    /// (no launch of its own; where the launch shape has no GEMV, [`Self::Launch`]).
    #[default]
    GateUpEpilogue,
    /// Always a launch of its own between the gate_up and down GEMVs.
    Launch,
}

/// The kernel choices of a decoder, fixed when it is built.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// The expert kernels' launch shape.
    pub(crate) gemm: GemmConfig,
    /// Router logits computed inside the routing launch instead of a GEMM of their own (only
    /// where the router is small enough to recompute in every routing cube).
    pub(crate) fused_router: bool,
    /// Where the routed experts' activation is computed.
    pub(crate) expert_act: ExpertAct,
    /// Where the dense GEMMs run.
    pub(crate) dense_mma: MmaMode,
    /// Where the routed experts run.
    pub(crate) grouped: GroupedMode,
}

/// Per-step scratch buffers, sized for the decoder's most tokens per step and the widest layer.
pub(crate) struct Scratch {
    pub(crate) h: DeviceArray,
    pub(crate) proj: DeviceArray,
    pub(crate) qkv: DeviceArray,
    pub(crate) attn: DeviceArray,
    pub(crate) o: DeviceArray,
    pub(crate) router_logits: DeviceArray,
    pub(crate) xg: DeviceArray,
    pub(crate) gate_up: DeviceArray,
    /// `act(gate) · up` of `gate_up`'s rows, in the gate half of rows shaped like them.
    pub(crate) expert_act: DeviceArray,
    pub(crate) down: DeviceArray,
    pub(crate) mlp_gu: DeviceArray,
    /// `act(gate)·up` of `mlp_gu`, the down GEMM's input.
    pub(crate) mlp_act: DeviceArray,
    pub(crate) mlp_out: DeviceArray,
    pub(crate) logits: DeviceArray,
    /// The routing of steps of up to [`ROUTED_STEP_TOKENS`] tokens.
    pub(crate) route: RouteBuffers,
    /// The routing of larger steps, when the decoder takes them.
    pub(crate) route_wide: Option<RouteBuffers>,
    pub(crate) norm_params: DeviceArray,
    pub(crate) eps: DeviceArray,
    pub(crate) embed_scale: DeviceArray,
    pub(crate) softcap: DeviceArray,
    pub(crate) none: DeviceArray,
}

impl Scratch {
    /// Buffers for steps of up to `tokens` tokens and `logit_rows` rows of logits of a model of
    /// `cfg`'s shapes, its routing cut into items of `route_chunk` tokens.
    pub(crate) fn new<R: Runtime>(
        client: &ComputeClient<R>,
        cfg: &DecodeConfig,
        route_chunk: usize,
        tokens: usize,
        logit_rows: usize,
    ) -> Result<Self, DecodeError> {
        let scratch = |n: usize| DeviceArray::empty::<R, f32>(client, n);
        let [
            h,
            proj,
            qkv,
            attn,
            o,
            router_logits,
            xg,
            gate_up,
            expert_act,
            down,
            mlp_gu,
            mlp_act,
            mlp_out,
            logits,
        ] = scratch_sizes(cfg, tokens, logit_rows).map(scratch);
        Ok(Self {
            h,
            proj,
            qkv,
            attn,
            o,
            router_logits,
            xg,
            gate_up,
            expert_act,
            down,
            mlp_gu,
            mlp_act,
            mlp_out,
            logits,
            route: RouteBuffers::with_capacity(
                client,
                cfg.moe_shape(),
                route_chunk,
                tokens.min(ROUTED_STEP_TOKENS),
            )?,
            route_wide: (tokens > ROUTED_STEP_TOKENS)
                .then(|| RouteBuffers::with_capacity(client, cfg.moe_shape(), route_chunk, tokens))
                .transpose()?,
            norm_params: DeviceArray::from_slice(client, &[cfg.eps, 0.0]),
            eps: DeviceArray::from_slice(client, &[cfg.eps]),
            embed_scale: DeviceArray::from_slice(client, &[cfg.embed_scale]),
            softcap: DeviceArray::from_slice(client, &[cfg.softcap]),
            none: DeviceArray::from_slice(client, &[0.0f32]),
        })
    }
}

impl Scratch {
    /// Device bytes of the step buffers (activations, logits, routing tables), as
    /// [`DecodeConfig::scratch_bytes`] counts them.
    pub(crate) fn bytes(&self) -> u64 {
        let f32s = [
            &self.h,
            &self.proj,
            &self.qkv,
            &self.attn,
            &self.o,
            &self.router_logits,
            &self.xg,
            &self.gate_up,
            &self.expert_act,
            &self.down,
            &self.mlp_gu,
            &self.mlp_act,
            &self.mlp_out,
            &self.logits,
        ];
        let routes = self.route.bytes() + self.route_wide.as_ref().map_or(0, RouteBuffers::bytes);
        4 * f32s.iter().map(|a| a.len as u64).sum::<u64>() + routes
    }
}

/// Steps of up to this many tokens route into tables sized for them (a decode batch): the
/// routing cube's shared memory and the routed GEMV's item prefix grow with the tables, so a
/// decoder taking longer steps keeps a second, wider set for them.
pub(crate) const ROUTED_STEP_TOKENS: usize = 256;

/// Device bytes of the routing buffers of a decoder with steps of up to `tokens` tokens.
pub(crate) fn route_bytes(cfg: &DecodeConfig, route_chunk: usize, tokens: usize) -> u64 {
    let small = RouteBuffers::bytes_for(cfg.moe_shape(), route_chunk, tokens.min(ROUTED_STEP_TOKENS));
    let wide = if tokens > ROUTED_STEP_TOKENS {
        RouteBuffers::bytes_for(cfg.moe_shape(), route_chunk, tokens)
    } else {
        0
    };
    small + wide
}

/// Elements of the f32 scratch buffers for steps of `t` tokens and `logit_rows` rows of logits
/// of a model of `cfg`'s shapes, in [`Scratch`]'s field order (`h` to `logits`).
pub(crate) fn scratch_sizes(cfg: &DecodeConfig, t: usize, logit_rows: usize) -> [usize; 14] {
    let h = cfg.hidden;
    let widest = |f: &dyn Fn(usize) -> usize| (0..cfg.layers).map(f).max().unwrap_or(0).max(1);
    [
        t * h,
        t * widest(&|l| cfg.proj_rows(l)),
        t * widest(&|l| cfg.qkv_width(l)),
        t * cfg.heads * widest(&|l| cfg.attn[l].head_dim),
        t * h,
        t * cfg.experts.max(1),
        t * cfg.top_k * h,
        t * cfg.top_k * 2 * cfg.inter,
        t * cfg.top_k * 2 * cfg.inter,
        t * cfg.top_k * h,
        t * widest(&|l| gu_width(cfg, l)),
        t * widest(&|l| cfg.mlp_inter(l)),
        t * h,
        logit_rows.min(t) * cfg.vocab,
    ]
}

/// Each tracked sequence's statistics buffer with its rows of the step as `(first row, rows,
/// slot)` segments.
pub(crate) type ResidualSegments<'a> = Vec<(&'a DeviceArray, Vec<(u32, u32, u32)>)>;

/// A prefill step's rows in runs of one sequence ([`kernels_cubecl::prefill_runs`]).
pub(crate) struct PrefillRuns {
    /// `[first row, rows]` per run, on the device.
    pub(crate) runs: DeviceArray,
    /// Runs.
    pub(crate) count: usize,
    /// Rows of the longest run.
    pub(crate) longest: usize,
    /// The length runs were cut at.
    pub(crate) max_rows: usize,
}

/// One chunk of a step in flight: what every stage reads (the device, the shapes, the
/// scratch buffers, the step's uploaded ids, positions and block tables) and the launches so far.
pub(crate) struct Fwd<'a, R: Runtime, KV> {
    pub(crate) c: &'a ComputeClient<R>,
    pub(crate) cfg: &'a DecodeConfig,
    pub(crate) s: &'a Scratch,
    pub(crate) tuning: &'a Tuning,
    pub(crate) kv: &'a DevicePools<R>,
    pub(crate) experts: &'a PagedExperts<R>,
    pub(crate) stats: &'a mut RouteStats,
    /// The step's slots, block tables and lengths.
    pub(crate) step: StepArrays,
    /// Token ids, positions and `[tokens]` of the step.
    pub(crate) ids: DeviceArray,
    pub(crate) pos: DeviceArray,
    pub(crate) meta: DeviceArray,
    /// Tokens of the chunk.
    pub(crate) t: usize,
    /// The rows the LM head computes, when not all: their indices and `[count]` on the device,
    /// and the count (a prefill needs only each prompt's last position).
    pub(crate) head_rows: Option<(DeviceArray, DeviceArray, usize)>,
    /// In a step with prompt chunks, its rows in runs of one sequence, cut at each length some
    /// layer's prefill attention wants (none in a decode step): attention then reads each
    /// run's cache once for all of its queries.
    pub(crate) runs: Vec<PrefillRuns>,
    /// The rows of each sequence whose prompt statistics the decoder gathers, with their
    /// buffer ([`crate::Decoder::track_residual`]).
    pub(crate) residual: ResidualSegments<'a>,
    pub(crate) launches: usize,
    pub(crate) _kv: PhantomData<KV>,
}

impl<'a, R: Runtime, KV: Float + CubeElement> Fwd<'a, R, KV> {
    /// The routing buffers of this step's size (see [`ROUTED_STEP_TOKENS`]).
    pub(crate) fn route_buffers(&self) -> &'a RouteBuffers {
        match &self.s.route_wide {
            Some(wide) if self.t > ROUTED_STEP_TOKENS => wide,
            _ => &self.s.route,
        }
    }
}

impl<R: Runtime, KV: Float + CubeElement> Fwd<'_, R, KV> {
    /// The statistics of the residual stream entering layer `l` (`h`) over the rows of each
    /// tracked sequence.
    pub(crate) fn residual_stats(&mut self, l: usize) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let mut n = 0;
        for (stats, segs) in &self.residual {
            kernels_cubecl::residual_stats(c, &s.h, cfg.hidden, segs, stats, l, cfg.layers)?;
            n += 1;
        }
        self.launches += n;
        Ok(())
    }

    /// Counts a launch that went through.
    pub(crate) fn launched(&mut self, r: Result<(), KernelError>) -> Result<(), DecodeError> {
        r?;
        self.launches += 1;
        Ok(())
    }

    /// The RMSNorm of weight `w` folded into a kernel's input.
    pub(crate) fn norm<'w>(&'w self, w: &'w DeviceArray) -> Option<RowNorm<'w>> {
        Some(RowNorm { w, params: &self.s.norm_params })
    }

    /// A dense GEMM of `n` outputs over `k` inputs where the decoder's dense GEMMs run.
    pub(crate) fn gemm(&self, n: usize, k: usize, bias: bool, accumulate: bool) -> DenseGemm {
        DenseGemm { n, k, bias, accumulate, mma: self.tuning.dense_mma, plain_rows: None }
    }

    /// `h = embed[ids] · embed_scale`.
    pub(crate) fn embed(&mut self, table: &DeviceArray) -> Result<(), DecodeError> {
        let (c, s) = (self.c, self.s);
        self.launched(embed(c, self.t, self.cfg.hidden, &self.ids, table, &s.embed_scale, &s.h))
    }

    /// `logits = head · final_norm(h)`, soft-capped where the model caps them; with
    /// `head_rows`, only those rows of `h`, gathered through the norm into `o` first, into the
    /// first rows of `logits`.
    pub(crate) fn final_norm_head(
        &mut self,
        norm: &DeviceArray,
        head: &DeviceArray,
    ) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let g = self.gemm(cfg.vocab, cfg.hidden, false, false);
        if let Some((idx, meta, n)) = self.head_rows.clone() {
            if n == 0 {
                return Ok(());
            }
            let h = cfg.hidden;
            self.launched(gather_rows_normed(c, n, 1, h, &meta, &s.h, self.norm(norm), &idx, &s.o))?;
            self.launched(dense_gemm(c, g, n, &meta, &s.o, head, &s.none, &s.logits))?;
            if cfg.softcap > 0.0 {
                self.launched(softcap(c, n, cfg.vocab, &meta, &s.logits, &s.softcap))?;
            }
            return Ok(());
        }
        self.launched(dense_gemm_normed(
            c,
            g,
            self.t,
            &self.meta,
            &s.h,
            self.norm(norm),
            head,
            &s.none,
            &s.logits,
        ))?;
        if cfg.softcap > 0.0 {
            self.launched(softcap(c, self.t, cfg.vocab, &self.meta, &s.logits, &s.softcap))?;
        }
        Ok(())
    }

    /// Gemma-4's sandwich norm of the attention output: `h += norm(o)`.
    pub(crate) fn add_norm(&mut self, w: &DeviceArray) -> Result<(), DecodeError> {
        let (c, s) = (self.c, self.s);
        self.launched(add_rms_norm(c, self.t, self.cfg.hidden, &s.o, w, &s.eps, &s.h))
    }

    /// Gemma-4's feed-forward epilogue in one launch: the routing weights times the
    /// per-expert scale combine the experts' outputs, then the three post-feed-forward norms
    /// (experts, dense branch, their sum), the residual and the layer scalar.
    pub(crate) fn gemma_ffn_out(&mut self, gl: &GemmaLayer) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let b = GemmaFfnOut {
            logits: &s.router_logits,
            per_expert_scale: &gl.per_expert_scale,
            pos: &self.route_buffers().pos,
            down: &s.down,
            mlp: &s.mlp_out,
            norms: &gl.post_norms,
            scalar: &gl.scalar,
            params: &s.eps,
            h: &s.h,
        };
        self.launched(gemma_ffn_out(c, self.t, cfg.experts, cfg.top_k, cfg.hidden, b))
    }
}
