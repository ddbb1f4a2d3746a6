//! `pagedweight eval-ppl`: token perplexity of a model (Hugging Face or quantized checkpoint)
//! over a text file, with the window convention of `pw_models::eval`; with
//! `--expert-budget-bytes` and `--policy`, the perplexity of a quantized checkpoint whose experts
//! must fit a memory budget, allocated by one policy (issue 7):
//!
//! - `uniform`: the highest single bit-width whose expert bytes (planes + LUTs) fit;
//! - `planner`: the mixed allocation `pw_planner::plan` reaches when lowering from the highest
//!   stored bit-width down to the budget, with the checkpoint's offline sensitivities, routing
//!   statistics and residual features gathered in a first pass over the same text at the
//!   highest bit-width (router choices folded into `RoutingStats` once per forward), and the
//!   residual head saved beside the checkpoint (`residual_head.json` + `.mpk`, written by
//!   `examples/train_residual_head.rs`; without it the factors are 1 and the output says
//!   `"residual":"absent"`). The head runs per prompt, as in serving: every forward of the
//!   first pass (one window with `--batch 1`) gets its own factors from its own residual
//!   features, its own plan, and its windows are scored at that allocation;
//!   `,text-residual` instead runs the head once on the features averaged over the whole text,
//!   one set of factors per (layer, kind) for every window. The routing multiplier is
//!   relative to the calibration routing `quantize` recorded (`"routing_multiplier":"relative"`;
//!   `,absolute-routing` uses the plain share). `,no-routing`, `,no-residual` and
//!   `,no-sensitivity` switch a component off (the ablations).
//!
//! On a Hugging Face directory the same command gives the FP16 figure (`"policy":"fp16"`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use indicatif::{ProgressBar, ProgressStyle};
use pw_models::eval::{Perplexity, perplexity, perplexity_traced, token_nll, token_windows};
use pw_models::{CausalLm, LoadedModel, Trace, is_quantized_dir};
use pw_planner::{
    HEAD_CONFIG_FILE, MemoryTarget, PlannerConfig, ResidualFactors, ResidualHead, RoutingConfig,
    RoutingStats, Snapshot, accumulate_choices, plan, residual_features,
};

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
    #[arg(long, conflicts_with_all = ["policy", "expert_budget_bytes"])]
    pub bits: Option<u8>,
    /// Evaluate only the first N tokens of the text (default: all).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Windows per forward pass: the same result from fewer, larger operations. It measured
    /// no faster on the CPU backend (hence 1); on a GPU it cuts per-operation overhead.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Device bytes the experts may occupy (planes + LUTs of every expert block); the
    /// `--policy` decides the bit-widths. On a Hugging Face directory: reported against.
    #[arg(long)]
    pub expert_budget_bytes: Option<u64>,
    /// How bit-widths are chosen under the budget: `uniform` (the highest single bit-width
    /// that fits) or `planner`, optionally with `,no-routing`, `,no-residual`,
    /// `,no-sensitivity` (ablations) or `,absolute-routing` (routing multipliers by the plain
    /// share even where the checkpoint recorded its calibration routing). Default with a
    /// budget: `planner`.
    #[arg(long, requires = "expert_budget_bytes")]
    pub policy: Option<String>,
    /// JSON file of `pw_planner::RoutingConfig` (buckets, floors, multipliers) for the
    /// planner's routing statistics; default: `RoutingConfig::default()`.
    #[arg(long, requires = "expert_budget_bytes")]
    pub routing_config: Option<PathBuf>,
}

