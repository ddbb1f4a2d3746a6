//! The expert kernels' shared device code: staging `x`, decoding bit-plane words into LUT
//! indices by a bit-matrix transpose, lane-held LUTs, and the warp reductions into `y`.
//!
//! Planes are read exactly as `pw-format` stores them (`[planes, rows, words]`, plane 0 = MSB,
//! bit `j` of a word = column `32·w + j`), so a page lowered by dropping trailing planes needs
//! no rewrite.

use cubecl::prelude::*;
use half::f16;

use crate::activation::act_fn;
use crate::plane::warp_sum;

/// Column `col` of the `x` row at `base` as the kernels use it: as is, or `act(gate) · up` with
/// `up` `k` columns after `gate`.
#[cube]
pub(crate) fn staged_x(x: &Array<f32>, base: usize, k: usize, col: usize, #[comptime] act: u32) -> f32 {
    if comptime![act == 0 || act == 3] {
        x[base + col]
    } else {
        act_fn(x[base + col], act) * x[base + k + col]
    }
}

/// Reduces each lane's partial sums `acc[r · tb + t]` across the warp and lets lane 0 store the
/// rows `row0 + r` below `n` of the `tokens` real tokens.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_rows(
    acc: &Array<f32>,
    y: &mut Array<f32>,
    y_off: usize,
    n: usize,
    row0: usize,
    tokens: usize,
    lane: usize,
    #[comptime] rows: usize,
    #[comptime] tb: usize,
    #[comptime] plane_size: usize,
) {
    #[unroll]
    for r in 0..rows {
        #[unroll]
        for t in 0..tb {
            let s = warp_sum(acc[r * tb + t], plane_size);
            let row = row0 + r;
            if lane == 0 && row < n && t < tokens {
                y[y_off + t * n + row] = s;
            }
        }
    }
}

/// `f32` vectors of four staged `x` values.
pub(crate) type X4 = Vector<f32, Const<4>>;

/// Four staged `x` values of element type `XF` (f32, or f16 to halve the shared-memory reads of
/// the GEMV; see [`GemmConfig::gemv_x_half`]).
pub(crate) type XS<XF> = Vector<XF, Const<4>>;

/// Shared-memory vectors per staged 32-column word: 8 of data and one of padding, so the
/// lanes' 16-byte reads of consecutive words hit distinct banks (a stride of 36 words).
pub(crate) const XV_PER_WORD: usize = 9;

/// Staged vector `s` (`0..8`) of the word starting at column `col0`: within a word, columns are
/// stored in the order in which [`word_rows`] takes its indices, so the 8 columns of one
/// transposed word `q` are two consecutive vectors. Vector `s` holds columns
/// `col0 + q + 4h + 8jj` (`q = s / 2`, `h = s mod 2`, `jj = 0..4`); columns at or past `k` are
/// zero.
#[cube]
pub(crate) fn staged_vec<XF: Float>(
    x: &Array<f32>,
    base: usize,
    k: usize,
    col0: usize,
    s: usize,
    #[comptime] act: u32,
) -> XS<XF> {
    let c = col0 + s / 2usize + 4usize * (s % 2usize);
    let mut v = XS::<XF>::empty();
    #[unroll]
    for jj in 0..4usize {
        let col = c + 8usize * jj;
        let mut e = 0.0f32;
        if col < k {
            e = staged_x(x, base, k, col, act);
        }
        v[jj] = XF::cast_from(e);
    }
    v
}

