//! `pw-bench bench-serve`: a stream of requests (mixed prompt and output lengths, arrivals
//! at a fixed rate) through the serving engine over the fast path of a synthetic full-size
//! model under a fixed device-memory limit, once with the experts pinned at 8 bits and once
//! with the planner free to lower them. Records throughput, time to first token, time per
//! output token, the concurrency reached, the memory split and the bit mix over time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cubecl::prelude::*;
use pw_decode::DecodeConfig;
use pw_pages::BoundaryTimes;
use pw_serve::{
    BoundaryHook, BoundaryState, Engine, EngineConfig, Event, FastOptions, FastStepModel, GenerateRequest,
    MemoryOptions, MemoryState, SamplingParams, StepModel, StepTiming, UsageRecorder, WeightPolicy,
};
use serde_json::{Value, json};

/// Options of `bench-serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Runtime: cuda or wgpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Output JSON file.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Model shape (random weights): mixtral-8x7b, qwen1.5-moe-a2.7b, gemma-4-26b-a4b, or
    /// tiny / tiny-mixtral / tiny-qwen / tiny-gemma (small shapes, for a smoke test).
    #[arg(long, default_value = "mixtral-8x7b")]
    pub model: String,
    /// Policies to run: pinned (experts fixed at 8 bits), uniform4 (fixed at 4 bits) and/or
    /// planner (starting at 8 bits).
    #[arg(long, value_delimiter = ',', default_value = "pinned,planner")]
    pub policies: Vec<String>,
    /// Device memory in GB for dense weights + experts + KV cache (default: the model at 8 bits
    /// plus room for the KV cache of a quarter of --max-batch full-length sequences).
    #[arg(long)]
    pub gpu_memory_gb: Option<f64>,
    /// Requests in the stream.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Arrivals per second (fixed rate).
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// Prompt lengths, uniform in MIN,MAX tokens (prompts go through the decode kernels in
    /// chunks of at most --max-step-tokens per step).
    #[arg(long, value_delimiter = ',', default_value = "8,32")]
    pub prompt: Vec<usize>,
    /// Output lengths, uniform in MIN,MAX tokens.
    #[arg(long, value_delimiter = ',', default_value = "32,128")]
    pub output: Vec<usize>,
    /// Most sequences per engine step.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Tokens per engine step, decodes and prompt chunks together (at least --max-batch).
    #[arg(long, default_value_t = 2048)]
    pub max_step_tokens: usize,
    /// KV admission: `preempt` reserves what each sequence holds and preempts (then resumes by
    /// recomputation) the latest requests when the cache runs out; `reserve` reserves prompt +
    /// max_tokens up front.
    #[arg(long, default_value = "reserve")]
    pub admission: pw_serve::Admission,
    /// KV blocks below which the planner lowers pages (T_blk); also the give-back margin.
    #[arg(long, default_value_t = 16)]
    pub kv_threshold_blocks: u64,
    /// Routing statistics every N steps.
    #[arg(long, default_value_t = 4)]
    pub routing_every: u64,
    /// Most MB of page raising started per boundary (0 = no limit), so that a large give-back
    /// is spread over several steps.
    #[arg(long, default_value_t = 64.0)]
    pub max_raise_mb: f64,
    /// Seconds after the planner's last lowering before pages may be raised again.
    #[arg(long, default_value_t = 1.0)]
    pub raise_after_s: f64,
    /// Stop a policy's run after this many seconds (requests not finished are cancelled and
    /// left out of the figures; the record says how many completed).
    #[arg(long, default_value_t = 150.0)]
    pub max_seconds: f64,
    /// Seed of the lengths and prompt tokens.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Read the page table (what `GET /v1/page-table` serves) every this many milliseconds
    /// while the load runs, as a dashboard would (0 = never); the record has the reads' latency
    /// and the step times, to compare with a run without it.
    #[arg(long, default_value_t = 0)]
    pub poll_page_table_ms: u64,
    /// Internal: run only this policy in this process and write its record here (each policy
    /// of a multi-policy run gets a fresh process, so device memory the first one kept in its
    /// allocator's pools does not count against the second).
    #[arg(long, hide = true, num_args = 2, value_names = ["POLICY", "FILE"])]
    pub child: Option<Vec<String>>,
}

