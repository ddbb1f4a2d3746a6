//! The decode-step kernels that Qwen2-MoE and Gemma-4 need beyond the Mixtral set in
//! [`crate::step`]: per-head Q/K/V norms with
//! Gemma's K = V, a norm added into the residual (Gemma's sandwich norms), Gemma's whole
//! feed-forward epilogue in one launch, logit soft-capping, on-device greedy sampling and the
//! device-side random fills of synthetic models.
//!
//! Like the kernels of [`crate::decode`], each reads nothing from the host inside a step.

use cubecl::prelude::*;

use crate::attention::rope_store;
use crate::decode::{cube_sum, load_row, plane_top_k};
use crate::step::{bad, need, row_units};
use crate::{DeviceArray, KernelError, gemm};

/// `act(g)` for an [`gemm::Activation`] code (1: SiLU, 2: GELU with the tanh approximation, HF's
/// `gelu_pytorch_tanh`).
#[cube]
pub(crate) fn act_fn(g: f32, #[comptime] act: u32) -> f32 {
    if comptime![act == 1] {
        g / (1.0 + (-g).exp())
    } else {
        let inner = 0.797_884_6 * (g + 0.044715 * g * g * g);
        0.5 * g * (1.0 + inner.tanh())
    }
}

/// Per-head RMSNorm of a projection row into the fused Q|K|V layout the cache kernels read.
/// Head `u` of the output row (`[heads + 2·kv_heads, head_dim]`): query heads normed with
/// `w[0..hd]`, key heads with `w[hd..2hd]` (when `qk_norm`), value heads weightless (when
/// `v_norm`); with `k_eq_v` the value heads read the raw key heads (no `v_proj`).
/// `params = [eps]`. Grid `(tokens, heads + 2·kv_heads)`; cube: one plane.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn head_norm_kernel(
    src: &Array<f32>,
    w: &Array<f32>,
    params: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] src_stride: usize,
    #[comptime] qk_norm: bool,
    #[comptime] v_norm: bool,
    #[comptime] k_eq_v: bool,
) {
    let t = CUBE_POS_X as usize;
    let u = CUBE_POS_Y as usize;
    let out_stride = comptime![(heads + 2 * kv_heads) * head_dim];
    let is_v = u >= heads + kv_heads;
    // With K = V the value heads read the key heads `kv_heads` earlier in the row.
    let shift = comptime![if k_eq_v { kv_heads } else { 0 }];
    let su = u - select(is_v, shift, 0usize);
    let s0 = t * src_stride + su * head_dim;
    let o0 = t * out_stride + u * head_dim;
    let vf = comptime![v_norm as u32];
    let qf = comptime![qk_norm as u32];
    let norm = select(is_v, vf, qf);
    let weighted = select(is_v, 0u32, qf);
    let woff = select(u >= heads, head_dim, 0usize);
    let mut inv = 1.0f32;
    if norm == 1u32 {
        let mut ss = 0.0f32;
        for c in range_stepped(UNIT_POS as usize, head_dim, CUBE_DIM as usize) {
            let v = src[s0 + c];
            ss += v * v;
        }
        let total = plane_sum(ss);
        inv = 1.0 / (total / f32::cast_from(head_dim) + params[0]).sqrt();
    }
    for c in range_stepped(UNIT_POS as usize, head_dim, CUBE_DIM as usize) {
        let mut v = src[s0 + c] * inv;
        if weighted == 1u32 {
            v *= w[woff + c];
        }
        out[o0 + c] = v;
    }
}

/// `h[t] += x[t] / rms(x[t]) · w`; `params = [eps]`. Grid `(tokens)`; cube: `units` units,
/// each owning columns `u + i · units` (unrolled; see [`crate::decode::gather_rows_kernel`]).
#[cube(launch_unchecked)]
pub fn add_rms_norm_kernel(
    x: &Array<f32>,
    w: &Array<f32>,
    params: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let per = comptime![hidden.div_ceil(units)];
    let base = CUBE_POS_X as usize * hidden;
    let u = UNIT_POS as usize;
    let eps = params[0];
    let mut xv = Array::<f32>::new(per);
    let ss = load_row(x, base, &mut xv, hidden, units);
    // `h` and `w` before any store, in one block: loaded per column between the stores to `h`,
    // each column waited out a round trip (ncu on the H200: 7.9 µs for one Gemma-4 token).
    let mut hv = Array::<f32>::new(per);
    let mut wv = Array::<f32>::new(per);
    load_row(h, base, &mut hv, hidden, units);
    load_row(w, 0usize, &mut wv, hidden, units);
    let inv = 1.0 / (cube_sum(ss, units, plane_size) / f32::cast_from(hidden) + eps).sqrt();
    #[unroll]
    for i in 0..per {
        let c = u + i * units;
        if c < hidden {
            h[base + c] = hv[i] + xv[i] * inv * wv[i];
        }
    }
}

