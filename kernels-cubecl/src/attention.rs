//! Paged KV cache kernels for decoding: append one token's K/V per sequence into its cache
//! block, and attend one query token per sequence over its blocks.
//!
//! Pool layout (one K and one V pool per layer): `[slots, kv_heads · head_dim]` with
//! `slot = block · block_size + offset`, in the cache element type `KV` (f16 on the GPU). A
//! sequence's block table lists its blocks in token order, so token `t` lives in slot
//! `table[t / block_size] · block_size + t % block_size`.
//!
//! Attention mapping (split-context, "flash decoding"): a cube serves `hg` query heads that
//! share one KV head (GQA: K/V rows are read once for the group) over one chunk of the
//! context; its planes (warps) take interleaved runs of `unroll` tokens, lane `l` owning the
//! head dimensions `l, l + P, …` (`P` = plane size) so every K/V row is read coalesced. Each
//! plane keeps an online softmax (running max, sum, rescaled accumulator) per head; the planes
//! merge theirs through shared memory. With one chunk per sequence the cube writes the output;
//! otherwise it writes its unnormalised partial `(acc, m, l)` and [`paged_decode_combine_kernel`]
//! merges the chunks. Why: one plane walking 4096 tokens one at a time is latency-bound (a
//! dependent load, a plane reduction and two `exp` per token) and fills 32 of 132 SMs.

use cubecl::prelude::*;

use crate::gemm::{warp_max, warp_sum};

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

/// Split-context decode attention, first pass. Grid: `(n_kv_heads · group / hg, seqs, splits)`;
/// cube: `planes` planes. Sequence `s` sees tokens `start..len` (`start` from the window); split
/// `z` takes `start + z · chunk ..` up to `chunk` of them. `direct` (one split): write
/// normalised outputs to `out` `[seqs, n_heads, head_dim]`; otherwise write
/// `part[((s · n_heads + h) · splits + z) · (head_dim + 2) ..]` = unnormalised accumulator,
/// running max, running sum.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn paged_decode_split_kernel<KV: Float>(
    q: &Array<f32>,
    k_pool: &Array<KV>,
    v_pool: &Array<KV>,
    block_table: &Array<u32>,
    seq_lens: &Array<u32>,
    params: &Array<f32>,
    out: &mut Array<f32>,
    part: &mut Array<f32>,
    chunk: u32,
    splits: u32,
    #[comptime] head_dim: usize,
    #[comptime] n_heads: usize,
    #[comptime] n_kv_heads: usize,
    #[comptime] hg: usize,
    #[comptime] block_size: usize,
    #[comptime] max_blocks: usize,
    #[comptime] window: usize,
    #[comptime] plane_size: usize,
    #[comptime] planes: usize,
    #[comptime] unroll: usize,
    #[comptime] q_stride: usize,
    #[comptime] direct: bool,
) {
    let per = comptime![head_dim / plane_size];
    let group = comptime![n_heads / n_kv_heads];
    let subs = comptime![group / hg];
    let kv_width = comptime![n_kv_heads * head_dim];
    let x = CUBE_POS_X as usize;
    let kvh = x / subs;
    let h0 = kvh * group + (x % subs) * hg;
    let s = CUBE_POS_Y as usize;
    let z = CUBE_POS_Z as usize;
    let lane = UNIT_POS as usize % plane_size;
    let w = UNIT_POS as usize / plane_size;

    let len = seq_lens[s] as usize;
    let mut start = 0usize;
    if comptime![window > 0] {
        if len > window {
            start = len - window;
        }
    }
    let c0 = start + z * chunk as usize;
    let c1 = min(len, c0 + chunk as usize);
    let scale = params[0];

    let mut qv = Array::<f32>::new(comptime![hg * per]);
    let mut acc = Array::<f32>::new(comptime![hg * per]);
    let mut m = Array::<f32>::new(hg);
    let mut l = Array::<f32>::new(hg);
    #[unroll]
    for g in 0..hg {
        #[unroll]
        for j in 0..per {
            qv[g * per + j] = q[s * q_stride + (h0 + g) * head_dim + lane + j * plane_size] * scale;
            acc[g * per + j] = 0.0;
        }
        // A finite "minus infinity" keeps exp(m - m_new) away from inf - inf.
        m[g] = -1.0e30;
        l[g] = 0.0;
    }
    let head_off = kvh * head_dim + lane;
    let mut kr = Array::<f32>::new(comptime![unroll * per]);
    let mut vr = Array::<f32>::new(comptime![unroll * per]);
    let mut sc = Array::<f32>::new(comptime![hg * unroll]);
    let mut t0 = c0 + w * unroll;
    while t0 < c1 {
        // All K and V loads of `unroll` tokens are issued before any of them is used.
        #[unroll]
        for u in 0..unroll {
            let t = min(t0 + u, c1 - 1);
            let blk = block_table[s * max_blocks + t / block_size] as usize;
            let base = (blk * block_size + t % block_size) * kv_width + head_off;
            #[unroll]
            for j in 0..per {
                kr[u * per + j] = f32::cast_from(k_pool[base + j * plane_size]);
                vr[u * per + j] = f32::cast_from(v_pool[base + j * plane_size]);
            }
        }
        #[unroll]
        for g in 0..hg {
            let mut m_new = m[g];
            #[unroll]
            for u in 0..unroll {
                let mut part_dot = 0.0f32;
                #[unroll]
                for j in 0..per {
                    part_dot += qv[g * per + j] * kr[u * per + j];
                }
                // Tokens past the chunk (clamped loads) get a score that exp() turns into 0.
                let score = select(t0 + u < c1, warp_sum(part_dot, plane_size), f32::new(-1.0e30));
                sc[g * unroll + u] = score;
                m_new = max(m_new, score);
            }
            let corr = (m[g] - m_new).exp();
            let mut lg = l[g] * corr;
            #[unroll]
            for j in 0..per {
                acc[g * per + j] *= corr;
            }
            #[unroll]
            for u in 0..unroll {
                let p = (sc[g * unroll + u] - m_new).exp();
                lg += p;
                #[unroll]
                for j in 0..per {
                    acc[g * per + j] += p * vr[u * per + j];
                }
            }
            l[g] = lg;
            m[g] = m_new;
        }
        t0 += comptime![planes * unroll];
    }

    // Merge the planes: [planes, hg, head_dim] accumulators, then [planes, hg] maxima and sums.
    let stat = comptime![planes * hg * head_dim];
    let mut sh = SharedMemory::<f32>::new(comptime![planes * hg * (head_dim + 2)]);
    #[unroll]
    for g in 0..hg {
        #[unroll]
        for j in 0..per {
            sh[(w * hg + g) * head_dim + lane + j * plane_size] = acc[g * per + j];
        }
        if lane == 0 {
            sh[stat + w * hg + g] = m[g];
            sh[stat + planes * hg + w * hg + g] = l[g];
        }
    }
    sync_cube();
    for i in range_stepped(UNIT_POS as usize, comptime![hg * head_dim], comptime![planes * plane_size]) {
        let g = i / head_dim;
        let d = i % head_dim;
        let mut mm = f32::new(-1.0e30);
        #[unroll]
        for p in 0..planes {
            mm = max(mm, sh[stat + p * hg + g]);
        }
        let mut ll = 0.0f32;
        let mut aa = 0.0f32;
        #[unroll]
        for p in 0..planes {
            let f = (sh[stat + p * hg + g] - mm).exp();
            ll += sh[stat + planes * hg + p * hg + g] * f;
            aa += sh[(p * hg + g) * head_dim + d] * f;
        }
        let h = h0 + g;
        if comptime![direct] {
            out[(s * n_heads + h) * head_dim + d] = aa / select(ll > 0.0, ll, 1.0f32);
        } else {
            let at = ((s * n_heads + h) * splits as usize + z) * comptime![head_dim + 2];
            part[at + d] = aa;
            if d == 0 {
                part[at + head_dim] = mm;
                part[at + head_dim + 1] = ll;
            }
        }
    }
}

