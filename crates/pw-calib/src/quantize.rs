//! Hugging Face MoE checkpoint → PagedWeight checkpoint directory.
//!
//! 1. Importance of every expert weight from the calibration windows: the diagonal Fisher
//!    through the whole model on an autodiff backend ([`crate::fisher`]) where it fits the
//!    memory, else the layer-streamed input second moments ([`crate::streamed`]), which hold
//!    one layer at a time ([`ImportanceMethod`], [`memory_needs`]).
//! 2. Every expert's gate+up (`[2I, H]`, gate rows first, [`BlockKind::GateUp`]) and down
//!    (`[H, I]`) matrix, read from the checkpoint in its own layout, is quantized with its
//!    importance ([`ApBlock::quantize`], rows = outputs); the block's sensitivity per bit-width
//!    is the quantizer's importance-weighted error. Blocks are named by
//!    [`expert_block_name`] after the bank's checkpoint prefix and list their source tensors.
//! 3. Every other tensor is copied byte for byte; `config.json` and the tokenizer / generation
//!    files are copied beside the manifest.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, mpsc};

use burn::tensor::backend::{AutodiffBackend, Backend};
use pw_format::{
    ApBlock, BlockKind, BlockMeta, CheckpointWriter, DEFAULT_SHARD_BYTES, FormatError, LayerRouting, Manifest,
};
use pw_hf::ModelConfig;
use pw_models::eval::token_windows;
use pw_models::{CausalLm, HfSource, LoadedModel, expert_block_name, is_quantized_dir, layer_of};
use pw_nn::{ExpertLayout, GatedMlpConfig};
use pw_quant::{MAX_BITS, MIN_BITS};

use rayon::prelude::*;

use crate::streamed::{StreamedBank, WINDOW_BATCH, streamed_importance_each};
use crate::{CalibError, FisherPass};

/// Files copied beside the manifest when the model directory has them (`config.json` is
/// required).
pub const SIDE_FILES: [&str; 7] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Settings of [`quantize_model`].
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizeConfig {
    /// Lowest stored bit-width (≥ 3).
    pub min_bits: u8,
    /// Highest stored bit-width (≤ 8): the number of planes.
    pub max_bits: u8,
    /// Tokens per calibration window (one example of the Fisher estimate).
    pub ctx: usize,
    /// Calibration tokens used at most (a prefix of the calibration ids).
    pub calib_tokens: usize,
    /// How the importance of the expert weights is estimated.
    pub importance: ImportanceMethod,
    /// Bytes after which an output shard is closed; a rerun after an interruption keeps every
    /// closed shard's blocks.
    pub shard_bytes: usize,
}

impl Default for QuantizeConfig {
    fn default() -> Self {
        Self {
            min_bits: 3,
            max_bits: 8,
            ctx: 256,
            calib_tokens: 16384,
            importance: ImportanceMethod::Fisher,
            shard_bytes: DEFAULT_SHARD_BYTES,
        }
    }
}

/// How [`quantize_model`] estimates the importance of the expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportanceMethod {
    /// Diagonal Fisher: squared gradients of the calibration loss through the whole model.
    Fisher,
    /// Layer-streamed: each expert's input second moments, one layer in memory at a time.
    Streamed,
    /// Fisher when its estimated memory ([`MemoryNeeds::fisher`]) fits `memory_bytes` (what
    /// the device running the pass has), else streamed.
    Auto {
        /// Bytes available to the pass.
        memory_bytes: u64,
    },
}

impl ImportanceMethod {
    /// `fisher`, `streamed` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fisher => "fisher",
            Self::Streamed => "streamed",
            Self::Auto { .. } => "auto",
        }
    }
}

/// Bytes each importance pass needs on its device, estimated from the checkpoint's tensor shapes
/// as f32: the Fisher pass holds every weight, its gradient and a squared-gradient sum of every
/// expert weight (twice: on the device and on the host), plus activations; the streamed pass the
/// largest decoder layer, the embedding table and the calibration windows' hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNeeds {
    /// The Fisher pass.
    pub fisher: u64,
    /// The layer-streamed pass.
    pub streamed: u64,
}

