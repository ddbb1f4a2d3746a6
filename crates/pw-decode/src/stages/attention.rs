//! The attention block: the fused Q|K|V projection of `input_layernorm(h)` (plus Qwen's
//! biases) → RoPE and the K/V append into the paged cache (with Gemma-4's per-head norms) →
//! paged attention (decode, or prefill over runs of a prompt chunk's rows) → the O projection.

use cubecl::prelude::*;
use kernels_cubecl::{HeadNorm, PrefillKernel, head_norm_rope_append, prefill_run_rows};
use kernels_cubecl::{RowLayout, paged_decode_attention_strided, paged_prefill_attention, rope_append};
use kernels_cubecl::{dense_gemm, dense_gemm_normed};

use super::Fwd;
use crate::DecodeError;
use crate::weights::Layer;

/// Where the attention block's O projection goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttnOut {
    /// Added into the residual `h`.
    Residual,
    /// Into the scratch `o`, for a norm before the residual (Gemma-4's sandwich norm).
    Scratch,
}

impl<R: Runtime, KV: Float + CubeElement> Fwd<'_, R, KV> {
    /// Layer `l`'s attention over the step's tokens and their cached context.
    pub(crate) fn attention(&mut self, l: usize, layer: &Layer, out: AttnOut) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let (h, nh, hd) = (cfg.hidden, cfg.heads, cfg.attn[l].head_dim);
        self.qkv_rope_append(l, layer)?;
        let (kp, vp) = self.kv.layer(l);
        let attn_shape = self.kv.geometry().attn_shape(l);
        let qkv_w = cfg.qkv_width(l);
        let step = &self.step;
        let want = prefill_run_rows::<R, KV>(c, &attn_shape);
        let runs = self.runs.iter().find(|r| r.max_rows == want).or(self.runs.first());
        let r = match runs {
            Some(runs) => paged_prefill_attention::<R, KV>(
                c,
                attn_shape,
                PrefillKernel::Auto,
                self.t,
                &runs.runs,
                runs.count,
                runs.longest,
                &s.qkv,
                qkv_w,
                kp,
                vp,
                &step.table,
                &step.lens,
                &layer.scale,
                &s.attn,
            ),
            None => paged_decode_attention_strided::<R, KV>(
                c,
                attn_shape,
                self.t,
                step.max_len,
                &s.qkv,
                qkv_w,
                kp,
                vp,
                &step.table,
                &step.lens,
                &layer.scale,
                &s.attn,
            ),
        };
        self.launched(r)?;
        let o = self.gemm(h, nh * hd, false, out == AttnOut::Residual);
        let o_out = if out == AttnOut::Residual { &s.h } else { &s.o };
        self.launched(dense_gemm(c, o, self.t, &self.meta, &s.attn, &layer.wo, &s.none, o_out))
    }

    /// The projection of `input_layernorm(h)` (one GEMM with the norm folded in), then one
    /// launch that rotates Q and K (after Gemma-4's head norms) and appends K and V to the cache.
    fn qkv_rope_append(&mut self, l: usize, layer: &Layer) -> Result<(), DecodeError> {
        let (c, s, cfg, t) = (self.c, self.s, self.cfg, self.t);
        let a = &cfg.attn[l];
        let (nh, hd, kvh, qkv_w) = (cfg.heads, a.head_dim, a.kv_heads, cfg.qkv_width(l));
        let rows = cfg.proj_rows(l);
        let proj_out = if layer.head_norms.is_some() { &s.proj } else { &s.qkv };
        let g = self.gemm(rows, cfg.hidden, layer.bqkv.is_some(), false);
        let bias = layer.bqkv.as_ref().unwrap_or(&s.none);
        let norm = self.norm(&layer.input_norm);
        self.launched(dense_gemm_normed(c, g, t, &self.meta, &s.h, norm, &layer.wqkv, bias, proj_out))?;
        let (kp, vp) = self.kv.layer(l);
        let (pos, slots) = (&self.pos, &self.step.slots);
        let Some(w) = &layer.head_norms else {
            let attn_shape = self.kv.geometry().attn_shape(l);
            let layout = RowLayout { stride: qkv_w, k_off: nh * hd, v_off: (nh + kvh) * hd };
            let r = rope_append::<R, KV>(
                c,
                attn_shape,
                t,
                layout,
                hd,
                &s.qkv,
                pos,
                &layer.inv_freq,
                slots,
                kp,
                vp,
            );
            return self.launched(r);
        };
        let g = HeadNorm {
            heads: nh,
            kv_heads: kvh,
            head_dim: hd,
            src_stride: rows,
            qk_norm: true,
            v_norm: true,
            k_eq_v: a.k_eq_v,
        };
        let r = head_norm_rope_append::<R, KV>(
            c,
            g,
            t,
            hd,
            &s.proj,
            w,
            &s.eps,
            pos,
            &layer.inv_freq,
            slots,
            (&s.qkv, qkv_w),
            kp,
            vp,
        );
        self.launched(r)
    }
}
