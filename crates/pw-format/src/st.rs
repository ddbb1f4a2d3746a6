//! Memory-mapped safetensors files with errors that name the file and tensor.

use crate::FormatError;
use half::{bf16, f16};
use safetensors::tensor::{Metadata, TensorView};
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// A safetensors file mapped into memory, its header parsed and validated
/// (a truncated or padded file is rejected on open).
pub struct StFile {
    path: PathBuf,
    map: memmap2::Mmap,
    header: usize,
    meta: Metadata,
}

impl std::fmt::Debug for StFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StFile").field("path", &self.path).finish_non_exhaustive()
    }
}

impl StFile {
    /// Maps and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, FormatError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| FormatError::io(&path, e))?;
        // SAFETY: the mapping is read-only; files are not modified while loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::io(&path, e))?;
        let (header, meta) =
            read_header(&map).map_err(|reason| FormatError::Safetensors { path: path.clone(), reason })?;
        Ok(Self { path, map, header, meta })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.meta.tensors().into_keys().collect();
        v.sort();
        v
    }

    /// The string metadata of the file (`__metadata__`).
    pub fn metadata(&self) -> Option<&std::collections::HashMap<String, String>> {
        self.meta.metadata().as_ref()
    }

    /// True when the file holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.meta.info(name).is_some()
    }

    /// A view of tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let info = self.meta.info(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        let start = 8 + self.header + info.data_offsets.0;
        let end = 8 + self.header + info.data_offsets.1;
        TensorView::new(info.dtype, info.shape.clone(), &self.map[start..end])
            .map_err(|e| FormatError::Safetensors { path: self.path.clone(), reason: e.to_string() })
    }

    /// Tensor `name`, checked to have `dtype` and `shape`.
    pub fn expect(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<TensorView<'_>, FormatError> {
        let t = self.tensor(name)?;
        if t.dtype() != dtype {
            return Err(FormatError::Dtype {
                path: self.path.clone(),
                tensor: name.into(),
                expected: format!("{dtype}"),
                found: format!("{}", t.dtype()),
            });
        }
        if t.shape() != shape {
            return Err(FormatError::Shape {
                path: self.path.clone(),
                tensor: name.into(),
                expected: shape.to_vec(),
                found: t.shape().to_vec(),
            });
        }
        Ok(t)
    }

    /// Tensor `name` converted to f32 (from f32, f16 or bf16), with its shape.
    pub fn to_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), FormatError> {
        let t = self.tensor(name)?;
        let data = view_to_f32(&t).ok_or_else(|| FormatError::Dtype {
            path: self.path.clone(),
            tensor: name.into(),
            expected: "F32, F16 or BF16".into(),
            found: format!("{}", t.dtype()),
        })?;
        Ok((data, t.shape().to_vec()))
    }
}

/// Parses and validates the header of a whole safetensors file: its length and metadata.
///
/// Refuses first any tensor that ends past the end of the file: safetensors 0.6 sums the
/// offsets with the header length, and offsets near `usize::MAX` overflow that sum (a panic
/// where overflow checks are on). Headers this cannot parse are left to safetensors to report.
pub(crate) fn read_header(bytes: &[u8]) -> Result<(usize, Metadata), String> {
    let header = bytes.get(..8).and_then(|n| {
        let n = usize::try_from(u64::from_le_bytes(n.try_into().ok()?)).ok()?;
        bytes.get(8..8usize.checked_add(n)?)
    });
    if let Some(header) = header
        && let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header)
    {
        let data = (bytes.len() - 8 - header.len()) as u64;
        for (name, info) in &map {
            let end = info.get("data_offsets").and_then(|o| o.get(1)).and_then(serde_json::Value::as_u64);
            if let Some(end) = end.filter(|&e| e > data) {
                return Err(format!(
                    "tensor `{name}` ends at data offset {end}, past the {data} data bytes of the file"
                ));
            }
        }
    }
    SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())
}

/// Owned tensors by name: dtype, shape, little-endian bytes.
pub type TensorMap = std::collections::BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// Writes `tensors` (and optional string metadata) as one safetensors file.
pub fn write_tensors(
    path: &Path,
    tensors: &TensorMap,
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<(), FormatError> {
    let err = |e: safetensors::SafeTensorError| FormatError::Safetensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let views = tensors
        .iter()
        .map(|(k, (d, s, b))| Ok((k.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(err)?;
    safetensors::serialize_to_file(views, metadata, path).map_err(err)
}

/// Converts a float tensor view to f32; `None` for non-float dtypes.
pub fn view_to_f32(t: &TensorView<'_>) -> Option<Vec<f32>> {
    let b = t.data();
    Some(match t.dtype() {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        Dtype::BF16 => {
            b.chunks_exact(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect()
        }
        _ => return None,
    })
}
