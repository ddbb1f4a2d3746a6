//! Trains the planner's prompt-residual head on calibration prompts (issue 7).
//!
//! `cargo run --release --example train_residual_head -- --model assets/tiny-mixtral --out DIR`
//!
//! For every calibration prompt it
//! 1. runs the model once in full precision, keeping the residual stream entering each layer
//!    (pw-models' `Trace`) → `pw_planner::residual_features` and the reference next-token
//!    distributions;
//! 2. for every (layer, block kind), runs the model again with every expert block of that kind
//!    in that layer lowered to `--bits` (quantized once with pw-format's nested k-means, then
//!    dequantized at `--bits`) and measures the damage `KL_p(l, k)`: the mean per-token KL from
//!    the reference distribution to the lowered one;
//! 3. turns it into the target `y_p(l, k) = ln(KL_p(l, k) / S(l, k)) − c`, where `S(l, k)` is
//!    the global sensitivity of the same lowering (sum over the layer's experts of the
//!    quantizer's SSE increase from 8 to `--bits` bits) and `c` the mean of `ln(KL / S)` over
//!    all prompts and blocks (see `pw_planner::ResidualHead` for why);
//! 4. fits the head with Burn autodiff + Adam for each `--l2` on the first 4/5 of the prompts,
//!    reports held-out error against the two simpler predictors (no correction; a per-block
//!    constant), refits on all prompts with the best ridge and saves
//!    `residual_head.json` + `residual_head.mpk` to `--out` (default: the model directory).
//!
//! Prompts come from `--text` (default `MODEL/calib.txt`) cut into windows of
//! `--prompt-tokens` with `MODEL/tokenizer.json`; without a tokenizer or text (the test
//! fixtures) they are deterministic random token ids, which exercises the pipeline but
//! teaches nothing about language. `--save-data FILE` writes the collected pairs as JSON;
//! `--data FILE` trains from such a file without touching a model. `--init DIR` starts from a
//! saved head: fine-tuning on your own prompts is the same command with `--text` pointing at
//! them. When `--out` is a quantized checkpoint (it holds `pagedweight.json`), `S(l, k)` comes
//! from its manifest's importance-weighted sensitivities, the ones the planner multiplies;
//! otherwise they are this example's unweighted SSE, and a head trained that way corrects the
//! wrong baseline when used with a checkpoint (measured in benches/results/planner-eval.md).

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::module::Param;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Tensor, TensorData};
use burn_ndarray::NdArray;
use clap::Parser;
use pw_format::{ApBlock, BlockKind};
use pw_hf::{Checkpoint, ModelConfig};
use pw_models::generate::ids_tensor;
use pw_models::{AnyModel, CausalLm, Gemma4, HfSource, Mixtral, Qwen2Moe, Trace};
use pw_nn::{ExpertKeys, Experts, GatedMlpConfig, LoadError, WeightSource};
use pw_planner::{
    HeadTrainingConfig, ResidualHead, ResidualHeadConfig, residual_features, train_residual_head,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};

type B = NdArray<f32>;
type AB = Autodiff<NdArray<f32>>;

const DEFAULT_MODEL: &str = "assets/tiny-mixtral";
const FIXTURE_MODEL: &str = "models/pw-models/tests/fixtures/mixtral";

#[derive(Parser, Debug)]
#[command(about = "Train the planner's prompt-residual head on calibration prompts")]
struct Args {
    /// Hugging Face model directory (default: assets/tiny-mixtral, else the Mixtral test fixture).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Calibration text (default: MODEL/calib.txt when it exists).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Train from a data file written by --save-data instead of running a model.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write the collected (features, targets) pairs here.
    #[arg(long)]
    save_data: Option<PathBuf>,
    /// Where to save the head (default: the model directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Start from the head saved in this directory (fine-tuning).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Calibration prompts.
    #[arg(long, default_value_t = 48)]
    prompts: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Bit-width the blocks are lowered to when measuring damage.
    #[arg(long, default_value_t = 3)]
    bits: u8,
    /// Adam steps.
    #[arg(long, default_value_t = 1500)]
    epochs: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 0.02)]
    lr: f64,
    /// Ridge penalties to try; the one with the lowest held-out error is used for the final fit.
    #[arg(long, value_delimiter = ',', default_value = "0.0001,0.001,0.01,0.1,1,10")]
    l2: Vec<f64>,
    /// Bound on |ln multiplier|.
    #[arg(long, default_value_t = 2.0)]
    max_log: f64,
}

