//! Per-head RMSNorms of a fused Q|K|V projection row (Qwen3-style Q/K norms, Gemma-4's weighted
//! Q/K and weightless V norms with K = V), alone or fused with RoPE and the K/V append.

use cubecl::prelude::*;

use crate::attention::append::{Rope, rope_reference, rope_store};
use crate::device::{bad, need, row_units};
use crate::plane::{cube_sum, load_row};
use crate::{DeviceArray, KernelError};

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

/// Gemma-4's per-head norms, RoPE and the K/V append in one launch (grid `(tokens, source
/// heads)`, cube `units` units): [`head_norm_kernel`] with
/// `qk_norm` and `v_norm` (weighted Q/K norms, weightless V norm, V = the raw K heads with
/// `k_eq_v`) feeding [`crate::attention::append::rope_append`]'s rotation, reading the projection row `src[t]`
/// directly. Cube `(t, sh)` reduces source head `sh` (its columns loaded together) into its
/// inverse RMS; a query head, normed and rotated, goes to `q[t]` (the first `heads · hd` of a
/// row of `q_stride`, where attention reads them), a key head normed and rotated into K pool
/// slot `slots[t]` (dimensions past `rot_dim` unrotated), a value head (with `k_eq_v` the key
/// head itself) normed into the V pool. Why one launch: the separate norm was one more launch
/// per layer; why a cube per head: one cube per token walked every head in loops whose loads
/// waited behind the previous iteration's stores.
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
/// [`rope_reference`] on the query and key heads; returns each token's
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
    let r = Rope { stride, heads: g.heads + g.kv_heads, head_dim: g.head_dim, rot_dim };
    rope_reference(r, &mut rows, pos, inv_freq);
    let (nq, nk) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
    let part = |off: usize, n: usize| -> Vec<f32> {
        rows.chunks(stride).flat_map(|r| r[off..][..n].to_vec()).collect()
    };
    (part(0, nq), part(nq, nk), part(nq + nk, nk))
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubecl::wgpu::WgpuRuntime;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::testing::{assert_close, client, rand_vec};
    use crate::*;

    /// f32 arithmetic in another order than the CPU (plane sums), plus GPU exp/tanh.
    const FAMILY_TOL: f32 = 2e-5;

    /// Gemma-4's head norms, RoPE and K/V append in one launch against `head_norm_reference`, then
    /// `rope_reference`, then `kv_append_reference`: with and without K = V, full and partial
    /// rotary, spare columns in the projection row and in the query row.
    #[test]
    fn head_norm_rope_append_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(22);
        let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
        let (heads, kv_heads, head_dim) = (4, 2, 16);
        for (k_eq_v, rot_dim) in [(false, 16usize), (true, 10)] {
            let src_heads = if k_eq_v { heads + kv_heads } else { heads + 2 * kv_heads };
            let g = HeadNorm {
                heads,
                kv_heads,
                head_dim,
                src_stride: src_heads * head_dim + 3,
                qk_norm: true,
                v_norm: true,
                k_eq_v,
            };
            let shape = PagedAttnShape {
                n_heads: heads,
                n_kv_heads: kv_heads,
                head_dim,
                block_size: 4,
                max_blocks: 4,
                window: 0,
            };
            let (tokens, pool_slots, w) = (3, 12, shape.slot_width());
            let src = rand_vec(&mut rng, tokens * g.src_stride, 2.0);
            let wn = rand_vec(&mut rng, 2 * head_dim, 1.5);
            let pos = [0u32, 7, 130];
            let slots = [5u32, 0, 9];
            let inv_freq: Vec<f32> =
                (0..rot_dim / 2).map(|i| 10000f32.powf(-((2 * i) as f32) / rot_dim as f32)).collect();
            let (wq, wk, wv) = head_norm_rope_append_reference(g, &src, &wn, 1e-6, &pos, &inv_freq, rot_dim);
            let (mut kp, mut vp) = (vec![0f32; pool_slots * w], vec![0f32; pool_slots * w]);
            kv_append_reference(shape, &wk, &wv, &slots, &mut kp, &mut vp);
            let q_stride = g.out_stride();
            let qd = up(&vec![0.0; tokens * q_stride]);
            let (kd, vd) = (up(&vec![0.0; pool_slots * w]), up(&vec![0.0; pool_slots * w]));
            let (pd, sd) = (DeviceArray::from_slice(&client, &pos), DeviceArray::from_slice(&client, &slots));
            head_norm_rope_append::<_, f32>(
                &client,
                g,
                tokens,
                rot_dim,
                &up(&src),
                &up(&wn),
                &up(&[1e-6]),
                &pd,
                &up(&inv_freq),
                &sd,
                (&qd, q_stride),
                &kd,
                &vd,
            )
            .unwrap();
            let got = read_f32(&client, &qd).unwrap();
            let q: Vec<f32> =
                (0..tokens).flat_map(|t| got[t * q_stride..][..heads * head_dim].to_vec()).collect();
            let what = format!("K = V {k_eq_v}, rot_dim {rot_dim}");
            assert_close(&q, &wq, FAMILY_TOL, &format!("queries, {what}"));
            assert_close(&read_f32(&client, &kd).unwrap(), &kp, FAMILY_TOL, &format!("K pool, {what}"));
            assert_close(&read_f32(&client, &vd).unwrap(), &vp, FAMILY_TOL, &format!("V pool, {what}"));
        }
    }

    #[test]
    fn head_norm_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(12);
        let (heads, kv_heads, head_dim) = (4, 2, 16);
        for (qk_norm, v_norm, k_eq_v) in [(true, true, false), (true, true, true), (false, false, false)] {
            let src_heads = if k_eq_v { heads + kv_heads } else { heads + 2 * kv_heads };
            let g = HeadNorm {
                heads,
                kv_heads,
                head_dim,
                src_stride: src_heads * head_dim,
                qk_norm,
                v_norm,
                k_eq_v,
            };
            let tokens = 3;
            let src = rand_vec(&mut rng, tokens * g.src_stride, 2.0);
            let w = rand_vec(&mut rng, 2 * head_dim, 1.5);
            let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * g.out_stride());
            let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
            head_norm(&client, g, tokens, &up(&src), &up(&w), &up(&[1e-6]), &out).unwrap();
            let want = head_norm_reference(g, &src, &w, 1e-6);
            assert_close(&read_f32(&client, &out).unwrap(), &want, FAMILY_TOL, &format!("head_norm {g:?}"));
        }
    }
}
