//! `pw-bench bench-raise`: page raisings of the fast decode path on the device, through the
//! decoder's own mover (`pw_pages::device_mover`: on CUDA asynchronous pinned copies on a
//! stream of their own, elsewhere copies on the kernels' queue).
//!
//! - `check`: the model in `--check-model` (default the shipped one) loaded with every expert
//!   at 8 bits, and loaded at 3 bits and then raised to 8 through the mover, prefill the same
//!   prompt and decode the same greedy tokens; the two must agree exactly (same planes and
//!   LUTs in the arenas, same kernels), so `max_abs_logit_diff` is 0 and the tokens equal.
//! - speed: a full-size shape (`--model`, its first `--layers` layers) with random host
//!   parents, every page at 3 bits, `--batch` sequences at `--ctx` decoding greedy steps; then
//!   every page is asked for 8 bits and the steps go on while the boundaries between them commit
//!   the raisings. `raise_gbps` = device bytes added (planes 3..8 and the 8-bit LUTs, less the
//!   3-bit LUTs) / time from that boundary to the last commit; `step_ms_idle` and
//!   `step_ms_raising` are median step times (enqueue to ids read) before and meanwhile.

use anyhow::{Context, Result, bail, ensure};
use cubecl::prelude::*;
use pw_decode::{DecodeConfig, Decoder, ExpertBlocks};
use pw_hf::{Checkpoint, ModelConfig};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Options of `bench-raise`.
#[derive(clap::Args, Debug)]
pub struct BenchRaiseArgs {
    /// Runtime: cuda or wgpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Output JSON file.
    #[arg(long)]
    pub out: PathBuf,
    /// HF model directory of the exactness check.
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    pub check_model: PathBuf,
    /// Shape of the speed measurement (see `bench-decode --models`).
    #[arg(long, default_value = "qwen1.5-moe-a2.7b")]
    pub model: String,
    /// Decoder layers of the speed measurement (host parents take every page at 8 bits).
    #[arg(long, default_value_t = 24)]
    pub layers: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Context of each sequence (synthetic prefill).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Timed idle steps (and the most steps waited for the raisings: 64 times this).
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
}

/// Runs both parts and writes one JSON object.
pub fn bench_raise(a: &BenchRaiseArgs) -> Result<()> {
    ensure!(
        a.batch > 0 && a.steps > 0 && a.layers > 0,
        "bench-raise: --batch, --steps and --layers must be > 0"
    );
    let result = match a.device.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => run::<cubecl::cuda::CudaRuntime>(&cubecl::cuda::CudaDevice::new(0), a)?,
        #[cfg(not(feature = "cuda"))]
        "cuda" => bail!("--device cuda: this binary was built without CUDA; rebuild with `--features cuda`"),
        "wgpu" => run::<cubecl::wgpu::WgpuRuntime>(&cubecl::wgpu::WgpuDevice::DefaultDevice, a)?,
        d => bail!("--device {d}: expected cuda or wgpu"),
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&result)?)
        .with_context(|| format!("{}", a.out.display()))?;
    eprintln!("{}", serde_json::to_string(&result)?);
    let check = &result["check"];
    ensure!(
        check["tokens_equal"] == true && check["max_abs_logit_diff"] == 0.0,
        "bench-raise: the raised model differs from the one loaded at 8 bits: {check}"
    );
    Ok(())
}

fn run<R: Runtime>(device: &R::Device, a: &BenchRaiseArgs) -> Result<Value> {
    let client = R::client(device);
    let check = check::<R>(&client, &a.check_model)?;
    eprintln!("check: {check}");
    let speed = speed::<R>(&client, a)?;
    Ok(json!({ "check": check, "speed": speed }))
}

/// Prefill of a fixed prompt, then 16 greedy steps: every logit row and the tokens.
fn greedy<R: Runtime>(dec: &mut Decoder<R, half::f16>) -> Result<(Vec<Vec<f32>>, Vec<u32>)> {
    let vocab = dec.config().vocab as u32;
    let prompt: Vec<u32> = (0..24u32).map(|i| (7 + 13 * i) % vocab).collect();
    dec.add_sequence(0)?;
    let mut rows = dec.prefill(&[(0, &prompt)])?;
    let mut tokens = Vec::new();
    for _ in 0..16 {
        let last = rows.last().context("no logits")?;
        let t = (0..last.len()).max_by(|&i, &j| last[i].total_cmp(&last[j])).context("empty logits")? as u32;
        tokens.push(t);
        rows.extend(dec.step(&[(0, t)])?);
    }
    dec.free_sequence(0)?;
    Ok((rows, tokens))
}

