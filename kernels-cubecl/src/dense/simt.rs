//! The dense skinny GEMM on the SIMT cores (any device).

use cubecl::prelude::*;
use half::f16;

use super::{DenseGemm, GemmInput};
use crate::DeviceArray;
use crate::plane::warp_sum;
use crate::pool::{MAX_TOKENS, token_bucket};

/// `y[t, r] (+)= Σ_c x[t, c] · W[r, c] (+ bias[r])` for `t < meta[0]`, `W` f16 row-major
/// `[n, k]` as PyTorch stores it, read as vectors of `vec` halves (16-byte loads on CUDA).
/// Grid `(ceil(n / (warps · rows)) · ttiles)`, cube `warps` planes: cube `i` takes the row
/// block `i / ttiles` for tokens `(i mod ttiles) · max_tokens ..` (the token tiles of a row
/// block run side by side, so its weights are read from DRAM once and then from L2); a plane
/// owns `rows` rows, its lanes stride the rows' vectors (coalesced), one `plane_sum` per row
/// and token.
///
/// `x` is read as vectors of the same width as `W`'s (two 16-byte loads on CUDA): read one
/// f32 at a time, a warp's loads of a column were 32 bytes apart, eight L1 wavefronts per
/// instruction. With several tokens each plane takes two rows so each `x` vector serves both.
///
/// With `norm`, `x` goes through an RMSNorm first (`norm_p = [eps, offset]`, weight `g`):
/// `y = (W · (x ⊙ (g + offset))) / sqrt(mean(x²) + eps)`. The norm is a per-token scale, so
/// each lane multiplies its converted weights by `g + offset` (once per vector, whatever the
/// token count) and sums the squares of the `x` values it reads; a plane reads every column
/// of each token, so one more `plane_sum` per token gives `Σ x²` and the scale is applied
/// after the row's reduction: no separate norm launch, no extra pass over memory.
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
    ttiles: u32,
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
) {
    let lane = UNIT_POS as usize % plane_size;
    let block = CUBE_POS_X as usize / ttiles as usize;
    let t0 = (CUBE_POS_X as usize % ttiles as usize) * max_tokens;
    let row0 = (block * warps + UNIT_POS as usize / plane_size) * rows;
    let all = meta[0] as usize;
    if row0 >= n || t0 >= all {
        terminate!();
    }
    let tokens = min(all - t0, max_tokens);
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
    // A single row takes 8 per round: a warp's rounds are a chain of DRAM round trips.
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
                t0,
                tokens,
                &mut acc,
                &mut ss,
                max_tokens,
                rows,
                vec,
                norm,
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
            x, &wv, norm_w, off, 0usize, 1usize, v, kv, t0, tokens, &mut acc, &mut ss, max_tokens, rows, vec,
            norm,
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
            if comptime![has_bias] {
                s += bias[min(row, n - 1)];
            }
            if lane == 0 && t < tokens && row < n {
                if comptime![accumulate] {
                    y[(t0 + t) * n + row] += s;
                } else {
                    y[(t0 + t) * n + row] = s;
                }
            }
        }
    }
}

/// `acc[r · max_tokens + t] += W vector · x vector` for the weight vectors `wv[r · per_row + q]`
/// of each row and `x`'s vector `v` of each real token `t0 + t`. With `norm` the weights are first
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
    t0: usize,
    tokens: usize,
    acc: &mut Array<f32>,
    ss: &mut Array<f32>,
    #[comptime] max_tokens: usize,
    #[comptime] rows: usize,
    #[comptime] vec: usize,
    #[comptime] norm: bool,
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
    // no guard, so the compiler can issue all of them before the FMAs (guarded, each token's
    // `x` is an L2 round trip of its own).
    let last = max(tokens, 1usize) - 1;
    #[unroll]
    for t in 0..max_tokens {
        let tr = min(t, last);
        let xv = x[(t0 + tr) * kv + v];
        let mut xf = Array::<f32>::new(vec);
        #[unroll]
        for i in 0..vec {
            xf[i] = xv[i];
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

/// Launches [`dense_gemm_kernel`] (arguments checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    input: GemmInput<'_>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) {
    let plane = client.properties().hardware.plane_size_max as usize;
    let warps = 8;
    // The widest load the device likes that divides the row (16 bytes of halves on CUDA).
    let vec =
        client.io_optimized_vector_sizes(2).filter(|v| *v <= 8 && g.k.is_multiple_of(*v)).max().unwrap_or(1);
    let tb = token_bucket(tokens.min(MAX_TOKENS));
    let ttiles = tokens.div_ceil(tb);
    // Two rows per plane share each `x` vector (and with a norm its weight vector and Σ x²)
    // once there are two tokens or a norm; a plain input at one token keeps one row per plane,
    // twice the cubes in flight (the faster choice on the H200).
    let normed = matches!(input, GemmInput::Norm(_));
    let default = if tb == 2 || normed { 2 } else { 1 };
    let rows = if tb > 2 { 2 } else { g.plain_rows.filter(|r| *r == 1 || *r == 2).unwrap_or(default) };
    // Without a norm the kernel reads neither norm buffer: `x` and `meta` stand in for them.
    let (nw, np) = match input {
        GemmInput::Norm(nm) => (nm.w, nm.params),
        _ => (x, meta),
    };
    // SAFETY: sizes checked above; the kernel reads `meta[0] = tokens` rows of `k`;
    // `w` holds `n · k` halves, i.e. `n · k / vec` vectors, and `x` at least
    // `tokens · k / vec`, the norm weight (when read) `k / vec` (whole buffers, so their
    // starts are aligned for any vector width).
    unsafe {
        dense_gemm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((g.n.div_ceil(warps * rows) * ttiles) as u32, 1, 1),
            CubeDim::new_1d((warps * plane) as u32),
            vec,
            ArrayArg::from_raw_parts(x.handle.clone(), x.len / vec),
            ArrayArg::from_raw_parts(w.handle.clone(), g.n * g.k / vec),
            bias.arg(),
            meta.arg(),
            ArrayArg::from_raw_parts(nw.handle.clone(), (nw.len / vec).max(1)),
            np.arg(),
            y.arg(),
            ttiles as u32,
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
        )
    };
}
