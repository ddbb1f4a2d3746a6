//! The quantized checkpoint: a directory with the source `config.json` and
//! tokenizer files, a versioned manifest, and safetensors shards holding the
//! blocks' planes and LUTs plus every non-expert tensor unchanged.

use crate::block::check_range;
use crate::{ApBlock, FormatError, StFile, TensorMap, write_tensors};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// File name of the manifest inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "pagedweight.json";
/// Magic string of the manifest.
pub const MAGIC: &str = "pagedweight-checkpoint";
/// Manifest version written and read by this build.
pub const VERSION: u32 = 1;
/// Default shard size of the writer.
pub const DEFAULT_SHARD_BYTES: usize = 2 << 30;

/// Which projection of an expert a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockKind {
    /// Gate and up projections stacked (gate rows first): `[2·I, H]`.
    GateUp,
    /// Down projection `[H, I]`.
    Down,
}

/// One any-precision block in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockEntry {
    /// Tensor prefix of the block inside its file.
    pub name: String,
    /// Decoder layer.
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// Projection.
    pub kind: BlockKind,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Lowest stored bit-width.
    pub min_bits: u8,
    /// Highest stored bit-width (number of planes).
    pub max_bits: u8,
    /// Shard file holding the block.
    pub file: String,
    /// Importance-weighted squared error per bit-width `min_bits..=max_bits`.
    pub sensitivity: Vec<f64>,
    /// Source tensor names the block was built from.
    #[serde(default)]
    pub sources: Vec<String>,
}

impl BlockEntry {
    /// Bytes on a device at `bits`: `(planes, lut)`.
    pub fn bytes_at(&self, bits: u8) -> (usize, usize) {
        (bits as usize * self.rows * self.cols.div_ceil(32) * 4, self.rows * (1usize << bits) * 2)
    }
}

/// The manifest (`pagedweight.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MAGIC`].
    pub magic: String,
    /// Format version, [`VERSION`].
    pub version: u32,
    /// `model_type` of the source `config.json`, when known.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Any-precision blocks.
    pub blocks: Vec<BlockEntry>,
    /// Unchanged tensors: name → shard file.
    pub dense: BTreeMap<String, String>,
}

impl Manifest {
    /// Lowest and highest bit-width stored by any block, `None` without blocks.
    pub fn bit_range(&self) -> Option<(u8, u8)> {
        let lo = self.blocks.iter().map(|b| b.min_bits).max()?;
        let hi = self.blocks.iter().map(|b| b.max_bits).min()?;
        Some((lo, hi))
    }
}

/// What a block is, apart from its data.
#[derive(Debug, Clone)]
pub struct BlockMeta {
    /// Tensor prefix.
    pub name: String,
    /// Decoder layer.
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// Projection.
    pub kind: BlockKind,
    /// Source tensor names.
    pub sources: Vec<String>,
}

type Pending = TensorMap;

/// Writes a checkpoint directory shard by shard.
#[derive(Debug)]
pub struct CheckpointWriter {
    dir: PathBuf,
    shard_bytes: usize,
    pending: Pending,
    pending_bytes: usize,
    shard: usize,
    manifest: Manifest,
}

impl CheckpointWriter {
    /// Creates (or reuses) `dir`.
    pub fn create(dir: impl AsRef<Path>) -> Result<Self, FormatError> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| FormatError::io(&dir, e))?;
        Ok(Self {
            dir,
            shard_bytes: DEFAULT_SHARD_BYTES,
            pending: Pending::new(),
            pending_bytes: 0,
            shard: 1,
            manifest: Manifest {
                magic: MAGIC.into(),
                version: VERSION,
                model_type: None,
                blocks: Vec::new(),
                dense: BTreeMap::new(),
            },
        })
    }

    /// Sets the size after which a shard is closed.
    pub fn with_shard_bytes(mut self, bytes: usize) -> Self {
        self.shard_bytes = bytes.max(1);
        self
    }

    /// Records the source model type.
    pub fn set_model_type(&mut self, model_type: Option<String>) {
        self.manifest.model_type = model_type;
    }

    fn shard_name(&self) -> String {
        format!("pw-{:05}.safetensors", self.shard)
    }

    fn push(&mut self, tensors: Pending) -> Result<String, FormatError> {
        let file = self.shard_name();
        for (k, v) in tensors {
            self.pending_bytes += v.2.len();
            self.pending.insert(k, v);
        }
        if self.pending_bytes >= self.shard_bytes {
            self.flush()?;
        }
        Ok(file)
    }

    fn flush(&mut self) -> Result<(), FormatError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self.dir.join(self.shard_name());
        let pending = std::mem::take(&mut self.pending);
        write_tensors(&path, &pending, None)?;
        self.pending_bytes = 0;
        self.shard += 1;
        Ok(())
    }

    /// Adds an any-precision block.
    pub fn add_block(&mut self, meta: BlockMeta, block: &ApBlock) -> Result<(), FormatError> {
        let file = self.push(block.tensors(&meta.name))?;
        self.manifest.blocks.push(BlockEntry {
            name: meta.name,
            layer: meta.layer,
            expert: meta.expert,
            kind: meta.kind,
            rows: block.rows,
            cols: block.cols,
            min_bits: block.min_bits,
            max_bits: block.max_bits,
            file,
            sensitivity: block.sensitivity.clone(),
            sources: meta.sources,
        });
        Ok(())
    }

    /// Adds a tensor that is stored unchanged.
    pub fn add_dense(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<(), FormatError> {
        let mut t = Pending::new();
        t.insert(name.to_string(), (dtype, shape, bytes));
        let file = self.push(t)?;
        self.manifest.dense.insert(name.to_string(), file);
        Ok(())
    }

    /// Copies a side file (config.json, tokenizer files) into the checkpoint.
    pub fn copy_file(&self, src: &Path) -> Result<(), FormatError> {
        let name =
            src.file_name().ok_or_else(|| FormatError::io(src, std::io::ErrorKind::InvalidInput.into()))?;
        std::fs::copy(src, self.dir.join(name)).map_err(|e| FormatError::io(src, e))?;
        Ok(())
    }

    /// Writes the last shard and the manifest.
    pub fn finish(mut self) -> Result<Manifest, FormatError> {
        self.flush()?;
        let path = self.dir.join(MANIFEST_FILE);
        let json = serde_json::to_string_pretty(&self.manifest).expect("manifest serialises");
        std::fs::write(&path, json).map_err(|e| FormatError::io(&path, e))?;
        Ok(self.manifest)
    }
}