/// The routing options of `--routing-config`, or the defaults.
fn routing_config(path: Option<&Path>) -> Result<RoutingConfig> {
    let Some(path) = path else { return Ok(RoutingConfig::default()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let cfg: RoutingConfig =
        serde_json::from_str(&text).with_context(|| format!("{}: not a RoutingConfig", path.display()))?;
    cfg.validate().with_context(|| format!("{}", path.display()))?;
    Ok(cfg)
}

/// A `--policy` value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Policy {
    /// The highest single bit-width that fits.
    Uniform,
    /// The planner with these switches.
    Planner {
        /// Its components.
        config: PlannerConfig,
        /// Routing multipliers by the plain share, ignoring the calibration routing.
        absolute_routing: bool,
        /// The residual head on the text's mean features instead of each prompt's own.
        text_residual: bool,
    },
}

impl Policy {
    /// The planner with every component on.
    pub(crate) fn planner() -> Self {
        Self::Planner { config: PlannerConfig::default(), absolute_routing: false, text_residual: false }
    }

    /// Parses `uniform` or
    /// `planner[,no-routing][,no-residual][,no-sensitivity][,absolute-routing][,text-residual]`.
    pub(crate) fn parse(s: &str) -> Result<Self> {
        let mut tokens = s.split(',').map(str::trim);
        let mut policy = match tokens.next().unwrap_or_default() {
            "uniform" => Self::Uniform,
            "planner" => Self::planner(),
            other => bail!(
                "--policy {s}: unknown policy `{other}` (expected `uniform` or \
                 `planner[,no-routing][,no-residual][,no-sensitivity][,absolute-routing][,text-residual]`)"
            ),
        };
        for t in tokens {
            let Self::Planner { config: cfg, absolute_routing, text_residual } = &mut policy else {
                bail!("--policy {s}: `{t}` switches off a planner component; `uniform` takes no options")
            };
            match t {
                "no-routing" => cfg.use_routing = false,
                "no-residual" => cfg.use_residual = false,
                "no-sensitivity" => cfg.use_sensitivity = false,
                "absolute-routing" => *absolute_routing = true,
                "text-residual" => *text_residual = true,
                other => bail!(
                    "--policy {s}: unknown option `{other}` (expected no-routing, no-residual, \
                     no-sensitivity, absolute-routing or text-residual)"
                ),
            }
        }
        Ok(policy)
    }

    /// Canonical name, as printed.
    pub(crate) fn name(&self) -> String {
        match self {
            Self::Uniform => "uniform".into(),
            Self::Planner { config: c, absolute_routing, text_residual } => {
                let mut n = String::from("planner");
                for (off, t) in [
                    (!c.use_routing, ",no-routing"),
                    (!c.use_residual, ",no-residual"),
                    (!c.use_sensitivity, ",no-sensitivity"),
                    (*absolute_routing, ",absolute-routing"),
                    (*text_residual, ",text-residual"),
                ] {
                    if off {
                        n.push_str(t);
                    }
                }
                n
            }
        }
    }
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
    // Parse the options before any work, so a typo fails at once.
    routing_config(args.routing_config.as_deref())?;
    let policy = match (&args.policy, args.expert_budget_bytes) {
        (Some(p), _) => Some(Policy::parse(p)?),
        (None, Some(_)) => Some(Policy::planner()),
        (None, None) => None,
    };
    let mut ids = tokenize_text_file(&args.model, &args.text)?;
    if let Some(n) = args.max_tokens {
        ids.truncate(n);
    }
    if ids.len() < 2 {
        bail!("{} has {} tokens; at least 2 are needed", args.text.display(), ids.len());
    }
    let (Some(policy), Some(budget)) = (policy, args.expert_budget_bytes) else {
        let loaded = load::<B>(&args.model, args.bits, device)?;
        let result = run_ppl(&loaded, &ids, args, device)?;
        // Written by hand to keep the documented key order (serde_json sorts keys).
        println!(
            "{{\"ppl\":{},\"tokens\":{},\"expert_bytes\":{}}}",
            serde_json::to_string(&result.ppl())?,
            result.tokens,
            loaded.expert_bytes
        );
        return Ok(());
    };
    if !is_quantized_dir(&args.model) {
        // The reference: the checkpoint's own weights, whatever the budget.
        let loaded = load::<B>(&args.model, None, device)?;
        let result = run_ppl(&loaded, &ids, args, device)?;
        println!(
            "{{\"policy\":\"fp16\",\"ppl\":{},\"expert_bytes\":{},\"budget_bytes\":{budget},\"fits\":{},\
             \"tokens\":{}}}",
            serde_json::to_string(&result.ppl())?,
            loaded.expert_bytes,
            loaded.expert_bytes <= budget,
            result.tokens
        );
        return Ok(());
    }
    budgeted::<B>(args, &ids, &policy, budget, device)
}

fn load<B: Backend>(dir: &Path, bits: Option<u8>, device: &B::Device) -> Result<LoadedModel<B>> {
    LoadedModel::<B>::load(dir, bits, device)
        .with_context(|| format!("loading the model in {}", dir.display()))
}

/// Perplexity of a loaded model over `ids`, with a progress bar; checks the token ids first.
fn run_ppl<B: Backend>(
    loaded: &LoadedModel<B>,
    ids: &[u32],
    args: &EvalPplArgs,
    device: &B::Device,
) -> Result<Perplexity> {
    check_vocab(loaded, ids, &args.text)?;
    let pb = bar(token_windows(ids, args.ctx).len(), "windows");
    let result = perplexity(&loaded.model, ids, args.ctx, args.batch, device, |n| pb.inc(n as u64));
    pb.finish_and_clear();
    if !result.ppl().is_finite() {
        bail!(
            "the perplexity of {} on {} is not finite (summed NLL {} over {} tokens): the model gives \
             NaN or infinite logits — check its weights",
            args.model.display(),
            args.text.display(),
            result.nll,
            result.tokens
        );
    }
    Ok(result)
}

fn check_vocab<B: Backend>(loaded: &LoadedModel<B>, ids: &[u32], text: &Path) -> Result<()> {
    let vocab = loaded.model.vocab_size();
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} of {} is outside the model's vocabulary of {vocab}", text.display());
    }
    Ok(())
}