#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_words<XF: Float>(
    x: &Array<f32>,
    x_s: &mut SharedMemory<XS<XF>>,
    x_off: usize,
    k: usize,
    col0: usize,
    words: usize,
    tokens: usize,
    unit: usize,
    #[comptime] tb: usize,
    cube_units: usize,
    #[comptime] act: u32,
) {
    let x_stride = if comptime![act == 0] { k } else { 2usize * k };
    let xs_stride = words * XV_PER_WORD;
    let total = tb * words * 8usize;
    // STAGE_ROUND vectors per unit per round, all loaded before any is stored: one at a time,
    // a unit waited out an L2 round trip per vector (the GEMV stages Mixtral's 14336-column
    // down input, 14 vectors per unit, while its cube does nothing else).
    let mut vs = Array::<XS<XF>>::new(STAGE_ROUND);
    for i0 in range_stepped(unit, total, STAGE_ROUND * cube_units) {
        #[unroll]
        for j in 0..STAGE_ROUND {
            let i = i0 + j * cube_units;
            let t = i / (words * 8usize);
            let mut v = XS::<XF>::empty().fill(XF::new(0.0));
            if i < total && t < tokens {
                let wl = (i / 8usize) % words;
                v = staged_vec::<XF>(x, x_off + t * x_stride, k, col0 + 32usize * wl, i % 8usize, act);
            }
            vs[j] = v;
        }
        #[unroll]
        for j in 0..STAGE_ROUND {
            let i = i0 + j * cube_units;
            if i < total {
                let t = i / (words * 8usize);
                let wl = (i / 8usize) % words;
                x_s[t * xs_stride + wl * XV_PER_WORD + i % 8usize] = vs[j];
            }
        }
    }
}

/// Vectors of `x` each unit of [`stage_words`] loads before storing any.
const STAGE_ROUND: usize = 4;

/// Exchanges the bits of `t[a]` at positions `i + s` with those of `t[b]` at `i`, for the
/// positions `i` set in `m`: one step of a bit-matrix transpose (two instructions per word on
/// the GPU: a shift and a three-input select).
#[cube]
fn delta_swap(
    t: &mut Array<u32>,
    #[comptime] a: usize,
    #[comptime] b: usize,
    #[comptime] s: u32,
    #[comptime] m: u32,
) {
    let x = t[a];
    let y = t[b];
    let ms = comptime![m << s];
    t[a] = (x & comptime![!(m << s)]) | ((y << s) & ms);
    t[b] = (y & comptime![!m]) | ((x >> s) & m);
}

/// Transposes the four words `t[o..o + 4]` as 4 × 4 bit blocks: afterwards nibble `j` of
/// `t[o + i]` holds bit `4j + i` of the four input words, input word `k` at bit `k`.
#[cube]
fn transpose4(t: &mut Array<u32>, #[comptime] o: usize) {
    delta_swap(t, o, o + 2usize, 2u32, 0x3333_3333u32);
    delta_swap(t, o + 1usize, o + 3usize, 2u32, 0x3333_3333u32);
    delta_swap(t, o, o + 1usize, 1u32, 0x5555_5555u32);
    delta_swap(t, o + 2usize, o + 3usize, 1u32, 0x5555_5555u32);
}

/// Where the expert kernels look up LUTs of at most 16 entries (≤ 4 bits; wider ones always
/// come from shared memory): from shared memory, or from the warp's registers by shuffles.
pub(crate) const LUT_SHARED: u32 = 0;

/// Lane `l` holds entry `l mod 2^bits` of each row; the shuffle's source lane is the index
/// word shifted, unmasked: the hardware takes it modulo 32 (CUDA's `__shfl_sync`), and the
/// duplicated upper lanes make the stray bit above the index harmless.
pub(crate) const LUT_LANES_WRAP: u32 = 1;

/// As [`LUT_LANES_WRAP`] with the source lane masked (APIs where a lane past the plane is
/// undefined), for planes of at least 16 lanes.
pub(crate) const LUT_LANES_MASKED: u32 = 2;

/// Planes of 8 lanes (lavapipe): lane `l` holds entries `l` and `l + 8` in two registers; two
/// shuffles and a select.
pub(crate) const LUT_LANES_PAIR: u32 = 3;

/// Registers per row per lane of the lane-held LUTs for `shuffle`.
pub(crate) fn lane_lut_regs(shuffle: u32) -> usize {
    if shuffle == LUT_LANES_PAIR { 2 } else { 1 }
}