/// The usage record plus the time of every step that ran with sequences in it (the gap
/// between its boundary and the one before, which includes page-table reads answered there),
/// where each step spent it, and the memory state after each boundary.
#[derive(Clone, Default)]
struct StepTimer {
    usage: UsageRecorder,
    steps: Arc<Mutex<(Option<Instant>, Vec<f64>)>>,
    /// Per boundary: when it ended, the sequences running and waiting, the step's parts and
    /// the memory after it.
    ticks: Arc<Mutex<Vec<Tick>>>,
}

/// One boundary: what the records and the timeline are computed from.
#[derive(Clone)]
struct Tick {
    at: Instant,
    active: usize,
    waiting: usize,
    timing: StepTiming,
    memory: Option<MemoryState>,
}

impl BoundaryHook for StepTimer {
    fn on_boundary(&mut self, s: &BoundaryState) {
        self.usage.on_boundary(s);
        let now = Instant::now();
        let mut g = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(prev) = g.0 {
            g.1.push(now.duration_since(prev).as_secs_f64());
        }
        g.0 = (s.active > 0).then_some(now);
        self.ticks.lock().unwrap_or_else(|p| p.into_inner()).push(Tick {
            at: now,
            active: s.active,
            waiting: s.waiting,
            timing: s.timing,
            memory: s.memory.clone(),
        });
    }
}

/// Runs the benchmark on the chosen runtime.
pub fn bench_serve(a: &BenchServeArgs) -> Result<()> {
    if a.prompt.len() != 2 || a.output.len() != 2 || a.prompt[0] == 0 || a.prompt[0] > a.prompt[1] {
        bail!("--prompt and --output take MIN,MAX with 1 <= MIN <= MAX");
    }
    if a.output[0] == 0 || a.output[0] > a.output[1] {
        bail!("--output takes MIN,MAX with 1 <= MIN <= MAX");
    }
    if !(a.rate.is_finite() && a.rate > 0.0) {
        bail!("--rate must be > 0");
    }
    let policy_of = |p: &str| -> Result<Policy> {
        Ok(match p {
            "pinned" => Policy { weights: WeightPolicy::Pinned, bits: 8, name: "pinned-8bit" },
            "uniform4" => Policy { weights: WeightPolicy::Pinned, bits: 4, name: "uniform-4bit" },
            "planner" => Policy { weights: WeightPolicy::Planner, bits: 8, name: "planner" },
            other => bail!("--policies: unknown policy {other} (pinned, uniform4, planner)"),
        })
    };
    if let Some(c) = &a.child {
        let rec = run_policy(a, policy_of(&c[0])?)?;
        std::fs::write(&c[1], rec.to_string()).with_context(|| c[1].clone())?;
        return Ok(());
    }
    let mut records = Vec::new();
    for p in &a.policies {
        policy_of(p)?;
        let tmp = a.out.with_extension(format!("{p}.part.json"));
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .arg("--child")
            .arg(p)
            .arg(&tmp)
            .status()
            .context("starting the benchmark process")?;
        if !status.success() {
            bail!("the {p} run failed ({status})");
        }
        let rec: Value = serde_json::from_str(
            &std::fs::read_to_string(&tmp).with_context(|| format!("{}", tmp.display()))?,
        )?;
        let _ = std::fs::remove_file(&tmp);
        eprintln!("{}", summary(&rec));
        records.push(rec);
        // Partial results survive a later failure.
        std::fs::write(&a.out, serde_json::to_string_pretty(&records)?)
            .with_context(|| format!("{}", a.out.display()))?;
    }
    Ok(())
}

