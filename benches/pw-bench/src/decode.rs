//! `pw-bench bench-decode`: one fused decode step (`pw-decode`) of full-size Mixtral-8x7B,
//! Qwen1.5-MoE-A2.7B and Gemma-4-26B-A4B shapes with synthetic weights, per batch size,
//! context length and committed expert bits, against the bytes the step must read divided by
//! the streaming read bandwidth measured in the same run.
//!
//! The context is a synthetic prefill: each sequence's block table gets `ctx` positions whose
//! K/V are the random values the pools were filled with, so only decode steps are timed.
//! Each timed step enqueues every launch (the host time), then waits for the greedy ids, the
//! only thing read back.

use anyhow::{Context, Result};
use cubecl::prelude::*;
use kernels_cubecl::{Activation, GemmConfig, GroupedMode, MmaMode, MmaTuning, ROUTE_CHUNK, sync};
use pw_decode::{AttnLayer, DecodeConfig, Decoder, ExpertAct, Family};
use pw_pages::Accountant;
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
    /// Model shapes (comma-separated): mixtral-8x7b, qwen1.5-moe-a2.7b, gemma-4-26b-a4b, or
    /// tiny-mixtral / tiny-qwen / tiny-gemma (small shapes for a smoke test).
    #[arg(long, value_delimiter = ',', default_value = "mixtral-8x7b,qwen1.5-moe-a2.7b,gemma-4-26b-a4b")]
    pub models: Vec<String>,
    /// Committed expert bits (comma-separated): 3..8, or `mix` (a deterministic mix of 3..8
    /// per page, as the planner leaves them).
    #[arg(long, value_delimiter = ',', default_value = "8,4,3,mix")]
    pub bits: Vec<String>,
    /// Batch sizes (sequences per step; above `--max-step-tokens` they run in chunks of it).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Context lengths each sequence has (synthetic prefill) when timing starts.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    pub ctx: Vec<usize>,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 8)]
    pub steps: usize,
    /// Untimed steps first (kernel compilation, caches).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Add the records to those already in `--out` (one process per model frees each model's
    /// device memory before the next).
    #[arg(long)]
    pub append: bool,
    /// Override the fewest routed items for which the expert GEMMs use the persistent GEMV
    /// kernel (`kernels_cubecl::GEMV_MIN_ITEMS`).
    #[arg(long)]
    pub gemv_min_items: Option<usize>,
    /// Keep the router GEMM a launch of its own even where the routing launch could compute
    /// the logits (Mixtral), to compare the two.
    #[arg(long)]
    pub router_gemm: bool,
    /// Override the plane words per lane of the expert GEMV (`GemmConfig::gemv_words_per_lane`).
    #[arg(long)]
    pub gemv_words: Option<usize>,
    /// Override the warps per cube of the expert kernels (`GemmConfig::warps`).
    #[arg(long)]
    pub warps: Option<usize>,
    /// Override the rows of one GEMV warp unit (`GemmConfig::gemv_rows`).
    #[arg(long)]
    pub gemv_rows: Option<usize>,
    /// Element type of the expert GEMV's staged `x` (comma-separated, each measured): `f32`
    /// (the default) or `f16` (`GemmConfig::gemv_x_half`).
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    pub gemv_x: Vec<String>,
    /// Resident warps per SM the expert GEMV's grid is sized for (comma-separated, each
    /// measured; default `GemmConfig::gemv_warps_per_sm`).
    #[arg(long, value_delimiter = ',')]
    pub gemv_warps_per_sm: Vec<usize>,
    /// The expert GEMV's plane words loaded a step ahead (comma-separated `off` / `on`, each
    /// measured; `GemmConfig::gemv_prefetch`).
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub gemv_prefetch: Vec<String>,
    /// Where the routed experts' activation is computed (comma-separated, each measured):
    /// `epilogue` (the gate_up GEMV's, the default) or `launch` (a launch of its own).
    #[arg(long, value_delimiter = ',', default_value = "epilogue")]
    pub expert_act: Vec<String>,
    /// Where the dense GEMMs run (comma-separated, each measured): `auto` (the default: the
    /// matrix units from `MMA_MIN_TOKENS` tokens where the device has them), `off` (the plain
    /// kernel), `auto-w` (as `auto`, columns split until the grid holds 32 warps per SM),
    /// `always` (the matrix units at every batch), `auto-skinny` (as `auto` without CubeK's
    /// matmul in large steps) or `auto-KIND` (as `auto`, large steps on CubeK's matmul of that
    /// kind: `MatmulKernel::name`).
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    pub dense_mma: Vec<String>,
    /// Most tokens per routed work item (comma-separated, each measured; default
    /// `ROUTE_CHUNK`, choices `ROUTE_CHUNK_CHOICES`): an expert with more tokens reads its
    /// weights once per item.
    #[arg(long, value_delimiter = ',')]
    pub route_chunk: Vec<usize>,
    /// Where the routed experts run (comma-separated, each measured): `auto` (the default: the
    /// grouped GEMM on the matrix units from `GROUPED_MIN_MEAN_TOKENS` tokens per expert),
    /// `off` (the routed GEMVs) or `always` (the grouped GEMM at every batch).
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    pub grouped: Vec<String>,
    /// Most tokens of one decoder step (default `pw_decode::DEFAULT_MAX_STEP_TOKENS`).
    #[arg(long, default_value_t = pw_decode::DEFAULT_MAX_STEP_TOKENS)]
    pub max_step_tokens: usize,
    /// Also time the prefill of one prompt of each of these lengths (comma-separated; steps of
    /// `--max-step-tokens`, the logits of the last position read back), after the batches.
    #[arg(long, value_delimiter = ',')]
    pub prompts: Vec<usize>,
}

