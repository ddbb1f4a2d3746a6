//! The serving crate's tests: detokenization, the scheduler, the engine over the fast decode
//! path, and the HTTP server.
//!
//! One test binary for the crate: each binary links Burn and CubeCL anew.

mod common;
mod detok;
mod engine;
mod fast;
mod reference;
mod server;
