//! Models over a quantized PagedWeight checkpoint directory (`pagedweight.json`).
//!
//! Non-expert tensors are stored unchanged and served as they are; every expert block is an
//! any-precision block that [`PwSource`] either dequantizes at one bit-width into the dense
//! [`Experts`] bank, or (over a [`PageTable`]) serves as pages of a [`PagedExperts`] bank that
//! keeps planes + LUTs on the device at per-page bit-widths.

use std::collections::{HashMap, HashSet};

use burn::tensor::backend::Backend;
use pw_format::{BlockKind, Checkpoint, FormatError, view_to_f32};
use pw_linear::{PageTable, PagedExperts};
use pw_nn::{DenseExperts, ExpertKeys, ExpertRows, Experts, GatedMlpConfig, LoadError, WeightSource};

/// Name of the block holding expert `expert`'s `kind` projection of the bank at `prefix`
/// (the bank's checkpoint prefix, e.g. `model.layers.0.block_sparse_moe.experts`):
/// `{prefix}.{expert}.gate_up` or `{prefix}.{expert}.down`. The quantizer writes these names and
/// [`PwSource`] reads them.
pub fn expert_block_name(prefix: &str, expert: usize, kind: BlockKind) -> String {
    format!("{prefix}.{expert}.{}", kind.name())
}

/// [`WeightSource`] over a quantized checkpoint whose experts are dequantized at `bits`, or
/// each block at its own bit-width ([`PwSource::with_block_bits`]).
pub struct PwSource<'a, B: Backend> {
    ckpt: &'a Checkpoint,
    bits: u8,
    /// Per-block bit-widths by block name, overriding `bits` (mixed allocations of the planner).
    block_bits: HashMap<String, u8>,
    device: B::Device,
    /// The original checkpoint tensors the blocks were made from: they still "exist" for
    /// [`WeightSource::has`], so models resolve the same expert layout as on the source model.
    block_sources: HashSet<String>,
    /// Paged experts: the table holding every expert block.
    pages: Option<PageTable>,
}

impl<'a, B: Backend> PwSource<'a, B> {
    /// Serves `ckpt` on `device`, experts at `bits` (checked against every block when the
    /// experts are built).
    pub fn new(ckpt: &'a Checkpoint, bits: u8, device: &B::Device) -> Self {
        let block_sources = ckpt.manifest().blocks.iter().flat_map(|b| b.sources.iter().cloned()).collect();
        Self { ckpt, bits, block_bits: HashMap::new(), device: device.clone(), block_sources, pages: None }
    }

    /// Dequantizes each block named in `block_bits` at its own bit-width (the others at the
    /// `bits` given to [`PwSource::new`]); checked against each block's stored range.
    pub fn with_block_bits(mut self, block_bits: HashMap<String, u8>) -> Self {
        self.block_bits = block_bits;
        self
    }

    /// Serves `ckpt` with every expert bank a [`PagedExperts`] over `table` (built from the
    /// same checkpoint, see [`PageTable::from_checkpoint`]).
    pub fn paged(ckpt: &'a Checkpoint, table: PageTable, device: &B::Device) -> Self {
        let max = ckpt.manifest().bit_range().map_or(8, |r| r.1);
        Self { pages: Some(table), ..Self::new(ckpt, max, device) }
    }

    fn block_rows(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, LoadError> {
        let block = self.ckpt.block(name).map_err(|e| LoadError::Source(e.to_string()))?;
        if (block.rows, block.cols) != (rows, cols) {
            return Err(LoadError::Shape {
                name: name.to_string(),
                expected: vec![rows, cols],
                got: vec![block.rows, block.cols],
            });
        }
        let bits = self.block_bits.get(name).copied().unwrap_or(self.bits);
        if !(block.min_bits..=block.max_bits).contains(&bits) {
            return Err(LoadError::Source(format!(
                "block `{name}` stores bits {}..={}, not {bits}",
                block.min_bits, block.max_bits
            )));
        }
        Ok(block.dequantize_reference(bits))
    }
}

impl<B: Backend> WeightSource<B> for PwSource<'_, B> {
    fn device(&self) -> B::Device {
        self.device.clone()
    }

    fn has(&self, name: &str) -> bool {
        self.ckpt.manifest().dense.contains_key(name) || self.block_sources.contains(name)
    }

    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        if !self.ckpt.manifest().dense.contains_key(name) {
            return Err(if self.block_sources.contains(name) {
                LoadError::Source(format!(
                    "`{name}` is stored as any-precision expert blocks, not as a tensor"
                ))
            } else {
                LoadError::Missing { name: name.to_string() }
            });
        }
        let view = self.ckpt.dense(name).map_err(|e| LoadError::Source(e.to_string()))?;
        let shape = view.shape();
        // Scalars saved as [1] and [] are the same thing.
        let numel: usize = shape.iter().product();
        if shape != expected && !(numel == 1 && expected.iter().product::<usize>() == 1) {
            return Err(LoadError::Shape {
                name: name.to_string(),
                expected: expected.to_vec(),
                got: shape.to_vec(),
            });
        }
        view_to_f32(&view).ok_or_else(|| {
            LoadError::Source(
                FormatError::Dtype {
                    path: self.ckpt.dir().join(&self.ckpt.manifest().dense[name]),
                    tensor: name.to_string(),
                    expected: "F32, F16 or BF16".into(),
                    found: format!("{}", view.dtype()),
                }
                .to_string(),
            )
        })
    }

    fn experts(
        &self,
        keys: &ExpertKeys,
        num_experts: usize,
        cfg: GatedMlpConfig,
    ) -> Result<Experts<B>, LoadError> {
        let layout = keys.resolve(self)?;
        if let Some(table) = &self.pages {
            let page = |e: usize, kind: BlockKind| {
                let name = expert_block_name(layout.prefix(), e, kind);
                table.page_named(&name).ok_or(LoadError::Missing { name })
            };
            let gate_up = (0..num_experts).map(|e| page(e, BlockKind::GateUp)).collect::<Result<_, _>>()?;
            let down = (0..num_experts).map(|e| page(e, BlockKind::Down)).collect::<Result<_, _>>()?;
            let bank = PagedExperts::new(table.clone(), gate_up, down, cfg)
                .map_err(|e| LoadError::Source(format!("{}: {e}", layout.prefix())))?;
            return Ok(bank.into_experts());
        }
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let mut rows = ExpertRows { gate_up: Vec::new(), down: Vec::new() };
        for e in 0..num_experts {
            let p = layout.prefix();
            rows.gate_up.push(self.block_rows(&expert_block_name(p, e, BlockKind::GateUp), 2 * i, h)?);
            rows.down.push(self.block_rows(&expert_block_name(p, e, BlockKind::Down), h, i)?);
        }
        Ok(Experts::Dense(DenseExperts::from_rows(rows, cfg, &self.device)))
    }
}
