//! A small router's GEMM folded into the routing and gather launch.

use cubecl::prelude::*;
use half::f16;

use super::gather::{check_route_gather, gather_row, route_then_gather};
use super::route::route_cube;
use super::{LogitsLayout, MoeShape, RouteBuffers, RouteCounters};
use crate::device::{bad, need, row_units};
use crate::norms::{RowNorm, norm_args, rms_norm_reference};
use crate::plane::warp_sum;
use crate::pool::MAX_TOKENS;
use crate::{DeviceArray, KernelError};

/// The largest router (`experts · hidden` weights) [`moe_route_gather_router`] folds into the
/// routing launch: every routing cube reads the whole router and recomputes every token's
/// logits, so the cost grows with it. Mixtral's 8 × 4096 (64 KiB of f16, L2-resident after
/// the first cube, ~2k FMAs per unit) fits; Qwen1.5-MoE's 60 × 2048 router sits in the shared
/// expert's GEMM anyway, and Gemma-4's 128 × 2816 (11× Mixtral's, with its own norm, read
/// again by its FFN epilogue) keeps its GEMM.
pub const FUSED_ROUTER_MAX_WEIGHTS: usize = 64 * 1024;

/// The most experts [`moe_route_gather_router`] takes: each unit keeps a partial sum per expert
/// in registers.
pub const FUSED_ROUTER_MAX_EXPERTS: usize = 32;

/// Shared memory [`moe_route_gather_router`] may take for its partial sums (lavapipe offers
/// 32 KiB, the H200 48 KiB without opting in).
const FUSED_ROUTER_MAX_SHARED: usize = 24 * 1024;

/// Whether [`moe_route_gather_router`] takes a router of this shape on this device (see
/// [`FUSED_ROUTER_MAX_WEIGHTS`]; its partial sums must also fit in shared memory).
pub fn router_fusable<R: Runtime>(client: &ComputeClient<R>, shape: MoeShape) -> bool {
    shape.experts <= FUSED_ROUTER_MAX_EXPERTS
        && shape.experts * shape.hidden <= FUSED_ROUTER_MAX_WEIGHTS
        && router_shared(client, shape) <= FUSED_ROUTER_MAX_SHARED
}

/// Bytes of shared memory of [`decode::route_gather_router_kernel`]'s partial sums and logits.
fn router_shared<R: Runtime>(client: &ComputeClient<R>, shape: MoeShape) -> usize {
    let (units, plane) = row_units(client, shape.hidden.max(16 * shape.experts.max(MAX_TOKENS)), 16);
    4 * MAX_TOKENS * ((units / plane) * (shape.experts + 1) + shape.experts)
}

/// CPU reference of the router logits [`moe_route_gather_router`] computes:
/// `norm(x) · routerᵀ` with `norm = (w, eps, offset)` as [`rms_norm_reference`].
///
/// # Shapes
/// - `x`: `[tokens, hidden]`; `router`: `[experts, hidden]`; returns `[tokens, experts]`
pub fn router_logits_reference(
    x: &[f32],
    router: &[f16],
    hidden: usize,
    norm: Option<(&[f32], f32, f32)>,
) -> Vec<f32> {
    let xn = match norm {
        Some((w, eps, off)) => rms_norm_reference(x, w, eps, off),
        None => x.to_vec(),
    };
    xn.chunks(hidden)
        .flat_map(|row| {
            router.chunks(hidden).map(move |r| row.iter().zip(r).map(|(a, b)| a * b.to_f32()).sum::<f32>())
        })
        .collect()
}

