//! The grouped expert GEMM of a whole step: every expert's gathered rows (grouped by expert, as
//! the routing writes them) through its block at its committed bit-width, each 16-row weight
//! tile decoded once per pass of up to `8 · token_groups` tokens whatever the expert's token
//! count, all experts of a layer in one launch.
//!
//! On devices with f16 `mma.sync` (CUDA, planes of 32) the decoded weights feed the matrix
//! units (the LUT-dequantize-into-MMA design): a warp holds a 16-row tile, lane `(g, c) =
//! (lane / 4, lane % 4)` decodes word `4s + c` of its rows `g` and `g + 8` from the bit-planes,
//! looks the indices up in the tile's LUTs (shared memory, f16) and feeds them as the A
//! fragments of eight m16n8k16 MMAs, whose B fragments are 8 tokens of `x` rounded to f16
//! (f32 accumulation). Any permutation of the reduction index gives the same sum when A and
//! B use the same one: MMA `j` of a word reads its columns `j, j + 8, j + 16, j + 24`, which
//! one shift-and-mask per plane (`(w >> j) & 0x01010101`) turns into four indices at once.
//! `x` is first rounded to f16 in that order by a launch of its own ([`grouped_x_kernel`]), so
//! each lane's B fragments are 16-byte loads that the four lanes of a token read as one
//! contiguous run: every row tile of an expert reads the same tokens, and converting them there
//! cost more than the MMAs.
//!
//! Two MMA kernels ([`GroupedKernel`]): with few tokens per expert each warp decodes its own
//! tile for all of its tokens ([`grouped_mma_kernel`]); with many, the LUT lookups of every
//! warp's decode would repeat per 64 tokens, so each cube's warps decode one tile each per step
//! into shared memory and all of them multiply every tile with their own slice of the tokens
//! ([`grouped_staged_kernel`]): a weight is decoded once per 128 tokens of a pass.
//! Elsewhere a plain kernel computes the same results with f32 `x` ([`grouped_simt_kernel`]).
//!
//! With a gated epilogue the gate_up launch pairs gate row `r` with up row `I + r` in one tile
//! (rows `g` and `g + 8` of the MMA) and stores `act(gate) · up` directly, so the activation
//! needs no launch and the down launch reads `[rows, I]`.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::f16;

use crate::activation::{act_fn, gelu_tanh, silu};
use crate::dense::mma::W8;
use crate::device::{bad, need};
use crate::{Activation, DeviceArray, KernelError};

/// Two halves: one 32-bit register of an f16 MMA fragment.
type H2 = Vector<f16, Const<2>>;

type Acc = Vector<f32, Const<2>>;

/// Warps per cube of the MMA kernel (their LUTs share the cube's shared memory).
pub(crate) const MMA_WARPS: usize = 4;

/// LUT slots per row in the MMA kernel's shared memory (the widest, 8 bits: bit-widths live in
/// device words the host does not read).
const LUT_ROW: usize = 256;

/// Most token groups of 8 per pass of the MMA kernel (its accumulators: 4 or 8 registers each):
/// each pass decodes the expert's weights again.
pub const GROUPED_MAX_TOKEN_GROUPS: usize = 8;

/// Independent accumulator chains per token group of the MMA kernel: two while the groups are
/// too few to keep the matrix unit's pipeline full, else one (registers).
const fn chains(token_groups: usize) -> usize {
    if token_groups < 4 { 2 } else { 1 }
}

/// Warps per cube of the staged kernel, and the row tiles of a cube: each warp decodes one
/// tile per step into shared memory, then multiplies all of them with its slice of the tokens.
pub(crate) const STAGED_WARPS: usize = 4;

/// Most token groups of 8 per warp of the staged kernel (16 accumulator registers per group).
const STAGED_MAX_WARP_GROUPS: usize = 4;

/// Fewest tokens per active expert, on average, for which the staged kernel runs instead of
/// the per-warp one (below it most of its warps would have no tokens).
pub const GROUPED_STAGED_MIN_MEAN_TOKENS: usize = 32;

/// Output rows per cube of the plain kernel.
const SIMT_UNITS: usize = 64;

/// Tokens per pass of the plain kernel.
const SIMT_TOKENS: usize = 4;

/// Where a decoder's routed experts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedMode {
    /// The routed GEMVs over work items ([`crate::ap_gemm_routed`]).
    Off,
    /// The grouped GEMM on the matrix units where the device has them and the experts get at
    /// least [`GROUPED_MIN_MEAN_TOKENS`] tokens on average, else the GEMVs.
    Auto,
    /// The grouped GEMM at any token count, on the plain kernel where the device has no matrix
    /// units (tests, benchmarks).
    Always,
}

/// Fewest tokens per active expert, on average, for which [`GroupedMode::Auto`] takes the
/// grouped GEMM: below it the routed GEMVs, which read an expert's weights once per one or two
/// tokens, beat its LUT lookups and matrix-unit passes (`benches/results/h200-decode-steps.md`).
pub const GROUPED_MIN_MEAN_TOKENS: usize = 4;

impl GroupedMode {
    /// Whether a step of `rows` gathered rows over `experts` experts takes the grouped GEMM on
    /// `client`'s device.
    pub fn grouped<R: Runtime>(self, client: &ComputeClient<R>, rows: usize, experts: usize) -> bool {
        match self {
            Self::Off => false,
            Self::Always => true,
            Self::Auto => {
                rows >= GROUPED_MIN_MEAN_TOKENS * experts.min(rows).max(1) && grouped_mma_supported(client)
            }
        }
    }
}

/// Expected tokens per active expert of a step of `rows` gathered rows over `experts`.
pub fn mean_tokens(rows: usize, experts: usize) -> usize {
    rows.div_ceil(experts.min(rows).max(1))
}

/// Which block of each expert a grouped launch reads from the slot words
/// ([`crate::expert_slot_words`]: gate_up in words 0..3, down in 3..6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertBlock {
    /// `[2I, H]`: gate rows, then up rows.
    GateUp,
    /// `[H, I]`.
    Down,
}

/// One grouped launch over a layer's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupedGemm {
    /// Experts of the layer (the groups table's entries).
    pub experts: usize,
    /// Rows N of each expert's block.
    pub rows: usize,
    /// Columns K (a multiple of 4).
    pub cols: usize,
    /// The block read.
    pub block: ExpertBlock,
    /// Row stride of `x` in elements (≥ `cols`, a multiple of 4).
    pub x_stride: usize,
    /// Row stride of `y` in elements.
    pub y_stride: usize,
    /// [`Activation::SiluMul`] or [`Activation::GeluTanhMul`]: `rows` are gate | up and output
    /// column `r < rows / 2` is `act(gate_r) · up_r`; [`Activation::None`]: output column `r`
    /// is row `r`.
    pub epilogue: Activation,
}