fn inv_freq(theta: f64, head_dim: usize, rotating_pairs: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            if i < rotating_pairs { (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32 } else { 0.0 }
        })
        .collect()
}

/// The shapes of the real models (DESIGN.md section 3; Gemma-4-26B-A4B: 16 query heads).
pub(crate) fn shape(name: &str) -> Result<DecodeConfig> {
    let attn = |kv_heads, head_dim, window, theta| AttnLayer {
        kv_heads,
        head_dim,
        window,
        k_eq_v: false,
        inv_freq: inv_freq(theta, head_dim, head_dim / 2),
    };
    let base = |family, vocab, hidden, inter, layers, heads, a: AttnLayer, experts, top_k| DecodeConfig {
        family,
        vocab,
        hidden,
        inter,
        layers,
        heads,
        attn: vec![a; layers],
        experts,
        top_k,
        renormalize: true,
        sparse: vec![true; layers],
        dense_inter: 0,
        shared_inter: 0,
        act: Activation::SiluMul,
        eps: 1e-5,
        attn_scale: None,
        embed_scale: 1.0,
        softcap: 0.0,
        tied: false,
    };
    Ok(match name {
        "mixtral-8x7b" => base(Family::Mixtral, 32000, 4096, 14336, 32, 32, attn(8, 128, 0, 1e6), 8, 2),
        "tiny-mixtral" => base(Family::Mixtral, 4096, 256, 256, 5, 8, attn(2, 32, 0, 1e4), 8, 2),
        "qwen1.5-moe-a2.7b" | "tiny-qwen" => {
            let tiny = name == "tiny-qwen";
            let mut c = if tiny {
                base(Family::Qwen2Moe, 4096, 256, 64, 3, 8, attn(8, 32, 0, 1e6), 12, 4)
            } else {
                base(Family::Qwen2Moe, 151936, 2048, 1408, 24, 16, attn(16, 128, 0, 1e6), 60, 4)
            };
            c.renormalize = false;
            c.shared_inter = if tiny { 256 } else { 5632 };
            c.dense_inter = c.shared_inter;
            c.eps = 1e-6;
            c
        }
        "gemma-4-26b-a4b" | "tiny-gemma" => {
            let tiny = name == "tiny-gemma";
            let (vocab, hidden, dense, inter, layers, heads, experts, top_k) = if tiny {
                (4096, 256, 192, 64, 6, 8, 16, 4)
            } else {
                (262144, 2816, 2112, 704, 30, 16, 128, 8)
            };
            let (hd, ghd, window) = if tiny { (32, 64, 16) } else { (256, 512, 1024) };
            let mut c = base(
                Family::Gemma4,
                vocab,
                hidden,
                inter,
                layers,
                heads,
                attn(8, hd, window, 1e4),
                experts,
                top_k,
            );
            for (l, a) in c.attn.iter_mut().enumerate() {
                if l % 6 == 5 {
                    // Full layers: wider heads, 2 KV heads, K = V, proportional RoPE rotating the
                    // first quarter of the pairs.
                    *a = AttnLayer {
                        kv_heads: 2,
                        head_dim: ghd,
                        window: 0,
                        k_eq_v: true,
                        inv_freq: inv_freq(1e6, ghd, ghd / 8),
                    };
                }
            }
            c.dense_inter = dense;
            c.act = Activation::GeluTanhMul;
            c.eps = 1e-6;
            c.attn_scale = Some(1.0);
            c.embed_scale = (hidden as f32).sqrt();
            c.softcap = 30.0;
            c.tied = true;
            c
        }
        s => anyhow::bail!(
            "--models {s}: expected mixtral-8x7b, qwen1.5-moe-a2.7b, gemma-4-26b-a4b, tiny-mixtral, tiny-qwen or tiny-gemma"
        ),
    })
}

