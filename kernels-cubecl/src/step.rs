//! Host launchers and CPU references of the decode-step kernels in [`crate::decode`].
//!
//! The host knows each step's token count `T` (it built the batch) and sizes grids with it;
//! kernels read `T` from a one-word `meta` buffer so that one compiled variant per
//! `max_tokens` bucket serves every batch size.

use cubecl::prelude::*;
use half::f16;

use crate::{Activation, DeviceArray, KernelError, MAX_TOKENS, PoolSlot, decode, gemm, token_bucket};

pub(crate) fn bad(reason: String) -> KernelError {
    KernelError::BadItem { item: 0, reason }
}

pub(crate) fn need(what: &str, a: &DeviceArray, n: usize) -> Result<(), KernelError> {
    if a.len < n { Err(bad(format!("{what}: {} elements, needs {n}", a.len))) } else { Ok(()) }
}

pub(crate) fn cube_1d(width: usize) -> CubeDim {
    CubeDim::new_1d(width.clamp(1, 256) as u32)
}

/// Units of a cube that reduces rows of `width` with up to `per_unit` values per unit: a
/// multiple of the plane size, at least one plane, at most the device's cube size and 1024.
pub(crate) fn row_units<R: Runtime>(
    client: &ComputeClient<R>,
    width: usize,
    per_unit: usize,
) -> (usize, usize) {
    let hw = &client.properties().hardware;
    let plane = hw.plane_size_max as usize;
    let cap = (hw.max_units_per_cube as usize).clamp(plane, 1024) / plane * plane;
    (width.div_ceil(per_unit).next_multiple_of(plane).clamp(plane, cap), plane)
}

/// Embedding lookup: `h[t] = table[ids[t]] · params[0]`.
///
/// # Shapes
/// - `ids`: `[tokens]`; `table`: `[vocab, hidden]` f16; `h`: `[tokens, hidden]`
pub fn embed<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    hidden: usize,
    ids: &DeviceArray,
    table: &DeviceArray,
    params: &DeviceArray,
    h: &DeviceArray,
) -> Result<(), KernelError> {
    need("embed ids", ids, tokens)?;
    need("embed out", h, tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    // SAFETY: ids are checked against the vocabulary by the caller (the tokenizer's ids); the
    // output was checked above.
    unsafe {
        decode::embed_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            cube_1d(hidden),
            ids.arg(),
            table.arg(),
            params.arg(),
            h.arg(),
            hidden,
        )
    };
    Ok(())
}

/// CPU reference of [`embed`].
pub fn embed_reference(ids: &[u32], table: &[f16], hidden: usize, scale: f32) -> Vec<f32> {
    ids.iter()
        .flat_map(|&i| table[i as usize * hidden..][..hidden].iter().map(move |w| w.to_f32() * scale))
        .collect()
}

/// RMSNorm of each row: `x / sqrt(mean(x²) + eps) · (w + offset)` (offset 1 for `1 + w`
/// norms), on the CPU. The decode step has no norm launch of its own: the reference of the
/// norms folded into [`dense_gemm_normed`] and [`gather_rows_normed`].
pub fn rms_norm_reference(x: &[f32], w: &[f32], eps: f32, offset: f32) -> Vec<f32> {
    let hidden = w.len();
    x.chunks(hidden)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
            let inv = (ms + eps).sqrt();
            row.iter().zip(w).map(move |(v, g)| v / inv * (g + offset))
        })
        .collect()
}

/// Options of a dense skinny GEMM launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseGemm {
    /// Output features (rows of `W`).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Add `bias` (f32 `[n]`).
    pub bias: bool,
    /// `y += x·Wᵀ` (a residual add) instead of `y = x·Wᵀ`.
    pub accumulate: bool,
    /// Where it runs: the plain kernel or the matrix units ([`crate::mma::dense_mma_kernel`]).
    pub mma: MmaMode,
}

impl DenseGemm {
    /// `y = x·Wᵀ` of `n` rows and `k` columns, no bias, [`MmaMode::AUTO`].
    pub fn new(n: usize, k: usize) -> Self {
        Self { n, k, bias: false, accumulate: false, mma: MmaMode::AUTO }
    }
}

/// Where a dense GEMM runs. The matrix units need a device with TF32 `mma`
/// ([`dense_mma_supported`]), `k` a multiple of [`crate::mma::MMA_STEP_COLS`] and a plain or
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
}

impl MmaMode {
    /// [`MmaMode::Auto`] with the default launch shape.
    pub const AUTO: MmaMode = MmaMode::Auto(MmaTuning::DEFAULT);
}

/// Fewest tokens for which [`MmaMode::Auto`] uses the matrix units. At one token the plain
/// kernel streams faster (H200, bench-kernels at git `d60f6b1`: Mixtral's QKV 15.7 vs 18.5 µs,
/// Gemma-4's LM head 325 vs 565 µs); at two the matrix units win on most layers' matrices
/// (Gemma-4's QKV 22.0 vs 16.2) but not on Gemma-4's LM head (431 vs 566); from four on every
/// layer's matrix (Mixtral's QKV 25.4 vs 18.7 at 4 tokens, 44.7 vs 18.9 at 8).
pub const MMA_MIN_TOKENS: usize = 3;

/// Launch shape of [`crate::mma::dense_mma_kernel`].
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
}

