//! A streaming read kernel: the bandwidth bound every other kernel is
//! compared against, measured in the same run.

use cubecl::prelude::*;

/// Each unit XORs `unroll` independent u32 loads per step over a grid-stride
/// loop and writes one word: pure read traffic. (Scalar loads with unroll 16
/// matched 16-byte vector loads on the H200: 4.34 TB/s.)
#[cube(launch_unchecked)]
pub fn stream_read_kernel(data: &Array<u32>, out: &mut Array<u32>, #[comptime] unroll: usize) {
    let total = CUBE_COUNT * CUBE_DIM as usize;
    let n = data.len();
    let mut acc = 0u32;
    let mut i = ABSOLUTE_POS;
    while i + (unroll - 1) * total < n {
        #[unroll]
        for u in 0..unroll {
            acc ^= data[i + u * total];
        }
        i += unroll * total;
    }
    while i < n {
        acc ^= data[i];
        i += total;
    }
    out[ABSOLUTE_POS] = acc;
}

/// Fills `out` with a hash of each index and `seed` (random-looking plane words for
/// benchmarks, generated on the device instead of uploaded).
#[cube(launch_unchecked)]
pub fn fill_hash_kernel(out: &mut Array<u32>, seed: &Array<u32>) {
    let total = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let mut z = (i as u32) ^ seed[0];
        z = (z ^ (z >> 16u32)) * 0x7feb_352du32;
        z = (z ^ (z >> 15u32)) * 0x846c_a68bu32;
        out[i] = z ^ (z >> 16u32);
        i += total;
    }
}