/// Committed bits of expert `e` in layer `l`.
type BitsFn = Box<dyn Fn(usize, usize) -> u8>;

/// Committed bits of expert `e` in layer `l`: uniform, or the planner-like mix (a fixed hash of
/// the page spread over 3..8).
fn bits_fn(spec: &str) -> Result<BitsFn> {
    if spec == "mix" {
        return Ok(Box::new(|l, e| {
            let x = (l as u32).wrapping_mul(0x9E37_79B9) ^ (e as u32).wrapping_mul(0x85EB_CA6B);
            3 + ((x ^ (x >> 15)).wrapping_mul(0x2C1B_3C6D) >> 29) as u8 % 6
        }));
    }
    let b: u8 = spec.parse().with_context(|| format!("--bits {spec}: expected 3..8 or mix"))?;
    anyhow::ensure!((3..=8).contains(&b), "--bits {b}: outside 3..8");
    Ok(Box::new(move |_, _| b))
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
    let records = if a.append && a.out.exists() {
        let text = std::fs::read_to_string(&a.out).with_context(|| format!("{}", a.out.display()))?;
        let mut old: Vec<Value> =
            serde_json::from_str(&text).with_context(|| format!("{}: not a JSON array", a.out.display()))?;
        old.extend(records);
        old
    } else {
        records
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&records)?)
        .with_context(|| format!("{}", a.out.display()))?;
    Ok(())
}

