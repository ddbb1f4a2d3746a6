//! The `pagedweight` command-line tool: one binary, one subcommand per job.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use pw_format::{ApBlock, Checkpoint, MANIFEST_FILE, StFile};
use std::path::{Path, PathBuf};

mod eval_cmd;
mod models_cmd;
mod quantize_cmd;

use pagedweight::DEFAULT_MODEL;

#[derive(Parser)]
#[command(
    name = "pagedweight",
    version,
    about = "Serve Mixture-of-Experts LLMs with pageable any-precision expert weights"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a quantized checkpoint's manifest: its blocks, their bit range and
    /// the bytes the experts need on the device at each bit-width.
    ///
    /// PATH is a checkpoint directory (with pagedweight.json) or a single
    /// .safetensors file written by `quantize-tensor`.
    Inspect {
        /// Checkpoint directory or block file.
        path: PathBuf,
        /// List every block, not only the totals.
        #[arg(long)]
        blocks: bool,
    },
    /// Quantize one 2-D tensor to the any-precision format (3..8 nested bits)
    /// and print, per bit-width, the relative Frobenius error ‖W − Ŵ_b‖/‖W‖
    /// as JSON lines {"bits":b,"rel_err":x}.
    QuantizeTensor(QuantizeTensorArgs),
    /// Run a Hugging Face MoE checkpoint once over the prompt and write its logits
    /// (f32 tensor `logits` [T, V]) to a safetensors file.
    Logits(models_cmd::LogitsArgs),
    /// Stream a completion of a prompt from a Hugging Face MoE checkpoint.
    Generate(models_cmd::GenerateArgs),
    /// Quantize a Hugging Face MoE checkpoint (Mixtral, Qwen2-MoE, Gemma-4) into a PagedWeight
    /// checkpoint: expert blocks become any-precision blocks weighted by a diagonal Fisher
    /// estimate over calibration text; every other tensor is copied unchanged.
    Quantize(quantize_cmd::QuantizeArgs),
    /// Token perplexity over a text file in disjoint windows; prints
    /// {"ppl":…,"tokens":…,"expert_bytes":…}. Accepts quantized checkpoints (--bits).
    EvalPpl(eval_cmd::EvalPplArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching), or complete
    /// one prompt with --once.
    Serve(pagedweight::serve_cmd::ServeArgs),
    /// Plot a `bench-serve` record: the experts' bit mix, the memory split (experts, KV, the
    /// budget) and the requests queued and running over time, one PNG per run.
    Plot(pagedweight::plot_cmd::PlotArgs),
}

#[derive(clap::Args)]
struct QuantizeTensorArgs {
    /// Safetensors file holding the tensor (f32, f16 or bf16).
    #[arg(long)]
    input: PathBuf,
    /// Name of the 2-D tensor `[rows, cols]` (rows = outputs).
    #[arg(long)]
    tensor: String,
    /// Per-weight importance (e.g. a Fisher diagonal) of the same shape, as
    /// FILE.safetensors:NAME. Default: all ones.
    #[arg(long)]
    importance: Option<String>,
    /// Output safetensors file holding `NAME.planes` and `NAME.lut{b}`.
    #[arg(long)]
    out: PathBuf,
    /// Lowest stored bit-width.
    #[arg(long, default_value_t = 3)]
    min_bits: u8,
    /// Highest stored bit-width.
    #[arg(long, default_value_t = 8)]
    max_bits: u8,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Inspect { path, blocks } => inspect(&path, blocks),
        Command::QuantizeTensor(args) => quantize_tensor(&args),
        Command::Logits(args) => models_cmd::logits(&args),
        Command::Generate(args) => models_cmd::generate(&args),
        Command::Quantize(args) => quantize_cmd::quantize(&args),
        Command::EvalPpl(args) => eval_cmd::eval_ppl(&args),
        Command::Serve(args) => pagedweight::serve_cmd::serve_command(&args),
        Command::Plot(args) => {
            for png in pagedweight::plot_cmd::plot(&args)? {
                println!("{}", png.display());
            }
            Ok(())
        }
    }
}

/// Loads a 2-D float tensor as f32.
fn load_matrix(path: &Path, name: &str) -> Result<(Vec<f32>, usize, usize)> {
    let file = StFile::open(path)?;
    let (data, shape) = file.to_f32(name)?;
    let [rows, cols] = shape[..] else {
        bail!("{}: tensor `{name}` has shape {shape:?}, expected 2 dimensions", path.display());
    };
    Ok((data, rows, cols))
}

