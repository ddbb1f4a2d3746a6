//! The dense skinny GEMM on the matrix units: `y (+)= x · Wᵀ (+ bias)` with `W` f16 and
//! `x` f32, as TF32 `mma.sync` tiles of 16 rows × 8 tokens × 8 columns (f32 accumulation),
//! the same results as [`super::simt::dense_gemm_kernel`] up to TF32's rounding of `x`.
//!
//! Why: at several tokens the plain kernel re-reads each `x` vector from L1 for every two
//! rows and spends a multiply per weight and token, far below the memory bandwidth. Here a
//! warp's `x` fragment serves 16 rows and the
//! multiplies leave the ALUs, so the weights stream at memory speed whatever the token count.
//!
//! TF32 rather than f16 inputs: f16 weights are exact in TF32 (same 10-bit mantissa), and
//! `x` (a residual stream, unnormalised when the norm is fused) keeps f32's range, which f16
//! (max 65504) does not promise for every model.
//!
//! Layout: the columns a lane feeds the MMA are permuted so that it loads 16 contiguous bytes
//! of each of its two rows and 32 of its token's `x` per 32-column step (any permutation of
//! the reduction index is the same sum as long as `W` and `x` use the same one): lane
//! `(g, c) = (lane / 4, lane % 4)` holds columns `8c .. 8c + 8` of rows `g`, `g + 8` and of
//! token `g`, and MMA `m` of the step reads its columns `8c + 2m` and `8c + 2m + 1` as the
//! fragment's columns `c` and `c + 4`.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::f16;

use super::DenseGemm;
use super::matmul::MatmulKernel;
use crate::DeviceArray;
use crate::expert_gemm::bitplane::X4;
use crate::norms::{RowNorm, norm_args};

/// Eight halves: one lane's 16 bytes of a weight row per step.
pub(crate) type W8 = Vector<f16, Const<8>>;

type Tf = Vector<tf32, Const<1>>;

type Acc = Vector<f32, Const<2>>;

/// Columns per step (4 lanes × 8).
pub const MMA_STEP_COLS: usize = 32;

/// Tokens of one cube's token tile (two 8-token fragments) in a step of at most this many
/// tokens; larger steps take tiles of [`MmaTuning::wide_groups`] fragments.
pub const MMA_TILE_TOKENS: usize = 16;

/// Where a dense GEMM runs. The matrix units need a device with TF32 `mma`
/// ([`dense_mma_supported`]), `k` a multiple of [`MMA_STEP_COLS`] and a plain or
/// normed input; where one is missing the plain kernel runs whatever the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmaMode {
    /// The plain kernel.
    Off,
    /// The matrix units from [`MMA_MIN_TOKENS`] tokens with this launch shape (the default,
    /// [`MmaMode::AUTO`]).
    Auto(MmaTuning),
    /// The matrix units at any token count, with this launch shape (benchmarks).
    Always(MmaTuning),
    /// CubeK's matmul of this kind at any token count ([`super::matmul`]; benchmarks, tests).
    Matmul(MatmulKernel),
}

impl MmaMode {
    /// [`MmaMode::Auto`] with the default launch shape.
    pub const AUTO: MmaMode = MmaMode::Auto(MmaTuning::DEFAULT);
}

/// Fewest tokens for which [`MmaMode::Auto`] uses the matrix units: at one token the plain
/// kernel streams faster, at two the matrix units win on most matrices but not on a large LM
/// head, from three or four on every layer's matrix (`benches/results/h200-kernels.md`).
pub const MMA_MIN_TOKENS: usize = 3;

/// Launch shape of [`dense_mma_kernel`], and the matmul that takes over in large steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaTuning {
    /// Steps of 32 columns per warp whose weight loads are issued together.
    pub unroll: usize,
    /// Load the next round's weights before this round's MMAs.
    pub pipeline: bool,
    /// Warps per SM the grid should hold at least (columns are split, up to 16 ways, until it
    /// does).
    pub warps_per_sm: usize,
    /// Independent accumulators per token group (1 or 2).
    pub accumulators: usize,
    /// Load a round's `x` with its weights (else each step's just before its MMAs).
    pub x_ahead: bool,
    /// Token fragments of 8 per tile in steps of more than [`MMA_TILE_TOKENS`] tokens (1..8):
    /// each tile reads the weights again (from L2 after the first), so wider tiles read them
    /// fewer times; from 3 fragments a step's `x` is loaded just before its MMAs (registers).
    pub wide_groups: usize,
    /// From [`super::matmul::MATMUL_MIN_TOKENS`] tokens (and [`super::matmul::MATMUL_MIN_ROWS`]
    /// rows), CubeK's matmul of this kind on f16 inputs instead ([`super::matmul`]), on devices
    /// with f16 matrix units.
    pub matmul: Option<MatmulKernel>,
}