impl GroupedGemm {
    /// The two launches of an MoE layer of `experts` experts (width `hidden`, expert width
    /// `inter`, gated activation `act`) over compact rows: gate_up from `[rows, hidden]` with
    /// `act(gate) · up` into `[rows, inter]`, then down from those into `[rows, hidden]`.
    pub fn layer(experts: usize, hidden: usize, inter: usize, act: Activation) -> (Self, Self) {
        let gate_up = Self {
            experts,
            rows: 2 * inter,
            cols: hidden,
            block: ExpertBlock::GateUp,
            x_stride: hidden,
            y_stride: inter,
            epilogue: act,
        };
        let down = Self {
            rows: hidden,
            cols: inter,
            block: ExpertBlock::Down,
            x_stride: inter,
            y_stride: hidden,
            epilogue: Activation::None,
            ..gate_up
        };
        (gate_up, down)
    }

    /// Output columns of `y`.
    pub fn out_cols(&self) -> usize {
        if self.epilogue == Activation::None { self.rows } else { self.rows / 2 }
    }

    fn check(&self) -> Result<(), KernelError> {
        let gated = matches!(self.epilogue, Activation::SiluMul | Activation::GeluTanhMul);
        if !(gated || self.epilogue == Activation::None) {
            return Err(bad(format!("grouped gemm: epilogue {:?}", self.epilogue)));
        }
        if gated && (self.block != ExpertBlock::GateUp || !self.rows.is_multiple_of(16)) {
            return Err(bad(format!(
                "grouped gemm: a gated epilogue needs gate_up rows of 8k gates, {self:?}"
            )));
        }
        if self.cols == 0
            || !self.cols.is_multiple_of(4)
            || self.x_stride < self.cols
            || !self.x_stride.is_multiple_of(4)
        {
            return Err(bad(format!("grouped gemm: columns / x stride {self:?}")));
        }
        if self.y_stride < self.out_cols() || self.experts == 0 || self.rows == 0 {
            return Err(bad(format!("grouped gemm: y stride / shape {self:?}")));
        }
        Ok(())
    }
}

/// Whether `client`'s device runs [`grouped_mma_kernel`]: f16 `mma` of 16 × 8 × 16 with f32
/// accumulation and planes of 32 lanes (CUDA from sm_80; not lavapipe).
pub fn grouped_mma_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    use cubecl::ir::{ElemType, FloatKind, features::MmaConfig};
    let props = client.properties();
    let cfg = MmaConfig {
        a_type: ElemType::Float(FloatKind::F16).into(),
        b_type: ElemType::Float(FloatKind::F16).into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        n: 8,
        k: 16,
    };
    props.features.matmul.mma.contains(&cfg)
        && props.hardware.plane_size_min == 32
        && props.hardware.plane_size_max == 32
}

/// The kernel of a grouped launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupedKernel {
    /// The plain kernel (any device, `x` in f32).
    Plain,
    /// Matrix units; each warp decodes its own 16-row tile for its passes of up to
    /// `8 · GROUPED_MAX_TOKEN_GROUPS` tokens ([`grouped_mma_kernel`]).
    Mma,
    /// Matrix units; each tile decoded once per pass into shared memory and multiplied by all
    /// the cube's warps, each with its slice of the tokens ([`grouped_staged_kernel`]).
    Staged,
}

impl GroupedKernel {
    /// The kernel for experts of `mean_tokens` tokens on average on `client`'s device.
    pub fn choose<R: Runtime>(client: &ComputeClient<R>, mean_tokens: usize) -> Self {
        if !grouped_mma_supported(client) {
            Self::Plain
        } else if mean_tokens >= GROUPED_STAGED_MIN_MEAN_TOKENS {
            Self::Staged
        } else {
            Self::Mma
        }
    }

    /// Token groups of 8 per pass (per warp for [`Self::Staged`]) for experts of `mean_tokens`
    /// tokens on average; 0 for [`Self::Plain`]. A compile-time value: each one is a kernel of
    /// its own.
    pub fn token_groups(self, mean_tokens: usize) -> usize {
        let mean = mean_tokens.max(1);
        match self {
            Self::Plain => 0,
            Self::Mma => (2 * mean).div_ceil(8).clamp(1, GROUPED_MAX_TOKEN_GROUPS),
            Self::Staged => mean.div_ceil(8 * STAGED_WARPS).clamp(1, STAGED_MAX_WARP_GROUPS),
        }
    }
}

/// The grouped GEMM: for every expert `e` with `groups[2e + 1]` gathered rows from
/// `groups[2e]`, `y[row] = epilogue(x[row] · W_eᵀ)` with `W_e` the expert's block at the
/// bit-width in its slot words. `rows` bounds the gathered rows (`x`, `y`); `mean_tokens` (the
/// expected tokens per active expert) picks the kernel ([`GroupedKernel::choose`]) and sizes
/// its passes; `mma: false` takes the plain kernel. Does not synchronise.
///
/// # Shapes
/// - `slots`: `[experts, 6]` ([`crate::expert_slot_words`]); `groups`: `[experts, 2]`
/// - `x`: `[rows, x_stride]`; `y`: `[rows, y_stride]`
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_grouped<R: Runtime>(
    client: &ComputeClient<R>,
    g: GroupedGemm,
    mma: bool,
    planes: &DeviceArray,
    luts: &DeviceArray,
    slots: &DeviceArray,
    groups: &DeviceArray,
    rows: usize,
    mean_tokens: usize,
    x: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    let kernel = if mma { GroupedKernel::choose(client, mean_tokens) } else { GroupedKernel::Plain };
    ap_gemm_grouped_with(client, g, kernel, planes, luts, slots, groups, rows, mean_tokens, x, y)
}

