//! A streaming read kernel: the bandwidth bound every other kernel is compared against,
//! measured in the same run.

use cubecl::prelude::*;

use crate::DeviceArray;

/// Each unit XORs `unroll` independent u32 loads per step over a grid-stride
/// loop and writes one word: pure read traffic (scalar loads with unroll 16 match 16-byte vector
/// loads on the H200).
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

/// Launches the streaming read over `data` (u32 words);
/// `out` gets one word per unit, `cubes · 256` in all. Does not synchronise.
pub fn stream_read<R: Runtime>(client: &ComputeClient<R>, data: &DeviceArray, out: &DeviceArray, cubes: u32) {
    assert!(out.len >= cubes as usize * 256, "stream_read: `out` needs one word per unit");
    // SAFETY: the kernel reads `data.len` words and writes `cubes · 256` words, checked above.
    unsafe {
        stream_read_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(256),
            data.arg(),
            out.arg(),
            16,
        )
    };
}

/// CPU reference of [`stream_read`]: the XOR of all words, which equals the
/// XOR of the kernel's outputs.
pub fn stream_read_reference(data: &[u32]) -> u32 {
    data.iter().fold(0, |a, b| a ^ b)
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubecl::wgpu::WgpuRuntime;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use crate::testing::client;
    use crate::*;

    #[test]
    fn stream_read_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(6);
        for words in [4usize, 4 * 1000, 4 * 70_001] {
            let data: Vec<u32> = (0..words).map(|_| rng.random()).collect();
            let d = DeviceArray::from_slice(&client, &data);
            let cubes = 3;
            let out = DeviceArray::empty::<WgpuRuntime, u32>(&client, cubes * 256);
            stream_read(&client, &d, &out, cubes as u32);
            let got = read_u32(&client, &out).unwrap().iter().fold(0, |a, b| a ^ b);
            assert_eq!(got, stream_read_reference(&data), "{words} words");
        }
    }
}