/// Gemma-4's feed-forward epilogue for token `t` (grid `(tokens)`, cube: `units` units, unit
/// `u` owning columns `u + i · units` in registers): routing recomputed from `logits[t]` by
/// each plane with the routing's own selection ([`crate::decode::plane_top_k`]: softmax, top-k
/// with lower expert first on ties), renormalised, times `per_expert_scale[e]`;
/// `y = Σ_j w_j · down[pos[t, j]]`; then `h = (h + norm(norm(m)·post1 + norm(y)·post2)·post) ·
/// scalar[0]`.
/// `norms = [post1 | post2 | post]` (`3·hidden`), `params = [eps]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn gemma_ffn_out_kernel(
    logits: &Array<f32>,
    pes: &Array<f32>,
    pos: &Array<u32>,
    down: &Array<f32>,
    m: &Array<f32>,
    norms: &Array<f32>,
    scalar: &Array<f32>,
    params: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let per = comptime![hidden.div_ceil(units)];
    let t = CUBE_POS_X as usize;
    let u = UNIT_POS as usize;
    let base = t * hidden;
    let lb = t * experts;
    let eps = params[0];
    // Every plane selects the token's experts itself, as the routing does (no barrier); before,
    // each unit scanned all 128 experts k times, in a one-cube kernel of 28 µs per Gemma layer
    // at batch 1 (ncu on the H200).
    let mut esel = Array::<u32>::new(k);
    let mut wsel = Array::<f32>::new(k);
    plane_top_k(&logits.to_slice(), lb, u % plane_size, &mut esel, &mut wsel, experts, k, plane_size);
    // Every load that does not depend on the reductions first, in one block: loads behind a
    // guard, a division's slow-path branch or a store to `h` were issued one round trip at a
    // time (ncu on the H200: 38 dependent round trips, 22 µs for one token of Gemma-4).
    let mut rows = Array::<u32>::new(k);
    let mut scale = Array::<f32>::new(k);
    let mut sum = 0.0f32;
    #[unroll]
    for j in 0..k {
        rows[j] = pos[t * k + j];
        scale[j] = pes[esel[j] as usize];
        sum += wsel[j];
    }
    let mut post1 = Array::<f32>::new(per);
    let mut post2 = Array::<f32>::new(per);
    let mut post = Array::<f32>::new(per);
    let mut hv = Array::<f32>::new(per);
    let mut mv = Array::<f32>::new(per);
    load_row(norms, 0usize, &mut post1, hidden, units);
    load_row(norms, hidden, &mut post2, hidden, units);
    load_row(norms, 2 * hidden, &mut post, hidden, units);
    load_row(h, base, &mut hv, hidden, units);
    let ss_m = load_row(m, base, &mut mv, hidden, units);
    let rsum = 1.0 / sum;
    #[unroll]
    for j in 0..k {
        wsel[j] = wsel[j] * rsum * scale[j];
    }
    // Pass 1: the experts' sum and its sum of squares (columns past `hidden` read the last one
    // and count zero).
    let mut yv = Array::<f32>::new(per);
    let mut ss_y = 0.0f32;
    #[unroll]
    for i in 0..per {
        let c = min(u + i * units, hidden - 1);
        let mut y = 0.0f32;
        #[unroll]
        for j in 0..k {
            y += wsel[j] * down[rows[j] as usize * hidden + c];
        }
        y = select(u + i * units < hidden, y, 0.0f32);
        yv[i] = y;
        ss_y += y * y;
    }
    let hf = f32::cast_from(hidden);
    let inv_y = 1.0 / (cube_sum(ss_y, units, plane_size) / hf + eps).sqrt();
    let inv_m = 1.0 / (cube_sum(ss_m, units, plane_size) / hf + eps).sqrt();
    let mut ss_x = 0.0f32;
    #[unroll]
    for i in 0..per {
        let x = mv[i] * inv_m * post1[i] + yv[i] * inv_y * post2[i];
        yv[i] = x;
        ss_x += x * x;
    }
    let inv_x = 1.0 / (cube_sum(ss_x, units, plane_size) / hf + eps).sqrt();
    let s = scalar[0];
    #[unroll]
    for i in 0..per {
        let c = u + i * units;
        if c < hidden {
            h[base + c] = (hv[i] + yv[i] * inv_x * post[i]) * s;
        }
    }
}

