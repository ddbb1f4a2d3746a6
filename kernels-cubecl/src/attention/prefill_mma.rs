//! Prefill attention on the matrix units (flash-style): the query rows of a prompt chunk over
//! their sequence's paged f16 K/V, `Q·Kᵀ` and `P·V` as f16 `mma.sync` m16n8k16 with f32
//! accumulation and an online softmax between them, the same result as
//! [`super::prefill::paged_prefill_attention_kernel`] up to f16 rounding of `Q` and `P`.
//!
//! Why: the plain prefill kernel spends a plane reduction, an `exp` and two FMAs per head
//! dimension on every (query, key) pair on the ALUs; at thousands of tokens the quadratic
//! attention is a large part of a prompt's time. Here a cube's 64 (query token, head) rows
//! share each staged key tile and the products leave the ALUs.
//!
//! Layout: a cube serves one run of `64 / group` consecutive query tokens of one sequence and
//! one KV head; its row `m` is token `m / group`, query head `m % group` of the KV head's group
//! (GQA rows share the keys). Warp `w` owns rows `16 (w mod 4) .. + 16`: its `Q` fragments stay
//! in registers for the whole run; wide heads split the output's dimensions over two (256) or
//! four (512) warps per row block. At 256 each of them computes the block's scores; at 512 each
//! computes them over its quarter of the dimensions (a quarter of `Q` in registers) and the
//! four partial scores are summed through shared memory. Each tile of keys is gathered from
//! the paged pools into shared memory, K as `[key][dim]`, V transposed as `[dim][key]` (so
//! that both are read as the 32-bit `B` fragments of their MMAs), rows padded by 8 halves
//! against bank conflicts.
//! The scores' accumulators become the `A` fragments of `P·V` in registers (FlashAttention-2's
//! reuse), so scores touch shared memory only to be summed at head dim 512.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::f16;

use super::PagedAttnShape;
use crate::DeviceArray;

/// Two halves: one 32-bit register of an f16 MMA fragment.
type H2 = Vector<f16, Const<2>>;

/// Eight halves: one 16-byte load of a K or V row.
type H8 = Vector<f16, Const<8>>;

type Acc = Vector<f32, Const<2>>;

/// Warps per cube (16 query rows each).
const MMA_WARPS: usize = 4;

/// (query token, head) rows of one cube.
pub const MMA_ROWS: usize = 16 * MMA_WARPS;

/// How the kernel covers a head dimension.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadPlan {
    /// Warps per row block; each keeps `1 / split` of the output's dimensions.
    pub(crate) split: usize,
    /// Keys per staged tile.
    pub(crate) keys: usize,
    /// Whether each of a row block's warps computes the scores over its part of the
    /// dimensions only (partial scores summed through shared memory) rather than all of them.
    pub(crate) split_scores: bool,
}

impl HeadPlan {
    /// The kernel's cube: [`MMA_WARPS`] row blocks of `split` warps of 32 lanes.
    pub(crate) fn cube_dim(&self) -> CubeDim {
        CubeDim::new_1d((MMA_WARPS * self.split * 32) as u32)
    }
}

/// The [`HeadPlan`] of a head dimension. Registers: a lane holds `head_dim / 2` halves of `Q`
/// (`/ split` with split scores) and `head_dim / 2 / split` f32 of output, at most 64 each.
/// Shared memory: the K and V tiles, and at 512 the partial scores (56 KiB in all, past the
/// 48 KiB of static shared memory: CubeCL's CUDA launches opt into more).
pub(crate) fn head_plan(head_dim: usize) -> Option<HeadPlan> {
    let plan = |split, keys, split_scores| Some(HeadPlan { split, keys, split_scores });
    match head_dim {
        d if d.is_multiple_of(32) && d <= 128 => plan(1, 64, false),
        256 => plan(2, 32, false),
        512 => plan(4, 16, true),
        _ => None,
    }
}

/// Query tokens of one run of the matrix-unit kernel for `shape`, when it serves `shape` on a
/// device whose f16 `mma` it can use (`mma`): a head dimension that is a multiple of 32 up to
/// 128, 256 or 512, and a GQA group dividing [`MMA_ROWS`]; `None` otherwise.
pub fn prefill_mma_run_tokens(shape: &PagedAttnShape, mma: bool) -> Option<usize> {
    let group = shape.n_heads / shape.n_kv_heads.max(1);
    let fits = mma
        && head_plan(shape.head_dim).is_some()
        && group > 0
        && MMA_ROWS.is_multiple_of(group)
        && shape.n_heads.is_multiple_of(shape.n_kv_heads.max(1));
    fits.then_some(MMA_ROWS / group)
}

