//! The three families against transformers' reference outputs, KV-cached generation, and the
//! perplexity convention.
//!
//! One test binary for the crate: each binary links Burn anew.

mod eval;
mod models;
mod stream;