/// [`ap_gemm_grouped`] on the given kernel (an error where the device has no matrix units for
/// it).
///
/// # Shapes
/// As [`ap_gemm_grouped`].
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_grouped_with<R: Runtime>(
    client: &ComputeClient<R>,
    g: GroupedGemm,
    kernel: GroupedKernel,
    planes: &DeviceArray,
    luts: &DeviceArray,
    slots: &DeviceArray,
    groups: &DeviceArray,
    rows: usize,
    mean_tokens: usize,
    x: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    g.check()?;
    need("grouped gemm slots", slots, 6 * g.experts)?;
    need("grouped gemm groups", groups, 2 * g.experts)?;
    need("grouped gemm x", x, rows * g.x_stride)?;
    need("grouped gemm y", y, rows * g.y_stride)?;
    if kernel != GroupedKernel::Plain && !grouped_mma_supported(client) {
        return Err(bad(format!("grouped gemm: {kernel:?} needs f16 mma on planes of 32")));
    }
    if rows == 0 {
        return Ok(());
    }
    let slot = match g.block {
        ExpertBlock::GateUp => 0,
        ExpertBlock::Down => 3,
    };
    let gate = g.epilogue.code();
    let tiles = if gate == 0 { g.rows.div_ceil(16) } else { g.rows / 16 };
    let passes = kernel.token_groups(mean_tokens);
    let (cubes, warps) = match kernel {
        GroupedKernel::Plain => (g.out_cols().div_ceil(SIMT_UNITS), 0),
        GroupedKernel::Mma => (tiles.div_ceil(MMA_WARPS), MMA_WARPS),
        GroupedKernel::Staged => (tiles.div_ceil(STAGED_WARPS), STAGED_WARPS),
    };
    let count = CubeCount::Static(cubes as u32, g.experts as u32, 1);
    if kernel == GroupedKernel::Plain {
        // SAFETY: the groups and slot words come from the routing over slots validated by
        // `expert_slot_words` against the layer's shapes (planes, LUTs inside the pool); the
        // groups' rows lie inside `rows`, checked against `x` and `y` above.
        unsafe {
            grouped_simt_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_1d(SIMT_UNITS as u32),
                planes.arg(),
                luts.arg(),
                slots.arg(),
                groups.arg(),
                x.arg(),
                y.arg(),
                g.rows,
                g.cols,
                g.x_stride,
                g.y_stride,
                slot,
                gate,
            )
        };
        return Ok(());
    }
    let xp = grouped_x_f16(client, rows, g.cols, g.x_stride, x)?;
    let dim = CubeDim::new_1d((warps * 32) as u32);
    // SAFETY: as above; `xp` holds `rows` rows of `grouped_x_row(cols)` halves, whole vectors
    // of 8.
    unsafe {
        let xa = ArrayArg::from_raw_parts(xp.handle.clone(), xp.len / 8);
        if kernel == GroupedKernel::Mma {
            grouped_mma_kernel::launch_unchecked::<R>(
                client,
                count,
                dim,
                planes.arg(),
                luts.arg(),
                slots.arg(),
                groups.arg(),
                xa,
                y.arg(),
                g.rows,
                g.cols,
                g.y_stride,
                slot,
                gate,
                passes,
            )
        } else {
            grouped_staged_kernel::launch_unchecked::<R>(
                client,
                count,
                dim,
                planes.arg(),
                luts.arg(),
                slots.arg(),
                groups.arg(),
                xa,
                y.arg(),
                g.rows,
                g.cols,
                g.y_stride,
                slot,
                gate,
                passes,
            )
        }
    };
    Ok(())
}

/// Weight `(r, c)` of a block of `n` rows and `k` columns at `bits` from its planes and LUT.
pub(crate) fn ap_weight(
    planes: &[u32],
    luts: &[f16],
    n: usize,
    k: usize,
    bits: usize,
    r: usize,
    c: usize,
) -> f32 {
    let words = k.div_ceil(32);
    let mut idx = 0usize;
    for p in 0..bits {
        idx = (idx << 1) | ((planes[(p * n + r) * words + c / 32] >> (c % 32)) & 1) as usize;
    }
    luts[r * (1 << bits) + idx].to_f32()
}

/// CPU reference of [`ap_gemm_grouped`] over host copies of the pool, slot words and groups;
/// `y` is updated in place (rows of no group are left as they are).
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_grouped_reference(
    g: GroupedGemm,
    planes: &[u32],
    luts: &[f16],
    slots: &[u32],
    groups: &[u32],
    x: &[f32],
    y: &mut [f32],
) {
    let slot = if g.block == ExpertBlock::GateUp { 0 } else { 3 };
    let (n, k) = (g.rows, g.cols);
    for e in 0..g.experts {
        let (first, count) = (groups[2 * e] as usize, groups[2 * e + 1] as usize);
        let s = &slots[6 * e + slot..][..3];
        let (p, l, bits) = (&planes[s[0] as usize..], &luts[s[1] as usize..], s[2] as usize);
        for row in first..first + count {
            let xr = &x[row * g.x_stride..][..k];
            let dot = |r: usize| -> f32 { (0..k).map(|c| xr[c] * ap_weight(p, l, n, k, bits, r, c)).sum() };
            for o in 0..g.out_cols() {
                y[row * g.y_stride + o] = match g.epilogue {
                    Activation::SiluMul => silu(dot(o)) * dot(n / 2 + o),
                    Activation::GeluTanhMul => gelu_tanh(dot(o)) * dot(n / 2 + o),
                    _ => dot(o),
                };
            }
        }
    }
}

/// `(a, b)` as one f16 fragment register.
#[cube]
fn pair(a: f16, b: f16) -> H2 {
    let mut v = H2::empty();
    v[0] = a;
    v[1] = b;
    v
}

/// Expert `e`'s gathered rows and its block's committed page: what both kernels read first.
#[derive(CubeType, Clone, Copy)]
struct ExpertGroup {
    first: usize,
    count: usize,
    plane_off: usize,
    lut_off: usize,
    bits: usize,
}

/// Expert `e`'s first row and row count from `groups`, and the plane offset, LUT offset and bits
/// of its block from the slot words (`slot`: 0 gate_up, 3 down).
#[cube]
fn expert_group(groups: &Array<u32>, slots: &Array<u32>, e: usize, #[comptime] slot: usize) -> ExpertGroup {
    let w = 6usize * e + slot;
    ExpertGroup {
        first: groups[2usize * e] as usize,
        count: groups[2usize * e + 1usize] as usize,
        plane_off: slots[w] as usize,
        lut_off: slots[w + 1usize] as usize,
        bits: slots[w + 2usize] as usize,
    }
}

/// `xp[t, 128s + 32(j / 2) + 8c + 4(j mod 2) + i] = f16(x[t, 32(4s + c) + j + 8i])` (`j < 8`,
/// `c < 4`, `i < 4`; zeros past `k`): the columns of step `s` (plane words `4s .. 4s + 4`) in
/// the order the MMA kernels' B fragments read them (MMA `j` of word `4s + c`: columns
/// `j, j + 8` then `j + 16, j + 24`), so that the lanes `c` of a token read one contiguous 64-byte
/// run per pair of MMAs. Rows of [`grouped_x_row`] halves; one unit per output element.
#[cube(launch_unchecked)]
pub fn grouped_x_kernel(
    x: &Array<f32>,
    xp: &mut Array<f16>,
    total: u32,
    #[comptime] k: usize,
    #[comptime] x_stride: usize,
) {
    let i = ABSOLUTE_POS;
    if i >= total as usize {
        terminate!();
    }
    let kp = comptime![grouped_x_row(k)];
    let t = i / kp;
    let p = i % kp;
    let r = p % 128usize;
    let c = (r % 32usize) / 8usize;
    let j = 2usize * (r / 32usize) + (r % 8usize) / 4usize;
    let col = 32usize * (4usize * (p / 128usize) + c) + j + 8usize * (r % 4usize);
    let mut v = f16::new(0.0);
    if col < k {
        v = f16::cast_from(x[t * x_stride + col]);
    }
    xp[i] = v;
}