fn run<R: Runtime>(device: &R::Device, a: &BenchDecodeArgs) -> Result<Vec<Value>> {
    let client = R::client(device);
    let mut records = Vec::new();
    let tiny = a.models.iter().all(|m| m.starts_with("tiny"));
    let words = if tiny { 1 << 22 } else { 1 << 29 };
    let gbps = (words * 4) as f64 / crate::kernels::stream_read_secs(&client, words)? / 1e9;
    let max_batch = a.batches.iter().copied().max().unwrap_or(1);
    let max_ctx = a.ctx.iter().copied().max().unwrap_or(0);
    let block = 16;
    let max_prompt = a.prompts.iter().copied().max().unwrap_or(0);
    let decode_seq = max_ctx + a.steps + a.warmup + 1;
    let max_seq = decode_seq.max(max_prompt + 1);
    let bits_list: Vec<(String, BitsFn)> =
        a.bits.iter().map(|b| Ok((b.clone(), bits_fn(b)?))).collect::<Result<_>>()?;
    let acts: Vec<(String, ExpertAct)> = a
        .expert_act
        .iter()
        .map(|m| {
            let at = match m.as_str() {
                "epilogue" => ExpertAct::GateUpEpilogue,
                "launch" => ExpertAct::Launch,
                x => anyhow::bail!("--expert-act {x}: expected epilogue or launch"),
            };
            Ok((m.clone(), at))
        })
        .collect::<Result<_>>()?;

    for model in &a.models {
        let cfg = shape(model)?;
        // KV blocks come from the same accountant as the weights: lease the weights first,
        // then as many blocks as the largest batch needs.
        let geometry = cfg.kv_geometry(block, 2, max_seq);
        let kv_blocks = (max_batch * decode_seq.div_ceil(block)).max((max_prompt + 1).div_ceil(block));
        let first = &bits_list.first().context("--bits is empty")?.1;
        let mut base = GemmConfig::for_client(&client);
        base.gemv_min_items = a.gemv_min_items.unwrap_or(base.gemv_min_items);
        base.gemv_words_per_lane = a.gemv_words.unwrap_or(base.gemv_words_per_lane);
        base.warps = a.warps.unwrap_or(base.warps);
        base.gemv_rows = a.gemv_rows.unwrap_or(base.gemv_rows);
        base.check().context("--gemv-words / --gemv-rows / --warps")?;
        let mut next_id = 0u64;
        let modes = a
            .dense_mma
            .iter()
            .map(|m| match m.as_str() {
                "off" => Ok((m.as_str(), MmaMode::Off)),
                "auto" => Ok((m.as_str(), MmaMode::AUTO)),
                "auto-w" => {
                    Ok((m.as_str(), MmaMode::Auto(MmaTuning { warps_per_sm: 32, ..MmaTuning::DEFAULT })))
                }
                "always" => Ok((m.as_str(), MmaMode::Always(MmaTuning::default()))),
                "auto-skinny" => {
                    Ok((m.as_str(), MmaMode::Auto(MmaTuning { matmul: None, ..MmaTuning::DEFAULT })))
                }
                _ => match m.strip_prefix("auto-").and_then(kernels_cubecl::MatmulKernel::from_name) {
                    Some(k) => {
                        Ok((m.as_str(), MmaMode::Auto(MmaTuning { matmul: Some(k), ..MmaTuning::DEFAULT })))
                    }
                    None => Err(anyhow::anyhow!(
                        "--dense-mma {m}: expected off, auto, auto-w, always, auto-skinny or auto-KIND"
                    )),
                },
            })
            .collect::<Result<Vec<_>>>()?;
        let x_halves = a
            .gemv_x
            .iter()
            .map(|x| match x.as_str() {
                "f32" => Ok(false),
                "f16" => Ok(true),
                _ => Err(anyhow::anyhow!("--gemv-x {x}: expected f32 or f16")),
            })
            .collect::<Result<Vec<_>>>()?;
        let combos = acts
            .iter()
            .flat_map(|x| modes.iter().map(move |m| (x, *m)))
            .flat_map(|(x, m)| x_halves.iter().map(move |h| (x, m, *h)));
        let default_wps = base.gemv_warps_per_sm;
        let wps_list =
            if a.gemv_warps_per_sm.is_empty() { vec![default_wps] } else { a.gemv_warps_per_sm.clone() };
        let prefetches = a
            .gemv_prefetch
            .iter()
            .map(|p| match p.as_str() {
                "off" => Ok(false),
                "on" => Ok(true),
                _ => Err(anyhow::anyhow!("--gemv-prefetch {p}: expected off or on")),
            })
            .collect::<Result<Vec<_>>>()?;
        let chunks = if a.route_chunk.is_empty() { vec![ROUTE_CHUNK] } else { a.route_chunk.clone() };
        let grouped_modes = a
            .grouped
            .iter()
            .map(|m| match m.as_str() {
                "off" => Ok((m.as_str(), GroupedMode::Off)),
                "auto" => Ok((m.as_str(), GroupedMode::Auto)),
                "always" => Ok((m.as_str(), GroupedMode::Always)),
                _ => Err(anyhow::anyhow!("--grouped {m}: expected off, auto or always")),
            })
            .collect::<Result<Vec<_>>>()?;
        let combos = combos
            .flat_map(|c| wps_list.iter().map(move |w| (c, *w)))
            .flat_map(|(c, w)| prefetches.iter().map(move |p| (c, w, *p)))
            .flat_map(|(c, w, p)| chunks.iter().map(move |k| (c, w, p, *k)))
            .flat_map(|(c, w, p, k)| grouped_modes.iter().map(move |gm| (c, w, p, k, *gm)));
        for (((act_name, act), (mma_name, mma), x_half), wps, prefetch, chunk, (grouped_name, grouped)) in
            combos
        {
            // The kernel choices are fixed at construction: one model per combination.
            let mut g = base;
            g.gemv_x_half = x_half;
            g.gemv_warps_per_sm = wps;
            g.gemv_prefetch = prefetch;
            g.check().context("--gemv-warps-per-sm")?;
            let t = Instant::now();
            let mut dec = Decoder::<R, half::f16>::builder(&client)
                .kv_blocks(kv_blocks)
                .block_size(block)
                .max_seq_len(max_seq)
                .gemm(g)
                .fused_router(!a.router_gemm)
                .expert_act(*act)
                .dense_mma(mma)
                .route_chunk(chunk)
                .grouped(grouped)
                .max_step_tokens(a.max_step_tokens)
                .synthetic(cfg.clone(), first)
                .context("--route-chunk")?;
            let fused_router = dec.fused_router();
            sync(&client)?;
            let accountant = Accountant::new(u64::MAX / 2);
            let _weights =
                accountant.lease(pw_pages::Use::Weights, (dec.dense_bytes() + dec.expert_bytes()) as u64)?;
            let _kv = accountant.lease_kv_blocks(kv_blocks as u64, geometry.block_bytes() as u64)?;
            eprintln!(
                "{model}: dense {:.2} GB, KV {:.2} GB ({kv_blocks} blocks), built in {:.1} s",
                dec.dense_bytes() as f64 / 1e9,
                dec.kv_bytes() as f64 / 1e9,
                t.elapsed().as_secs_f64()
            );
            for (bits_name, bits) in &bits_list {
                dec.recommit_synthetic(bits.as_ref())?;
                let sparse_layers = cfg.sparse.iter().filter(|s| **s).count();
                let mean_bits = (0..cfg.layers)
                    .filter(|&l| cfg.sparse[l])
                    .flat_map(|l| (0..cfg.experts).map(move |e| (l, e)))
                    .map(|(l, e)| bits(l, e) as f64)
                    .sum::<f64>()
                    / (sparse_layers * cfg.experts).max(1) as f64;
                for &ctx in &a.ctx {
                    for &b in &a.batches {
                        let ids: Vec<u64> = (next_id..next_id + b as u64).collect();
                        next_id += b as u64;
                        for &id in &ids {
                            dec.add_sequence(id)?;
                            dec.fill_synthetic(id, ctx)?;
                        }
                        let mut toks = vec![1u32; b];
                        let mut host = 0.0f64;
                        let mut wall = 0.0f64;
                        let mut launches = 0;
                        for s in 0..a.warmup + a.steps {
                            let batch: Vec<(u64, u32)> =
                                ids.iter().copied().zip(toks.iter().copied()).collect();
                            let t0 = Instant::now();
                            dec.enqueue_greedy(&batch)?;
                            let t1 = Instant::now();
                            toks = dec.read_greedy(b)?;
                            if s >= a.warmup {
                                host += (t1 - t0).as_secs_f64();
                                wall += t0.elapsed().as_secs_f64();
                            }
                            launches = dec.last_launches();
                        }
                        for &id in &ids {
                            dec.free_sequence(id)?;
                        }
                        let secs = wall / a.steps as f64;
                        let bytes = step_bytes(&dec, &cfg, b, ctx + a.warmup + a.steps / 2);
                        let bound = bytes.total() / (gbps * 1e9);
                        let rec = json!({
                            "model": model, "batch": b, "ctx": ctx, "bits": bits_name,
                            "tpot_ms": secs * 1e3, "host_ms": host / a.steps as f64 * 1e3,
                            "launches": launches, "tok_s": b as f64 / secs, "bound_tok_s": b as f64 / bound,
                            "fraction_of_bound": bound / secs, "mean_expert_bits": mean_bits,
                            "bytes_per_step": bytes.total(), "dense_bytes": bytes.dense,
                            "expert_bytes_touched": bytes.experts, "kv_bytes": bytes.kv,
                            "stream_gbps": gbps, "chunks": b.div_ceil(dec.max_step_tokens()),
                            "max_step_tokens": dec.max_step_tokens(),
                            "gemv_min_items": dec.gemm_config().gemv_min_items,
                            "gemv_words": dec.gemm_config().gemv_words_per_lane,
                            "warps": dec.gemm_config().warps,
                            "gemv_rows": dec.gemm_config().gemv_rows,
                            "fused_router": fused_router,
                            "expert_act": act_name,
                            "dense_mma": mma_name,
                            "gemv_x": if x_half { "f16" } else { "f32" },
                            "gemv_warps_per_sm": wps,
                            "gemv_prefetch": prefetch,
                            "route_chunk": chunk,
                            "grouped": grouped_name,
                            "mma_supported": kernels_cubecl::dense_mma_supported(dec.client()),
                        });
                        eprintln!("{rec}");
                        records.push(rec);
                    }
                }
                for &n in &a.prompts {
                    records.push(time_prefill(&mut dec, model, bits_name, n, &mut next_id)?);
                }
            }
        }
    }
    Ok(records)
}