/// What the first pass over the text gathered for the planner.
struct PassStats {
    /// Router choices, folded in once per forward.
    routing: RoutingStats,
    /// Residual features averaged over the forwards (`None` when no forward ran).
    features: Option<Vec<f32>>,
    /// Per forward: the windows it ran and their residual features.
    forwards: Vec<(usize, Vec<f32>)>,
    /// Decoder layers the features cover.
    layers: usize,
    /// Perplexity of the pass (the highest stored bit-width).
    ppl: f64,
}

/// Runs the checkpoint at `bits` over the text, gathering routing statistics over
/// `layers × experts` (relative to the calibration routing `calibration` recorded, when given)
/// and residual features.
fn stats_pass<B: Backend>(
    args: &EvalPplArgs,
    ids: &[u32],
    bits: u8,
    (layers, experts): (usize, usize),
    calibration: Option<&pw_format::Manifest>,
    device: &B::Device,
) -> Result<PassStats> {
    let loaded = load::<B>(&args.model, Some(bits), device)?;
    check_vocab(&loaded, ids, &args.text)?;
    let mut routing = RoutingStats::new(layers, experts, routing_config(args.routing_config.as_deref())?)?;
    if let Some(m) = calibration {
        routing.set_calibration_routing(&m.routing).with_context(|| format!("{}", args.model.display()))?;
    }
    let mut sum: Vec<f64> = Vec::new();
    let mut per_forward = Vec::new();
    let (mut forwards, mut model_layers) = (0usize, 0usize);
    let mut failed: Option<anyhow::Error> = None;
    let pb = bar(token_windows(ids, args.ctx).len(), "statistics");
    let result = perplexity_traced(&loaded.model, ids, args.ctx, args.batch, device, true, |n, trace| {
        pb.inc(n as u64);
        if failed.is_none() {
            match fold_trace(trace, &mut routing, &mut sum, &mut model_layers, experts) {
                Ok(f) => per_forward.push((n, f)),
                Err(e) => failed = Some(e),
            }
        }
        forwards += 1;
    });
    pb.finish_and_clear();
    if let Some(e) = failed {
        return Err(e);
    }
    let features = (forwards > 0).then(|| sum.iter().map(|v| (*v / forwards as f64) as f32).collect());
    Ok(PassStats { routing, features, forwards: per_forward, layers: model_layers, ppl: result.ppl() })
}