/// `x = tanh(x / c) · c`, `params = [c]`, over the first `meta[0]` rows of `width`.
/// Grid `(ceil(rows · width / 256))`.
#[cube(launch_unchecked)]
pub fn softcap_kernel(x: &mut Array<f32>, params: &Array<f32>, meta: &Array<u32>, #[comptime] width: usize) {
    let i = ABSOLUTE_POS;
    if i < meta[0] as usize * width {
        let c = params[0];
        x[i] = (x[i] / c).tanh() * c;
    }
}

/// Greedy sampling: `ids[t] = argmax(x[t])` (lowest index on ties). Grid `(tokens)`; cube:
/// `units` units, each visiting its columns in increasing order, 8 loads in flight per round
/// (a one-plane loop over a 32000-wide row took 344 µs on the H200).
#[cube(launch_unchecked)]
pub fn argmax_kernel(
    x: &Array<f32>,
    ids: &mut Array<u32>,
    #[comptime] width: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let t = CUBE_POS_X as usize;
    let u = UNIT_POS as usize;
    let base = t * width;
    let mut bv = f32::new(-3.0e38);
    let mut bi = 0u32;
    let mut vals = Array::<f32>::new(8usize);
    for c0 in range_stepped(0usize, width, comptime![8 * units]) {
        #[unroll]
        for i in 0..8usize {
            // Clamped loads (always in bounds), masked below.
            vals[i] = x[base + min(c0 + i * units + u, comptime![width - 1])];
        }
        #[unroll]
        for i in 0..8usize {
            let c = c0 + i * units + u;
            if c < width && vals[i] > bv {
                bv = vals[i];
                bi = c as u32;
            }
        }
    }
    let (m, best) = crate::gemm::warp_arg_max(bv, bi, plane_size);
    if comptime![units > plane_size] {
        let planes = comptime![units / plane_size];
        let mut shv = SharedMemory::<f32>::new(planes);
        let mut shi = SharedMemory::<u32>::new(planes);
        let lane = u % plane_size;
        if lane == 0 {
            shv[u / plane_size] = m;
            shi[u / plane_size] = best;
        }
        sync_cube();
        if u == 0 {
            let mut vb = shv[0];
            let mut ib = shi[0];
            for p in 1..planes {
                let v = shv[p];
                let i = shi[p];
                if v > vb || (v == vb && i < ib) {
                    vb = v;
                    ib = i;
                }
            }
            ids[t] = ib;
        }
    } else {
        if u == 0 {
            ids[t] = best;
        }
    }
}

/// `out[i] = (2·u(i) − 1) · scale` with `u(i)` a hash of `(i, seed)` in `[0, 1)`, in `F`;
/// `params = [scale]`. Grid-stride over `out`.
#[cube(launch_unchecked)]
pub fn fill_uniform_kernel<F: Float>(out: &mut Array<F>, params: &Array<f32>, seed: &Array<u32>) {
    let total = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let mut x = (i as u32) * 0x9E37_79B9u32 ^ seed[0] * 0x85EB_CA6Bu32;
        x ^= x >> 16u32;
        x *= 0x7FEB_352Du32;
        x ^= x >> 15u32;
        x *= 0x846C_A68Bu32;
        x ^= x >> 16u32;
        let u = f32::cast_from(x >> 8u32) / 16_777_216.0;
        out[i] = F::cast_from((u * 2.0 - 1.0) * params[0]);
        i += total;
    }
}

/// `out[t · out_stride + i] = act(x[t, i]) · x[t, inter + i] · s_t` over gate|up rows of
/// `stride` (`s_t` the sigmoid of `x[t, 2·inter]` when `gated`, else 1). Grid:
/// `step::column_grid`, a column per unit.
#[cube(launch_unchecked)]
pub fn gated_act_kernel(
    x: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] inter: usize,
    #[comptime] stride: usize,
    #[comptime] act: u32,
    #[comptime] gated: bool,
    #[comptime] out_stride: usize,
) {
    let t = CUBE_POS_X as usize;
    let c = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if c < inter {
        let row = t * stride;
        let mut v = act_fn(x[row + c], act) * x[row + inter + c];
        if comptime![gated] {
            v /= 1.0 + (-x[row + 2 * inter]).exp();
        }
        out[t * out_stride + c] = v;
    }
}

