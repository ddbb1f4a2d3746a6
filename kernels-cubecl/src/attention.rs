//! Paged KV cache kernels for decoding: append one token's K/V per sequence into its cache
//! block, and attend one query token per sequence over its blocks.
//!
//! Pool layout (one K and one V pool per layer): `[slots, kv_heads · head_dim]` with
//! `slot = block · block_size + offset`, in the cache element type `KV` (f16 on the GPU). A
//! sequence's block table lists its blocks in token order, so token `t` lives in slot
//! `table[t / block_size] · block_size + t % block_size`.
//!
//! Attention mapping: one plane (warp) per (query head, sequence); lane `l` owns the head
//! dimensions `l, l + P, l + 2P, …` (`P` = plane size), so every K/V row is read coalesced.
//! Tokens are visited in order with an online softmax (running max, running sum, rescaled
//! accumulator), one `plane_sum` per token for the score.

use cubecl::prelude::*;

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

/// Decode attention over paged K/V. Grid: `(query heads, sequences)`; cube: one plane.
/// Queries are read at `s · q_stride` (inside a fused QKV row), outputs are dense.
/// `params[0]` is the score scale. `seq_lens[s]` counts the cached tokens of sequence `s`,
/// the query's own included (it was appended first); with `window > 0` the query sees only the
/// last `window` of them.
#[cube(launch_unchecked)]
// The window test is comptime, the length test runtime: they cannot share one `if`.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn paged_decode_kernel<KV: Float>(
    q: &Array<f32>,
    k_pool: &Array<KV>,
    v_pool: &Array<KV>,
    block_table: &Array<u32>,
    seq_lens: &Array<u32>,
    params: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] head_dim: usize,
    #[comptime] n_heads: usize,
    #[comptime] n_kv_heads: usize,
    #[comptime] block_size: usize,
    #[comptime] max_blocks: usize,
    #[comptime] window: usize,
    #[comptime] plane_size: usize,
    #[comptime] q_stride: usize,
) {
    let per = comptime![head_dim / plane_size];
    let h = CUBE_POS_X as usize;
    let s = CUBE_POS_Y as usize;
    let kvh = h / comptime![n_heads / n_kv_heads];
    let lane = UNIT_POS as usize;
    let kv_width = comptime![n_kv_heads * head_dim];
    let len = seq_lens[s] as usize;
    let mut start = 0usize;
    if comptime![window > 0] {
        if len > window {
            start = len - window;
        }
    }
    let scale = params[0];

    let q_base = s * q_stride + h * head_dim + lane;
    let o_base = (s * n_heads + h) * head_dim + lane;
    let mut qv = Array::<f32>::new(per);
    let mut acc = Array::<f32>::new(per);
    #[unroll]
    for j in 0..per {
        qv[j] = q[q_base + j * plane_size] * scale;
        acc[j] = 0.0;
    }
    // A finite "minus infinity" keeps exp(m - m_new) away from inf - inf.
    let mut m = f32::new(-1.0e30);
    let mut l = 0.0f32;
    for t in start..len {
        let blk = block_table[s * max_blocks + t / block_size] as usize;
        let base = (blk * block_size + t % block_size) * kv_width + kvh * head_dim + lane;
        let mut part = 0.0f32;
        #[unroll]
        for j in 0..per {
            part += qv[j] * f32::cast_from(k_pool[base + j * plane_size]);
        }
        let score = plane_sum(part);
        let m_new = select(score > m, score, m);
        let corr = (m - m_new).exp();
        let p = (score - m_new).exp();
        l = l * corr + p;
        #[unroll]
        for j in 0..per {
            acc[j] = acc[j] * corr + p * f32::cast_from(v_pool[base + j * plane_size]);
        }
        m = m_new;
    }
    let z = select(l > 0.0, l, 1.0f32);
    #[unroll]
    for j in 0..per {
        out[o_base + j * plane_size] = acc[j] / z;
    }
}