/// Halves per row of [`grouped_x_kernel`]'s output for `k` columns: whole steps of four plane
/// words.
pub const fn grouped_x_row(k: usize) -> usize {
    128 * k.div_ceil(128)
}

/// [`grouped_x_kernel`] of `rows` rows of `k` columns of `x` (row stride `x_stride`) into a new
/// buffer: the B-fragment order the MMA kernel reads.
///
/// # Shapes
/// - `x`: `[rows, x_stride]`; returns `[rows, grouped_x_row(k)]` f16
pub fn grouped_x_f16<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    k: usize,
    x_stride: usize,
    x: &DeviceArray,
) -> Result<DeviceArray, KernelError> {
    if x_stride < k {
        return Err(bad(format!("grouped_x_f16: row stride {x_stride} below {k} columns")));
    }
    need("grouped_x_f16 x", x, rows * x_stride)?;
    let total = rows * grouped_x_row(k);
    let xp = DeviceArray::empty::<R, f16>(client, total);
    if total == 0 {
        return Ok(xp);
    }
    // SAFETY: `x` holds `rows` rows of `x_stride ≥ k` (checked above), `xp` `total` halves.
    unsafe {
        grouped_x_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(total.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            x.arg(),
            xp.arg(),
            total as u32,
            k,
            x_stride,
        )
    };
    Ok(xp)
}

/// CPU reference of [`grouped_x_kernel`] over `rows` rows.
pub fn grouped_x_reference(x: &[f32], rows: usize, k: usize, x_stride: usize) -> Vec<f16> {
    let kp = grouped_x_row(k);
    (0..rows * kp)
        .map(|i| {
            let (t, p) = (i / kp, i % kp);
            let r = p % 128;
            let (c, j) = ((r % 32) / 8, 2 * (r / 32) + (r % 8) / 4);
            let col = 32 * (4 * (p / 128) + c) + j + 8 * (r % 4);
            if col < k { f16::from_f32(x[t * x_stride + col]) } else { f16::ZERO }
        })
        .collect()
}

/// A 16-row MMA tile's rows: `lo` (MMA rows 0..8) and `hi` (rows 8..16) start here. Tile `t`
/// holds rows `16t .. 16t + 16`, or with a gated epilogue gate rows `8t .. 8t + 8` (lo) and the
/// matching up rows `n / 2 + 8t ..` (hi).
#[derive(CubeType, Clone, Copy)]
struct TileRows {
    lo: usize,
    hi: usize,
}

#[cube]
fn tile_rows(tile: usize, #[comptime] n: usize, #[comptime] gate: u32) -> TileRows {
    let mut lo = tile * 16usize;
    let mut hi = tile * 16usize + 8usize;
    if comptime![gate != 0] {
        lo = tile * 8usize;
        hi = comptime![n / 2] + tile * 8usize;
    }
    TileRows { lo, hi }
}

/// Loads the 16 LUT rows of the tile at `rows` into warp `warp`'s slots of `lut` and returns
/// where lane `lane` reads: its rows `lo + g`, `hi + g` (`g = lane / 4`; past the end the last
/// row, whose results are not stored) and word column `lane % 4`.
///
/// Up to [`LANE_LUT_MAX_BITS`] bits (from 3) every lane gets its own copy of its two rows, entry
/// `j` in the low half of 32-bit word `32j + lane` ([`lane_lut`]): all of a lookup's 32 lanes
/// read their own bank whatever the indices. Wider, the 16 rows are stored once, `2^bits` slots
/// apart. The caller synchronises the cube before the lookups.
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_view(
    luts: &Array<f16>,
    lut: &mut SharedMemory<f16>,
    eg: ExpertGroup,
    rows: TileRows,
    warp: usize,
    lane: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
) -> WordView {
    let words = comptime![k.div_ceil(32)];
    let entries = 1usize << eg.bits;
    let lbase = warp * comptime![16 * LUT_ROW];
    let g = lane / 4usize;
    let row_lo = min(rows.lo + g, n - 1usize);
    let row_hi = min(rows.hi + g, n - 1usize);
    let mut l_lo = lbase + g * entries;
    let mut l_hi = lbase + (g + 8usize) * entries;
    if lane_lut(eg.bits) {
        // Lane-private copies: row lo's entries, then row hi's, 64 halves per entry.
        l_lo = lbase + 2usize * lane;
        l_hi = l_lo + 64usize * entries;
        for j in 0..entries {
            lut[l_lo + 64usize * j] = luts[eg.lut_off + row_lo * entries + j];
            lut[l_hi + 64usize * j] = luts[eg.lut_off + row_hi * entries + j];
        }
    } else {
        // Row i < 8: lo row i, else hi row i − 8.
        for i in range_stepped(lane, 16usize * entries, 32usize) {
            let ri = i >> eg.bits;
            let j = i & (entries - 1usize);
            let mut r = rows.lo + ri;
            if ri >= 8usize {
                r = rows.hi + ri - 8usize;
            }
            lut[lbase + i] = luts[eg.lut_off + min(r, n - 1usize) * entries + j];
        }
    }
    WordView {
        p_lo: eg.plane_off + row_lo * words,
        p_hi: eg.plane_off + row_hi * words,
        l_lo,
        l_hi,
        c: lane % 4usize,
        bits: eg.bits,
    }
}

/// The widest bit-width whose LUTs the MMA kernels copy per lane ([`tile_view`]): two rows of
/// `2^bits` entries in 64 halves each fill a warp's `16 · LUT_ROW` slots at 5 bits.
const LANE_LUT_MAX_BITS: usize = 5;

/// Whether blocks of `bits` get lane-private LUTs: exactly the widths whose step loops are
/// unrolled for them, up to [`LANE_LUT_MAX_BITS`]. [`lane_lut`] asks the same of the committed
/// bits at run time; the decode asks it of the width a loop was unrolled for.
const fn lane_lut_width(bits: usize) -> bool {
    EXACT_MIN_BITS <= bits && bits <= LANE_LUT_MAX_BITS
}

/// [`lane_lut_width`] of a block's committed bits (read from its slot words at run time).
#[cube]
#[allow(clippy::manual_range_contains)]
fn lane_lut(bits: usize) -> bool {
    bits >= comptime![EXACT_MIN_BITS] && bits <= comptime![LANE_LUT_MAX_BITS]
}

/// Stores one token's results of MMA rows `g` (`lo`) and `g + 8` (`hi`) of the tile at `rows`
/// into the output row at `yb`: both rows, or `act(lo) · hi` with a gated epilogue; rows past
/// the end are not stored.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_pair(
    y: &mut Array<f32>,
    yb: usize,
    rows: TileRows,
    g: usize,
    lo: f32,
    hi: f32,
    #[comptime] n: usize,
    #[comptime] gate: u32,
) {
    if comptime![gate != 0] {
        if rows.lo + g < comptime![n / 2] {
            y[yb + rows.lo + g] = act_fn(lo, gate) * hi;
        }
    } else {
        if rows.lo + g < n {
            y[yb + rows.lo + g] = lo;
        }
        if rows.hi + g < n {
            y[yb + rows.hi + g] = hi;
        }
    }
}

