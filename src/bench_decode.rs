//! `pagedweight bench-decode`: time of one fused decode step (`pw-decode`) of a full-size
//! Mixtral-8x7B-shaped model with synthetic weights, at several batch sizes, against the bytes
//! the step must read divided by the streaming read bandwidth measured in the same run.

use anyhow::{Context, Result};
use cubecl::prelude::*;
use kernels_cubecl::sync;
use pw_decode::{DecodeConfig, MixtralDecoder};
use serde_json::{Value, json};
use std::time::Instant;

/// Options of `bench-decode`.
#[derive(clap::Args, Debug)]
pub struct BenchDecodeArgs {
    /// Runtime: cuda or wgpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Output JSON file.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Model shape: mixtral-8x7b or tiny (the shipped model's shape, for a smoke test).
    #[arg(long, default_value = "mixtral-8x7b")]
    pub shape: String,
    /// Committed expert bit-width.
    #[arg(long, default_value_t = 4)]
    pub bits: u8,
    /// Batch sizes (sequences per step, at most 16).
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    pub batches: Vec<usize>,
    /// Context length each sequence reaches before timing.
    #[arg(long, default_value_t = 128)]
    pub ctx: usize,
    /// Timed steps per batch size.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
}

/// The synthetic shapes of the GPU benches.
pub(crate) fn shape(name: &str) -> Result<DecodeConfig> {
    let (vocab, hidden, inter, layers, heads, kv_heads, head_dim, theta) = match name {
        "mixtral-8x7b" => (32000, 4096, 14336, 32, 32, 8, 128, 1e6f64),
        "tiny" => (4096, 256, 256, 5, 8, 2, 32, 1e4),
        s => anyhow::bail!("--shape {s}: expected mixtral-8x7b or tiny"),
    };
    let inv_freq =
        (0..head_dim / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32).collect();
    Ok(DecodeConfig {
        vocab,
        hidden,
        inter,
        layers,
        heads,
        kv_heads,
        head_dim,
        experts: 8,
        top_k: 2,
        eps: 1e-5,
        window: 0,
        inv_freq,
    })
}

/// Runs the benchmark on the chosen runtime.
pub fn bench_decode(a: &BenchDecodeArgs) -> Result<()> {
    let records = match a.device.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => run::<cubecl::cuda::CudaRuntime>(&cubecl::cuda::CudaDevice::new(0), a)?,
        #[cfg(not(feature = "cuda"))]
        "cuda" => {
            anyhow::bail!("--device cuda: this binary was built without CUDA; rebuild with `--features cuda`")
        }
        "wgpu" => run::<cubecl::wgpu::WgpuRuntime>(&cubecl::wgpu::WgpuDevice::DefaultDevice, a)?,
        d => anyhow::bail!("--device {d}: expected cuda or wgpu"),
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&records)?)
        .with_context(|| format!("{}", a.out.display()))?;
    Ok(())
}

fn run<R: Runtime>(device: &R::Device, a: &BenchDecodeArgs) -> Result<Vec<Value>> {
    let client = R::client(device);
    let cfg = shape(&a.shape)?;
    let mut records = Vec::new();

    let words = if a.shape == "tiny" { 1 << 22 } else { 1 << 29 };
    let gbps = (words * 4) as f64 / crate::bench::stream_read_secs(&client, words)? / 1e9;

    let max_batch = a.batches.iter().copied().max().unwrap_or(1);
    let max_seq = a.ctx + a.steps + 16;
    let block = 16;
    let kv_blocks = max_batch * max_seq.div_ceil(block) + 4;
    let t = Instant::now();
    let mut dec =
        MixtralDecoder::<R, half::f16>::synthetic(&client, cfg.clone(), a.bits, kv_blocks, block, max_seq)?;
    sync(&client)?;
    eprintln!(
        "synthetic {} at {} bits: experts {:.2} GB, dense {:.2} GB, built in {:.1} s",
        a.shape,
        a.bits,
        dec.expert_bytes() as f64 / 1e9,
        dec.dense_bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let mut next_id = 0u64;
    for &b in &a.batches {
        let ids: Vec<u64> = (0..b as u64).map(|i| next_id + i).collect();
        next_id += b as u64;
        for &id in &ids {
            dec.add_sequence(id)?;
        }
        let mut tok = 1u32;
        let mut batch = |dec: &mut MixtralDecoder<R, half::f16>| -> Result<()> {
            let step: Vec<(u64, u32)> = ids.iter().map(|&id| (id, tok)).collect();
            let logits = dec.step(&step)?;
            tok = pw_models::generate::argmax(&logits[0]) % cfg.vocab as u32;
            Ok(())
        };
        for _ in 0..a.ctx {
            batch(&mut dec)?;
        }
        let t = Instant::now();
        for _ in 0..a.steps {
            batch(&mut dec)?;
        }
        let secs = t.elapsed().as_secs_f64() / a.steps as f64;
        for &id in &ids {
            dec.free_sequence(id)?;
        }
        // Bytes a step must read: every dense weight but the embedding (one row per token), the
        // pages of the experts the batch touches (expected count under uniform routing), and
        // the KV cache of every sequence.
        let (e, k) = (cfg.experts as f64, cfg.top_k as f64);
        let touched = e * (1.0 - (1.0 - k / e).powi(b as i32));
        let embed = cfg.vocab * cfg.hidden * 2;
        let dense = (dec.dense_bytes() - embed + b * cfg.hidden * 2) as f64;
        let experts = touched * dec.expert_page_bytes() as f64 * cfg.layers as f64;
        let ctx_mid = (a.ctx + a.steps / 2) as f64;
        let kv = (cfg.layers * b * 2 * cfg.kv_heads * cfg.head_dim * 2) as f64 * ctx_mid;
        let bytes = dense + experts + kv;
        let bound = bytes / (gbps * 1e9);
        let rec = json!({
            "bench": "decode_step", "shape": a.shape, "bits": a.bits, "batch": b, "ctx": a.ctx,
            "ms_per_step": secs * 1e3, "tokens_per_s": b as f64 / secs,
            "bytes_per_step": bytes, "dense_bytes": dense, "expert_bytes_touched": experts, "kv_bytes": kv,
            "experts_touched_per_layer": touched, "stream_gbps": gbps,
            "bound_ms": bound * 1e3, "fraction_of_bound": bound / secs,
            "effective_gbps": bytes / secs / 1e9,
        });
        eprintln!("{rec}");
        records.push(rec);
    }
    Ok(records)
}