/// Who sets the experts' bits, and where they start.
#[derive(Debug, Clone, Copy)]
struct Policy {
    weights: WeightPolicy,
    bits: u8,
    name: &'static str,
}

fn run_policy(a: &BenchServeArgs, policy: Policy) -> Result<Value> {
    {
        let rec = match a.device.as_str() {
            #[cfg(feature = "cuda")]
            "cuda" => run::<cubecl::cuda::CudaRuntime>(&cubecl::cuda::CudaDevice::new(0), a, policy)?,
            #[cfg(not(feature = "cuda"))]
            "cuda" => {
                bail!("--device cuda: this binary was built without CUDA; rebuild with `--features cuda`")
            }
            "wgpu" => run::<cubecl::wgpu::WgpuRuntime>(&cubecl::wgpu::WgpuDevice::DefaultDevice, a, policy)?,
            d => bail!("--device {d}: expected cuda or wgpu"),
        };
        Ok(rec)
    }
}

fn summary(r: &Value) -> String {
    let mut r = r.clone();
    if let Some(o) = r.as_object_mut() {
        o.remove("bit_mix");
    }
    r.to_string()
}

/// A word-level tokenizer whose word `tN` is token N, for random token ids.
fn tokenizer(vocab: usize) -> Result<tokenizers::Tokenizer> {
    let words: serde_json::Map<String, Value> =
        (0..vocab).map(|i| (format!("t{i}"), Value::from(i))).collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "t0"}
    });
    tokenizers::Tokenizer::from_bytes(tok.to_string().as_bytes())
        .map_err(|e| anyhow::anyhow!("building the benchmark tokenizer: {e}"))
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Expert bytes of the synthetic model with every page at `bits`.
fn expert_bytes(c: &DecodeConfig, bits: u64) -> u64 {
    let (h, i) = (c.hidden as u64, c.inter as u64);
    let words = |rows: u64, cols: u64| rows * cols.div_ceil(32) * 4;
    let sparse = c.sparse.iter().filter(|&&s| s).count();
    (sparse * c.experts) as u64 * (bits * (words(2 * i, h) + words(h, i)) + ((2 * i + h) << bits) * 2)
}

