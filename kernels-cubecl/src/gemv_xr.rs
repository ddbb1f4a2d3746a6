//! Persistent grouped GEMV for items of one token with `x` held in the lanes' registers: the
//! same descriptors, results and warp units as [`crate::gemv`], another split of the work.
//!
//! Why: in [`crate::gemv`] every lane walks a row's plane words and reads each word's 32 `x`
//! values from shared memory (8 vector loads per word, shared by the unit's rows), a third of
//! the load/store pipe's wavefronts at one token, and that pipe, which also carries the LUT
//! shuffles (one per weight), is what bounds it (ncu on the H200: 77 % of its wavefronts, DRAM
//! 30 %). Here a lane keeps one plane word position for every row it visits, so its 32 `x`
//! values stay in registers, loaded once per item:
//!
//! - a *group* of `group` warps covers `group · plane_size` plane words of a row (a K slice
//!   called a chunk; rows longer than that take several chunks, `x` reloaded per chunk); a cube
//!   holds `groups` groups, which share the cube's units round-robin;
//! - each warp adds its slice of a unit's rows with the lane-held (≤ 4 bits) or shared-memory
//!   LUTs of [`crate::gemm::word_rows`], reduces across its lanes and leaves the partial sum in
//!   shared memory; after a block of [`XR_BLOCK`] units a cube barrier, and the cube adds each
//!   row's partials (in warp order, so a row's value does not depend on the unit that held it)
//!   and stores it, or for gated units `act(gate) · up` as [`crate::gemv`] does.

use cubecl::prelude::*;
use half::f16;

use crate::gemm::{DESC_WORDS, X4, lane_lut_regs, staged_vec, word_rows};
use crate::gemv::{find_item, load_step, stage_luts, unit_prefix};

/// Units per block between the cube's barriers (the partial sums of a block stay in shared
/// memory: `XR_BLOCK · rows · group` floats).
pub const XR_BLOCK: usize = 64;