/// Collected training pairs.
struct Data {
    layers: usize,
    features: Vec<Vec<f32>>,
    targets: Vec<Vec<f32>>,
    centre: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let data = match &args.data {
        Some(path) => read_data(path)?,
        None => collect(&args)?,
    };
    if let Some(path) = &args.save_data {
        write_data(path, &data)?;
    }
    let out = match (&args.out, &args.data) {
        (Some(o), _) => o.clone(),
        (None, None) => model_dir(&args),
        (None, Some(_)) => bail!("--out is required with --data"),
    };
    train_and_save(&args, &data, &out)
}

fn model_dir(args: &Args) -> PathBuf {
    args.model.clone().unwrap_or_else(|| {
        if Path::new(DEFAULT_MODEL).join("config.json").exists() {
            DEFAULT_MODEL.into()
        } else {
            FIXTURE_MODEL.into()
        }
    })
}

/// The calibration prompts as token ids.
fn prompts(args: &Args, dir: &Path, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let text = args.text.clone().or_else(|| Some(dir.join("calib.txt")).filter(|p| p.exists()));
    let tok = dir.join("tokenizer.json");
    let (n, t) = (args.prompts, args.prompt_tokens);
    if let (Some(text), true) = (&text, tok.exists()) {
        let tokenizer = tokenizers::Tokenizer::from_file(&tok)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tok.display()))?;
        let s = std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
        let ids = tokenizer
            .encode(s.as_str(), false)
            .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", text.display()))?
            .get_ids()
            .to_vec();
        let windows = ids.len() / t;
        if windows < n {
            bail!("{} has {} tokens: too few for {n} prompts of {t} tokens", text.display(), ids.len());
        }
        // Evenly spread windows, so prompts come from all over the text.
        eprintln!("prompts: {n} windows of {t} tokens from {}", text.display());
        return Ok((0..n).map(|i| ids[i * windows / n * t..][..t].to_vec()).collect());
    }
    eprintln!(
        "prompts: no tokenizer/text in {}: {n} random-token prompts (pipeline check only)",
        dir.display()
    );
    let mut rng = StdRng::seed_from_u64(0);
    Ok((0..n).map(|_| (0..t).map(|_| rng.random_range(0..vocab as u32)).collect()).collect())
}

/// [`WeightSource`] that lowers every expert block of one (layer, kind) to `bits`.
struct Lowered<'a> {
    inner: HfSource<'a, B>,
    target: Option<(usize, BlockKind)>,
    bits: u8,
    /// Quantized blocks by (layer, expert, kind), shared between loads: each is quantized once.
    cache: &'a RefCell<HashMap<(usize, usize, u8), ApBlock>>,
}

fn kind_tag(k: BlockKind) -> u8 {
    match k {
        BlockKind::GateUp => 0,
        BlockKind::Down => 1,
    }
}

/// The decoder layer of an expert bank, from its checkpoint prefix (`...layers.N....`).
fn layer_of(keys: &ExpertKeys) -> Result<usize, LoadError> {
    let p = keys.fused.first().map(String::as_str).unwrap_or_default();
    p.split('.')
        .skip_while(|s| *s != "layers")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| LoadError::Source(format!("no layer index in expert prefix `{p}`")))
}