fn run<R: Runtime>(device: &R::Device, a: &BenchServeArgs, policy: Policy) -> Result<Value>
where
    pw_decode::Decoder<R, half::f16>: Send,
{
    let client = R::client(device);
    let cfg = crate::decode::shape(if a.model == "tiny" { "tiny-mixtral" } else { &a.model })?;
    let max_context = a.prompt[1] + a.output[1] + 16;
    let kv_per_token = cfg.attn.iter().map(|x| (x.kv_heads * x.head_dim * 2 * 2) as u64).sum::<u64>();
    let dense = cfg.dense_bytes();
    let gpu_bytes = match a.gpu_memory_gb {
        Some(gb) => (gb * 1e9) as u64,
        None => {
            let quarter = (a.max_batch as u64).div_ceil(4) * max_context as u64 * kv_per_token;
            dense
                + cfg.default_scratch_bytes()
                + expert_bytes(&cfg, 8)
                + quarter
                + (a.kv_threshold_blocks + 1 + a.max_batch as u64) * 16 * kv_per_token
        }
    };
    let scratch = cfg.default_scratch_bytes();
    let budget = gpu_bytes
        .checked_sub(dense + scratch)
        .context("--gpu-memory-gb is below the dense weights and the decoder's step buffers")?;
    let memory = MemoryOptions {
        budget_bytes: Some(budget),
        policy: policy.weights,
        threshold_blocks: a.kv_threshold_blocks,
        give_back_blocks: a.kv_threshold_blocks.max(1),
        routing_every: a.routing_every.max(1),
        max_raise_bytes: (a.max_raise_mb * 1e6) as u64,
        raise_after: std::time::Duration::try_from_secs_f64(a.raise_after_s)
            .context("--raise-after-s: a number of seconds, not negative")?,
        ..Default::default()
    };
    let options = FastOptions {
        bits: policy.bits,
        kv_budget_bytes: 0,
        max_batch: a.max_batch,
        max_context,
        memory,
        residual_head: true,
        max_step_tokens: pw_decode::DEFAULT_MAX_STEP_TOKENS,
    };
    let t_load = Instant::now();
    let model = FastStepModel::<R, half::f16>::synthetic(&client, cfg.clone(), &options)?;
    let capacity = model.kv_capacity_bytes();
    let start_weights = model.weight_bytes();
    let load_s = t_load.elapsed().as_secs_f64();
    eprintln!(
        "{} {}: loaded in {load_s:.1} s; budget {:.2} GB for experts + KV, experts {:.2} GB, KV capacity {:.3} GB",
        a.model,
        policy.name,
        budget as f64 / 1e9,
        (start_weights - dense) as f64 / 1e9,
        capacity as f64 / 1e9
    );
    let config = EngineConfig {
        admission: a.admission,
        kv_budget_bytes: capacity,
        max_batch: a.max_batch,
        max_context,
        max_step_tokens: a.max_step_tokens.max(a.max_batch),
        max_waiting: 4096,
        eos_token_ids: vec![],
    };
    let rec = StepTimer::default();
    let tok = Arc::new(tokenizer(cfg.vocab)?);
    let engine = Engine::start(Box::new(model), tok, config, Box::new(rec.clone()))?;
    let handle = engine.handle();

    // The request stream: lengths and tokens fixed by the seed, the same for every policy.
    let mut rng = Rng(a.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let reqs: Vec<(Vec<u32>, usize)> = (0..a.requests)
        .map(|_| {
            let p = rng.range(a.prompt[0], a.prompt[1]);
            let prompt = (0..p).map(|_| (rng.next() % cfg.vocab as u64) as u32).collect();
            (prompt, rng.range(a.output[0], a.output[1]))
        })
        .collect();

    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(a.max_seconds);
    let stop = Arc::new(AtomicBool::new(false));
    // Bit mix and memory over time.
    let sampler = {
        let h = handle.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let m = h.metrics().snapshot();
                if let Some(mem) = &m.memory {
                    let gb: Vec<f64> =
                        mem.weight_bytes_by_bits[3..].iter().map(|&b| b as f64 / 1e9).collect();
                    out.push(json!({
                        "t_s": t0.elapsed().as_secs_f64(), "active": m.active_sequences, "queue": m.queue_length,
                        "expert_gb_by_bits_3_to_8": gb, "mean_bits": mem.mean_bits(),
                        "kv_gb": (mem.kv_blocks_used * mem.block_bytes) as f64 / 1e9,
                    }));
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            out
        })
    };
    // A dashboard's poller: the engine answers between two steps.
    let poller = (a.poll_page_table_ms > 0).then(|| {
        let h = handle.clone();
        let stop = stop.clone();
        let every = Duration::from_millis(a.poll_page_table_ms);
        std::thread::spawn(move || {
            let (mut latency, mut pages) = (Vec::new(), 0usize);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                match h.blocking_page_table() {
                    Ok(view) => {
                        latency.push(t.elapsed().as_secs_f64());
                        pages = view.map_or(0, |v| v.pages.len());
                    }
                    Err(e) => {
                        eprintln!("page table: {e}");
                        break;
                    }
                }
                std::thread::sleep(every.saturating_sub(t.elapsed()));
            }
            (latency, pages)
        })
    });
    let mut clients = Vec::with_capacity(reqs.len());
    for (i, (prompt, out_len)) in reqs.into_iter().enumerate() {
        let arrival = t0 + Duration::from_secs_f64(i as f64 / a.rate);
        if arrival > deadline {
            break;
        }
        if let Some(d) = arrival.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let prompt_tokens = prompt.len();
        let params = SamplingParams { max_tokens: out_len, ignore_eos: true, ..Default::default() };
        let mut stream = handle.submit(GenerateRequest { prompt, params })?;
        clients.push(std::thread::spawn(move || -> Option<Served> {
            let submitted = Instant::now();
            let mut served = Served {
                submitted_s: submitted.duration_since(t0).as_secs_f64(),
                prompt_tokens,
                ttft: 0.0,
                gaps: Vec::new(),
                tokens: 0,
                done_s: 0.0,
            };
            let mut last = None::<Instant>;
            loop {
                if Instant::now() > deadline {
                    return None; // dropping the stream cancels the request
                }
                match stream.blocking_next()? {
                    Event::Token { .. } => {
                        let now = Instant::now();
                        match last {
                            None => served.ttft = now.duration_since(submitted).as_secs_f64(),
                            Some(l) => served.gaps.push(now.duration_since(l).as_secs_f64()),
                        }
                        last = Some(now);
                        served.tokens += 1;
                    }
                    Event::Done { .. } => {
                        served.done_s = t0.elapsed().as_secs_f64();
                        return Some(served);
                    }
                    Event::Failed(msg) => {
                        eprintln!("request failed: {msg}");
                        return None;
                    }
                }
            }
        }));
    }
    let submitted = clients.len();
    // Requests still queued at the deadline get no event to wake their client: wait for the
    // clients or the deadline, then stop the engine, which ends every stream left.
    while Instant::now() < deadline && !clients.iter().all(|c| c.is_finished()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let m = handle.metrics().snapshot();
    let r = rec.usage.record();
    let mut step_s = rec.steps.lock().unwrap_or_else(|p| p.into_inner()).1.clone();
    let ticks = rec.ticks.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let parts: Vec<StepTiming> = ticks.iter().map(|t| t.timing).collect();
    let memory: Vec<MemoryState> = ticks.iter().filter_map(|t| t.memory.clone()).collect();
    let (mut poll_s, polled_pages) = poller.map(|p| p.join().unwrap_or_default()).unwrap_or_default();
    engine.shutdown();
    let results: Vec<_> = clients.into_iter().filter_map(|c| c.join().ok().flatten()).collect();
    let bit_mix = sampler.join().unwrap_or_default();

    let mut ttft: Vec<f64> = results.iter().map(|r| r.ttft).collect();
    let mut tpot: Vec<f64> = results.iter().flat_map(|r| r.gaps.iter().copied()).collect();
    let tokens: usize = results.iter().map(|r| r.tokens).sum();
    let per_request: Vec<Value> = results
        .iter()
        .map(|r| {
            json!({"submitted_s": r.submitted_s, "prompt_tokens": r.prompt_tokens, "ttft_ms": r.ttft * 1e3,
                "output_tokens": r.tokens, "done_s": r.done_s})
        })
        .collect();
    // Lowest committed expert bytes seen (at peak KV pressure) and the peak KV.
    let min_experts = bit_mix
        .iter()
        .filter_map(|s| {
            s["expert_gb_by_bits_3_to_8"].as_array().map(|v| v.iter().filter_map(Value::as_f64).sum::<f64>())
        })
        .fold(f64::INFINITY, f64::min);
    let mem = m.memory.clone().unwrap_or_default();
    let min_experts = if min_experts.is_finite() { min_experts } else { mem.weight_bytes() as f64 / 1e9 };
    let mut record = json!({
        "model": a.model,
        "policy": policy.name,
        "req_s": results.len() as f64 / wall,
        "tok_s": tokens as f64 / wall,
        "ttft_p50_ms": percentile(&mut ttft, 0.5) * 1e3,
        "tpot_p50_ms": percentile(&mut tpot, 0.5) * 1e3,
        "tpot_p99_ms": percentile(&mut tpot, 0.99) * 1e3,
        "max_concurrent": r.peak_active,
        "weight_gb": (dense as f64 / 1e9) + min_experts,
        "kv_gb": r.peak_kv_bytes_used as f64 / 1e9,
        "gpu_memory_gb": gpu_bytes as f64 / 1e9,
        "budget_gb": budget as f64 / 1e9,
        "dense_gb": dense as f64 / 1e9,
        "kv_capacity_gb": capacity as f64 / 1e9,
        "requests": a.requests, "submitted": submitted, "completed": results.len(),
        "failed": m.requests_failed_total, "failed_out_of_memory": m.requests_failed_out_of_memory_total,
        "preempted": m.requests_preempted_total, "calls_out_of_memory": m.calls_out_of_memory_total,
        "max_step_tokens": a.max_step_tokens,
        "rate_req_s": a.rate, "prompt_tokens": a.prompt, "output_tokens": a.output,
        "max_batch": a.max_batch, "wall_s": wall, "load_s": load_s,
        "page_moves_down": mem.page_moves_down_total, "page_moves_up": mem.page_moves_up_total,
        "planner_lower": mem.planner_lower_total, "planner_raise": mem.planner_raise_total,
        "planner_unmet": mem.planner_unmet_total,
        "final_mean_bits": mem.mean_bits(),
        "bit_mix": bit_mix,
        "per_request": per_request,
    });
    let steps = json!({
        "steps": step_s.len(),
        "step_ms_mean": step_s.iter().sum::<f64>() / step_s.len().max(1) as f64 * 1e3,
        "step_ms_p50": percentile(&mut step_s, 0.5) * 1e3,
        "step_ms_p99": percentile(&mut step_s, 0.99) * 1e3,
        "poll_page_table_ms": a.poll_page_table_ms,
        "page_table_reads": poll_s.len(),
        "page_table_pages": polled_pages,
        "page_table_read_ms_p50": percentile(&mut poll_s, 0.5) * 1e3,
        "page_table_read_ms_max": poll_s.iter().copied().fold(0.0, f64::max) * 1e3,
        "step_parts": step_parts(&parts),
        "boundary_plans": mem.plans_total,
        "boundary_plan_s": mem.plan_time.as_secs_f64(),
        "boundary_tables_published": mem.tables_published_total,
        "boundary_commit_s": mem.commit_time.as_secs_f64(),
        "boundary_commit_parts_s": commit_parts(&mem.commit_parts),
        "boundary_costs": boundary_costs(&memory),
        "timeline": timeline(&ticks, t0),
    });
    if let (Some(r), Value::Object(extra)) = (record.as_object_mut(), steps) {
        r.extend(extra);
    }
    Ok(record)
}