/// The kernel. Grid: any number of cubes; cube: `group · groups` warps of `plane_size` lanes.
/// `chunks` = `ceil(ceil(K / 32) / (group · plane_size))` for the largest `K` of the items. Items
/// must hold at most one token. `glu`: 0 for plain units, else the gated activation's code.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn ap_gemv_xr_kernel(
    planes: &Array<u32>,
    luts: &Array<f16>,
    desc: &Array<u32>,
    x: &Array<f32>,
    y: &mut Array<f32>,
    n_items: u32,
    chunks: u32,
    #[comptime] max_items: usize,
    #[comptime] plane_size: usize,
    #[comptime] group: usize,
    #[comptime] groups: usize,
    #[comptime] rows: usize,
    #[comptime] act: u32,
    #[comptime] lut_slots: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
    #[comptime] glu: u32,
) {
    let half = comptime![if glu > 0 { rows / 2 } else { rows }];
    let warps = comptime![group * groups];
    let unit = UNIT_POS as usize;
    let lane = unit % plane_size;
    let warp = unit / plane_size;
    let g = warp / group;
    let wg = warp % group;
    let cube_units = warps * plane_size;
    let items = n_items as usize;

    let mut pref = SharedMemory::<u32>::new(max_items + 1);
    let mut wsum = SharedMemory::<u32>::new(warps);
    let units_total =
        unit_prefix(desc, items, &mut pref, &mut wsum, unit, lane, warp, plane_size, warps, half, glu);

    // This cube's contiguous range of units.
    let cubes = CUBE_COUNT;
    let c = CUBE_POS;
    let per = units_total / cubes;
    let rem = units_total % cubes;
    let start = c * per + select(c < rem, c, rem);
    let end = start + per + select(c < rem, 1usize, 0usize);

    let mut lut_s = SharedMemory::<f32>::new(warps * rows * lut_slots);
    let lbase = warp * rows * lut_slots;
    let mut part = SharedMemory::<f32>::new(XR_BLOCK * rows * group);
    let mut xr = Array::<X4>::new(8usize);
    let mut acc = Array::<f32>::new(rows);
    let mut rb = Array::<u32>::new(rows);
    #[unroll]
    for r in 0..rows {
        rb[r] = (lbase + r * lut_slots) as u32;
    }
    let mut lr = Array::<f32>::new(rows * comptime![lane_lut_regs(shuffle)]);
    // `word_rows` takes a staged `x`; with `x` in registers it reads none.
    let x_s = SharedMemory::<X4>::new(1usize);

    for b0 in range_stepped(start, end, XR_BLOCK) {
        let b1 = min(b0 + XR_BLOCK, end);
        for ch in 0..chunks as usize {
            // This lane's plane word of every row: s · plane_size + lane.
            let s = ch * group + wg;
            // The item of the units being walked (units only grow): its descriptor, unit range
            // and `x` slice stay in registers until a unit lies past it.
            let mut it_end = 0usize;
            let mut first = 0usize;
            let mut plane_off = 0usize;
            let mut lut_off = 0usize;
            let mut n = 0usize;
            let mut k = 0usize;
            let mut bits = 0u32;
            for u in range_stepped(b0 + g, b1, groups) {
                if u >= it_end {
                    let it = find_item(&pref, items, u);
                    first = pref[it] as usize;
                    it_end = pref[it + 1] as usize;
                    let d = it * DESC_WORDS;
                    plane_off = desc[d] as usize;
                    lut_off = desc[d + 1] as usize;
                    n = desc[d + 2] as usize;
                    k = desc[d + 3] as usize;
                    bits = desc[d + 4];
                    let x_off = desc[d + 5] as usize;
                    let col0 = 32usize * (s * plane_size + lane);
                    #[unroll]
                    for v in 0..8usize {
                        xr[v] = staged_vec(x, x_off, k, col0, v, act);
                    }
                }
                let row0 = (u - first) * half;
                let words = k.div_ceil(32usize);
                if bits == 3u32 {
                    unit_slice(
                        planes, luts, &mut lut_s, &x_s, &xr, &mut acc, &rb, &mut lr, plane_off, lut_off, n,
                        words, row0, s, lane, lbase, 3usize, plane_size, rows, lut_slots, unrolled, shuffle,
                        glu,
                    );
                } else if bits == 4u32 {
                    unit_slice(
                        planes, luts, &mut lut_s, &x_s, &xr, &mut acc, &rb, &mut lr, plane_off, lut_off, n,
                        words, row0, s, lane, lbase, 4usize, plane_size, rows, lut_slots, unrolled, shuffle,
                        glu,
                    );
                } else if bits == 5u32 {
                    unit_slice(
                        planes, luts, &mut lut_s, &x_s, &xr, &mut acc, &rb, &mut lr, plane_off, lut_off, n,
                        words, row0, s, lane, lbase, 5usize, plane_size, rows, lut_slots, unrolled, shuffle,
                        glu,
                    );
                } else if bits == 6u32 {
                    unit_slice(
                        planes, luts, &mut lut_s, &x_s, &xr, &mut acc, &rb, &mut lr, plane_off, lut_off, n,
                        words, row0, s, lane, lbase, 6usize, plane_size, rows, lut_slots, unrolled, shuffle,
                        glu,
                    );
                } else if bits == 7u32 {
                    unit_slice(
                        planes, luts, &mut lut_s, &x_s, &xr, &mut acc, &rb, &mut lr, plane_off, lut_off, n,
                        words, row0, s, lane, lbase, 7usize, plane_size, rows, lut_slots, unrolled, shuffle,
                        glu,
                    );
                } else {
                    unit_slice(
                        planes, luts, &mut lut_s, &x_s, &xr, &mut acc, &rb, &mut lr, plane_off, lut_off, n,
                        words, row0, s, lane, lbase, 8usize, plane_size, rows, lut_slots, unrolled, shuffle,
                        glu,
                    );
                }
                // Lane r < rows holds row r's sum of the warp's slice.
                let sum = warp_sum_rows(&acc, lane, rows, plane_size);
                if lane < rows {
                    let slot = ((u - b0) * rows + lane) * group + wg;
                    if ch == 0 {
                        part[slot] = sum;
                    } else {
                        part[slot] += sum;
                    }
                }
            }
        }
        sync_cube();
        // Each row of the block's units: its partials in warp order, then the store.
        for i in range_stepped(unit, (b1 - b0) * half, cube_units) {
            let u = b0 + i / half;
            let r = i % half;
            let it = find_item(&pref, items, u);
            let d = it * DESC_WORDS;
            let n = desc[d + 2] as usize;
            let y_off = desc[d + 6] as usize;
            let row = (u - pref[it] as usize) * half + r;
            let p0 = ((u - b0) * rows + r) * group;
            let mut sum = 0.0f32;
            #[unroll]
            for w in 0..group {
                sum += part[p0 + w];
            }
            if comptime![glu > 0] {
                let mut upv = 0.0f32;
                #[unroll]
                for w in 0..group {
                    upv += part[p0 + half * group + w];
                }
                if row < n / 2usize {
                    y[y_off + row] = crate::families::act_fn(sum, glu) * upv;
                }
            } else if row < n {
                y[y_off + row] = sum;
            }
        }
        sync_cube();
    }
}

