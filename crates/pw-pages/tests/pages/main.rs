//! The page table's tests: the commit protocol on host arenas, the device pool under the
//! grouped kernel, and (feature `cuda`) the asynchronous CUDA mover.
//!
//! One test binary for the crate: each binary links CubeCL anew.

mod common;
mod cuda;
mod device;
mod protocol;
