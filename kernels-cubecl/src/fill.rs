//! Device-side fills: random weights of synthetic models and random plane words for
//! benchmarks, and zeroed counters, generated on the device instead of uploaded.

use cubecl::prelude::*;

use crate::device::bad;
use crate::{DeviceArray, KernelError};

/// `out[i] = (2·u(i) − 1) · scale` with `u(i)` a hash of `(i, seed)` in `[0, 1)`, in `F`;
/// `params = [scale]`. Grid-stride over `out`.
#[cube(launch_unchecked)]
pub fn fill_uniform_kernel<F: Float>(out: &mut Array<F>, params: &Array<f32>, seed: &Array<u32>) {
    let total = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let mut x = (i as u32) * 0x9E37_79B9u32 ^ seed[0] * 0x85EB_CA6Bu32;
        x ^= x >> 16u32;
        x *= 0x7FEB_352Du32;
        x ^= x >> 15u32;
        x *= 0x846C_A68Bu32;
        x ^= x >> 16u32;
        let u = f32::cast_from(x >> 8u32) / 16_777_216.0;
        out[i] = F::cast_from((u * 2.0 - 1.0) * params[0]);
        i += total;
    }
}

/// Fills `out` (`len` elements of `F`) with [`fill_uniform_kernel`]'s values in
/// `[-scale, scale)`. Does not synchronise.
pub fn fill_uniform<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    out: &DeviceArray,
    seed: u32,
    scale: f32,
) -> Result<(), KernelError> {
    if out.len >= u32::MAX as usize {
        return Err(bad(format!("fill_uniform: {} elements, at most 2^32 - 1", out.len)));
    }
    if out.len == 0 {
        return Ok(());
    }
    let params = DeviceArray::from_slice(client, &[scale]);
    let seed = DeviceArray::from_slice(client, &[seed]);
    let cubes = out.len.div_ceil(256).min(4096);
    // SAFETY: the kernel writes only indices below `out.len`.
    unsafe {
        fill_uniform_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(256),
            out.arg(),
            params.arg(),
            seed.arg(),
        )
    };
    Ok(())
}

/// CPU reference of [`fill_uniform`] (before rounding to `F`).
pub fn fill_uniform_reference(len: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| {
            let mut x = i.wrapping_mul(0x9E37_79B9) ^ seed.wrapping_mul(0x85EB_CA6B);
            x ^= x >> 16;
            x = x.wrapping_mul(0x7FEB_352D);
            x ^= x >> 15;
            x = x.wrapping_mul(0x846C_A68B);
            x ^= x >> 16;
            let u = (x >> 8) as f32 / 16_777_216.0;
            (u * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `out[i] = 0`. Grid-stride over `out`.
#[cube(launch_unchecked)]
pub fn fill_zero_kernel<T: Numeric>(out: &mut Array<T>) {
    let total = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        out[i] = T::from_int(0);
        i += total;
    }
}

/// Zeroes `out` (elements of `T`) on the device, without an upload. Does not synchronise.
pub fn fill_zero<R: Runtime, T: Numeric + CubeElement>(client: &ComputeClient<R>, out: &DeviceArray) {
    if out.len == 0 {
        return;
    }
    let cubes = out.len.div_ceil(256).min(1024);
    // SAFETY: the kernel writes only indices below `out.len`.
    unsafe {
        fill_zero_kernel::launch_unchecked::<T, R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(256),
            out.arg(),
        )
    };
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

/// Fills `out` (u32 words) with a hash of each index and `seed`, on the device. Does not
/// synchronise.
pub fn fill_hash<R: Runtime>(client: &ComputeClient<R>, out: &DeviceArray, seed: u32) {
    let seed = DeviceArray::from_slice(client, &[seed]);
    // SAFETY: the kernel writes only indices below `out.len`.
    unsafe {
        fill_hash_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(1024, 1, 1),
            CubeDim::new_1d(256),
            out.arg(),
            seed.arg(),
        )
    };
}

/// CPU reference of [`fill_hash`].
pub fn fill_hash_reference(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            let mut z = i ^ seed;
            z = (z ^ (z >> 16)).wrapping_mul(0x7feb_352d);
            z = (z ^ (z >> 15)).wrapping_mul(0x846c_a68b);
            z ^ (z >> 16)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubecl::wgpu::WgpuRuntime;

    use crate::testing::{assert_close, client};
    use crate::*;

    #[test]
    fn fill_zero_zeroes_every_element() {
        let client = client();
        for n in [1usize, 255, 257, 300_001] {
            let u = DeviceArray::from_slice(&client, &fill_hash_reference(n, 3));
            fill_zero::<WgpuRuntime, u32>(&client, &u);
            assert!(read_u32(&client, &u).unwrap().iter().all(|&w| w == 0), "u32, {n}");
            let f = DeviceArray::from_slice(&client, &fill_uniform_reference(n, 4, 2.0));
            fill_zero::<WgpuRuntime, f32>(&client, &f);
            assert!(read_f32(&client, &f).unwrap().iter().all(|&x| x == 0.0), "f32, {n}");
        }
    }

    #[test]
    fn fill_hash_matches_reference() {
        let client = client();
        let out = DeviceArray::empty::<WgpuRuntime, u32>(&client, 300_001);
        fill_hash(&client, &out, 42);
        assert_eq!(read_u32(&client, &out).unwrap(), fill_hash_reference(300_001, 42));
    }

    #[test]
    fn fill_uniform_matches_reference() {
        let client = client();
        let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, 1_100_003);
        fill_uniform::<WgpuRuntime, f32>(&client, &out, 9, 0.25).unwrap();
        let want = fill_uniform_reference(1_100_003, 9, 0.25);
        assert_close(&read_f32(&client, &out).unwrap(), &want, 0.0, "fill_uniform");
        assert!(
            want.iter().all(|v| v.abs() <= 0.25)
                && want.iter().any(|v| *v > 0.2)
                && want.iter().any(|v| *v < -0.2)
        );
    }
}
