//! `pagedweight eval-ppl`: token perplexity of a model (Hugging Face or quantized checkpoint)
//! over a text file, with the window convention of `pw_models::eval`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use indicatif::{ProgressBar, ProgressStyle};
use pw_models::eval::{perplexity, token_windows};
use pw_models::{CausalLm, LoadedModel};

use crate::models_cmd::{DeviceKind, load_tokenizer, on_device};

/// Arguments of `pagedweight eval-ppl`.
#[derive(clap::Args, Debug)]
pub struct EvalPplArgs {
    /// Model directory: a Hugging Face checkpoint or a quantized one (pagedweight.json).
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// UTF-8 text file, tokenized whole with the model's tokenizer.json (no special tokens).
    #[arg(long)]
    pub text: PathBuf,
    /// Tokens per window; each window is an independent sequence.
    #[arg(long, default_value_t = 256)]
    pub ctx: usize,
    /// Backend.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Bit-width of every expert (quantized checkpoints only; default: the highest stored).
    #[arg(long)]
    pub bits: Option<u8>,
    /// Evaluate only the first N tokens of the text (default: all).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Windows per forward pass: the same result from fewer, larger operations. It measured
    /// no faster on the CPU backend (hence 1); on a GPU it cuts per-operation overhead.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
}

/// Prints `{"ppl":…, "tokens":…, "expert_bytes":…}` for the model on the text.
pub fn eval_ppl(args: &EvalPplArgs) -> Result<()> {
    on_device!(args.device, eval_on, args)
}

/// Reads `path` and tokenizes it whole with `model_dir/tokenizer.json`, without special tokens.
pub(crate) fn tokenize_text_file(model_dir: &Path, path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let tok = load_tokenizer(model_dir)?;
    Ok(tok
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", path.display()))?
        .get_ids()
        .to_vec())
}

/// A progress bar on stderr.
pub(crate) fn bar(len: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({elapsed} < {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn eval_on<B: Backend>(args: &EvalPplArgs, device: &B::Device) -> Result<()> {
    if args.ctx < 2 {
        bail!("--ctx {}: a window needs at least 2 tokens", args.ctx);
    }
    let mut ids = tokenize_text_file(&args.model, &args.text)?;
    if let Some(n) = args.max_tokens {
        ids.truncate(n);
    }
    if ids.len() < 2 {
        bail!("{} has {} tokens; at least 2 are needed", args.text.display(), ids.len());
    }
    let loaded = LoadedModel::<B>::load(&args.model, args.bits, device)
        .with_context(|| format!("loading the model in {}", args.model.display()))?;
    let vocab = loaded.model.vocab_size();
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} of {} is outside the model's vocabulary of {vocab}", args.text.display());
    }
    let pb = bar(token_windows(&ids, args.ctx).len(), "windows");
    let result = perplexity(&loaded.model, &ids, args.ctx, args.batch, device, |n| pb.inc(n as u64));
    pb.finish_and_clear();
    // Written by hand to keep the documented key order (serde_json sorts keys).
    println!(
        "{{\"ppl\":{},\"tokens\":{},\"expert_bytes\":{}}}",
        serde_json::to_string(&result.ppl())?,
        result.tokens,
        loaded.expert_bytes
    );
    Ok(())
}
