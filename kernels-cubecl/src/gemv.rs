//! Persistent grouped bit-plane + LUT GEMV for work items of one or two tokens (routed decode
//! items), same descriptors and results as [`crate::gemm`].
//!
//! Why a second kernel: the tiled kernel stages `x` chunk by chunk behind two cube barriers and
//! launches a cube per (row tile, item), including the items the router left empty, so at one
//! token its warps spend most of their time waiting at barriers or on a DRAM latency with few
//! loads in flight (ncu on the H200: ~930 GB/s for Mixtral's gate_up at 4 bits). Here:
//!
//! - a fixed grid of cubes (a few per SM) shares the *active* items' warp units (R rows each)
//!   in contiguous ranges, from a prefix sum over the descriptors computed in each cube;
//! - a cube stages `x` (all columns, all tokens, activation applied) once per item it visits;
//! - each warp then walks its units with no cube barrier: it stages its rows' LUTs in a
//!   warp-private region, loads `J` plane words per lane and row (all in flight), rebuilds
//!   four indices per shift/mask step and reduces with `plane_sum`;
//! - gated units (`glu`, for the routed experts' gate_up): a unit's rows are gate rows and the
//!   up rows `n / 2` further, and it stores `act(gate) · up` in the gate half of its output rows,
//!   so the activation needs no launch of its own.

use cubecl::prelude::*;
use half::f16;

use crate::gemm::{
    DESC_WORDS, LUT_SHARED, XS, XV_PER_WORD, lane_lut_regs, load_lane_luts, stage_words, store_rows,
    unit_row, warp_sum, word_rows,
};

