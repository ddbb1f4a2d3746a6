//! `pagedweight quantize`: a Hugging Face MoE checkpoint → a quantized PagedWeight checkpoint,
//! with diagonal-Fisher importance from calibration text (`pw_calib` does the work).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use indicatif::ProgressBar;
use pw_calib::{QuantizeConfig, Stage, quantize_model};

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
    /// Backend of the gradient pass.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
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
    let cfg = QuantizeConfig {
        min_bits: args.min_bits,
        max_bits: args.max_bits,
        ctx: args.ctx,
        calib_tokens: args.calib_tokens,
    };
    let mut current: Option<(Stage, ProgressBar)> = None;
    let report = quantize_model::<Autodiff<B>>(&args.model, &args.out, &ids, &cfg, device, |p| {
        if current.as_ref().map(|c| c.0) != Some(p.stage) {
            if let Some((_, pb)) = current.take() {
                pb.finish();
            }
            let what = match p.stage {
                Stage::Loading => "loading",
                Stage::Gradients => "gradients",
                Stage::Quantizing => "quantizing",
                Stage::Copying => "copying",
            };
            current = Some((p.stage, bar(p.total, what)));
        }
        if let Some((_, pb)) = &current {
            pb.set_position(p.done as u64);
        }
    })
    .with_context(|| format!("quantizing {} into {}", args.model.display(), args.out.display()))?;
    if let Some((_, pb)) = current {
        pb.finish();
    }
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
        })
    );
    Ok(())
}
