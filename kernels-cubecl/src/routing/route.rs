//! The routing kernel: top-k per token, each expert's gathered rows, and the work items.

use cubecl::prelude::*;

use super::{LogitsLayout, MoeShape, RouteBuffers, RouteCounters};
use crate::device::{bad, need, row_units};
use crate::plane::{warp_arg_max, warp_max, warp_sum};
use crate::{DeviceArray, KernelError};

/// Units of the routing cube of a step of its own (clamped to what the device allows): the
/// top-k, grouping and work items of a step of hundreds of tokens spread over many planes.
const ROUTE_UNITS: usize = 1024;

/// Most (token, expert) choices routed in one cube with the step's selection in shared memory
/// (8 bytes each); a larger step selects in a launch of its own ([`moe_select_kernel`]).
pub const ROUTE_SHARED_CHOICES: usize = 2048;

/// Planes (tokens) per cube of [`moe_select_kernel`].
const SELECT_PLANES: usize = 8;

/// Routing and grouping in one cube of `units` units (whole planes of `plane_size`, at least
/// `experts`):
/// 1. a plane per token `t < meta[0]`: softmax over `logits[t · lstride + loff ..][..experts]`,
///    top-`k` (ties: lower expert first), optional renormalisation → `weights[t, j]`;
/// 2. expert `e` (a plane per expert, in turn): its tokens in token order get consecutive
///    gathered rows after every lower expert's; writes `gather[row] = t`, `pos[t, j] = row` and
///    the work items of expert `e`
///    (gate_up: `[2I, H]`, down: `[H, I]`, from `slots[e] = (gate_up plane_off, lut_off, bits,
///    down plane_off, lut_off, bits)`), items of up to `chunk` tokens each, so the grouped
///    GEMM runs with no host round trip: the live items packed at the front of each table (in
///    expert order), the rest not written, and their count in the header slot that follows the
///    table's `experts · chunks` items (see [`super::RouteBuffers`]);
/// 3. with `stats`, expert `e`'s plane also adds its token count to `counts[base + e]` and the
///    sum of its choices' weights to `mass[base + e]`: the planner's routing
///    statistics at no launch of their own.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn moe_route_kernel(
    logits: &Array<f32>,
    slots: &Array<u32>,
    meta: &Array<u32>,
    weights: &mut Array<f32>,
    gather: &mut Array<u32>,
    pos: &mut Array<u32>,
    desc_gate_up: &mut Array<u32>,
    desc_down: &mut Array<u32>,
    groups: &mut Array<u32>,
    counts: &mut Array<u32>,
    mass: &mut Array<f32>,
    base: u32,
    #[comptime] lstride: usize,
    #[comptime] loff: usize,
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
) {
    let tokens = meta[0] as usize;
    route_cube(
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
        tokens * k,
        true,
        0usize,
        1usize,
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
}

/// Softmax and top-k of one token's logits `logits[base ..][..experts]` by one plane, lane `l`
/// holding experts `l + j · plane_size`: every lane gets the selected experts `ge[jj]` (the k
/// largest, ties to the lower expert) and their softmax probabilities `pv[jj]`, rather than a
/// unit scanning all experts k times (Gemma-4 has 128 experts and k = 8).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn plane_top_k(
    logits: &Slice<f32>,
    base: usize,
    lane: usize,
    ge: &mut Array<u32>,
    pv: &mut Array<f32>,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] plane_size: usize,
) {
    let per = comptime![experts.div_ceil(plane_size)];
    let lowest = f32::new(-3.0e38);
    let mut v = Array::<f32>::new(per);
    let mut m = lowest;
    #[unroll]
    for j in 0..per {
        let e = lane + j * plane_size;
        let mut x = lowest;
        if e < experts {
            x = logits[base + e];
        }
        v[j] = x;
        m = max(m, x);
    }
    m = warp_max(m, plane_size);
    let mut z = 0.0f32;
    #[unroll]
    for j in 0..per {
        if lane + j * plane_size < experts {
            z += (v[j] - m).exp();
        }
    }
    z = warp_sum(z, plane_size);
    // Each lane's best (its experts ascending, strict >), then the plane's best pair, the lower
    // expert on ties.
    #[unroll]
    for jj in 0..k {
        let mut bv = lowest;
        let mut be = 0xFFFF_FFFFu32;
        #[unroll]
        for j in 0..per {
            if lane + j * plane_size < experts && v[j] > bv {
                bv = v[j];
                be = (lane + j * plane_size) as u32;
            }
        }
        let (gm, g) = warp_arg_max(bv, be, plane_size);
        #[unroll]
        for j in 0..per {
            if (lane + j * plane_size) as u32 == g {
                v[j] = lowest;
            }
        }
        ge[jj] = g;
        pv[jj] = (gm - m).exp() / z;
    }
}

