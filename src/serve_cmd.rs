//! `pagedweight serve` / `cargo run --example mixtral_serve`: load a model, start the engine,
//! and serve the OpenAI-compatible API (or answer one prompt with `--once`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use pw_models::AnyModel;
use pw_serve::server::{ServerOptions, ServerState, serve};
use pw_serve::{
    BurnStepModel, ChatMessage, ChatTemplate, Engine, EngineConfig, Event, GenerateRequest, SamplingParams,
    StepModel, UsageRecorder,
};

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeDevice {
    /// The best backend this binary has: CUDA if built with `--features cuda` and a GPU
    /// answers, else wgpu if built with `--features wgpu`, else the CPU.
    Auto,
    /// Burn's ndarray backend on the CPU.
    Cpu,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
}

/// Options of `pagedweight serve` and of the `mixtral_serve` example.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json; the chat template
    /// from tokenizer_config.json), or a PagedWeight checkpoint `quantize` wrote (its calibrated
    /// expert blocks and sensitivities served as they are).
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the URL is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Backend.
    #[arg(long, value_enum, default_value_t = ServeDevice::Auto)]
    pub device: ServeDevice,
    /// Where compiled CUDA kernels are kept between starts, one directory per build and GPU
    /// model (default: `$XDG_CACHE_HOME/pagedweight/kernels`, else `~/.cache/pagedweight/kernels`).
    #[arg(long)]
    pub kernel_cache: Option<PathBuf>,
    /// Compile every CUDA kernel at start, keeping none for the next start.
    #[arg(long, conflicts_with = "kernel_cache")]
    pub no_kernel_cache: bool,
    /// KV-cache budget in bytes: requests wait until their prompt + max_tokens fit
    /// (default: every batch slot at the full context).
    #[arg(long)]
    pub kv_budget_bytes: Option<u64>,
    /// Most sequences decoded together (default: 256 on the fast path under a memory budget,
    /// which bounds the KV cache; 16 elsewhere, where the cache is sized as max batch × context).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Tokens through the model per step, decodes and prompt chunks together (default: 2048,
    /// at least the max batch): longer prompts are prefilled in chunks across steps.
    #[arg(long)]
    pub max_step_tokens: Option<usize>,
    /// KV admission: `preempt` reserves what each sequence holds and preempts (then resumes by
    /// recomputation) the latest requests when the cache runs out; `reserve` reserves prompt +
    /// max_tokens up front.
    #[arg(long, default_value = "preempt")]
    pub admission: pw_serve::Admission,
    /// Context length (default: `max_position_embeddings` of config.json).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Ignore the prompt-residual head beside the checkpoint (`residual_head.json`, written by
    /// the `train_residual_head` example); by default the fast path's planner weighs each
    /// running prompt's factors into the pages' damage.
    #[arg(long)]
    pub no_residual: bool,
    /// Model name clients use (default: the directory's name).
    #[arg(long)]
    pub served_name: Option<String>,
    /// Complete this prompt (greedy), print it and a summary, and exit instead of serving.
    #[arg(long)]
    pub once: Option<String>,
    /// With --once: wrap the prompt as a user message with the chat template.
    #[arg(long, requires = "once")]
    pub chat: bool,
    /// With --once: most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Serve through the fast decode path (fused CubeCL kernels over the paged KV cache and the
    /// paged any-precision experts) even where it is not the default: CUDA with `--device cuda`
    /// (or `auto` in a CUDA build with a GPU), wgpu otherwise. The default wherever CUDA or a
    /// hardware wgpu adapter answers.
    #[arg(long, conflicts_with = "reference")]
    pub fast: bool,
    /// Serve through the Burn reference model (one forward per sequence) instead of the fast
    /// path; the default where no GPU answers.
    #[arg(long)]
    pub reference: bool,
    /// With --fast: the bit-width (3..8) every expert starts at (the highest that fits
    /// --gpu-memory-gb if lower).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(3..=8))]
    pub bits: u8,
    /// With --fast: device memory in GB (1e9 bytes) for the weights and the KV cache together.
    /// The experts and the KV blocks lease from one budget (this less the dense weights); the
    /// planner lowers expert pages as the cache grows and raises them when it shrinks. Default
    /// on CUDA: 90 % of the GPU's memory, at most what is free when the server starts; on wgpu,
    /// none (the cache is sized as max batch × context).
    #[arg(long)]
    pub gpu_memory_gb: Option<f64>,
    /// On the Burn reference path: host memory in GB (1e9 bytes) for the expert pages and the
    /// KV cache together (the dense weights come on top); the planner lowers and raises pages
    /// as on the fast path. A PagedWeight checkpoint (`pagedweight quantize`) always has paged
    /// experts (default budget: the experts at --bits plus the KV cache of every batch slot at
    /// the full context); so does a Hugging Face directory, its experts quantized at load.
    #[arg(long, conflicts_with = "gpu_memory_gb")]
    pub memory_gb: Option<f64>,
    /// Planner options (with --fast --gpu-memory-gb, or a PagedWeight checkpoint on the
    /// reference path).
    #[command(flatten)]
    pub planner: PlannerArgs,
    /// Require `Authorization: Bearer KEY` on /v1/* (401 otherwise).
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from the first line of this file (keeps it out of the process list).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Most requests waiting for admission; more are answered 429.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// Seconds a client has to send a request's headers (also closes idle connections) and,
    /// separately, its body.
    #[arg(long, default_value_t = 30.0)]
    pub http_timeout_s: f64,
    /// `/metrics` also has one series per expert page (committed and desired bits, bytes),
    /// for Prometheus users; `/v1/page-table` and `/dashboard` have them regardless.
    #[arg(long)]
    pub metrics_per_page: bool,
}

