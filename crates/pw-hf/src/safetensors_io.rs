use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::SafeTensors;

use crate::{HfError, Result};

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 64-bit integers (token ids in reference files).
    I64,
    /// Anything else, by its safetensors name.
    Other(&'static str),
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DType::F32 => f.write_str("F32"),
            DType::F16 => f.write_str("F16"),
            DType::BF16 => f.write_str("BF16"),
            DType::I64 => f.write_str("I64"),
            DType::Other(s) => f.write_str(s),
        }
    }
}

/// Our dtype of a safetensors dtype; every one we cannot read keeps its own name (`I16`, `U64`,
/// …) so that an error says which dtype it met.
fn dtype_of(d: safetensors::Dtype) -> DType {
    use safetensors::Dtype as D;
    match d {
        D::F32 => DType::F32,
        D::F16 => DType::F16,
        D::BF16 => DType::BF16,
        D::I64 => DType::I64,
        D::F64 => DType::Other("F64"),
        D::I32 => DType::Other("I32"),
        D::U32 => DType::Other("U32"),
        D::U64 => DType::Other("U64"),
        D::I16 => DType::Other("I16"),
        D::U16 => DType::Other("U16"),
        D::I8 => DType::Other("I8"),
        D::U8 => DType::Other("U8"),
        D::BOOL => DType::Other("BOOL"),
        D::F8_E5M2 => DType::Other("F8_E5M2"),
        D::F8_E4M3 => DType::Other("F8_E4M3"),
        D::F8_E8M0 => DType::Other("F8_E8M0"),
        D::F6_E2M3 => DType::Other("F6_E2M3"),
        D::F6_E3M2 => DType::Other("F6_E3M2"),
        D::F4 => DType::Other("F4"),
        // A dtype added to safetensors after this was written.
        _ => DType::Other("an unknown safetensors dtype"),
    }
}

/// Checks that no tensor of a safetensors header ends past the end of the `len`-byte file,
/// before `SafeTensors::read_metadata` sums the offsets: offsets near `usize::MAX` overflow
/// that sum, which panics in builds with overflow checks. Headers it cannot parse are left to
/// `read_metadata` to report.
pub(crate) fn check_data_offsets(bytes: &[u8]) -> std::result::Result<(), String> {
    let Some(n) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))) else {
        return Ok(());
    };
    let Some(header) = usize::try_from(n).ok().and_then(|n| bytes.get(8..8usize.checked_add(n)?)) else {
        return Ok(());
    };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header) else {
        return Ok(());
    };
    let data = (bytes.len() - 8 - header.len()) as u64;
    for (name, info) in &map {
        let end = info.get("data_offsets").and_then(|o| o.get(1)).and_then(serde_json::Value::as_u64);
        if let Some(end) = end.filter(|&e| e > data) {
            return Err(format!(
                "tensor `{name}` ends at data offset {end}, past the {data} data bytes of the file"
            ));
        }
    }
    Ok(())
}

/// A tensor read to the host as `f32`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