/// [`MemoryNeeds`] of quantizing the Hugging Face checkpoint in `model_dir` with `cfg`.
pub fn memory_needs(model_dir: &Path, cfg: &QuantizeConfig) -> Result<MemoryNeeds, CalibError> {
    let config = ModelConfig::from_dir(model_dir)?;
    let hf = pw_hf::Checkpoint::open(model_dir)?;
    let (mut all, mut experts) = (0u64, 0u64);
    let mut per_layer: Vec<u64> = Vec::new();
    for name in hf.names() {
        let (_, shape) = hf.info(name)?;
        let n = shape.iter().product::<usize>() as u64;
        all += n;
        if name.contains(".experts.") {
            experts += n;
        }
        if let Some(l) = layer_of(name) {
            if per_layer.len() <= l {
                per_layer.resize(l + 1, 0);
            }
            per_layer[l] += n;
        }
    }
    let (hidden, vocab) = match &config {
        ModelConfig::Mixtral(c) => (c.hidden_size, c.vocab_size),
        ModelConfig::Qwen2Moe(c) => (c.hidden_size, c.vocab_size),
        ModelConfig::Gemma4(c) => (c.hidden_size, c.vocab_size),
    };
    let (layers, hidden, vocab) = (per_layer.len().max(1) as u64, hidden as u64, vocab as u64);
    let ctx = cfg.ctx as u64;
    let tokens = cfg.calib_tokens as u64;
    // Activations kept for the backward pass: a few dozen hidden-sized values per token and
    // layer, and the logits.
    let fisher_activations = ctx * (layers * 64 * hidden + 4 * vocab);
    let fisher = 4 * (2 * all + 2 * experts + fisher_activations);
    let largest_layer = per_layer.iter().copied().max().unwrap_or(0);
    let batch = WINDOW_BATCH as u64;
    let streamed = 4 * (largest_layer + vocab * hidden + 2 * tokens * hidden + ctx * batch * 64 * hidden);
    Ok(MemoryNeeds { fisher, streamed })
}

/// Phase of [`quantize_model`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Reading the checkpoint and building the model (`total` = 1).
    Loading,
    /// Gradients of the calibration windows (`total` = windows).
    Gradients,
    /// The layer-streamed pass (`total` = decoder layers).
    Moments,
    /// Quantizing expert blocks (`total` = blocks).
    Quantizing,
    /// Copying the unchanged tensors (`total` = tensors).
    Copying,
}

/// Where [`quantize_model`] is: `done` of `total` units of `stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The phase.
    pub stage: Stage,
    /// Units finished.
    pub done: usize,
    /// Units in the phase.
    pub total: usize,
}

/// What [`quantize_model`] wrote.
#[derive(Debug, Clone)]
pub struct QuantizeReport {
    /// The manifest of the new checkpoint.
    pub manifest: Manifest,
    /// Calibration windows used.
    pub windows: usize,
    /// Calibration tokens used.
    pub tokens: usize,
    /// Mean next-token loss over the calibration windows (the Fisher pass computes it; the
    /// streamed pass stops before the head).
    pub calib_loss: Option<f64>,
    /// The importance used: [`ImportanceMethod::Fisher`] or [`ImportanceMethod::Streamed`].
    pub importance: ImportanceMethod,
    /// What each importance pass was estimated to need.
    pub memory: MemoryNeeds,
}

/// One MoE layer's experts as the quantization stage needs them.
struct CalibratedBank {
    layer: usize,
    layout: ExpertLayout,
    cfg: GatedMlpConfig,
    /// Per expert, its share of the layer's routing-weight mass on the calibration text.
    mass_share: Vec<f64>,
    importance: ExpertImportance,
}

/// Per expert, the importance of its gate+up (`[2I, H]`) and down (`[H, I]`) weights.
enum ExpertImportance {
    /// One value per weight, rows = outputs.
    Weights { gate_up: Vec<Vec<f32>>, down: Vec<Vec<f32>> },
    /// One value per input column, the same for every row.
    Columns { gate_up: Vec<Vec<f32>>, down: Vec<Vec<f32>> },
}

impl ExpertImportance {
    /// The importance of expert `e`'s `kind` block of `rows` rows, one value per weight.
    fn block(&self, e: usize, kind: BlockKind, rows: usize) -> Vec<f32> {
        match (self, kind) {
            (Self::Weights { gate_up, .. }, BlockKind::GateUp) => gate_up[e].clone(),
            (Self::Weights { down, .. }, BlockKind::Down) => down[e].clone(),
            (Self::Columns { gate_up, .. }, BlockKind::GateUp) => gate_up[e].repeat(rows),
            (Self::Columns { down, .. }, BlockKind::Down) => down[e].repeat(rows),
        }
    }
}

