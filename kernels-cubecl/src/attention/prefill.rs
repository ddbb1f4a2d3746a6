//! Prefill attention: the query tokens of a prompt chunk over their sequence's paged K/V, the
//! cache read once per block of queries rather than once per query.
//!
//! A step's rows come in runs: consecutive rows of one sequence at consecutive positions (a
//! prompt chunk), each at most [`PREFILL_RUN_ROWS`] long ([`prefill_runs`]). A cube serves one
//! run and one KV head: it walks the keys the run sees in tiles staged in shared memory, and
//! every query row of the run, for every query head of the KV head's group, reads each staged
//! key once (causal: row `r` sees keys below its length; with a window only the last `window`).
//! Its planes (warps) own the (query, head) rows in turn, lane `l` the head dimensions
//! `l, l + P, …`, with an online softmax per row as in the decode kernel. Runs of more rows
//! than the cube holds at once go in sub-blocks. On devices with f16 `mma` and an f16 cache,
//! [`super::prefill_mma`] does the same on the matrix units.

use std::any::TypeId;

use cubecl::prelude::*;

use super::PagedAttnShape;
use super::prefill_mma::{self, prefill_mma_run_tokens};
use crate::expert_gemm::grouped::grouped_mma_supported;
use crate::plane::warp_sum;
use crate::{DeviceArray, KernelError};

/// Rows per run (one cube) of the plain kernel.
pub const PREFILL_RUN_ROWS: usize = 16;

/// Which kernel runs a prefill attention launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// The matrix-unit kernel where it applies ([`prefill_run_rows`]), else the plain one.
    Auto,
    /// The plain kernel ([`paged_prefill_attention_kernel`]).
    Plain,
    /// The matrix-unit kernel ([`prefill_mma::paged_prefill_mma_kernel`]); an error where it
    /// does not apply.
    Mma,
}

/// Whether the matrix-unit kernel can run on `client` over a cache of `KV`: f16 `mma`
/// on planes of 32 and an f16 cache.
fn mma_ok<R: Runtime, KV: 'static>(client: &ComputeClient<R>) -> bool {
    TypeId::of::<KV>() == TypeId::of::<half::f16>() && grouped_mma_supported(client)
}

/// Rows per run that [`paged_prefill_attention`] serves best for `shape` on `client` over a
/// cache of `KV`: the matrix-unit kernel's run (64 query rows over the GQA group) where it
/// applies, else [`PREFILL_RUN_ROWS`]. Any run length is correct with either kernel.
pub fn prefill_run_rows<R: Runtime, KV: 'static>(client: &ComputeClient<R>, shape: &PagedAttnShape) -> usize {
    prefill_mma_run_tokens(shape, mma_ok::<R, KV>(client)).unwrap_or(PREFILL_RUN_ROWS)
}

/// Planes per cube.
const PREFILL_PLANES: usize = 8;

/// `[first row, rows]` of each run of `seqs` (a step's rows, by sequence): consecutive equal
/// entries, cut every `max_rows` rows (at least one).
pub fn prefill_runs<T: PartialEq>(seqs: &[T], max_rows: usize) -> Vec<u32> {
    let max_rows = max_rows.max(1);
    let mut runs = Vec::new();
    let mut i = 0;
    while i < seqs.len() {
        let mut j = i + 1;
        while j < seqs.len() && j - i < max_rows && seqs[j] == seqs[i] {
            j += 1;
        }
        runs.extend([i as u32, (j - i) as u32]);
        i = j;
    }
    runs
}

/// How a cube splits its work for `shape` on planes of `plane_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PrefillPlan {
    /// Query rows per sub-block.
    qb: usize,
    /// (query, head) rows each plane owns.
    rows_per_plane: usize,
    /// Keys per staged tile.
    tile: usize,
}

impl PrefillPlan {
    fn new(shape: &PagedAttnShape, plane_size: usize) -> Self {
        let per = shape.head_dim / plane_size;
        let group = shape.n_heads / shape.n_kv_heads;
        // About 32 registers of query and of accumulator per lane.
        let cap = (32 / per).max(1);
        let qb = (cap * PREFILL_PLANES / group).clamp(1, PREFILL_RUN_ROWS);
        let rows_per_plane = (qb * group).div_ceil(PREFILL_PLANES);
        // K and V tiles in 16 KiB of shared memory (f32).
        let tile = (2048 / shape.head_dim).clamp(1, 32);
        Self { qb, rows_per_plane, tile }
    }
}

