//! The small fused kernels of a decode step (everything but attention and the grouped expert
//! GEMM): embedding lookup, dense f16 skinny GEMM with bias, residual add and a fused input
//! RMSNorm, on-device routing (with the planner's statistics) that writes the grouped kernel's
//! descriptor table (a small router's logits computed in the same launch), row gather (with a
//! fused RMSNorm) and the weighted combine. No RMSNorm
//! is a launch of its own: each is folded into the kernels that read its output. Every launch reads its token count from `meta[0]`, so one compiled
//! kernel serves every batch size up to its `max_tokens` bucket and the host never needs a
//! round trip inside a layer.

use cubecl::prelude::*;
use half::f16;

use crate::gemm::{warp_arg_max, warp_max, warp_sum};

/// `h[t] = table[ids[t]]` widened to f32 (times `scale`, e.g. Gemma's √hidden). Grid `(tokens)`.
#[cube(launch_unchecked)]
pub fn embed_kernel(
    ids: &Array<u32>,
    table: &Array<f16>,
    params: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] hidden: usize,
) {
    let t = CUBE_POS_X as usize;
    let row = ids[t] as usize * hidden;
    let scale = params[0];
    for c in range_stepped(UNIT_POS as usize, hidden, CUBE_DIM as usize) {
        h[t * hidden + c] = f32::cast_from(table[row + c]) * scale;
    }
}

/// Sum of `v` over all `units` units of the cube, returned to every unit: a plane reduction,
/// then the planes' partial sums through shared memory.
#[cube]
pub fn cube_sum(v: f32, #[comptime] units: usize, #[comptime] plane_size: usize) -> f32 {
    let mut total = warp_sum(v, plane_size);
    if comptime![units > plane_size] {
        let planes = comptime![units / plane_size];
        let mut sh = SharedMemory::<f32>::new(planes);
        let lane = UNIT_POS as usize % plane_size;
        if lane == 0 {
            sh[UNIT_POS as usize / plane_size] = total;
        }
        sync_cube();
        let mut t = 0.0f32;
        #[unroll]
        for p in 0..planes {
            t += sh[p];
        }
        // The next reduction may reuse the memory.
        sync_cube();
        total = t;
    }
    total
}

/// Loads this unit's columns `UNIT_POS + i · units` of the row at `base` into `xv` (zeros past
/// `hidden`), all loads unrolled so they are in flight together; returns their sum of squares.
#[cube]
pub fn load_row(
    x: &Array<f32>,
    base: usize,
    xv: &mut Array<f32>,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
) -> f32 {
    let u = UNIT_POS as usize;
    let mut ss = 0.0f32;
    #[unroll]
    for i in 0..comptime![hidden.div_ceil(units)] {
        let c = u + i * units;
        let mut v = 0.0f32;
        if c < hidden {
            v = x[base + c];
        }
        xv[i] = v;
        ss += v * v;
    }
    ss
}