/// Planner options of the fast path (with --gpu-memory-gb).
#[derive(clap::Args, Debug, Clone)]
pub struct PlannerArgs {
    /// `planner`: expert bit-widths move with KV pressure; `pinned`: they stay at --bits.
    #[arg(long, value_enum, default_value_t = Policy::Planner)]
    pub policy: Policy,
    /// Lowest bit-width the planner may lower a page to (3..8).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(3..=8))]
    pub floor_bits: u8,
    /// Free KV blocks at or below which pages are lowered (T_blk).
    #[arg(long, default_value_t = 16)]
    pub kv_threshold_blocks: u64,
    /// Free blocks above the threshold needed before memory goes back to the weights (H ≥ 1).
    #[arg(long, default_value_t = 16)]
    pub give_back_blocks: u64,
    /// Record routing statistics every N steps (one download of two small arrays each time).
    #[arg(long, default_value_t = 1)]
    pub routing_every: u64,
    /// Most MB one boundary may start raising (0 = no limit).
    #[arg(long, default_value_t = 0.0)]
    pub max_raise_mb: f64,
    /// Seconds after the last lowering before memory may go back to the weights.
    #[arg(long, default_value_t = 1.0, value_parser = seconds)]
    pub raise_after_s: f64,
    /// Ablation: plan without routing statistics (no hot/cold floors or multipliers).
    #[arg(long)]
    pub no_routing: bool,
    /// Ablation: plan without the offline sensitivity (uniform-quantizer error model).
    #[arg(long)]
    pub no_sensitivity: bool,
}

/// A duration in seconds: finite and not negative.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && (0.0..=1e6).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a number of seconds between 0 and 1e6")),
    }
}

/// Who sets the experts' bit-widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// The quality-aware planner, between decode steps.
    Planner,
    /// Fixed at --bits.
    Pinned,
}

impl PlannerArgs {
    /// The memory options for a budget of `budget_bytes` (experts + KV).
    pub fn memory(&self, budget_bytes: Option<u64>) -> pw_serve::MemoryOptions {
        let mut planner = pw_serve::PlannerConfig { floor_bits: self.floor_bits, ..Default::default() };
        planner.use_routing = !self.no_routing;
        planner.use_sensitivity = !self.no_sensitivity;
        let routing = pw_serve::RoutingConfig {
            hot_floor_bits: pw_serve::RoutingConfig::default().hot_floor_bits.max(self.floor_bits),
            warm_floor_bits: self.floor_bits,
            cold_floor_bits: self.floor_bits,
            ..Default::default()
        };
        pw_serve::MemoryOptions {
            budget_bytes,
            policy: match self.policy {
                Policy::Planner => pw_serve::WeightPolicy::Planner,
                Policy::Pinned => pw_serve::WeightPolicy::Pinned,
            },
            planner,
            routing,
            threshold_blocks: self.kv_threshold_blocks,
            give_back_blocks: self.give_back_blocks.max(1),
            routing_every: self.routing_every.max(1),
            max_raise_bytes: (self.max_raise_mb * 1e6) as u64,
            raise_after: std::time::Duration::from_secs_f64(self.raise_after_s),
            // Read from the checkpoint by the loader.
            calibration_routing: Vec::new(),
        }
    }
}

/// Context length when neither --max-context nor config.json gives one.
const FALLBACK_CONTEXT: usize = 4096;

