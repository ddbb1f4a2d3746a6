//! The dense MLP (Qwen2-MoE's gated shared expert and dense layers, Gemma-4's dense GeGLU
//! branch): a gate|up GEMM of the normed residual, the activation `act(gate) · up` (times the
//! sigmoid of the shared expert's gate row), the down GEMM.

use cubecl::prelude::*;
use kernels_cubecl::DeviceArray;
use kernels_cubecl::gated_act;
use kernels_cubecl::{GatedInput, dense_gemm, dense_gemm_normed};

use super::Fwd;
use crate::DecodeError;
use crate::weights::{Mlp, gu_width};

/// Where a dense MLP's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MlpOut {
    /// Added into the residual `h`.
    Residual,
    /// Into the scratch `mlp_out`, for the epilogue that norms it (Gemma-4).
    Scratch,
}

impl<R: Runtime, KV: Float + CubeElement> Fwd<'_, R, KV> {
    /// Layer `l`'s MLP, first half: the gate|up GEMM of `norm(h)` (with Qwen's router logits
    /// after its outputs, see `crate::weights::router_in_mlp`).
    pub(crate) fn mlp_up(&mut self, l: usize, w: &Mlp, norm: &DeviceArray) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let g = self.gemm(gu_width(cfg, l), cfg.hidden, false, false);
        let norm = self.norm(norm);
        self.launched(dense_gemm_normed(c, g, self.t, &self.meta, &s.h, norm, &w.gate_up, &s.none, &s.mlp_gu))
    }

    /// Second half: the activation in a launch of its own, then the down GEMM into `out`.
    pub(crate) fn mlp_down(&mut self, l: usize, w: &Mlp, out: MlpOut) -> Result<(), DecodeError> {
        let (c, s, cfg, t) = (self.c, self.s, self.cfg, self.t);
        let inter = cfg.mlp_inter(l);
        let a = GatedInput { act: cfg.act, stride: gu_width(cfg, l), gated: cfg.mlp_rows(l) > 2 * inter };
        let d = self.gemm(cfg.hidden, inter, false, out == MlpOut::Residual);
        let y = if out == MlpOut::Residual { &s.h } else { &s.mlp_out };
        self.launched(gated_act(c, t, inter, a, &s.mlp_gu, (&s.mlp_act, inter)))?;
        self.launched(dense_gemm(c, d, t, &self.meta, &s.mlp_act, &w.down, &s.none, y))
    }
}