/// One completed request as its client saw it.
struct Served {
    /// When it was submitted, seconds after the run's start.
    submitted_s: f64,
    /// Its prompt's length.
    prompt_tokens: usize,
    /// Seconds from submission to its first token.
    ttft: f64,
    /// Seconds between its consecutive tokens.
    gaps: Vec<f64>,
    /// Tokens it received.
    tokens: usize,
    /// When it ended, seconds after the run's start.
    done_s: f64,
}

/// What the boundaries' page work cost. Between consecutive boundaries (including those a step
/// ran to make KV room) the commits' time is fitted by least squares on what they did (pages
/// lowered, raisings started, raisings committed, layer tables published), and the planning
/// time on the plans computed; boundaries that moved nothing give the base cost.
fn boundary_costs(memory: &[MemoryState]) -> Value {
    let ms = |a: Duration, b: Duration| b.saturating_sub(a).as_secs_f64() * 1e3;
    let n = |a: u64, b: u64| b.saturating_sub(a) as f64;
    // (commit ms, plan ms, [lowered, started, raised, tables], plans)
    let rows: Vec<(f64, f64, [f64; 4], f64)> = memory
        .windows(2)
        .map(|w| {
            let (a, b) = (&w[0], &w[1]);
            (
                ms(a.commit_time, b.commit_time),
                ms(a.plan_time, b.plan_time),
                [
                    n(a.page_moves_down_total, b.page_moves_down_total),
                    n(a.raisings_started_total, b.raisings_started_total),
                    n(a.page_moves_up_total, b.page_moves_up_total),
                    n(a.tables_published_total, b.tables_published_total),
                ],
                n(a.plans_total, b.plans_total),
            )
        })
        .collect();
    let still: Vec<f64> = rows.iter().filter(|r| r.2.iter().all(|&x| x == 0.0)).map(|r| r.0).collect();
    let moving: Vec<f64> = rows.iter().filter(|r| r.2.iter().any(|&x| x > 0.0)).map(|r| r.0).collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let commit_fit =
        least_squares(&rows.iter().map(|r| (r.0, [1.0, r.2[0], r.2[1], r.2[2], r.2[3]])).collect::<Vec<_>>());
    let plan_fit = least_squares(&rows.iter().map(|r| (r.1, [1.0, r.3])).collect::<Vec<_>>());
    json!({
        "boundaries": rows.len(),
        "still": still.len(), "still_commit_ms_mean": mean(&still),
        "moving": moving.len(), "moving_commit_ms_mean": mean(&moving),
        "commit_fit_ms": commit_fit.map(|c| json!({"base": c[0], "per_lowered": c[1], "per_raising_started": c[2],
            "per_raising_committed": c[3], "per_table_published": c[4]})),
        "plan_fit_ms": plan_fit.map(|c| json!({"base": c[0], "per_plan": c[1]})),
    })
}

