//! Persistent grouped bit-plane + LUT GEMV for work items of one or two tokens (routed decode
//! items), same descriptors and results as the tiled kernel ([`super::tiled`]).
//!
//! Why a second kernel: the tiled kernel stages `x` chunk by chunk behind two cube barriers and
//! launches a cube per (row tile, item), including the items the router left empty, so at one
//! token its warps spend most of their time waiting at barriers or on a DRAM latency with few
//! loads in flight, far from the memory bandwidth. Here:
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

use super::GemmConfig;
use super::bitplane::{
    LUT_SHARED, XS, XV_PER_WORD, lane_lut_regs, load_lane_luts, stage_words, store_rows, unit_row, word_rows,
};
use crate::activation::act_fn;
use crate::plane::warp_sum;
use crate::pool::DESC_WORDS;
use crate::pool::token_bucket;
use crate::{Activation, DeviceArray};

/// The kernel. Grid: any number of cubes (a few per SM); cube: `warps · plane_size` units.
/// `n_items` descriptors of [`DESC_WORDS`] words (see [`super::tiled::ap_gemm_kernel`]); items
/// with zero tokens take no work (with `counted`, see [`launch_gemv`], only the live
/// items at the front are read). `x_words` (comptime) bounds `ceil(cols / 32)` over the items,
/// rounded up to a multiple of `plane_size · J`. `glu`: 0 for plain units, else the code of the
/// gated activation (`rows` even; see [`super::routed::ap_gemm_routed_gated`]).
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
    let mut pref = SharedMemory::<u32>::new(max_items + 1);
    let units_total = unit_prefix(desc, &mut pref, items, unit, max_items, plane_size, warps, half, glu);

    // This cube's contiguous range of units.
    let cubes = CUBE_COUNT;
    let c = CUBE_POS;
    let per = units_total / cubes;
    let rem = units_total % cubes;
    let start = c * per + select(c < rem, c, rem);
    let end = start + per + select(c < rem, 1usize, 0usize);

    let shape = comptime![GemvShape {
        tb,
        plane_size,
        warps,
        rows,
        wpl: words_per_lane,
        lut_slots,
        unrolled,
        shuffle,
        glu,
        prefetch,
    }];
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
        let item = GemvItem { plane_off, lut_off, n, words, y_off, tokens, first, u0, seg_end, lane, lbase };
        gemv_units_of_width::<XF>(planes, luts, &mut lut_s, &x_s, y, &item, bits, xs_stride, 3usize, shape);
        cur = seg_end;
    }
}

/// Writes `pref[i + 1]` = warp units of the items before `i + 1` (an item of `n` rows has
/// `ceil(n / half)` units, a gated one `ceil(n / 2 / half)`; items without tokens none) for the
/// `items` first descriptors, and returns the total. Every round's descriptor loads come first
/// (unconditional: items past the last read item 0 and count nothing), then one barrier for all
/// rounds' warp totals: a loop of rounds, each a round trip and two barriers, is slow.
#[cube]
#[allow(clippy::too_many_arguments)]
fn unit_prefix(
    desc: &Array<u32>,
    pref: &mut SharedMemory<u32>,
    items: usize,
    unit: usize,
    #[comptime] max_items: usize,
    #[comptime] plane_size: usize,
    #[comptime] warps: usize,
    #[comptime] half: usize,
    #[comptime] glu: u32,
) -> usize {
    let lane = unit % plane_size;
    let warp = unit / plane_size;
    let cube_units = warps * plane_size;
    let rounds = comptime![max_items.div_ceil(warps * plane_size)];
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
    carry as usize
}

/// The comptime shape a GEMV launch compiles [`gemv_units`] for: [`ap_gemv_kernel`]'s arguments
/// of the same names (`wpl` = `words_per_lane`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemvShape {
    tb: usize,
    plane_size: usize,
    warps: usize,
    rows: usize,
    wpl: usize,
    lut_slots: usize,
    unrolled: bool,
    shuffle: u32,
    glu: u32,
    prefetch: bool,
}

/// One item's descriptor fields and this warp's share of its units: `u0, u0 + warps, … <
/// seg_end`, the item's first unit being `first`; `lbase` is the warp's LUT region.
#[derive(CubeType, Clone, Copy)]
struct GemvItem {
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
}

/// [`gemv_units`] compiled for the item's bit-width `bits` (3..=8): one uniform branch per
/// width from `b` on, so a `b`-bit block builds its indices from `b` planes only.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemv_units_of_width<XF: Float>(
    planes: &Array<u32>,
    luts: &Array<f16>,
    lut_s: &mut SharedMemory<f32>,
    x_s: &SharedMemory<XS<XF>>,
    y: &mut Array<f32>,
    item: &GemvItem,
    bits: u32,
    xs_stride: usize,
    #[comptime] b: usize,
    #[comptime] shape: GemvShape,
) {
    if comptime![b < 8] {
        if bits == comptime![b as u32] {
            gemv_units::<XF>(planes, luts, lut_s, x_s, y, item, xs_stride, b, shape);
        } else {
            gemv_units_of_width::<XF>(
                planes,
                luts,
                lut_s,
                x_s,
                y,
                item,
                bits,
                xs_stride,
                comptime![b + 1],
                shape,
            );
        }
    } else {
        gemv_units::<XF>(planes, luts, lut_s, x_s, y, item, xs_stride, 8usize, shape);
    }
}