/// Splits [`paged_decode_combine_kernel`] loads per round.
const COMBINE_ROUND: usize = 8;

/// Split-context decode attention, second pass: merges the `splits` partials of each
/// (sequence, head). Grid: `(n_heads, seqs)`; cube: one plane, lane `l` owning dims `l, l + P, …`.
#[cube(launch_unchecked)]
pub fn paged_decode_combine_kernel(
    part: &Array<f32>,
    out: &mut Array<f32>,
    splits: u32,
    #[comptime] head_dim: usize,
    #[comptime] n_heads: usize,
    #[comptime] plane_size: usize,
) {
    let per = comptime![head_dim / plane_size];
    let h = CUBE_POS_X as usize;
    let s = CUBE_POS_Y as usize;
    let lane = UNIT_POS as usize;
    let row = comptime![head_dim + 2];
    let base = (s * n_heads + h) * splits as usize * row;
    // The splits' maxima and softmax denominators across the lanes (a lane per split), not
    // in the accumulation loop: a plane walking 32 splits one by one took 7 µs (Mixtral, batch
    // 1, ncu on the H200).
    let mut mm = f32::new(-1.0e30);
    for z in range_stepped(lane, splits as usize, plane_size) {
        mm = max(mm, part[base + z * row + head_dim]);
    }
    mm = warp_max(mm, plane_size);
    let mut ll = 0.0f32;
    for z in range_stepped(lane, splits as usize, plane_size) {
        let at = base + z * row;
        ll += part[at + head_dim + 1] * (part[at + head_dim] - mm).exp();
    }
    ll = warp_sum(ll, plane_size);
    let mut acc = Array::<f32>::new(per);
    #[unroll]
    for j in 0..per {
        acc[j] = 0.0;
    }
    // Rounds of COMBINE_ROUND splits whose loads are all issued before any is used: a loop
    // of one split per iteration waited an L2 round trip per split.
    let n = splits as usize;
    for z0 in range_stepped(0usize, n, COMBINE_ROUND) {
        let mut pm = Array::<f32>::new(COMBINE_ROUND);
        let mut pv = Array::<f32>::new(comptime![COMBINE_ROUND * per]);
        #[unroll]
        for zz in 0..COMBINE_ROUND {
            // Splits past the last read the last one and weigh zero.
            let at = base + min(z0 + zz, n - 1) * row;
            pm[zz] = part[at + head_dim];
            #[unroll]
            for j in 0..per {
                pv[zz * per + j] = part[at + lane + j * plane_size];
            }
        }
        #[unroll]
        for zz in 0..COMBINE_ROUND {
            let f = select(z0 + zz < n, (pm[zz] - mm).exp(), 0.0f32);
            #[unroll]
            for j in 0..per {
                acc[j] += pv[zz * per + j] * f;
            }
        }
    }
    let zz = select(ll > 0.0, ll, 1.0f32);
    #[unroll]
    for j in 0..per {
        out[(s * n_heads + h) * head_dim + lane + j * plane_size] = acc[j] / zz;
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
/// a row sharing its work: one cube per row took ~10 µs for Mixtral's 40 heads at batch 1,
/// ncu on the H200): the query heads of
/// row `t` of `qkv` are rotated in place (attention reads them there), its key heads are rotated
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
