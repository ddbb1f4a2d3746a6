//! `pagedweight logits` and `pagedweight generate`: run a Hugging Face MoE checkpoint
//! (Mixtral, Qwen1.5-MoE, Gemma-4) with its tokenizer and chat template.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use pw_hf::ModelConfig;
use pw_models::generate::ids_tensor;
use pw_models::{AnyModel, CausalLm, Sampler, SamplingConfig};
use serde_json::Value;
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
    let config = ModelConfig::from_dir(&args.model)?;
    let mut stop = config.eos_token_ids().to_vec();
    stop.extend(generation_config_eos(&args.model)?);
    stop.extend(&args.stop);
    let model = load_model::<B>(&args.model, device)?;
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
    pw_models::generate(&model, &prompt_ids, &mut sampler, device, |t| {
        generated.push(t);
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
    writeln!(out)?;
    Ok(())
}

/// End-of-sequence ids of `generation_config.json`, if present.
fn generation_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let v: Value = read_json(&path)?;
    Ok(match v.get("eos_token_id") {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => Vec::new(),
    })
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// A special token as tokenizer_config.json writes it: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

/// The chat template of a model directory: `chat_template.jinja`, `chat_template.json`, or the
/// `chat_template` of `tokenizer_config.json` (a string or a list of named templates).
fn find_chat_template(dir: &Path, tokenizer_config: &Value) -> Result<String> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja).with_context(|| format!("reading {}", jinja.display()));
    }
    let json = dir.join("chat_template.json");
    if json.exists()
        && let Some(s) = read_json(&json)?.get("chat_template").and_then(Value::as_str)
    {
        return Ok(s.to_string());
    }
    match tokenizer_config.get("chat_template") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or(list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .context("tokenizer_config.json: `chat_template` list has no usable template"),
        _ => bail!(
            "{} has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json `chat_template`)",
            dir.display()
        ),
    }
}

/// Renders one user message with the model's chat template, ready for the assistant's turn.
pub fn render_chat(dir: &Path, user: &str) -> Result<String> {
    let cfg_path = dir.join("tokenizer_config.json");
    let tokenizer_config = if cfg_path.exists() { read_json(&cfg_path)? } else { Value::Null };
    let template = find_chat_template(dir, &tokenizer_config)?;
    render_template(&template, &tokenizer_config, user)
}

fn render_template(template: &str, tokenizer_config: &Value, user: &str) -> Result<String> {
    let mut env = minijinja::Environment::new();
    // transformers renders with trim_blocks and lstrip_blocks, and Python string methods.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template("chat", template).context("parsing the chat template")?;
    let ctx = minijinja::context! {
        messages => vec![minijinja::context! { role => "user", content => user }],
        add_generation_prompt => true,
        bos_token => token_text(tokenizer_config.get("bos_token")),
        eos_token => token_text(tokenizer_config.get("eos_token")),
    };
    env.get_template("chat")?.render(ctx).context("rendering the chat template")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_hf_style_template() {
        let template = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}\
            [INST] {{ m['content'].strip() }} [/INST]{% else %}{{ raise_exception('bad role') }}{% endif %}\
            {% endfor %}{% if add_generation_prompt %}\n{% endif %}";
        let cfg = serde_json::json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>"});
        let out = render_template(template, &cfg, "  hi there ").unwrap();
        assert_eq!(out, "<s>[INST] hi there [/INST]");
    }

    #[test]
    fn template_errors_are_reported() {
        let err = render_template("{{ raise_exception('no system role') }}", &Value::Null, "x").unwrap_err();
        assert!(format!("{err:#}").contains("no system role"), "{err:#}");
    }

    #[test]
    fn template_list_form_picks_default() {
        let cfg = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(find_chat_template(dir.path(), &cfg).unwrap(), "D");
        let err = find_chat_template(dir.path(), &Value::Null).unwrap_err().to_string();
        assert!(err.contains("no chat template"), "{err}");
    }

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
