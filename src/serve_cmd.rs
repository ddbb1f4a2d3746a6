//! `pagedweight serve` / `cargo run --example mixtral_serve`: load a model, start the engine,
//! and serve the OpenAI-compatible API (or answer one prompt with `--once`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use pw_models::AnyModel;
use pw_serve::server::{ServerState, serve};
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
    /// from tokenizer_config.json).
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
    /// KV-cache budget in bytes: requests wait until their prompt + max_tokens fit
    /// (default: every batch slot at the full context).
    #[arg(long)]
    pub kv_budget_bytes: Option<u64>,
    /// Most sequences decoded together.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Context length (default: `max_position_embeddings` of config.json).
    #[arg(long)]
    pub max_context: Option<usize>,
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
    /// Serve through the fast decode path (fused CubeCL kernels over the paged KV cache and
    /// any-precision experts; Mixtral architecture): CUDA with `--device cuda` (or `auto` in a
    /// CUDA build with a GPU), wgpu otherwise.
    #[arg(long)]
    pub fast: bool,
    /// With --fast: the bit-width (3..8) every expert is quantized to and committed at.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(3..=8))]
    pub bits: u8,
}

/// Context length when neither --max-context nor config.json gives one.
const FALLBACK_CONTEXT: usize = 4096;

/// Runs the command.
pub fn serve_command(args: &ServeArgs) -> Result<()> {
    if args.fast {
        // The fast path runs its own CubeCL kernels; the Burn backend type is unused.
        return run::<burn_ndarray::NdArray<f32>>(args, &Default::default(), "cpu");
    }
    match resolve(args.device) {
        ServeDevice::Auto | ServeDevice::Cpu => {
            run::<burn_ndarray::NdArray<f32>>(args, &Default::default(), "cpu")
        }
        #[cfg(feature = "wgpu")]
        ServeDevice::Wgpu => run::<burn_wgpu::Wgpu>(args, &burn_wgpu::WgpuDevice::default(), "wgpu"),
        #[cfg(feature = "cuda")]
        ServeDevice::Cuda => run::<burn_cuda::Cuda>(args, &burn_cuda::CudaDevice::default(), "cuda"),
        #[allow(unreachable_patterns)]
        other => bail!("this binary was built without the `{other:?}` backend (enable the cargo feature)"),
    }
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

/// The fast-path model on CUDA or wgpu, with a KV cache for the budget the engine will use.
fn fast_model(args: &ServeArgs, dir: &Path, max_context: usize) -> Result<(Box<dyn StepModel>, String)> {
    let config = pw_hf::ModelConfig::from_dir(dir)?;
    let kv = pw_serve::KvLayout::from_config(&config, 2);
    let budget = args.kv_budget_bytes.unwrap_or(kv.bytes_for(max_context) * args.max_batch.max(1) as u64);
    #[cfg(feature = "cuda")]
    if args.device == ServeDevice::Cuda || (args.device == ServeDevice::Auto && cuda_works()) {
        use cubecl::Runtime;
        let client = cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0));
        let m = pw_serve::load_fast(&client, dir, args.bits, budget, args.max_batch, max_context)?;
        return Ok((m, format!("cuda (fast path, experts at {} bits)", args.bits)));
    }
    if args.device == ServeDevice::Cpu {
        bail!("--fast runs CubeCL kernels: use --device cuda, wgpu or auto");
    }
    use cubecl::Runtime;
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::DefaultDevice);
    let m = pw_serve::load_fast(&client, dir, args.bits, budget, args.max_batch, max_context)?;
    Ok((m, format!("wgpu (fast path, experts at {} bits)", args.bits)))
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

fn run<B: Backend>(args: &ServeArgs, device: &B::Device, device_name: &str) -> Result<()>
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
    let (model, device_name): (Box<dyn StepModel>, String) = if args.fast {
        fast_model(args, dir, max_context)?
    } else {
        let m = BurnStepModel::<B, AnyModel<B>>::load(dir, device).context("loading the model")?;
        (Box::new(m), device_name.to_string())
    };
    let tokenizer = Arc::new(pw_serve::load_tokenizer(dir)?);
    let chat = ChatTemplate::from_dir(dir)?;
    let eos_token_ids = pw_serve::eos_token_ids(dir)?;
    let kv = model.kv_layout().clone();
    let weight_bytes = model.weight_bytes();
    let kv_budget_bytes =
        args.kv_budget_bytes.unwrap_or(kv.bytes_for(max_context) * args.max_batch.max(1) as u64);
    let config = EngineConfig {
        kv_budget_bytes,
        max_batch: args.max_batch,
        max_context,
        max_prefill_tokens: 2048,
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
        args.max_batch
    );

    if let Some(prompt) = &args.once {
        return once(args, &engine, &tokenizer, chat.as_ref(), prompt, &rec);
    }

    let state = Arc::new(ServerState::new(engine.handle(), tokenizer, chat, name.clone()));
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
    Ok(())
}