impl Default for MmaTuning {
    /// Measured on the H200 (bench-kernels, git `6f7c4ea`, 8 tokens): 4 steps per round without
    /// pipelining, e.g. Mixtral's QKV 19.2 µs (25.4 pipelined), Gemma-4's 16.5 (23.6).
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl MmaTuning {
    /// See [`Default`].
    pub const DEFAULT: MmaTuning =
        MmaTuning { unroll: 4, pipeline: false, warps_per_sm: 16, accumulators: 1, x_ahead: true };
}

/// Whether `client`'s device runs [`crate::mma::dense_mma_kernel`]: TF32 `mma` of 16 × 8 × 8
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

/// An RMSNorm folded into the input of the kernel that consumes its output:
/// `x / sqrt(mean(x²) + params[0]) · (w + params[1])` per row of `x`, as
/// [`rms_norm_reference`] computes it (`params = [eps, offset]`, offset 1 for `1 + w` norms).
#[derive(Debug, Clone, Copy)]
pub struct RowNorm<'a> {
    /// f32 `[width]` norm weight.
    pub w: &'a DeviceArray,
    /// f32 `[eps, offset]`.
    pub params: &'a DeviceArray,
}

/// `y (+)= x · Wᵀ (+ bias)` with `W` f16 `[n, k]` row-major; `meta[0]` = tokens (≤ 16).
///
/// # Shapes
/// - `x`: `[tokens, k]`; `w`: `[n, k]`; `y`: `[tokens, n]`
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    dense_gemm_normed(client, g, tokens, meta, x, None, w, bias, y)
}

/// [`dense_gemm`] of `norm(x)` when `norm` is given: `y (+)= rms_norm(x) · Wᵀ (+ bias)` in one
/// launch (the norm is a per-token scale applied after each row's reduction, see
/// [`decode::dense_gemm_kernel`]), so a norm feeding a projection costs no launch.
///
/// # Shapes
/// - `x`: `[tokens, k]`; `norm.w`: `[k]`; `w`: `[n, k]`; `y`: `[tokens, n]`
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_normed<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    let input = match norm {
        Some(nm) => GemmInput::Norm(nm),
        None => GemmInput::Plain,
    };
    dense_gemm_launch(client, g, tokens, meta, x, input, w, bias, y)
}

/// Most tokens for which a dense MLP's down projection should apply the activation in its
/// loads ([`dense_gemm_act`]): each plane recomputes it for its rows, so the cost grows with
/// tokens × rows / 2; above this run [`crate::families::gated_act`] then [`dense_gemm`].
/// None: even at batch 1 the fused loads cost more than the activation's own launch (H200,
/// same process: Qwen1.5-MoE's step 3.21 → 2.96–3.00 ms, the shared-expert down 25 µs with
/// its 77 registers per thread; Gemma-4 5.01–5.09 → 4.96–4.99 ms); at batch 8 it took up to
/// 195 µs for Qwen's 23 MB (ncu, git `b4cf179`).
pub const FUSED_ACT_MAX_TOKENS: usize = 0;

/// How a dense MLP's down projection reads its gate|up rows (see [`dense_gemm_act`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedInput {
    /// The activation of the gate half (not [`Activation::None`]).
    pub act: Activation,
    /// Elements per gate|up row: `2·k`, or more (a multiple of 8 when `gated`).
    pub stride: usize,
    /// Scale each token by the sigmoid of its row's column `2·k` (Qwen's shared-expert gate).
    pub gated: bool,
}

impl GatedInput {
    /// Rejects an input without an activation or whose rows cannot hold gate and up halves of
    /// `width` (and the gate column when `gated`); `what` names the launcher.
    pub(crate) fn check(&self, what: &str, width: usize) -> Result<(), KernelError> {
        let gating = matches!(self.act, Activation::SiluMul | Activation::GeluTanhMul);
        if !gating || self.stride < 2 * width + self.gated as usize {
            return Err(bad(format!("{what}: {self:?} for width {width}")));
        }
        Ok(())
    }
}

/// Grid and cube of the per-row column kernels (a unit per column of `width`, a row of cubes
/// per token): [`moe_combine`], [`crate::families::gated_act`].
pub(crate) fn column_grid(tokens: usize, width: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(tokens as u32, width.div_ceil(COLUMN_UNITS) as u32, 1),
        CubeDim::new_1d(COLUMN_UNITS as u32),
    )
}

/// Units per cube of [`column_grid`].
const COLUMN_UNITS: usize = 256;

/// [`dense_gemm`] over `act(gate) · up` (· `sigmoid(x[t, 2k])` when `gated`) of the gate|up
/// rows `x`, the down projection of a dense MLP with its activation fused into the input
/// loads (as [`crate::Activation`] does in the expert kernels): no activation launch.
///
/// # Shapes
/// - `x`: `[tokens, a.stride]` (gate `[0, k)`, up `[k, 2k)`, gate column `2k`); `w`: `[n, k]`;
///   `y`: `[tokens, n]`
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_act<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    a: GatedInput,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    a.check("dense_gemm_act", g.k)?;
    dense_gemm_launch(client, g, tokens, meta, x, GemmInput::Act(a), w, bias, y)
}

/// What the dense GEMM does to `x` while loading it.
#[derive(Debug, Clone, Copy)]
enum GemmInput<'a> {
    Plain,
    Norm(RowNorm<'a>),
    Act(GatedInput),
}

