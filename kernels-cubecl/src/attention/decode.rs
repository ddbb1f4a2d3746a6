//! Decode attention: one query token per sequence over its paged K/V, split across cubes
//! along the context ("flash decoding") and merged by a second pass.

use cubecl::prelude::*;

use super::PagedAttnShape;
use crate::plane::{warp_max, warp_sum};
use crate::{DeviceArray, KernelError};

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

    merge_planes(
        &acc, &m, &l, out, part, s, h0, z, splits, w, lane, head_dim, n_heads, hg, plane_size, planes, direct,
    );
}

/// Merges the planes' online softmax states (`acc`, `m`, `l` of the cube's `hg` heads from
/// `h0`) through shared memory, and writes the normalised output (`direct`) or split `z`'s
/// partial (see [`paged_decode_split_kernel`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn merge_planes(
    acc: &Array<f32>,
    m: &Array<f32>,
    l: &Array<f32>,
    out: &mut Array<f32>,
    part: &mut Array<f32>,
    s: usize,
    h0: usize,
    z: usize,
    splits: u32,
    w: usize,
    lane: usize,
    #[comptime] head_dim: usize,
    #[comptime] n_heads: usize,
    #[comptime] hg: usize,
    #[comptime] plane_size: usize,
    #[comptime] planes: usize,
    #[comptime] direct: bool,
) {
    let per = comptime![head_dim / plane_size];
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
    // in the accumulation loop, where a plane would walk the splits one by one.
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

/// Decode attention of one query token per sequence over its paged K/V:
/// `out[s, h] = softmax(scale · q[s, h] · K[s, kv(h)]ᵀ) · V[s, kv(h)]` over the sequence's
/// visible tokens. `params` holds `[scale]`; `max_len` bounds `seq_lens` (it sizes the split
/// of the context across cubes; a smaller value would leave tokens out). Does not synchronise.
///
/// # Shapes
/// - `q`, `out`: `[seqs, n_heads, head_dim]`; `block_table`: `[seqs, max_blocks]`;
///   `seq_lens`: `[seqs]`; pools: `[pool slots, n_kv_heads · head_dim]`
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    max_len: usize,
    q: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
    block_table: &DeviceArray,
    seq_lens: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let q_stride = shape.n_heads * shape.head_dim;
    paged_decode_attention_strided::<R, KV>(
        client,
        shape,
        seqs,
        max_len,
        q,
        q_stride,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        params,
        out,
    )
}

/// How [`paged_decode_attention`] cuts its work: heads per cube, planes per cube, tokens per
/// plane iteration and per split, number of splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnSplit {
    /// Query heads per cube (they share one KV head).
    pub hg: usize,
    /// Planes per cube.
    pub planes: usize,
    /// Tokens per plane iteration (their loads are in flight together).
    pub unroll: usize,
    /// Tokens per split.
    pub chunk: usize,
    /// Splits of the context (1: no combine pass).
    pub splits: usize,
}

impl AttnSplit {
    /// The split for `seqs` sequences of at most `max_len` cached tokens on a device with
    /// `sms` multiprocessors, `plane_size` lanes and `smem` bytes of shared memory per cube.
    pub fn choose(
        shape: &PagedAttnShape,
        seqs: usize,
        max_len: usize,
        plane_size: usize,
        sms: usize,
        smem: usize,
    ) -> Self {
        let group = shape.n_heads / shape.n_kv_heads;
        let per = shape.head_dim / plane_size;
        // Registers: `hg · per` query and accumulator values per lane; 16 keeps ptxas from
        // spilling with the K/V registers of `unroll` tokens beside them.
        let mut hg = group;
        while hg > 1 && (hg * per > 16 || !group.is_multiple_of(hg)) {
            hg -= 1;
        }
        let unroll = if per <= 4 {
            4
        } else if per <= 8 {
            2
        } else {
            1
        };
        // The plane merge needs `planes · hg · (head_dim + 2)` f32 of shared memory; stay within
        // 16 KiB so that several cubes share an SM (and lavapipe's 32 KiB).
        let budget = smem.min(16 * 1024) / 4;
        let mut planes = 4;
        while planes > 1 && planes * hg * (shape.head_dim + 2) > budget {
            planes /= 2;
        }
        let visible = if shape.window > 0 { max_len.min(shape.window) } else { max_len }.max(1);
        // Enough cubes to cover the SMs twice, down to one iteration per plane (a higher floor
        // leaves short contexts in too few cubes).
        let base = (shape.n_heads / hg) * seqs.max(1);
        let want = (2 * sms).div_ceil(base).max(1);
        let min_chunk = planes * unroll;
        let chunk = visible.div_ceil(want).max(min_chunk);
        Self { hg, planes, unroll, chunk, splits: visible.div_ceil(chunk) }
    }
}