/// Share of a CUDA device's memory the fast path takes when --gpu-memory-gb is not given (what
/// vLLM's `gpu_memory_utilization` defaults to): the rest is left to the CUDA context and other
/// processes.
const DEVICE_MEMORY_SHARE: f64 = 0.9;

/// Max batch where a memory budget bounds the KV cache (vLLM's `max_num_seqs` default): the
/// scheduler admits while the budget has room, up to this many sequences.
const BUDGETED_MAX_BATCH: usize = 256;

/// Max batch where the KV cache is sized as max batch × context (no budget).
const UNBUDGETED_MAX_BATCH: usize = 16;

/// The memory budget in bytes for weights + KV: `--gpu-memory-gb` when given, else (with the
/// device's free and total bytes) `DEVICE_MEMORY_SHARE` of the total, at most what is free.
fn memory_budget_bytes(gpu_memory_gb: Option<f64>, device: Option<(u64, u64)>) -> Result<Option<u64>> {
    match (gpu_memory_gb, device) {
        (Some(gb), _) if !(gb.is_finite() && gb > 0.0) => {
            bail!("--gpu-memory-gb must be a positive number, got {gb}")
        }
        (Some(gb), _) => Ok(Some((gb * 1e9) as u64)),
        (None, Some((free, total))) => Ok(Some(((total as f64 * DEVICE_MEMORY_SHARE) as u64).min(free))),
        (None, None) => Ok(None),
    }
}

/// `--max-batch`, or its default for a run with (or without) a memory budget.
fn resolve_max_batch(arg: Option<usize>, budgeted: bool) -> usize {
    arg.unwrap_or(if budgeted { BUDGETED_MAX_BATCH } else { UNBUDGETED_MAX_BATCH })
}

/// Runs the command.
pub fn serve_command(args: &ServeArgs) -> Result<()> {
    if matches!(args.device, ServeDevice::Auto | ServeDevice::Cuda) && !args.no_kernel_cache {
        keep_compiled_kernels(args.kernel_cache.as_deref(), args.device == ServeDevice::Cuda);
    }
    let supported = pw_hf::ModelConfig::from_dir(&args.model)
        .map_err(|e| e.to_string())
        .and_then(|c| pw_decode::DecodeConfig::from_model(&c).map(|_| ()).map_err(|e| e.to_string()));
    // Asked once: probing CUDA starts a context, and the fast path's loader needs the answer too.
    let cuda_ok = std::cell::OnceCell::new();
    let cuda = || *cuda_ok.get_or_init(cuda_answers);
    let fast = match choose_path(args, supported, cuda, hardware_wgpu) {
        Ok(fast) => fast,
        Err(why) => {
            eprintln!("serving through the Burn reference model: {why}");
            false
        }
    };
    if fast {
        // The fast path runs its own CubeCL kernels; the Burn backend type is unused.
        let on_cuda = args.device == ServeDevice::Cuda || (args.device == ServeDevice::Auto && cuda());
        return run::<burn_ndarray::NdArray<f32>>(args, &Default::default(), "cpu", Some(on_cuda));
    }
    match resolve(args.device) {
        ServeDevice::Auto | ServeDevice::Cpu => {
            run::<burn_ndarray::NdArray<f32>>(args, &Default::default(), "cpu", None)
        }
        #[cfg(feature = "wgpu")]
        ServeDevice::Wgpu => run::<burn_wgpu::Wgpu>(args, &burn_wgpu::WgpuDevice::default(), "wgpu", None),
        #[cfg(feature = "cuda")]
        ServeDevice::Cuda => run::<burn_cuda::Cuda>(args, &burn_cuda::CudaDevice::default(), "cuda", None),
        #[allow(unreachable_patterns)]
        other => bail!("this binary was built without the `{other:?}` backend (enable the cargo feature)"),
    }
}

/// Keeps the CUDA kernels NVRTC compiles in this build's directory under `root` (or the user's
/// cache directory), so the next start loads them; a cache that cannot be set up only costs the
/// compilation, so it is reported (`asked`: CUDA was asked for, else only a GPU that answers is
/// told about) and serving goes on.
#[cfg(feature = "cuda")]
fn keep_compiled_kernels(root: Option<&Path>, asked: bool) {
    let root = root.map(Path::to_path_buf).or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("pagedweight").join("kernels"))
    });
    let Some(root) = root else {
        eprintln!("no kernel cache: neither --kernel-cache, XDG_CACHE_HOME nor HOME is set");
        return;
    };
    match kernels_cubecl::kernel_cache::persist_cuda_kernels(&root) {
        Ok(dir) => eprintln!("compiled CUDA kernels kept in {}", dir.display()),
        Err(kernels_cubecl::kernel_cache::KernelCacheError::Driver(_)) if !asked => {}
        Err(e) => eprintln!("no kernel cache: {e}"),
    }
}