#[allow(clippy::too_many_arguments)]
fn dense_gemm_launch<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    input: GemmInput<'_>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    if tokens > MAX_TOKENS {
        return Err(bad(format!("dense_gemm: {tokens} tokens, at most {MAX_TOKENS}")));
    }
    let x_stride = match input {
        GemmInput::Act(a) => a.stride,
        _ => g.k,
    };
    need("dense_gemm x", x, tokens * x_stride)?;
    need("dense_gemm w", w, g.n * g.k)?;
    need("dense_gemm y", y, tokens * g.n)?;
    if g.bias {
        need("dense_gemm bias", bias, g.n)?;
    }
    if let GemmInput::Norm(nm) = input {
        need("dense_gemm norm weight", nm.w, g.k)?;
        need("dense_gemm norm params", nm.params, 2)?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let tuning = match g.mma {
        MmaMode::Off => None,
        MmaMode::Auto(t) => (tokens >= MMA_MIN_TOKENS).then_some(t),
        MmaMode::Always(t) => Some(t),
    };
    if let Some(tuning) = tuning
        && !matches!(input, GemmInput::Act(_))
        && tokens <= crate::mma::MMA_MAX_TOKENS
        && g.k.is_multiple_of(crate::mma::MMA_STEP_COLS)
        && dense_mma_supported(client)
    {
        let norm = match input {
            GemmInput::Norm(nm) => Some(nm),
            _ => None,
        };
        dense_mma_launch(client, g, tuning, tokens, meta, x, norm, w, bias, y);
        return Ok(());
    }
    let plane = client.properties().hardware.plane_size_max as usize;
    let warps = 8;
    // The widest load the device likes that divides the row (16 bytes of halves on CUDA) and
    // the row stride of `x`.
    let vec = client
        .io_optimized_vector_sizes(2)
        .filter(|v| *v <= 8 && g.k.is_multiple_of(*v) && x_stride.is_multiple_of(*v))
        .max()
        .unwrap_or(1);
    let tb = token_bucket(tokens);
    // Two rows per plane share each `x` vector (and with a norm its weight vector and Σ x²)
    // once there are two tokens or a norm; a plain input at one token keeps one row per plane,
    // twice the cubes in flight. Measured on the H200 (bench-kernels, one row → two): Mixtral's
    // QKV with a norm 20.4 → 17.4 µs at one token, 32.6 → 18.8 at two, plain 15.6 → 16.7 at
    // one token; Gemma-4's LM head with a norm 431 → 361 µs.
    let normed = matches!(input, GemmInput::Norm(_));
    let rows = if tb > 2 { 2 } else { few_token_rows(if tb == 2 || normed { 2 } else { 1 }) };
    // Without a norm the kernel reads neither norm buffer: `x` and `meta` stand in for them.
    let (nw, np) = match input {
        GemmInput::Norm(nm) => (nm.w, nm.params),
        _ => (x, meta),
    };
    let (act, gated) = match input {
        GemmInput::Act(a) => (a.act.code(), a.gated),
        _ => (0, false),
    };
    // SAFETY: sizes checked above; the kernel reads `meta[0] ≤ tokens` rows of `x_stride`;
    // `w` holds `n · k` halves, i.e. `n · k / vec` vectors, and `x` at least
    // `tokens · x_stride / vec`, the norm weight (when read) `k / vec` (whole buffers, so their
    // starts are aligned for any vector width).
    unsafe {
        decode::dense_gemm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(g.n.div_ceil(warps * rows) as u32, 1, 1),
            CubeDim::new_1d((warps * plane) as u32),
            vec,
            ArrayArg::from_raw_parts(x.handle.clone(), x.len / vec),
            ArrayArg::from_raw_parts(w.handle.clone(), g.n * g.k / vec),
            bias.arg(),
            meta.arg(),
            ArrayArg::from_raw_parts(nw.handle.clone(), (nw.len / vec).max(1)),
            np.arg(),
            y.arg(),
            g.n,
            g.k,
            vec,
            tb,
            plane,
            warps,
            rows,
            g.bias,
            g.accumulate,
            matches!(input, GemmInput::Norm(_)),
            act,
            x_stride / vec,
            gated,
        )
    };
    Ok(())
}

/// Rows per plane of the plain dense kernel at one or two tokens: `default`, unless the
/// `PW_DENSE_ROWS` environment variable holds 1 or 2 (a benchmark knob, read once).
fn few_token_rows(default: usize) -> usize {
    static ROWS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    ROWS.get_or_init(|| {
        std::env::var("PW_DENSE_ROWS").ok().and_then(|v| v.parse().ok()).filter(|r| *r == 1 || *r == 2)
    })
    .unwrap_or(default)
}

/// Warps per cube of [`crate::mma::dense_mma_kernel`] (more when one row tile is split more
/// ways).
const MMA_WARPS: usize = 8;
/// Most column splits of one row tile.
const MMA_MAX_SPLITS: usize = 16;

/// Launches [`crate::mma::dense_mma_kernel`] (arguments checked by the caller: `k` a multiple
/// of 32, `tokens ≤ MMA_MAX_TOKENS`, the device supported).
#[allow(clippy::too_many_arguments)]
fn dense_mma_launch<R: Runtime>(
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
    let steps = g.k / crate::mma::MMA_STEP_COLS;
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    // The fewest column splits (a power of two up to 16, at most the steps) that give the grid
    // enough warps; a cube holds 8 warps (or one row tile's splits).
    let mut splits = 1;
    while splits < MMA_MAX_SPLITS && row_tiles * splits < t.warps_per_sm * sms && splits * 2 <= steps {
        splits *= 2;
    }
    let tiles = (MMA_WARPS / splits).max(1);
    let warps = tiles * splits;
    let groups = tokens.div_ceil(8);
    let (nw, np) = norm_args(norm, x, meta);
    // SAFETY: the caller checked `x` ≥ tokens · k, `w` = n · k, `y` ≥ tokens · n, the bias and
    // norm buffers; `k` is a multiple of 32, so every row starts 16-byte aligned and the
    // vector lengths below are whole.
    unsafe {
        crate::mma::dense_mma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(row_tiles.div_ceil(tiles) as u32, 1, 1),
            CubeDim::new_1d((warps * 32) as u32),
            ArrayArg::from_raw_parts(x.handle.clone(), x.len / 4),
            ArrayArg::from_raw_parts(w.handle.clone(), g.n * g.k / 8),
            bias.arg(),
            meta.arg(),
            ArrayArg::from_raw_parts(nw.handle.clone(), (nw.len / 4).max(1)),
            np.arg(),
            y.arg(),
            g.n,
            g.k,
            groups,
            tiles,
            splits,
            t.unroll.max(1),
            t.pipeline,
            t.accumulators.clamp(1, 2),
            t.x_ahead,
            g.bias,
            g.accumulate,
            norm.is_some(),
        )
    };
}