impl Default for MmaTuning {
    /// [`MmaTuning::DEFAULT`]: 4 steps per round without pipelining, the fastest shape
    /// measured on the H200; CubeK's [`MatmulKernel::DEFAULT`] for large steps.
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl MmaTuning {
    /// See [`Default`].
    pub const DEFAULT: MmaTuning = MmaTuning {
        unroll: 4,
        pipeline: false,
        warps_per_sm: 16,
        accumulators: 1,
        x_ahead: true,
        wide_groups: 2,
        matmul: Some(MatmulKernel::DEFAULT),
    };
}

/// Whether `client`'s device runs [`dense_mma_kernel`]: TF32 `mma` of 16 × 8 × 8
/// and planes of 32 lanes (CUDA from sm_80; not lavapipe).
pub fn dense_mma_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    use cubecl::ir::{ElemType, FloatKind, features::MmaConfig};
    let props = client.properties();
    let cfg = MmaConfig {
        a_type: ElemType::Float(FloatKind::TF32).into(),
        b_type: ElemType::Float(FloatKind::TF32).into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        n: 8,
        k: 8,
    };
    props.features.matmul.mma.contains(&cfg)
        && props.hardware.plane_size_min == 32
        && props.hardware.plane_size_max == 32
}

/// Warps per cube of [`dense_mma_kernel`] (more when one row tile is split more
/// ways).
const MMA_WARPS: usize = 8;

/// Most column splits of one row tile.
const MMA_MAX_SPLITS: usize = 16;

/// Launches [`dense_mma_kernel`] (arguments checked by the caller: `k` a multiple
/// of 32, the device supported).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    t: MmaTuning,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) {
    let row_tiles = g.n.div_ceil(16);
    let steps = g.k / MMA_STEP_COLS;
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    // The fewest column splits (a power of two up to 16, at most the steps) that give the grid
    // enough warps; a cube holds 8 warps (or one row tile's splits).
    let mut splits = 1;
    while splits < MMA_MAX_SPLITS && row_tiles * splits < t.warps_per_sm * sms && splits * 2 <= steps {
        splits *= 2;
    }
    let tiles = (MMA_WARPS / splits).max(1);
    let warps = tiles * splits;
    let groups = if tokens > MMA_TILE_TOKENS {
        t.wide_groups.clamp(1, 8)
    } else {
        tokens.min(MMA_TILE_TOKENS).div_ceil(8)
    };
    let ttiles = tokens.div_ceil(8 * groups);
    let (nw, np) = norm_args(norm, x, meta);
    // SAFETY: the caller checked `x` ≥ tokens · k, `w` = n · k, `y` ≥ tokens · n, the bias and
    // norm buffers; `k` is a multiple of 32, so every row starts 16-byte aligned and the
    // vector lengths below are whole.
    unsafe {
        dense_mma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((row_tiles.div_ceil(tiles) * ttiles) as u32, 1, 1),
            CubeDim::new_1d((warps * 32) as u32),
            ArrayArg::from_raw_parts(x.handle.clone(), x.len / 4),
            ArrayArg::from_raw_parts(w.handle.clone(), g.n * g.k / 8),
            bias.arg(),
            meta.arg(),
            ArrayArg::from_raw_parts(nw.handle.clone(), (nw.len / 4).max(1)),
            np.arg(),
            y.arg(),
            ttiles as u32,
            g.n,
            g.k,
            groups,
            tiles,
            splits,
            t.unroll.max(1),
            t.pipeline,
            t.accumulators.clamp(1, 2),
            t.x_ahead && groups <= 2,
            g.bias,
            g.accumulate,
            norm.is_some(),
        )
    };
}

