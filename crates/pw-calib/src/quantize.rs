//! Hugging Face MoE checkpoint → PagedWeight checkpoint directory.
//!
//! 1. Load the model on an autodiff backend, recording every expert bank.
//! 2. Fisher pass over the calibration windows ([`crate::fisher`]).
//! 3. Every expert's gate+up (`[2I, H]`, gate rows first, [`BlockKind::GateUp`]) and down
//!    (`[H, I]`) matrix, read from the checkpoint in its own layout, is quantized with its
//!    importance ([`ApBlock::quantize`], rows = outputs); the block's sensitivity per bit-width
//!    is the quantizer's importance-weighted error. Blocks are named by
//!    [`expert_block_name`] after the bank's checkpoint prefix and list their source tensors.
//! 4. Every other tensor is copied byte for byte; `config.json` and the tokenizer / generation
//!    files are copied beside the manifest.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use pw_format::{ApBlock, BlockKind, BlockMeta, CheckpointWriter, LayerRouting, Manifest};
use pw_models::eval::token_windows;
use pw_models::{CausalLm, HfSource, LoadedModel, expert_block_name, is_quantized_dir};
use pw_quant::{MAX_BITS, MIN_BITS};

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
}

impl Default for QuantizeConfig {
    fn default() -> Self {
        Self { min_bits: 3, max_bits: 8, ctx: 256, calib_tokens: 16384 }
    }
}

/// Phase of [`quantize_model`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Reading the checkpoint and building the model (`total` = 1).
    Loading,
    /// Gradients of the calibration windows (`total` = windows).
    Gradients,
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
    /// Mean next-token loss over the calibration windows.
    pub calib_loss: f64,
}

/// Quantizes the Hugging Face MoE checkpoint in `model_dir` into a PagedWeight checkpoint in
/// `out_dir`, with Fisher importance from `calib_ids` (the calibration text's token ids,
/// tokenized without special tokens). The Fisher pass runs on `B` on `device`;
/// `progress` is called as each unit of work finishes.
pub fn quantize_model<B: AutodiffBackend>(
    model_dir: &Path,
    out_dir: &Path,
    calib_ids: &[u32],
    cfg: &QuantizeConfig,
    device: &B::Device,
    mut progress: impl FnMut(Progress),
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

    progress(Progress { stage: Stage::Loading, done: 0, total: 1 });
    let loaded = LoadedModel::<B>::load(model_dir, None, device)?;
    if loaded.banks.is_empty() {
        return Err(CalibError::NoExperts { dir: model_dir.to_path_buf() });
    }
    let vocab = loaded.model.vocab_size();
    if let Some(&id) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(CalibError::TokenOutOfRange { id, vocab });
    }
    let hf = pw_hf::Checkpoint::open(model_dir)?;
    progress(Progress { stage: Stage::Loading, done: 1, total: 1 });

    let windows = token_windows(ids, cfg.ctx);
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

    let mut writer = CheckpointWriter::create(out_dir)?;
    writer.set_model_type(model_type(model_dir)?);
    // What the planner's online routing is compared with: the Fisher importance already
    // weighs each expert by this use.
    writer.set_routing(
        loaded
            .banks
            .iter()
            .zip(&importance)
            .map(|(bank, imp)| LayerRouting { layer: bank.layer, mass_share: imp.mass_share() })
            .collect(),
    );
    let total_blocks: usize = loaded.banks.iter().map(|b| 2 * b.num_experts).sum();
    let mut done = 0;
    let src = HfSource::<B>::new(&hf, device);
    let mut expert_tensors = HashSet::new();
    for (bank, imp) in loaded.banks.iter().zip(&importance) {
        let (h, i) = (bank.cfg.hidden, bank.cfg.intermediate);
        let wrap = |source| pw_models::ModelError::Load { dir: model_dir.display().to_string(), source };
        let rows = bank.layout.read_rows(&src, bank.num_experts, bank.cfg).map_err(wrap)?;
        expert_tensors.extend(bank.layout.tensor_names(bank.num_experts));
        for e in 0..bank.num_experts {
            let (gu_src, dn_src) = bank.layout.expert_sources(e);
            let parts = [
                (BlockKind::GateUp, &rows.gate_up[e], &imp.gate_up[e], 2 * i, h, gu_src),
                (BlockKind::Down, &rows.down[e], &imp.down[e], h, i, dn_src),
            ];
            for (kind, w, importance, r, c, sources) in parts {
                let name = expert_block_name(bank.layout.prefix(), e, kind);
                let block = ApBlock::quantize(&name, w, Some(importance), r, c, cfg.min_bits, cfg.max_bits)?;
                let meta = BlockMeta { name, layer: bank.layer, expert: e, kind, sources };
                writer.add_block(meta, &block)?;
                done += 1;
                progress(Progress { stage: Stage::Quantizing, done, total: total_blocks });
            }
        }
    }

    let dense: Vec<&str> = hf.names().filter(|n| !expert_tensors.contains(*n)).collect();
    for (n, name) in dense.iter().enumerate() {
        let (dtype, shape, bytes) = hf.raw(name)?;
        writer.add_dense(name, dtype, shape.to_vec(), bytes.to_vec())?;
        progress(Progress { stage: Stage::Copying, done: n + 1, total: dense.len() });
    }
    for f in SIDE_FILES {
        let p = model_dir.join(f);
        if p.is_file() {
            writer.copy_file(&p)?;
        }
    }
    let manifest = writer.finish()?;
    Ok(QuantizeReport { manifest, windows: windows.len(), tokens: ids.len(), calib_loss })
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