/// CPU reference of [`dense_gemm`]; updates `y` in place.
pub fn dense_gemm_reference(g: DenseGemm, x: &[f32], w: &[f16], bias: &[f32], y: &mut [f32]) {
    for (t, xr) in x.chunks(g.k).enumerate() {
        for r in 0..g.n {
            let mut s: f32 = w[r * g.k..][..g.k].iter().zip(xr).map(|(a, b)| a.to_f32() * b).sum();
            if g.bias {
                s += bias[r];
            }
            let o = &mut y[t * g.n + r];
            *o = if g.accumulate { *o + s } else { s };
        }
    }
}

/// CPU reference of [`dense_gemm_normed`]: [`rms_norm_reference`] of `x` with `norm_w`,
/// `[eps, offset]`, then [`dense_gemm_reference`]; updates `y` in place.
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_normed_reference(
    g: DenseGemm,
    x: &[f32],
    norm_w: &[f32],
    eps: f32,
    offset: f32,
    w: &[f16],
    bias: &[f32],
    y: &mut [f32],
) {
    dense_gemm_reference(g, &rms_norm_reference(x, norm_w, eps, offset), w, bias, y);
}

/// CPU reference of [`dense_gemm_act`]: [`crate::families::gated_act_reference`] of the
/// gate|up rows, then [`dense_gemm_reference`]; updates `y` in place.
pub fn dense_gemm_act_reference(
    g: DenseGemm,
    x: &[f32],
    a: GatedInput,
    w: &[f16],
    bias: &[f32],
    y: &mut [f32],
) {
    let xa = crate::families::gated_act_reference(x, g.k, a.stride, a.act, a.gated);
    dense_gemm_reference(g, &xa, w, bias, y);
}

/// Where the heads to rotate sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rope {
    /// Elements per row of the buffer.
    pub stride: usize,
    /// Heads to rotate, from the start of each row (query heads then key heads).
    pub heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Rotated dimensions per head (partial rotary); `inv_freq` has `rot_dim / 2` entries.
    pub rot_dim: usize,
}

/// CPU reference of rotate-half RoPE at positions `pos` (what
/// [`crate::rope_append`] applies to the query and key heads); rotates `qk` in place.
///
/// # Shapes
/// - `qk`: `[tokens, stride]`; `pos`: `[tokens]`; `inv_freq`: `[rot_dim / 2]`
pub fn rope_reference(r: Rope, qk: &mut [f32], pos: &[u32], inv_freq: &[f32]) {
    let half = r.rot_dim / 2;
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..r.heads {
            for (i, f) in inv_freq[..half].iter().enumerate() {
                let a = p as f32 * f;
                let b = t * r.stride + h * r.head_dim + i;
                let (x1, x2) = (qk[b], qk[b + half]);
                qk[b] = x1 * a.cos() - x2 * a.sin();
                qk[b + half] = x2 * a.cos() + x1 * a.sin();
            }
        }
    }
}

/// Geometry of one MoE layer for routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Routed experts (≤ 128).
    pub experts: usize,
    /// Experts per token.
    pub k: usize,
    /// Renormalise the top-k probabilities.
    pub renormalize: bool,
    /// Model width H.
    pub hidden: usize,
    /// Expert width I.
    pub inter: usize,
}

/// The committed pages of one layer's experts: per expert its gate_up (`[2I, H]`) and down
/// (`[H, I]`) slot in the weight pool. Flattened to the 6 words per expert the routing kernel
/// copies into descriptors.
pub fn expert_slot_words(shape: MoeShape, slots: &[(PoolSlot, PoolSlot)]) -> Result<Vec<u32>, KernelError> {
    if slots.len() != shape.experts {
        return Err(bad(format!("{} expert slots for {} experts", slots.len(), shape.experts)));
    }
    let mut out = Vec::with_capacity(6 * slots.len());
    for (e, (gu, dn)) in slots.iter().enumerate() {
        if (gu.rows, gu.cols) != (2 * shape.inter as u32, shape.hidden as u32)
            || (dn.rows, dn.cols) != (shape.hidden as u32, shape.inter as u32)
        {
            return Err(bad(format!("expert {e}: slot shapes {gu:?} / {dn:?} do not match {shape:?}")));
        }
        out.extend([gu.plane_off, gu.lut_off, gu.bits, dn.plane_off, dn.lut_off, dn.bits]);
    }
    Ok(out)
}