/// Entry `src`'s low bits of row `r`'s lane-held LUT (see the `LUT_LANES_*` modes).
#[cube]
fn lane_lut(lr: &Array<f32>, r: usize, src: u32, #[comptime] shuffle: u32) -> f32 {
    if comptime![shuffle == LUT_LANES_WRAP] {
        plane_shuffle(lr[r], src)
    } else if comptime![shuffle == LUT_LANES_MASKED] {
        plane_shuffle(lr[r], src & 15u32)
    } else {
        let lo = plane_shuffle(lr[2usize * r], src & 7u32);
        let hi = plane_shuffle(lr[2usize * r + 1usize], src & 7u32);
        select((src & 8u32) != 0u32, hi, lo)
    }
}

/// Loads this lane's entries of the lane-held LUTs of `rows` rows into `lr` (see the
/// `LUT_LANES_*` modes; `lut_len` entries per row from `lut_off`): row `r` is
/// [`unit_row`]`(row0, r, half, up)`, and rows with `row0 + r mod half` at or past `n_live` get
/// zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_lane_luts(
    luts: &Array<f16>,
    lut_off: usize,
    lut_len: usize,
    row0: usize,
    n_live: usize,
    up: usize,
    lane: usize,
    lr: &mut Array<f32>,
    #[comptime] rows: usize,
    #[comptime] half: usize,
    #[comptime] shuffle: u32,
) {
    let regs = comptime![lane_lut_regs(shuffle)];
    #[unroll]
    for r in 0..rows {
        #[unroll]
        for i in 0..regs {
            let mut v = 0.0f32;
            if row0 + r % half < n_live {
                let e = (lane + 8usize * i) & (lut_len - 1usize);
                v = f32::cast_from(luts[lut_off + unit_row(row0, r, half, up) * lut_len + e]);
            }
            lr[r * regs + i] = v;
        }
    }
}

/// Row `r` of a warp unit starting at `row0`: `row0 + r` for a plain unit (`half` = its row
/// count); for a gated unit (gate rows then the matching up rows, `half` each) the up rows lie
/// `up` rows further.
#[cube]
pub(crate) fn unit_row(row0: usize, r: usize, #[comptime] half: usize, up: usize) -> usize {
    row0 + (r / half) * up + r % half
}

