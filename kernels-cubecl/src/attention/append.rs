//! Writing a decode step's K/V rows into the paged cache: the plain append, and RoPE of the
//! query and key heads fused with it.

use cubecl::prelude::*;

use super::{PagedAttnShape, RowLayout};
use crate::{DeviceArray, KernelError};

/// Writes the new token of each sequence into its slot. Grid: `(sequences)`; each cube copies
/// one `[kv_heads · head_dim]` row of K and of V (read at `s · src_stride + k_off` / `v_off`,
/// so they can sit inside a fused QKV row), converting to the pool's element type.
#[cube(launch_unchecked)]
pub fn kv_append_kernel<KV: Float>(
    k_new: &Array<f32>,
    v_new: &Array<f32>,
    slots: &Array<u32>,
    k_pool: &mut Array<KV>,
    v_pool: &mut Array<KV>,
    #[comptime] width: usize,
    #[comptime] src_stride: usize,
    #[comptime] k_off: usize,
    #[comptime] v_off: usize,
) {
    let s = CUBE_POS_X as usize;
    let dst = slots[s] as usize * width;
    let src = s * src_stride;
    for i in range_stepped(UNIT_POS as usize, width, CUBE_DIM as usize) {
        k_pool[dst + i] = KV::cast_from(k_new[src + k_off + i]);
        v_pool[dst + i] = KV::cast_from(v_new[src + v_off + i]);
    }
}

/// Rotates the pair `(x1, x2)` (columns `i` and `i + half` of head `hd`) by the angle `a`
/// (rotate-half RoPE) and stores it: a query head (`hd < heads`) at `q[qo]` and `q[qo + half]`,
/// a key head into the K pool row at `kb` (its head `hd − heads`, column `i` and `i + half`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_store<KV: Float>(
    x1: f32,
    x2: f32,
    a: f32,
    hd: usize,
    i: usize,
    q: &mut Array<f32>,
    qo: usize,
    k_pool: &mut Array<KV>,
    kb: usize,
    #[comptime] heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] half: usize,
) {
    let (s, c) = (a.sin(), a.cos());
    let y1 = x1 * c - x2 * s;
    let y2 = x2 * c + x1 * s;
    if hd < heads {
        q[qo] = y1;
        q[qo + half] = y2;
    } else {
        let d = kb + (hd - heads) * head_dim + i;
        k_pool[d] = KV::cast_from(y1);
        k_pool[d + half] = KV::cast_from(y2);
    }
}

/// RoPE and the K/V append of a decode step in one launch (grid `(tokens, cubes)`, the cubes of
/// a row sharing its work, which one cube per row leaves serial): the query heads of row `t` of
/// `qkv` are rotated in place (attention reads them there), its key heads are rotated
/// on their way into K pool slot `slots[t]` (the unrotated dimensions past `rot_dim` copied as
/// they are), and its value heads are copied into the V pool. Key heads must follow the query
/// heads in the row (`k_off = heads · head_dim`). Angle `pos[t] · inv_freq[i]`, rotate-half.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn rope_append_kernel<KV: Float>(
    qkv: &mut Array<f32>,
    pos: &Array<u32>,
    inv_freq: &Array<f32>,
    slots: &Array<u32>,
    k_pool: &mut Array<KV>,
    v_pool: &mut Array<KV>,
    #[comptime] stride: usize,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] rot_dim: usize,
    #[comptime] v_off: usize,
) {
    let t = CUBE_POS_X as usize;
    let half = comptime![rot_dim / 2];
    let kv_width = comptime![kv_heads * head_dim];
    let p = f32::cast_from(pos[t]);
    let row = t * stride;
    let dst = slots[t] as usize * kv_width;
    let first = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    let step = CUBE_COUNT_Y as usize * CUBE_DIM as usize;
    for u in range_stepped(first, comptime![(heads + kv_heads) * half], step) {
        let hd = u / half;
        let i = u % half;
        let b = row + hd * head_dim + i;
        let (x1, x2) = (qkv[b], qkv[b + half]);
        rope_store(x1, x2, p * inv_freq[i], hd, i, qkv, b, k_pool, dst, heads, head_dim, half);
    }
    let tail = comptime![head_dim - rot_dim];
    if comptime![tail > 0] {
        for u in range_stepped(first, comptime![kv_heads * tail], step) {
            let i = rot_dim + u % tail;
            let h = u / tail;
            k_pool[dst + h * head_dim + i] =
                KV::cast_from(qkv[row + comptime![heads * head_dim] + h * head_dim + i]);
        }
    }
    for i in range_stepped(first, kv_width, step) {
        v_pool[dst + i] = KV::cast_from(qkv[row + v_off + i]);
    }
}