/// The body of [`moe_route_kernel`] for the cube that runs it, token `t`'s logits at
/// `logits[t · lstride + loff]`: writes the outputs when `write`, and returns the source token of gathered row `wanted` (any value when no row is
/// wanted, e.g. `wanted = tokens · k`) to every unit.
#[cube]
// A comptime switch around a runtime test stays two `if`s: CubeCL expands them differently.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub(crate) fn route_cube(
    logits: &Slice<f32>,
    slots: &Array<u32>,
    tokens: usize,
    weights: &mut Array<f32>,
    gather: &mut Array<u32>,
    pos: &mut Array<u32>,
    desc_gate_up: &mut Array<u32>,
    desc_down: &mut Array<u32>,
    groups: &mut Array<u32>,
    counts: &mut Array<u32>,
    mass: &mut Array<f32>,
    base: u32,
    wanted: usize,
    write: bool,
    wcube: usize,
    wcubes: usize,
    #[comptime] lstride: usize,
    #[comptime] loff: usize,
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
) -> usize {
    let mut sel = SharedMemory::<u32>::new(max_tokens * k);
    // The final weights, for the statistics (shared: global writes of other units need not
    // be visible after a cube barrier on every backend).
    let mut wsh = SharedMemory::<f32>::new(max_tokens * k);
    select_experts(
        logits,
        &mut sel,
        &mut wsh,
        weights,
        tokens,
        write,
        lstride,
        loff,
        experts,
        k,
        renormalize,
        units,
        plane_size,
    );
    sync_cube();
    group_choices(
        &sel.to_slice(),
        &wsh.to_slice(),
        slots,
        tokens,
        gather,
        pos,
        desc_gate_up,
        desc_down,
        groups,
        counts,
        mass,
        base,
        wanted,
        write,
        wcube,
        wcubes,
        experts,
        k,
        hidden,
        inter,
        chunk,
        chunks,
        stats,
        units,
        plane_size,
    )
}