/// Folds one forward's router outputs into `routing` (one step) and adds its residual features
/// to `sum`; returns those features.
fn fold_trace<B: Backend>(
    trace: &Trace<B>,
    routing: &mut RoutingStats,
    sum: &mut Vec<f64>,
    model_layers: &mut usize,
    experts: usize,
) -> Result<Vec<f32>> {
    let n = routing.layers() * experts;
    let (mut counts, mut mass) = (vec![0u32; n], vec![0f32; n]);
    let mut tokens = 0;
    for (l, r) in trace.routing.iter().enumerate() {
        let Some(r) = r else { continue };
        if l >= routing.layers() {
            bail!(
                "the model routes in layer {l}, but the checkpoint has expert blocks for {} layers",
                routing.layers()
            );
        }
        let w: Vec<f32> = r
            .weights
            .clone()
            .into_data()
            .convert::<f32>()
            .to_vec()
            .map_err(|e| anyhow::anyhow!("layer {l} routing weights: {e:?}"))?;
        accumulate_choices(&mut counts, &mut mass, experts, l, &r.indices, &w)?;
        tokens = r.indices.len() / r.k.max(1);
    }
    routing.update(tokens as u32, &counts, &mass)?;
    *model_layers = trace.hidden.len().saturating_sub(1);
    let f: Vec<f32> = residual_features(&trace.hidden, *model_layers)?
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("residual features: {e:?}"))?;
    if sum.is_empty() {
        sum.resize(f.len(), 0.0);
    }
    for (s, v) in sum.iter_mut().zip(&f) {
        *s += *v as f64;
    }
    Ok(f)
}

/// The residual head beside the checkpoint, checked against the model's layers; `None` (with
/// a note on stderr) when there is none.
fn residual_head<B: Backend>(
    dir: &Path,
    stats: &PassStats,
    device: &B::Device,
) -> Result<Option<ResidualHead<B>>> {
    if !dir.join(HEAD_CONFIG_FILE).is_file() {
        eprintln!(
            "no {HEAD_CONFIG_FILE} in {}: residual factors 1 (train one with `cargo run --release \
             --example train_residual_head -- --model HF_DIR --out {}`)",
            dir.display(),
            dir.display()
        );
        return Ok(None);
    }
    let head = ResidualHead::<B>::load(dir, device)?;
    if head.config().layers != stats.layers {
        bail!(
            "{}: the residual head is for {} layers, the model has {}",
            dir.join(HEAD_CONFIG_FILE).display(),
            head.config().layers,
            stats.layers
        );
    }
    Ok(Some(head))
}

/// The head's factors for one set of residual features.
fn head_factors<B: Backend>(
    head: &ResidualHead<B>,
    features: &[f32],
    device: &B::Device,
) -> Result<ResidualFactors> {
    let x = Tensor::<B, 1>::from_data(TensorData::new(features.to_vec(), [features.len()]), device);
    Ok(head.factors(x)?)
}