/// The kernel. Grid: `ceil(ceil(n / 16) / tiles) · ttiles` cubes of `tiles · splits` warps of
/// 32 lanes; cube `i` takes the row block `i / ttiles` for the token tile `i mod ttiles` (`groups`
/// token groups of 8 from token `8 · groups · (i mod ttiles)`, of `meta[0]` tokens; the token
/// tiles of a row block run side by side, so its weights come from DRAM once, then from L2);
/// warp `w` of a cube takes row tile `w / splits` (16 rows) and every `splits`-th
/// step of 32 columns from `w % splits`, then the cube adds its splits' partial tiles in
/// shared memory.
/// `k` a multiple of [`MMA_STEP_COLS`]; `x` rows of `k`; with `norm` the per-token RMSNorm
/// of [`super::simt::dense_gemm_kernel`] (weight `norm_w[c] + norm_p[1]`, `eps = norm_p[0]`).
/// `unroll`, `pipeline`, `accs`, `x_ahead`: the launch shape ([`MmaTuning`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dense_mma_kernel(
    x: &Array<X4>,
    w: &Array<W8>,
    bias: &Array<f32>,
    meta: &Array<u32>,
    norm_w: &Array<X4>,
    norm_p: &Array<f32>,
    y: &mut Array<f32>,
    ttiles: u32,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] groups: usize,
    #[comptime] tiles: usize,
    #[comptime] splits: usize,
    #[comptime] unroll: usize,
    #[comptime] pipeline: bool,
    #[comptime] accs: usize,
    #[comptime] x_ahead: bool,
    #[comptime] has_bias: bool,
    #[comptime] accumulate: bool,
    #[comptime] norm: bool,
) {
    let unit = UNIT_POS as usize;
    let lane = unit % 32usize;
    let warp = unit / 32usize;
    let tile_in = warp / splits;
    let split = warp % splits;
    let block = CUBE_POS_X as usize / ttiles as usize;
    let t0 = (CUBE_POS_X as usize % ttiles as usize) * comptime![8 * groups];
    let row0 = (block * tiles + tile_in) * 16usize;
    let g = lane / 4usize;
    let c = lane % 4usize;
    let all = meta[0] as usize;
    if t0 >= all {
        terminate!();
    }
    let tokens = min(all - t0, comptime![8 * groups]);
    let last = tokens - 1usize;
    let steps = comptime![k / MMA_STEP_COLS];
    let kw = comptime![k / 8];
    let kx = comptime![k / 4];
    // Rows past `n` (the last tile) read row `n - 1` and store nothing: loads need no guard.
    let r_lo = min(row0 + g, n - 1usize) * kw + c;
    let r_hi = min(row0 + g + 8usize, n - 1usize) * kw + c;
    let mut x_row = Array::<usize>::new(groups);
    #[unroll]
    for j in 0..groups {
        x_row[j] = (t0 + min(8usize * j + g, last)) * kx + 2usize * c;
    }
    let def = MmaDefinition::<tf32, tf32, f32>::new(16usize, 8usize, 8usize);
    // `accs` accumulators per group, MMA `m` of a step into `m mod accs`: independent chains
    // (an MMA waits for the previous one on its accumulator), added at the end.
    let mut acc = Array::<Acc>::new(2usize * groups * accs);
    #[unroll]
    for i in 0..2usize * groups * accs {
        acc[i] = Acc::empty().fill(0.0f32);
    }
    // Per group: this lane's share of its token's Σ x² (with `norm`).
    let mut ss = Array::<f32>::new(groups);
    #[unroll]
    for j in 0..groups {
        ss[j] = 0.0;
    }
    let mut off = 0.0f32;
    if comptime![norm] {
        off = norm_p[1];
    }
    // Rounds of `unroll` steps whose loads are all issued before the first MMA; steps past
    // the end load the last step again and are skipped (the test is warp-uniform). With
    // `pipeline` the next round's weights are loaded before this round's MMAs, so a warp
    // keeps a round of weights in flight while it computes.
    let rounds = comptime![steps.div_ceil(splits * unroll)];
    let mut wn = Array::<W8>::new(2usize * unroll);
    if comptime![pipeline] {
        load_weights(w, &mut wn, r_lo, r_hi, 0usize, split, splits, steps, unroll);
    }
    for rd in 0..rounds {
        let mut wa = Array::<W8>::new(2usize * unroll);
        if comptime![pipeline] {
            #[unroll]
            for i in 0..2usize * unroll {
                wa[i] = wn[i];
            }
            load_weights(w, &mut wn, r_lo, r_hi, rd + 1usize, split, splits, steps, unroll);
        } else {
            load_weights(w, &mut wa, r_lo, r_hi, rd, split, splits, steps, unroll);
        }
        // `x_ahead`: every step's `x` (and norm weights) loaded with the round's weights;
        // otherwise each step's just before its MMAs (L1 hits; fewer registers live).
        let mut xa = Array::<X4>::new(2usize * unroll * groups);
        let mut ga = Array::<X4>::new(2usize * unroll);
        if comptime![x_ahead] {
            #[unroll]
            for u in 0..unroll {
                let s = min((rd * unroll + u) * splits + split, steps - 1usize);
                load_x(x, norm_w, &x_row, &mut xa, &mut ga, u, s, c, groups, norm);
            }
        }
        #[unroll]
        for u in 0..unroll {
            if (rd * unroll + u) * splits + split < steps {
                let mut xs = Array::<X4>::new(2usize * groups);
                let mut gs = Array::<X4>::new(2usize);
                let s = (rd * unroll + u) * splits + split;
                step_x(x, norm_w, &x_row, &xa, &ga, &mut xs, &mut gs, u, s, c, groups, norm, x_ahead);
                #[unroll]
                for m in 0..4usize {
                    let mut a = Array::<Tf>::new(4usize);
                    #[unroll]
                    for i in 0..4usize {
                        // a0: (g, c), a1: (g + 8, c), a2: (g, c + 4), a3: (g + 8, c + 4);
                        // fragment column c is physical 2m, c + 4 is 2m + 1.
                        let v = f32::cast_from(wa[2usize * u + i % 2usize][2usize * m + i / 2usize]);
                        a[i] = Tf::new(bits_as::<tf32>(v));
                    }
                    #[unroll]
                    for j in 0..groups {
                        let mut b = Array::<Tf>::new(2usize);
                        #[unroll]
                        for i in 0..2usize {
                            let p = 2usize * m + i;
                            let mut v = xs[j * 2usize + p / 4usize][p % 4usize];
                            if comptime![norm] {
                                ss[j] += v * v;
                                v *= gs[p / 4usize][p % 4usize] + off;
                            }
                            b[i] = Tf::new(round_to::<tf32>(v));
                        }
                        let ai = 2usize * (j * accs + m % accs);
                        let mut cj = Array::<Acc>::new(2usize);
                        cj[0] = acc[ai];
                        cj[1] = acc[ai + 1usize];
                        def.execute_inplace(&a, &b, &mut cj);
                        acc[ai] = cj[0];
                        acc[ai + 1usize] = cj[1];
                    }
                }
            }
        }
    }

    store_tiles(
        &mut acc, &ss, y, bias, norm_p, block, t0, tokens, unit, g, c, n, k, groups, tiles, splits, accs,
        has_bias, accumulate, norm,
    );
}

