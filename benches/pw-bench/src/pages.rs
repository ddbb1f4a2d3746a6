//! `pw-bench bench-pages`: the weight page table on the GPU.
//!
//! - `reload_gbps`: host→GPU reload bandwidth of pages through the table's mover (on CUDA the
//!   asynchronous pinned-copy `CudaMover`): a set of reload pages raised from 3 to 8 bits at one
//!   boundary, timed until the last one committed (bytes = planes 3..8 + the 8-bit LUTs).
//! - `pinned_copy_gbps` (CUDA): a plain cudarc copy from a pinned host buffer into the raw
//!   pointer of a CubeCL buffer on a stream of its own, the ceiling of the mover.
//! - `step_ms_idle` / `step_ms_reloading`: one decode step's expert work of a Mixtral-8x7B-shaped
//!   model (per layer the grouped gate_up and down launches over every expert's tokens, all
//!   layers, batch 8 top-2, random weights at `--bits`), median over steps, without and with
//!   reload pages cycling 3 → 8 → 3 bits in the background (raisings copied while the steps run,
//!   committed and lowered again at the boundaries between steps). The reload pages are pages of
//!   the same table and arenas but of an extra layer the step does not read, so the step's
//!   bytes are the same in both runs and any difference is interference.
//!
//! Timing is wall clock around each step's launches and the `sync` ending it (CubeCL 0.10 has no
//! events on its stream); the boundary's own time is reported apart (`boundary_ms`).

use anyhow::{Context, Result, bail};
use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{Activation, DeviceArray, GemmConfig, WorkItem, ap_gemm, sync, upload_items};
use pw_format::{ApBlock, BlockKind};
use pw_pages::{Accountant, Group, Mover, PageId, PageKey, PagedWeights};
use rayon::prelude::*;
use serde_json::{Value, json};
use std::time::Instant;

/// Options of `bench-pages`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchPagesArgs {
    /// Runtime: cuda or wgpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Output JSON file.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Decoder layers of the step.
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// Experts per layer.
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    /// Model width.
    #[arg(long, default_value_t = 4096)]
    pub hidden: usize,
    /// Expert intermediate size.
    #[arg(long, default_value_t = 14336)]
    pub intermediate: usize,
    /// Decode tokens of the step.
    #[arg(long, default_value_t = 8)]
    pub tokens: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Committed bits of the step's pages.
    #[arg(long, default_value_t = 4)]
    pub bits: u8,
    /// Reload pages (gate_up-shaped) cycling 3 ↔ 8 bits in the background.
    #[arg(long, default_value_t = 16)]
    pub reload_pages: usize,
    /// Timed steps per phase.
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Bytes of the plain pinned copy (CUDA).
    #[arg(long, default_value_t = 1 << 30)]
    pub copy_bytes: usize,
}

/// Runs the benchmark and writes the JSON.
pub fn bench_pages(a: &BenchPagesArgs) -> Result<()> {
    if a.bits < 3 || a.bits > 8 || a.tokens == 0 || a.top_k == 0 || a.top_k > a.experts || a.layers == 0 {
        bail!("bench-pages: need 3 <= --bits <= 8, --tokens > 0, 0 < --top-k <= --experts, --layers > 0");
    }
    let result = match a.device.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => cuda::run(a)?,
        #[cfg(not(feature = "cuda"))]
        "cuda" => bail!("--device cuda: this binary was built without CUDA; rebuild with `--features cuda`"),
        "wgpu" => {
            let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::DefaultDevice);
            let (plane_cap, lut_cap) = arena(a);
            let pool = pw_pages::CubePool::new(client.clone(), plane_cap, lut_cap);
            let table = PagedWeights::new(blocks(a), Accountant::new(u64::MAX / 2), pool)?;
            let mut r = run(a, &client, table, |m| (m.planes(), m.luts()))?;
            r["pinned_copy_gbps"] = Value::Null;
            r
        }
        d => bail!("--device {d}: expected cuda or wgpu"),
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&result)?)
        .with_context(|| format!("{}", a.out.display()))?;
    eprintln!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// A block with pseudo-random planes and ascending LUTs (speed only; values are irrelevant).
fn random_block(rows: usize, cols: usize, max_bits: u8, seed: u64) -> ApBlock {
    let words = cols.div_ceil(32);
    let n = max_bits as usize * rows * words;
    let mut planes = vec![0u32; n];
    planes.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
        let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (c as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        for w in chunk {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            *w = z as u32;
        }
    });
    let luts = (3..=max_bits)
        .map(|b| {
            let k = 1usize << b;
            (0..rows * k).map(|i| f16::from_f32(((i % k) as f32 / k as f32 - 0.5) * 0.02)).collect()
        })
        .collect();
    ApBlock { rows, cols, min_bits: 3, max_bits, planes, luts, sensitivity: vec![0.0; max_bits as usize - 2] }
}