/// Times the prefill of one `n`-token prompt (after one untimed run that compiles the kernels of
/// its step sizes): the mean of two runs, or one from 4096 tokens.
fn time_prefill<R: Runtime>(
    dec: &mut Decoder<R, half::f16>,
    model: &str,
    bits: &str,
    n: usize,
    next_id: &mut u64,
) -> Result<Value> {
    let prompt: Vec<u32> = (0..n as u32).map(|i| 1 + i.wrapping_mul(2_654_435_761) % 1000).collect();
    let runs = if n >= 4096 { 1 } else { 2 };
    let mut secs = 0.0;
    for r in 0..=runs {
        let id = *next_id;
        *next_id += 1;
        dec.add_sequence(id)?;
        let t = Instant::now();
        let logits = dec.prefill(&[(id, &prompt)])?;
        if r > 0 {
            secs += t.elapsed().as_secs_f64();
        }
        dec.free_sequence(id)?;
        anyhow::ensure!(
            logits[0].iter().all(|v| v.is_finite()),
            "{model}: prefill of {n} tokens: non-finite logits"
        );
    }
    let ms = secs / runs as f64 * 1e3;
    let rec = json!({"kind": "prefill", "model": model, "prompt_tokens": n, "bits": bits, "time_ms": ms,
        "tok_s": n as f64 / ms * 1e3, "max_step_tokens": dec.max_step_tokens(),
        "steps": n.div_ceil(dec.max_step_tokens())});
    eprintln!("{rec}");
    Ok(rec)
}

