//! From logits to tokens on the device: Gemma's logit soft-capping and greedy sampling.

use cubecl::prelude::*;

use crate::device::{bad, need, row_units};
use crate::plane::warp_arg_max;
use crate::{DeviceArray, KernelError};

/// `x = tanh(x / c) · c`, `params = [c]`, over the first `meta[0]` rows of `width`.
/// Grid `(ceil(rows · width / 256))`.
#[cube(launch_unchecked)]
pub fn softcap_kernel(x: &mut Array<f32>, params: &Array<f32>, meta: &Array<u32>, #[comptime] width: usize) {
    let i = ABSOLUTE_POS;
    if i < meta[0] as usize * width {
        let c = params[0];
        x[i] = (x[i] / c).tanh() * c;
    }
}

/// Host side of [`softcap_kernel`] over `tokens` rows of `width` (`meta[0]` = tokens);
/// `params = [c]`.
pub fn softcap<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    width: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    params: &DeviceArray,
) -> Result<(), KernelError> {
    let n = tokens * width;
    need("softcap x", x, n)?;
    need("softcap meta", meta, 1)?;
    need("softcap params", params, 1)?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above; the kernel bounds-checks `i < n`.
    unsafe {
        softcap_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            x.arg(),
            params.arg(),
            meta.arg(),
            width,
        )
    };
    Ok(())
}

/// CPU reference of [`softcap`].
pub fn softcap_reference(x: &[f32], c: f32) -> Vec<f32> {
    x.iter().map(|v| (v / c).tanh() * c).collect()
}

/// Greedy sampling: `ids[t] = argmax(x[t])` (lowest index on ties). Grid `(tokens)`; cube:
/// `units` units, each visiting its columns in increasing order, 8 loads in flight per round
/// (a one-plane loop over a vocabulary-wide row is latency-bound).
#[cube(launch_unchecked)]
pub fn argmax_kernel(
    x: &Array<f32>,
    ids: &mut Array<u32>,
    #[comptime] width: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let t = CUBE_POS_X as usize;
    let u = UNIT_POS as usize;
    let base = t * width;
    let mut bv = f32::new(-3.0e38);
    let mut bi = 0u32;
    let mut vals = Array::<f32>::new(8usize);
    for c0 in range_stepped(0usize, width, comptime![8 * units]) {
        #[unroll]
        for i in 0..8usize {
            // Clamped loads (always in bounds), masked below.
            vals[i] = x[base + min(c0 + i * units + u, comptime![width - 1])];
        }
        #[unroll]
        for i in 0..8usize {
            let c = c0 + i * units + u;
            if c < width && vals[i] > bv {
                bv = vals[i];
                bi = c as u32;
            }
        }
    }
    let (m, best) = warp_arg_max(bv, bi, plane_size);
    if comptime![units > plane_size] {
        let planes = comptime![units / plane_size];
        let mut shv = SharedMemory::<f32>::new(planes);
        let mut shi = SharedMemory::<u32>::new(planes);
        let lane = u % plane_size;
        if lane == 0 {
            shv[u / plane_size] = m;
            shi[u / plane_size] = best;
        }
        sync_cube();
        if u == 0 {
            let mut vb = shv[0];
            let mut ib = shi[0];
            for p in 1..planes {
                let v = shv[p];
                let i = shi[p];
                if v > vb || (v == vb && i < ib) {
                    vb = v;
                    ib = i;
                }
            }
            ids[t] = ib;
        }
    } else {
        if u == 0 {
            ids[t] = best;
        }
    }
}

/// Host side of [`argmax_kernel`].
///
/// # Shapes
/// - `x`: `[tokens, width]`; `ids`: `[tokens]`
pub fn argmax<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    width: usize,
    x: &DeviceArray,
    ids: &DeviceArray,
) -> Result<(), KernelError> {
    need("argmax x", x, tokens * width)?;
    need("argmax ids", ids, tokens)?;
    if tokens == 0 {
        return Ok(());
    }
    if width == 0 {
        return Err(bad("argmax: rows of width 0".into()));
    }
    let (units, plane) = row_units(client, width, 32);
    // SAFETY: sizes checked above.
    unsafe {
        argmax_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            x.arg(),
            ids.arg(),
            width,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`argmax`] (lowest index on ties).
pub fn argmax_reference(x: &[f32], width: usize) -> Vec<u32> {
    x.chunks(width)
        .map(|r| {
            r.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
                as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubecl::wgpu::WgpuRuntime;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::testing::{assert_close, client, rand_vec};
    use crate::*;

    /// f32 arithmetic in another order than the CPU (plane sums), plus GPU exp/tanh.
    const FAMILY_TOL: f32 = 2e-5;

    #[test]
    fn softcap_and_argmax_match_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(13);
        let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
        let (tokens, hidden) = (4, 72);
        let x = rand_vec(&mut rng, tokens * hidden, 2.0);
        // Soft-cap over the first 3 of 4 rows only (`meta[0]` = 3).
        let xd = up(&x);
        softcap(&client, 3, hidden, &DeviceArray::from_slice(&client, &[3u32]), &xd, &up(&[1.5])).unwrap();
        let mut want = softcap_reference(&x[..3 * hidden], 1.5);
        want.extend_from_slice(&x[3 * hidden..]);
        assert_close(&read_f32(&client, &xd).unwrap(), &want, FAMILY_TOL, "softcap");

        // Greedy ids, with a tie in row 1 that must go to the lower index: a row narrower than
        // one round of the cube, and a wide one whose tie spans planes and rounds.
        for width in [300, 20_011] {
            let mut v = rand_vec(&mut rng, tokens * width, 1.0);
            v[width + 17] = 5.0;
            v[width + width - 50] = 5.0;
            v[3 * width + width - 1] = 7.0;
            let ids = DeviceArray::empty::<WgpuRuntime, u32>(&client, tokens);
            argmax(&client, tokens, width, &up(&v), &ids).unwrap();
            let want = argmax_reference(&v, width);
            assert_eq!((want[1], want[3]), (17, width as u32 - 1));
            assert_eq!(read_u32(&client, &ids).unwrap(), want, "width {width}");
        }
    }
}