/// An opened checkpoint: manifest validated, every shard mapped, and every
/// tensor the manifest names checked for presence, dtype and shape.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    files: HashMap<String, StFile>,
}

impl Checkpoint {
    /// Opens and validates the checkpoint in `dir`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, FormatError> {
        let dir = dir.as_ref().to_path_buf();
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(|e| FormatError::io(&mpath, e))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| FormatError::Manifest { path: mpath.clone(), reason: e.to_string() })?;
        // Magic and version first, so a newer format says so instead of failing on a field.
        let magic = value.get("magic").and_then(|v| v.as_str()).unwrap_or_default();
        if magic != MAGIC {
            return Err(FormatError::Magic { path: mpath, found: magic.into(), expected: MAGIC });
        }
        let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if version != VERSION {
            return Err(FormatError::Version { path: mpath, found: version, supported: VERSION });
        }
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| FormatError::Manifest { path: mpath.clone(), reason: e.to_string() })?;

        let mut files = HashMap::new();
        let names = manifest.blocks.iter().map(|b| &b.file).chain(manifest.dense.values());
        for name in names {
            if !files.contains_key(name) {
                files.insert(name.clone(), StFile::open(dir.join(name))?);
            }
        }
        for b in &manifest.blocks {
            check_range(&b.name, b.min_bits, b.max_bits)?;
            if b.rows == 0 || b.cols == 0 {
                return Err(FormatError::Block {
                    block: b.name.clone(),
                    reason: format!("shape {}x{} is empty", b.rows, b.cols),
                });
            }
            if b.sensitivity.len() != (b.max_bits - b.min_bits + 1) as usize {
                return Err(FormatError::Block {
                    block: b.name.clone(),
                    reason: format!(
                        "sensitivity has {} entries for bits {}..={}",
                        b.sensitivity.len(),
                        b.min_bits,
                        b.max_bits
                    ),
                });
            }
            let f = &files[&b.file];
            f.expect(
                &format!("{}.planes", b.name),
                Dtype::U32,
                &[b.max_bits as usize, b.rows, b.cols.div_ceil(32)],
            )?;
            for bits in b.min_bits..=b.max_bits {
                f.expect(&format!("{}.lut{bits}", b.name), Dtype::F16, &[b.rows, 1 << bits])?;
            }
        }
        for (name, file) in &manifest.dense {
            files[file].tensor(name)?;
        }
        Ok(Self { dir, manifest, files })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Loads block `name`.
    pub fn block(&self, name: &str) -> Result<ApBlock, FormatError> {
        let e = self.manifest.blocks.iter().find(|b| b.name == name).ok_or_else(|| {
            FormatError::UnknownBlock { path: self.dir.join(MANIFEST_FILE), block: name.into() }
        })?;
        ApBlock::read(
            &self.files[&e.file],
            &e.name,
            e.rows,
            e.cols,
            e.min_bits,
            e.max_bits,
            e.sensitivity.clone(),
        )
    }

    /// A view of unchanged tensor `name`.
    pub fn dense(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let file = self.manifest.dense.get(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.dir.join(MANIFEST_FILE),
            tensor: name.into(),
        })?;
        self.files[file].tensor(name)
    }
}