/// Prefill attention on the matrix units. Grid: `(n_kv_heads, runs)`; cube: [`MMA_WARPS`] ·
/// `split` planes of 32, tiles of `keys` keys, scores split or not ([`head_plan`]). Run `d` is
/// rows `runs[2d] .. runs[2d] + runs[2d + 1]` (at most `MMA_ROWS / group`) of one sequence at
/// consecutive positions (row `r` sees `seq_lens[r]` tokens). Writes `out[r, h, :]` for the
/// run's rows and the KV head's query heads `h`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn paged_prefill_mma_kernel(
    q: &Array<f32>,
    k_pool: &Array<H8>,
    v_pool: &Array<H8>,
    block_table: &Array<u32>,
    seq_lens: &Array<u32>,
    runs: &Array<u32>,
    params: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] head_dim: usize,
    #[comptime] n_heads: usize,
    #[comptime] n_kv_heads: usize,
    #[comptime] block_size: usize,
    #[comptime] max_blocks: usize,
    #[comptime] window: usize,
    #[comptime] q_stride: usize,
    #[comptime] split: usize,
    #[comptime] keys: usize,
    #[comptime] split_scores: bool,
) {
    let group = comptime![n_heads / n_kv_heads];
    let ksteps = comptime![head_dim / 16];
    // The 16-dimension steps of a warp's scores (its part of them with split scores).
    let qsteps = comptime![if split_scores { ksteps / split } else { ksteps }];
    // Partial scores of a warp: 2 accumulators per 8-key n-tile.
    let sparts = comptime![2 * keys / 8];
    // Output n-tiles of 8 dimensions per warp.
    let dtiles = comptime![head_dim / 8 / split];
    let ntiles = comptime![keys / 8];
    // Row strides of the staged tiles in 32-bit words (8 halves of padding).
    let k_stride = comptime![(head_dim + 8) / 2];
    let v_stride = comptime![(keys + 8) / 2];
    let parts = comptime![head_dim / 8];
    let kv_parts = comptime![n_kv_heads * head_dim / 8];
    let units = comptime![MMA_WARPS * split * 32];

    let kvh = CUBE_POS_X as usize;
    let d = CUBE_POS_Y as usize;
    let first = runs[2 * d] as usize;
    let count = runs[2 * d + 1] as usize;
    let lane = UNIT_POS_PLANE as usize;
    let w = (UNIT_POS as usize / 32usize) % MMA_WARPS;
    // The warp's part of the row block's dimensions, its first output n-tile and first
    // score step.
    let sp = UNIT_POS as usize / comptime![32 * MMA_WARPS];
    let d0 = sp * dtiles;
    let s0 = sp * comptime![if split_scores { ksteps / split } else { 0 }];
    let g = lane / 4usize;
    let t = lane % 4usize;
    let scale = params[0];
    let table = first * max_blocks;
    let def = MmaDefinition::<f16, f16, f32>::new(16usize, 8usize, 16usize);

    let mut ks = SharedMemory::<H2>::new(comptime![keys * (head_dim + 8) / 2]);
    let mut vt = SharedMemory::<H2>::new(comptime![head_dim * (keys + 8) / 2]);
    // Partial scores `[split][row block][part][lane]` (one word pair when unused).
    let mut sred =
        SharedMemory::<Acc>::new(comptime![if split_scores { split * MMA_WARPS * sparts * 32 } else { 1 }]);

    // The lane's two rows (g and g + 8 of the warp's 16): their token, query head, and the
    // keys they see `[lo, hi)`.
    let mut qrow = Array::<usize>::new(2usize);
    let mut lo = Array::<usize>::new(2usize);
    let mut hi = Array::<usize>::new(2usize);
    #[unroll]
    for e in 0..2usize {
        let m = 16usize * w + g + 8usize * e;
        let tok = min(m / group, count - 1usize);
        let row = first + tok;
        let h = kvh * group + m % group;
        qrow[e] = row * q_stride + h * head_dim;
        hi[e] = seq_lens[row] as usize;
        lo[e] = 0usize;
        if comptime![window > 0] {
            if hi[e] > window {
                lo[e] = hi[e] - window;
            }
        }
    }
    // Q fragments, scaled, for the warp's 16-dimension steps: [4s] row g dims 2t.., [4s + 1]
    // row g + 8, [4s + 2] row g dims 2t + 8.., [4s + 3] row g + 8.
    let mut qf = Array::<H2>::new(comptime![4 * qsteps]);
    #[unroll]
    for s in 0..qsteps {
        #[unroll]
        for i in 0..4usize {
            let base = qrow[i % 2usize] + 16usize * (s0 + s) + 2usize * t + 8usize * (i / 2usize);
            let mut v = H2::empty();
            v[0] = f16::cast_from(q[base] * scale);
            v[1] = f16::cast_from(q[base + 1usize] * scale);
            qf[4usize * s + i] = v;
        }
    }
    let mut o = Array::<Acc>::new(comptime![2 * head_dim / 8 / split]);
    #[unroll]
    for j in 0..dtiles {
        o[2usize * j] = Acc::empty().fill(0.0f32);
        o[2usize * j + 1usize] = Acc::empty().fill(0.0f32);
    }
    let mut mx = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    mx[0] = -1.0e30;
    mx[1] = -1.0e30;
    l[0] = 0.0;
    l[1] = 0.0;

    // The run's rows are consecutive positions: its first row starts the keys it sees, its
    // last row ends them.
    let len_first = seq_lens[first] as usize;
    let mut k_lo = 0usize;
    if comptime![window > 0] {
        if len_first > window {
            k_lo = len_first - window;
        }
    }
    let k_hi = seq_lens[first + count - 1usize] as usize;
    for t0 in range_stepped(k_lo, k_hi, keys) {
        // The previous tile's readers are done before it is overwritten.
        sync_cube();
        // K: 16-byte parts, consecutive units along a key row (coalesced).
        #[unroll]
        for it in 0..comptime![keys * head_dim / 8 / (MMA_WARPS * split * 32)] {
            let e = UNIT_POS as usize + it * units;
            let u = e / parts;
            let p = e % parts;
            let key = min(t0 + u, k_hi - 1usize);
            let slot = block_table[table + key / block_size] as usize * block_size + key % block_size;
            let v = k_pool[slot * kv_parts + kvh * parts + p];
            #[unroll]
            for i in 0..4usize {
                let mut h2 = H2::empty();
                h2[0] = v[2usize * i];
                h2[1] = v[2usize * i + 1usize];
                ks[u * k_stride + 4usize * p + i] = h2;
            }
        }
        // V transposed: a unit takes two consecutive keys of one 8-dimension part and writes
        // eight (key, key + 1) pairs down its dimensions; consecutive units along the keys.
        #[unroll]
        for it in 0..comptime![keys / 2 * head_dim / 8 / (MMA_WARPS * split * 32)] {
            let e = UNIT_POS as usize + it * units;
            let u2 = e % comptime![keys / 2];
            let p = e / comptime![keys / 2];
            let mut vv = Array::<H8>::new(2usize);
            #[unroll]
            for r in 0..2usize {
                let key = min(t0 + 2usize * u2 + r, k_hi - 1usize);
                let slot = block_table[table + key / block_size] as usize * block_size + key % block_size;
                vv[r] = v_pool[slot * kv_parts + kvh * parts + p];
            }
            #[unroll]
            for i in 0..8usize {
                let mut h2 = H2::empty();
                h2[0] = vv[0][i];
                h2[1] = vv[1][i];
                vt[(8usize * p + i) * v_stride + u2] = h2;
            }
        }
        sync_cube();

        // S = Q·Kᵀ over the tile (the warp's steps): n-tile j holds keys t0 + 8j .. t0 + 8j + 8.
        let mut sc = Array::<Acc>::new(sparts);
        #[unroll]
        for j in 0..ntiles {
            let mut c = Array::<Acc>::new(2usize);
            c[0] = Acc::empty().fill(0.0f32);
            c[1] = Acc::empty().fill(0.0f32);
            #[unroll]
            for s in 0..qsteps {
                let mut a = Array::<H2>::new(4usize);
                #[unroll]
                for i in 0..4usize {
                    a[i] = qf[4usize * s + i];
                }
                let mut b = Array::<H2>::new(2usize);
                let at = (8usize * j + g) * k_stride + 8usize * (s0 + s) + t;
                b[0] = ks[at];
                b[1] = ks[at + 4usize];
                def.execute_inplace(&a, &b, &mut c);
            }
            sc[2usize * j] = c[0];
            sc[2usize * j + 1usize] = c[1];
        }
        if comptime![split_scores] {
            // Sum the row block's partial scores (the next write to `sred` is two barriers
            // after these reads).
            let mine = (sp * MMA_WARPS + w) * sparts;
            #[unroll]
            for i in 0..sparts {
                sred[(mine + i) * 32usize + lane] = sc[i];
            }
            sync_cube();
            #[unroll]
            for i in 0..sparts {
                let mut v = Acc::empty().fill(0.0f32);
                #[unroll]
                for p in 0..split {
                    let x = sred[((p * MMA_WARPS + w) * sparts + i) * 32usize + lane];
                    v[0] += x[0];
                    v[1] += x[1];
                }
                sc[i] = v;
            }
        }

        // Online softmax per row (e = 0: row g, 1: row g + 8); a row's four lanes (t) share
        // its maximum through two XOR shuffles, each keeps a partial sum.
        #[unroll]
        for e in 0..2usize {
            let mut m_new = mx[e];
            #[unroll]
            for j in 0..ntiles {
                let mut v = sc[2usize * j + e];
                #[unroll]
                for c in 0..2usize {
                    let key = t0 + 8usize * j + 2usize * t + c;
                    v[c] = select(key >= lo[e] && key < hi[e], v[c], f32::new(-1.0e30));
                    m_new = max(m_new, v[c]);
                }
                sc[2usize * j + e] = v;
            }
            m_new = max(m_new, plane_shuffle_xor(m_new, 1u32));
            m_new = max(m_new, plane_shuffle_xor(m_new, 2u32));
            let corr = (mx[e] - m_new).exp();
            let mut le = l[e] * corr;
            #[unroll]
            for j in 0..dtiles {
                let mut v = o[2usize * j + e];
                v[0] *= corr;
                v[1] *= corr;
                o[2usize * j + e] = v;
            }
            #[unroll]
            for j in 0..ntiles {
                let mut v = sc[2usize * j + e];
                #[unroll]
                for c in 0..2usize {
                    let key = t0 + 8usize * j + 2usize * t + c;
                    // Keys the row does not see weigh 0, also before its first visible key
                    // (when the running maximum is still the initial one).
                    v[c] = select(key >= lo[e] && key < hi[e], (v[c] - m_new).exp(), f32::new(0.0));
                    le += v[c];
                }
                sc[2usize * j + e] = v;
            }
            l[e] = le;
            mx[e] = m_new;
        }

        // O += P·V: the 16 keys of step kk are score n-tiles 2kk and 2kk + 1.
        #[unroll]
        for kk in 0..comptime![keys / 16] {
            let mut a = Array::<H2>::new(4usize);
            #[unroll]
            for i in 0..4usize {
                let src = sc[4usize * kk + i];
                let mut h2 = H2::empty();
                h2[0] = f16::cast_from(src[0]);
                h2[1] = f16::cast_from(src[1]);
                a[i] = h2;
            }
            #[unroll]
            for j in 0..dtiles {
                let mut b = Array::<H2>::new(2usize);
                let at = (8usize * (d0 + j) + g) * v_stride + 8usize * kk + t;
                b[0] = vt[at];
                b[1] = vt[at + 4usize];
                let mut c = Array::<Acc>::new(2usize);
                c[0] = o[2usize * j];
                c[1] = o[2usize * j + 1usize];
                def.execute_inplace(&a, &b, &mut c);
                o[2usize * j] = c[0];
                o[2usize * j + 1usize] = c[1];
            }
        }
    }

    // Normalise by the row sums (the four lanes' partials) and store the run's rows.
    #[unroll]
    for e in 0..2usize {
        let mut le = l[e];
        le += plane_shuffle_xor(le, 1u32);
        le += plane_shuffle_xor(le, 2u32);
        let inv = 1.0f32 / select(le > 0.0, le, 1.0f32);
        let m = 16usize * w + g + 8usize * e;
        if m / group < count {
            let row = first + m / group;
            let h = kvh * group + m % group;
            let base = (row * n_heads + h) * head_dim + 8usize * d0 + 2usize * t;
            #[unroll]
            for j in 0..dtiles {
                let v = o[2usize * j + e];
                out[base + 8usize * j] = v[0] * inv;
                out[base + 8usize * j + 1usize] = v[1] * inv;
            }
        }
    }
}