/// Prefill attention. Grid: `(n_kv_heads, runs)`; cube: [`PREFILL_PLANES`] planes. Run `d` is
/// rows `runs[2d] .. runs[2d] + runs[2d + 1]` of one sequence at consecutive positions (row
/// `r` sees `seq_lens[r]` tokens). Writes `out[r, h, :]` for the run's rows and the KV head's
/// query heads `h`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn paged_prefill_attention_kernel<KV: Float>(
    q: &Array<f32>,
    k_pool: &Array<KV>,
    v_pool: &Array<KV>,
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
    #[comptime] plane_size: usize,
    #[comptime] qb: usize,
    #[comptime] rows_per_plane: usize,
    #[comptime] tile: usize,
    #[comptime] q_stride: usize,
) {
    let per = comptime![head_dim / plane_size];
    let group = comptime![n_heads / n_kv_heads];
    let kv_width = comptime![n_kv_heads * head_dim];
    let units = comptime![PREFILL_PLANES * plane_size];
    let kvh = CUBE_POS_X as usize;
    let d = CUBE_POS_Y as usize;
    let first = runs[2 * d] as usize;
    let count = runs[2 * d + 1] as usize;
    let lane = UNIT_POS as usize % plane_size;
    let w = UNIT_POS as usize / plane_size;
    let scale = params[0];
    let table = first * max_blocks;
    let mut ks = SharedMemory::<f32>::new(comptime![tile * head_dim]);
    let mut vs = SharedMemory::<f32>::new(comptime![tile * head_dim]);
    for b0 in range_stepped(0usize, count, qb) {
        let nb = min(qb, count - b0);
        // The sub-block's rows are consecutive positions: its first row starts the keys it
        // sees, its last row ends them.
        let len_first = seq_lens[first + b0] as usize;
        let mut k_lo = 0usize;
        if comptime![window > 0] {
            if len_first > window {
                k_lo = len_first - window;
            }
        }
        let k_hi = seq_lens[first + b0 + nb - 1] as usize;
        // This plane's rows: r = w + PREFILL_PLANES · i ↔ query r / group, head r mod group.
        let mut qv = Array::<f32>::new(comptime![rows_per_plane * per]);
        let mut acc = Array::<f32>::new(comptime![rows_per_plane * per]);
        let mut m = Array::<f32>::new(rows_per_plane);
        let mut l = Array::<f32>::new(rows_per_plane);
        let mut lo = Array::<usize>::new(rows_per_plane);
        let mut hi = Array::<usize>::new(rows_per_plane);
        #[unroll]
        for i in 0..rows_per_plane {
            let r = w + comptime![PREFILL_PLANES * i];
            let row = first + b0 + min(r / group, nb - 1);
            let h = kvh * group + r % group;
            #[unroll]
            for j in 0..per {
                qv[i * per + j] = q[row * q_stride + h * head_dim + lane + j * plane_size] * scale;
                acc[i * per + j] = 0.0;
            }
            m[i] = -1.0e30;
            l[i] = 0.0;
            hi[i] = seq_lens[row] as usize;
            lo[i] = 0usize;
            if comptime![window > 0] {
                if hi[i] > window {
                    lo[i] = hi[i] - window;
                }
            }
        }
        for t0 in range_stepped(k_lo, k_hi, tile) {
            // The previous tile's readers are done before it is overwritten.
            sync_cube();
            for e in range_stepped(UNIT_POS as usize, comptime![tile * head_dim], units) {
                let t = min(t0 + e / head_dim, k_hi - 1);
                let blk = block_table[table + t / block_size] as usize;
                let at = (blk * block_size + t % block_size) * kv_width + kvh * head_dim + e % head_dim;
                ks[e] = f32::cast_from(k_pool[at]);
                vs[e] = f32::cast_from(v_pool[at]);
            }
            sync_cube();
            #[unroll]
            for i in 0..rows_per_plane {
                let mut sc = Array::<f32>::new(tile);
                let mut m_new = m[i];
                #[unroll]
                for u in 0..tile {
                    let mut dot = 0.0f32;
                    #[unroll]
                    for j in 0..per {
                        dot += qv[i * per + j] * ks[u * head_dim + lane + j * plane_size];
                    }
                    let t = t0 + u;
                    let s = select(t >= lo[i] && t < hi[i], warp_sum(dot, plane_size), f32::new(-1.0e30));
                    sc[u] = s;
                    m_new = max(m_new, s);
                }
                let corr = (m[i] - m_new).exp();
                let mut li = l[i] * corr;
                #[unroll]
                for j in 0..per {
                    acc[i * per + j] *= corr;
                }
                #[unroll]
                for u in 0..tile {
                    let t = t0 + u;
                    // Keys the row does not see weigh 0, also before its first visible key
                    // (when the running maximum is still the initial one).
                    let p = select(t >= lo[i] && t < hi[i], (sc[u] - m_new).exp(), f32::new(0.0));
                    li += p;
                    #[unroll]
                    for j in 0..per {
                        acc[i * per + j] += p * vs[u * head_dim + lane + j * plane_size];
                    }
                }
                l[i] = li;
                m[i] = m_new;
            }
        }
        #[unroll]
        for i in 0..rows_per_plane {
            let r = w + comptime![PREFILL_PLANES * i];
            if r < comptime![qb * group] && r / group < nb {
                let row = first + b0 + r / group;
                let h = kvh * group + r % group;
                let inv = 1.0f32 / select(l[i] > 0.0, l[i], 1.0f32);
                #[unroll]
                for j in 0..per {
                    out[(row * n_heads + h) * head_dim + lane + j * plane_size] = acc[i * per + j] * inv;
                }
            }
        }
    }
}

