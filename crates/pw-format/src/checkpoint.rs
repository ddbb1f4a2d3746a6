//! The quantized checkpoint: a directory with the source `config.json` and
//! tokenizer files, a versioned manifest, and safetensors shards holding the
//! blocks' planes and LUTs plus every non-expert tensor unchanged.

use crate::{ApBlock, FormatError, StFile, TensorMap, write_tensors};
use pw_quant::{MAX_BITS, MIN_BITS};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Component, Path, PathBuf};

/// File name of the manifest inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "pagedweight.json";
/// Magic string of the manifest.
pub const MAGIC: &str = "pagedweight-checkpoint";
/// Manifest version written and read by this build.
pub const VERSION: u32 = 1;
/// The writer's record of a checkpoint still being written: the manifest of every closed shard
/// and what the run was (see [`CheckpointWriter::resume`]).
pub const PARTIAL_FILE: &str = "pagedweight.partial.json";

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

impl BlockKind {
    /// `gate_up` or `down`: the name the manifest writes, and block names and labels use.
    pub fn name(self) -> &'static str {
        match self {
            Self::GateUp => "gate_up",
            Self::Down => "down",
        }
    }
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

    /// [`Self::bytes_at`], `None` where a count overflows `usize` (an untrusted manifest).
    pub fn checked_bytes_at(&self, bits: u8) -> Option<(usize, usize)> {
        let planes =
            (bits as usize).checked_mul(self.rows)?.checked_mul(self.cols.div_ceil(32))?.checked_mul(4)?;
        let lut = self.rows.checked_mul(1usize.checked_shl(bits.into())?)?.checked_mul(2)?;
        Some((planes, lut))
    }
}

/// Checks that a file name from the manifest stays inside the checkpoint directory: relative,
/// non-empty, no `..` component. The reason is the error text.
fn check_relative(name: &str) -> Result<(), String> {
    let path = Path::new(name);
    if name.is_empty() || name.contains('\0') {
        return Err(format!("{name:?} is not a file name"));
    }
    if path.has_root() || path.is_absolute() {
        return Err(format!("`{name}` is an absolute path; files must lie inside the checkpoint directory"));
    }
    let mut normal = false;
    for c in path.components() {
        match c {
            Component::Normal(_) => normal = true,
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(format!(
                    "`{name}` has a `..` component; files must lie inside the checkpoint directory"
                ));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!(
                    "`{name}` is an absolute path; files must lie inside the checkpoint directory"
                ));
            }
        }
    }
    if !normal {
        return Err(format!("`{name}` names no file"));
    }
    Ok(())
}

/// Resolves a file name the manifest checked with [`check_relative`] against the checkpoint
/// directory, following symlinks: a target outside the directory (or, for a checkpoint inside
/// the Hugging Face cache `<repo>/snapshots/<rev>/`, outside `<repo>/blobs/`, where the cache's
/// links point) or anything but a regular file is refused. A missing file resolves to its joined
/// path, so opening it reports the I/O error with that path.
fn resolve_inside(dir: &Path, canon_dir: &Path, name: &str) -> Result<PathBuf, String> {
    let joined = dir.join(name);
    let Ok(real) = joined.canonicalize() else { return Ok(joined) };
    let hub_blobs = canon_dir
        .parent()
        .filter(|snapshots| snapshots.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .map(|repo| repo.join("blobs"));
    let inside = real.starts_with(canon_dir) || hub_blobs.is_some_and(|b| real.starts_with(b));
    if !inside {
        return Err(format!(
            "`{name}` resolves to {}, outside the checkpoint directory {}",
            real.display(),
            canon_dir.display()
        ));
    }
    if !real.is_file() {
        return Err(format!("`{name}` resolves to {}, which is not a regular file", real.display()));
    }
    Ok(real)
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
    /// How the calibration text was routed, per sparse layer (absent in checkpoints written
    /// before it was recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routing: Vec<LayerRouting>,
}

/// One sparse layer's routing on the calibration text: what the planner's online routing
/// statistics are compared with, since the Fisher sensitivities already weigh each expert by
/// this use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerRouting {
    /// Decoder layer.
    pub layer: usize,
    /// Per expert, its share of the layer's routing-weight mass (1 = an average expert).
    pub mass_share: Vec<f64>,
}