/// The activation of a dense MLP's gate|up rows as a launch of its own ([`gated_act_kernel`]),
/// for batches where [`crate::step::dense_gemm_act`] would recompute it too often (see
/// [`crate::step::FUSED_ACT_MAX_TOKENS`]); the shared expert's sigmoid gate is a per-token
/// scale, so it is applied here and the down projection reads plain rows. Rows of `out` are
/// `out_stride` apart (`inter` for packed rows; `2 · inter` leaves each in the gate half of a
/// gate|up-shaped row, what [`crate::Activation::Applied`] reads).
///
/// # Shapes
/// - `x`: `[tokens, a.stride]`; `out`: `[tokens, out_stride]` (the first `inter` of each row)
pub fn gated_act<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    inter: usize,
    a: crate::step::GatedInput,
    x: &DeviceArray,
    (out, out_stride): (&DeviceArray, usize),
) -> Result<(), KernelError> {
    a.check("gated_act", inter)?;
    if out_stride < inter {
        return Err(bad(format!("gated_act: output rows of {out_stride} for width {inter}")));
    }
    need("gated_act x", x, tokens * a.stride)?;
    need("gated_act out", out, tokens.saturating_sub(1) * out_stride + inter)?;
    if tokens == 0 || inter == 0 {
        return Ok(());
    }
    let (count, dim) = crate::step::column_grid(tokens, inter);
    // SAFETY: sizes checked above; the kernel bounds-checks its column.
    unsafe {
        gated_act_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            x.arg(),
            out.arg(),
            inter,
            a.stride,
            a.act.code(),
            a.gated,
            out_stride,
        )
    };
    Ok(())
}

/// `out[t, i] = act(x[t, i]) · x[t, inter + i]` (· `sigmoid(x[t, 2·inter])` when `gated`) of
/// rows of `stride`, on the CPU: the input [`crate::step::dense_gemm_act`] reads (the
/// reference of its fused activation).
pub fn gated_act_reference(
    x: &[f32],
    inter: usize,
    stride: usize,
    act: gemm::Activation,
    gated: bool,
) -> Vec<f32> {
    let f = |g: f32| if act == gemm::Activation::SiluMul { crate::silu(g) } else { crate::gelu_tanh(g) };
    x.chunks(stride)
        .flat_map(|row| {
            let s = if gated { 1.0 / (1.0 + (-row[2 * inter]).exp()) } else { 1.0 };
            (0..inter).map(move |i| f(row[i]) * row[inter + i] * s)
        })
        .collect()
}

/// Geometry of [`head_norm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadNorm {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Elements per row of the projection (`(heads + kv_heads) · hd` with K = V, else
    /// `(heads + 2·kv_heads) · hd`).
    pub src_stride: usize,
    /// Weighted norms on queries and keys (`w = [q_norm | k_norm]`).
    pub qk_norm: bool,
    /// Weightless norm on values.
    pub v_norm: bool,
    /// Values are the raw keys.
    pub k_eq_v: bool,
}

