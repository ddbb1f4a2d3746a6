use std::path::PathBuf;

/// Errors of the planner. Each names the page, layer or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A page of the snapshot is inconsistent (bit range, table lengths, values).
    #[error("page {page}: {reason}")]
    Page {
        /// The page, as `layer L expert E kind`.
        page: String,
        /// What is wrong.
        reason: String,
    },
    /// Routing statistics or residual factors do not cover the snapshot.
    #[error("{what}: {reason}")]
    Shape {
        /// The input at fault (e.g. `routing counts`).
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// A configuration value is out of its domain.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a residual-head file failed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
}