/// Writes each sequence's new K/V row (`k_new`, `v_new`: `[seqs, kv_heads · head_dim]` f32) into
/// pool slot `slots[s]`, converting to the pool type `KV`. Does not synchronise.
///
/// # Shapes
/// - `k_new`, `v_new`: `[seqs, slot_width]`; `slots`: `[seqs]`; pools: `[pool slots, slot_width]`
#[allow(clippy::too_many_arguments)]
pub fn kv_append<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    k_new: &DeviceArray,
    v_new: &DeviceArray,
    slots: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let w = shape.slot_width();
    let layout = RowLayout { stride: w, k_off: 0, v_off: 0 };
    kv_append_rows::<R, KV>(client, shape, seqs, layout, k_new, v_new, slots, k_pool, v_pool)
}

/// [`kv_append`] reading K/V rows laid out as `layout` says.
#[allow(clippy::too_many_arguments)]
pub fn kv_append_rows<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    layout: RowLayout,
    k_new: &DeviceArray,
    v_new: &DeviceArray,
    slots: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let w = shape.slot_width();
    if seqs == 0 {
        return Ok(());
    }
    let need = (seqs - 1) * layout.stride + w;
    if layout.k_off + w > layout.stride.max(w)
        || layout.v_off + w > layout.stride.max(w)
        || k_new.len < need + layout.k_off
        || v_new.len < need + layout.v_off
        || slots.len < seqs
        || k_pool.len != v_pool.len
    {
        return Err(KernelError::BadItem { item: 0, reason: "kv_append: buffer sizes do not match".into() });
    }
    // SAFETY: sources and slot list checked above; slot values are the cache allocator's, which
    // hands out only slots below `k_pool.len / w`.
    unsafe {
        kv_append_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static(seqs as u32, 1, 1),
            CubeDim::new_1d(w.min(256) as u32),
            k_new.arg(),
            v_new.arg(),
            slots.arg(),
            k_pool.arg(),
            v_pool.arg(),
            w,
            layout.stride,
            layout.k_off,
            layout.v_off,
        )
    };
    Ok(())
}

/// RoPE of the query and key heads of `qkv` rows and the K/V append in one launch (see
/// [`attention::rope_append_kernel`]): the decode step's `rope` + [`kv_append_rows`] with one
/// launch less per layer. `layout.k_off` must be `n_heads · head_dim` (keys right after the
/// queries). Does not synchronise.
///
/// # Shapes
/// - `qkv`: `[tokens, layout.stride]`; `pos`, `slots`: `[tokens]`; `inv_freq`: `[rot_dim / 2]`;
///   pools: `[pool slots, n_kv_heads · head_dim]`
#[allow(clippy::too_many_arguments)]
pub fn rope_append<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    tokens: usize,
    layout: RowLayout,
    rot_dim: usize,
    qkv: &DeviceArray,
    pos: &DeviceArray,
    inv_freq: &DeviceArray,
    slots: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let (hd, w) = (shape.head_dim, shape.slot_width());
    let bad = |reason: String| Err(KernelError::BadItem { item: 0, reason });
    if layout.k_off != shape.n_heads * hd
        || layout.k_off + w > layout.stride
        || layout.v_off + w > layout.stride
    {
        return bad(format!("rope_append: row layout {layout:?} does not hold Q | K | V heads of {hd}"));
    }
    if rot_dim == 0 || rot_dim > hd || !rot_dim.is_multiple_of(2) {
        return bad(format!("rope_append: rot_dim {rot_dim} for head_dim {hd}"));
    }
    if tokens == 0 {
        return Ok(());
    }
    if qkv.len < tokens * layout.stride
        || pos.len < tokens
        || slots.len < tokens
        || inv_freq.len < rot_dim / 2
        || k_pool.len != v_pool.len
    {
        return bad("rope_append: buffer sizes do not match".into());
    }
    // A unit per rotated pair, cubes of up to 256.
    let pairs = (shape.n_heads + shape.n_kv_heads) * rot_dim / 2;
    let units = pairs.clamp(1, 256);
    // SAFETY: sizes checked above; slot values are the cache allocator's (inside the pools).
    unsafe {
        rope_append_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static(tokens as u32, pairs.div_ceil(units) as u32, 1),
            CubeDim::new_1d(units as u32),
            qkv.arg(),
            pos.arg(),
            inv_freq.arg(),
            slots.arg(),
            k_pool.arg(),
            v_pool.arg(),
            layout.stride,
            shape.n_heads,
            shape.n_kv_heads,
            hd,
            rot_dim,
            layout.v_off,
        )
    };
    Ok(())
}

/// CPU reference of [`kv_append`] on f32 pools.
pub fn kv_append_reference(
    shape: PagedAttnShape,
    k_new: &[f32],
    v_new: &[f32],
    slots: &[u32],
    k_pool: &mut [f32],
    v_pool: &mut [f32],
) {
    let w = shape.slot_width();
    for (s, &slot) in slots.iter().enumerate() {
        let d = slot as usize * w;
        k_pool[d..d + w].copy_from_slice(&k_new[s * w..][..w]);
        v_pool[d..d + w].copy_from_slice(&v_new[s * w..][..w]);
    }
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