/// [`route_gather_kernel`] with the router GEMM folded in: every cube first computes all the
/// step's router logits `logits[t, e] = Σ_c norm(x)[t, c] · router[e, c]` (`router` f16
/// `[experts, hidden]`, the norm the gather's own) into shared memory, then routes and gathers
/// as [`route_gather_kernel`] does; cube 0 also writes the logits to `logits_out`. Only for a
/// small router (the host launcher bounds `experts · hidden`): each cube reads the whole
/// router (from L2 after the first) and `x`: some ALU in parallel against a launch and the
/// round trip of the logits through memory.
///
/// The dot products: unit `u` owns the vectors `u + i · units` of `vec` columns (16-byte loads
/// of the router on CUDA), every router vector it needs loaded before any is used, keeps one
/// partial sum per expert for the token in hand, reduces each over its plane and leaves the
/// planes' sums (and the sum of squares of the norm) in shared memory; after one barrier units
/// sum the planes' partials of each (token, expert) and apply the norm's per-token scale, as
/// `dense_gemm_kernel` does with its norm (read one half at a time under a column guard, each
/// round of loads was a DRAM round trip). Cube: `units` units, a multiple of `plane_size`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn route_gather_router_kernel<N: Size>(
    router: &Array<Vector<f16, N>>,
    x_vec: &Array<Vector<f32, N>>,
    norm_w_vec: &Array<Vector<f32, N>>,
    logits_out: &mut Array<f32>,
    slots: &Array<u32>,
    meta: &Array<u32>,
    x: &Array<f32>,
    norm_w: &Array<f32>,
    norm_p: &Array<f32>,
    xg: &mut Array<f32>,
    weights: &mut Array<f32>,
    gather: &mut Array<u32>,
    pos: &mut Array<u32>,
    desc_gate_up: &mut Array<u32>,
    desc_down: &mut Array<u32>,
    groups: &mut Array<u32>,
    counts: &mut Array<u32>,
    mass: &mut Array<f32>,
    base: u32,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] max_tokens: usize,
    #[comptime] renormalize: bool,
    #[comptime] hidden: usize,
    #[comptime] inter: usize,
    #[comptime] chunk: usize,
    #[comptime] chunks: usize,
    #[comptime] stats: bool,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
    #[comptime] norm: bool,
    #[comptime] vec: usize,
) {
    let row = CUBE_POS_X as usize;
    let tokens = meta[0] as usize;
    if row >= tokens * k {
        terminate!();
    }
    let planes = comptime![units / plane_size];
    let mut part = SharedMemory::<f32>::new(comptime![max_tokens * planes * (experts + 1)]);
    let mut lg = SharedMemory::<f32>::new(comptime![max_tokens * experts]);
    router_logits(
        router, x_vec, norm_w_vec, norm_p, logits_out, &mut part, &mut lg, tokens, row, experts, hidden,
        units, plane_size, norm, vec,
    );
    let t = route_cube(
        &lg.to_slice(),
        slots,
        tokens,
        weights,
        gather,
        pos,
        desc_gate_up,
        desc_down,
        groups,
        counts,
        mass,
        base,
        row,
        row == 0,
        row,
        tokens * k,
        experts,
        0usize,
        experts,
        k,
        max_tokens,
        renormalize,
        hidden,
        inter,
        chunk,
        chunks,
        stats,
        units,
        plane_size,
    );
    gather_row(x, t, row, norm_w, norm_p, xg, hidden, units, plane_size, norm);
}

/// The step's router logits `norm(x) · routerᵀ` of every token into `lg` (and, in cube 0, into
/// `logits_out`), through the planes' partial sums in `part` (see
/// [`route_gather_router_kernel`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn router_logits<N: Size>(
    router: &Array<Vector<f16, N>>,
    x_vec: &Array<Vector<f32, N>>,
    norm_w_vec: &Array<Vector<f32, N>>,
    norm_p: &Array<f32>,
    logits_out: &mut Array<f32>,
    part: &mut SharedMemory<f32>,
    lg: &mut SharedMemory<f32>,
    tokens: usize,
    row: usize,
    #[comptime] experts: usize,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
    #[comptime] norm: bool,
    #[comptime] vec: usize,
) {
    let u = UNIT_POS as usize;
    let planes = comptime![units / plane_size];
    let hv = comptime![hidden / vec];
    let per = comptime![hv.div_ceil(units)];
    // Per (token, plane): the plane's partial dot product with each expert's row, then its
    // partial sum of squares.
    let stride = comptime![experts + 1];
    // This unit's vectors; past the row they read the last one and count zero.
    let mut vi = Array::<usize>::new(per);
    let mut live = Array::<f32>::new(per);
    #[unroll]
    for i in 0..per {
        let v = u + i * units;
        vi[i] = min(v, comptime![hv - 1]);
        live[i] = select(v < hv, 1.0f32, 0.0f32);
    }
    // The router's vectors and the norm weight (with its offset) in f32, once for every token.
    let mut rw = Array::<Vector<f16, N>>::new(comptime![per * experts]);
    #[unroll]
    for i in 0..per {
        #[unroll]
        for e in 0..experts {
            rw[i * experts + e] = router[e * hv + vi[i]];
        }
    }
    let mut gw = Array::<f32>::new(comptime![per * vec]);
    let mut off = 0.0f32;
    if comptime![norm] {
        off = norm_p[1];
    }
    #[unroll]
    for i in 0..per {
        if comptime![norm] {
            let g = norm_w_vec[vi[i]];
            #[unroll]
            for j in 0..vec {
                gw[i * vec + j] = (g[j] + off) * live[i];
            }
        } else {
            #[unroll]
            for j in 0..vec {
                gw[i * vec + j] = live[i];
            }
        }
    }
    let lane = u % plane_size;
    let p = u / plane_size;
    for t in 0..tokens {
        let mut xv = Array::<Vector<f32, N>>::new(per);
        #[unroll]
        for i in 0..per {
            xv[i] = x_vec[t * hv + vi[i]];
        }
        let mut acc = Array::<f32>::new(experts);
        #[unroll]
        for e in 0..experts {
            acc[e] = 0.0;
        }
        let mut ss = 0.0f32;
        #[unroll]
        for i in 0..per {
            #[unroll]
            for j in 0..vec {
                let xj = xv[i][j] * live[i];
                ss += xj * xj;
                let v = xj * gw[i * vec + j];
                #[unroll]
                for e in 0..experts {
                    acc[e] += v * f32::cast_from(rw[i * experts + e][j]);
                }
            }
        }
        let at = (t * planes + p) * stride;
        #[unroll]
        for e in 0..experts {
            let sum = warp_sum(acc[e], plane_size);
            if lane == 0 {
                part[at + e] = sum;
            }
        }
        let sq = warp_sum(ss, plane_size);
        if lane == 0 {
            part[at + experts] = sq;
        }
    }
    sync_cube();
    for j in range_stepped(u, tokens * experts, units) {
        let t = j / experts;
        let e = j % experts;
        let mut d = 0.0f32;
        let mut sq = 0.0f32;
        for q in 0..planes {
            d += part[(t * planes + q) * stride + e];
            sq += part[(t * planes + q) * stride + experts];
        }
        let mut v = d;
        if comptime![norm] {
            v = d / (sq / f32::cast_from(hidden) + norm_p[0]).sqrt();
        }
        lg[j] = v;
        if row == 0 {
            logits_out[j] = v;
        }
    }
    sync_cube();
}