/// [`paged_decode_attention`] with the query of sequence `s` at `s · q_stride` (inside a fused
/// QKV row).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_strided<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    max_len: usize,
    q: &DeviceArray,
    q_stride: usize,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
    block_table: &DeviceArray,
    seq_lens: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let hw = &client.properties().hardware;
    let plane_size = hw.plane_size_max as usize;
    let sms = hw.num_streaming_multiprocessors.unwrap_or(8) as usize;
    let smem = hw.max_shared_memory_size;
    shape.check(plane_size)?;
    if seqs == 0 {
        return Ok(());
    }
    let qn = seqs * shape.n_heads * shape.head_dim;
    if q_stride < shape.n_heads * shape.head_dim
        || q.len < (seqs - 1) * q_stride + shape.n_heads * shape.head_dim
        || out.len < qn
        || block_table.len < seqs * shape.max_blocks
        || seq_lens.len < seqs
        || params.len < 1
    {
        return Err(KernelError::BadItem {
            item: 0,
            reason: "paged_decode_attention: buffer sizes do not match".into(),
        });
    }
    let sp = AttnSplit::choose(&shape, seqs, max_len, plane_size, sms, smem);
    let direct = sp.splits == 1;
    let row = shape.head_dim + 2;
    let part = if direct {
        None
    } else {
        Some(DeviceArray::empty::<R, f32>(client, qn / shape.head_dim * sp.splits * row))
    };
    let part_arg = part.as_ref().unwrap_or(out);
    let group = shape.n_heads / shape.n_kv_heads;
    // SAFETY: q/out/table/lens sizes checked above; table entries and lengths come from the
    // cache allocator, which keeps every referenced slot inside the pools; `part` holds
    // `splits` rows per (sequence, head).
    unsafe {
        paged_decode_split_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static((shape.n_kv_heads * group / sp.hg) as u32, seqs as u32, sp.splits as u32),
            CubeDim::new_1d((sp.planes * plane_size) as u32),
            q.arg(),
            k_pool.arg(),
            v_pool.arg(),
            block_table.arg(),
            seq_lens.arg(),
            params.arg(),
            out.arg(),
            part_arg.arg(),
            sp.chunk as u32,
            sp.splits as u32,
            shape.head_dim,
            shape.n_heads,
            shape.n_kv_heads,
            sp.hg,
            shape.block_size,
            shape.max_blocks,
            shape.window,
            plane_size,
            sp.planes,
            sp.unroll,
            q_stride,
            direct,
        );
        if let Some(part) = &part {
            paged_decode_combine_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(shape.n_heads as u32, seqs as u32, 1),
                CubeDim::new_1d(plane_size as u32),
                part.arg(),
                out.arg(),
                sp.splits as u32,
                shape.head_dim,
                shape.n_heads,
                plane_size,
            );
        }
    };
    Ok(())
}

/// CPU reference of [`paged_decode_attention`] on f32 pools (plain two-pass softmax).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_reference(
    shape: PagedAttnShape,
    scale: f32,
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    block_table: &[u32],
    seq_lens: &[u32],
) -> Vec<f32> {
    let (hq, d, w) = (shape.n_heads, shape.head_dim, shape.slot_width());
    let group = hq / shape.n_kv_heads;
    let mut out = vec![0f32; seq_lens.len() * hq * d];
    for (s, &len) in seq_lens.iter().enumerate() {
        let len = len as usize;
        let start = if shape.window > 0 { len.saturating_sub(shape.window) } else { 0 };
        let slot = |t: usize| {
            block_table[s * shape.max_blocks + t / shape.block_size] as usize * shape.block_size
                + t % shape.block_size
        };
        for h in 0..hq {
            let qh = &q[(s * hq + h) * d..][..d];
            let off = (h / group) * d;
            let scores: Vec<f32> = (start..len)
                .map(|t| {
                    let k = &k_pool[slot(t) * w + off..][..d];
                    scale * qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>()
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            let o = &mut out[(s * hq + h) * d..][..d];
            for (i, t) in (start..len).enumerate() {
                let v = &v_pool[slot(t) * w + off..][..d];
                for (oo, vv) in o.iter_mut().zip(v) {
                    *oo += e[i] / z * vv;
                }
            }
        }
    }
    out
}
