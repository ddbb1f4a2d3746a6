//! The prefill / large-batch path: expand a block's committed planes + LUT into a dense f16
//! weight, which the caller multiplies with Burn's own matmul (the matrix units). For many
//! tokens the matmul's cost dominates and the expansion is one streaming pass (reads
//! `b/8 + LUT` bytes per weight, writes 2), so this is faster than any skinny kernel.

use cubecl::prelude::*;
use half::f16;

use crate::pool::{PoolImage, PoolSlot};
use crate::{DeviceArray, KernelError};

/// Eight units per (row, plane word): unit `l` rebuilds the indices of columns `l, l+8, l+16,
/// l+24` in one shift/mask step per plane (`(w >> l) & 0x01010101`), so neighbouring units
/// write neighbouring columns (the stores coalesce, where one unit per word writing its 32
/// columns does not).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn ap_dequantize_kernel(
    planes: &Array<u32>,
    luts: &Array<f16>,
    out: &mut Array<f16>,
    plane_off: usize,
    lut_off: usize,
    n: usize,
    k: usize,
    #[comptime] bits: usize,
) {
    let words = k.div_ceil(32usize);
    let pos = ABSOLUTE_POS;
    if pos >= n * words * 8usize {
        terminate!();
    }
    let word = pos / 8usize;
    let l = (pos % 8usize) as u32;
    let row = word / words;
    let wi = word % words;
    let mut idx4 = 0u32;
    #[unroll]
    for p in 0..bits {
        idx4 = (idx4 << 1u32) | ((planes[plane_off + (p * n + row) * words + wi] >> l) & 0x0101_0101u32);
    }
    let lut_row = lut_off + row * (1usize << bits);
    let col0 = wi * 32usize + l as usize;
    #[unroll]
    for kk in 0..4usize {
        let col = col0 + 8usize * kk;
        if col < k {
            let idx = ((idx4 >> (8 * kk) as u32) & 0xFFu32) as usize;
            out[row * k + col] = luts[lut_row + idx];
        }
    }
}

/// Writes the dense `[rows, cols]` f16 weight of `slot` (its committed bits) into `out`.
/// Does not synchronise.
///
/// # Shapes
/// - `out`: at least `[slot.rows, slot.cols]` f16
pub fn ap_dequantize<R: Runtime>(
    client: &ComputeClient<R>,
    planes: &DeviceArray,
    luts: &DeviceArray,
    slot: PoolSlot,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let (n, k, b) = (slot.rows as usize, slot.cols as usize, slot.bits as usize);
    let bad = |reason: String| Err(KernelError::BadItem { item: 0, reason });
    if !(3..=8).contains(&b) {
        return bad(format!("bits {b} outside 3..=8"));
    }
    let words = k.div_ceil(32);
    if slot.plane_off as usize + b * n * words > planes.len {
        return bad("planes past the end of the plane pool".into());
    }
    if slot.lut_off as usize + n * (1 << b) > luts.len {
        return bad("LUT past the end of the LUT pool".into());
    }
    if out.len < n * k {
        return bad(format!("dense output holds {} elements, needs {}", out.len, n * k));
    }
    let units = n * words * 8;
    if units == 0 {
        return Ok(());
    }
    let cubes = units.div_ceil(256) as u32;
    // SAFETY: offsets and lengths checked above; the kernel guards `pos < 8 · n · words`.
    unsafe {
        ap_dequantize_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(256),
            planes.arg(),
            luts.arg(),
            out.arg(),
            slot.plane_off as usize,
            slot.lut_off as usize,
            n,
            k,
            b,
        )
    };
    Ok(())
}

/// CPU reference of [`ap_dequantize`]: the f16 values of the block at its committed bits,
/// read back from a pool image.
pub fn ap_dequantize_reference(pool: &PoolImage, slot: PoolSlot) -> Vec<f16> {
    let (n, k, b) = (slot.rows as usize, slot.cols as usize, slot.bits as usize);
    let words = k.div_ceil(32);
    let mut out = vec![f16::ZERO; n * k];
    for r in 0..n {
        let lut = &pool.luts[slot.lut_off as usize + r * (1 << b)..][..1 << b];
        for c in 0..k {
            let mut idx = 0usize;
            for p in 0..b {
                let w = pool.planes[slot.plane_off as usize + (p * n + r) * words + c / 32];
                idx = (idx << 1) | ((w >> (c % 32)) & 1) as usize;
            }
            out[r * k + c] = lut[idx];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubecl::wgpu::WgpuRuntime;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::testing::{client, random_block};
    use crate::*;

    /// The prefill expansion is a copy of LUT values: exact, and equal to pw-format's own
    /// dequantization of the block.
    #[test]
    fn dequantize_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(7);
        for (rows, cols) in [(5usize, 100usize), (33, 64), (3, 1000)] {
            let block = random_block(&mut rng, rows, cols);
            for bits in 3..=8u8 {
                let mut pool = PoolImage::default();
                // A leading block so the offsets are not zero.
                pool.push(&random_block(&mut rng, 2, 40), 5);
                let slot = pool.push(&block, bits);
                let planes = DeviceArray::from_slice(&client, &pool.planes);
                let luts = DeviceArray::from_slice(&client, &pool.luts);
                let out = DeviceArray::empty::<WgpuRuntime, half::f16>(&client, rows * cols);
                ap_dequantize(&client, &planes, &luts, slot, &out).unwrap();
                let got = half::f16::from_bytes(&client.read_one(out.handle.clone()).unwrap()).to_vec();
                let want = ap_dequantize_reference(&pool, slot);
                assert_eq!(got[..rows * cols], want[..], "{rows}x{cols} b{bits}");
                let fmt: Vec<half::f16> =
                    block.dequantize_reference(bits).iter().map(|&v| half::f16::from_f32(v)).collect();
                assert_eq!(want, fmt, "{rows}x{cols} b{bits}: reference disagrees with pw-format");
            }
        }
        let mut pool = PoolImage::default();
        let slot = pool.push(&random_block(&mut rng, 4, 64), 4);
        let planes = DeviceArray::from_slice(&client, &pool.planes);
        let luts = DeviceArray::from_slice(&client, &pool.luts);
        let small = DeviceArray::empty::<WgpuRuntime, half::f16>(&client, 10);
        assert!(ap_dequantize(&client, &planes, &luts, slot, &small).is_err(), "short output accepted");
    }
}
