//! The tiled expert GEMM: a cube per (row tile, work item).
//!
//! A cube holds `warps` planes (warps); warp `w` owns rows `row0 + w·R .. + R`
//! (`R = rows_per_warp`), lane `l` owns word `l` of each chunk of `32 · plane_size` columns. The
//! cube stages the chunk of `x` (all tokens) in shared memory with one pad vector per 32
//! columns, so the lanes' reads hit distinct banks, and the rows' LUTs as f32. Indices come out
//! of the plane words by a bit-matrix transpose ([`word_rows`]), 32 at a time; the decoded
//! weight is reused for every token.

use cubecl::prelude::*;
use half::f16;

use super::GemmConfig;
use crate::{Activation, DeviceArray};

use super::bitplane::{
    LUT_SHARED, X4, XV_PER_WORD, lane_lut_regs, load_lane_luts, stage_words, store_rows, word_rows,
};

/// The kernel. Grid: `(row tiles of warps · rows_per_warp, work items)`;
/// cube: `warps · plane_size` units. Descriptor `d = desc[8·item ..]`: plane word offset,
/// LUT element offset, rows, cols, bits, x offset, y offset, tokens. With `counted` the table
/// is a routing's (see [`crate::routing::RouteBuffers`]): word 0 of the slot after its `n_items`
/// items counts the live ones, which come first, and the items past them are not read.
///
/// Each cube branches once per chunk (uniformly) into a body compiled for its item's
/// bit-width, so a `b`-bit block builds its indices from `b` planes only, and into a body for
/// at most 2 tokens when its item has that few (routed decode items mostly do), so padding
/// tokens cost no multiply-adds. Within a body, the `x` values of a column are read from
/// shared memory once for all the warp's rows.
#[cube(launch_unchecked)]
// A comptime switch around a runtime test stays two `if`s: CubeCL expands them differently.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn ap_gemm_kernel(
    planes: &Array<u32>,
    luts: &Array<f16>,
    desc: &Array<u32>,
    x: &Array<f32>,
    y: &mut Array<f32>,
    n_items: u32,
    #[comptime] max_tokens: usize,
    #[comptime] plane_size: usize,
    #[comptime] warps: usize,
    #[comptime] rows_per_warp: usize,
    #[comptime] act: u32,
    #[comptime] lut_slots: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
    #[comptime] counted: bool,
) {
    if comptime![counted] {
        if CUBE_POS_Y >= desc[n_items as usize * 8usize] {
            terminate!();
        }
    }
    let rows_per_cube = warps * rows_per_warp;
    let d = CUBE_POS_Y as usize * 8usize;
    let plane_off = desc[d] as usize;
    let lut_off = desc[d + 1] as usize;
    let n = desc[d + 2] as usize;
    let k = desc[d + 3] as usize;
    let bits = desc[d + 4];
    let x_off = desc[d + 5] as usize;
    let y_off = desc[d + 6] as usize;
    let tokens = desc[d + 7] as usize;

    let row0 = CUBE_POS_X as usize * rows_per_cube;
    if row0 >= n || tokens == 0 {
        terminate!();
    }
    let lut_len = 1usize << bits as usize;
    let unit = UNIT_POS as usize;
    let cube_units = warps * plane_size;

    // Each row's LUT gets the launch's widest LUT of slots: a launch of narrow blocks leaves
    // shared memory (hence occupancy) to the `x` chunk.
    let mut lut_s = SharedMemory::<f32>::new(warps * rows_per_warp * lut_slots);
    // Items whose LUTs the lanes hold (see `gemm_item`) never read these.
    if comptime![shuffle == LUT_SHARED] || bits > 4u32 {
        for i in range_stepped(unit, rows_per_cube * lut_len, cube_units) {
            let r = i / lut_len;
            let e = i % lut_len;
            if row0 + r < n {
                lut_s[r * lut_slots + e] = f32::cast_from(luts[lut_off + (row0 + r) * lut_len + e]);
            }
        }
    }
    let mut x_s = SharedMemory::<X4>::new(max_tokens * plane_size * XV_PER_WORD);

    // Few-token items (most routed decode items) run a body with no padding tokens.
    let small = comptime![if max_tokens < 2 { max_tokens } else { 2usize }];
    if comptime![small < max_tokens] && tokens <= small {
        gemm_item(
            planes,
            luts,
            lut_off,
            x,
            y,
            &lut_s,
            &mut x_s,
            plane_off,
            n,
            k,
            bits,
            x_off,
            y_off,
            tokens,
            row0,
            small,
            plane_size,
            warps,
            rows_per_warp,
            act,
            lut_slots,
            unrolled,
            shuffle,
        );
    } else {
        gemm_item(
            planes,
            luts,
            lut_off,
            x,
            y,
            &lut_s,
            &mut x_s,
            plane_off,
            n,
            k,
            bits,
            x_off,
            y_off,
            tokens,
            row0,
            max_tokens,
            plane_size,
            warps,
            rows_per_warp,
            act,
            lut_slots,
            unrolled,
            shuffle,
        );
    }
}