/// The grouping half of [`route_cube`] over the step's choices `sel[t · k + j]` and their
/// weights `wts` (shared memory, or global memory written by an earlier launch): each expert's
/// rows, the positions, the work items and the statistics; returns the source token of
/// gathered row `wanted` to every unit.
#[cube]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub(crate) fn group_choices(
    sel: &Slice<u32>,
    wts: &Slice<f32>,
    slots: &Array<u32>,
    tokens: usize,
    gather: &mut Array<u32>,
    pos: &mut Array<u32>,
    desc_gate_up: &mut Array<u32>,
    desc_down: &mut Array<u32>,
    groups: &mut Array<u32>,
    counts: &mut Array<u32>,
    mass: &mut Array<f32>,
    base: u32,
    wanted: usize,
    write: bool,
    wcube: usize,
    wcubes: usize,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] hidden: usize,
    #[comptime] inter: usize,
    #[comptime] chunk: usize,
    #[comptime] chunks: usize,
    #[comptime] stats: bool,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) -> usize {
    let u = UNIT_POS as usize;
    let lane = u % plane_size;
    let mut src = SharedMemory::<u32>::new(1usize);
    // Each expert's first gathered row and token count, for the work items.
    let mut esh = SharedMemory::<u32>::new(experts);
    let mut csh = SharedMemory::<u32>::new(experts);
    // Each expert's first work item, and the planes' item totals.
    let mut ish = SharedMemory::<u32>::new(experts);
    let mut wtot = SharedMemory::<u32>::new(comptime![units / plane_size]);
    // Each expert's choices are counted, then given their rows, by one plane walking the
    // step's choices a plane's width at a time (planes take experts in turn).
    let n = tokens * k;
    let planes = comptime![units / plane_size];
    let w = u / plane_size;
    for e in range_stepped(w, experts, planes) {
        let mut count = 0u32;
        for i0 in range_stepped(0, n, plane_size) {
            count += hits_up_to(choice_hit(sel, i0 + lane, n, e), lane, plane_size).1;
        }
        if lane == 0 {
            csh[e] = count;
        }
    }
    sync_cube();
    if u < experts {
        let mut before = 0u32;
        for e in 0..u {
            before += csh[e];
        }
        esh[u] = before;
        if write {
            groups[2usize * u] = before;
            groups[2usize * u + 1usize] = csh[u];
        }
    }
    sync_cube();
    for e in range_stepped(w, experts, planes) {
        let mut row = esh[e];
        let mut m = 0.0f32;
        for i0 in range_stepped(0, n, plane_size) {
            let i = i0 + lane;
            let hit = choice_hit(sel, i, n, e);
            let (incl, total) = hits_up_to(hit, lane, plane_size);
            if hit == 1u32 {
                let r = row + incl - 1u32;
                if r as usize == wanted {
                    src[0] = (i / k) as u32;
                }
                if write {
                    gather[r as usize] = (i / k) as u32;
                    pos[i] = r;
                }
                m += wts[i];
            }
            row += total;
        }
        m = warp_sum(m, plane_size);
        if comptime![stats] {
            if write && lane == 0 {
                counts[base as usize + e] += csh[e];
                mass[base as usize + e] += m;
            }
        }
    }
    sync_cube();
    // Items of at most `chunk` tokens each, so the grouped GEMM's token bucket (and its
    // accumulators) stays small when a batch spreads over the experts; the live ones packed at
    // the front of the tables in expert order, from each expert's exclusive prefix.
    let mut ic = 0u32;
    if u < experts {
        ic = (csh[u] + comptime![chunk as u32 - 1]) / comptime![chunk as u32];
    }
    let incl = plane_inclusive_sum(ic);
    if lane == plane_size - 1 {
        wtot[u / plane_size] = incl;
    }
    sync_cube();
    let mut items_before = 0u32;
    let mut live = 0u32;
    #[unroll]
    for w in 0..comptime![units / plane_size] {
        let v = wtot[w];
        if w < u / plane_size {
            items_before += v;
        }
        live += v;
    }
    if u < experts {
        ish[u] = items_before + incl - ic;
    }
    sync_cube();
    write_items(
        slots,
        &esh,
        &csh,
        &ish,
        live,
        desc_gate_up,
        desc_down,
        wcube,
        wcubes,
        experts,
        hidden,
        inter,
        chunk,
        chunks,
        units,
    );
    src[0] as usize
}

/// Each token's top-`k` experts (`sel[t · k + j]`) and their weights (`wsh`, and `weights` when
/// `write`), a plane per token `t < tokens` (token `t`'s logits at `logits[t · lstride + loff]`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn select_experts(
    logits: &Slice<f32>,
    sel: &mut SharedMemory<u32>,
    wsh: &mut SharedMemory<f32>,
    weights: &mut Array<f32>,
    tokens: usize,
    write: bool,
    #[comptime] lstride: usize,
    #[comptime] loff: usize,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] renormalize: bool,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let u = UNIT_POS as usize;
    let lane = u % plane_size;
    for t in range_stepped(u / plane_size, tokens, comptime![units / plane_size]) {
        let mut ge = Array::<u32>::new(k);
        let mut pv = Array::<f32>::new(k);
        token_choices(
            logits,
            t * lstride + loff,
            lane,
            &mut ge,
            &mut pv,
            experts,
            k,
            renormalize,
            plane_size,
        );
        if lane == 0 {
            #[unroll]
            for jj in 0..k {
                sel[t * k + jj] = ge[jj];
                if write {
                    weights[t * k + jj] = pv[jj];
                }
                wsh[t * k + jj] = pv[jj];
            }
        }
    }
}

/// One token's routing by one plane: its top-`k` experts `ge` and their final weights `pv`
/// (renormalised when asked), in every lane.
#[cube]
#[allow(clippy::too_many_arguments)]
fn token_choices(
    logits: &Slice<f32>,
    base: usize,
    lane: usize,
    ge: &mut Array<u32>,
    pv: &mut Array<f32>,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] renormalize: bool,
    #[comptime] plane_size: usize,
) {
    plane_top_k(logits, base, lane, ge, pv, experts, k, plane_size);
    if comptime![renormalize] {
        let mut sum = 0.0f32;
        #[unroll]
        for jj in 0..k {
            sum += pv[jj];
        }
        #[unroll]
        for jj in 0..k {
            pv[jj] /= sum;
        }
    }
}

