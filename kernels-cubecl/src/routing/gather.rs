//! Gathering the routed experts' input rows into expert order (through the layer's RMSNorm),
//! alone or in the routing launch.

use cubecl::prelude::*;

use super::route::{check_route, route_cube, route_launch};
use super::{LogitsLayout, MoeShape, RouteBuffers, RouteCounters};
use crate::device::{bad, need, row_units};
use crate::norms::{RowNorm, norm_args, rms_norm_reference};
use crate::plane::{cube_sum, load_row};
use crate::pool::MAX_TOKENS;
use crate::{DeviceArray, KernelError};

/// `out[row] = x[gather[row]]` for `row < meta[0] · k`, with `norm` through an RMSNorm
/// (`norm_p = [eps, offset]`, weight `norm_w`: `x / rms(x) · (w + offset)`, offset 1 for
/// `1 + w` norms): the routed experts read the normed rows and the norm needs no launch of
/// its own. Grid `(max rows)`; cube: `units` units, unit `u` owning columns `u + i · units`
/// (`i < ⌈width / units⌉`, unrolled) so that all its loads are in flight together (one plane
/// looping over a wide row waits a DRAM latency per iteration). One row reduction per
/// gathered row: each token's row is normed `k` times, some ALU against a launch.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn gather_rows_kernel(
    x: &Array<f32>,
    gather: &Array<u32>,
    meta: &Array<u32>,
    norm_w: &Array<f32>,
    norm_p: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] k: usize,
    #[comptime] width: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
    #[comptime] norm: bool,
) {
    let row = CUBE_POS_X as usize;
    if row >= meta[0] as usize * k {
        terminate!();
    }
    gather_row(x, gather[row] as usize, row, norm_w, norm_p, out, width, units, plane_size, norm);
}

/// `out[row] = x[src]` (through the RMSNorm with `norm`) by the cube's `units` units.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_row(
    x: &Array<f32>,
    src: usize,
    row: usize,
    norm_w: &Array<f32>,
    norm_p: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] width: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
    #[comptime] norm: bool,
) {
    let per = comptime![width.div_ceil(units)];
    let u = UNIT_POS as usize;
    let mut xv = Array::<f32>::new(per);
    let ss = load_row(x, src * width, &mut xv, width, units);
    if comptime![norm] {
        // The norm's weights before any store: loaded between the stores, each column waits
        // out a round trip.
        let eps = norm_p[0];
        let off = norm_p[1];
        let mut wv = Array::<f32>::new(per);
        load_row(norm_w, 0usize, &mut wv, width, units);
        let inv = 1.0 / (cube_sum(ss, units, plane_size) / f32::cast_from(width) + eps).sqrt();
        #[unroll]
        for i in 0..per {
            let c = u + i * units;
            if c < width {
                out[row * width + c] = xv[i] * inv * (wv[i] + off);
            }
        }
    } else {
        #[unroll]
        for i in 0..per {
            let c = u + i * units;
            if c < width {
                out[row * width + c] = xv[i];
            }
        }
    }
}

/// Gathers `x` rows into expert order: `out[row] = x[gather[row]]`.
///
/// # Shapes
/// - `x`: `[tokens, width]`; `out`: `[tokens · k, width]`
#[allow(clippy::too_many_arguments)]
pub fn gather_rows<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    k: usize,
    width: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    gather: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    gather_rows_normed(client, tokens, k, width, meta, x, None, gather, out)
}

/// [`gather_rows`] of `norm(x)` when `norm` is given: `out[row] = rms_norm(x[gather[row]])`,
/// so the routed experts' input norm costs no launch of its own.
///
/// # Shapes
/// - `x`: `[tokens, width]`; `norm.w`: `[width]`; `out`: `[tokens · k, width]`
#[allow(clippy::too_many_arguments)]
pub fn gather_rows_normed<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    k: usize,
    width: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    gather: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    need("gather x", x, tokens * width)?;
    need("gather out", out, tokens * k * width)?;
    need("gather index", gather, tokens * k)?;
    if let Some(nm) = norm {
        need("gather norm weight", nm.w, width)?;
        need("gather norm params", nm.params, 2)?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let (units, plane) = row_units(client, width, 16);
    if width > 32 * units {
        return Err(bad(format!("gather: width {width} exceeds 32 values per unit of {units} units")));
    }
    let (nw, np) = norm_args(norm, x, meta);
    // SAFETY: sizes checked above; indices come from `moe_route`, below `tokens`.
    unsafe {
        gather_rows_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((tokens * k) as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            x.arg(),
            gather.arg(),
            meta.arg(),
            nw.arg(),
            np.arg(),
            out.arg(),
            k,
            width,
            units,
            plane,
            norm.is_some(),
        )
    };
    Ok(())
}

