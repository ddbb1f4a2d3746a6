use std::path::PathBuf;

/// Why serving failed or a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A model-directory file (tokenizer, template, configs) is unreadable or malformed.
    #[error("{}: {message}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template failed to parse or render.
    #[error("chat template ({}): {message}", origin.display())]
    Template {
        /// Where the template came from.
        origin: PathBuf,
        /// The minijinja error.
        message: String,
    },
    /// Tokenizing or detokenizing failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The model could not be loaded.
    #[error("model: {0}")]
    Model(String),
    /// The request is invalid (bad sampling values, too long, does not fit the KV budget).
    #[error("{message}")]
    InvalidRequest {
        /// The offending request field, if one.
        param: Option<&'static str>,
        /// What is wrong.
        message: String,
    },
    /// Too many requests are waiting; the client should retry later.
    #[error("{0}")]
    Overloaded(String),
    /// The engine thread has stopped.
    #[error("the engine has stopped")]
    EngineStopped,
    /// The model failed during a step.
    #[error("model step failed: {0}")]
    Step(String),
}

impl ServeError {
    /// An [`ServeError::InvalidRequest`] about `param`.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidRequest { param: Some(param), message: message.into() }
    }
}