/// The MMA kernel (see the module docs). Grid: `(ceil(tiles / MMA_WARPS), experts)` cubes of
/// `MMA_WARPS` warps; warp `w` of cube `(x, e)` takes tile `x · MMA_WARPS + w` of expert `e`:
/// rows `16t .. 16t + 16` (`gate = 0`), or gate rows `8t .. 8t + 8` and the matching up rows
/// (`gate` an [`Activation`] code), and runs the expert's tokens in passes of
/// `8 · token_groups`. `slot`: the block's first slot word (0 gate_up, 3 down). `x`: the rows
/// in f16, each word's columns in fragment order ([`grouped_x_kernel`]), as vectors of 8.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_mma_kernel(
    planes: &Array<u32>,
    luts: &Array<f16>,
    slots: &Array<u32>,
    groups: &Array<u32>,
    x: &Array<W8>,
    y: &mut Array<f32>,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] y_stride: usize,
    #[comptime] slot: usize,
    #[comptime] gate: u32,
    #[comptime] token_groups: usize,
) {
    let eg = expert_group(groups, slots, CUBE_POS_Y as usize, slot);
    if eg.count == 0usize {
        terminate!();
    }
    let (first, count, bits) = (eg.first, eg.count, eg.bits);
    let unit = UNIT_POS as usize;
    let lane = unit % 32usize;
    let warp = unit / 32usize;
    let g = lane / 4usize;
    let c = lane % 4usize;
    let tile = CUBE_POS_X as usize * comptime![MMA_WARPS] + warp;
    let rows = tile_rows(tile, n, gate);
    let mut lut = SharedMemory::<f16>::new(comptime![MMA_WARPS * 16 * LUT_ROW]);
    let wv = tile_view(luts, &mut lut, eg, rows, warp, lane, n, k);
    sync_cube();
    for p0 in range_stepped(0usize, count, comptime![8 * token_groups]) {
        // `chains(token_groups)` accumulator pairs per group (MMA jj of a word into pair
        // jj mod chains): with few groups, two dependency chains per group.
        let per_group = comptime![2 * chains(token_groups)];
        let mut acc = Array::<Acc>::new(comptime![per_group * token_groups]);
        #[unroll]
        for i in 0..comptime![per_group * token_groups] {
            acc[i] = Acc::empty().fill(0.0f32);
        }
        // This lane's token row of each group (`x` in W8 units, 4 per word; past the expert's
        // count it reads its last row and stores nothing).
        let mut x_row = Array::<usize>::new(token_groups);
        #[unroll]
        for q in 0..token_groups {
            let tok = min(p0 + 8usize * q + g, count - 1usize);
            x_row[q] = (first + tok) * comptime![grouped_x_row(k) / 8];
        }
        word_steps_of_width(planes, &lut, x, &x_row, &mut acc, wv, bits, n, k, token_groups, EXACT_MIN_BITS);
        // C fragment: Σ over chains h of acc[per_group·q + 2h][i] is (row lo, token
        // 8q + 2c + i), of acc[per_group·q + 2h + 1][i] (row hi, …).
        #[unroll]
        for q in 0..token_groups {
            #[unroll]
            for i in 0..2usize {
                let tok = p0 + 8usize * q + 2usize * c + i;
                if tok < count {
                    let yb = (first + tok) * y_stride;
                    let mut lo = 0.0f32;
                    let mut hi = 0.0f32;
                    #[unroll]
                    for h in 0..comptime![chains(token_groups)] {
                        lo += acc[comptime![per_group * q + 2 * h]][i];
                        hi += acc[comptime![per_group * q + 2 * h + 1]][i];
                    }
                    store_pair(y, yb, rows, g, lo, hi, n, gate);
                }
            }
        }
    }
}

/// Where a warp's rows and LUTs are: plane 0 of rows lo and hi, their LUTs in shared memory,
/// the lane's word within a step, the committed bits.
#[derive(CubeType, Clone, Copy)]
struct WordView {
    p_lo: usize,
    p_hi: usize,
    l_lo: usize,
    l_hi: usize,
    c: usize,
    bits: usize,
}

/// The widest bit-width whose step loop the grouped kernels unroll exactly (the hot and warm
/// floors the planner lowers to); wider blocks take the 8-plane loop with the unused planes
/// skipped.
const EXACT_MAX_BITS: usize = 6;

/// The narrowest bit-width whose step loop the grouped kernels unroll exactly (the format's
/// narrowest): where [`word_steps_of_width`] and [`staged_steps_of_width`] start.
const EXACT_MIN_BITS: usize = 3;

/// [`word_steps`] with the planes unrolled exactly for `bits`
/// ([`EXACT_MIN_BITS`]..=[`EXACT_MAX_BITS`]): one
/// uniform branch per width from `b` on, else the 8-plane loop.
#[cube]
#[allow(clippy::too_many_arguments)]
fn word_steps_of_width(
    planes: &Array<u32>,
    lut: &SharedMemory<f16>,
    x: &Array<W8>,
    x_row: &Array<usize>,
    acc: &mut Array<Acc>,
    wv: WordView,
    bits: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] token_groups: usize,
    #[comptime] b: usize,
) {
    if comptime![b <= EXACT_MAX_BITS] {
        if bits == comptime![b] {
            word_steps(planes, lut, x, x_row, acc, wv, n, k, token_groups, b, true);
        } else {
            word_steps_of_width(planes, lut, x, x_row, acc, wv, bits, n, k, token_groups, comptime![b + 1]);
        }
    } else {
        word_steps(planes, lut, x, x_row, acc, wv, n, k, token_groups, 8usize, false);
    }
}

/// [`staged_steps`] with the planes unrolled exactly for `bits`, as [`word_steps_of_width`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn staged_steps_of_width(
    planes: &Array<u32>,
    lut: &SharedMemory<f16>,
    stage: &mut SharedMemory<W8>,
    x: &Array<W8>,
    x_row: &Array<usize>,
    acc: &mut Array<Acc>,
    wv: WordView,
    sv: StageView,
    bits: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] warp_groups: usize,
    #[comptime] b: usize,
) {
    if comptime![b <= EXACT_MAX_BITS] {
        if bits == comptime![b] {
            staged_steps(planes, lut, stage, x, x_row, acc, wv, sv, n, k, warp_groups, b, true);
        } else {
            staged_steps_of_width(
                planes,
                lut,
                stage,
                x,
                x_row,
                acc,
                wv,
                sv,
                bits,
                n,
                k,
                warp_groups,
                comptime![b + 1],
            );
        }
    } else {
        staged_steps(planes, lut, stage, x, x_row, acc, wv, sv, n, k, warp_groups, 8usize, false);
    }
}

