//! `pagedweight quantize`: a Hugging Face MoE checkpoint → a quantized PagedWeight checkpoint,
//! with importance from calibration text: diagonal Fisher where it fits the device's memory,
//! else the layer-streamed input moments (`pw_calib` does the work).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use indicatif::{MultiProgress, ProgressBar};
use pw_calib::{ImportanceMethod, QuantizeConfig, Stage, quantize_model};

use crate::eval_cmd::{bar, tokenize_text_file};
use crate::models_cmd::{DeviceKind, on_device};

/// Arguments of `pagedweight quantize`.
#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json).
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Output checkpoint directory (created).
    #[arg(long)]
    pub out: PathBuf,
    /// Calibration text. Default: calib.txt in the model directory.
    #[arg(long)]
    pub calib: Option<PathBuf>,
    /// Calibration tokens used at most (from the start of the text).
    #[arg(long, default_value_t = 16384)]
    pub calib_tokens: usize,
    /// Tokens per calibration window; each window is one example of the Fisher estimate.
    #[arg(long, default_value_t = 256)]
    pub ctx: usize,
    /// Lowest stored bit-width.
    #[arg(long, default_value_t = 3)]
    pub min_bits: u8,
    /// Highest stored bit-width.
    #[arg(long, default_value_t = 8)]
    pub max_bits: u8,
    /// Worker threads for the quantizer and the CPU backend (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Backend of the importance pass.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Importance of the expert weights: `fisher` (gradients through the whole model),
    /// `streamed` (each expert's input second moments, one layer in memory at a time) or
    /// `auto` (Fisher when its estimated memory fits the device's).
    #[arg(long, value_enum, default_value_t = Importance::Auto)]
    pub importance: Importance,
    /// Memory `auto` may use, in GB. Default: the free memory of the CUDA device with
    /// `--device cuda`, else the host's available memory.
    #[arg(long)]
    pub memory_gb: Option<f64>,
}

/// `--importance`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Importance {
    /// Fisher when it fits, else streamed.
    Auto,
    /// Diagonal Fisher.
    Fisher,
    /// Layer-streamed input second moments.
    Streamed,
}

/// Quantizes the model and prints a one-line JSON summary.
pub fn quantize(args: &QuantizeArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting --threads")?;
    }
    on_device!(args.device, quantize_on, args)
}

fn quantize_on<B: Backend>(args: &QuantizeArgs, device: &B::Device) -> Result<()> {
    let calib = args.calib.clone().unwrap_or_else(|| args.model.join("calib.txt"));
    if !calib.is_file() {
        bail!(
            "calibration text {} not found{}",
            calib.display(),
            if args.calib.is_none() { " (the default beside the model; give --calib FILE)" } else { "" }
        );
    }
    let ids = tokenize_text_file(&args.model, &calib)?;
    let importance = match args.importance {
        Importance::Fisher => ImportanceMethod::Fisher,
        Importance::Streamed => ImportanceMethod::Streamed,
        Importance::Auto => ImportanceMethod::Auto { memory_bytes: memory_bytes(args)? },
    };
    let cfg = QuantizeConfig {
        min_bits: args.min_bits,
        max_bits: args.max_bits,
        ctx: args.ctx,
        calib_tokens: args.calib_tokens,
        importance,
        ..QuantizeConfig::default()
    };
    // One bar per stage: with the streamed importance, quantizing runs beside the layer pass.
    let bars = MultiProgress::new();
    let mut stages: Vec<(Stage, ProgressBar, f64)> = Vec::new();
    let start = std::time::Instant::now();
    let report = quantize_model::<Autodiff<B>>(&args.model, &args.out, &ids, &cfg, device, |p| {
        let i = match stages.iter().position(|s| s.0 == p.stage) {
            Some(i) => i,
            None => {
                stages.push((p.stage, bars.add(bar(p.total, stage_name(p.stage))), 0.0));
                stages.len() - 1
            }
        };
        let (_, pb, end) = &mut stages[i];
        pb.set_position(p.done as u64);
        *end = start.elapsed().as_secs_f64();
    })
    .with_context(|| format!("quantizing {} into {}", args.model.display(), args.out.display()))?;
    let round = |s: f64| serde_json::Value::from((s * 10.0).round() / 10.0);
    // When each stage's last unit finished, in seconds from the start.
    let ended: serde_json::Map<String, serde_json::Value> = stages
        .into_iter()
        .map(|(stage, pb, end)| {
            pb.finish();
            (stage_name(stage).to_string(), round(end))
        })
        .collect();
    let m = &report.manifest;
    println!(
        "{}",
        serde_json::json!({
            "out": args.out.display().to_string(),
            "blocks": m.blocks.len(),
            "dense_tensors": m.dense.len(),
            "calib_windows": report.windows,
            "calib_tokens": report.tokens,
            "calib_loss": report.calib_loss,
            "importance": report.importance.name(),
            "stage_ended_s": ended,
            "wall_s": round(start.elapsed().as_secs_f64()),
            "memory_needed": { "fisher": report.memory.fisher, "streamed": report.memory.streamed },
            "memory_available": match importance {
                ImportanceMethod::Auto { memory_bytes } => Some(memory_bytes),
                _ => None,
            },
        })
    );
    Ok(())
}

fn stage_name(stage: Stage) -> &'static str {
    match stage {
        Stage::Loading => "loading",
        Stage::Gradients => "gradients",
        Stage::Moments => "layers (streamed importance)",
        Stage::Quantizing => "quantizing",
        Stage::Copying => "copying",
    }
}

/// What `--importance auto` may use: `--memory-gb`, else the CUDA device's free memory, else the
/// host's available memory.
fn memory_bytes(args: &QuantizeArgs) -> Result<u64> {
    if let Some(gb) = args.memory_gb {
        if !(gb.is_finite() && gb > 0.0) {
            bail!("--memory-gb {gb}: must be a positive number of GB");
        }
        return Ok((gb * 1e9) as u64);
    }
    if args.device == DeviceKind::Cuda {
        return Ok(pagedweight::serve_cmd::cuda_memory()?.0);
    }
    pagedweight::serve_cmd::host_available_memory()
        .context("reading the host's available memory (/proc/meminfo); give --memory-gb")
}