impl Manifest {
    /// Parses manifest JSON and [validates](Self::validate) it; `path` is the manifest file,
    /// named in every error.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, FormatError> {
        let bad = |reason: String| FormatError::Manifest { path: path.to_path_buf(), reason };
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        // Magic and version first, so a newer format says so instead of failing on a field.
        let magic = value.get("magic").and_then(|v| v.as_str()).unwrap_or_default();
        if magic != MAGIC {
            return Err(FormatError::Magic {
                path: path.to_path_buf(),
                found: magic.into(),
                expected: MAGIC,
            });
        }
        let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if version != u64::from(VERSION) {
            let found = u32::try_from(version).unwrap_or(u32::MAX);
            return Err(FormatError::Version { path: path.to_path_buf(), found, supported: VERSION });
        }
        let manifest: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        manifest.validate(path)?;
        Ok(manifest)
    }

    /// Checks every entry without touching the shards: bit ranges inside `3..=8`, non-empty
    /// shapes whose byte counts fit in `usize`, one sensitivity per stored bit-width, no two
    /// blocks with one name or one (layer, expert, kind), a gate_up and a down of one expert
    /// that agree on `[2·I, H]` / `[H, I]`, one shape per (layer, kind), and every file a
    /// relative path inside the checkpoint directory. `path` is the manifest file, for errors.
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        let err = |entry: String, field: &str, reason: String| FormatError::ManifestEntry {
            path: path.to_path_buf(),
            entry,
            field: field.into(),
            reason,
        };
        let label = |i: usize| format!("block `{}` (blocks[{i}])", self.blocks[i].name);
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        let mut by_key: HashMap<(usize, usize, BlockKind), usize> = HashMap::new();
        let mut by_layer: HashMap<(usize, BlockKind), usize> = HashMap::new();
        let mut total = 0usize;
        for (i, b) in self.blocks.iter().enumerate() {
            if b.name.is_empty() {
                return Err(err(label(i), "name", "is empty".into()));
            }
            for (field, bits) in [("min_bits", b.min_bits), ("max_bits", b.max_bits)] {
                if !(MIN_BITS..=MAX_BITS).contains(&bits) {
                    return Err(err(label(i), field, format!("{bits} is outside {MIN_BITS}..={MAX_BITS}")));
                }
            }
            if b.min_bits > b.max_bits {
                let reason = format!("{} exceeds max_bits {}", b.min_bits, b.max_bits);
                return Err(err(label(i), "min_bits", reason));
            }
            for (field, n) in [("rows", b.rows), ("cols", b.cols)] {
                if n == 0 {
                    return Err(err(label(i), field, "is 0: the block is empty".into()));
                }
            }
            if b.kind == BlockKind::GateUp && !b.rows.is_multiple_of(2) {
                let reason = format!("{} is odd, but gate_up stacks gate and up rows [2·I, H]", b.rows);
                return Err(err(label(i), "rows", reason));
            }
            let want = (b.max_bits - b.min_bits + 1) as usize;
            if b.sensitivity.len() != want {
                let reason = format!(
                    "has {} entries, bits {}..={} need {want}",
                    b.sensitivity.len(),
                    b.min_bits,
                    b.max_bits
                );
                return Err(err(label(i), "sensitivity", reason));
            }
            if let Some(s) = b.sensitivity.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
                return Err(err(label(i), "sensitivity", format!("{s} is not a finite error >= 0")));
            }
            let bytes = b.checked_bytes_at(b.max_bits).and_then(|(p, l)| p.checked_add(l));
            total = bytes.and_then(|n| total.checked_add(n)).ok_or_else(|| {
                let reason = format!(
                    "{} rows x {} cols at {} bits: the byte count overflows",
                    b.rows, b.cols, b.max_bits
                );
                err(label(i), "rows", reason)
            })?;
            check_relative(&b.file).map_err(|reason| err(label(i), "file", reason))?;
            if let Some(j) = by_name.insert(&b.name, i) {
                return Err(err(label(i), "name", format!("duplicates blocks[{j}]")));
            }
            if let Some(j) = by_key.insert((b.layer, b.expert, b.kind), i) {
                let reason =
                    format!("layer {} expert {} {:?} is also {}", b.layer, b.expert, b.kind, label(j));
                return Err(err(label(i), "kind", reason));
            }
            let first = *by_layer.entry((b.layer, b.kind)).or_insert(i);
            let f = &self.blocks[first];
            if (f.rows, f.cols) != (b.rows, b.cols) {
                let reason = format!(
                    "shape {}x{} differs from {}x{} of {} in the same layer",
                    b.rows,
                    b.cols,
                    f.rows,
                    f.cols,
                    label(first)
                );
                return Err(err(label(i), "rows", reason));
            }
        }
        // gate_up [2·I, H] and down [H, I] of one expert.
        for (g, gu) in self.blocks.iter().enumerate().filter(|(_, b)| b.kind == BlockKind::GateUp) {
            let Some(&d) = by_key.get(&(gu.layer, gu.expert, BlockKind::Down)) else { continue };
            let dn = &self.blocks[d];
            if gu.cols != dn.rows || dn.cols.checked_mul(2) != Some(gu.rows) {
                let reason = format!(
                    "gate_up {}x{} and down {}x{} ({}) disagree: expected [2·I, H] and [H, I]",
                    gu.rows,
                    gu.cols,
                    dn.rows,
                    dn.cols,
                    label(d)
                );
                return Err(err(label(g), "rows", reason));
            }
        }
        let mut routed_layers = HashSet::new();
        for (i, r) in self.routing.iter().enumerate() {
            let entry = format!("routing[{i}] (layer {})", r.layer);
            if !routed_layers.insert(r.layer) {
                return Err(err(entry, "layer", "appears twice".into()));
            }
            let experts =
                self.blocks.iter().filter(|b| b.layer == r.layer && b.kind == BlockKind::GateUp).count();
            if experts == 0 {
                return Err(err(entry, "layer", "has no expert blocks".into()));
            }
            if r.mass_share.len() != experts {
                let reason = format!("has {} entries for the layer's {experts} experts", r.mass_share.len());
                return Err(err(entry, "mass_share", reason));
            }
            if let Some(s) = r.mass_share.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
                return Err(err(entry, "mass_share", format!("{s} is not a finite share >= 0")));
            }
        }
        for (name, file) in &self.dense {
            let entry = format!("dense tensor `{name}`");
            if name.is_empty() {
                return Err(err(entry, "dense", "a tensor name is empty".into()));
            }
            check_relative(file).map_err(|reason| err(entry, "file", reason))?;
        }
        Ok(())
    }

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
    /// Identifies the run for [`Self::resume`]; `None`: no partial record is kept.
    run_key: Option<String>,
}