/// `y[t, r] (+)= Σ_c x[t, c] · W[r, c] (+ bias[r])` for `t < meta[0]`, `W` f16 row-major
/// `[n, k]` as PyTorch stores it, read as vectors of `vec` halves (16-byte loads on CUDA).
/// Grid `(ceil(n / (warps · rows)))`, cube `warps` planes; a plane owns `rows` rows, its lanes
/// stride the rows' vectors (coalesced), one `plane_sum` per row and token.
///
/// `x` is read as vectors of the same width as `W`'s (two 16-byte loads on CUDA): read one
/// f32 at a time, a warp's loads of a column were 32 bytes apart, eight L1 wavefronts per
/// instruction, which held the H200 at ~1.6 TB/s (ncu, Mixtral's QKV). With several tokens
/// each plane takes two rows so each `x` vector serves both.
///
/// With `norm`, `x` goes through an RMSNorm first (`norm_p = [eps, offset]`, weight `g`):
/// `y = (W · (x ⊙ (g + offset))) / sqrt(mean(x²) + eps)`. The norm is a per-token scale, so
/// each lane multiplies its converted weights by `g + offset` (once per vector, whatever the
/// token count) and sums the squares of the `x` values it reads; a plane reads every column
/// of each token, so one more `plane_sum` per token gives `Σ x²` and the scale is applied
/// after the row's reduction: no separate norm launch, no extra pass over memory.
///
/// With `act` (an [`crate::Activation`] code) `x` is a dense MLP's gate|up output, rows of
/// `xs` vectors: the GEMM reads `act(gate) · up` while loading it (as the expert kernels stage
/// their input), and with `gated` scales each token's result by the sigmoid of the row's
/// column `2·k` (Qwen's shared-expert gate, a per-token scale applied after the reduction
/// like the norm's), so the activation needs no launch of its own. Without `act`, `xs = k /
/// vec`.
#[cube(launch_unchecked)]
// A comptime switch around a runtime test stays two `if`s: CubeCL expands them differently.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn dense_gemm_kernel<N: Size>(
    x: &Array<Vector<f32, N>>,
    w: &Array<Vector<f16, N>>,
    bias: &Array<f32>,
    meta: &Array<u32>,
    norm_w: &Array<Vector<f32, N>>,
    norm_p: &Array<f32>,
    y: &mut Array<f32>,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] vec: usize,
    #[comptime] max_tokens: usize,
    #[comptime] plane_size: usize,
    #[comptime] warps: usize,
    #[comptime] rows: usize,
    #[comptime] has_bias: bool,
    #[comptime] accumulate: bool,
    #[comptime] norm: bool,
    #[comptime] act: u32,
    #[comptime] xs: usize,
    #[comptime] gated: bool,
) {
    let lane = UNIT_POS as usize % plane_size;
    let row0 = (CUBE_POS_X as usize * warps + UNIT_POS as usize / plane_size) * rows;
    let tokens = meta[0] as usize;
    if row0 >= n {
        terminate!();
    }
    let mut acc = Array::<f32>::new(max_tokens * rows);
    #[unroll]
    for t in 0..max_tokens * rows {
        acc[t] = 0.0;
    }
    // Per token: this lane's share of Σ x² (only with `norm`).
    let mut ss = Array::<f32>::new(max_tokens);
    #[unroll]
    for t in 0..max_tokens {
        ss[t] = 0.0;
    }
    let mut off = 0.0f32;
    if comptime![norm] {
        off = norm_p[1];
    }
    let kv = comptime![k / vec];
    // Rows past `n` (the last plane of a ragged tile) read row `n - 1` and store nothing, so
    // the loads need no guard.
    let mut wrow = Array::<usize>::new(rows);
    #[unroll]
    for r in 0..rows {
        wrow[r] = min(row0 + r, n - 1) * kv;
    }
    // Rounds of `rv` vectors per lane and row whose loads are all issued before any is used
    // (one load in flight per lane leaves HBM idle), then the remaining vectors one by one.
    // A single row takes 8 per round: a warp's rounds are a chain of DRAM round trips, and 4
    // per round left Mixtral's QKV (4096 columns, 4 rounds) at 2.1 TB/s at batch 1 (ncu on
    // the H200, git `ac18dce`).
    let rv = comptime![if rows == 1 { 8usize } else { 4usize }];
    let full = comptime![kv / (rv * plane_size)];
    for rd in 0..full {
        let v0 = rd * comptime![rv * plane_size] + lane;
        let mut wv = Array::<Vector<f16, N>>::new(rv * rows);
        #[unroll]
        for r in 0..rows {
            #[unroll]
            for q in 0..rv {
                wv[r * rv + q] = w[wrow[r] + v0 + q * plane_size];
            }
        }
        #[unroll]
        for q in 0..rv {
            dense_fma(
                x,
                &wv,
                norm_w,
                off,
                q,
                rv,
                v0 + q * plane_size,
                kv,
                tokens,
                &mut acc,
                &mut ss,
                max_tokens,
                rows,
                vec,
                norm,
                act,
                xs,
            );
        }
    }
    for v in range_stepped(full * comptime![rv * plane_size] + lane, kv, plane_size) {
        let mut wv = Array::<Vector<f16, N>>::new(rows);
        #[unroll]
        for r in 0..rows {
            wv[r] = w[wrow[r] + v];
        }
        dense_fma(
            x, &wv, norm_w, off, 0usize, 1usize, v, kv, tokens, &mut acc, &mut ss, max_tokens, rows, vec,
            norm, act, xs,
        );
    }
    let mut eps = 0.0f32;
    if comptime![norm] {
        eps = norm_p[0];
    }
    #[unroll]
    for t in 0..max_tokens {
        if comptime![norm] {
            ss[t] = 1.0 / (warp_sum(ss[t], plane_size) / f32::cast_from(k) + eps).sqrt();
        }
    }
    #[unroll]
    for r in 0..rows {
        let row = row0 + r;
        #[unroll]
        for t in 0..max_tokens {
            let mut s = warp_sum(acc[r * max_tokens + t], plane_size);
            if comptime![norm] {
                s *= ss[t];
            }
            if comptime![gated] {
                if t < tokens {
                    // The shared expert's gate: column 2·k of the gate|up row, a vector start.
                    s *= 1.0 / (1.0 + (-x[t * xs + 2 * kv][0]).exp());
                }
            }
            if comptime![has_bias] {
                s += bias[min(row, n - 1)];
            }
            if lane == 0 && t < tokens && row < n {
                if comptime![accumulate] {
                    y[t * n + row] += s;
                } else {
                    y[t * n + row] = s;
                }
            }
        }
    }
}