impl HeadNorm {
    /// Elements per output row.
    pub fn out_stride(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// Host side of [`head_norm_kernel`]; `params = [eps]`.
///
/// # Shapes
/// - `src`: `[tokens, src_stride]`; `w`: `[2 · head_dim]`; `out`: `[tokens, out_stride]`
pub fn head_norm<R: Runtime>(
    client: &ComputeClient<R>,
    g: HeadNorm,
    tokens: usize,
    src: &DeviceArray,
    w: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let src_heads = if g.k_eq_v { g.heads + g.kv_heads } else { g.heads + 2 * g.kv_heads };
    if g.src_stride < src_heads * g.head_dim {
        return Err(bad(format!("head_norm: bad geometry {g:?}")));
    }
    need("head_norm src", src, tokens * g.src_stride)?;
    need("head_norm out", out, tokens * g.out_stride())?;
    need("head_norm params", params, 1)?;
    if g.qk_norm {
        need("head_norm weights", w, 2 * g.head_dim)?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let plane = client.properties().hardware.plane_size_max;
    // SAFETY: sizes checked above.
    unsafe {
        head_norm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, (g.heads + 2 * g.kv_heads) as u32, 1),
            CubeDim::new_1d(plane),
            src.arg(),
            w.arg(),
            params.arg(),
            out.arg(),
            g.heads,
            g.kv_heads,
            g.head_dim,
            g.src_stride,
            g.qk_norm,
            g.v_norm,
            g.k_eq_v,
        )
    };
    Ok(())
}

/// CPU reference of [`head_norm`].
pub fn head_norm_reference(g: HeadNorm, src: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let hd = g.head_dim;
    let mut out = Vec::new();
    for row in src.chunks(g.src_stride) {
        for u in 0..g.heads + 2 * g.kv_heads {
            let is_v = u >= g.heads + g.kv_heads;
            let su = if is_v && g.k_eq_v { u - g.kv_heads } else { u };
            let x = &row[su * hd..][..hd];
            let norm = if is_v { g.v_norm } else { g.qk_norm };
            let inv = if norm {
                1.0 / (x.iter().map(|v| v * v).sum::<f32>() / hd as f32 + eps).sqrt()
            } else {
                1.0
            };
            let woff = if u >= g.heads { hd } else { 0 };
            out.extend(x.iter().enumerate().map(|(c, v)| {
                if !norm {
                    *v
                } else if is_v {
                    v * inv
                } else {
                    v * inv * w[woff + c]
                }
            }));
        }
    }
    out
}

/// Host side of [`add_rms_norm_kernel`]: `h += rms_norm(x) · w`, `params = [eps]`.
///
/// # Shapes
/// - `x`, `h`: `[tokens, hidden]`; `w`: `[hidden]`
pub fn add_rms_norm<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    hidden: usize,
    x: &DeviceArray,
    w: &DeviceArray,
    params: &DeviceArray,
    h: &DeviceArray,
) -> Result<(), KernelError> {
    need("add_rms_norm x", x, tokens * hidden)?;
    need("add_rms_norm h", h, tokens * hidden)?;
    need("add_rms_norm w", w, hidden)?;
    need("add_rms_norm params", params, 1)?;
    if tokens == 0 {
        return Ok(());
    }
    let (units, plane) = row_units(client, hidden, 16);
    if hidden > 32 * units {
        return Err(bad(format!("add_rms_norm: width {hidden} exceeds 32 values per unit of {units} units")));
    }
    // SAFETY: sizes checked above.
    unsafe {
        add_rms_norm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            x.arg(),
            w.arg(),
            params.arg(),
            h.arg(),
            hidden,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`add_rms_norm`]; updates `h` in place.
pub fn add_rms_norm_reference(x: &[f32], w: &[f32], eps: f32, h: &mut [f32]) {
    let n = crate::step::rms_norm_reference(x, w, eps, 0.0);
    for (a, b) in h.iter_mut().zip(n) {
        *a += b;
    }
}

/// The buffers [`gemma_ffn_out`] reads and writes.
#[derive(Debug, Clone, Copy)]
pub struct GemmaFfnOut<'a> {
    /// `[tokens, experts]` router logits.
    pub logits: &'a DeviceArray,
    /// `[experts]` per-expert output scale.
    pub per_expert_scale: &'a DeviceArray,
    /// `[tokens, k]` gathered row of each choice (from `moe_route`).
    pub pos: &'a DeviceArray,
    /// `[tokens · k, hidden]` expert outputs.
    pub down: &'a DeviceArray,
    /// `[tokens, hidden]` dense MLP output.
    pub mlp: &'a DeviceArray,
    /// `[3 · hidden]` = post_feedforward_layernorm_1 | _2 | post_feedforward_layernorm.
    pub norms: &'a DeviceArray,
    /// `[1]` layer scalar.
    pub scalar: &'a DeviceArray,
    /// `[eps]`.
    pub params: &'a DeviceArray,
    /// `[tokens, hidden]` residual stream, updated.
    pub h: &'a DeviceArray,
}