/// Quantizes the Hugging Face MoE checkpoint in `model_dir` into a PagedWeight checkpoint in
/// `out_dir`, with importance from `calib_ids` (the calibration text's token ids, tokenized
/// without special tokens). The importance pass runs on `B` on `device`; with the streamed
/// importance each layer's experts are quantized on the host while the pass runs the next
/// layers. `progress` is called as each unit of work finishes (from either thread). A run
/// interrupted after it closed output shards resumes where they end when rerun with the same
/// inputs and settings (the importance pass is redone, the blocks already written are not).
pub fn quantize_model<B: AutodiffBackend>(
    model_dir: &Path,
    out_dir: &Path,
    calib_ids: &[u32],
    cfg: &QuantizeConfig,
    device: &B::Device,
    progress: impl FnMut(Progress) + Send,
) -> Result<QuantizeReport, CalibError> {
    check_config(cfg)?;
    if is_quantized_dir(model_dir) {
        return Err(CalibError::AlreadyQuantized { dir: model_dir.to_path_buf() });
    }
    if same_dir(model_dir, out_dir) {
        return Err(CalibError::SameDir { dir: out_dir.to_path_buf() });
    }
    let ids = &calib_ids[..calib_ids.len().min(cfg.calib_tokens)];
    if ids.len() < 2 {
        return Err(CalibError::TooFewTokens { tokens: ids.len() });
    }

    let memory = memory_needs(model_dir, cfg)?;
    let method = match cfg.importance {
        ImportanceMethod::Auto { memory_bytes } if memory.fisher <= memory_bytes => ImportanceMethod::Fisher,
        ImportanceMethod::Auto { .. } => ImportanceMethod::Streamed,
        m => m,
    };
    let windows = token_windows(ids, cfg.ctx);
    let config = ModelConfig::from_dir(model_dir)?;
    let hf = pw_hf::Checkpoint::open(model_dir)?;
    let progress = Mutex::new(progress);
    let report = |p: Progress| (progress.lock().unwrap_or_else(PoisonError::into_inner))(p);
    // The Fisher pass needs the whole model first; the streamed one checks the ids here. Either
    // fails before the output directory is touched.
    let fisher = match method {
        ImportanceMethod::Fisher => Some(fisher_banks::<B>(model_dir, &windows, device, &mut |p| report(p))?),
        _ => {
            let vocab = config.vocab_size();
            if let Some(&id) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(CalibError::TokenOutOfRange { id, vocab });
            }
            None
        }
    };

    let key = run_key(model_dir, ids, cfg, method);
    let mut writer = CheckpointWriter::resume(out_dir, &key)?.with_shard_bytes(cfg.shard_bytes);
    writer.set_model_type(model_type(model_dir)?);
    let mut out = BankWriter {
        model_dir,
        cfg,
        writer,
        total: 2 * config.routed_experts().iter().sum::<usize>(),
        done: 0,
        routing: Vec::new(),
        expert_tensors: HashSet::new(),
    };
    let src = HfSource::<B::InnerBackend>::new(&hf, device);
    let calib_loss = match fisher {
        Some((banks, loss)) => {
            for bank in banks {
                out.bank(&src, bank, &report)?;
            }
            loss
        }
        None => {
            // The pass runs here, the quantizer on a thread of its own, one layer behind it.
            std::thread::scope(|s| {
                let (tx, rx) = mpsc::channel::<CalibratedBank>();
                let (out, src, report) = (&mut out, &src, &report);
                let worker = s.spawn(move || rx.into_iter().try_for_each(|bank| out.bank(src, bank, report)));
                let pass = streamed_importance_each::<B::InnerBackend>(
                    model_dir,
                    &windows,
                    device,
                    |done, total| report(Progress { stage: Stage::Moments, done, total }),
                    |bank| tx.send(calibrated(bank)).is_ok(),
                );
                drop(tx);
                worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
                pass.map(|_| ())
            })?;
            None
        }
    };

    let BankWriter { mut writer, routing, expert_tensors, .. } = out;
    // What the planner's online routing is compared with: the importance already weighs each
    // expert by this use.
    writer.set_routing(routing);
    let dense: Vec<&str> = hf.names().filter(|n| !expert_tensors.contains(*n)).collect();
    for (n, name) in dense.iter().enumerate() {
        if !writer.has_dense(name) {
            let (dtype, shape, bytes) = hf.raw(name)?;
            writer.add_dense(name, dtype, shape.to_vec(), bytes.to_vec())?;
        }
        report(Progress { stage: Stage::Copying, done: n + 1, total: dense.len() });
    }
    for f in SIDE_FILES {
        let p = model_dir.join(f);
        if p.is_file() {
            writer.copy_file(&p)?;
        }
    }
    let manifest = writer.finish()?;
    Ok(QuantizeReport {
        manifest,
        windows: windows.len(),
        tokens: ids.len(),
        calib_loss,
        importance: method,
        memory,
    })
}