/// CPU reference of [`gather_rows_normed`] (of [`gather_rows`] with `norm = None`): the rows
/// `x[gather[row]]`, each through [`rms_norm_reference`] with `(w, eps, offset)` when given.
pub fn gather_rows_reference(
    x: &[f32],
    width: usize,
    gather: &[u32],
    norm: Option<(&[f32], f32, f32)>,
) -> Vec<f32> {
    gather
        .iter()
        .flat_map(|&t| {
            let row = &x[t as usize * width..][..width];
            match norm {
                Some((w, eps, off)) => rms_norm_reference(row, w, eps, off),
                None => row.to_vec(),
            }
        })
        .collect()
}

/// [`moe_route_kernel`] and the row gather of [`gather_rows_kernel`] (with its optional norm)
/// in one launch: cube `row` (grid `(max rows)`) recomputes the step's routing in shared
/// memory — the same selection in the same order, some ALU that every cube runs in
/// parallel, against a launch — to learn which token its gathered row holds; cube 0 alone
/// writes the routing outputs (weights, positions, work items, statistics). Token `t`'s logits
/// are `logits[t · lstride + loff ..][..experts]` (a GEMM may have computed them beside other
/// outputs). Cube: at least `max(experts, max_tokens)` units and the gather's `units`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn route_gather_kernel(
    logits: &Array<f32>,
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
    #[comptime] lstride: usize,
    #[comptime] loff: usize,
) {
    let row = CUBE_POS_X as usize;
    let tokens = meta[0] as usize;
    if row >= tokens * k {
        terminate!();
    }
    let t = route_cube(
        &logits.to_slice(),
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
        lstride,
        loff,
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

/// [`moe_route_counted`] and [`gather_rows_normed`] of `x` by its routing in one launch (see
/// [`decode::route_gather_kernel`]): the routed experts' input is ready one launch after the
/// router logits. `out.gather` is written too.
///
/// # Shapes
/// - `logits`: `[tokens, layout.stride]`; `slots`: `[experts · 6]`; `x`: `[tokens, hidden]`;
///   `xg`: `[tokens · k, hidden]`
#[allow(clippy::too_many_arguments)]
pub fn moe_route_gather<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    (logits, layout): (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    xg: &DeviceArray,
) -> Result<(), KernelError> {
    let (units, plane) =
        check_route_gather(client, shape, tokens, (logits, layout), slots, out, stats, x, norm, xg)?;
    if tokens == 0 {
        return Ok(());
    }
    if tokens > MAX_TOKENS {
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
    // SAFETY: sizes checked above; outputs were sized for MAX_TOKENS tokens by RouteBuffers;
    // the gathered rows' tokens come from the routing, below `tokens`.
    unsafe {
        route_gather_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((tokens * shape.k) as u32, 1, 1),
            CubeDim::new_1d(units as u32),
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
            layout.stride,
            layout.offset,
        )
    };
    Ok(())
}

/// A step of more than `MAX_TOKENS` tokens (arguments checked by [`check_route_gather`]): every
/// cube of the fused launch would route all the tokens again, so the routing runs once, in a
/// cube of its own, and the gather follows it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_then_gather<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    logits: (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    xg: &DeviceArray,
) -> Result<(), KernelError> {
    route_launch(client, shape, tokens, meta, logits, slots, out, stats);
    gather_rows_normed(client, tokens, shape.k, shape.hidden, meta, x, norm, &out.gather, xg)
}

/// The checks [`moe_route_gather`] and [`moe_route_gather_router`] share (the routing's,
/// [`check_route`], and the gather's); returns the cube's units and the plane size.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_route_gather<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    logits: (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    xg: &DeviceArray,
) -> Result<(usize, usize), KernelError> {
    check_route(shape, tokens, logits, slots, out, stats)?;
    let width = shape.hidden;
    need("gather x", x, tokens * width)?;
    need("gather out", xg, tokens * shape.k * width)?;
    if let Some(nm) = norm {
        need("gather norm weight", nm.w, width)?;
        need("gather norm params", nm.params, 2)?;
    }
    // The routing needs a unit per expert and per token, the gather up to 16 values per unit.
    let (units, plane) = row_units(client, width.max(16 * shape.experts.max(MAX_TOKENS)), 16);
    if width > 32 * units || units < shape.experts.max(MAX_TOKENS) {
        return Err(bad(format!("moe_route_gather: width {width} or {shape:?} too wide for {units} units")));
    }
    Ok((units, plane))
}