/// Host side of [`gemma_ffn_out_kernel`].
pub fn gemma_ffn_out<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    experts: usize,
    k: usize,
    hidden: usize,
    b: GemmaFfnOut<'_>,
) -> Result<(), KernelError> {
    if experts > 128 || k == 0 || k > experts {
        return Err(bad(format!("gemma_ffn_out: {experts} experts, top-{k}")));
    }
    need("gemma_ffn_out logits", b.logits, tokens * experts)?;
    need("gemma_ffn_out per_expert_scale", b.per_expert_scale, experts)?;
    need("gemma_ffn_out pos", b.pos, tokens * k)?;
    need("gemma_ffn_out down", b.down, tokens * k * hidden)?;
    need("gemma_ffn_out mlp", b.mlp, tokens * hidden)?;
    need("gemma_ffn_out norms", b.norms, 3 * hidden)?;
    need("gemma_ffn_out scalar", b.scalar, 1)?;
    need("gemma_ffn_out params", b.params, 1)?;
    need("gemma_ffn_out h", b.h, tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    let (units, plane) = row_units(client, hidden, 16);
    if hidden > 32 * units {
        return Err(bad(format!(
            "gemma_ffn_out: width {hidden} exceeds 32 values per unit of {units} units"
        )));
    }
    // SAFETY: sizes checked above; `pos` entries come from `moe_route`, below `tokens · k`.
    unsafe {
        gemma_ffn_out_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            b.logits.arg(),
            b.per_expert_scale.arg(),
            b.pos.arg(),
            b.down.arg(),
            b.mlp.arg(),
            b.norms.arg(),
            b.scalar.arg(),
            b.params.arg(),
            b.h.arg(),
            experts,
            k,
            hidden,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`gemma_ffn_out`] with the experts' outputs given per token and choice
/// (`down[t, j]` is the output of token `t`'s `j`-th choice); updates `h` in place.
#[allow(clippy::too_many_arguments)]
pub fn gemma_ffn_out_reference(
    logits: &[f32],
    experts: usize,
    k: usize,
    per_expert_scale: &[f32],
    down: &[f32],
    mlp: &[f32],
    norms: &[f32],
    scalar: f32,
    eps: f32,
    h: &mut [f32],
) {
    let hidden = norms.len() / 3;
    let shape = crate::step::MoeShape { experts, k, renormalize: true, hidden, inter: 1 };
    let (sel, wts) = crate::step::route_reference(shape, logits);
    let norm = |x: &[f32], w: &[f32]| crate::step::rms_norm_reference(x, w, eps, 0.0);
    for (t, hrow) in h.chunks_mut(hidden).enumerate() {
        let mut y = vec![0f32; hidden];
        for j in 0..k {
            let w = wts[t * k + j] * per_expert_scale[sel[t * k + j] as usize];
            for (c, yy) in y.iter_mut().enumerate() {
                *yy += w * down[(t * k + j) * hidden + c];
            }
        }
        let a = norm(&mlp[t * hidden..][..hidden], &norms[..hidden]);
        let b = norm(&y, &norms[hidden..2 * hidden]);
        let x: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
        let x = norm(&x, &norms[2 * hidden..]);
        for (hh, xx) in hrow.iter_mut().zip(x) {
            *hh = (*hh + xx) * scalar;
        }
    }
}

/// Host side of [`softcap_kernel`] over `tokens` rows of `width` (`meta[0]` = tokens);
/// `params = [c]`.
pub fn softcap<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    width: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    params: &DeviceArray,
) -> Result<(), KernelError> {
    let n = tokens * width;
    need("softcap x", x, n)?;
    need("softcap meta", meta, 1)?;
    need("softcap params", params, 1)?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above; the kernel bounds-checks `i < n`.
    unsafe {
        softcap_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            x.arg(),
            params.arg(),
            meta.arg(),
            width,
        )
    };
    Ok(())
}

/// CPU reference of [`softcap`].
pub fn softcap_reference(x: &[f32], c: f32) -> Vec<f32> {
    x.iter().map(|v| (v / c).tanh() * c).collect()
}

/// Host side of [`argmax_kernel`].
///
/// # Shapes
/// - `x`: `[tokens, width]`; `ids`: `[tokens]`
pub fn argmax<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    width: usize,
    x: &DeviceArray,
    ids: &DeviceArray,
) -> Result<(), KernelError> {
    need("argmax x", x, tokens * width)?;
    need("argmax ids", ids, tokens)?;
    if tokens == 0 {
        return Ok(());
    }
    if width == 0 {
        return Err(bad("argmax: rows of width 0".into()));
    }
    let (units, plane) = row_units(client, width, 32);
    // SAFETY: sizes checked above.
    unsafe {
        argmax_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            x.arg(),
            ids.arg(),
            width,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`argmax`] (lowest index on ties).
pub fn argmax_reference(x: &[f32], width: usize) -> Vec<u32> {
    x.chunks(width)
        .map(|r| {
            r.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
                as u32
        })
        .collect()
}

/// Fills `out` (`len` elements of `F`) with [`fill_uniform_kernel`]'s values in
/// `[-scale, scale)`. Does not synchronise.
pub fn fill_uniform<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    out: &DeviceArray,
    seed: u32,
    scale: f32,
) -> Result<(), KernelError> {
    if out.len >= u32::MAX as usize {
        return Err(bad(format!("fill_uniform: {} elements, at most 2^32 - 1", out.len)));
    }
    if out.len == 0 {
        return Ok(());
    }
    let params = DeviceArray::from_slice(client, &[scale]);
    let seed = DeviceArray::from_slice(client, &[seed]);
    let cubes = out.len.div_ceil(256).min(4096);
    // SAFETY: the kernel writes only indices below `out.len`.
    unsafe {
        fill_uniform_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(256),
            out.arg(),
            params.arg(),
            seed.arg(),
        )
    };
    Ok(())
}

