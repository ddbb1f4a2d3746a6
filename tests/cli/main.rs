//! The binary's tests: each subcommand run as a user runs it (quantize-tensor, inspect,
//! quantize, logits, generate, eval-ppl, serve, plot), the dashboard in a browser, and the Burn
//! backends agreeing.
//!
//! One test binary for the package: each binary links Burn and CubeCL anew.

mod backend_parity;
mod dashboard_cli;
mod models_cli;
mod quantize_cli;
mod serve_cli;
mod tensor_cli;