struct StepBytes {
    dense: f64,
    experts: f64,
    kv: f64,
}

impl StepBytes {
    fn total(&self) -> f64 {
        self.dense + self.experts + self.kv
    }
}

/// Bytes a step of `b` sequences at context `ctx` must read, each once: every dense weight but
/// the embedding (one row per token; a tied head reads it whole), the committed pages of the
/// experts the batch touches (expected count under uniform routing), and the visible K/V of
/// every sequence. With more than 16 sequences the kernels read the weights once per chunk;
/// the bound does not count that.
fn step_bytes<R: Runtime>(
    dec: &Decoder<R, half::f16>,
    cfg: &DecodeConfig,
    b: usize,
    ctx: usize,
) -> StepBytes {
    let embed = cfg.vocab * cfg.hidden * 2;
    let dense = (dec.dense_bytes() - if cfg.tied { 0 } else { embed } + b * cfg.hidden * 2) as f64;
    let (e, k) = (cfg.experts as f64, cfg.top_k as f64);
    let touched = e * (1.0 - (1.0 - k / e).powi(b as i32));
    let experts: f64 = (0..cfg.layers).map(|l| dec.layer_expert_bytes(l) as f64 / e * touched).sum();
    let kv: f64 = cfg
        .attn
        .iter()
        .map(|a| {
            let visible = if a.window > 0 { ctx.min(a.window) } else { ctx };
            (b * visible * 2 * a.kv_heads * a.head_dim * 2) as f64
        })
        .sum();
    StepBytes { dense, experts, kv }
}