/// CPU reference of [`fill_uniform`] (before rounding to `F`).
pub fn fill_uniform_reference(len: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| {
            let mut x = i.wrapping_mul(0x9E37_79B9) ^ seed.wrapping_mul(0x85EB_CA6B);
            x ^= x >> 16;
            x = x.wrapping_mul(0x7FEB_352D);
            x ^= x >> 15;
            x = x.wrapping_mul(0x846C_A68B);
            x ^= x >> 16;
            let u = (x >> 8) as f32 / 16_777_216.0;
            (u * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Gemma-4's per-head norms, RoPE and the K/V append in one launch (grid `(tokens, source
/// heads)`, cube `units` units): [`head_norm_kernel`] with
/// `qk_norm` and `v_norm` (weighted Q/K norms, weightless V norm, V = the raw K heads with
/// `k_eq_v`) feeding [`crate::rope_append`]'s rotation, reading the projection row `src[t]`
/// directly. Cube `(t, sh)` reduces source head `sh` (its columns loaded together) into its
/// inverse RMS; a query head, normed and rotated, goes to `q[t]` (the first `heads · hd` of a
/// row of `q_stride`, where attention reads them), a key head normed and rotated into K pool
/// slot `slots[t]` (dimensions past `rot_dim` unrotated), a value head (with `k_eq_v` the key
/// head itself) normed into the V pool. Why one launch: the separate norm was one more launch
/// per layer; why a cube per head: one cube per token walked every head in loops whose loads
/// waited behind the previous iteration's stores (ncu on the H200: 8.4 µs per Gemma-4 layer).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn head_norm_rope_append_kernel<KV: Float>(
    src: &Array<f32>,
    w: &Array<f32>,
    params: &Array<f32>,
    pos: &Array<u32>,
    inv_freq: &Array<f32>,
    slots: &Array<u32>,
    q: &mut Array<f32>,
    k_pool: &mut Array<KV>,
    v_pool: &mut Array<KV>,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] rot_dim: usize,
    #[comptime] src_stride: usize,
    #[comptime] q_stride: usize,
    #[comptime] k_eq_v: bool,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let t = CUBE_POS_X as usize;
    let sh = CUBE_POS_Y as usize;
    let u = UNIT_POS as usize;
    let base = t * src_stride + sh * head_dim;
    let eps = params[0];
    let p = f32::cast_from(pos[t]);
    let kv_width = comptime![kv_heads * head_dim];
    let dst = slots[t] as usize * kv_width;
    let mut xv = Array::<f32>::new(comptime![head_dim.div_ceil(units)]);
    let ss = load_row(src, base, &mut xv, head_dim, units);
    let inv = 1.0 / (cube_sum(ss, units, plane_size) / f32::cast_from(head_dim) + eps).sqrt();
    let half = comptime![rot_dim / 2];
    if sh < comptime![heads + kv_heads] {
        let woff = select(sh >= heads, head_dim, 0usize);
        for i in range_stepped(u, half, units) {
            let x1 = src[base + i] * inv * w[woff + i];
            let x2 = src[base + i + half] * inv * w[woff + i + half];
            let qo = t * q_stride + sh * head_dim + i;
            rope_store(x1, x2, p * inv_freq[i], sh, i, q, qo, k_pool, dst, heads, head_dim, half);
        }
        for i in range_stepped(u + rot_dim, head_dim, units) {
            let v = src[base + i] * inv * w[woff + i];
            if sh < heads {
                q[t * q_stride + sh * head_dim + i] = v;
            } else {
                k_pool[dst + (sh - heads) * head_dim + i] = KV::cast_from(v);
            }
        }
    }
    // Value heads: the raw K heads with K = V, else their own; weightless norm.
    let v0 = comptime![if k_eq_v { heads } else { heads + kv_heads }];
    if sh >= v0 {
        #[unroll]
        for i in 0..comptime![head_dim.div_ceil(units)] {
            let c = u + i * units;
            if c < head_dim {
                v_pool[dst + (sh - v0) * head_dim + c] = KV::cast_from(xv[i] * inv);
            }
        }
    }
}

/// Host side of [`head_norm_rope_append_kernel`] (Q/K/V norms as Gemma-4 has them: `g.qk_norm`
/// and `g.v_norm` both set); `w = [q_norm | k_norm]`, `params = [eps]`.
///
/// # Shapes
/// - `src`: `[tokens, g.src_stride]`; `w`: `[2 · head_dim]`; `pos`, `slots`: `[tokens]`;
///   `inv_freq`: `[rot_dim / 2]`; `q`: `[tokens, q_stride]`; pools: `[slots, kv_heads · head_dim]`
#[allow(clippy::too_many_arguments)]
pub fn head_norm_rope_append<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    g: HeadNorm,
    tokens: usize,
    rot_dim: usize,
    src: &DeviceArray,
    w: &DeviceArray,
    params: &DeviceArray,
    pos: &DeviceArray,
    inv_freq: &DeviceArray,
    slots: &DeviceArray,
    (q, q_stride): (&DeviceArray, usize),
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let hd = g.head_dim;
    let src_heads = if g.k_eq_v { g.heads + g.kv_heads } else { g.heads + 2 * g.kv_heads };
    if !g.qk_norm || !g.v_norm || g.src_stride < src_heads * hd || q_stride < g.heads * hd {
        return Err(bad(format!("head_norm_rope_append: unsupported {g:?} (q stride {q_stride})")));
    }
    if rot_dim == 0 || rot_dim > hd || !rot_dim.is_multiple_of(2) {
        return Err(bad(format!("head_norm_rope_append: rot_dim {rot_dim} for head_dim {hd}")));
    }
    need("head_norm_rope_append src", src, tokens * g.src_stride)?;
    need("head_norm_rope_append weights", w, 2 * hd)?;
    need("head_norm_rope_append params", params, 1)?;
    need("head_norm_rope_append pos", pos, tokens)?;
    need("head_norm_rope_append slots", slots, tokens)?;
    need("head_norm_rope_append inv_freq", inv_freq, rot_dim / 2)?;
    need("head_norm_rope_append q", q, tokens * q_stride)?;
    if k_pool.len != v_pool.len {
        return Err(bad("head_norm_rope_append: K and V pools differ".into()));
    }
    if tokens == 0 {
        return Ok(());
    }
    // A cube per source head, two columns per unit (up to 256 units).
    let (units, plane) = row_units(client, hd, 2);
    let units = units.min(256usize.max(plane));
    // SAFETY: sizes checked above; slot values are the cache allocator's (inside the pools).
    unsafe {
        head_norm_rope_append_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static(tokens as u32, src_heads as u32, 1),
            CubeDim::new_1d(units as u32),
            src.arg(),
            w.arg(),
            params.arg(),
            pos.arg(),
            inv_freq.arg(),
            slots.arg(),
            q.arg(),
            k_pool.arg(),
            v_pool.arg(),
            g.heads,
            g.kv_heads,
            hd,
            rot_dim,
            g.src_stride,
            q_stride,
            g.k_eq_v,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`head_norm_rope_append`]: [`head_norm_reference`] then
/// [`crate::step::rope_reference`] on the query and key heads; returns each token's
/// `(queries [heads · hd], keys [kv_heads · hd], values [kv_heads · hd])` rows, flattened.
#[allow(clippy::too_many_arguments)]
pub fn head_norm_rope_append_reference(
    g: HeadNorm,
    src: &[f32],
    w: &[f32],
    eps: f32,
    pos: &[u32],
    inv_freq: &[f32],
    rot_dim: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rows = head_norm_reference(g, src, w, eps);
    let stride = g.out_stride();
    let r = crate::step::Rope { stride, heads: g.heads + g.kv_heads, head_dim: g.head_dim, rot_dim };
    crate::step::rope_reference(r, &mut rows, pos, inv_freq);
    let (nq, nk) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
    let part = |off: usize, n: usize| -> Vec<f32> {
        rows.chunks(stride).flat_map(|r| r[off..][..n].to_vec()).collect()
    };
    (part(0, nq), part(nq, nk), part(nq + nk, nk))
}