/// The kernel. Grid: any number of cubes (a few per SM); cube: `warps · plane_size` units.
/// `n_items` descriptors of [`DESC_WORDS`] words (see [`crate::gemm::ap_gemm_kernel`]); items
/// with zero tokens take no work (with `counted`, see [`crate::launch_gemv`], only the live
/// items at the front are read). `x_words` (comptime) bounds `ceil(cols / 32)` over the items,
/// rounded up to a multiple of `plane_size · J`. `glu`: 0 for plain units, else the code of the
/// gated activation (`rows` even; see [`crate::step::ap_gemm_routed_gated`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn ap_gemv_kernel<XF: Float>(
    planes: &Array<u32>,
    luts: &Array<f16>,
    desc: &Array<u32>,
    x: &Array<f32>,
    y: &mut Array<f32>,
    n_items: u32,
    #[comptime] max_items: usize,
    #[comptime] tb: usize,
    #[comptime] plane_size: usize,
    #[comptime] warps: usize,
    #[comptime] rows: usize,
    #[comptime] words_per_lane: usize,
    #[comptime] x_words: usize,
    #[comptime] act: u32,
    #[comptime] lut_slots: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
    #[comptime] glu: u32,
    #[comptime] counted: bool,
    #[comptime] prefetch: bool,
) {
    // A gated unit (`glu` = the activation's code) holds `rows / 2` gate rows and the matching
    // up rows `n / 2` further; a plain one `rows` consecutive rows.
    let half = comptime![if glu > 0 { rows / 2 } else { rows }];
    let unit = UNIT_POS as usize;
    let lane = unit % plane_size;
    let warp = unit / plane_size;
    let cube_units = warps * plane_size;
    // With `counted`, only the live items at the front of the table (the routing counts them
    // in its header slot): at batch 1 Gemma-4's table holds 8 live items of 1024.
    let mut items = n_items as usize;
    if comptime![counted] {
        items = min(desc[max_items * DESC_WORDS] as usize, items);
    }

    // pref[i] = warp units of items before i (an item of n rows has ceil(n / rows) units).
    // Every round's descriptor loads first (unconditional: items past the last read item 0 and
    // count nothing), then one barrier for all rounds' warp totals: a loop of rounds, each a
    // round trip and two barriers, took several µs of a Gemma-4 GEMV's 21 (1024 items).
    let rounds = comptime![max_items.div_ceil(warps * plane_size)];
    let mut pref = SharedMemory::<u32>::new(max_items + 1);
    let mut wsum = SharedMemory::<u32>::new(rounds * warps);
    if unit == 0 {
        pref[0] = 0u32;
    }
    let mut tk = Array::<u32>::new(rounds);
    let mut nr = Array::<u32>::new(rounds);
    #[unroll]
    for r in 0..rounds {
        let i = r * cube_units + unit;
        let d = select(i < items, i, 0usize) * DESC_WORDS;
        tk[r] = desc[d + 7];
        nr[r] = desc[d + 2];
    }
    let mut incl = Array::<u32>::new(rounds);
    #[unroll]
    for r in 0..rounds {
        let i = r * cube_units + unit;
        let live = if comptime![glu > 0] { nr[r] / 2u32 } else { nr[r] };
        let c = select(
            i < items && tk[r] > 0u32,
            (live + comptime![half as u32 - 1]) / comptime![half as u32],
            0u32,
        );
        let s = plane_inclusive_sum(c);
        incl[r] = s;
        if lane == plane_size - 1 {
            wsum[r * warps + warp] = s;
        }
    }
    sync_cube();
    let mut carry = 0u32;
    #[unroll]
    for r in 0..rounds {
        let mut before = carry;
        let mut total = carry;
        for w in 0..warps {
            let v = wsum[r * warps + w];
            if w < warp {
                before += v;
            }
            total += v;
        }
        let i = r * cube_units + unit;
        if i < items {
            pref[i + 1] = before + incl[r];
        }
        carry = total;
    }
    sync_cube();
    let units_total = carry as usize;

    // This cube's contiguous range of units.
    let cubes = CUBE_COUNT;
    let c = CUBE_POS;
    let per = units_total / cubes;
    let rem = units_total % cubes;
    let start = c * per + select(c < rem, c, rem);
    let end = start + per + select(c < rem, 1usize, 0usize);

    let xs_stride = x_words * XV_PER_WORD;
    let mut x_s = SharedMemory::<XS<XF>>::new(tb * x_words * XV_PER_WORD);
    let mut lut_s = SharedMemory::<f32>::new(warps * rows * lut_slots);
    let lbase = warp * rows * lut_slots;

    let mut cur = start;
    loop {
        if cur >= end {
            break;
        }
        // The item holding unit `cur`: largest i with pref[i] <= cur.
        let mut lo = 0usize;
        let mut hi = items;
        loop {
            if hi - lo <= 1 {
                break;
            }
            let mid = (lo + hi) / 2;
            if (pref[mid] as usize) <= cur {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let it = lo;
        let first = pref[it] as usize;
        let seg_end = min(end, pref[it + 1] as usize);
        let d = it * DESC_WORDS;
        let plane_off = desc[d] as usize;
        let lut_off = desc[d + 1] as usize;
        let n = desc[d + 2] as usize;
        let k = desc[d + 3] as usize;
        let bits = desc[d + 4];
        let x_off = desc[d + 5] as usize;
        let y_off = desc[d + 6] as usize;
        let tokens = desc[d + 7] as usize;

        // The previous item's x is consumed; stage this one's, zero past its columns.
        sync_cube();
        stage_words::<XF>(x, &mut x_s, x_off, k, 0usize, x_words, tokens, unit, tb, cube_units, act);
        sync_cube();

        let words = k.div_ceil(32usize);
        let u0 = cur + warp;
        if bits == 3u32 {
            gemv_units::<XF>(
                planes,
                luts,
                &mut lut_s,
                &x_s,
                y,
                plane_off,
                lut_off,
                n,
                words,
                y_off,
                tokens,
                first,
                u0,
                seg_end,
                lane,
                lbase,
                3usize,
                tb,
                plane_size,
                warps,
                rows,
                words_per_lane,
                xs_stride,
                lut_slots,
                unrolled,
                shuffle,
                glu,
                prefetch,
            );
        } else if bits == 4u32 {
            gemv_units::<XF>(
                planes,
                luts,
                &mut lut_s,
                &x_s,
                y,
                plane_off,
                lut_off,
                n,
                words,
                y_off,
                tokens,
                first,
                u0,
                seg_end,
                lane,
                lbase,
                4usize,
                tb,
                plane_size,
                warps,
                rows,
                words_per_lane,
                xs_stride,
                lut_slots,
                unrolled,
                shuffle,
                glu,
                prefetch,
            );
        } else if bits == 5u32 {
            gemv_units::<XF>(
                planes,
                luts,
                &mut lut_s,
                &x_s,
                y,
                plane_off,
                lut_off,
                n,
                words,
                y_off,
                tokens,
                first,
                u0,
                seg_end,
                lane,
                lbase,
                5usize,
                tb,
                plane_size,
                warps,
                rows,
                words_per_lane,
                xs_stride,
                lut_slots,
                unrolled,
                shuffle,
                glu,
                prefetch,
            );
        } else if bits == 6u32 {
            gemv_units::<XF>(
                planes,
                luts,
                &mut lut_s,
                &x_s,
                y,
                plane_off,
                lut_off,
                n,
                words,
                y_off,
                tokens,
                first,
                u0,
                seg_end,
                lane,
                lbase,
                6usize,
                tb,
                plane_size,
                warps,
                rows,
                words_per_lane,
                xs_stride,
                lut_slots,
                unrolled,
                shuffle,
                glu,
                prefetch,
            );
        } else if bits == 7u32 {
            gemv_units::<XF>(
                planes,
                luts,
                &mut lut_s,
                &x_s,
                y,
                plane_off,
                lut_off,
                n,
                words,
                y_off,
                tokens,
                first,
                u0,
                seg_end,
                lane,
                lbase,
                7usize,
                tb,
                plane_size,
                warps,
                rows,
                words_per_lane,
                xs_stride,
                lut_slots,
                unrolled,
                shuffle,
                glu,
                prefetch,
            );
        } else {
            gemv_units::<XF>(
                planes,
                luts,
                &mut lut_s,
                &x_s,
                y,
                plane_off,
                lut_off,
                n,
                words,
                y_off,
                tokens,
                first,
                u0,
                seg_end,
                lane,
                lbase,
                8usize,
                tb,
                plane_size,
                warps,
                rows,
                words_per_lane,
                xs_stride,
                lut_slots,
                unrolled,
                shuffle,
                glu,
                prefetch,
            );
        }
        cur = seg_end;
    }
}

/// One warp's units `u0, u0 + warps, … < seg_end` of an item at `bits` bits.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemv_units<XF: Float>(
    planes: &Array<u32>,
    luts: &Array<f16>,
    lut_s: &mut SharedMemory<f32>,
    x_s: &SharedMemory<XS<XF>>,
    y: &mut Array<f32>,
    plane_off: usize,
    lut_off: usize,
    n: usize,
    words: usize,
    y_off: usize,
    tokens: usize,
    first: usize,
    u0: usize,
    seg_end: usize,
    lane: usize,
    lbase: usize,
    #[comptime] bits: usize,
    #[comptime] tb: usize,
    #[comptime] plane_size: usize,
    #[comptime] warps: usize,
    #[comptime] rows: usize,
    #[comptime] wpl: usize,
    xs_stride: usize,
    #[comptime] lut_slots: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
    #[comptime] glu: u32,
    #[comptime] prefetch: bool,
) {
    let half = comptime![if glu > 0 { rows / 2 } else { rows }];
    // Rows a unit may use (gated: the gate half) and the distance of the up rows.
    let n_live = if comptime![glu > 0] { n / 2 } else { n };
    let up = n_live;
    let lut_len = comptime![1usize << bits];
    let step_words = comptime![plane_size * wpl];
    let steps = words.div_ceil(step_words);
    let mut acc = Array::<f32>::new(rows * tb);
    let mut pw = Array::<u32>::new(rows * wpl * bits);
    let mut rb = Array::<u32>::new(rows);
    #[unroll]
    for r in 0..rows {
        rb[r] = (lbase + r * lut_slots) as u32;
    }
    let mut lr = Array::<f32>::new(rows * comptime![lane_lut_regs(shuffle)]);
    for u in range_stepped(u0, seg_end, warps) {
        let row0 = (u - first) * half;
        if comptime![shuffle != LUT_SHARED && bits <= 4] {
            load_lane_luts(luts, lut_off, lut_len, row0, n_live, up, lane, &mut lr, rows, half, shuffle);
        } else {
            // This warp's LUT region is free once every lane left the previous unit.
            sync_plane();
            for i in range_stepped(lane, rows * lut_len, plane_size) {
                let r = i / lut_len;
                let e = i % lut_len;
                if row0 + r % half < n_live {
                    lut_s[lbase + r * lut_slots + e] =
                        f32::cast_from(luts[lut_off + unit_row(row0, r, half, up) * lut_len + e]);
                }
            }
            sync_plane();
        }
        #[unroll]
        for a in 0..rows * tb {
            acc[a] = 0.0;
        }
        // With `prefetch` (≤ 4 bits), step s + 1's words are loaded before step s's arithmetic
        // (the GEMV waits on its plane words: ncu's long-scoreboard stalls lead at one token),
        // at the cost of a second set of word registers.
        let pf = comptime![prefetch && bits <= 4];
        let mut pn = Array::<u32>::new(comptime![if pf { rows * wpl * bits } else { 1usize }]);
        if comptime![pf] {
            load_step(
                planes, &mut pw, plane_off, n, n_live, up, words, row0, 0usize, lane, plane_size, rows, half,
                wpl, bits,
            );
        }
        for s in 0..steps {
            // Every plane word of the step first, so they are all in flight together.
            if comptime![pf] {
                // Past the last step every word is zero and nothing is loaded.
                load_step(
                    planes,
                    &mut pn,
                    plane_off,
                    n,
                    n_live,
                    up,
                    words,
                    row0,
                    s + 1,
                    lane,
                    plane_size,
                    rows,
                    half,
                    wpl,
                    bits,
                );
            } else {
                load_step(
                    planes, &mut pw, plane_off, n, n_live, up, words, row0, s, lane, plane_size, rows, half,
                    wpl, bits,
                );
            }
            #[unroll(unrolled)]
            for j in 0..wpl {
                let wi = s * step_words + j * plane_size + lane;
                word_rows::<XF>(
                    &pw,
                    j * bits,
                    &rb,
                    &lr,
                    lut_s,
                    x_s,
                    wi * XV_PER_WORD,
                    xs_stride,
                    &mut acc,
                    wpl * bits,
                    bits,
                    tb,
                    rows,
                    unrolled,
                    shuffle,
                );
            }
            if comptime![pf] {
                #[unroll]
                for i in 0..rows * wpl * bits {
                    pw[i] = pn[i];
                }
            }
        }
        if comptime![glu > 0] {
            store_gated(&acc, y, y_off, n, row0, tokens, lane, half, tb, plane_size, glu);
        } else {
            store_rows(&acc, y, y_off, n, row0, tokens, lane, rows, tb, plane_size);
        }
    }
}

/// [`store_rows`] of a gated unit: lane 0 stores `act(gate) · up` of gate rows `row0 ..< row0 +
/// half` (below `n / 2`) at those rows of `y` (row stride `n`, the gate half of gate|up-shaped
/// rows, what [`crate::Activation::Applied`] reads).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_gated(
    acc: &Array<f32>,
    y: &mut Array<f32>,
    y_off: usize,
    n: usize,
    row0: usize,
    tokens: usize,
    lane: usize,
    #[comptime] half: usize,
    #[comptime] tb: usize,
    #[comptime] plane_size: usize,
    #[comptime] act: u32,
) {
    #[unroll]
    for r in 0..half {
        #[unroll]
        for t in 0..tb {
            let g = warp_sum(acc[r * tb + t], plane_size);
            let u = warp_sum(acc[(r + half) * tb + t], plane_size);
            let row = row0 + r;
            if lane == 0 && row < n / 2 && t < tokens {
                y[y_off + t * n + row] = crate::families::act_fn(g, act) * u;
            }
        }
    }
}

/// Loads step `s`'s plane words of the unit's rows ([`unit_row`]`(row0, r, half, up)`; `wpl`
/// words per lane and row, all unrolled so they are in flight together) into `pw`; words past
/// the item (or of rows with `row0 + r mod half` at or past `n_live`) are zero.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_step(
    planes: &Array<u32>,
    pw: &mut Array<u32>,
    plane_off: usize,
    n: usize,
    n_live: usize,
    up: usize,
    words: usize,
    row0: usize,
    s: usize,
    lane: usize,
    #[comptime] plane_size: usize,
    #[comptime] rows: usize,
    #[comptime] half: usize,
    #[comptime] wpl: usize,
    #[comptime] bits: usize,
) {
    let step_words = comptime![plane_size * wpl];
    #[unroll]
    for r in 0..rows {
        let row = unit_row(row0, r, half, up);
        #[unroll]
        for j in 0..wpl {
            let wi = s * step_words + j * plane_size + lane;
            let live = row0 + r % half < n_live && wi < words;
            #[unroll]
            for p in 0..bits {
                let mut v = 0u32;
                if live {
                    v = planes[plane_off + (p * n + row) * words + wi];
                }
                pw[(r * wpl + j) * bits + p] = v;
            }
        }
    }
}