/// Tokens per routed work item: an expert's tokens are split into items of at most this many.
/// Two, so every routed launch fits the persistent GEMV ([`crate::GEMV_MAX_TOKENS`]): the host
/// cannot know how a batch spreads over the experts, and with items of up to 8 tokens every
/// batch above two ran the tiled kernel at its 8-token bucket (ncu on the H200, git `b4cf179`:
/// Mixtral's routed gate_up + down took 1327 µs per layer at batch 8, Qwen1.5-MoE's 278 µs,
/// while a decode batch gives each expert about two tokens). An expert with more tokens reads
/// its weights once per item.
pub const ROUTE_CHUNK: usize = 2;
/// Work items per expert (`MAX_TOKENS / ROUTE_CHUNK`); empty ones exit at once.
pub const ROUTE_CHUNKS: usize = MAX_TOKENS / ROUTE_CHUNK;
/// Route chunks [`RouteBuffers::with_chunk`] accepts: powers of two up to the persistent
/// GEMV's largest token bucket ([`crate::GEMV_MAX_TOKENS`]; where an item's `x` does not fit in
/// shared memory the routed launch takes the tiled kernel). Four halves the weight reads of an
/// expert with 3–4 tokens (batch 8 gives a Mixtral expert 2 on average, a third of them 3 or
/// more) at the cost of four multiplies per decoded weight for every item, and of registers:
/// CUDA 13.0 gives the GEMV 112–160 per thread at 4–8 tokens against 77–80 at one
/// (`benches/results/sass-gemv.md`, static), more than its grid's 24 warps per SM allow. Not yet
/// timed on the GPU, so [`ROUTE_CHUNK`] stays the default.
pub const ROUTE_CHUNK_CHOICES: [usize; 4] = [1, 2, 4, 8];

/// Routing statistics [`moe_route_counted`] accumulates: per expert `e` of the layer,
/// `counts[base + e] +=` its tokens and `mass[base + e] +=` their routing weights.
#[derive(Debug, Clone, Copy)]
pub struct RouteCounters<'a> {
    /// u32 counters, at least `base + experts`.
    pub counts: &'a DeviceArray,
    /// f32 sums, at least `base + experts`.
    pub mass: &'a DeviceArray,
    /// The layer's first entry (`layer · experts`).
    pub base: usize,
}

/// Output buffers of [`moe_route`].
#[derive(Debug, Clone)]
pub struct RouteBuffers {
    /// `[tokens, k]` routing weights.
    pub weights: DeviceArray,
    /// `[tokens · k]` source token of each gathered row.
    pub gather: DeviceArray,
    /// `[tokens, k]` gathered row of each choice.
    pub pos: DeviceArray,
    /// `[experts · chunks + 1, 8]` gate_up work items (`chunks = MAX_TOKENS / chunk`): the live
    /// ones first (expert order), then empty ones; word 0 of the last (header) slot counts the
    /// live ones.
    pub desc_gate_up: DeviceArray,
    /// `[experts · chunks + 1, 8]` down work items, laid out as `desc_gate_up`.
    pub desc_down: DeviceArray,
    /// Most tokens per work item (see [`RouteBuffers::with_chunk`]).
    chunk: usize,
    /// One-element stand-ins for the statistics' buffers when none are kept (never written).
    no_counts: DeviceArray,
    no_mass: DeviceArray,
}

impl RouteBuffers {
    /// Buffers for up to `MAX_TOKENS` tokens, in work items of [`ROUTE_CHUNK`] tokens.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, shape: MoeShape) -> Self {
        Self::with_chunk(client, shape, ROUTE_CHUNK).expect("ROUTE_CHUNK is a valid chunk")
    }

    /// Buffers whose routing cuts an expert's tokens into work items of at most `chunk` tokens
    /// (one of [`ROUTE_CHUNK_CHOICES`]); the routed GEMMs read each item's weights once.
    pub fn with_chunk<R: Runtime>(
        client: &ComputeClient<R>,
        shape: MoeShape,
        chunk: usize,
    ) -> Result<Self, KernelError> {
        check_route_chunk(chunk)?;
        let n = MAX_TOKENS * shape.k;
        // Both tables: `experts · chunks` items and the header slot.
        let table = (shape.experts * (MAX_TOKENS / chunk) + 1) * gemm::DESC_WORDS;
        Ok(Self {
            weights: DeviceArray::empty::<R, f32>(client, n),
            gather: DeviceArray::empty::<R, u32>(client, n),
            pos: DeviceArray::empty::<R, u32>(client, n),
            desc_gate_up: DeviceArray::empty::<R, u32>(client, table),
            desc_down: DeviceArray::empty::<R, u32>(client, table),
            chunk,
            no_counts: DeviceArray::empty::<R, u32>(client, 1),
            no_mass: DeviceArray::empty::<R, f32>(client, 1),
        })
    }

    /// Most tokens per work item: what [`ap_gemm_routed`] and [`ap_gemm_routed_gated`] take
    /// with these buffers' tables.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Work items per expert in the tables.
    pub fn chunks(&self) -> usize {
        MAX_TOKENS / self.chunk
    }

    /// The statistics counters a routing launch writes: the caller's, or these buffers' unused
    /// stand-ins (the kernel compiled without statistics never touches them), with the layer's
    /// first entry.
    fn counters<'a>(&'a self, stats: Option<RouteCounters<'a>>) -> (&'a DeviceArray, &'a DeviceArray, usize) {
        match stats {
            Some(st) => (st.counts, st.mass, st.base),
            None => (&self.no_counts, &self.no_mass, 0),
        }
    }
}