/// The layer-streamed importance of a bank as the quantizer takes it.
fn calibrated(b: StreamedBank) -> CalibratedBank {
    CalibratedBank {
        layer: b.layer,
        layout: b.layout,
        cfg: b.cfg,
        mass_share: mass_share(&b.routing_mass),
        importance: ExpertImportance::Columns { gate_up: b.gate_up, down: b.down },
    }
}

/// The output checkpoint as banks are quantized into it, one after another in layer order.
struct BankWriter<'a> {
    model_dir: &'a Path,
    cfg: &'a QuantizeConfig,
    writer: CheckpointWriter,
    /// Expert blocks of the model.
    total: usize,
    /// Blocks written or kept so far.
    done: usize,
    routing: Vec<LayerRouting>,
    /// The source tensors the blocks replace.
    expert_tensors: HashSet<String>,
}

impl BankWriter<'_> {
    /// Quantizes `bank`'s blocks that an earlier run did not write, its experts in parallel,
    /// and writes them in expert order.
    fn bank<B: Backend>(
        &mut self,
        src: &HfSource<B>,
        bank: CalibratedBank,
        report: &impl Fn(Progress),
    ) -> Result<(), CalibError> {
        let num_experts = bank.mass_share.len();
        let (h, i) = (bank.cfg.hidden, bank.cfg.intermediate);
        self.expert_tensors.extend(bank.layout.tensor_names(num_experts));
        self.routing.push(LayerRouting { layer: bank.layer, mass_share: bank.mass_share.clone() });
        let prefix = bank.layout.prefix();
        let todo: Vec<(usize, BlockKind)> = (0..num_experts)
            .flat_map(|e| [(e, BlockKind::GateUp), (e, BlockKind::Down)])
            .filter(|&(e, kind)| !self.writer.has_block(&expert_block_name(prefix, e, kind)))
            .collect();
        if todo.is_empty() {
            self.done += 2 * num_experts;
            report(Progress { stage: Stage::Quantizing, done: self.done, total: self.total });
            return Ok(());
        }
        let wrap = |source| pw_models::ModelError::Load { dir: self.model_dir.display().to_string(), source };
        let rows = bank.layout.read_rows(src, num_experts, bank.cfg).map_err(wrap)?;
        let (min_bits, max_bits) = (self.cfg.min_bits, self.cfg.max_bits);
        let blocks: Vec<Result<ApBlock, FormatError>> = todo
            .par_iter()
            .map(|&(e, kind)| {
                let (w, r, c) = match kind {
                    BlockKind::GateUp => (&rows.gate_up[e], 2 * i, h),
                    BlockKind::Down => (&rows.down[e], h, i),
                };
                let importance = bank.importance.block(e, kind, r);
                let name = expert_block_name(prefix, e, kind);
                ApBlock::quantize(&name, w, Some(&importance), r, c, min_bits, max_bits)
            })
            .collect();
        drop(rows);
        // `done` counts the bank's blocks in expert order, those an earlier run wrote included.
        let first = self.done;
        for ((e, kind), block) in todo.into_iter().zip(blocks) {
            let (gu_src, dn_src) = bank.layout.expert_sources(e);
            let sources = if kind == BlockKind::GateUp { gu_src } else { dn_src };
            let meta = BlockMeta {
                name: expert_block_name(prefix, e, kind),
                layer: bank.layer,
                expert: e,
                kind,
                sources,
            };
            self.writer.add_block(meta, &block?)?;
            self.done = first + 2 * e + usize::from(kind == BlockKind::Down) + 1;
            report(Progress { stage: Stage::Quantizing, done: self.done, total: self.total });
        }
        self.done = first + 2 * num_experts;
        Ok(())
    }
}