/// One item's row tile for a token bucket `tb`: stage `x` chunk by chunk, dispatch on the
/// bit-width, reduce across the warp and store.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemm_item(
    planes: &Array<u32>,
    luts: &Array<f16>,
    lut_off: usize,
    x: &Array<f32>,
    y: &mut Array<f32>,
    lut_s: &SharedMemory<f32>,
    x_s: &mut SharedMemory<X4>,
    plane_off: usize,
    n: usize,
    k: usize,
    bits: u32,
    x_off: usize,
    y_off: usize,
    tokens: usize,
    row0: usize,
    #[comptime] tb: usize,
    #[comptime] plane_size: usize,
    #[comptime] warps: usize,
    #[comptime] rows_per_warp: usize,
    #[comptime] act: u32,
    #[comptime] lut_slots: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
) {
    let words = k.div_ceil(32usize);
    let unit = UNIT_POS as usize;
    let cube_units = warps * plane_size;
    let lane = unit % plane_size;
    let warp = unit / plane_size;
    let wrow0 = row0 + warp * rows_per_warp;
    let xs_stride = plane_size * XV_PER_WORD;
    let mut rb = Array::<u32>::new(rows_per_warp);
    #[unroll]
    for r in 0..rows_per_warp {
        rb[r] = ((warp * rows_per_warp + r) * lut_slots) as u32;
    }

    // Lane-held LUTs of the warp's rows (≤ 4-bit items, when the launch uses them).
    let mut lr = Array::<f32>::new(rows_per_warp * comptime![lane_lut_regs(shuffle)]);
    if comptime![shuffle != LUT_SHARED] && bits <= 4u32 {
        let lut_len = 1usize << bits as usize;
        load_lane_luts(
            luts,
            lut_off,
            lut_len,
            wrow0,
            n,
            0,
            lane,
            &mut lr,
            rows_per_warp,
            rows_per_warp,
            shuffle,
        );
    }

    let mut acc = Array::<f32>::new(tb * rows_per_warp);
    #[unroll]
    for t in 0..tb * rows_per_warp {
        acc[t] = 0.0;
    }
    let n_chunks = words.div_ceil(plane_size);
    for ch in 0..n_chunks {
        // The previous chunk must be consumed (and the LUTs staged) first.
        sync_cube();
        let c0 = ch * 32usize * plane_size;
        stage_words::<f32>(x, x_s, x_off, k, c0, plane_size, tokens, unit, tb, cube_units, act);
        sync_cube();

        let wi = ch * plane_size + lane;
        // One uniform branch per chunk into a body compiled for the item's bit-width.
        let span = ChunkSpan { plane_off, n, words, wi, wrow0, xs_stride, lane };
        let shape = comptime![ChunkShape { tb, rows_per_warp, unrolled, shuffle }];
        chunk_rows_of_width(planes, &span, &rb, &lr, lut_s, x_s, &mut acc, bits, 3usize, shape);
    }

    store_rows(&acc, y, y_off, n, wrow0, tokens, lane, rows_per_warp, tb, plane_size);
}

/// The comptime shape [`chunk_rows`] is compiled for ([`ap_gemm_kernel`]'s arguments of the
/// same names, `tb` the item's token bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ChunkShape {
    tb: usize,
    rows_per_warp: usize,
    unrolled: bool,
    shuffle: u32,
}