#[cfg(not(feature = "cuda"))]
fn keep_compiled_kernels(_root: Option<&Path>, _asked: bool) {}

/// Whether the fast path serves (`Ok(true)`), the reference model by request (`Ok(false)`), or
/// the reference model because the fast path cannot (`Err` with the reason): `--fast` and
/// `--reference` decide; `--device cpu` is the reference model; otherwise the fast path wherever
/// the decoder supports the model (`supported`) and, for `--device auto`, CUDA or a hardware
/// wgpu adapter answers.
fn choose_path(
    args: &ServeArgs,
    supported: Result<(), String>,
    cuda: impl Fn() -> bool,
    wgpu_gpu: impl Fn() -> bool,
) -> Result<bool, String> {
    if args.fast {
        return Ok(true);
    }
    if args.reference || args.device == ServeDevice::Cpu {
        return Ok(false);
    }
    supported.map_err(|e| format!("the fast path does not serve this model ({e})"))?;
    match args.device {
        ServeDevice::Auto if !(cuda() || wgpu_gpu()) => Err(
            "no CUDA device or hardware wgpu adapter answers (`--fast --device wgpu` runs the fast path on \
             software Vulkan)"
                .into(),
        ),
        _ => Ok(true),
    }
}

/// Whether a CUDA device answers.
#[cfg(feature = "cuda")]
fn cuda_answers() -> bool {
    cuda_works()
}

/// A build without CUDA has no CUDA device.
#[cfg(not(feature = "cuda"))]
fn cuda_answers() -> bool {
    false
}

/// Whether wgpu finds a hardware GPU adapter (Vulkan, Metal, DX12); a software one such as Mesa's
/// lavapipe does not count.
fn hardware_wgpu() -> bool {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::all(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    cubecl::future::block_on(instance.enumerate_adapters(wgpu::Backends::all())).iter().any(|a| {
        matches!(a.get_info().device_type, wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu)
    })
}

/// The device `auto` stands for.
fn resolve(kind: ServeDevice) -> ServeDevice {
    if kind != ServeDevice::Auto {
        return kind;
    }
    #[cfg(feature = "cuda")]
    if cuda_works() {
        return ServeDevice::Cuda;
    }
    if cfg!(feature = "wgpu") { ServeDevice::Wgpu } else { ServeDevice::Cpu }
}

/// The fast decoder's step size: the engine's token budget, halved (down to the earlier default
/// of 256) while its step buffers would take more than half of what a memory budget leaves
/// beside the dense weights, so a small budget keeps its room for experts and KV.
fn decoder_step_tokens(dc: &pw_decode::DecodeConfig, total: Option<u64>, engine_tokens: usize) -> usize {
    let mut tokens = engine_tokens.max(1);
    if let Some(total) = total {
        let room = total.saturating_sub(dc.dense_bytes()) / 2;
        while tokens > 256 && dc.step_scratch_bytes(tokens) > room {
            tokens = (tokens / 2).max(256);
        }
    }
    tokens
}

/// The fast-path model on CUDA or wgpu, the KV bytes the engine may reserve and the max batch.
fn fast_model(
    args: &ServeArgs,
    dir: &Path,
    max_context: usize,
    on_cuda: bool,
) -> Result<(Box<dyn StepModel>, String, u64, usize)> {
    let config = pw_hf::ModelConfig::from_dir(dir)?;
    let kv = pw_serve::KvLayout::from_config(&config, 2);
    if !on_cuda && args.device == ServeDevice::Cpu {
        bail!("--fast runs CubeCL kernels: use --device cuda, wgpu or auto");
    }
    if !pw_models::is_quantized_dir(dir) {
        say_proxies(dir);
    }
    let device_memory = if on_cuda { Some(cuda_memory()?) } else { None };
    let total = memory_budget_bytes(args.gpu_memory_gb, device_memory)?;
    let max_batch = resolve_max_batch(args.max_batch, total.is_some());
    let kv_budget_bytes =
        args.kv_budget_bytes.unwrap_or(kv.bytes_for(max_context).saturating_mul(max_batch.max(1) as u64));
    // The dense weights and the decoder's step buffers are not paged: the experts and the KV
    // cache share the rest.
    let dc = pw_decode::DecodeConfig::from_model(&config)?;
    let step_tokens = decoder_step_tokens(&dc, total, args.max_step_tokens.unwrap_or(2048.max(max_batch)));
    let budget = match total {
        Some(total) => {
            let (dense, scratch) = (dc.dense_bytes(), dc.step_scratch_bytes(step_tokens));
            let source = match args.gpu_memory_gb {
                Some(gb) => format!("--gpu-memory-gb {gb}"),
                None => {
                    format!("{:.0} % of the GPU's memory, at most what is free", DEVICE_MEMORY_SHARE * 100.0)
                }
            };
            Some(total.checked_sub(dense + scratch).with_context(|| {
                format!(
                    "the memory budget of {total} bytes ({source}) is less than the dense weights ({dense} bytes) \
                     and the decoder's step buffers ({scratch} bytes)"
                )
            })?)
        }
        None => None,
    };
    let options = pw_serve::FastOptions {
        bits: args.bits,
        kv_budget_bytes,
        max_batch,
        max_context,
        memory: args.planner.memory(budget),
        residual_head: !args.no_residual,
        max_step_tokens: step_tokens,
    };
    let what = match (budget, args.planner.policy) {
        (None, _) => format!("experts at {} bits", args.bits),
        (Some(b), Policy::Pinned) => format!("experts pinned, {b} bytes for experts + KV"),
        (Some(b), Policy::Planner) => format!("planner on, {b} bytes for experts + KV"),
    };
    #[cfg(feature = "cuda")]
    if on_cuda {
        use cubecl::Runtime;
        let client = cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0));
        let (m, cap) = pw_serve::load_fast(&client, dir, &options)?;
        return Ok((m, format!("cuda (fast path, {what})"), cap, max_batch));
    }
    use cubecl::Runtime;
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::DefaultDevice);
    let (m, cap) = pw_serve::load_fast(&client, dir, &options)?;
    Ok((m, format!("wgpu (fast path, {what})"), cap, max_batch))
}