/// Whether plane `p` is read: always where the planes were unrolled to exactly the bits
/// (`exact`), else below `bits`.
#[cube]
fn plane_on(#[comptime] p: usize, bits: usize, #[comptime] exact: bool) -> bool {
    let mut on = true;
    if comptime![!exact] {
        on = p < bits;
    }
    on
}

/// One pass's steps of [`grouped_mma_kernel`] over the tile's words: `planes_n` planes
/// unrolled (the committed bits when `exact`, else the most, 8), the A fragments decoded once
/// per word and fed to the MMAs of every token group into `acc`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn word_steps(
    planes: &Array<u32>,
    lut: &SharedMemory<f16>,
    x: &Array<W8>,
    x_row: &Array<usize>,
    acc: &mut Array<Acc>,
    wv: WordView,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] token_groups: usize,
    #[comptime] planes_n: usize,
    #[comptime] exact: bool,
) {
    let words = comptime![k.div_ceil(32)];
    let pstride = comptime![n * k.div_ceil(32)];
    let steps = comptime![k.div_ceil(32).div_ceil(4)];
    let def = MmaDefinition::<f16, f16, f32>::new(16usize, 8usize, 16usize);
    // Plane words of the step, the next step's loaded before this one's decode.
    let mut pa = Array::<u32>::new(planes_n);
    let mut pb = Array::<u32>::new(planes_n);
    load_words(planes, &mut pa, &mut pb, wv, pstride, min(wv.c, words - 1usize), planes_n, exact);
    for s in 0..steps {
        let w = 4usize * s + wv.c;
        let mut na = Array::<u32>::new(planes_n);
        let mut nb = Array::<u32>::new(planes_n);
        load_words(planes, &mut na, &mut nb, wv, pstride, min(w + 4usize, words - 1usize), planes_n, exact);
        // The word in two halves (MMAs 0..4, then 4..8), so a half's indices, A fragments
        // and `x` are live at once rather than the whole word's (registers: occupancy).
        #[unroll]
        for half in 0..2usize {
            let mut af = Array::<H2>::new(16usize);
            decode_half(lut, &pa, &pb, wv, w, words, &mut af, half, planes_n, exact);
            #[unroll]
            for q in 0..token_groups {
                // MMA j = 4·half + jj reads the word's columns j, j + 8, j + 16, j + 24:
                // vector (s, 2·half + jj / 2, c) of the row from element 4·(jj mod 2)
                // ([`grouped_x_kernel`]).
                let mut xh = Array::<W8>::new(2usize);
                #[unroll]
                for h in 0..2usize {
                    xh[h] = x[x_row[q] + 16usize * s + comptime![4 * (2 * half + h)] + wv.c];
                }
                #[unroll]
                for jj in 0..4usize {
                    let mut a = Array::<H2>::new(4usize);
                    #[unroll]
                    for i in 0..4usize {
                        a[i] = af[4usize * jj + i];
                    }
                    let v = comptime![jj / 2];
                    let e = comptime![4 * (jj % 2)];
                    let mut b = Array::<H2>::new(2usize);
                    b[0] = pair(xh[v][e], xh[v][comptime![e + 1]]);
                    b[1] = pair(xh[v][comptime![e + 2]], xh[v][comptime![e + 3]]);
                    let ai = comptime![2 * chains(token_groups) * q + 2 * (jj % chains(token_groups))];
                    let mut cq = Array::<Acc>::new(2usize);
                    cq[0] = acc[ai];
                    cq[1] = acc[ai + 1usize];
                    def.execute_inplace(&a, &b, &mut cq);
                    acc[ai] = cq[0];
                    acc[ai + 1usize] = cq[1];
                }
            }
        }
        #[unroll]
        for p in 0..planes_n {
            pa[p] = na[p];
            pb[p] = nb[p];
        }
    }
}

/// The A fragments of MMAs `4·half .. 4·half + 4` of word `w` into `af`, from the lane's plane
/// words `pa` (row lo) and `pb` (row hi) and the tile's LUTs: `af[4jj]` row lo, columns
/// `j, j + 8` of MMA `j = 4·half + jj`; `af[4jj + 1]` row hi, the same; `af[4jj + 2]`,
/// `af[4jj + 3]` columns `j + 16, j + 24`. A word past the end (`w ≥ words`) gives zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn decode_half(
    lut: &SharedMemory<f16>,
    pa: &Array<u32>,
    pb: &Array<u32>,
    wv: WordView,
    w: usize,
    #[comptime] words: usize,
    af: &mut Array<H2>,
    #[comptime] half: usize,
    #[comptime] planes_n: usize,
    #[comptime] exact: bool,
) {
    // Indices of MMA 4·half + jj's columns (4·half + jj) + 8b in byte b of il[jj]
    // (row lo), ih[jj] (row hi).
    let mut il = Array::<u32>::new(4usize);
    let mut ih = Array::<u32>::new(4usize);
    #[unroll]
    for jj in 0..4usize {
        il[jj] = 0u32;
        ih[jj] = 0u32;
    }
    #[unroll]
    for p in 0..planes_n {
        if comptime![exact] {
            // Plane p's bit goes straight to bit d = planes_n − 1 − p of each byte: one shift
            // and one and-or per plane and MMA, where shifting the index first costs a third op.
            let d = comptime![planes_n - 1 - p];
            let m = comptime![0x0101_0101u32 << d];
            #[unroll]
            for jj in 0..4usize {
                let sh = comptime![4 * half + jj];
                if comptime![sh >= d] {
                    il[jj] |= (pa[p] >> comptime![(sh - d) as u32]) & m;
                    ih[jj] |= (pb[p] >> comptime![(sh - d) as u32]) & m;
                } else {
                    il[jj] |= (pa[p] << comptime![(d - sh) as u32]) & m;
                    ih[jj] |= (pb[p] << comptime![(d - sh) as u32]) & m;
                }
            }
        } else if plane_on(p, wv.bits, exact) {
            let a = pa[p];
            let b = pb[p];
            #[unroll]
            for jj in 0..4usize {
                let sh = comptime![(4 * half + jj) as u32];
                il[jj] = (il[jj] << 1u32) | ((a >> sh) & 0x0101_0101u32);
                ih[jj] = (ih[jj] << 1u32) | ((b >> sh) & 0x0101_0101u32);
            }
        }
    }
    // A fragments: [4jj] row lo, columns j, j + 8; [4jj + 1] row hi, the same;
    // [4jj + 2], [4jj + 3] columns j + 16, j + 24. A word past the end gives zeros.
    let zero = f16::new(0.0);
    #[unroll]
    for jj in 0..4usize {
        let lo = il[jj];
        let hi = ih[jj];
        let mut v = Array::<f16>::new(8usize);
        #[unroll]
        for b in 0..4usize {
            let sh = comptime![(8 * b) as u32];
            if comptime![exact && lane_lut_width(planes_n)] {
                // Lane-private LUTs ([`tile_view`]): entry j at 64j halves from the lane's base,
                // byte b moved straight to bits 6.. (one shift and one mask).
                let m = comptime![0xFFu32 << 6u32];
                if comptime![b == 0] {
                    v[b] = lut[wv.l_lo + ((lo << 6u32) & m) as usize];
                    v[4usize + b] = lut[wv.l_hi + ((hi << 6u32) & m) as usize];
                } else {
                    let r = comptime![(8 * b - 6) as u32];
                    v[b] = lut[wv.l_lo + ((lo >> r) & m) as usize];
                    v[4usize + b] = lut[wv.l_hi + ((hi >> r) & m) as usize];
                }
            } else {
                v[b] = lut[wv.l_lo + ((lo >> sh) & 0xFFu32) as usize];
                v[4usize + b] = lut[wv.l_hi + ((hi >> sh) & 0xFFu32) as usize];
            }
        }
        if w >= words {
            #[unroll]
            for b in 0..8usize {
                v[b] = zero;
            }
        }
        af[4usize * jj] = pair(v[0], v[1]);
        af[4usize * jj + 1usize] = pair(v[4], v[5]);
        af[4usize * jj + 2usize] = pair(v[2], v[3]);
        af[4usize * jj + 3usize] = pair(v[6], v[7]);
    }
}