/// The step's pages (layers `0..layers`, parents of `--bits` planes: the step never raises
/// them) and the reload pages (layer `layers`, 8-bit parents).
fn blocks(a: &BenchPagesArgs) -> Vec<(String, PageKey, ApBlock)> {
    let (h, i) = (a.hidden, a.intermediate);
    let mut out = Vec::new();
    for layer in 0..a.layers {
        for e in 0..a.experts {
            for (kind, r, c) in [(BlockKind::GateUp, 2 * i, h), (BlockKind::Down, h, i)] {
                let seed = ((out.len() as u64) << 1) | 1;
                out.push((
                    format!("{layer}.{e}.{kind:?}"),
                    PageKey { layer, expert: e, kind },
                    random_block(r, c, a.bits, seed),
                ));
            }
        }
    }
    for e in 0..a.reload_pages {
        let key = PageKey { layer: a.layers, expert: e, kind: BlockKind::GateUp };
        out.push((format!("reload.{e}"), key, random_block(2 * i, h, 8, ((out.len() as u64) << 1) | 1)));
    }
    out
}

/// Arena sizes: the step's pages at `--bits`, the reload pages at 8 bits with the 3-bit LUTs
/// beside their 8-bit ones.
fn arena(a: &BenchPagesArgs) -> (usize, usize) {
    let (h, i) = (a.hidden, a.intermediate);
    let (wg, wd) = (h.div_ceil(32), i.div_ceil(32));
    let b = a.bits as usize;
    let step_planes = a.layers * a.experts * b * (2 * i * wg + h * wd);
    let step_luts = (a.layers * a.experts * (2 * i + h)) << b;
    // One spare 8-bit page: a raising that cannot grow in place copies all its planes anew.
    let reload_planes = (a.reload_pages + 1) * 8 * 2 * i * wg;
    let reload_luts = a.reload_pages * 2 * i * ((1 << 8) + (1 << 3));
    (step_planes + reload_planes, step_luts + reload_luts)
}

/// Bytes a 3 → 8 raising of one reload page copies: planes 3..8 and the 8-bit LUT.
fn raise_bytes(a: &BenchPagesArgs) -> usize {
    let rows = 2 * a.intermediate;
    5 * rows * a.hidden.div_ceil(32) * 4 + rows * 256 * 2
}