/// Launches [`paged_prefill_mma_kernel`] (the caller has checked the buffers and that `shape`
/// passes [`prefill_mma_run_tokens`] with every run at most that long).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    runs: &DeviceArray,
    n_runs: usize,
    q: &DeviceArray,
    q_stride: usize,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
    block_table: &DeviceArray,
    seq_lens: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) {
    let plan = head_plan(shape.head_dim).expect("checked by prefill_mma_run_tokens");
    // SAFETY: the caller checked the buffer sizes; runs come from `prefill_runs` over the
    // step's rows; table entries and lengths come from the cache allocator, which keeps every
    // referenced slot inside the pools (f16, slots of `n_kv_heads · head_dim` halves, a
    // multiple of 8).
    unsafe {
        let pool = |a: &DeviceArray| ArrayArg::from_raw_parts(a.handle.clone(), a.len / 8);
        paged_prefill_mma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(shape.n_kv_heads as u32, n_runs as u32, 1),
            plan.cube_dim(),
            q.arg(),
            pool(k_pool),
            pool(v_pool),
            block_table.arg(),
            seq_lens.arg(),
            runs.arg(),
            params.arg(),
            out.arg(),
            shape.head_dim,
            shape.n_heads,
            shape.n_kv_heads,
            shape.block_size,
            shape.max_blocks,
            shape.window,
            q_stride,
            plan.split,
            plan.keys,
            plan.split_scores,
        )
    };
}