/// [`moe_route_gather`] with the router GEMM in the same launch (see
/// [`decode::route_gather_router_kernel`]): the logits `norm(x) · routerᵀ` are computed in each
/// routing cube (the norm is the gather's), and written to `logits` by one of them. For
/// routers that pass [`router_fusable`] only. Steps of more than `MAX_TOKENS` tokens run the
/// router's GEMM, then the routing and the gather as [`moe_route_gather`] does.
///
/// # Shapes
/// - `router`: f16 `[experts, hidden]`; `logits`: `[tokens, experts]`; `slots`: `[experts · 6]`;
///   `x`: `[tokens, hidden]`; `xg`: `[tokens · k, hidden]`
#[allow(clippy::too_many_arguments)]
pub fn moe_route_gather_router<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    (router, logits): (&DeviceArray, &DeviceArray),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    xg: &DeviceArray,
) -> Result<(), KernelError> {
    if !router_fusable(client, shape) {
        return Err(bad(format!(
            "moe_route_gather_router: a router of {} × {} is above {FUSED_ROUTER_MAX_EXPERTS} experts, \
             {FUSED_ROUTER_MAX_WEIGHTS} weights or {FUSED_ROUTER_MAX_SHARED} bytes of shared memory \
             (use its own GEMM and moe_route_gather)",
            shape.experts, shape.hidden
        )));
    }
    need("moe_route_gather_router router", router, shape.experts * shape.hidden)?;
    let layout = LogitsLayout { stride: shape.experts, offset: 0 };
    let (units, plane) =
        check_route_gather(client, shape, tokens, (logits, layout), slots, out, stats, x, norm, xg)?;
    if tokens == 0 {
        return Ok(());
    }
    if tokens > MAX_TOKENS {
        // The cube's shared memory holds `MAX_TOKENS` tokens' partial logits: a larger step
        // computes them in a GEMM of their own first.
        let g = crate::DenseGemm::new(shape.experts, shape.hidden);
        crate::dense_gemm_normed(client, g, tokens, meta, x, norm, router, logits, logits)?;
        return route_then_gather(
            client,
            shape,
            tokens,
            meta,
            (logits, layout),
            slots,
            out,
            stats,
            x,
            norm,
            xg,
        );
    }
    let (counts, mass, base) = out.counters(stats);
    let (nw, np) = norm_args(norm, x, meta);
    // The widest load the device likes that divides the row (16 bytes of halves on CUDA).
    let vec = client
        .io_optimized_vector_sizes(2)
        .filter(|v| *v <= 8 && shape.hidden.is_multiple_of(*v))
        .max()
        .unwrap_or(1);
    // SAFETY: sizes checked above; outputs were sized for MAX_TOKENS tokens by RouteBuffers;
    // the gathered rows' tokens come from the routing, below `tokens`. The vector views cover
    // whole buffers (`x` holds `tokens` rows of `hidden`, a multiple of `vec`), so their starts
    // are aligned for any width.
    unsafe {
        route_gather_router_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((tokens * shape.k) as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            vec,
            ArrayArg::from_raw_parts(router.handle.clone(), shape.experts * shape.hidden / vec),
            ArrayArg::from_raw_parts(x.handle.clone(), (x.len / vec).max(1)),
            ArrayArg::from_raw_parts(nw.handle.clone(), (nw.len / vec).max(1)),
            logits.arg(),
            slots.arg(),
            meta.arg(),
            x.arg(),
            nw.arg(),
            np.arg(),
            xg.arg(),
            out.weights.arg(),
            out.gather.arg(),
            out.pos.arg(),
            out.desc_gate_up.arg(),
            out.desc_down.arg(),
            out.groups.arg(),
            counts.arg(),
            mass.arg(),
            base as u32,
            shape.experts,
            shape.k,
            MAX_TOKENS,
            shape.renormalize,
            shape.hidden,
            shape.inter,
            out.chunk,
            out.chunks(),
            stats.is_some(),
            units,
            plane,
            norm.is_some(),
            vec,
        )
    };
    Ok(())
}