/// Step `s`'s `x` (and norm weight) vectors into `xs` and `gs`: copied from the round's `xa`
/// and `ga` (slot `u`) with `x_ahead`, else loaded now.
#[cube]
#[allow(clippy::too_many_arguments)]
fn step_x(
    x: &Array<X4>,
    norm_w: &Array<X4>,
    x_row: &Array<usize>,
    xa: &Array<X4>,
    ga: &Array<X4>,
    xs: &mut Array<X4>,
    gs: &mut Array<X4>,
    #[comptime] u: usize,
    s: usize,
    c: usize,
    #[comptime] groups: usize,
    #[comptime] norm: bool,
    #[comptime] x_ahead: bool,
) {
    if comptime![x_ahead] {
        #[unroll]
        for i in 0..2usize * groups {
            xs[i] = xa[u * 2usize * groups + i];
        }
        #[unroll]
        for h in 0..2usize {
            gs[h] = ga[2usize * u + h];
        }
    } else {
        load_x(x, norm_w, x_row, xs, gs, 0usize, s, c, groups, norm);
    }
}

/// Adds the cube's warps' partial tiles (their accumulators `acc`, and with `norm` their shares
/// `ss` of each token's `Σ x²`) through shared memory, applies the norm's scale and the bias,
/// and stores (or adds) the cube's rows of `y` (row block `block`, tokens `t0 ..`; see
/// [`dense_mma_kernel`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_tiles(
    acc: &mut Array<Acc>,
    ss: &Array<f32>,
    y: &mut Array<f32>,
    bias: &Array<f32>,
    norm_p: &Array<f32>,
    block: usize,
    t0: usize,
    tokens: usize,
    unit: usize,
    g: usize,
    c: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] groups: usize,
    #[comptime] tiles: usize,
    #[comptime] splits: usize,
    #[comptime] accs: usize,
    #[comptime] has_bias: bool,
    #[comptime] accumulate: bool,
    #[comptime] norm: bool,
) {
    let lane = unit % 32usize;
    let warp = unit / 32usize;
    // Partial tiles: warp `w`'s lane `l` element `e` (c0..c3 of group j) at
    // `((w · 32 + l) · groups + j) · 4 + e`.
    let warps = comptime![tiles * splits];
    let mut red = SharedMemory::<f32>::new(warps * 32 * groups * 4);
    let mut ssm = SharedMemory::<f32>::new(warps * 8 * groups);
    #[unroll]
    for j in 0..groups {
        #[unroll]
        for q in 1..accs {
            let (lo, hi) = (acc[2usize * (j * accs + q)], acc[2usize * (j * accs + q) + 1usize]);
            acc[2usize * j * accs] += lo;
            acc[2usize * j * accs + 1usize] += hi;
        }
        acc[2usize * j] = acc[2usize * j * accs];
        acc[2usize * j + 1usize] = acc[2usize * j * accs + 1usize];
    }
    #[unroll]
    for j in 0..groups {
        let base = ((warp * 32usize + lane) * groups + j) * 4usize;
        red[base] = acc[2usize * j][0];
        red[base + 1usize] = acc[2usize * j][1];
        red[base + 2usize] = acc[2usize * j + 1usize][0];
        red[base + 3usize] = acc[2usize * j + 1usize][1];
        if comptime![norm] {
            // The token's share over the four lanes of its group.
            let mut s = ss[j];
            s += plane_shuffle_xor(s, 1u32);
            s += plane_shuffle_xor(s, 2u32);
            if c == 0usize {
                ssm[(warp * groups + j) * 8usize + g] = s;
            }
        }
    }
    sync_cube();
    let mut eps = 0.0f32;
    if comptime![norm] {
        eps = norm_p[0];
    }
    let per_tile = comptime![32 * groups * 4];
    for o in range_stepped(unit, tiles * per_tile, warps * 32usize) {
        let t_in = o / per_tile;
        let e = o % per_tile;
        let mut s = 0.0f32;
        #[unroll]
        for sp in 0..splits {
            s += red[(t_in * splits + sp) * per_tile + e];
        }
        // Element e: lane l = e / (4 · groups), group j, accumulator slot i.
        let l = e / (4usize * groups);
        let j = (e / 4usize) % groups;
        let i = e % 4usize;
        let row = (block * tiles + t_in) * 16usize + l / 4usize + 8usize * (i / 2usize);
        let tk = 8usize * j + 2usize * (l % 4usize) + i % 2usize;
        if comptime![norm] {
            let mut q = 0.0f32;
            #[unroll]
            for sp in 0..splits {
                q += ssm[((t_in * splits + sp) * groups + j) * 8usize + tk % 8usize];
            }
            s *= 1.0 / (q / f32::cast_from(k) + eps).sqrt();
        }
        if comptime![has_bias] {
            s += bias[min(row, n - 1usize)];
        }
        if tk < tokens && row < n {
            if comptime![accumulate] {
                y[(t0 + tk) * n + row] += s;
            } else {
                y[(t0 + tk) * n + row] = s;
            }
        }
    }
}