/// Prefill attention of a step's `rows` query rows (query of row `r` at `r · q_stride`) in the
/// runs of `runs` (`[first row, rows]` per run, [`prefill_runs`]; every row in one run, none
/// longer than `longest`) over their paged K/V into `out`, on the kernel `kernel` picks.
/// `params` holds `[scale]`. Does not synchronise.
///
/// # Shapes
/// - `q`: `[rows, q_stride]`; `out`: `[rows, n_heads · head_dim]`; `block_table`: `[rows,
///   max_blocks]`; `seq_lens`: `[rows]`; `runs`: `[n_runs, 2]`
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_attention<R: Runtime, KV: Float + CubeElement + 'static>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    kernel: PrefillKernel,
    rows: usize,
    runs: &DeviceArray,
    n_runs: usize,
    longest: usize,
    q: &DeviceArray,
    q_stride: usize,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
    block_table: &DeviceArray,
    seq_lens: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let plane_size = client.properties().hardware.plane_size_max as usize;
    shape.check(plane_size)?;
    if rows == 0 || n_runs == 0 {
        return Ok(());
    }
    let width = shape.n_heads * shape.head_dim;
    if q_stride < width
        || q.len < (rows - 1) * q_stride + width
        || out.len < rows * width
        || block_table.len < rows * shape.max_blocks
        || seq_lens.len < rows
        || runs.len < 2 * n_runs
        || params.len < 1
    {
        return Err(KernelError::BadItem {
            item: 0,
            reason: "paged_prefill_attention: buffer sizes do not match".into(),
        });
    }
    let mma_rows = prefill_mma_run_tokens(&shape, mma_ok::<R, KV>(client)).filter(|&n| longest <= n);
    match (kernel, mma_rows) {
        (PrefillKernel::Auto | PrefillKernel::Mma, Some(_)) => {
            prefill_mma::launch(
                client,
                shape,
                runs,
                n_runs,
                q,
                q_stride,
                k_pool,
                v_pool,
                block_table,
                seq_lens,
                params,
                out,
            );
            return Ok(());
        }
        (PrefillKernel::Mma, None) => {
            return Err(KernelError::BadItem {
                item: 0,
                reason: format!(
                    "paged_prefill_attention: the matrix-unit kernel does not serve {shape:?} with runs of \
                     {longest} rows on this device and cache type"
                ),
            });
        }
        _ => {}
    }
    let plan = PrefillPlan::new(&shape, plane_size);
    // SAFETY: buffer sizes checked above; runs come from `prefill_runs` over the step's rows
    // (inside `rows`, each at least one row); table entries and lengths come from the cache
    // allocator, which keeps every referenced slot inside the pools.
    unsafe {
        paged_prefill_attention_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static(shape.n_kv_heads as u32, n_runs as u32, 1),
            CubeDim::new_1d((PREFILL_PLANES * plane_size) as u32),
            q.arg(),
            k_pool.arg(),
            v_pool.arg(),
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
            plane_size,
            plan.qb,
            plan.rows_per_plane,
            plan.tile,
            q_stride,
        )
    };
    Ok(())
}