/// Settles the table: boundaries until every page of `ids` is at its desired bits. Raisings
/// deferred for space are retried while others commit (freeing the extents they replace).
fn settle<M: Mover>(t: &mut PagedWeights<M>, ids: &[PageId]) -> Result<()> {
    loop {
        let r = t.boundary()?;
        let mut done = true;
        let mut in_flight = false;
        for &id in ids {
            let i = t.info(id)?;
            done &= i.committed == i.desired;
            in_flight |= i.raising_to.is_some();
        }
        if done {
            return Ok(());
        }
        let progress = !(r.started.is_empty()
            && r.raised.is_empty()
            && r.relocating.is_empty()
            && r.relocated.is_empty());
        if !progress && !in_flight {
            let d = r
                .deferred
                .first()
                .map(|d| format!("page {:?} cannot reach {} bits: {}", d.page, d.target, d.reason));
            bail!("the page table is stuck: {}", d.unwrap_or_default());
        }
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
}

/// The benchmark over a table on runtime `R`; `arenas` gives the mover's device arenas.
fn run<R: Runtime, M: Mover>(
    a: &BenchPagesArgs,
    client: &ComputeClient<R>,
    mut table: PagedWeights<M>,
    arenas: impl Fn(&M) -> (&DeviceArray, &DeviceArray),
) -> Result<Value> {
    let (h, i) = (a.hidden, a.intermediate);
    let reload: Vec<PageId> = (0..a.reload_pages)
        .map(|e| table.page(PageKey { layer: a.layers, expert: e, kind: BlockKind::GateUp }))
        .collect::<Result<_, _>>()?;
    let step_ids: Vec<PageId> = table.ids().filter(|id| !reload.contains(id)).collect();
    // Load: the step's pages at --bits, the reload pages at 3.
    let t0 = Instant::now();
    for &id in &step_ids {
        table.set_desired(id, a.bits)?;
    }
    for &id in &reload {
        table.set_desired(id, 3)?;
    }
    let all: Vec<PageId> = table.ids().collect();
    settle(&mut table, &all)?;
    sync(client)?;
    let load_s = t0.elapsed().as_secs_f64();
    let resident = table.usage().weights;
    eprintln!("loaded {:.2} GB of pages in {load_s:.2} s", resident as f64 / 1e9);

    // Reload bandwidth, idle: every reload page 3 → 8 at one boundary, until all committed.
    let mut reload_gbps = Vec::new();
    for _ in 0..3 {
        for &id in &reload {
            table.set_desired(id, 8)?;
        }
        let t = Instant::now();
        settle(&mut table, &reload)?;
        let secs = t.elapsed().as_secs_f64();
        reload_gbps.push((a.reload_pages * raise_bytes(a)) as f64 / secs / 1e9);
        for &id in &reload {
            table.set_desired(id, 3)?;
        }
        settle(&mut table, &reload)?;
        sync(client)?;
    }
    reload_gbps.sort_by(f64::total_cmp);
    let reload_gbps_median = reload_gbps[reload_gbps.len() / 2];
    eprintln!("reload: {reload_gbps:?} GB/s");

    // The step: token t goes to experts (t + j) mod E for j < top_k; rows grouped by expert.
    let rows = a.tokens * a.top_k;
    let mut per_expert = vec![0u32; a.experts];
    for t in 0..a.tokens {
        for j in 0..a.top_k {
            per_expert[(t + j) % a.experts] += 1;
        }
    }
    let (mut gu_groups, mut dn_groups, mut row) = (Vec::new(), Vec::new(), 0u32);
    for (e, &n) in per_expert.iter().enumerate() {
        let mut left = n;
        while left > 0 {
            let m = left.min(kernels_cubecl::MAX_TOKENS as u32);
            gu_groups.push(Group { expert: e, x_off: row * h as u32, y_off: row * 2 * i as u32, tokens: m });
            dn_groups.push(Group { expert: e, x_off: row * 2 * i as u32, y_off: row * h as u32, tokens: m });
            row += m;
            left -= m;
        }
    }
    // Descriptors change only at commits, and the step's pages never change here.
    let mut layers: Vec<[(Vec<WorkItem>, DeviceArray); 2]> = Vec::new();
    for l in 0..a.layers {
        let gu = table.items(l, BlockKind::GateUp, &gu_groups)?;
        let dn = table.items(l, BlockKind::Down, &dn_groups)?;
        let (dg, dd) = (upload_items(client, &gu), upload_items(client, &dn));
        layers.push([(gu, dg), (dn, dd)]);
    }
    let x = DeviceArray::from_slice(client, &vec![0.01f32; rows * h]);
    let hid = DeviceArray::empty::<R, f32>(client, rows * 2 * i);
    let y = DeviceArray::empty::<R, f32>(client, rows * h);
    let cfg = GemmConfig::for_client(client);
    let step = |table: &PagedWeights<M>| -> Result<f64> {
        let (planes, luts) = arenas(table.mover());
        let t = Instant::now();
        for [(gu, dg), (dn, dd)] in &layers {
            ap_gemm(client, cfg, planes, luts, gu, dg, &x, &hid, Activation::None)?;
            ap_gemm(client, cfg, planes, luts, dn, dd, &hid, &y, Activation::SiluMul)?;
        }
        sync(client)?;
        Ok(t.elapsed().as_secs_f64())
    };
    for _ in 0..3 {
        step(&table)?;
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let idle: Vec<f64> = (0..a.steps).map(|_| step(&table)).collect::<Result<_>>()?;

    // With reloads: at every boundary, committed 8-bit reload pages go back to 3 (at once) and
    // the 3-bit ones start raising again (copies overlap the next steps).
    let (mut busy, mut boundary_s, mut raised) = (Vec::new(), Vec::new(), 0usize);
    let t_all = Instant::now();
    let mut in_flight_steps = 0;
    for _ in 0..a.steps {
        let t = Instant::now();
        for &id in &reload {
            let info = table.info(id)?;
            if info.raising_to.is_none() {
                table.set_desired(id, if info.committed == 8 { 3 } else { 8 })?;
            }
        }
        let r = table.boundary()?;
        raised += r.raised.iter().filter(|p| reload.contains(p)).count();
        boundary_s.push(t.elapsed().as_secs_f64());
        if reload.iter().any(|&id| table.info(id).is_ok_and(|i| i.raising_to.is_some())) {
            in_flight_steps += 1;
        }
        busy.push(step(&table)?);
    }
    let reload_secs = t_all.elapsed().as_secs_f64();
    let (hbm_words, read_bytes) = (
        (256usize << 20).min(resident as usize / 4).max(1 << 20),
        a.layers * a.experts * a.bits as usize * (2 * i * h.div_ceil(32) + h * i.div_ceil(32)) * 4,
    );
    let hbm_gbps = (hbm_words * 4) as f64 / crate::kernels::stream_read_secs(client, hbm_words)? / 1e9;
    let (idle_ms, busy_ms) = (median(idle) * 1e3, median(busy) * 1e3);
    table.audit().map_err(anyhow::Error::msg)?;
    Ok(json!({
        "reload_gbps": reload_gbps_median,
        "reload_gbps_runs": reload_gbps,
        "pinned_copy_gbps": Value::Null,
        "step_ms_idle": idle_ms,
        "step_ms_reloading": busy_ms,
        "step_slowdown": busy_ms / idle_ms - 1.0,
        "boundary_ms_median": median(boundary_s) * 1e3,
        "steps_with_reload_in_flight": in_flight_steps,
        "steps": a.steps,
        "reload_commits_during_steps": raised,
        "reload_gbps_during_steps": (raised * raise_bytes(a)) as f64 / reload_secs / 1e9,
        "step_weight_bytes": read_bytes,
        "step_effective_gbps": read_bytes as f64 / (idle_ms / 1e3) / 1e9,
        "hbm_read_gbps": hbm_gbps,
        "resident_weight_bytes": resident,
        "load_s": load_s,
        "shape": {"layers": a.layers, "experts": a.experts, "hidden": h, "intermediate": i,
                  "tokens": a.tokens, "top_k": a.top_k, "bits": a.bits, "reload_pages": a.reload_pages},
        "device": a.device,
    }))
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cudarc::driver::result as cu;

    fn err(what: &str, e: cu::DriverError) -> anyhow::Error {
        anyhow::anyhow!("CUDA {what}: {e:?}")
    }

    /// A plain pinned copy into a CubeCL buffer's raw pointer on a stream of its own.
    fn pinned_copy_gbps(client: &ComputeClient<CudaRuntime>, bytes: usize) -> Result<f64> {
        let buf = client.empty(bytes);
        sync(client)?;
        let res = client.get_resource(buf.clone()).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let dst = res.resource().ptr;
        cu::init().map_err(|e| err("init", e))?;
        let dev = cu::device::get(0).map_err(|e| err("device", e))?;
        // SAFETY: CubeCL uses the primary context of device 0 too.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| err("context", e))?;
        // SAFETY: just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| err("set context", e))?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| err("stream", e))?;
        // SAFETY: plain allocation, freed below.
        let host = unsafe { cu::malloc_host(bytes, 0) }.map_err(|e| err("pinned alloc", e))? as *mut u8;
        // SAFETY: `host` holds `bytes` bytes.
        let src = unsafe {
            std::ptr::write_bytes(host, 7, bytes);
            std::slice::from_raw_parts(host, bytes)
        };
        let mut v = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            // SAFETY: `dst` is a live buffer of `bytes` bytes (its handle and resource are held),
            // `src` is pinned and untouched until the stream is synchronised.
            unsafe {
                cu::memcpy_htod_async(dst, src, stream).map_err(|e| err("copy", e))?;
                cu::stream::synchronize(stream).map_err(|e| err("sync", e))?;
            }
            v.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        // SAFETY: the copies finished; nothing references these any more.
        unsafe {
            let _ = cu::free_host(host as *mut std::ffi::c_void);
            let _ = cu::stream::destroy(stream);
        }
        drop(res);
        v.sort_by(f64::total_cmp);
        eprintln!("pinned copy: {v:?} GB/s");
        Ok(v[v.len() / 2])
    }

    pub(super) fn run(a: &BenchPagesArgs) -> Result<Value> {
        let client = CudaRuntime::client(&CudaDevice::new(0));
        let pinned = pinned_copy_gbps(&client, a.copy_bytes)?;
        let (plane_cap, lut_cap) = arena(a);
        let mover = pw_pages::CudaMover::new(client.clone(), 0, plane_cap, lut_cap)?;
        let t = Instant::now();
        let table = PagedWeights::new(blocks(a), Accountant::new(u64::MAX / 2), mover)?;
        eprintln!("built the table (host parents pinned) in {:.1} s", t.elapsed().as_secs_f64());
        let mut r = super::run(a, &client, table, |m| (m.pool().planes(), m.pool().luts()))?;
        r["pinned_copy_gbps"] = json!(pinned);
        Ok(r)
    }
}