/// Says that the Hugging Face checkpoint in `dir` has its experts quantized at load, so the
/// planner's sensitivities are proxies, and how to get calibrated ones.
fn say_proxies(dir: &Path) {
    eprintln!(
        "{}: a Hugging Face checkpoint: its experts are quantized at load with uniform importance, so the \
         planner's sensitivities are proxies (`pagedweight quantize --model DIR --out PW_DIR` writes \
         calibrated ones, and `serve --model PW_DIR` serves them)",
        dir.display()
    );
}

/// The Burn reference model over a PagedWeight checkpoint: its experts are pages under
/// `--memory-gb` (host bytes on ndarray) that the planner manages between steps. Returns the
/// model, its description, the KV bytes the engine may reserve and the max batch.
fn paged_reference_model<B: Backend>(
    args: &ServeArgs,
    dir: &Path,
    device: &B::Device,
    device_name: &str,
    max_context: usize,
) -> Result<(Box<dyn StepModel>, String, u64, usize)>
where
    B::Device: Send,
{
    let budget = match args.memory_gb {
        Some(gb) if !(gb.is_finite() && gb > 0.0) => bail!("--memory-gb must be a positive number, got {gb}"),
        Some(gb) => Some((gb * 1e9) as u64),
        None => None,
    };
    let max_batch = resolve_max_batch(args.max_batch, budget.is_some());
    let config = pw_hf::ModelConfig::from_dir(dir)?;
    let kv = pw_serve::KvLayout::from_config(&config, size_of::<B::FloatElem>() as u64);
    let kv_budget_bytes =
        args.kv_budget_bytes.unwrap_or(kv.bytes_for(max_context).saturating_mul(max_batch.max(1) as u64));
    let memory = args.planner.memory(budget);
    let (m, cap) = BurnStepModel::<B, AnyModel<B>>::load_paged(
        dir,
        device,
        args.bits,
        &memory,
        max_batch,
        kv_budget_bytes,
    )
    .context("loading the model")?;
    let what = match (budget, args.planner.policy) {
        (None, _) => "paged experts".to_string(),
        (Some(b), Policy::Pinned) => format!("paged experts pinned, {b} bytes for experts + KV"),
        (Some(b), Policy::Planner) => format!("paged experts, planner on, {b} bytes for experts + KV"),
    };
    Ok((Box::new(m), format!("{device_name} (reference path, {what})"), cap, max_batch))
}