impl WeightSource<B> for Lowered<'_> {
    fn device(&self) -> burn::tensor::Device<B> {
        self.inner.device()
    }

    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }

    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.inner.read(name, expected)
    }

    fn experts(
        &self,
        keys: &ExpertKeys,
        num_experts: usize,
        cfg: GatedMlpConfig,
    ) -> Result<Experts<B>, LoadError> {
        let mut ex = Experts::load_dense(self, keys, num_experts, cfg)?;
        let layer = layer_of(keys)?;
        let Some((l, kind)) = self.target.filter(|(l, _)| *l == layer) else { return Ok(ex) };
        #[allow(unreachable_patterns)]
        let dense = match &mut ex {
            Experts::Dense(d) => d,
            _ => return Err(LoadError::Source("only dense expert banks can be lowered here".into())),
        };
        let params = match kind {
            BlockKind::GateUp => &mut dense.gate_up,
            BlockKind::Down => &mut dense.down,
        };
        let device = self.device();
        for (e, p) in params.iter_mut().enumerate() {
            // Stored `[in, out]`; the quantizer works on HF rows `[out, in]`.
            let [cin, cout] = p.val().dims();
            let w: Vec<f32> = p
                .val()
                .into_data()
                .convert::<f32>()
                .to_vec()
                .map_err(|e| LoadError::Source(format!("{e:?}")))?;
            let key = (l, e, kind_tag(kind));
            let mut cache = self.cache.borrow_mut();
            let block = match cache.entry(key) {
                Entry::Occupied(b) => b.into_mut(),
                Entry::Vacant(slot) => {
                    let rows = transpose(&w, cin, cout);
                    let name = format!("layer {l} expert {e} {kind:?}");
                    slot.insert(
                        ApBlock::quantize(&name, &rows, None, cout, cin, 3, 8)
                            .map_err(|e| LoadError::Source(e.to_string()))?,
                    )
                }
            };
            let deq = block.dequantize_reference(self.bits);
            let back = transpose(&deq, cout, cin);
            *p = Param::from_tensor(Tensor::from_data(TensorData::new(back, [cin, cout]), &device));
        }
        Ok(ex)
    }
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

fn load(config: &ModelConfig, ckpt: &Checkpoint, src: &Lowered) -> Result<AnyModel<B>> {
    let model: Result<AnyModel<B>, LoadError> = match config {
        ModelConfig::Mixtral(c) => Mixtral::load(c, src).map(AnyModel::Mixtral),
        ModelConfig::Qwen2Moe(c) => Qwen2Moe::load(c, src).map(AnyModel::Qwen2Moe),
        ModelConfig::Gemma4(c) => Gemma4::load(c, src).map(AnyModel::Gemma4),
    };
    model.with_context(|| format!("loading {}", ckpt.dir().display()))
}

/// Next-token log-probabilities `[seq, vocab]` of one prompt.
fn log_probs(model: &AnyModel<B>, ids: &[u32], trace: Option<&mut Trace<B>>) -> Tensor<B, 2> {
    let device = Default::default();
    let mut cache = model.new_cache();
    let logits = model.forward(ids_tensor::<B>(ids, &device), &mut cache, trace);
    let [_, s, v] = logits.dims();
    log_softmax(logits.reshape([s, v]), 1)
}

/// Mean over positions of KL(reference ‖ lowered).
fn kl(reference: &Tensor<B, 2>, lowered: &Tensor<B, 2>) -> Result<f64> {
    let [s, _] = reference.dims();
    let k = (reference.clone().exp() * (reference.clone() - lowered.clone())).sum().div_scalar(s as f64);
    Ok(k.into_data().convert::<f64>().to_vec::<f64>().map_err(|e| anyhow::anyhow!("{e:?}"))?[0])
}

