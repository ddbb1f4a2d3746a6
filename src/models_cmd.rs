//! `pagedweight logits` and `pagedweight generate`: run a Hugging Face MoE checkpoint
//! (Mixtral, Qwen1.5-MoE, Gemma-4) with its tokenizer and chat template.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use pw_models::generate::ids_tensor;
use pw_models::{AnyModel, CausalLm, LoadedModel, PagedOptions, Sampler, SamplingConfig, is_quantized_dir};
use tokenizers::Tokenizer;

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// Burn's ndarray backend on the CPU.
    Cpu,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
}

/// Arguments of `pagedweight logits`.
#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    /// Hugging Face model directory (config.json + safetensors).
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt", value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Text to tokenize with the model's tokenizer.json (special tokens added).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Output safetensors file: f32 tensor `logits` of shape [T, V].
    #[arg(long)]
    pub out: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
}

/// Arguments of `pagedweight generate`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json).
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Extra stop token ids, besides the model's end-of-sequence ids.
    #[arg(long, value_delimiter = ',')]
    pub stop: Vec<u32>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Quantized checkpoint only: run the experts paged (planes + LUTs in a page table on the
    /// device, the grouped kernel on GPU backends) with every page at this bit-width.
    #[arg(long)]
    pub bits: Option<u8>,
    /// Quantized checkpoint only: run the experts paged under this weight budget (GB = 10^9
    /// bytes, the page table's memory accountant); the bits are the highest uniform width
    /// that fits (with --bits: that width, or an error).
    #[arg(long)]
    pub weight_budget_gb: Option<f64>,
}

/// Calls `$f::<Backend>(args, &device)` for the chosen device.
macro_rules! on_device {
    ($kind:expr, $f:ident, $args:expr) => {
        match $kind {
            DeviceKind::Cpu => $f::<burn_ndarray::NdArray<f32>>($args, &Default::default()),
            #[cfg(feature = "wgpu")]
            DeviceKind::Wgpu => $f::<burn_wgpu::Wgpu>($args, &burn_wgpu::WgpuDevice::default()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => $f::<burn_cuda::Cuda>($args, &burn_cuda::CudaDevice::default()),
            #[allow(unreachable_patterns)]
            other => {
                bail!("this binary was built without the `{other:?}` backend (enable the cargo feature)")
            }
        }
    };
}

pub(crate) use on_device;

/// Writes the logits of one forward pass over the prompt.
pub fn logits(args: &LogitsArgs) -> Result<()> {
    on_device!(args.device, logits_on, args)
}

/// Streams a completion of the prompt to stdout.
pub fn generate(args: &GenerateArgs) -> Result<()> {
    on_device!(args.device, generate_on, args)
}

fn load_model<B: Backend>(dir: &Path, device: &B::Device) -> Result<AnyModel<B>> {
    AnyModel::<B>::load(dir, device).with_context(|| format!("loading the model in {}", dir.display()))
}

pub(crate) fn load_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("cannot load {}: {e}", path.display()))
}

fn logits_on<B: Backend>(args: &LogitsArgs, device: &B::Device) -> Result<()> {
    let ids = match (&args.ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(p)) => encode(&load_tokenizer(&args.model)?, p, true)?,
        (None, None) => bail!("give --ids or --prompt"),
    };
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    let model = load_model::<B>(&args.model, device)?;
    let vocab = model.vocab_size();
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    let mut cache = model.new_cache();
    let out = model.forward(ids_tensor::<B>(&ids, device), &mut cache, None);
    let [_, t, v] = out.dims();
    let data: Vec<f32> =
        out.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    write_logits(&args.out, &data, t, v)
}

fn write_logits(path: &Path, data: &[f32], t: usize, v: usize) -> Result<()> {
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![t, v], &bytes)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    safetensors::serialize_to_file(vec![("logits", view)], None, path)
        .with_context(|| format!("writing {}", path.display()))
}

