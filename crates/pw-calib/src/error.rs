use std::path::PathBuf;

use pw_format::FormatError;
use pw_hf::HfError;
use pw_models::ModelError;

/// Why calibration or quantization failed. Every variant names the file, tensor or setting.
#[derive(Debug, thiserror::Error)]
pub enum CalibError {
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The source checkpoint could not be read.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// The output checkpoint could not be written.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The model has no routed experts, so there is nothing to quantize.
    #[error("{dir}: the model in config.json has no MoE expert layers, nothing to quantize")]
    NoExperts {
        /// The model directory.
        dir: PathBuf,
    },
    /// The source is already a quantized checkpoint.
    #[error("{dir} is already a quantized PagedWeight checkpoint; quantize its Hugging Face original")]
    AlreadyQuantized {
        /// The model directory.
        dir: PathBuf,
    },
    /// Input and output directories are the same.
    #[error("the output directory {dir} is the model directory")]
    SameDir {
        /// The directory.
        dir: PathBuf,
    },
    /// The calibration text is too short to predict anything.
    #[error("the calibration text has {tokens} tokens; at least 2 are needed")]
    TooFewTokens {
        /// Tokens available.
        tokens: usize,
    },
    /// A setting is out of range.
    #[error("{setting} = {value}: {reason}")]
    Setting {
        /// The setting.
        setting: &'static str,
        /// Its value.
        value: String,
        /// What is allowed.
        reason: String,
    },
    /// A calibration token is not in the model's vocabulary.
    #[error("calibration token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The loss of a calibration window is not finite.
    #[error("the loss of calibration window {window} is {loss}: the model or its weights are broken")]
    NonFiniteLoss {
        /// Window index.
        window: usize,
        /// The loss.
        loss: f64,
    },
    /// A side file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}