fn collect(args: &Args) -> Result<Data> {
    let dir = model_dir(args);
    // A quantized checkpoint as --out: its manifest's sensitivities define S(l, k).
    let manifest = match &args.out {
        Some(out) if out.join(pw_format::MANIFEST_FILE).is_file() => {
            let m = pw_format::Checkpoint::open(out)?.manifest().clone();
            eprintln!("sensitivities: the manifest of {}", out.display());
            Some(m)
        }
        _ => None,
    };
    let config = ModelConfig::from_dir(&dir)?;
    let ckpt = Checkpoint::open(&dir)?;
    let device = Default::default();
    let cache = RefCell::new(HashMap::new());
    let source =
        |target| Lowered { inner: HfSource::new(&ckpt, &device), target, bits: args.bits, cache: &cache };
    let reference = load(&config, &ckpt, &source(None))?;
    let ids = prompts(args, &dir, reference.vocab_size())?;

    let mut features = Vec::with_capacity(ids.len());
    let mut ref_lp = Vec::with_capacity(ids.len());
    let mut layers = 0;
    for p in &ids {
        let mut trace = Trace::default();
        ref_lp.push(log_probs(&reference, p, Some(&mut trace)));
        layers = trace.hidden.len() - 1;
        let f = residual_features(&trace.hidden, layers)?;
        features.push(f.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?);
    }
    eprintln!("{}: {layers} layers, {} prompts of {} tokens", dir.display(), ids.len(), args.prompt_tokens);

    // log(KL / S) per prompt, column 2l + k; layers without routed experts (Gemma-4 can
    // switch the MoE block off per layer) keep target 0 and stay out of the centre.
    let mut ratio = vec![vec![0f64; 2 * layers]; ids.len()];
    let mut measured = vec![false; 2 * layers];
    for l in 0..layers {
        for kind in [BlockKind::GateUp, BlockKind::Down] {
            let col = 2 * l + kind_tag(kind) as usize;
            let lowered = load(&config, &ckpt, &source(Some((l, kind))))?;
            let blocks = cache.borrow();
            let (count, mut s) = blocks
                .iter()
                .filter(|((bl, _, k), _)| *bl == l && *k == kind_tag(kind))
                .fold((0, 0.0), |(c, s), (_, b)| {
                    (c + 1, s + b.sensitivity_at(args.bits) - b.sensitivity_at(8))
                });
            // The planner multiplies the checkpoint's own (Fisher-weighted) sensitivities: the
            // head must correct those, not this example's unweighted SSE.
            if let Some(m) = &manifest {
                let at = |e: &pw_format::BlockEntry, b: u8| e.sensitivity[(b - e.min_bits) as usize];
                s = m
                    .blocks
                    .iter()
                    .filter(|e| e.layer == l && e.kind == kind)
                    .map(|e| at(e, args.bits.clamp(e.min_bits, e.max_bits)) - at(e, e.max_bits))
                    .sum();
            }
            if count == 0 {
                eprintln!("layer {l}: no routed experts, target left at 0");
                continue;
            }
            measured[col] = true;
            let mut mean_kl = 0.0;
            for (i, p) in ids.iter().enumerate() {
                let d = kl(&ref_lp[i], &log_probs(&lowered, p, None))?;
                mean_kl += d / ids.len() as f64;
                ratio[i][col] = (d.max(1e-12) / s.max(1e-30)).ln();
            }
            eprintln!("layer {l} {kind:?}: S = {s:.4e}, mean KL at {} bits = {mean_kl:.4e}", args.bits);
        }
    }
    let cols = measured.iter().filter(|m| **m).count();
    if cols == 0 {
        bail!("{}: no MoE layer to measure", dir.display());
    }
    let centre =
        ratio.iter().flat_map(|r| r.iter().zip(&measured).filter(|(_, m)| **m)).map(|(v, _)| v).sum::<f64>()
            / (ids.len() * cols) as f64;
    let targets = ratio
        .iter()
        .map(|r| r.iter().zip(&measured).map(|(v, m)| if *m { (v - centre) as f32 } else { 0.0 }).collect())
        .collect();
    Ok(Data { layers, features, targets, centre })
}

fn write_data(path: &Path, d: &Data) -> Result<()> {
    let v = json!({"layers": d.layers, "centre": d.centre, "features": d.features, "targets": d.targets});
    std::fs::write(path, serde_json::to_string(&v)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn read_data(path: &Path) -> Result<Data> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let field = |k: &str| v.get(k).with_context(|| format!("{}: field `{k}` is missing", path.display()));
    let layers = field("layers")?
        .as_u64()
        .with_context(|| format!("{}: `layers` is not an integer", path.display()))?;
    let rows = |k: &str| -> Result<Vec<Vec<f32>>> {
        serde_json::from_value(field(k)?.clone())
            .with_context(|| format!("{}: `{k}` is not a list of number lists", path.display()))
    };
    let centre = field("centre")?.as_f64().unwrap_or(0.0);
    Ok(Data { layers: layers as usize, features: rows("features")?, targets: rows("targets")?, centre })
}

fn tensor(rows: &[Vec<f32>], width: usize) -> Result<Tensor<AB, 2>> {
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != width) {
        bail!("sample {i} has {} values, expected {width}", r.len());
    }
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    Ok(Tensor::from_data(TensorData::new(flat, [rows.len(), width]), &Default::default()))
}