/// Least-squares coefficients of `y ≈ c · x` over `rows` of `(y, x)` (normal equations,
/// Gaussian elimination with partial pivoting); `None` when the system is singular.
fn least_squares<const K: usize>(rows: &[(f64, [f64; K])]) -> Option<[f64; K]> {
    let mut a = [[0.0f64; K]; K];
    let mut b = [0.0f64; K];
    for (y, x) in rows {
        for ((ai, bi), &xi) in a.iter_mut().zip(&mut b).zip(x) {
            *bi += xi * y;
            for (aij, &xj) in ai.iter_mut().zip(x) {
                *aij += xi * xj;
            }
        }
    }
    for col in 0..K {
        let p = (col..K).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[p][col].abs() < 1e-9 {
            return None;
        }
        a.swap(col, p);
        b.swap(col, p);
        let (pivot, pb) = (a[col], b[col]);
        for (r, (row, br)) in a.iter_mut().zip(&mut b).enumerate() {
            if r != col {
                let f = row[col] / pivot[col];
                for (x, p) in row.iter_mut().zip(pivot).skip(col) {
                    *x -= f * p;
                }
                *br -= f * pb;
            }
        }
    }
    Some(std::array::from_fn(|i| b[i] / a[i][i]))
}

/// Where the steps' time went: per part (the decode calls, the prefill calls, the boundaries)
/// its calls, their sizes, total and median seconds.
fn step_parts(parts: &[StepTiming]) -> Value {
    let part = |size: fn(&StepTiming) -> usize, time: fn(&StepTiming) -> Duration| {
        let calls: Vec<&StepTiming> = parts.iter().filter(|t| size(t) > 0).collect();
        let mut s: Vec<f64> = calls.iter().map(|t| time(t).as_secs_f64()).collect();
        let size_sum: usize = calls.iter().map(|t| size(t)).sum();
        json!({"calls": calls.len(), "size_mean": size_sum as f64 / calls.len().max(1) as f64,
            "s_total": s.iter().sum::<f64>(), "ms_p50": percentile(&mut s, 0.5) * 1e3,
            "ms_p99": percentile(&mut s, 0.99) * 1e3})
    };
    json!({
        "decode": part(|t| t.decode_seqs, |t| t.decode),
        "prefill": part(|t| t.prefill_tokens, |t| t.prefill),
        "boundary": part(|_| 1, |t| t.boundary),
    })
}