/// The selection of a step too large for [`moe_route_kernel`]'s shared memory, in a launch of
/// its own: a plane per token `t < meta[0]` (token `t`'s logits at `logits[t · lstride +
/// loff]`) writes its top-`k` experts to `sel[t · k ..]` and their weights to
/// `weights[t · k ..]`, which [`moe_group_kernel`] then groups.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn moe_select_kernel(
    logits: &Array<f32>,
    meta: &Array<u32>,
    sel: &mut Array<u32>,
    weights: &mut Array<f32>,
    #[comptime] lstride: usize,
    #[comptime] loff: usize,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] renormalize: bool,
    #[comptime] plane_size: usize,
) {
    let t = ABSOLUTE_POS / plane_size;
    if t >= meta[0] as usize {
        terminate!();
    }
    let lane = UNIT_POS as usize % plane_size;
    let mut ge = Array::<u32>::new(k);
    let mut pv = Array::<f32>::new(k);
    token_choices(
        &logits.to_slice(),
        t * lstride + loff,
        lane,
        &mut ge,
        &mut pv,
        experts,
        k,
        renormalize,
        plane_size,
    );
    if lane == 0 {
        #[unroll]
        for jj in 0..k {
            sel[t * k + jj] = ge[jj];
            weights[t * k + jj] = pv[jj];
        }
    }
}

/// The grouping of [`moe_select_kernel`]'s choices in one cube of `units` units (see
/// [`moe_route_kernel`], steps 2 and 3).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn moe_group_kernel(
    sel: &Array<u32>,
    weights: &Array<f32>,
    slots: &Array<u32>,
    meta: &Array<u32>,
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
    #[comptime] hidden: usize,
    #[comptime] inter: usize,
    #[comptime] chunk: usize,
    #[comptime] chunks: usize,
    #[comptime] stats: bool,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let tokens = meta[0] as usize;
    group_choices(
        &sel.to_slice(),
        &weights.to_slice(),
        slots,
        tokens,
        gather,
        pos,
        desc_gate_up,
        desc_down,
        groups,
        counts,
        mass,
        base,
        tokens * k,
        true,
        0usize,
        1usize,
        experts,
        k,
        hidden,
        inter,
        chunk,
        chunks,
        stats,
        units,
        plane_size,
    );
}

/// The plane's hits (`hit` 0 or 1 per lane) up to and including `lane`, and in all: a ballot
/// and two population counts on planes of up to 32 lanes (one 32-bit mask), else CubeCL's
/// inclusive scan (a loop of shuffles) and a broadcast.
#[cube]
#[allow(unused_assignments)]
fn hits_up_to(hit: u32, lane: usize, #[comptime] plane_size: usize) -> (u32, u32) {
    let mut incl = 0u32;
    let mut total = 0u32;
    if comptime![plane_size <= 32] {
        let mask = plane_ballot(hit == 1u32)[0];
        // Lanes 0..=lane (for lane 31 the shift wraps to 0 and the mask to all ones).
        let upto = (2u32 << lane as u32) - 1u32;
        incl = (mask & upto).count_ones();
        total = mask.count_ones();
    } else {
        incl = plane_inclusive_sum(hit);
        total = plane_broadcast(incl, comptime![plane_size as u32 - 1]);
    }
    (incl, total)
}

/// 1 when choice `i < n` picked expert `e`, else 0.
#[cube]
fn choice_hit(sel: &Slice<u32>, i: usize, n: usize, e: usize) -> u32 {
    let mut hit = 0u32;
    if i < n {
        hit = select(sel[i] as usize == e, 1u32, 0u32);
    }
    hit
}