/// The norm buffers a launch binds: the norm's, or, without a norm (the kernel then reads
/// neither), `x` and `meta` standing in for them.
fn norm_args<'a>(
    norm: Option<RowNorm<'a>>,
    x: &'a DeviceArray,
    meta: &'a DeviceArray,
) -> (&'a DeviceArray, &'a DeviceArray) {
    match norm {
        Some(nm) => (nm.w, nm.params),
        None => (x, meta),
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
    if shape.experts > 128 || shape.k == 0 || shape.k > shape.experts {
        return Err(bad(format!("moe_route: unsupported {shape:?} (at most 128 experts, 1 ≤ k ≤ experts)")));
    }
    if tokens > MAX_TOKENS {
        return Err(bad(format!("moe_route: {tokens} tokens, at most {MAX_TOKENS}")));
    }
    need("moe_route logits", logits, tokens * shape.experts)?;
    need("moe_route slots", slots, shape.experts * 6)?;
    if let Some(st) = stats {
        need("moe_route counts", st.counts, st.base + shape.experts)?;
        need("moe_route mass", st.mass, st.base + shape.experts)?;
    }
    if tokens == 0 {
        return Ok(());
    }
    // A unit per expert and per token, whole planes (the top-k runs a plane per token).
    let (units, plane) = row_units(client, shape.experts.max(MAX_TOKENS), 1);
    let (counts, mass, base) = out.counters(stats);
    // SAFETY: sizes checked above; outputs were sized for MAX_TOKENS tokens by RouteBuffers.
    unsafe {
        decode::moe_route_kernel::launch_unchecked::<R>(
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
        )
    };
    Ok(())
}

/// Where each token's router logits sit: `logits[t · stride + offset ..][..experts]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogitsLayout {
    /// Elements per token row (`experts` for a buffer of logits only).
    pub stride: usize,
    /// The first logit in the row (after the other outputs of the GEMM that computed them).
    pub offset: usize,
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
    if layout.stride < layout.offset + shape.experts {
        return Err(bad(format!("moe_route_gather: {layout:?} for {} experts", shape.experts)));
    }
    need(
        "moe_route logits",
        logits,
        tokens.saturating_sub(1) * layout.stride + layout.offset + shape.experts,
    )?;
    let (units, plane) = check_route_gather(client, shape, tokens, slots, stats, x, norm, xg)?;
    if tokens == 0 {
        return Ok(());
    }
    let (counts, mass, base) = out.counters(stats);
    let (nw, np) = norm_args(norm, x, meta);
    // SAFETY: sizes checked above; outputs were sized for MAX_TOKENS tokens by RouteBuffers;
    // the gathered rows' tokens come from the routing, below `tokens`.
    unsafe {
        decode::route_gather_kernel::launch_unchecked::<R>(
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

/// The checks [`moe_route_gather`] and [`moe_route_gather_router`] share; returns the cube's
/// units and the plane size.
#[allow(clippy::too_many_arguments)]
fn check_route_gather<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    slots: &DeviceArray,
    stats: Option<RouteCounters<'_>>,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    xg: &DeviceArray,
) -> Result<(usize, usize), KernelError> {
    if shape.experts > 128 || shape.k == 0 || shape.k > shape.experts {
        return Err(bad(format!("moe_route: unsupported {shape:?} (at most 128 experts, 1 ≤ k ≤ experts)")));
    }
    if tokens > MAX_TOKENS {
        return Err(bad(format!("moe_route: {tokens} tokens, at most {MAX_TOKENS}")));
    }
    let width = shape.hidden;
    need("moe_route slots", slots, shape.experts * 6)?;
    need("gather x", x, tokens * width)?;
    need("gather out", xg, tokens * shape.k * width)?;
    if let Some(st) = stats {
        need("moe_route counts", st.counts, st.base + shape.experts)?;
        need("moe_route mass", st.mass, st.base + shape.experts)?;
    }
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

/// The largest router (`experts · hidden` weights) [`moe_route_gather_router`] folds into the
/// routing launch: every routing cube reads the whole router and recomputes every token's
/// logits, so the cost grows with it. Mixtral's 8 × 4096 (64 KiB of f16, L2-resident after
/// the first cube, ~2k FMAs per unit) fits; Qwen1.5-MoE's 60 × 2048 router sits in the shared
/// expert's GEMM anyway, and Gemma-4's 128 × 2816 (11× Mixtral's, with its own norm, read
/// again by its FFN epilogue) keeps its GEMM.
pub const FUSED_ROUTER_MAX_WEIGHTS: usize = 64 * 1024;
/// The most experts [`moe_route_gather_router`] takes: each unit keeps a partial sum per expert
/// in registers.
pub const FUSED_ROUTER_MAX_EXPERTS: usize = 32;

/// Shared memory [`moe_route_gather_router`] may take for its partial sums (lavapipe offers
/// 32 KiB, the H200 48 KiB without opting in).
const FUSED_ROUTER_MAX_SHARED: usize = 24 * 1024;

/// Whether [`moe_route_gather_router`] takes a router of this shape on this device (see
/// [`FUSED_ROUTER_MAX_WEIGHTS`]; its partial sums must also fit in shared memory).
pub fn router_fusable<R: Runtime>(client: &ComputeClient<R>, shape: MoeShape) -> bool {
    shape.experts <= FUSED_ROUTER_MAX_EXPERTS
        && shape.experts * shape.hidden <= FUSED_ROUTER_MAX_WEIGHTS
        && router_shared(client, shape) <= FUSED_ROUTER_MAX_SHARED
}

/// Bytes of shared memory of [`decode::route_gather_router_kernel`]'s partial sums and logits.
fn router_shared<R: Runtime>(client: &ComputeClient<R>, shape: MoeShape) -> usize {
    let (units, plane) = row_units(client, shape.hidden.max(16 * shape.experts.max(MAX_TOKENS)), 16);
    4 * MAX_TOKENS * ((units / plane) * (shape.experts + 1) + shape.experts)
}

/// CPU reference of the router logits [`moe_route_gather_router`] computes:
/// `norm(x) · routerᵀ` with `norm = (w, eps, offset)` as [`rms_norm_reference`].
///
/// # Shapes
/// - `x`: `[tokens, hidden]`; `router`: `[experts, hidden]`; returns `[tokens, experts]`
pub fn router_logits_reference(
    x: &[f32],
    router: &[f16],
    hidden: usize,
    norm: Option<(&[f32], f32, f32)>,
) -> Vec<f32> {
    let xn = match norm {
        Some((w, eps, off)) => rms_norm_reference(x, w, eps, off),
        None => x.to_vec(),
    };
    xn.chunks(hidden)
        .flat_map(|row| {
            router.chunks(hidden).map(move |r| row.iter().zip(r).map(|(a, b)| a * b.to_f32()).sum::<f32>())
        })
        .collect()
}

/// [`moe_route_gather`] with the router GEMM in the same launch (see
/// [`decode::route_gather_router_kernel`]): the logits `norm(x) · routerᵀ` are computed in each
/// routing cube (the norm is the gather's), and written to `logits` by one of them. For
/// routers that pass [`router_fusable`] only.
///
/// # Shapes
/// - `router`: f16 `[experts, hidden]`; `logits`: `[tokens, experts]`; `slots`: `[experts · 6]`;
///   `x`: `[tokens, hidden]`; `xg`: `[tokens · k, hidden]`
#[allow(clippy::too_many_arguments)]
pub fn moe_route_gather_router<R: Runtime>(
    client: &ComputeClient<R>,
    shape: MoeShape,
    tokens: usize,
    meta: &DeviceArray,
    (router, logits): (&DeviceArray, &DeviceArray),
    slots: &DeviceArray,
    out: &RouteBuffers,
    stats: Option<RouteCounters<'_>>,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    xg: &DeviceArray,
) -> Result<(), KernelError> {
    if !router_fusable(client, shape) {
        return Err(bad(format!(
            "moe_route_gather_router: a router of {} × {} is above {FUSED_ROUTER_MAX_EXPERTS} experts, \
             {FUSED_ROUTER_MAX_WEIGHTS} weights or {FUSED_ROUTER_MAX_SHARED} bytes of shared memory \
             (use its own GEMM and moe_route_gather)",
            shape.experts, shape.hidden
        )));
    }
    need("moe_route_gather_router router", router, shape.experts * shape.hidden)?;
    need("moe_route_gather_router logits", logits, tokens * shape.experts)?;
    let (units, plane) = check_route_gather(client, shape, tokens, slots, stats, x, norm, xg)?;
    if tokens == 0 {
        return Ok(());
    }
    let (counts, mass, base) = out.counters(stats);
    let (nw, np) = norm_args(norm, x, meta);
    // The widest load the device likes that divides the row (16 bytes of halves on CUDA).
    let vec = client
        .io_optimized_vector_sizes(2)
        .filter(|v| *v <= 8 && shape.hidden.is_multiple_of(*v))
        .max()
        .unwrap_or(1);
    // SAFETY: sizes checked above; outputs were sized for MAX_TOKENS tokens by RouteBuffers;
    // the gathered rows' tokens come from the routing, below `tokens`. The vector views cover
    // whole buffers (`x` holds `tokens` rows of `hidden`, a multiple of `vec`), so their starts
    // are aligned for any width.
    unsafe {
        decode::route_gather_router_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((tokens * shape.k) as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            vec,
            ArrayArg::from_raw_parts(router.handle.clone(), shape.experts * shape.hidden / vec),
            ArrayArg::from_raw_parts(x.handle.clone(), (x.len / vec).max(1)),
            ArrayArg::from_raw_parts(nw.handle.clone(), (nw.len / vec).max(1)),
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
            vec,
        )
    };
    Ok(())
}

/// CPU routing: per token the top-k experts (descending probability, lower index first on
/// ties) and their weights.
pub fn route_reference(shape: MoeShape, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let (mut sel, mut wts) = (vec![], vec![]);
    for row in logits.chunks(shape.experts) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
        let mut order: Vec<usize> = (0..shape.experts).collect();
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        let p: Vec<f32> = order[..shape.k].iter().map(|&e| (row[e] - m).exp() / z).collect();
        let s: f32 = p.iter().sum();
        for (j, &e) in order[..shape.k].iter().enumerate() {
            sel.push(e as u32);
            wts.push(if shape.renormalize { p[j] / s } else { p[j] });
        }
    }
    (sel, wts)
}

/// CPU reference of the statistics of [`moe_route_counted`] for one layer:
/// `counts[layer · E + e] +=` choices of `e`, `mass[layer · E + e] +=` their weights.
///
/// # Shapes
/// - `choices`, `weights`: `[tokens, k]` (expert index and routing weight of each choice)
/// - `counts`, `mass`: `[layers · experts]`
pub fn route_stats_reference(
    experts: usize,
    layer: usize,
    choices: &[usize],
    weights: &[f32],
    counts: &mut [u32],
    mass: &mut [f32],
) {
    for (&e, &w) in choices.iter().zip(weights) {
        counts[layer * experts + e] += 1;
        mass[layer * experts + e] += w;
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
        decode::gather_rows_kernel::launch_unchecked::<R>(
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

/// `h[t] += Σ_j weights[t, j] · y[pos[t, j]]`.
///
/// # Shapes
/// - `y`: `[tokens · k, hidden]`; `pos`, `weights`: `[tokens, k]`; `h`: `[tokens, hidden]`
#[allow(clippy::too_many_arguments)]
pub fn moe_combine<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    k: usize,
    hidden: usize,
    y: &DeviceArray,
    pos: &DeviceArray,
    weights: &DeviceArray,
    h: &DeviceArray,
) -> Result<(), KernelError> {
    need("combine y", y, tokens * k * hidden)?;
    need("combine h", h, tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above; positions come from `moe_route`, below `tokens · k`.
    let (count, dim) = column_grid(tokens, hidden);
    unsafe {
        decode::moe_combine_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            y.arg(),
            pos.arg(),
            weights.arg(),
            h.arg(),
            k,
            hidden,
        )
    };
    Ok(())
}

/// `chunk` is one of [`ROUTE_CHUNK_CHOICES`].
fn check_route_chunk(chunk: usize) -> Result<(), KernelError> {
    if ROUTE_CHUNK_CHOICES.contains(&chunk) {
        Ok(())
    } else {
        Err(bad(format!("route chunk {chunk}: expected one of {ROUTE_CHUNK_CHOICES:?}")))
    }
}

/// Work items of a routed launch over `experts` (`experts · MAX_TOKENS / chunk`), with the
/// launch configuration, the chunk and the descriptor table's length (with its header slot)
/// checked.
fn routed_items(
    cfg: crate::GemmConfig,
    desc: &DeviceArray,
    chunk: usize,
    experts: usize,
) -> Result<usize, KernelError> {
    check_route_chunk(chunk)?;
    let items = experts * (MAX_TOKENS / chunk);
    cfg.check()?;
    need("routed gemm descriptors", desc, (items + 1) * gemm::DESC_WORDS)?;
    Ok(items)
}

/// The grouped expert GEMM over a descriptor table built on the device by [`moe_route`]
/// into buffers of route chunk `chunk` ([`RouteBuffers::chunk`]; `experts · MAX_TOKENS /
/// chunk` items, each at most `min(tokens, chunk)` tokens and `max_rows` rows of `cols`
/// columns).
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_routed<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: crate::GemmConfig,
    planes: &DeviceArray,
    luts: &DeviceArray,
    desc: &DeviceArray,
    chunk: usize,
    experts: usize,
    max_rows: usize,
    cols: usize,
    tokens: usize,
    x: &DeviceArray,
    y: &DeviceArray,
    act: crate::Activation,
) -> Result<(), KernelError> {
    let items = routed_items(cfg, desc, chunk, experts)?;
    if tokens == 0 {
        return Ok(());
    }
    // Bit-widths live in device descriptors: room for the widest LUT.
    let bufs = [planes, luts, desc, x, y];
    let item_tokens = tokens.min(chunk);
    if crate::launch_gemv(client, cfg, bufs, items, true, cols, item_tokens, act, gemm::LUT_SLOTS, None) {
        return Ok(());
    }
    let tiles = max_rows.div_ceil(cfg.warps * cfg.rows_per_warp) as u32;
    // SAFETY: descriptors are written by `moe_route` from slot words validated by
    // `expert_slot_words` against the layer's shapes; `x`/`y` hold `tokens · k` rows.
    unsafe {
        gemm::ap_gemm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tiles, items as u32, 1),
            CubeDim::new_1d((cfg.warps * cfg.plane_size) as u32),
            planes.arg(),
            luts.arg(),
            desc.arg(),
            x.arg(),
            y.arg(),
            token_bucket(item_tokens),
            cfg.plane_size,
            cfg.warps,
            cfg.rows_per_warp,
            act.code(),
            // Bit-widths live in device descriptors: room for the widest LUT.
            gemm::LUT_SLOTS,
            cfg.unrolled,
            cfg.lut_mode(),
        )
    };
    Ok(())
}

/// Most tokens per routed item for which [`ap_gemm_routed_gated`] runs: at two, the gated GEMV
/// took up to 100 registers per thread against the plain one's 80 (ncu on the H200), so one
/// cube fewer fits per SM, and Qwen1.5-MoE's batch-8 step went from 7.27–7.31 to 7.79–7.95 ms;
/// at one token it saves the activation's launch (Gemma-4 b1 6.74 → 6.62 ms).
pub const GATED_MAX_TOKENS: usize = 1;

/// The routed experts' gate_up GEMV with their activation in its epilogue: each warp unit holds
/// gate rows and the matching up rows, and stores `act(gate) · up` into the gate half of the
/// item's gate|up-shaped output rows (row stride `max_rows` = 2·inter, what
/// [`crate::Activation::Applied`] reads), so no launch of its own applies it. `act` is
/// [`crate::Activation::SiluMul`] or [`crate::Activation::GeluTanhMul`]. Returns false, having
/// launched nothing, where the launch shape has no gated GEMV (more than [`GATED_MAX_TOKENS`]
/// tokens per item, shared memory, an odd `GemmConfig::gemv_rows`): then run
/// [`ap_gemm_routed`] and [`crate::families::gated_act`].
///
/// # Shapes
/// - as [`ap_gemm_routed`]; the up half of `y`'s rows is left unwritten.
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_routed_gated<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: crate::GemmConfig,
    planes: &DeviceArray,
    luts: &DeviceArray,
    desc: &DeviceArray,
    chunk: usize,
    experts: usize,
    max_rows: usize,
    cols: usize,
    tokens: usize,
    x: &DeviceArray,
    y: &DeviceArray,
    act: crate::Activation,
) -> Result<bool, KernelError> {
    let items = routed_items(cfg, desc, chunk, experts)?;
    if !matches!(act, crate::Activation::SiluMul | crate::Activation::GeluTanhMul) {
        return Err(bad(format!("ap_gemm_routed_gated: {act:?} is not a gated activation")));
    }
    if !max_rows.is_multiple_of(2) {
        return Err(bad(format!("ap_gemm_routed_gated: {max_rows} gate|up rows")));
    }
    if tokens == 0 {
        return Ok(true);
    }
    let item_tokens = tokens.min(chunk);
    if item_tokens > GATED_MAX_TOKENS {
        return Ok(false);
    }
    let bufs = [planes, luts, desc, x, y];
    let none = crate::Activation::None;
    Ok(crate::launch_gemv(
        client,
        cfg,
        bufs,
        items,
        true,
        cols,
        item_tokens,
        none,
        gemm::LUT_SLOTS,
        Some(act),
    ))
}