fn mse(pred: &[Vec<f32>], target: &[Vec<f32>]) -> f64 {
    let n: usize = target.iter().map(Vec::len).sum();
    pred.iter().flatten().zip(target.iter().flatten()).map(|(p, t)| ((p - t) as f64).powi(2)).sum::<f64>()
        / n as f64
}

fn train_and_save(args: &Args, d: &Data, out: &Path) -> Result<()> {
    let cfg = ResidualHeadConfig::new(d.layers).with_max_log_multiplier(args.max_log);
    let (f, o) = (cfg.n_features(), cfg.n_outputs());
    let train_cfg =
        |l2: f64| HeadTrainingConfig::new().with_epochs(args.epochs).with_learning_rate(args.lr).with_l2(l2);
    let device = Default::default();
    let start = || -> Result<ResidualHead<AB>> {
        match &args.init {
            Some(dir) => {
                let h = ResidualHead::<AB>::load(dir, &device)?;
                if h.config() != cfg {
                    bail!("{}: head for {:?}, data for {cfg:?}", dir.display(), h.config());
                }
                Ok(h)
            }
            None => Ok(cfg.init(&device)),
        }
    };
    let n = d.features.len();
    if n == 0 {
        bail!("no training samples");
    }
    // Hold out the last fifth to tell whether the features predict anything.
    let held = if n >= 5 { n / 5 } else { 0 };
    let split = n - held;
    let mut report = json!({"samples": n, "layers": d.layers, "centre": d.centre});
    let mut best_l2 = *args.l2.first().context("--l2 needs at least one value")?;
    if held > 0 {
        let test = &d.targets[split..];
        let mut best = f64::INFINITY;
        let mut tried = serde_json::Map::new();
        for &l2 in &args.l2 {
            let (head, _) = train_residual_head(
                start()?,
                tensor(&d.features[..split], f)?,
                tensor(&d.targets[..split], o)?,
                &train_cfg(l2),
            )?;
            let pred: Vec<f32> = head
                .forward(tensor(&d.features[split..], f)?)
                .into_data()
                .to_vec()
                .map_err(|e| anyhow::anyhow!("{e:?}"))?;
            let pred: Vec<Vec<f32>> = pred.chunks(o).map(<[f32]>::to_vec).collect();
            let err = mse(&pred, test);
            tried.insert(format!("{l2}"), json!(err));
            if err < best {
                (best, best_l2) = (err, l2);
            }
        }
        let zero: Vec<Vec<f32>> = test.iter().map(|r| vec![0.0; r.len()]).collect();
        let bias: Vec<f32> =
            (0..o).map(|k| d.targets[..split].iter().map(|r| r[k]).sum::<f32>() / split as f32).collect();
        let consts: Vec<Vec<f32>> = test.iter().map(|_| bias.clone()).collect();
        report["heldout_samples"] = json!(held);
        report["heldout_mse_head_by_l2"] = Value::Object(tried);
        report["heldout_mse_head"] = json!(best);
        report["heldout_mse_per_block_constant"] = json!(mse(&consts, test));
        report["heldout_mse_no_correction"] = json!(mse(&zero, test));
    }
    report["l2"] = json!(best_l2);
    let (head, r) =
        train_residual_head(start()?, tensor(&d.features, f)?, tensor(&d.targets, o)?, &train_cfg(best_l2))?;
    report["train_loss_initial"] = json!(r.initial_loss);
    report["train_loss_final"] = json!(r.final_loss);
    head.save(out)?;
    report["saved"] = json!(out.display().to_string());
    println!("{report}");
    Ok(())
}