/// The staged MMA kernel, for experts of many tokens. Grid: `(ceil(tiles / STAGED_WARPS),
/// experts)` cubes of [`STAGED_WARPS`] warps; cube `(x, e)` holds tiles `STAGED_WARPS · x ..` of
/// expert `e` (rows as in [`grouped_mma_kernel`]). Per step of four plane words, warp `w`
/// decodes tile `w`'s A fragments once into shared memory; then every warp multiplies all the
/// cube's tiles with its own `8 · warp_groups` tokens of the pass (`8 · warp_groups ·
/// STAGED_WARPS` tokens), so a weight is decoded once per pass rather than once per warp's
/// tokens. Arguments as in [`grouped_mma_kernel`].
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_staged_kernel(
    planes: &Array<u32>,
    luts: &Array<f16>,
    slots: &Array<u32>,
    groups: &Array<u32>,
    x: &Array<W8>,
    y: &mut Array<f32>,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] y_stride: usize,
    #[comptime] slot: usize,
    #[comptime] gate: u32,
    #[comptime] warp_groups: usize,
) {
    let eg = expert_group(groups, slots, CUBE_POS_Y as usize, slot);
    if eg.count == 0usize {
        terminate!();
    }
    let (first, count, bits) = (eg.first, eg.count, eg.bits);
    let unit = UNIT_POS as usize;
    let lane = unit % 32usize;
    let warp = unit / 32usize;
    let g = lane / 4usize;
    let c = lane % 4usize;
    let tile0 = CUBE_POS_X as usize * comptime![STAGED_WARPS];
    let mut lut = SharedMemory::<f16>::new(comptime![STAGED_WARPS * 16 * LUT_ROW]);
    let wv = tile_view(luts, &mut lut, eg, tile_rows(tile0 + warp, n, gate), warp, lane, n, k);
    sync_cube();
    // Two steps' A fragments of every tile: [buffer][tile][MMA j][lane], a lane's four
    // registers as one vector.
    let mut stage = SharedMemory::<W8>::new(comptime![2 * STAGED_WARPS * 8 * 32]);
    for p0 in range_stepped(0usize, count, comptime![8 * warp_groups * STAGED_WARPS]) {
        let t0 = p0 + warp * comptime![8 * warp_groups];
        // acc[2(rt · warp_groups + q)] (MMA rows lo) and the next (rows hi): tile rt, group q.
        let mut acc = Array::<Acc>::new(comptime![2 * STAGED_WARPS * warp_groups]);
        #[unroll]
        for i in 0..comptime![2 * STAGED_WARPS * warp_groups] {
            acc[i] = Acc::empty().fill(0.0f32);
        }
        let mut x_row = Array::<usize>::new(warp_groups);
        #[unroll]
        for q in 0..warp_groups {
            let tok = min(t0 + 8usize * q + g, count - 1usize);
            x_row[q] = (first + tok) * comptime![grouped_x_row(k) / 8];
        }
        let sv = StageView { warp, lane, active: t0 < count };
        staged_steps_of_width(
            planes,
            &lut,
            &mut stage,
            x,
            &x_row,
            &mut acc,
            wv,
            sv,
            bits,
            n,
            k,
            warp_groups,
            EXACT_MIN_BITS,
        );
        // The next pass's first step rewrites the buffer the last step read.
        sync_cube();
        #[unroll]
        for rt in 0..comptime![STAGED_WARPS] {
            let rows = tile_rows(tile0 + rt, n, gate);
            #[unroll]
            for q in 0..warp_groups {
                #[unroll]
                for i in 0..2usize {
                    let tok = t0 + 8usize * q + 2usize * c + i;
                    if tok < count {
                        let a = comptime![2 * (rt * warp_groups + q)];
                        let (lo, hi) = (acc[a][i], acc[comptime![a + 1]][i]);
                        store_pair(y, (first + tok) * y_stride, rows, g, lo, hi, n, gate);
                    }
                }
            }
        }
    }
}

/// A warp of [`grouped_staged_kernel`]: its index, the lane, and whether the pass has tokens for it.
#[derive(CubeType, Clone, Copy)]
struct StageView {
    warp: usize,
    lane: usize,
    active: bool,
}