/// Where one lane's word of a staged chunk lies: the item's planes (`n` rows of `words` words
/// from `plane_off`), the word `wi`, the warp's first row `wrow0`, and the staged `x`'s row
/// stride.
#[derive(CubeType, Clone, Copy)]
struct ChunkSpan {
    plane_off: usize,
    n: usize,
    words: usize,
    wi: usize,
    wrow0: usize,
    xs_stride: usize,
    lane: usize,
}

/// [`chunk_rows`] compiled for the item's bit-width `bits` (3..=8): one uniform branch per
/// width from `b` on, so a `b`-bit block builds its indices from `b` planes only.
#[cube]
#[allow(clippy::too_many_arguments)]
fn chunk_rows_of_width(
    planes: &Array<u32>,
    span: &ChunkSpan,
    rb: &Array<u32>,
    lr: &Array<f32>,
    lut_s: &SharedMemory<f32>,
    x_s: &SharedMemory<X4>,
    acc: &mut Array<f32>,
    bits: u32,
    #[comptime] b: usize,
    #[comptime] shape: ChunkShape,
) {
    if comptime![b < 8] {
        if bits == comptime![b as u32] {
            chunk_rows(planes, span, rb, lr, lut_s, x_s, acc, b, shape);
        } else {
            chunk_rows_of_width(planes, span, rb, lr, lut_s, x_s, acc, bits, comptime![b + 1], shape);
        }
    } else {
        chunk_rows(planes, span, rb, lr, lut_s, x_s, acc, 8usize, shape);
    }
}

/// One lane's word of one staged chunk for the warp's rows, at `bits` bits: loads every
/// plane word first (all in flight together), then [`word_rows`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn chunk_rows(
    planes: &Array<u32>,
    span: &ChunkSpan,
    rb: &Array<u32>,
    lr: &Array<f32>,
    lut_s: &SharedMemory<f32>,
    x_s: &SharedMemory<X4>,
    acc: &mut Array<f32>,
    #[comptime] bits: usize,
    #[comptime] shape: ChunkShape,
) {
    let tb = comptime![shape.tb];
    let rows_per_warp = comptime![shape.rows_per_warp];
    let unrolled = comptime![shape.unrolled];
    let shuffle = comptime![shape.shuffle];
    let plane_off = span.plane_off;
    let n = span.n;
    let words = span.words;
    let wi = span.wi;
    let wrow0 = span.wrow0;
    let xs_stride = span.xs_stride;
    let lane = span.lane;
    let mut pw = Array::<u32>::new(rows_per_warp * bits);
    #[unroll]
    for r in 0..rows_per_warp {
        let row = wrow0 + r;
        let live = row < n && wi < words;
        #[unroll]
        for p in 0..bits {
            let mut v = 0u32;
            if live {
                v = planes[plane_off + (p * n + row) * words + wi];
            }
            pw[r * bits + p] = v;
        }
    }
    word_rows::<f32>(
        &pw,
        0usize,
        rb,
        lr,
        lut_s,
        x_s,
        lane * XV_PER_WORD,
        xs_stride,
        acc,
        bits,
        bits,
        tb,
        rows_per_warp,
        unrolled,
        shuffle,
    );
}

/// Launches [`ap_gemm_kernel`] over `n_items` descriptors of up to `max_rows` rows, compiled for
/// the token bucket `tb` and `lut_slots` LUT slots per row; `counted`: a routing's table (live
/// items first, their count after the items).
///
/// # Safety
/// The descriptors must lie inside the buffers: checked by the caller against host items, or
/// written on the device from validated slot words (routed tables).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    [planes, luts, desc, x, y]: [&DeviceArray; 5],
    n_items: usize,
    max_rows: usize,
    tb: usize,
    act: Activation,
    lut_slots: usize,
    counted: bool,
) {
    let tiles = max_rows.div_ceil(cfg.warps * cfg.rows_per_warp) as u32;
    // SAFETY: the caller's contract.
    unsafe {
        ap_gemm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tiles, n_items as u32, 1),
            CubeDim::new_1d((cfg.warps * cfg.plane_size) as u32),
            planes.arg(),
            luts.arg(),
            desc.arg(),
            x.arg(),
            y.arg(),
            n_items as u32,
            tb,
            cfg.plane_size,
            cfg.warps,
            cfg.rows_per_warp,
            act.code(),
            lut_slots,
            cfg.unrolled,
            cfg.lut_mode(),
            counted,
        )
    }
}