/// `eval-ppl` on a quantized checkpoint under an expert byte budget.
fn budgeted<B: Backend>(
    args: &EvalPplArgs,
    ids: &[u32],
    policy: &Policy,
    budget: u64,
    device: &B::Device,
) -> Result<()> {
    let dir = &args.model;
    let ckpt = pw_format::Checkpoint::open(dir)?;
    let manifest = ckpt.manifest();
    let Some((lo, hi)) = manifest.bit_range() else {
        bail!("{}: the checkpoint has no expert blocks", dir.display());
    };
    let at = |bits: &dyn Fn(&pw_format::BlockEntry) -> u8| -> u64 {
        manifest
            .blocks
            .iter()
            .map(|b| {
                let (p, l) = b.bytes_at(bits(b));
                (p + l) as u64
            })
            .sum()
    };
    let smallest = at(&|b| b.min_bits);
    if budget < smallest {
        bail!(
            "--expert-budget-bytes {budget} is below the smallest size of this checkpoint's experts: \
             {smallest} bytes with every block at its lowest stored bit-width ({lo} bits); \
             a budget needs at least that"
        );
    }
    let largest = at(&|b| b.max_bits);
    let mut extra = String::new();
    let bits: Vec<u8> = match policy {
        Policy::Uniform => {
            let b =
                (lo..=hi).rev().find(|&b| at(&|e| b.clamp(e.min_bits, e.max_bits)) <= budget).unwrap_or(lo);
            extra.push_str(&format!(",\"bits\":{b}"));
            manifest.blocks.iter().map(|e| b.clamp(e.min_bits, e.max_bits)).collect()
        }
        Policy::Planner { config: cfg, absolute_routing, text_residual } => {
            let snapshot = Snapshot::from_manifest(manifest, hi)?;
            let extent = snapshot.extent();
            // Routing and residual need the first pass; the bytes-only ablation does not.
            let stats = if cfg.use_routing || cfg.use_residual {
                let calibration = (!absolute_routing).then_some(manifest);
                Some(stats_pass::<B>(args, ids, hi, extent, calibration, device)?)
            } else {
                None
            };
            let head = match &stats {
                Some(s) if cfg.use_residual => residual_head::<B>(dir, s, device)?,
                _ => None,
            };
            let target =
                if largest > budget { MemoryTarget::Free(largest - budget) } else { MemoryTarget::Hold };
            if let (Some(head), Some(stats), false) = (&head, &stats, *text_residual) {
                let planned = Planned { snapshot: &snapshot, stats, head, target, config: cfg };
                return per_prompt::<B>(args, ids, policy, budget, &planned, device);
            }
            let (factors, residual) = match (&head, &stats) {
                (Some(h), Some(s)) => match &s.features {
                    Some(f) => (Some(head_factors(h, f, device)?), "head-text-mean"),
                    None => (None, "absent"),
                },
                _ if cfg.use_residual => (None, "absent"),
                _ => (None, "off"),
            };
            let t0 = Instant::now();
            let p = plan(&snapshot, stats.as_ref().map(|s| &s.routing), factors.as_ref(), target, cfg)?;
            let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
            if !p.met {
                bail!(
                    "the planner cannot fit {budget} bytes: with its bit floors (hot experts' pages \
                     at {} bits and more) the experts still take {} bytes; the smallest without \
                     floors is {smallest} (policy `{}`)",
                    routing_config(args.routing_config.as_deref())?.hot_floor_bits,
                    p.bytes_after,
                    policy.name()
                );
            }
            if let Some(s) = &stats {
                let multiplier = if s.routing.has_calibration() { "relative" } else { "absolute" };
                extra.push_str(&format!(
                    ",\"ppl_stats_pass\":{},\"stats_bits\":{hi},\"routing_steps\":{},\"routing_multiplier\":\"{multiplier}\"",
                    serde_json::to_string(&s.ppl)?,
                    s.routing.steps()
                ));
            }
            extra.push_str(&format!(",\"residual\":\"{residual}\",\"plan_ms\":{plan_ms:.3}"));
            p.desired
        }
    };
    let block_bits: HashMap<String, u8> =
        manifest.blocks.iter().zip(&bits).map(|(e, &b)| (e.name.clone(), b)).collect();
    let loaded = LoadedModel::<B>::load_mixed(dir, &block_bits, device)
        .with_context(|| format!("loading the model in {}", dir.display()))?;
    if loaded.expert_bytes > budget {
        bail!(
            "internal: policy `{}` chose {} expert bytes over the budget of {budget}",
            policy.name(),
            loaded.expert_bytes
        );
    }
    let result = run_ppl(&loaded, ids, args, device)?;
    let mut hist = BTreeMap::new();
    for b in &bits {
        *hist.entry(b.to_string()).or_insert(0usize) += 1;
    }
    println!(
        "{{\"policy\":{},\"ppl\":{},\"expert_bytes\":{},\"budget_bytes\":{budget},\"tokens\":{},\
         \"bits_histogram\":{}{extra}}}",
        serde_json::to_string(&policy.name())?,
        serde_json::to_string(&result.ppl())?,
        loaded.expert_bytes,
        result.tokens,
        serde_json::to_string(&hist)?
    );
    Ok(())
}

/// What the planner works from in [`per_prompt`].
struct Planned<'a, B: Backend> {
    snapshot: &'a Snapshot,
    stats: &'a PassStats,
    head: &'a ResidualHead<B>,
    target: MemoryTarget,
    config: &'a PlannerConfig,
}