/// The work items (see [`moe_route_kernel`]) of every expert `e` (its rows from `esh[e]`,
/// `csh[e]` of them, in items of at most `chunk` tokens, its slot words from `slots[6e ..]`):
/// the `live` items from item `ish[e]` on for expert `e`, then the header slot (after the
/// table's `experts · chunks` items) whose word 0 counts them; the items past the live ones are
/// not written (the routed kernels read the count). Word by word: cube `wcube` of `wcubes` takes
/// words `(wcube + i · wcubes) · units + unit`, so a warp's stores are consecutive words, and a
/// word's expert is found by a binary search of `ish`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_items(
    slots: &Array<u32>,
    esh: &SharedMemory<u32>,
    csh: &SharedMemory<u32>,
    ish: &SharedMemory<u32>,
    live: u32,
    desc_gate_up: &mut Array<u32>,
    desc_down: &mut Array<u32>,
    wcube: usize,
    wcubes: usize,
    #[comptime] experts: usize,
    #[comptime] hidden: usize,
    #[comptime] inter: usize,
    #[comptime] chunk: usize,
    #[comptime] chunks: usize,
    #[comptime] units: usize,
) {
    let first_unit = wcube * units + UNIT_POS as usize;
    for i in range_stepped(first_unit, live as usize * 8usize, wcubes * units) {
        let item = (i / 8usize) as u32;
        // The expert of the item: the last one whose first item is at or before it (experts
        // without items share their first item with the next).
        let mut lo = 0usize;
        let mut hi = lo + experts; // a runtime value: `experts` is comptime
        while hi - lo > 1usize {
            let mid = (lo + hi) / 2usize;
            if ish[mid] <= item {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let e = lo;
        let c = (item - ish[e]) as usize;
        let count = csh[e];
        let f = (i % 8usize) as u32;
        let first = esh[e] + (c * chunk) as u32;
        let n = min(count - (c * chunk) as u32, chunk as u32);
        // Slot words 0, 1, 2 (gate_up) and 3, 4, 5 (down) go to fields 0, 1 and 4.
        let sf = select(f == 0u32, 0usize, select(f == 1u32, 1usize, 2usize));
        let sg = slots[e * 6usize + sf];
        let sd = slots[e * 6usize + 3usize + sf];
        let slot_field = f == 0u32 || f == 1u32 || f == 4u32;
        let mut g = n;
        let mut d = n;
        if f == 2u32 {
            g = comptime![2 * inter] as u32;
            d = hidden as u32;
        } else if f == 3u32 {
            g = hidden as u32;
            d = inter as u32;
        } else if f == 5u32 {
            g = first * hidden as u32;
            d = first * comptime![2 * inter] as u32;
        } else if f == 6u32 {
            g = first * comptime![2 * inter] as u32;
            d = first * hidden as u32;
        }
        desc_gate_up[i] = select(slot_field, sg, g);
        desc_down[i] = select(slot_field, sd, d);
    }
    if first_unit == 0 {
        let words = comptime![experts * chunks * 8];
        desc_gate_up[words] = live;
        desc_down[words] = live;
    }
}

/// Softmax → top-k routing of `logits` and the grouped kernel's work items, on the device.
/// `slots` comes from [`expert_slot_words`] over slots inside the weight pool.
///
/// # Shapes
/// - `logits`: `[tokens, experts]`; `slots`: `[experts · 6]`
pub fn moe_route<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    logits: &DeviceArray,
    slots: &DeviceArray,
    out: &RouteBuffers,
) -> Result<(), KernelError> {
    moe_route_counted(client, shape, tokens, meta, logits, slots, out, None)
}

/// [`moe_route`] that also accumulates the layer's routing statistics into `stats` when given
/// (the planner's per-expert token counts and routing mass, see [`route_stats_reference`]),
/// in the same launch.
///
/// # Shapes
/// - `logits`: `[tokens, experts]`; `slots`: `[experts · 6]`; `stats.counts`, `stats.mass`:
///   `[≥ base + experts]`
#[allow(clippy::too_many_arguments)]
pub fn moe_route_counted<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    logits: &DeviceArray,
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
) -> Result<(), KernelError> {
    let layout = LogitsLayout { stride: shape.experts, offset: 0 };
    launch_route(client, shape, tokens, meta, (logits, layout), slots, out, stats)
}

/// [`moe_route_counted`] of logits laid out as `layout`: [`check_route`], then the one-cube
/// routing launch ([`route_launch`]).
#[allow(clippy::too_many_arguments)]
fn launch_route<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    logits: (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
) -> Result<(), KernelError> {
    check_route(shape, tokens, logits, slots, out, stats)?;
    route_launch(client, shape, tokens, meta, logits, slots, out, stats);
    Ok(())
}