/// `acc[r · max_tokens + t] += W vector · x vector` for the weight vectors `wv[r · per_row + q]`
/// of each row and `x`'s vector `v` of each real token. With `norm` the weights are first
/// scaled by the norm weight `g[v] + off` and `ss[t]` gains the squares of `x`'s vector.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dense_fma<N: Size>(
    x: &Array<Vector<f32, N>>,
    wv: &Array<Vector<f16, N>>,
    g: &Array<Vector<f32, N>>,
    off: f32,
    q: usize,
    #[comptime] per_row: usize,
    v: usize,
    kv: usize,
    tokens: usize,
    acc: &mut Array<f32>,
    ss: &mut Array<f32>,
    #[comptime] max_tokens: usize,
    #[comptime] rows: usize,
    #[comptime] vec: usize,
    #[comptime] norm: bool,
    #[comptime] act: u32,
    #[comptime] xs: usize,
) {
    // The row's weights in f32 once, whatever the token count.
    let mut wf = Array::<f32>::new(rows * vec);
    if comptime![norm] {
        let gv = g[v];
        #[unroll]
        for r in 0..rows {
            #[unroll]
            for i in 0..vec {
                wf[r * vec + i] = f32::cast_from(wv[r * per_row + q][i]) * (gv[i] + off);
            }
        }
    } else {
        #[unroll]
        for r in 0..rows {
            #[unroll]
            for i in 0..vec {
                wf[r * vec + i] = f32::cast_from(wv[r * per_row + q][i]);
            }
        }
    }
    // Bucket tokens past `tokens` read the last real row and are never stored: the loads carry
    // no guard, so the compiler can issue all of them before the FMAs. Guarded, each token's
    // `x` was an L2 round trip of its own (ncu on the H200, git `b4cf179`: Qwen1.5-MoE's
    // o_proj, 8 MB, took 35 µs at batch 8).
    let last = max(tokens, 1usize) - 1;
    #[unroll]
    for t in 0..max_tokens {
        let tr = min(t, last);
        let xv = x[tr * xs + v];
        let mut xf = Array::<f32>::new(vec);
        if comptime![act == 0] {
            #[unroll]
            for i in 0..vec {
                xf[i] = xv[i];
            }
        } else {
            // act(gate) · up, the up half `k` columns (`kv` vectors) further on.
            let uv = x[tr * xs + kv + v];
            #[unroll]
            for i in 0..vec {
                xf[i] = crate::families::act_fn(xv[i], act) * uv[i];
            }
        }
        if comptime![norm] {
            #[unroll]
            for i in 0..vec {
                ss[t] += xf[i] * xf[i];
            }
        }
        #[unroll]
        for r in 0..rows {
            #[unroll]
            for i in 0..vec {
                acc[r * max_tokens + t] += wf[r * vec + i] * xf[i];
            }
        }
    }
}

/// Routing and grouping in one cube of `units` units (whole planes of `plane_size`, at least
/// `experts`):
/// 1. a plane per token `t < meta[0]`: softmax over `logits[t]`, top-`k` (ties: lower expert
///    first), optional renormalisation → `weights[t, j]`;
/// 2. unit `e`: its tokens in token order get consecutive gathered rows after every lower
///    expert's; writes `gather[row] = t`, `pos[t, j] = row` and the work items of expert `e`
///    (gate_up: `[2I, H]`, down: `[H, I]`, from `slots[e] = (gate_up plane_off, lut_off, bits,
///    down plane_off, lut_off, bits)`), items of up to `chunk` tokens each, so the grouped
///    GEMM runs with no host round trip: the live items packed at the front of each table (in
///    expert order), zeros after them, and their count in the header slot that follows the
///    table's `experts · chunks` items (see [`crate::step::RouteBuffers`]);
/// 3. with `stats`, unit `e` also adds its token count to `counts[base + e]` and the sum of
///    its choices' weights (in choice order) to `mass[base + e]`: the planner's routing
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
        counts,
        mass,
        base,
        tokens * k,
        true,
        0usize,
        1usize,
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
}