/// One warp's units of an item (see [`GemvItem`]) at `bits` bits.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemv_units<XF: Float>(
    planes: &Array<u32>,
    luts: &Array<f16>,
    lut_s: &mut SharedMemory<f32>,
    x_s: &SharedMemory<XS<XF>>,
    y: &mut Array<f32>,
    item: &GemvItem,
    xs_stride: usize,
    #[comptime] bits: usize,
    #[comptime] shape: GemvShape,
) {
    let tb = comptime![shape.tb];
    let plane_size = comptime![shape.plane_size];
    let warps = comptime![shape.warps];
    let rows = comptime![shape.rows];
    let wpl = comptime![shape.wpl];
    let lut_slots = comptime![shape.lut_slots];
    let unrolled = comptime![shape.unrolled];
    let shuffle = comptime![shape.shuffle];
    let glu = comptime![shape.glu];
    let prefetch = comptime![shape.prefetch];
    let plane_off = item.plane_off;
    let lut_off = item.lut_off;
    let n = item.n;
    let words = item.words;
    let y_off = item.y_off;
    let tokens = item.tokens;
    let first = item.first;
    let lane = item.lane;
    let lbase = item.lbase;
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
    for u in range_stepped(item.u0, item.seg_end, warps) {
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
        // (at one token the GEMV mostly waits on its plane words), at the cost of a second set
        // of word registers.
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
                y[y_off + t * n + row] = act_fn(g, act) * u;
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

/// Most tokens per item the persistent GEMV kernel takes (its `x` for all columns stays in
/// shared memory): the routed launches' largest chunk
/// ([`crate::routing::ROUTE_CHUNK_CHOICES`]). Launches of host items take it up to
/// [`GEMV_HOST_MAX_TOKENS`].
pub const GEMV_MAX_TOKENS: usize = 8;

/// Most tokens per item for which launches of host items (not routed) take the persistent
/// GEMV; above, the tiled kernel, which decodes each weight once for up to 16 tokens.
pub const GEMV_HOST_MAX_TOKENS: usize = 2;

/// Fewest items for which the persistent GEMV kernel is chosen. The tiled grid launches cubes
/// for every item, the GEMV only works on the active ones: ahead from a routed layer's items
/// on, but not for a single block, which keeps the tiled kernel.
pub const GEMV_MIN_ITEMS: usize = 16;

/// Default [`GemmConfig::gemv_rows`].
pub const GEMV_ROWS: usize = 2;

/// Default [`GemmConfig::gemv_warps_per_sm`]: the GEMV's registers at one token leave room for
/// 24 warps per SM; at two tokens they take more (`benches/results/sass-gemv.md`).
pub const GEMV_WARPS_PER_SM: usize = 24;

/// Calls `$f` (the GEMV kernel's launch, or its kernel definition's constructor) with the
/// leading arguments `$pre` and then [`ap_gemv_kernel`]'s comptime arguments for one
/// launch of `$cfg` and `$plan`, in declaration order: the one list both share.
macro_rules! gemv_comptime_call {
    ($f:path, ($($pre:expr),* $(,)?), ($cfg:expr, $plan:expr, $n_items:expr, $act:expr, $lut_slots:expr, $counted:expr)) => {
        $f(
            $($pre,)*
            $n_items,
            $plan.tb,
            $cfg.plane_size,
            $plan.warps,
            $cfg.gemv_rows,
            $cfg.gemv_words_per_lane,
            $plan.x_words,
            $act.code(),
            $lut_slots,
            $cfg.unrolled,
            $cfg.lut_mode(),
            $plan.glu,
            $counted,
            $cfg.gemv_prefetch,
        )
    };
}
#[cfg(feature = "cuda")]
pub(crate) use gemv_comptime_call;

/// The persistent GEMV's launch shape and comptime arguments for one launch (see
/// [`gemv_plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvPlan {
    /// Cubes in the grid.
    pub cubes: usize,
    /// Warps per cube.
    pub warps: usize,
    /// The kernel's comptime token bucket.
    pub tb: usize,
    /// Staged `x` words per token (a multiple of `plane_size · words_per_lane`).
    pub x_words: usize,
    /// Bytes of shared memory a cube takes.
    pub shared_bytes: usize,
    /// Gated activation code of the epilogue (0: plain units).
    pub glu: u32,
}

/// Where [`launch_gemv`] would launch the persistent GEMV on a device of `hw` (and with which
/// shape), or `None` where it does not apply (see [`GemmConfig::gemv`]; `x` of `cols` columns
/// must fit in shared memory). `counted`: a routed table (live items first, their count in a
/// header slot).
#[allow(clippy::too_many_arguments)]
pub fn gemv_plan(
    hw: &cubecl::ir::HardwareProperties,
    cfg: GemmConfig,
    n_items: usize,
    counted: bool,
    cols: usize,
    tokens: usize,
    lut_slots: usize,
    glu: Option<Activation>,
) -> Option<GemvPlan> {
    let tb = token_bucket(tokens);
    // Routed tables (`counted`) come in chunks the GEMV always takes; host items above two
    // tokens go to the tiled kernel.
    let most = if counted { GEMV_MAX_TOKENS } else { GEMV_HOST_MAX_TOKENS };
    if !cfg.gemv || tb > most || n_items < cfg.gemv_min_items.max(1) {
        return None;
    }
    // A gated unit pairs gate rows with up rows, half of its rows each.
    let glu = match glu {
        None => 0,
        Some(a @ (Activation::SiluMul | Activation::GeluTanhMul)) if cfg.gemv_rows.is_multiple_of(2) => {
            a.code()
        }
        Some(_) => return None,
    };
    let ps = cfg.plane_size;
    let step = ps * cfg.gemv_words_per_lane;
    let x_words = cols.div_ceil(32).div_ceil(step) * step;
    // Staged x, LUTs, the items' prefix and one warp total per round of the prefix.
    let x_bytes = if cfg.gemv_x_half { 2 } else { 4 };
    let shared = |warps: usize| {
        let prefix = n_items + 1 + n_items.div_ceil(warps * ps) * warps;
        x_bytes * tb * x_words * 4 * XV_PER_WORD + 4 * (warps * cfg.gemv_rows * lut_slots + prefix)
    };
    if shared(cfg.warps) > hw.max_shared_memory_size {
        return None;
    }
    // As many cubes per SM as can be resident (shared memory, and registers: see
    // `gemv_warps_per_sm`), so no second wave leaves SMs idle at the end.
    let per_sm =
        |warps: usize| (hw.max_shared_memory_size / shared(warps)).min(cfg.gemv_warps_per_sm / warps).max(1);
    // Where the staged `x` (all columns) leaves room for fewer cubes, wider cubes keep as many
    // warps per SM (a wide down input at two tokens otherwise allows one cube of 8 warps per SM,
    // at half the bandwidth).
    let widest = (hw.max_units_per_cube as usize / ps).min(3 * cfg.warps);
    let warps = [cfg.warps, cfg.warps * 3 / 2, 2 * cfg.warps, 3 * cfg.warps]
        .into_iter()
        // At most 64 rows of LUTs per cube: `word_rows` keeps 14-bit LUT bases (see `check`).
        .filter(|&w| w <= widest && w * cfg.gemv_rows <= 64 && shared(w) <= hw.max_shared_memory_size)
        .max_by_key(|&w| (per_sm(w) * w, std::cmp::Reverse(w)))
        .unwrap_or(cfg.warps);
    let cubes = hw.num_streaming_multiprocessors.unwrap_or(4) as usize * per_sm(warps);
    Some(GemvPlan { cubes, warps, tb, x_words, shared_bytes: shared(warps), glu })
}

/// Launches [`ap_gemv_kernel`] over `n_items` descriptors when it applies (see
/// [`gemv_plan`]); `false` when it does not.
/// `counted`: the table has a header slot after its `n_items` items whose word 0 counts the
/// live items, which come first (the routing's tables); the kernel reads only those.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_gemv<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    [planes, luts, desc, x, y]: [&DeviceArray; 5],
    n_items: usize,
    counted: bool,
    cols: usize,
    tokens: usize,
    act: Activation,
    lut_slots: usize,
    glu: Option<Activation>,
) -> bool {
    let hw = &client.properties().hardware;
    let Some(plan) = gemv_plan(hw, cfg, n_items, counted, cols, tokens, lut_slots, glu) else {
        return false;
    };
    let threads = plan.warps * cfg.plane_size;
    // SAFETY: callers checked the descriptors against the buffers (host items) or built them
    // on the device from validated slot words (routed items).
    unsafe {
        // The staged element type is a generic of the kernel: one call per type.
        macro_rules! launch {
            ($xf:ty) => {
                gemv_comptime_call!(
                    ap_gemv_kernel::launch_unchecked::<$xf, R>,
                    (
                        client,
                        CubeCount::Static(plan.cubes as u32, 1, 1),
                        CubeDim::new_1d(threads as u32),
                        planes.arg(),
                        luts.arg(),
                        desc.arg(),
                        x.arg(),
                        y.arg(),
                        n_items as u32
                    ),
                    (cfg, plan, n_items, act, lut_slots, counted)
                )
            };
        }
        if cfg.gemv_x_half { launch!(f16) } else { launch!(f32) }
    };
    true
}