struct Entry {
    shard: usize,
    dtype: DType,
    raw_dtype: safetensors::Dtype,
    shape: Vec<usize>,
    /// Byte range inside the shard's mapped file.
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// The safetensors weights of one model directory, single-file or sharded, memory-mapped.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

fn map_file(path: &Path) -> std::io::Result<Mmap> {
    let file = File::open(path)?;
    // SAFETY: the checkpoint files are treated as immutable inputs; a concurrent writer would
    // be a user error, as with every memory-mapped model loader.
    unsafe { Mmap::map(&file) }
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|source| HfError::Io { path: index.clone(), source })?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|source| HfError::Json { path: index.clone(), source })?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| HfError::Config {
                path: index.clone(),
                field: "weight_map".into(),
                message: "missing or not an object".into(),
            })?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| HfError::Config {
                    path: index.clone(),
                    field: format!("weight_map.{tensor}"),
                    message: "not a file name".into(),
                })?;
                if !names.iter().any(|n| n == file) {
                    names.push(file.to_string());
                }
            }
            let mut paths = Vec::new();
            for name in names {
                let inside = !name.is_empty()
                    && Path::new(&name)
                        .components()
                        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
                if !inside {
                    let tensor = map.iter().find(|(_, f)| f.as_str() == Some(&name)).map_or("", |(t, _)| t);
                    return Err(HfError::Config {
                        path: index.clone(),
                        field: format!("weight_map.{tensor}"),
                        message: format!("shard `{name}` is not a file name inside {}", dir.display()),
                    });
                }
                let p = dir.join(&name);
                if let Err(source) = File::open(&p) {
                    return Err(HfError::MissingShard { index: index.clone(), shard: name, source });
                }
                paths.push(p);
            }
            paths
        } else if single.exists() {
            vec![single]
        } else {
            return Err(HfError::NoWeights { dir });
        };
        Self::from_files(dir, &files)
    }

    /// Opens the given safetensors files as one checkpoint; a tensor name found in two files
    /// is an error naming both.
    pub fn from_files(dir: PathBuf, files: &[PathBuf]) -> Result<Self> {
        let mut ck = Self { dir, shards: Vec::new(), entries: BTreeMap::new() };
        for path in files {
            let map = map_file(path).map_err(|source| HfError::Io { path: path.clone(), source })?;
            ck.add_shard(path.clone(), map)?;
        }
        Ok(ck)
    }

    /// A checkpoint of no files yet, for [`Self::add_shard`].
    #[cfg(test)]
    pub(crate) fn empty(dir: PathBuf) -> Self {
        Self { dir, shards: Vec::new(), entries: BTreeMap::new() }
    }

    /// Parses the header of one mapped safetensors file and adds its tensors.
    pub(crate) fn add_shard(&mut self, path: PathBuf, map: Mmap) -> Result<()> {
        let bad = |message: String| HfError::Safetensors { path: path.clone(), message };
        check_data_offsets(&map).map_err(bad)?;
        let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
        let base = 8 + header_len;
        let mut tensors: Vec<_> = meta.tensors().into_iter().collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, info) in tensors {
            if let Some(other) = self.entries.get(&name) {
                return Err(bad(format!(
                    "tensor `{name}` is also in {}",
                    self.shards[other.shard].path.display()
                )));
            }
            let (s, e) = info.data_offsets;
            let entry = Entry {
                shard: self.shards.len(),
                dtype: dtype_of(info.dtype),
                raw_dtype: info.dtype,
                shape: info.shape.clone(),
                start: base + s,
                end: base + e,
            };
            self.entries.insert(name, entry);
        }
        self.shards.push(Shard { path, map });
        Ok(())
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .get(name)
            .ok_or_else(|| HfError::MissingTensor { name: name.to_string(), dir: self.dir.clone() })
    }

    /// Stored dtype and shape of a tensor.
    pub fn info(&self, name: &str) -> Result<(DType, &[usize])> {
        let e = self.entry(name)?;
        Ok((e.dtype, &e.shape))
    }

    /// A tensor exactly as stored: safetensors dtype, shape and little-endian bytes (for
    /// copying it unchanged into another file).
    pub fn raw(&self, name: &str) -> Result<(safetensors::Dtype, &[usize], &[u8])> {
        let e = self.entry(name)?;
        Ok((e.raw_dtype, &e.shape, &self.shards[e.shard].map[e.start..e.end]))
    }

    /// Reads a floating-point tensor (f32, f16 or bf16) as `f32`.
    pub fn read_f32(&self, name: &str) -> Result<HostTensor> {
        let e = self.entry(name)?;
        let shard = &self.shards[e.shard];
        let bytes = &shard.map[e.start..e.end];
        // Decode little-endian element by element: the mapping has no alignment guarantee.
        let data: Vec<f32> = match e.dtype {
            DType::F32 => {
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            DType::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => {
                bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
            other => {
                return Err(HfError::DType {
                    name: name.to_string(),
                    path: shard.path.clone(),
                    dtype: other.to_string(),
                    expected: "F32, F16 or BF16",
                });
            }
        };
        Ok(HostTensor { shape: e.shape.clone(), data })
    }

    /// Reads an `I64` tensor (token ids, expert indices in reference files).
    pub fn read_i64(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>)> {
        let e = self.entry(name)?;
        let shard = &self.shards[e.shard];
        if e.dtype != DType::I64 {
            return Err(HfError::DType {
                name: name.to_string(),
                path: shard.path.clone(),
                dtype: e.dtype.to_string(),
                expected: "I64",
            });
        }
        let data = shard.map[e.start..e.end]
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
            .collect();
        Ok((e.shape.clone(), data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(path: &Path, tensors: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)>) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn reads_every_float_dtype_as_f32() {
        let dir = tempfile::tempdir().unwrap();
        let vals = [1.5f32, -2.25, 0.0, 3.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect();
        let bf16b: Vec<u8> = vals.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect();
        let ids: Vec<u8> = [7i64, -1].iter().flat_map(|x| x.to_le_bytes()).collect();
        use safetensors::Dtype as D;
        write(
            &dir.path().join("model.safetensors"),
            vec![
                ("a", D::F32, vec![2, 2], f32b),
                ("b", D::F16, vec![4], f16b),
                ("c", D::BF16, vec![1, 4], bf16b),
                ("ids", D::I64, vec![2], ids),
            ],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        for name in ["a", "b", "c"] {
            assert_eq!(ck.read_f32(name).unwrap().data, vals, "{name}");
        }
        assert_eq!(ck.read_i64("ids").unwrap().1, vec![7, -1]);
        let (dtype, shape, bytes) = ck.raw("b").unwrap();
        assert_eq!((dtype, shape, bytes.len()), (D::F16, &[4usize][..], 8));
        assert_eq!(bytes[..2], f16::from_f32(1.5).to_le_bytes());
        let e = ck.read_f32("ids").unwrap_err().to_string();
        assert!(e.contains("`ids`") && e.contains("I64"), "{e}");
        let e = ck.read_f32("nope").unwrap_err().to_string();
        assert!(e.contains("`nope`") && e.contains("missing"), "{e}");
    }

    #[test]
    fn sharded_index_and_its_errors() {
        let dir = tempfile::tempdir().unwrap();
        let one: Vec<u8> = 1f32.to_le_bytes().to_vec();
        use safetensors::Dtype as D;
        write(&dir.path().join("s1.safetensors"), vec![("x", D::F32, vec![1], one.clone())]);
        write(&dir.path().join("s2.safetensors"), vec![("y", D::F32, vec![1], one)]);
        let index = r#"{"metadata":{},"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}}"#;
        std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.names().collect::<Vec<_>>(), vec!["x", "y"]);

        std::fs::write(dir.path().join("s2.safetensors"), b"garbage").unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("s2.safetensors") && e.contains("not a valid safetensors"), "{e}");

        std::fs::remove_file(dir.path().join("s2.safetensors")).unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("names shard s2.safetensors"), "{e}");

        std::fs::write(dir.path().join("model.safetensors.index.json"), "{").unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("model.safetensors.index.json") && e.contains("JSON"), "{e}");
    }

    #[test]
    fn unsupported_dtype_names_tensor_file_and_dtype() {
        let dir = tempfile::tempdir().unwrap();
        use safetensors::Dtype as D;
        let path = dir.path().join("model.safetensors");
        write(
            &path,
            vec![("model.layers.0.w", D::I16, vec![2], vec![1, 0, 2, 0]), ("u", D::U64, vec![1], vec![0; 8])],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.info("model.layers.0.w").unwrap().0, DType::Other("I16"));
        let e = ck.read_f32("model.layers.0.w").unwrap_err().to_string();
        assert!(e.contains("`model.layers.0.w`") && e.contains(path.to_str().unwrap()), "{e}");
        assert!(e.contains("dtype I16") && !e.contains("unsupported"), "{e}");
        let e = ck.read_i64("u").unwrap_err().to_string();
        assert!(e.contains("`u`") && e.contains("dtype U64, expected I64"), "{e}");
    }

    #[test]
    fn offsets_that_overflow_are_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), crate::fuzz::offsets_near_usize_max()).unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("past the 0 data bytes"), "{e}");
    }

    #[test]
    fn index_shards_stay_inside_the_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("model");
        std::fs::create_dir(&dir).unwrap();
        use safetensors::Dtype as D;
        write(&tmp.path().join("outside.safetensors"), vec![("x", D::F32, vec![1], vec![0; 4])]);
        for shard in ["../outside.safetensors", "/etc/hostname", ""] {
            let index = format!(r#"{{"weight_map":{{"x":"{shard}"}}}}"#);
            std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
            let e = Checkpoint::open(&dir).unwrap_err().to_string();
            assert!(e.contains("weight_map.x") && e.contains("not a file name inside"), "{shard}: {e}");
        }
    }

    #[test]
    fn a_tensor_in_two_shards_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        use safetensors::Dtype as D;
        write(&dir.path().join("a.safetensors"), vec![("x", D::F32, vec![1], vec![0; 4])]);
        write(&dir.path().join("b.safetensors"), vec![("x", D::F32, vec![1], vec![0; 4])]);
        let files = [dir.path().join("a.safetensors"), dir.path().join("b.safetensors")];
        let e = Checkpoint::from_files(dir.path().into(), &files).unwrap_err().to_string();
        assert!(
            e.contains("b.safetensors") && e.contains("`x` is also in") && e.contains("a.safetensors"),
            "{e}"
        );
    }
}