/// `v`'s bits as a `T` (an f16 weight widened to f32 is exact in TF32: no rounding needed).
#[cube]
fn bits_as<T: Float>(v: f32) -> T {
    T::reinterpret(v)
}

/// `v` rounded to a `T`.
#[cube]
fn round_to<T: Float>(v: f32) -> T {
    T::cast_from(v)
}

/// Round `rd`'s weight vectors of rows `g` and `g + 8` (row starts `r_lo`, `r_hi`, lane
/// offset included) into `wa[2u]`, `wa[2u + 1]`; steps past the end load the last one.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_weights(
    w: &Array<W8>,
    wa: &mut Array<W8>,
    r_lo: usize,
    r_hi: usize,
    rd: usize,
    split: usize,
    #[comptime] splits: usize,
    #[comptime] steps: usize,
    #[comptime] unroll: usize,
) {
    #[unroll]
    for u in 0..unroll {
        let s = min((rd * unroll + u) * splits + split, steps - 1usize);
        wa[2usize * u] = w[r_lo + s * 4usize];
        wa[2usize * u + 1usize] = w[r_hi + s * 4usize];
    }
}

/// Step `s`'s `x` vectors of each token group (`x_row[j]`: the lane's token row start, lane
/// offset included) into `xa[(u · groups + j) · 2 + h]`, and with `norm` the norm weights'
/// into `ga[2u + h]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_x(
    x: &Array<X4>,
    norm_w: &Array<X4>,
    x_row: &Array<usize>,
    xa: &mut Array<X4>,
    ga: &mut Array<X4>,
    #[comptime] u: usize,
    s: usize,
    c: usize,
    #[comptime] groups: usize,
    #[comptime] norm: bool,
) {
    #[unroll]
    for j in 0..groups {
        #[unroll]
        for h in 0..2usize {
            xa[(u * groups + j) * 2usize + h] = x[x_row[j] + s * 8usize + h];
        }
    }
    if comptime![norm] {
        #[unroll]
        for h in 0..2usize {
            ga[2usize * u + h] = norm_w[s * 8usize + 2usize * c + h];
        }
    }
}