/// Softmax and top-k of one token's logits `logits[base ..][..experts]` by one plane, lane `l`
/// holding experts `l + j · plane_size`: every lane gets the selected experts `ge[jj]` (the k
/// largest, ties to the lower expert) and their softmax probabilities `pv[jj]`. A unit scanning
/// all experts k times took ~10 µs for Qwen1.5-MoE's 60 experts (ncu on the H200), and Gemma-4
/// has 128 experts and k = 8.
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
fn route_cube(
    logits: &Slice<f32>,
    slots: &Array<u32>,
    tokens: usize,
    weights: &mut Array<f32>,
    gather: &mut Array<u32>,
    pos: &mut Array<u32>,
    desc_gate_up: &mut Array<u32>,
    desc_down: &mut Array<u32>,
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
    let u = UNIT_POS as usize;
    let mut sel = SharedMemory::<u32>::new(max_tokens * k);
    // The final weights, for the statistics (shared: global writes of other units need not
    // be visible after a cube barrier on every backend).
    let mut wsh = SharedMemory::<f32>::new(max_tokens * k);
    let mut src = SharedMemory::<u32>::new(1usize);
    // Each expert's first gathered row and token count, for the work items.
    let mut esh = SharedMemory::<u32>::new(experts);
    let mut csh = SharedMemory::<u32>::new(experts);
    // Each expert's first work item, and the planes' item totals.
    let mut ish = SharedMemory::<u32>::new(experts);
    let mut wtot = SharedMemory::<u32>::new(comptime![units / plane_size]);
    // Softmax and top-k of a token by one plane (`plane_top_k`).
    let lane = u % plane_size;
    for t in range_stepped(u / plane_size, tokens, comptime![units / plane_size]) {
        let mut ge = Array::<u32>::new(k);
        let mut pv = Array::<f32>::new(k);
        plane_top_k(logits, t * lstride + loff, lane, &mut ge, &mut pv, experts, k, plane_size);
        let mut sum = 0.0f32;
        #[unroll]
        for jj in 0..k {
            if lane == 0 {
                sel[t * k + jj] = ge[jj];
            }
            sum += pv[jj];
        }
        if lane == 0 {
            #[unroll]
            for jj in 0..k {
                let mut p = pv[jj];
                if comptime![renormalize] {
                    p /= sum;
                }
                if write {
                    weights[t * k + jj] = p;
                }
                wsh[t * k + jj] = p;
            }
        }
    }
    sync_cube();
    if u < experts {
        let mut before = 0u32;
        let mut count = 0u32;
        for i in 0..tokens * k {
            let s = sel[i] as usize;
            if s < u {
                before += 1u32;
            }
            if s == u {
                count += 1u32;
            }
        }
        let mut row = before;
        let mut m = 0.0f32;
        for i in 0..tokens * k {
            if sel[i] as usize == u {
                if row as usize == wanted {
                    src[0] = (i / k) as u32;
                }
                if write {
                    gather[row as usize] = (i / k) as u32;
                    pos[i] = row;
                }
                row += 1u32;
                m += wsh[i];
            }
        }
        if comptime![stats] {
            if write {
                counts[base as usize + u] += count;
                mass[base as usize + u] += m;
            }
        }
        esh[u] = before;
        csh[u] = count;
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

/// The work items (see [`moe_route_kernel`]) of every expert `e` (its rows from `esh[e]`,
/// `csh[e]` of them, in items of at most `chunk` tokens, its slot words from `slots[6e ..]`):
/// the live ones at item `ish[e] + c`, then empty items (all zero) up to `experts · chunks`,
/// then the header slot whose word 0 counts the `live` ones (what the GEMV reads instead of
/// scanning every item: 1024 for Gemma-4). Word by word: cube `wcube` of `wcubes` takes words
/// `(wcube + i · wcubes) · units + unit`, so a warp's stores are consecutive words. Written per
/// expert (one unit per expert, its items' 16 words each), the stores of a plane were 64 words
/// apart: 32 sectors per store, and the launch waited on its store queue (ncu on the H200: a
/// third of Gemma-4's route + gather launch at batch 1, in its one writing cube).
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
    let per_e = comptime![chunks * 8];
    let words = comptime![experts * chunks * 8];
    let first_unit = wcube * units + UNIT_POS as usize;
    for i in range_stepped(first_unit, words, wcubes * units) {
        let e = i / per_e;
        let c = (i / 8usize) % chunks;
        let count = csh[e];
        if count > (c * chunk) as u32 {
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
            let j = (ish[e] as usize + c) * 8usize + f as usize;
            desc_gate_up[j] = select(slot_field, sg, g);
            desc_down[j] = select(slot_field, sd, d);
        }
    }
    for i in range_stepped(live as usize * 8usize + first_unit, words, wcubes * units) {
        desc_gate_up[i] = 0u32;
        desc_down[i] = 0u32;
    }
    if first_unit == 0 {
        desc_gate_up[words] = live;
        desc_down[words] = live;
    }
}

/// [`moe_route_kernel`] and the row gather of [`gather_rows_kernel`] (with its optional norm)
/// in one launch: cube `row` (grid `(max rows)`) recomputes the step's routing in shared
/// memory — the same selection in the same order, a few µs of ALU that every cube runs in
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

/// [`route_gather_kernel`] with the router GEMM folded in: every cube first computes all the
/// step's router logits `logits[t, e] = Σ_c norm(x)[t, c] · router[e, c]` (`router` f16
/// `[experts, hidden]`, the norm the gather's own) into shared memory, then routes and gathers
/// as [`route_gather_kernel`] does; cube 0 also writes the logits to `logits_out`. Only for a
/// small router (the host launcher bounds `experts · hidden`): each cube reads the whole
/// router (from L2 after the first) and `x`, a few µs of ALU in parallel against a launch and
/// the round trip of the logits through memory.
///
/// The dot products: unit `u` owns the vectors `u + i · units` of `vec` columns (16-byte loads
/// of the router on CUDA), every router vector it needs loaded before any is used, keeps one
/// partial sum per expert for the token in hand, reduces each over its plane and leaves the
/// planes' sums (and the sum of squares of the norm) in shared memory; after one barrier units
/// sum the planes' partials of each (token, expert) and apply the norm's per-token scale, as
/// `dense_gemm_kernel` does with its norm. Read one half at a time under a column guard, the
/// router took 16 rounds of loads, each a DRAM round trip, and the launch ~23 µs for Mixtral at
/// batch 1 (ncu on the H200, stalls at the conversions after each round). Cube: `units` units,
/// a multiple of `plane_size`.
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
    let u = UNIT_POS as usize;
    let planes = comptime![units / plane_size];
    let hv = comptime![hidden / vec];
    let per = comptime![hv.div_ceil(units)];
    // Per (token, plane): the plane's partial dot product with each expert's row, then its
    // partial sum of squares.
    let stride = comptime![experts + 1];
    let mut part = SharedMemory::<f32>::new(comptime![max_tokens * planes * (experts + 1)]);
    let mut lg = SharedMemory::<f32>::new(comptime![max_tokens * experts]);
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
    let t = route_cube(
        &lg.to_slice(),
        slots,
        tokens,
        weights,
        gather,
        pos,
        desc_gate_up,
        desc_down,
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

/// `out[row] = x[gather[row]]` for `row < meta[0] · k`, with `norm` through an RMSNorm
/// (`norm_p = [eps, offset]`, weight `norm_w`: `x / rms(x) · (w + offset)`, offset 1 for
/// `1 + w` norms): the routed experts read the normed rows and the norm needs no launch of
/// its own. Grid `(max rows)`; cube: `units` units, unit `u` owning columns `u + i · units`
/// (`i < ⌈width / units⌉`, unrolled) so that all its loads are in flight together (one plane
/// looping over a 4096-wide row waits a DRAM latency per iteration: a standalone RMSNorm
/// written that way took 79 µs per call on the H200, against ~3 µs). One row reduction per
/// gathered row: each token's row is normed `k` times, a few µs of ALU against a launch.
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
fn gather_row(
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
        // The norm's weights before any store: loaded between the stores, each column waited
        // out a round trip (ncu on the H200).
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

/// `h[t] += Σ_j weights[t, j] · y[pos[t, j]]` (the experts' outputs back into the residual
/// stream, in a fixed order). Grid: `step::column_grid`, a column per unit:
/// one cube per token walked its row in a loop of dependent loads (~10 µs for Mixtral's 4096
/// columns at batch 1, ncu on the H200).
#[cube(launch_unchecked)]
pub fn moe_combine_kernel(
    y: &Array<f32>,
    pos: &Array<u32>,
    weights: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] k: usize,
    #[comptime] hidden: usize,
) {
    let t = CUBE_POS_X as usize;
    let c = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if c < hidden {
        let mut acc = 0.0f32;
        #[unroll]
        for j in 0..k {
            acc += weights[t * k + j] * y[pos[t * k + j] as usize * hidden + c];
        }
        h[t * hidden + c] += acc;
    }
}
