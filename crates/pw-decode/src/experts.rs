//! The any-precision experts of the decode path as read from a checkpoint (host side); their
//! device storage under the weight page table is [`crate::PagedExperts`].

use std::path::Path;

use pw_format::{ApBlock, BlockKind, MANIFEST_FILE};
use pw_hf::Checkpoint;

use crate::config::{DecodeConfig, Family};
use crate::{DecodeError, read};

/// The any-precision experts of every layer (`[layer][expert] = (gate_up [2I, H], down [H, I])`;
/// empty for a layer without routed experts) and the bit-width each starts committed at; the
/// decoder hands them to its page table ([`crate::PagedExperts`]).
#[derive(Debug, Clone)]
pub struct ExpertBlocks {
    /// Blocks per layer and expert.
    pub blocks: Vec<Vec<(ApBlock, ApBlock)>>,
    /// Committed bits per layer and expert (gate_up, down).
    pub bits: Vec<Vec<(u8, u8)>>,
}

impl ExpertBlocks {
    /// Quantizes the experts of an HF checkpoint of `cfg`'s family (per-expert or fused
    /// layout) with uniform importance, all committed at `bits`.
    pub fn quantize_hf(ckpt: &Checkpoint, cfg: &DecodeConfig, bits: u8) -> Result<Self, DecodeError> {
        let (h, i) = (cfg.hidden, cfg.inter);
        let mut blocks = Vec::with_capacity(cfg.layers);
        let mut all_bits = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let mut layer = Vec::with_capacity(cfg.experts);
            if cfg.sparse[l] {
                for e in 0..cfg.experts {
                    let (gate_up, down) = expert_weights(ckpt, l, e, cfg)?;
                    let gu = ApBlock::quantize(
                        &format!("layers.{l}.experts.{e}.gate_up"),
                        &gate_up,
                        None,
                        2 * i,
                        h,
                        3,
                        8,
                    )?;
                    let dn =
                        ApBlock::quantize(&format!("layers.{l}.experts.{e}.down"), &down, None, h, i, 3, 8)?;
                    layer.push((gu, dn));
                }
            }
            all_bits.push(vec![(bits, bits); layer.len()]);
            blocks.push(layer);
        }
        Ok(Self { blocks, bits: all_bits })
    }
}

impl ExpertBlocks {
    /// The blocks `pagedweight quantize` wrote to the PagedWeight checkpoint `ckpt` (their
    /// Fisher-weighted sensitivities with them), each committed at `bits` clamped to the bit
    /// range it stores. Every expert of every sparse layer of `cfg` must have both blocks, of
    /// the model's shapes.
    pub fn from_checkpoint(
        ckpt: &pw_format::Checkpoint,
        cfg: &DecodeConfig,
        bits: u8,
    ) -> Result<Self, DecodeError> {
        let (h, i) = (cfg.hidden, cfg.inter);
        let path = ckpt.dir().join(MANIFEST_FILE);
        let entries = &ckpt.manifest().blocks;
        let mut blocks = Vec::with_capacity(cfg.layers);
        let mut all_bits = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let mut layer = Vec::new();
            let mut layer_bits = Vec::new();
            if cfg.sparse[l] {
                for e in 0..cfg.experts {
                    let mut pair = Vec::with_capacity(2);
                    for (kind, rows, cols) in [(BlockKind::GateUp, 2 * i, h), (BlockKind::Down, h, i)] {
                        let entry = entries
                            .iter()
                            .find(|b| b.layer == l && b.expert == e && b.kind == kind)
                            .ok_or_else(|| {
                                DecodeError::Unsupported(format!(
                                    "{}: no {kind:?} block for layer {l}, expert {e}",
                                    path.display()
                                ))
                            })?;
                        if (entry.rows, entry.cols) != (rows, cols) {
                            return Err(DecodeError::Shape {
                                name: entry.name.clone(),
                                expected: vec![rows, cols],
                                got: vec![entry.rows, entry.cols],
                            });
                        }
                        pair.push((ckpt.block(&entry.name)?, bits.clamp(entry.min_bits, entry.max_bits)));
                    }
                    let (dn, db) = pair.pop().expect("two blocks");
                    let (gu, gb) = pair.pop().expect("two blocks");
                    layer.push((gu, dn));
                    layer_bits.push((gb, db));
                }
            }
            blocks.push(layer);
            all_bits.push(layer_bits);
        }
        Ok(Self { blocks, bits: all_bits })
    }
}

impl ExpertBlocks {
    /// Writes these blocks and every tensor of the Hugging Face checkpoint `hf` (of the model
    /// `cfg` describes) but its experts into `w`: a PagedWeight checkpoint of blocks quantized
    /// elsewhere (e.g. by [`Self::quantize_hf`]). Blocks are named and sourced as `pagedweight
    /// quantize` names them (`{bank prefix}.{e}.{gate_up,down}`, from the expert tensors they
    /// replace), so the Burn models load the checkpoint too.
    pub fn write_checkpoint(
        &self,
        hf: &Checkpoint,
        cfg: &DecodeConfig,
        w: &mut pw_format::CheckpointWriter,
    ) -> Result<(), DecodeError> {
        for (l, layer) in self.blocks.iter().enumerate() {
            for (e, (gu, dn)) in layer.iter().enumerate() {
                let (prefix, gu_src, dn_src) = expert_sources(hf, l, e, cfg);
                for (kind, block, sources) in [(BlockKind::GateUp, gu, gu_src), (BlockKind::Down, dn, dn_src)]
                {
                    let name = format!("{prefix}.{e}.{}", kind.name());
                    let meta = pw_format::BlockMeta { name, layer: l, expert: e, kind, sources };
                    w.add_block(meta, block)?;
                }
            }
        }
        for name in hf.names().filter(|n| !n.contains(".experts.")) {
            let (dtype, shape, bytes) = hf.raw(name)?;
            w.add_dense(name, dtype, shape.to_vec(), bytes.to_vec())?;
        }
        Ok(())
    }
}