fn encode(tok: &Tokenizer, text: &str, add_special: bool) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, add_special)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec())
}

fn generate_on<B: Backend>(args: &GenerateArgs, device: &B::Device) -> Result<()> {
    let tok = load_tokenizer(&args.model)?;
    let prompt_ids = if args.chat {
        let text = render_chat(&args.model, &args.prompt)?;
        // The template already holds the BOS and role markers.
        encode(&tok, &text, false)?
    } else {
        encode(&tok, &args.prompt, true)?
    };
    if prompt_ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    let mut stop = pw_serve::eos_token_ids(&args.model)?;
    stop.extend(&args.stop);
    let paged = args.bits.is_some() || args.weight_budget_gb.is_some();
    let loaded = if paged {
        if !is_quantized_dir(&args.model) {
            bail!(
                "--bits / --weight-budget-gb need a quantized checkpoint (pagedweight.json), {} has none",
                args.model.display()
            );
        }
        let weight_budget = match args.weight_budget_gb {
            Some(gb) if !(gb.is_finite() && gb > 0.0) => {
                bail!("--weight-budget-gb {gb}: expected a positive size")
            }
            Some(gb) => Some((gb * 1e9) as u64),
            None => None,
        };
        let l = LoadedModel::<B>::load_paged(
            &args.model,
            PagedOptions { bits: args.bits, weight_budget },
            device,
        )
        .with_context(|| format!("loading the model in {}", args.model.display()))?;
        if let Some(p) = &l.pages {
            let u = p.usage();
            eprintln!(
                "paged experts: {} pages at {} bits on {}, {:.3} GB of {:.3} GB budget",
                p.len(),
                l.bits.unwrap_or(0),
                p.device_kind(),
                u.weights as f64 / 1e9,
                u.budget as f64 / 1e9
            );
        }
        Some(l)
    } else {
        None
    };
    let plain;
    let model = match &loaded {
        Some(l) => &l.model,
        None => {
            plain = load_model::<B>(&args.model, device)?;
            &plain
        }
    };
    let mut sampler = Sampler::new(SamplingConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop_tokens: stop,
    });

    let mut out = std::io::stdout().lock();
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = String::new();
    let mut write_err = None;
    let mut page_err = None;
    pw_models::generate(model, &prompt_ids, &mut sampler, device, |t| {
        generated.push(t);
        // Between decode steps: the safe point where finished page moves commit.
        if let Some(l) = &loaded
            && let Err(e) = l.boundary()
        {
            page_err = Some(e);
            return false;
        }
        // Decode the whole completion each time: byte-level pieces only form text together.
        if let Ok(text) = tok.decode(&generated, true)
            && let Some(new) = text.strip_prefix(printed.as_str())
            && !new.is_empty()
            && !new.ends_with('\u{FFFD}')
        {
            if let Err(e) = out.write_all(new.as_bytes()).and_then(|_| out.flush()) {
                write_err = Some(e);
                return false;
            }
            printed = text;
        }
        true
    });
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    if let Some(e) = page_err {
        return Err(e).context("page table boundary");
    }
    writeln!(out)?;
    Ok(())
}

/// Renders one user message with the model's chat template, ready for the assistant's turn.
pub fn render_chat(dir: &Path, user: &str) -> Result<String> {
    let template = pw_serve::ChatTemplate::from_dir(dir)?.with_context(|| {
        format!(
            "{} has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json `chat_template`)",
            dir.display()
        )
    })?;
    Ok(template.render(&[pw_serve::ChatMessage { role: "user".into(), content: user.to_string() }], true)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_file_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.safetensors");
        write_logits(&path, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3).unwrap();
        let ck =
            pw_hf::Checkpoint::from_files(dir.path().to_path_buf(), std::slice::from_ref(&path)).unwrap();
        let t = ck.read_f32("logits").unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(t.data[5], 6.0);
    }
}
