use std::path::PathBuf;

/// Everything that can go wrong reading a checkpoint directory.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A JSON file is malformed.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// A safetensors file is malformed.
    #[error("{path} is not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// The directory has no weights at all.
    #[error("{dir} holds neither model.safetensors nor model.safetensors.index.json")]
    NoWeights {
        /// The model directory.
        dir: PathBuf,
    },
    /// A shard named by the index is missing.
    #[error("{index} names shard {shard}, which cannot be opened: {source}")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard file name.
        shard: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The model directory.
        dir: PathBuf,
    },
    /// A tensor has a dtype we cannot convert.
    #[error("tensor `{name}` in {path} has dtype {dtype}, expected {expected}")]
    DType {
        /// The tensor name.
        name: String,
        /// Its file.
        path: PathBuf,
        /// Its dtype.
        dtype: String,
        /// What would have been accepted.
        expected: &'static str,
    },
    /// A configuration field is missing or has a bad value.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The field (dotted path for nested fields).
        field: String,
        /// What is wrong.
        message: String,
    },
}