/// The dense tensors of the model in `dir`: a Hugging Face checkpoint, or the shards of a
/// PagedWeight checkpoint (which keeps every tensor but the experts under its original name).
pub(crate) fn dense_checkpoint(dir: &Path) -> Result<Checkpoint, DecodeError> {
    if !dir.join(MANIFEST_FILE).is_file() {
        return Ok(Checkpoint::open(dir)?);
    }
    let pw = pw_format::Checkpoint::open(dir)?;
    let mut files: Vec<_> = pw.manifest().dense.values().map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    Ok(Checkpoint::from_files(dir.to_path_buf(), &files)?)
}

/// Where a family keeps layer `l`'s experts: `(prefix, [gate, up, down])` of the per-expert
/// layout (`{prefix}.{e}.{name}.weight`) and the prefix of the fused one
/// (`{fused}.gate_up_proj [E, 2I, H]`, `{fused}.down_proj [E, H, I]`).
pub(crate) fn expert_keys(cfg: &DecodeConfig, root: &str, l: usize) -> (String, [&'static str; 3], String) {
    let p = format!("{root}.layers.{l}");
    match cfg.family {
        Family::Mixtral => {
            (format!("{p}.block_sparse_moe.experts"), ["w1", "w3", "w2"], format!("{p}.mlp.experts"))
        }
        Family::Qwen2Moe => {
            (format!("{p}.mlp.experts"), ["gate_proj", "up_proj", "down_proj"], format!("{p}.mlp.experts"))
        }
        Family::Gemma4 => {
            (format!("{p}.experts"), ["gate_proj", "up_proj", "down_proj"], format!("{p}.experts"))
        }
    }
}

/// Quantizes the experts of the Hugging Face checkpoint in `dir` with uniform importance
/// ([`ExpertBlocks::quantize_hf`], 3..8 bits) and writes them, its other tensors and its
/// `config.json` as a PagedWeight checkpoint in `out`: paged experts for a directory `pagedweight
/// quantize` has not calibrated (the planner's sensitivities are then the quantizer's proxies).
pub fn write_quantized_hf(dir: &Path, out: &Path) -> Result<(), DecodeError> {
    let hf = Checkpoint::open(dir)?;
    let cfg = DecodeConfig::from_model(&pw_hf::ModelConfig::from_dir(dir)?)?;
    let blocks = ExpertBlocks::quantize_hf(&hf, &cfg, 8)?;
    let mut w = pw_format::CheckpointWriter::create(out)?;
    blocks.write_checkpoint(&hf, &cfg, &mut w)?;
    w.copy_file(&dir.join("config.json"))?;
    w.finish()?;
    Ok(())
}

/// The bank prefix of layer `l` and the tensors expert `e`'s gate_up and down blocks come from:
/// per-expert tensors where the checkpoint has them, else the layer's fused ones (as
/// `pw_nn::ExpertLayout::expert_sources` names them).
fn expert_sources(
    ckpt: &Checkpoint,
    l: usize,
    e: usize,
    cfg: &DecodeConfig,
) -> (String, Vec<String>, Vec<String>) {
    let (per, [g, u, d], fused) = expert_keys(cfg, crate::root(ckpt), l);
    if ckpt.contains(&format!("{per}.{e}.{g}.weight")) {
        let gu = vec![format!("{per}.{e}.{g}.weight"), format!("{per}.{e}.{u}.weight")];
        let dn = vec![format!("{per}.{e}.{d}.weight")];
        (per, gu, dn)
    } else {
        let (gu, dn) = (vec![format!("{fused}.gate_up_proj")], vec![format!("{fused}.down_proj")]);
        (fused, gu, dn)
    }
}

/// `(gate_up [2I·H], down [H·I])` of one expert, row-major as the kernels read them.
pub fn expert_weights(
    ckpt: &Checkpoint,
    l: usize,
    e: usize,
    cfg: &DecodeConfig,
) -> Result<(Vec<f32>, Vec<f32>), DecodeError> {
    let (h, i) = (cfg.hidden, cfg.inter);
    let (per, [g, u, d], fused) = expert_keys(cfg, crate::root(ckpt), l);
    if ckpt.contains(&format!("{per}.{e}.{g}.weight")) {
        let mut gate_up = read(ckpt, &format!("{per}.{e}.{g}.weight"), &[i, h])?;
        gate_up.extend(read(ckpt, &format!("{per}.{e}.{u}.weight"), &[i, h])?);
        return Ok((gate_up, read(ckpt, &format!("{per}.{e}.{d}.weight"), &[h, i])?));
    }
    let gu = read(ckpt, &format!("{fused}.gate_up_proj"), &[cfg.experts, 2 * i, h])?;
    let dn = read(ckpt, &format!("{fused}.down_proj"), &[cfg.experts, h, i])?;
    Ok((gu[e * 2 * i * h..][..2 * i * h].to_vec(), dn[e * h * i..][..h * i].to_vec()))
}
