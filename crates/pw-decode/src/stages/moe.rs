//! The routed experts: router logits of the normed residual, on-device softmax/top-k that
//! writes the grouped kernels' descriptors (and the planner's routing counts when armed) with
//! the gather of the normed rows in the same launch, the grouped bit-plane GEMVs (or the grouped
//! GEMM, [`kernels_cubecl::GroupedMode`]) for gate_up and down, and the weighted combine into
//! the residual.

use cubecl::prelude::*;
use kernels_cubecl::Activation;
use kernels_cubecl::DeviceArray;
use kernels_cubecl::gated_act;
use kernels_cubecl::{
    GatedInput, GroupedGemm, LogitsLayout, ap_gemm_grouped, ap_gemm_routed, ap_gemm_routed_gated,
    dense_gemm_normed, mean_tokens, moe_combine, moe_route_gather, moe_route_gather_router,
};

use super::{ExpertAct, Fwd};
use crate::DecodeError;
use crate::paged::LayerPool;
use crate::weights::{gu_width, mlp_stride};

/// Where a routing launch finds the router logits of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Logits {
    /// In the scratch router logits, from the router's GEMM ([`Fwd::router_logits`]).
    Router,
    /// After the layer's dense MLP gate|up outputs, from the same GEMM
    /// (`crate::weights::router_in_mlp`).
    Mlp,
}

impl<'a, R: Runtime, KV: Float + CubeElement> Fwd<'a, R, KV> {
    /// Layer `l`'s routed experts (an error for a layer without any).
    pub(crate) fn expert_pool(&self, l: usize) -> Result<LayerPool<'a>, DecodeError> {
        self.experts.layer(l).ok_or_else(|| DecodeError::Unsupported(format!("layer {l}: no routed experts")))
    }

    /// Routing of `norm(h)` by `router`: the logits computed in the routing launch itself where
    /// the router is small enough (Mixtral's 8 × 4096, see
    /// `kernels_cubecl::router_fusable`), else in a GEMM of their own.
    pub(crate) fn route(
        &mut self,
        l: usize,
        ex: &LayerPool<'_>,
        router: &DeviceArray,
        norm: &DeviceArray,
    ) -> Result<(), DecodeError> {
        if !self.tuning.fused_router {
            self.router_logits(router, norm)?;
            return self.route_gather(l, ex, Logits::Router, norm);
        }
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let route = self.route_buffers();
        let counters = self.stats.counters(cfg.moe_shape(), l, self.t)?;
        let r = moe_route_gather_router(
            c,
            cfg.moe_shape(),
            self.t,
            &self.meta,
            (router, &s.router_logits),
            ex.slots,
            route,
            counters,
            &s.h,
            Some(kernels_cubecl::RowNorm { w: norm, params: &s.norm_params }),
            &s.xg,
        );
        self.launched(r)
    }

    /// The router logits of `norm(h)` in a GEMM of their own.
    pub(crate) fn router_logits(
        &mut self,
        router: &DeviceArray,
        norm: &DeviceArray,
    ) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let g = self.gemm(cfg.experts, cfg.hidden, false, false);
        let norm = self.norm(norm);
        self.launched(dense_gemm_normed(
            c,
            g,
            self.t,
            &self.meta,
            &s.h,
            norm,
            router,
            &s.none,
            &s.router_logits,
        ))
    }

    /// Routing (+ statistics) of the `logits` of layer `l` and the gather of `norm(h)`.
    pub(crate) fn route_gather(
        &mut self,
        l: usize,
        ex: &LayerPool<'_>,
        logits: Logits,
        norm: &DeviceArray,
    ) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let logits = match logits {
            Logits::Router => (&s.router_logits, LogitsLayout { stride: cfg.experts, offset: 0 }),
            Logits::Mlp => (&s.mlp_gu, LogitsLayout { stride: gu_width(cfg, l), offset: mlp_stride(cfg, l) }),
        };
        let route = self.route_buffers();
        let counters = self.stats.counters(cfg.moe_shape(), l, self.t)?;
        let norm = Some(kernels_cubecl::RowNorm { w: norm, params: &s.norm_params });
        let r = moe_route_gather(
            c,
            cfg.moe_shape(),
            self.t,
            &self.meta,
            logits,
            ex.slots,
            route,
            counters,
            &s.h,
            norm,
            &s.xg,
        );
        self.launched(r)
    }

    /// The routed experts of the gathered rows up to their outputs, with their activation in
    /// the gate_up GEMV's epilogue where the launch shape allows, else a launch of its own.
    pub(crate) fn experts(&mut self, ex: &LayerPool<'_>) -> Result<(), DecodeError> {
        let (c, s, cfg, t) = (self.c, self.s, self.cfg, self.t);
        if self.tuning.grouped.grouped(c, t * cfg.top_k, cfg.experts) {
            return self.experts_grouped(ex);
        }
        let (h, i, e, gemm) = (cfg.hidden, cfg.inter, cfg.experts, self.tuning.gemm);
        let route = self.route_buffers();
        let (gu, dn, chunk) = (&route.desc_gate_up, &route.desc_down, route.chunk());
        let routed = |desc, n, k, x, y, act| {
            ap_gemm_routed(c, gemm, ex.planes, ex.luts, desc, chunk, e, n, k, t, x, y, act)
        };
        let fused = self.tuning.expert_act == ExpertAct::GateUpEpilogue
            && ap_gemm_routed_gated(
                c,
                gemm,
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
            self.launches += 1;
            return self.launched(routed(dn, h, i, &s.gate_up, &s.down, Activation::Applied));
        }
        self.launched(routed(gu, 2 * i, h, &s.xg, &s.gate_up, Activation::None))?;
        let a = GatedInput { act: cfg.act, stride: 2 * i, gated: false };
        self.launched(gated_act(c, t * cfg.top_k, i, a, &s.gate_up, (&s.expert_act, 2 * i)))?;
        self.launched(routed(dn, h, i, &s.expert_act, &s.down, Activation::Applied))
    }

    /// The routed experts through the grouped GEMM over the routing's groups table: gate_up
    /// with `act(gate) · up` in its epilogue into `[rows, I]`, then down; each expert's weights
    /// decoded once per pass of its tokens.
    fn experts_grouped(&mut self, ex: &LayerPool<'_>) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        let (h, i, rows) = (cfg.hidden, cfg.inter, self.t * cfg.top_k);
        let mean = mean_tokens(rows, cfg.experts);
        let (gate_up, down) = GroupedGemm::layer(cfg.experts, h, i, cfg.act);
        let groups = &self.route_buffers().groups;
        for (g, x, y) in [(gate_up, &s.xg, &s.expert_act), (down, &s.expert_act, &s.down)] {
            let r = ap_gemm_grouped(c, g, true, ex.planes, ex.luts, ex.slots, groups, rows, mean, x, y);
            self.launched(r)?;
        }
        Ok(())
    }

    /// `h += Σ_k weight_k · down_k`: the experts' outputs combined into the residual.
    pub(crate) fn combine(&mut self) -> Result<(), DecodeError> {
        let (c, s, cfg) = (self.c, self.s, self.cfg);
        self.launched(moe_combine(
            c,
            self.t,
            cfg.top_k,
            cfg.hidden,
            &s.down,
            &self.route_buffers().pos,
            &self.route_buffers().weights,
            &s.h,
        ))
    }
}