/// The checks of every routing launch (fused with the gather or not): the shape, the buffers'
/// capacity, the logits' layout and length, the slot words and the statistics' buffers.
pub(crate) fn check_route(
    shape: MoeShape,
    tokens: usize,
    (logits, layout): (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
) -> Result<(), KernelError> {
    if shape.experts > 128 || shape.k == 0 || shape.k > shape.experts {
        return Err(bad(format!("moe_route: unsupported {shape:?} (at most 128 experts, 1 ≤ k ≤ experts)")));
    }
    if tokens > out.capacity() {
        return Err(bad(format!("moe_route: {tokens} tokens, the buffers hold {}", out.capacity())));
    }
    if layout.stride < layout.offset + shape.experts {
        return Err(bad(format!("moe_route: {layout:?} for {} experts", shape.experts)));
    }
    need(
        "moe_route logits",
        logits,
        tokens.saturating_sub(1) * layout.stride + layout.offset + shape.experts,
    )?;
    need("moe_route slots", slots, shape.experts * 6)?;
    if let Some(st) = stats {
        need("moe_route counts", st.counts, st.base + shape.experts)?;
        need("moe_route mass", st.mass, st.base + shape.experts)?;
    }
    Ok(())
}

/// The routing launch (arguments checked by [`check_route`]); nothing at 0 tokens. A step whose
/// choices fit [`ROUTE_SHARED_CHOICES`] routes in one cube of [`moe_route_kernel`]; a larger one
/// selects in a plane per token ([`moe_select_kernel`]) and groups in one cube
/// ([`moe_group_kernel`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_launch<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    (logits, layout): (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
) {
    if tokens == 0 {
        return;
    }
    // As many planes as the device allows: the top-k runs a plane per token, the grouping a
    // plane per expert, the work items a unit per word.
    let (units, plane) = row_units(client, ROUTE_UNITS.max(shape.experts), 1);
    let (counts, mass, base) = out.counters(stats);
    let shared_tokens = out.capacity().min(ROUTE_SHARED_CHOICES / shape.k);
    if tokens <= shared_tokens {
        // SAFETY: sizes checked by `check_route`; outputs were sized for `capacity` tokens by
        // RouteBuffers, and the kernel's shared memory holds `shared_tokens ≥ tokens`.
        unsafe {
            moe_route_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(units as u32),
                logits.arg(),
                slots.arg(),
                meta.arg(),
                out.weights.arg(),
                out.gather.arg(),
                out.pos.arg(),
                out.desc_gate_up.arg(),
                out.desc_down.arg(),
                out.groups.arg(),
                counts.arg(),
                mass.arg(),
                base as u32,
                layout.stride,
                layout.offset,
                shape.experts,
                shape.k,
                shared_tokens,
                shape.renormalize,
                shape.hidden,
                shape.inter,
                out.chunk,
                out.chunks(),
                stats.is_some(),
                units,
                plane,
            )
        };
        return;
    }
    route_two_launches(client, shape, tokens, meta, (logits, layout), slots, out, stats);
}

/// The routing of a step in two launches, [`moe_select_kernel`] then [`moe_group_kernel`]
/// (arguments checked by [`check_route`]): what [`route_launch`] runs where the step's choices
/// do not fit one cube's shared memory.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_two_launches<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    (logits, layout): (&DeviceArray, LogitsLayout),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
) {
    if tokens == 0 {
        return;
    }
    let (units, plane) = row_units(client, ROUTE_UNITS.max(shape.experts), 1);
    let (counts, mass, base) = out.counters(stats);
    // SAFETY: sizes checked by `check_route`; `sel` and `weights` hold `capacity · k ≥ tokens ·
    // k` entries, written by a plane per token.
    unsafe {
        moe_select_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens.div_ceil(SELECT_PLANES) as u32, 1, 1),
            CubeDim::new_1d((SELECT_PLANES * plane) as u32),
            logits.arg(),
            meta.arg(),
            out.sel.arg(),
            out.weights.arg(),
            layout.stride,
            layout.offset,
            shape.experts,
            shape.k,
            shape.renormalize,
            plane,
        );
        moe_group_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(units as u32),
            out.sel.arg(),
            out.weights.arg(),
            slots.arg(),
            meta.arg(),
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
            shape.hidden,
            shape.inter,
            out.chunk,
            out.chunks(),
            stats.is_some(),
            units,
            plane,
        )
    };
}
