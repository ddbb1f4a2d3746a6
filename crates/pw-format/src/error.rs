use std::path::PathBuf;

/// Errors of the format crate. Every variant names the file and, where there
/// is one, the tensor or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// An I/O error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: not a valid safetensors file ({reason}); is it truncated or corrupt?")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// The manifest is not valid JSON for this format.
    #[error("{path}: invalid manifest: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The manifest's magic string is wrong.
    #[error("{path}: field `magic` is {found:?}, expected {expected:?}: not a PagedWeight checkpoint")]
    Magic {
        /// The manifest file.
        path: PathBuf,
        /// The magic found.
        found: String,
        /// The expected magic.
        expected: &'static str,
    },
    /// The manifest version is not supported by this reader.
    #[error("{path}: field `version` is {found}, this build reads version {supported}")]
    Version {
        /// The manifest file.
        path: PathBuf,
        /// The version found.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// A tensor is missing from a file.
    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor {
        /// The file searched.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor has the wrong shape.
    #[error("{path}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Shape found.
        found: Vec<usize>,
    },
    /// A tensor has the wrong element type.
    #[error("{path}: tensor `{tensor}` has dtype {found}, expected {expected}")]
    Dtype {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Expected dtype(s).
        expected: String,
        /// Dtype found.
        found: String,
    },
    /// A manifest entry is invalid: a field out of range, a duplicate, shapes that disagree, or a
    /// file outside the checkpoint directory. Names the manifest, the entry and the field.
    #[error("{path}: {entry}: field `{field}`: {reason}")]
    ManifestEntry {
        /// The manifest file.
        path: PathBuf,
        /// The entry, e.g. ``block `layers.0.experts.1.down` (blocks[3])``.
        entry: String,
        /// The field at fault.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A value in a block is inconsistent (bit range, sizes).
    #[error("block `{block}`: {reason}")]
    Block {
        /// The block name.
        block: String,
        /// What is wrong.
        reason: String,
    },
    /// A requested block does not exist in the checkpoint.
    #[error("{path}: the manifest has no block `{block}`")]
    UnknownBlock {
        /// The manifest file.
        path: PathBuf,
        /// The block name.
        block: String,
    },
    /// Quantization failed.
    #[error("tensor `{tensor}`: {source}")]
    Quant {
        /// The tensor being quantized.
        tensor: String,
        /// The quantizer's error.
        source: pw_quant::QuantError,
    },
}

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}
