//! Helpers shared by the test binaries.
#![allow(dead_code)]

pub use pw_testkit::fixture;

/// Deterministic pseudo-random token ids below `vocab`.
pub fn calib_ids(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}