/// Free and total bytes of CUDA device 0.
#[cfg(feature = "cuda")]
pub fn cuda_memory() -> Result<(u64, u64)> {
    pw_pages::device_memory(0).map_err(|e| anyhow::anyhow!("reading the GPU's memory: {}", e.0))
}

/// Without CUDA there is no device memory to read.
#[cfg(not(feature = "cuda"))]
pub fn cuda_memory() -> Result<(u64, u64)> {
    bail!("this binary was built without CUDA")
}

/// Whether a CUDA device answers (the CUDA runtime panics when there is none).
#[cfg(feature = "cuda")]
fn cuda_works() -> bool {
    use burn::tensor::Tensor;
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ok = std::panic::catch_unwind(|| {
        let d = burn_cuda::CudaDevice::default();
        let _ = Tensor::<burn_cuda::Cuda, 1>::zeros([1], &d).into_data();
    })
    .is_ok();
    std::panic::set_hook(hook);
    ok
}

/// Serves through the Burn model on `device`, or (`fast_on_cuda: Some(on_cuda)`) the fast path,
/// on CUDA when `on_cuda`, else wgpu.
fn run<B: Backend>(
    args: &ServeArgs,
    device: &B::Device,
    device_name: &str,
    fast_on_cuda: Option<bool>,
) -> Result<()>
where
    B::Device: Send,
{
    let dir = &args.model;
    if !dir.join("config.json").exists() {
        bail!(
            "{}: no config.json here; pass --model DIR with a Hugging Face model directory (config.json, \
             *.safetensors, tokenizer.json){}",
            dir.display(),
            if dir == Path::new(crate::DEFAULT_MODEL) {
                " — the default is the shipped model, run from the repository root"
            } else {
                ""
            }
        );
    }
    let t0 = Instant::now();
    let max_context = args.max_context.or_else(|| pw_serve::max_context(dir)).unwrap_or(FALLBACK_CONTEXT);
    if args.gpu_memory_gb.is_some() && fast_on_cuda.is_none() {
        bail!(
            "--gpu-memory-gb pages the experts of the fast decode path, which does not serve here (see above)"
        );
    }
    if args.memory_gb.is_some() && fast_on_cuda.is_some() {
        bail!("--memory-gb sizes the reference path's paged experts; the fast path takes --gpu-memory-gb");
    }
    let mut _scratch = None;
    let (model, device_name, kv_budget_bytes, max_batch): (Box<dyn StepModel>, String, u64, usize) =
        if let Some(on_cuda) = fast_on_cuda {
            fast_model(args, dir, max_context, on_cuda)?
        } else if pw_models::is_quantized_dir(dir) {
            paged_reference_model::<B>(args, dir, device, device_name, max_context)?
        } else {
            // Paged experts for a Hugging Face directory: its experts quantized into a
            // PagedWeight checkpoint in a directory that lives as long as the server.
            say_proxies(dir);
            let tmp = tempfile::tempdir().context("a directory for the quantized experts")?;
            pw_decode::write_quantized_hf(dir, tmp.path())
                .with_context(|| format!("{}: quantizing the experts", dir.display()))?;
            let paged = paged_reference_model::<B>(args, tmp.path(), device, device_name, max_context)?;
            _scratch = Some(tmp);
            paged
        };
    let tokenizer = Arc::new(pw_serve::load_tokenizer(dir)?);
    let chat = ChatTemplate::from_dir(dir)?;
    let eos_token_ids = pw_serve::eos_token_ids(dir)?;
    let kv = model.kv_layout().clone();
    let weight_bytes = model.weight_bytes();
    if fast_on_cuda.is_none() {
        // The reference path's KV cache lives in host memory.
        check_host_kv(kv_budget_bytes, max_context, max_batch, args)?;
    }
    let config = EngineConfig {
        admission: args.admission,
        kv_budget_bytes,
        max_batch,
        max_context,
        max_step_tokens: args.max_step_tokens.unwrap_or(2048.max(max_batch)),
        max_waiting: args.max_waiting,
        eos_token_ids,
    };
    let rec = UsageRecorder::default();
    let engine = Engine::start(model, tokenizer.clone(), config, Box::new(rec.clone()))?;
    let name = args.served_name.clone().unwrap_or_else(|| {
        dir.canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into())
    });
    eprintln!(
        "loaded {name} on {device_name} in {:.1} s: weights {weight_bytes} bytes, KV {} bytes/token, budget {kv_budget_bytes} bytes, context {max_context}, max batch {}",
        t0.elapsed().as_secs_f64(),
        kv.bytes_per_token(),
        max_batch
    );

    if let Some(prompt) = &args.once {
        return once(args, &engine, &tokenizer, chat.as_ref(), prompt, &rec);
    }

    let options = server_options(args)?;
    let state =
        Arc::new(ServerState::new(engine.handle(), tokenizer, chat, name.clone()).with_options(options));
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        println!("serving `{name}` at http://{addr}/v1 (OpenAI API; /health, /metrics)");
        println!(
            "try: curl http://{addr}/v1/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{name}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'"
        );
        serve(listener, state, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving HTTP")
    })?;
    engine.shutdown();
    Ok(())
}