/// The commits' time by part, in seconds.
fn commit_parts(t: &BoundaryTimes) -> Value {
    json!({"finished": t.finished.as_secs_f64(), "lower": t.lower.as_secs_f64(),
        "start": t.start.as_secs_f64(), "start_mover": t.start_mover.as_secs_f64(), "publish": t.publish.as_secs_f64()})
}

/// The run in one-second bins from the first arrival: per bin the time of the decode and
/// prefill calls and of the boundaries (with their planning and commits), the decode calls'
/// mean batch, the prompt tokens run, the pages lowered and raised, and at its end the sequences
/// running and waiting and the experts' mean bits.
fn timeline(ticks: &[Tick], t0: Instant) -> Value {
    let Some(last) = ticks.last() else { return json!([]) };
    let bins = last.at.saturating_duration_since(t0).as_secs() as usize + 1;
    let mut out = Vec::with_capacity(bins);
    let mut prev_memory: Option<&MemoryState> = None;
    let mut i = 0;
    for bin in 0..bins {
        let end = t0 + Duration::from_secs(bin as u64 + 1);
        let (mut decode, mut prefill, mut boundary, mut plan, mut commit) = (0.0, 0.0, 0.0, 0.0, 0.0);
        let mut parts = BoundaryTimes::default();
        let (mut calls, mut seqs, mut tokens, mut down, mut up) = (0usize, 0usize, 0usize, 0u64, 0u64);
        let mut at_end: Option<&Tick> = None;
        while i < ticks.len() && ticks[i].at < end {
            let t = &ticks[i];
            decode += t.timing.decode.as_secs_f64();
            prefill += t.timing.prefill.as_secs_f64();
            boundary += t.timing.boundary.as_secs_f64();
            if t.timing.decode_seqs > 0 {
                calls += 1;
                seqs += t.timing.decode_seqs;
            }
            tokens += t.timing.prefill_tokens;
            if let Some(m) = &t.memory {
                if let Some(p) = prev_memory {
                    plan += m.plan_time.saturating_sub(p.plan_time).as_secs_f64();
                    commit += m.commit_time.saturating_sub(p.commit_time).as_secs_f64();
                    parts.add(&m.commit_parts.since(&p.commit_parts));
                    down += m.page_moves_down_total.saturating_sub(p.page_moves_down_total);
                    up += m.page_moves_up_total.saturating_sub(p.page_moves_up_total);
                }
                prev_memory = Some(m);
            }
            at_end = Some(t);
            i += 1;
        }
        out.push(json!({
            "t": bin, "decode_s": decode, "prefill_s": prefill, "boundary_s": boundary,
            "plan_s": plan, "commit_s": commit, "commit_parts_s": commit_parts(&parts), "decode_calls": calls,
            "decode_seqs_mean": seqs as f64 / calls.max(1) as f64, "prefill_tokens": tokens,
            "moves_down": down, "moves_up": up,
            "active": at_end.map(|t| t.active), "waiting": at_end.map(|t| t.waiting),
            "mean_bits": at_end.and_then(|t| t.memory.as_ref()).map(MemoryState::mean_bits),
        }));
    }
    Value::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fit recovers the coefficients of exact data, and says when the counts never vary.
    #[test]
    fn least_squares_recovers_known_costs() {
        let c = [0.2, 0.05, 0.01, 0.3];
        let rows: Vec<(f64, [f64; 4])> = (0..40)
            .map(|i| {
                let x = [1.0, (i % 7) as f64, ((i * 3) % 11) as f64, (i % 5 == 0) as u8 as f64 * 24.0];
                (x.iter().zip(&c).map(|(x, c)| x * c).sum(), x)
            })
            .collect();
        let fit = least_squares(&rows).unwrap();
        for (f, c) in fit.iter().zip(&c) {
            assert!((f - c).abs() < 1e-9, "{fit:?}");
        }
        let flat: Vec<(f64, [f64; 2])> = (0..10).map(|_| (0.1, [1.0, 0.0])).collect();
        assert!(least_squares(&flat).is_none());
    }
}