/// The Fisher pass: the whole model on the autodiff backend; the model is dropped before the
/// blocks are quantized.
fn fisher_banks<B: AutodiffBackend>(
    model_dir: &Path,
    windows: &[&[u32]],
    device: &B::Device,
    progress: &mut impl FnMut(Progress),
) -> Result<(Vec<CalibratedBank>, Option<f64>), CalibError> {
    progress(Progress { stage: Stage::Loading, done: 0, total: 1 });
    let loaded = LoadedModel::<B>::load(model_dir, None, device)?;
    if loaded.banks.is_empty() {
        return Err(CalibError::NoExperts { dir: model_dir.to_path_buf() });
    }
    let vocab = loaded.model.vocab_size();
    if let Some(&id) = windows.iter().flat_map(|w| w.iter()).find(|&&i| i as usize >= vocab) {
        return Err(CalibError::TokenOutOfRange { id, vocab });
    }
    progress(Progress { stage: Stage::Loading, done: 1, total: 1 });
    let mut fisher = FisherPass::new(&loaded.banks);
    for (n, w) in windows.iter().enumerate() {
        let loss = fisher.add_window(&loaded.model, &loaded.banks, w, device);
        if !loss.is_finite() {
            return Err(CalibError::NonFiniteLoss { window: n, loss });
        }
        progress(Progress { stage: Stage::Gradients, done: n + 1, total: windows.len() });
    }
    let calib_loss = fisher.mean_loss();
    let importance = fisher.finish(&loaded.banks);
    let banks = loaded
        .banks
        .iter()
        .zip(importance)
        .map(|(bank, imp)| CalibratedBank {
            layer: bank.layer,
            layout: bank.layout.clone(),
            cfg: bank.cfg,
            mass_share: imp.mass_share(),
            importance: ExpertImportance::Weights { gate_up: imp.gate_up, down: imp.down },
        })
        .collect();
    Ok((banks, Some(calib_loss)))
}

/// Per expert, its share of the layer's routing-weight mass (1 = an average expert; all 1 when
/// no mass was seen).
pub(crate) fn mass_share(mass: &[f64]) -> Vec<f64> {
    let total: f64 = mass.iter().sum();
    let n = mass.len() as f64;
    if total > 0.0 { mass.iter().map(|m| m * n / total).collect() } else { vec![1.0; mass.len()] }
}

/// What must be equal for a rerun to continue an interrupted one: the source, the calibration
/// ids, the settings and the importance method.
fn run_key(model_dir: &Path, ids: &[u32], cfg: &QuantizeConfig, method: ImportanceMethod) -> String {
    // FNV-1a over the calibration ids.
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for b in ids.iter().flat_map(|i| i.to_le_bytes()) {
        hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let dir = model_dir.canonicalize().unwrap_or_else(|_| model_dir.to_path_buf());
    format!(
        "{}|bits {}..={}|ctx {}|{} tokens {hash:016x}|{}",
        dir.display(),
        cfg.min_bits,
        cfg.max_bits,
        cfg.ctx,
        ids.len(),
        method.name()
    )
}

fn check_config(cfg: &QuantizeConfig) -> Result<(), CalibError> {
    let bad = |setting, value: usize, reason: String| {
        Err(CalibError::Setting { setting, value: value.to_string(), reason })
    };
    if !(MIN_BITS..=MAX_BITS).contains(&cfg.min_bits) {
        return bad("min_bits", cfg.min_bits.into(), format!("must be in {MIN_BITS}..={MAX_BITS}"));
    }
    if !(cfg.min_bits..=MAX_BITS).contains(&cfg.max_bits) {
        return bad(
            "max_bits",
            cfg.max_bits.into(),
            format!("must be in min_bits ({})..={MAX_BITS}", cfg.min_bits),
        );
    }
    if cfg.ctx < 2 {
        return bad("ctx", cfg.ctx, "a window needs at least 2 tokens".into());
    }
    Ok(())
}

/// `model_type` of `config.json`, recorded in the manifest.
fn model_type(dir: &Path) -> Result<Option<String>, CalibError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|source| CalibError::Io { path: path.clone(), source })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|source| CalibError::Hf(pw_hf::HfError::Json { path: path.clone(), source }))?;
    Ok(v.get("model_type").and_then(|t| t.as_str()).map(str::to_string))
}

fn same_dir(a: &Path, b: &Path) -> bool {
    let canon = |p: &Path| -> PathBuf { p.canonicalize().unwrap_or_else(|_| p.to_path_buf()) };
    canon(a) == canon(b)
}