/// The HTTP limits and key of `args`.
fn server_options(args: &ServeArgs) -> Result<ServerOptions> {
    let t = args.http_timeout_s;
    if !(t.is_finite() && t > 0.0) {
        bail!("--http-timeout-s must be a positive number of seconds, got {t}");
    }
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading --api-key-file {}", f.display()))?;
            Some(text.lines().next().unwrap_or("").trim().to_string())
        }
        (None, None) => None,
    };
    if api_key.as_ref().is_some_and(|k| k.is_empty()) {
        bail!("the API key is empty (--api-key / --api-key-file)");
    }
    let timeout = std::time::Duration::from_secs_f64(t);
    Ok(ServerOptions {
        api_key,
        header_timeout: timeout,
        body_timeout: timeout,
        metrics_per_page: args.metrics_per_page,
        ..Default::default()
    })
}

/// The CPU path's KV cache lives in host memory: refuse a budget the machine does not have
/// (Linux's `MemAvailable`; elsewhere nothing is checked).
fn check_host_kv(kv_budget_bytes: u64, max_context: usize, max_batch: usize, args: &ServeArgs) -> Result<()> {
    if let Some(available) = host_available_memory()
        && kv_budget_bytes > available
    {
        bail!(
            "the KV cache budget of {kv_budget_bytes} bytes ({}) exceeds the {available} bytes of memory \
             available: lower --max-context (now {max_context}, from max_position_embeddings of config.json \
             unless given), --max-batch ({}) or --kv-budget-bytes",
            if args.kv_budget_bytes.is_some() { "--kv-budget-bytes" } else { "context × max batch" },
            max_batch
        );
    }
    Ok(())
}

/// The host's available memory in bytes (Linux's `MemAvailable`; `None` elsewhere).
pub fn host_available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb.saturating_mul(1024))
}

/// Greedy completion of one prompt, streamed to stdout, then a summary.
fn once(
    args: &ServeArgs,
    engine: &Engine,
    tokenizer: &tokenizers::Tokenizer,
    chat: Option<&ChatTemplate>,
    prompt: &str,
    rec: &UsageRecorder,
) -> Result<()> {
    let ids = if args.chat {
        let Some(t) = chat else { bail!("{}: the model has no chat template", args.model.display()) };
        let text = t.render(&[ChatMessage { role: "user".into(), content: prompt.to_string() }], true)?;
        tokenizer.encode(text, false)
    } else {
        tokenizer.encode(prompt, true)
    }
    .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
    .get_ids()
    .to_vec();
    let h = engine.handle();
    let room = h.config().max_context.saturating_sub(ids.len());
    let params =
        SamplingParams { temperature: 0.0, max_tokens: args.max_tokens.min(room), ..Default::default() };
    let t0 = Instant::now();
    let mut stream = h.submit(GenerateRequest { prompt: ids, params })?;
    let mut out = std::io::stdout().lock();
    let mut first_token = None;
    let (usage, reason) = loop {
        match stream.blocking_next() {
            Some(Event::Token { text, .. }) => {
                first_token.get_or_insert_with(Instant::now);
                write!(out, "{text}")?;
                out.flush()?;
            }
            Some(Event::Done { text, reason, usage }) => {
                writeln!(out, "{text}")?;
                break (usage, reason);
            }
            Some(Event::Failed(msg)) => bail!("generation failed: {msg}"),
            None => bail!("the engine stopped"),
        }
    };
    let total = t0.elapsed().as_secs_f64();
    let decode = first_token.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let tok_s = if decode > 0.0 { (usage.completion_tokens.saturating_sub(1)) as f64 / decode } else { 0.0 };
    let r = rec.record();
    writeln!(
        out,
        "-- {} prompt + {} generated tokens ({}), {:.1} tok/s decode, {:.2} s total; KV {} bytes at peak; weights {} bytes",
        usage.prompt_tokens,
        usage.completion_tokens,
        reason.as_str(),
        tok_s,
        total,
        r.peak_kv_bytes_used,
        h.weight_bytes()
    )?;
    if let Some(mem) = h.metrics().snapshot().memory {
        writeln!(out, "{}", memory_summary(&mem))?;
    }
    Ok(())
}