/// The planner with the residual head per prompt: every forward of the statistics pass gets
/// its own factors and plan, and its windows are scored with the experts at that allocation
/// (each distinct allocation loaded once).
fn per_prompt<B: Backend>(
    args: &EvalPplArgs,
    ids: &[u32],
    policy: &Policy,
    budget: u64,
    p: &Planned<'_, B>,
    device: &B::Device,
) -> Result<()> {
    let dir = &args.model;
    let manifest = pw_format::Checkpoint::open(dir)?.manifest().clone();
    let t0 = Instant::now();
    let mut by_allocation: BTreeMap<Vec<u8>, Vec<usize>> = BTreeMap::new();
    for (j, (_, features)) in p.stats.forwards.iter().enumerate() {
        let factors = head_factors(p.head, features, device)?;
        let plan = plan(p.snapshot, Some(&p.stats.routing), Some(&factors), p.target, p.config)?;
        if !plan.met {
            bail!(
                "the planner cannot fit {budget} bytes for prompt {j}: with its bit floors the experts \
                 still take {} bytes (policy `{}`)",
                plan.bytes_after,
                policy.name()
            );
        }
        by_allocation.entry(plan.desired).or_default().push(j);
    }
    let plan_ms = t0.elapsed().as_secs_f64() * 1e3 / p.stats.forwards.len().max(1) as f64;
    let windows = token_windows(ids, args.ctx);
    let mut first = Vec::with_capacity(p.stats.forwards.len());
    let mut w = 0;
    for (n, _) in &p.stats.forwards {
        first.push(w);
        w += n;
    }
    let mut total = Perplexity::default();
    let (mut max_bytes, mut mean_bytes) = (0u64, 0f64);
    let mut hist: BTreeMap<String, f64> = BTreeMap::new();
    let pb = bar(windows.len(), "windows");
    for (bits, forwards) in &by_allocation {
        let block_bits: HashMap<String, u8> =
            manifest.blocks.iter().zip(bits).map(|(e, &b)| (e.name.clone(), b)).collect();
        let loaded = LoadedModel::<B>::load_mixed(dir, &block_bits, device)
            .with_context(|| format!("loading the model in {}", dir.display()))?;
        if loaded.expert_bytes > budget {
            bail!(
                "internal: a per-prompt plan chose {} expert bytes over the budget of {budget}",
                loaded.expert_bytes
            );
        }
        max_bytes = max_bytes.max(loaded.expert_bytes);
        for &j in forwards {
            let (n, _) = p.stats.forwards[j];
            total.add(token_nll(&loaded.model, &windows[first[j]..first[j] + n], device));
            mean_bytes += loaded.expert_bytes as f64 * n as f64;
            for b in bits {
                *hist.entry(b.to_string()).or_insert(0.0) += n as f64;
            }
            pb.inc(n as u64);
        }
    }
    pb.finish_and_clear();
    let n_windows = windows.len().max(1) as f64;
    let hist: BTreeMap<String, f64> =
        hist.into_iter().map(|(k, v)| (k, (v / n_windows * 100.0).round() / 100.0)).collect();
    let multiplier = if p.stats.routing.has_calibration() { "relative" } else { "absolute" };
    println!(
        "{{\"policy\":{},\"ppl\":{},\"expert_bytes\":{max_bytes},\"budget_bytes\":{budget},\"tokens\":{},\
         \"bits_histogram\":{},\"mean_expert_bytes\":{:.0},\"allocations\":{},\"prompts\":{},\
         \"ppl_stats_pass\":{},\"routing_steps\":{},\"routing_multiplier\":\"{multiplier}\",\
         \"residual\":\"head-per-prompt\",\"plan_ms\":{plan_ms:.3}}}",
        serde_json::to_string(&policy.name())?,
        serde_json::to_string(&total.ppl())?,
        total.tokens,
        serde_json::to_string(&hist)?,
        mean_bytes / n_windows,
        by_allocation.len(),
        p.stats.forwards.len(),
        serde_json::to_string(&p.stats.ppl)?,
        p.stats.routing.steps()
    );
    Ok(())
}