/// [`PARTIAL_FILE`]'s contents.
#[derive(Serialize, Deserialize)]
struct Partial {
    run_key: String,
    next_shard: usize,
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
                routing: Vec::new(),
            },
            run_key: None,
        })
    }

    /// A writer that can be resumed: every time a shard is closed it records the manifest so far
    /// in [`PARTIAL_FILE`], tagged with `run_key` (what the caller needs to be equal for the
    /// output to be the same: inputs and settings). When `dir` already holds such a record
    /// with the same key, the writer continues after its last closed shard — the entries in
    /// it are kept ([`Self::has_block`], [`Self::has_dense`]) — instead of starting over; a
    /// record of another run is ignored and overwritten.
    pub fn resume(dir: impl AsRef<Path>, run_key: &str) -> Result<Self, FormatError> {
        let mut w = Self::create(dir)?;
        w.run_key = Some(run_key.to_string());
        let path = w.dir.join(PARTIAL_FILE);
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(w) };
        let Ok(partial) = serde_json::from_str::<Partial>(&text) else { return Ok(w) };
        if partial.run_key == run_key
            && partial.manifest.magic == MAGIC
            && partial.manifest.version == VERSION
        {
            w.shard = partial.next_shard;
            w.manifest = partial.manifest;
        }
        Ok(w)
    }

    /// Whether the block `name` was written by an earlier run this writer resumed.
    pub fn has_block(&self, name: &str) -> bool {
        self.manifest.blocks.iter().any(|b| b.name == name)
    }

    /// Whether the unchanged tensor `name` was written by an earlier run this writer resumed.
    pub fn has_dense(&self, name: &str) -> bool {
        self.manifest.dense.contains_key(name)
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

    /// Records how the calibration text was routed (checked against the blocks by
    /// [`Self::finish`]).
    pub fn set_routing(&mut self, routing: Vec<LayerRouting>) {
        self.manifest.routing = routing;
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
        if let Some(key) = &self.run_key {
            let partial =
                Partial { run_key: key.clone(), next_shard: self.shard, manifest: self.manifest.clone() };
            let json = serde_json::to_string(&partial).expect("manifest serialises");
            // Written beside and renamed, so an interruption never leaves half a record.
            let path = self.dir.join(PARTIAL_FILE);
            let tmp = self.dir.join(format!("{PARTIAL_FILE}.tmp"));
            std::fs::write(&tmp, json).map_err(|e| FormatError::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| FormatError::io(&path, e))?;
        }
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

    /// Writes the last shard and the manifest, after [validating](Manifest::validate) it so
    /// that a checkpoint this writes always opens (a block added twice is refused here).
    pub fn finish(mut self) -> Result<Manifest, FormatError> {
        let path = self.dir.join(MANIFEST_FILE);
        self.manifest.validate(&path)?;
        self.flush()?;
        let json = serde_json::to_string_pretty(&self.manifest).expect("manifest serialises");
        std::fs::write(&path, json).map_err(|e| FormatError::io(&path, e))?;
        let partial = self.dir.join(PARTIAL_FILE);
        if partial.exists() {
            std::fs::remove_file(&partial).map_err(|e| FormatError::io(&partial, e))?;
        }
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
    /// Opens and validates the checkpoint in `dir`. Every file the manifest names is resolved
    /// inside `dir` (see [`Manifest::validate`]); a symlink that leads out of it is refused.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, FormatError> {
        let dir = dir.as_ref().to_path_buf();
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(|e| FormatError::io(&mpath, e))?;
        let manifest = Manifest::from_json_str(&text, &mpath)?;
        let canon_dir = dir.canonicalize().map_err(|e| FormatError::io(&dir, e))?;

        let mut files = HashMap::new();
        let blocks = manifest
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("block `{}` (blocks[{i}])", b.name), &b.file));
        let dense = manifest.dense.iter().map(|(name, file)| (format!("dense tensor `{name}`"), file));
        for (entry, name) in blocks.chain(dense) {
            if !files.contains_key(name) {
                let path = resolve_inside(&dir, &canon_dir, name).map_err(|reason| {
                    FormatError::ManifestEntry { path: mpath.clone(), entry, field: "file".into(), reason }
                })?;
                files.insert(name.clone(), StFile::open(path)?);
            }
        }
        for b in &manifest.blocks {
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