/// One pass's steps of [`grouped_staged_kernel`]: per step, this warp's tile decoded into
/// `stage` (buffer `s mod 2`: one synchronisation per step keeps a buffer from being rewritten
/// while another warp reads it), then, if the warp has tokens, the MMAs of every tile with its
/// token groups into `acc`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn staged_steps(
    planes: &Array<u32>,
    lut: &SharedMemory<f16>,
    stage: &mut SharedMemory<W8>,
    x: &Array<W8>,
    x_row: &Array<usize>,
    acc: &mut Array<Acc>,
    wv: WordView,
    sv: StageView,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] warp_groups: usize,
    #[comptime] planes_n: usize,
    #[comptime] exact: bool,
) {
    let words = comptime![k.div_ceil(32)];
    let pstride = comptime![n * k.div_ceil(32)];
    let steps = comptime![k.div_ceil(32).div_ceil(4)];
    let def = MmaDefinition::<f16, f16, f32>::new(16usize, 8usize, 16usize);
    let mut pa = Array::<u32>::new(planes_n);
    let mut pb = Array::<u32>::new(planes_n);
    load_words(planes, &mut pa, &mut pb, wv, pstride, min(wv.c, words - 1usize), planes_n, exact);
    for s in 0..steps {
        let w = 4usize * s + wv.c;
        let mut na = Array::<u32>::new(planes_n);
        let mut nb = Array::<u32>::new(planes_n);
        load_words(planes, &mut na, &mut nb, wv, pstride, min(w + 4usize, words - 1usize), planes_n, exact);
        let buf = (s % 2usize) * comptime![STAGED_WARPS * 8 * 32];
        #[unroll]
        for half in 0..2usize {
            let mut af = Array::<H2>::new(16usize);
            decode_half(lut, &pa, &pb, wv, w, words, &mut af, half, planes_n, exact);
            #[unroll]
            for jj in 0..4usize {
                let mut v = W8::empty();
                #[unroll]
                for i in 0..4usize {
                    v[comptime![2 * i]] = af[4usize * jj + i][0];
                    v[comptime![2 * i + 1]] = af[4usize * jj + i][1];
                }
                stage[buf + (sv.warp * 8usize + comptime![4 * half + jj]) * 32usize + sv.lane] = v;
            }
        }
        sync_cube();
        if sv.active {
            #[unroll]
            for jp in 0..4usize {
                // MMAs 2jp and 2jp + 1 of the lane's word read vector (s, jp, c) of each token
                // row ([`grouped_x_kernel`]), from element 0 and 4.
                let mut xb = Array::<W8>::new(warp_groups);
                #[unroll]
                for q in 0..warp_groups {
                    xb[q] = x[x_row[q] + 16usize * s + comptime![4 * jp] + wv.c];
                }
                #[unroll]
                for jm in 0..2usize {
                    let e = comptime![4 * jm];
                    #[unroll]
                    for rt in 0..comptime![STAGED_WARPS] {
                        let v = stage[buf + comptime![(rt * 8 + 2 * jp + jm) * 32] + sv.lane];
                        let mut a = Array::<H2>::new(4usize);
                        #[unroll]
                        for i in 0..4usize {
                            a[i] = pair(v[comptime![2 * i]], v[comptime![2 * i + 1]]);
                        }
                        #[unroll]
                        for q in 0..warp_groups {
                            let mut b = Array::<H2>::new(2usize);
                            b[0] = pair(xb[q][e], xb[q][comptime![e + 1]]);
                            b[1] = pair(xb[q][comptime![e + 2]], xb[q][comptime![e + 3]]);
                            let ai = comptime![2 * (rt * warp_groups + q)];
                            let mut cq = Array::<Acc>::new(2usize);
                            cq[0] = acc[ai];
                            cq[1] = acc[ai + 1usize];
                            def.execute_inplace(&a, &b, &mut cq);
                            acc[ai] = cq[0];
                            acc[ai + 1usize] = cq[1];
                        }
                    }
                }
            }
        }
        #[unroll]
        for p in 0..planes_n {
            pa[p] = na[p];
            pb[p] = nb[p];
        }
    }
}

/// Word `wc` of the planes of the rows whose plane 0 starts at `wv.p_lo` and `wv.p_hi` into
/// `a[p]`, `b[p]` (unrolled over `planes_n` planes, so the words stay in registers).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_words(
    planes: &Array<u32>,
    a: &mut Array<u32>,
    b: &mut Array<u32>,
    wv: WordView,
    #[comptime] pstride: usize,
    wc: usize,
    #[comptime] planes_n: usize,
    #[comptime] exact: bool,
) {
    #[unroll]
    for p in 0..planes_n {
        if plane_on(p, wv.bits, exact) {
            a[p] = planes[wv.p_lo + p * pstride + wc];
            b[p] = planes[wv.p_hi + p * pstride + wc];
        }
    }
}

/// The plain kernel (any device): unit `u` of cube `(x, e)` computes output column
/// `x · SIMT_UNITS + u` of expert `e`'s rows, [`SIMT_TOKENS`] tokens per pass, with `x` in
/// f32 (see [`grouped_mma_kernel`] for the arguments).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_simt_kernel(
    planes: &Array<u32>,
    luts: &Array<f16>,
    slots: &Array<u32>,
    groups: &Array<u32>,
    x: &Array<f32>,
    y: &mut Array<f32>,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] x_stride: usize,
    #[comptime] y_stride: usize,
    #[comptime] slot: usize,
    #[comptime] gate: u32,
) {
    let eg = expert_group(groups, slots, CUBE_POS_Y as usize, slot);
    let o = CUBE_POS_X as usize * comptime![SIMT_UNITS] + UNIT_POS as usize;
    let half_n = comptime![n / 2];
    let out = comptime![if gate != 0 { n / 2 } else { n }];
    if eg.count == 0usize || o >= out {
        terminate!();
    }
    let (first, count, plane_off, lut_off, bits) = (eg.first, eg.count, eg.plane_off, eg.lut_off, eg.bits);
    let entries = 1usize << bits;
    let words = comptime![k.div_ceil(32)];
    let pstride = comptime![n * k.div_ceil(32)];
    // Row a (the output row, or the gate row) and row b (the up row).
    let ra = o;
    let rb = half_n + o;
    for p0 in range_stepped(0usize, count, comptime![SIMT_TOKENS]) {
        let mut acc_a = Array::<f32>::new(comptime![SIMT_TOKENS]);
        let mut acc_b = Array::<f32>::new(comptime![SIMT_TOKENS]);
        let mut xb = Array::<usize>::new(comptime![SIMT_TOKENS]);
        #[unroll]
        for t in 0..comptime![SIMT_TOKENS] {
            acc_a[t] = 0.0;
            acc_b[t] = 0.0;
            xb[t] = (first + min(p0 + t, count - 1usize)) * x_stride;
        }
        for w in 0..words {
            let left = k - 32usize * w;
            let end = min(left, 32usize);
            for cc in 0..end {
                let mut ia = 0usize;
                let mut ib = 0usize;
                for p in 0..bits {
                    let sh = cc as u32;
                    ia = (ia << 1usize)
                        | ((planes[plane_off + p * pstride + ra * words + w] >> sh) & 1u32) as usize;
                    if comptime![gate != 0] {
                        ib = (ib << 1usize)
                            | ((planes[plane_off + p * pstride + rb * words + w] >> sh) & 1u32) as usize;
                    }
                }
                let wa = f32::cast_from(luts[lut_off + ra * entries + ia]);
                let mut wb = 0.0f32;
                if comptime![gate != 0] {
                    wb = f32::cast_from(luts[lut_off + rb * entries + ib]);
                }
                #[unroll]
                for t in 0..comptime![SIMT_TOKENS] {
                    let xv = x[xb[t] + 32usize * w + cc];
                    acc_a[t] += wa * xv;
                    if comptime![gate != 0] {
                        acc_b[t] += wb * xv;
                    }
                }
            }
        }
        #[unroll]
        for t in 0..comptime![SIMT_TOKENS] {
            if p0 + t < count {
                let mut v = acc_a[t];
                if comptime![gate != 0] {
                    v = act_fn(acc_a[t], gate) * acc_b[t];
                }
                y[(first + p0 + t) * y_stride + o] = v;
            }
        }
    }
}