fn quantize_tensor(a: &QuantizeTensorArgs) -> Result<()> {
    let (w, rows, cols) = load_matrix(&a.input, &a.tensor)?;
    let importance = match &a.importance {
        None => None,
        Some(spec) => {
            let (file, name) = spec
                .rsplit_once(':')
                .with_context(|| format!("--importance {spec:?}: expected FILE:NAME"))?;
            let (imp, r, c) = load_matrix(Path::new(file), name)?;
            if (r, c) != (rows, cols) {
                bail!("{file}: importance `{name}` is {r}x{c}, but `{}` is {rows}x{cols}", a.tensor);
            }
            Some(imp)
        }
    };
    let block = ApBlock::quantize(&a.tensor, &w, importance.as_deref(), rows, cols, a.min_bits, a.max_bits)?;

    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pagedweight-block".to_string());
    meta.insert("block".to_string(), a.tensor.clone());
    meta.insert("shape".to_string(), format!("[{rows},{cols}]"));
    meta.insert("bits".to_string(), format!("[{},{}]", a.min_bits, a.max_bits));
    meta.insert("sensitivity".to_string(), serde_json::to_string(&block.sensitivity)?);
    pw_format::write_tensors(&a.out, &block.tensors(&a.tensor), Some(meta))?;

    let norm: f64 = w.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt();
    for bits in a.min_bits..=a.max_bits {
        let deq = block.dequantize_reference(bits);
        let err: f64 = w.iter().zip(&deq).map(|(&x, &y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
        let rel = if norm > 0.0 { err / norm } else { err };
        println!("{}", serde_json::json!({ "bits": bits, "rel_err": rel }));
    }
    Ok(())
}

fn inspect(path: &Path, list_blocks: bool) -> Result<()> {
    if path.is_dir() {
        let ck = Checkpoint::open(path)?;
        let m = ck.manifest();
        println!("checkpoint {} (format version {})", path.display(), m.version);
        println!("model_type: {}", m.model_type.as_deref().unwrap_or("unknown"));
        println!("blocks: {}  dense tensors: {}", m.blocks.len(), m.dense.len());
        let Some((lo, hi)) = m.bit_range() else {
            println!("no any-precision blocks");
            return Ok(());
        };
        println!("bit range shared by all blocks: {lo}..={hi}");
        if list_blocks {
            for b in &m.blocks {
                println!(
                    "  {:<60} layer {:>3} expert {:>3} {:>7?} {}x{} bits {}..={} sens@{} {:.4e}",
                    b.name,
                    b.layer,
                    b.expert,
                    b.kind,
                    b.rows,
                    b.cols,
                    b.min_bits,
                    b.max_bits,
                    b.max_bits,
                    b.sensitivity.last().copied().unwrap_or(0.0)
                );
            }
        }
        print_bytes_table(lo, hi, |bits| m.blocks.iter().map(|b| b.bytes_at(bits)).fold((0, 0), add));
    } else {
        let file = StFile::open(path)?;
        let meta = file.metadata().cloned().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some("pagedweight-block") {
            bail!(
                "{}: not a checkpoint directory (no {MANIFEST_FILE}) nor a block file from `quantize-tensor`",
                path.display()
            );
        }
        let field = |k: &str| {
            meta.get(k).with_context(|| format!("{}: metadata field `{k}` missing", path.display()))
        };
        let name = field("block")?;
        let [rows, cols]: [usize; 2] = serde_json::from_str(field("shape")?)?;
        let [lo, hi]: [u8; 2] = serde_json::from_str(field("bits")?)?;
        let sens: Vec<f64> = serde_json::from_str(field("sensitivity")?)?;
        let block = ApBlock::read(&file, name, rows, cols, lo, hi, sens)?;
        println!("block `{name}` {rows}x{cols}, bits {lo}..={hi}");
        for bits in lo..=hi {
            println!("  sensitivity at {bits} bits: {:.6e}", block.sensitivity_at(bits));
        }
        print_bytes_table(lo, hi, |bits| block.bytes_at(bits));
    }
    Ok(())
}

fn add(a: (usize, usize), b: (usize, usize)) -> (usize, usize) {
    (a.0 + b.0, a.1 + b.1)
}

fn print_bytes_table(lo: u8, hi: u8, bytes: impl Fn(u8) -> (usize, usize)) {
    println!("{:>5} {:>14} {:>14} {:>14}", "bits", "plane bytes", "lut bytes", "total");
    for bits in lo..=hi {
        let (p, l) = bytes(bits);
        println!("{bits:>5} {p:>14} {l:>14} {:>14}", p + l);
    }
}