fn check<R: Runtime>(client: &ComputeClient<R>, dir: &Path) -> Result<Value> {
    let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(dir)?)?;
    let ckpt = Checkpoint::open(dir)?;
    let experts = ExpertBlocks::quantize_hf(&ckpt, &cfg, 8)?;
    let (block, max_seq) = (16, 64);
    let kv_blocks = max_seq / block + 1;
    let load = |bits: u8| -> Result<Decoder<R, half::f16>> {
        let mut e = experts.clone();
        e.bits = e.blocks.iter().map(|l| vec![(bits, bits); l.len()]).collect();
        Ok(Decoder::builder(client)
            .kv_blocks(kv_blocks)
            .block_size(block)
            .max_seq_len(max_seq)
            .load(dir, e)?)
    };
    let mut at8 = load(8)?;
    let (want, want_tokens) = greedy(&mut at8)?;
    drop(at8);
    let mut raised = load(3)?;
    let before = raised.experts().bytes_by_bits();
    let t = Instant::now();
    raised.experts_mut().commit_now(&|_, _| 8)?;
    let raise_ms = t.elapsed().as_secs_f64() * 1e3;
    let after = raised.experts().bytes_by_bits();
    ensure!(
        before[8] == 0 && after[3] == 0 && after[8] > 0,
        "pages did not move 3 → 8: {before:?} → {after:?}"
    );
    let (got, got_tokens) = greedy(&mut raised)?;
    let diff =
        want.iter().flatten().zip(got.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    Ok(json!({
        "model": dir.display().to_string(), "pages_bytes_3bit": before[3], "pages_bytes_8bit": after[8],
        "raise_ms": raise_ms, "max_abs_logit_diff": diff, "tokens_equal": want_tokens == got_tokens,
        "tokens": got_tokens,
    }))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

fn speed<R: Runtime>(client: &ComputeClient<R>, a: &BenchRaiseArgs) -> Result<Value> {
    let mut cfg = crate::decode::shape(&a.model)?;
    let layers = a.layers.min(cfg.layers);
    cfg.layers = layers;
    cfg.sparse.truncate(layers);
    cfg.attn.truncate(layers);
    let block = 16;
    let max_seq = a.ctx + 64 * a.steps + a.steps + 8;
    let kv_blocks = a.batch * max_seq.div_ceil(block);
    let t = Instant::now();
    let mut dec = Decoder::<R, half::f16>::builder(client)
        .kv_blocks(kv_blocks)
        .block_size(block)
        .max_seq_len(max_seq)
        .synthetic_host(cfg, &|_, _| 3)?;
    let load_s = t.elapsed().as_secs_f64();
    eprintln!("{}: {layers} layers loaded at 3 bits in {load_s:.1} s", a.model);
    let ids: Vec<u64> = (0..a.batch as u64).collect();
    for &id in &ids {
        dec.add_sequence(id)?;
        dec.fill_synthetic(id, a.ctx)?;
    }
    let mut toks = vec![1u32; a.batch];
    let step = |dec: &mut Decoder<R, half::f16>, toks: &mut Vec<u32>| -> Result<f64> {
        let batch: Vec<(u64, u32)> = ids.iter().copied().zip(toks.iter().copied()).collect();
        let t0 = Instant::now();
        dec.enqueue_greedy(&batch)?;
        *toks = dec.read_greedy(batch.len())?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    for _ in 0..2 {
        step(&mut dec, &mut toks)?;
    }
    let mut idle: Vec<f64> = (0..a.steps).map(|_| step(&mut dec, &mut toks)).collect::<Result<_>>()?;
    let bytes3 = dec.experts().committed_bytes();
    let pages = dec.experts().pages().len();
    for p in 0..pages {
        dec.experts_mut().set_desired(p, 8)?;
    }
    let t0 = Instant::now();
    let mut boundary_ms = Vec::new();
    let mut raising = Vec::new();
    let mut started = 0;
    let mut raised = 0;
    while raised < pages {
        if raising.len() > 64 * a.steps {
            bail!("only {raised} of {pages} raisings committed after {} steps", raising.len());
        }
        let tb = Instant::now();
        let c = dec.experts_mut().boundary()?;
        boundary_ms.push(tb.elapsed().as_secs_f64() * 1e3);
        started += c.started;
        raised += c.raised;
        if raised < pages {
            raising.push(step(&mut dec, &mut toks)?);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes8 = dec.experts().committed_bytes();
    let mut after: Vec<f64> = (0..a.steps).map(|_| step(&mut dec, &mut toks)).collect::<Result<_>>()?;
    let steps_raising = raising.len();
    Ok(json!({
        "model": a.model, "layers": layers, "pages": pages, "batch": a.batch, "ctx": a.ctx,
        "load_s": load_s, "started": started, "raised": raised,
        "bytes_3bit": bytes3, "bytes_8bit": bytes8,
        "raise_s": secs, "raise_gbps": (bytes8 - bytes3) as f64 / secs / 1e9,
        "steps_while_raising": steps_raising,
        "step_ms_idle_3bit": median(&mut idle), "step_ms_raising": median(&mut raising),
        "step_ms_idle_8bit": median(&mut after),
        "boundary_ms_max": boundary_ms.iter().copied().fold(0f64, f64::max),
        "boundary_ms_median": median(&mut boundary_ms),
    }))
}