/// One warp's slice (plane word `s · plane_size + lane` of each row) of a unit starting at
/// `row0` at `bits` bits: `acc[r]` = this lane's part of row [`crate::gemm::unit_row`]`(row0, r, half, up)`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn unit_slice(
    planes: &Array<u32>,
    luts: &Array<f16>,
    lut_s: &mut SharedMemory<f32>,
    x_s: &SharedMemory<X4>,
    xr: &Array<X4>,
    acc: &mut Array<f32>,
    rb: &Array<u32>,
    lr: &mut Array<f32>,
    plane_off: usize,
    lut_off: usize,
    n: usize,
    words: usize,
    row0: usize,
    s: usize,
    lane: usize,
    lbase: usize,
    #[comptime] bits: usize,
    #[comptime] plane_size: usize,
    #[comptime] rows: usize,
    #[comptime] lut_slots: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
    #[comptime] glu: u32,
) {
    let half = comptime![if glu > 0 { rows / 2 } else { rows }];
    let n_live = if comptime![glu > 0] { n / 2 } else { n };
    let up = n_live;
    let lut_len = comptime![1usize << bits];
    // The planes first, so their loads are in flight while the LUTs are fetched.
    let mut pw = Array::<u32>::new(rows * bits);
    load_step(
        planes, &mut pw, plane_off, n, n_live, up, words, row0, s, lane, plane_size, rows, half, 1usize, bits,
    );
    stage_luts(
        luts, lut_off, lut_len, lut_s, lbase, row0, n_live, up, lane, lr, bits, rows, half, lut_slots,
        plane_size, shuffle,
    );
    #[unroll]
    for r in 0..rows {
        acc[r] = 0.0;
    }
    word_rows(
        &pw, 0usize, rb, lr, lut_s, x_s, 0usize, 0usize, xr, acc, bits, bits, 1usize, rows, unrolled,
        shuffle, true,
    );
}

/// The warp sums of `rows` values per lane (`rows` a power of two, at most the plane size), lane
/// `r < rows` getting row `r`'s: the first `log2(rows)` butterfly steps halve the values each
/// lane holds (a lane keeps the half its lane bit selects and adds its partner's share of it),
/// so `rows − 1 + log2(plane_size / rows)` shuffles instead of `rows · log2(plane_size)` (5
/// instead of 10 for two rows of 32 lanes). Every row is summed over the same butterfly tree,
/// whichever slot holds it, so a row's value does not depend on its slot (IEEE addition
/// commutes).
#[cube]
fn warp_sum_rows(
    acc: &Array<f32>,
    lane: usize,
    #[comptime] rows: usize,
    #[comptime] plane_size: usize,
) -> f32 {
    let mut w = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        w[r] = acc[r];
    }
    let steps = comptime![rows.trailing_zeros() as usize];
    #[unroll]
    for st in 0..steps {
        let c = comptime![rows >> (st + 1)];
        let upper = ((lane >> st) & 1usize) == 1usize;
        #[unroll]
        for i in 0..c {
            let lo = w[2usize * i];
            let hi = w[2usize * i + 1usize];
            let send = select(upper, lo, hi);
            let keep = select(upper, hi, lo);
            w[i] = keep + plane_shuffle_xor(send, comptime![1u32 << st as u32]);
        }
    }
    let mut v = w[0];
    #[unroll]
    for st in 0..comptime![(plane_size / rows).trailing_zeros() as usize] {
        v += plane_shuffle_xor(v, comptime![(rows << st) as u32]);
    }
    v
}
