//! What the `pagedweight` binary shares with the examples: the default model location, the
//! `serve` command (`pagedweight serve` and `cargo run --example mixtral_serve` take the same
//! options) and the plots.

pub mod plot_cmd;
pub mod serve_cmd;

/// Directory of the shipped model; commands taking `--model` default to it (relative to the
/// repository root, where `cargo run` runs).
pub const DEFAULT_MODEL: &str = "assets/tiny-mixtral";