/// One line on the paged memory: budget, KV blocks, expert bytes per bit-width, page moves.
pub fn memory_summary(m: &pw_serve::MemoryState) -> String {
    let mix: Vec<String> = m
        .weight_bytes_by_bits
        .iter()
        .enumerate()
        .filter(|(_, n)| **n > 0)
        .map(|(b, n)| format!("{b}-bit {:.2} MB", *n as f64 / 1e6))
        .collect();
    format!(
        "-- memory: budget {:.2} MB for experts + KV; experts {:.2} MB (mean {:.2} bits: {}); KV {} blocks used, {} free \
         ({} bytes each); page moves {} down / {} up; plans {} lower / {} raise",
        m.budget_bytes as f64 / 1e6,
        m.weight_bytes() as f64 / 1e6,
        m.mean_bits(),
        mix.join(", "),
        m.kv_blocks_used,
        m.kv_blocks_free,
        m.block_bytes,
        m.page_moves_down_total,
        m.page_moves_up_total,
        m.planner_lower_total,
        m.planner_raise_total
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// --gpu-memory-gb wins; without it a CUDA device's budget is the share of its total, capped
    /// by what is free; without either there is none; a non-positive or non-finite value is refused.
    #[test]
    fn memory_budget_defaults_to_the_device() {
        let gb = 1_000_000_000u64;
        assert_eq!(memory_budget_bytes(Some(2.5), Some((100 * gb, 141 * gb))).unwrap(), Some(5 * gb / 2));
        assert_eq!(
            memory_budget_bytes(None, Some((140 * gb, 141 * gb))).unwrap(),
            Some((141.0 * 1e9 * DEVICE_MEMORY_SHARE) as u64)
        );
        assert_eq!(memory_budget_bytes(None, Some((50 * gb, 141 * gb))).unwrap(), Some(50 * gb));
        assert_eq!(memory_budget_bytes(None, None).unwrap(), None);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = memory_budget_bytes(Some(bad), None).unwrap_err().to_string();
            assert!(e.contains("--gpu-memory-gb"), "{e}");
        }
    }

    /// `serve` with these arguments, as clap parses them.
    fn try_parse(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        <Cli as clap::Parser>::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|c| c.serve)
    }

    fn parse(args: &[&str]) -> ServeArgs {
        try_parse(args).unwrap()
    }

    /// The fast path is the default wherever a GPU answers and the decoder supports the model;
    /// the flags and `--device cpu` override it; the reasons for the reference model say why.
    #[test]
    fn fast_path_is_the_default_where_a_gpu_answers() {
        let yes = || true;
        let no = || false;
        let ok = || Ok(());
        let unsupported = || Err("no decoder for `llama`".to_string());
        let auto = parse(&[]);
        assert_eq!(choose_path(&auto, ok(), yes, no), Ok(true));
        assert_eq!(choose_path(&auto, ok(), no, yes), Ok(true));
        let why = choose_path(&auto, ok(), no, no).unwrap_err();
        assert!(why.contains("no CUDA device or hardware wgpu adapter"), "{why}");
        let why = choose_path(&auto, unsupported(), yes, yes).unwrap_err();
        assert!(why.contains("llama"), "{why}");
        // Asked for by name: the fast path on that device, whatever answers.
        assert_eq!(choose_path(&parse(&["--device", "wgpu"]), ok(), no, no), Ok(true));
        assert_eq!(choose_path(&parse(&["--fast"]), unsupported(), no, no), Ok(true));
        // The reference model by request.
        assert_eq!(choose_path(&parse(&["--reference"]), ok(), yes, yes), Ok(false));
        assert_eq!(choose_path(&parse(&["--device", "cpu"]), ok(), yes, yes), Ok(false));
        assert!(try_parse(&["--fast", "--reference"]).is_err(), "--fast and --reference conflict");
    }

    /// The max batch follows the memory budget unless given.
    #[test]
    fn max_batch_follows_the_budget() {
        assert_eq!(resolve_max_batch(None, true), BUDGETED_MAX_BATCH);
        assert_eq!(resolve_max_batch(None, false), UNBUDGETED_MAX_BATCH);
        assert_eq!(resolve_max_batch(Some(3), true), 3);
        assert_eq!(resolve_max_batch(Some(40), false), 40);
    }
}