/// Adds one lane's plane word (32 columns) of `rows` rows at `bits` bits to
/// `acc[r · tb + t]`. `pw[pw0 + r · row_stride + p]` is plane `p`'s word of row `r`; `rb[r]` is
/// row `r`'s LUT base in `lut_s` (a multiple of `2^bits` rounded up to 16, below 16384);
/// `x_s[xv0 + t · xs_stride ..][..8]` is the word's staged `x` (see [`staged_vec`]).
///
/// The row's plane words are transposed as bit matrices (plane `bits − 1 − k` into row `k`,
/// missing planes zero), so every index comes out whole, MSB first as the format defines it:
/// at ≤ 4 bits nibble `j` of transposed word `q` is column `q + 4j`'s index (16 instructions
/// for 32 indices); above, two such nibble transposes (planes `bits − 1 .. bits − 4` and the
/// rest) are merged into bytes, low nibbles from the first (`q + 8jj` and `q + 4 + 8jj` in two
/// words). A lookup is then one shift and one mask-or of the row's byte base (bases are
/// multiples of the LUT size, so the or is an add) before the LDS, instead of rebuilding the
/// indices plane by plane per shift (a shift and a mask-or per plane per eight indices).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn word_rows<XF: Float>(
    pw: &Array<u32>,
    pw0: usize,
    rb: &Array<u32>,
    lr: &Array<f32>,
    lut_s: &SharedMemory<f32>,
    x_s: &SharedMemory<XS<XF>>,
    xv0: usize,
    xs_stride: usize,
    acc: &mut Array<f32>,
    #[comptime] row_stride: usize,
    #[comptime] bits: usize,
    #[comptime] tb: usize,
    #[comptime] rows: usize,
    #[comptime] unrolled: bool,
    #[comptime] shuffle: u32,
) {
    let nib = comptime![bits <= 4];
    let lanes = comptime![nib && shuffle != LUT_SHARED];
    let slots = comptime![if bits <= 4 { 4usize } else { 8usize }];
    // Index mask at byte granularity (×4: the LUT holds f32).
    let am = comptime![if bits <= 4 { 0x3Cu32 } else { 0x3FCu32 }];
    // Row r's LUT base as a byte offset; the mask (a no-op) bounds it for the compiler.
    let mut rp = Array::<u32>::new(rows);
    let mut tw = Array::<u32>::new(rows * slots);
    #[unroll]
    for r in 0..rows {
        rp[r] = (rb[r] & 0x3FFFu32) << 2u32;
        #[unroll]
        for kk in 0..slots {
            let mut v = 0u32;
            if comptime![kk < bits] {
                v = pw[pw0 + r * row_stride + comptime![bits - 1 - kk]];
            }
            tw[r * slots + kk] = v;
        }
        transpose4(&mut tw, comptime![r * slots]);
        if comptime![!nib] {
            transpose4(&mut tw, comptime![r * slots + 4]);
        }
    }
    // Byte-path index words of the current q: [r · 2 + h] (h = 0: columns q + 8jj, 1: q + 4 + 8jj).
    let mut vb = Array::<u32>::new(rows * 2usize);
    // Few tokens: both of a word's `x` vectors in registers; many: one at a time.
    let halves = comptime![if tb <= 4 { 1usize } else { 2usize }];
    let per_half = comptime![8usize / halves];
    let xw = comptime![2usize / halves];
    let mut xv = Array::<X4>::new(tb * xw);
    // Unrolled on GPUs (constant shifts); compact for CPU shader compilers.
    #[unroll(unrolled)]
    for q in 0..4usize {
        if comptime![!nib] {
            #[unroll]
            for r in 0..rows {
                let a = tw[r * 8usize + q];
                let b = tw[r * 8usize + 4usize + q];
                vb[2usize * r] = (a & 0x0F0F_0F0Fu32) | ((b << 4u32) & 0xF0F0_F0F0u32);
                vb[2usize * r + 1usize] = ((a >> 4u32) & 0x0F0F_0F0Fu32) | (b & 0xF0F0_F0F0u32);
            }
        }
        // Compact builds keep these loops too (lavapipe's compile time grows with the body).
        #[unroll(unrolled)]
        for hv in 0..halves {
            #[unroll(unrolled)]
            for t in 0..tb {
                #[unroll]
                for e in 0..xw {
                    let v = x_s[xv0 + t * xs_stride + 2usize * q + hv + e];
                    // Widened once per vector, whatever the rows (a no-op for f32).
                    let mut w = X4::empty();
                    #[unroll]
                    for i in 0..4usize {
                        w[i] = f32::cast_from(v[i]);
                    }
                    xv[t * xw + e] = w;
                }
            }
            #[unroll(unrolled)]
            for jl in 0..per_half {
                // Vector h, element jj of the word's staged x.
                let h = if comptime![halves == 1] { jl / 4usize } else { hv };
                let jj = jl % 4usize;
                // Nibble j of a transposed word is column q + 4j.
                let j = 2usize * jj + h;
                #[unroll]
                for r in 0..rows {
                    let w = if comptime![lanes] {
                        let src = tw[r * 4usize + q] >> (4usize * j) as u32;
                        lane_lut(lr, r, src, shuffle)
                    } else {
                        let addr = if comptime![nib] {
                            (((tw[r * 4usize + q] >> (4usize * j) as u32) << 2u32) & am) | rp[r]
                        } else {
                            (((vb[2usize * r + h] >> (8usize * jj) as u32) << 2u32) & am) | rp[r]
                        };
                        lut_s[(addr >> 2u32) as usize]
                    };
                    #[unroll(unrolled)]
                    for t in 0..tb {
                        acc[r * tb + t] += w * xv[t * xw + jl / 4usize][jj];
                    }
                }
            }
        }
    }
}
