//! RMSNorms. Most are folded into the kernel that reads their output ([`RowNorm`]: the dense
//! GEMM, the experts' gather, the router); Gemma's sandwich norm added into the residual
//! ([`add_rms_norm`]) and the per-head Q/K/V norms ([`head`]) are launches of their own.

pub mod head;

use cubecl::prelude::*;

use crate::device::{bad, need, row_units};
use crate::plane::{cube_sum, load_row};
use crate::{DeviceArray, KernelError};

/// An RMSNorm folded into the input of the kernel that consumes its output:
/// `x / sqrt(mean(x²) + params[0]) · (w + params[1])` per row of `x`, as
/// [`rms_norm_reference`] computes it (`params = [eps, offset]`, offset 1 for `1 + w` norms).
#[derive(Debug, Clone, Copy)]
pub struct RowNorm<'a> {
    /// f32 `[width]` norm weight.
    pub w: &'a DeviceArray,
    /// f32 `[eps, offset]`.
    pub params: &'a DeviceArray,
}

/// The norm buffers a launch binds: the norm's, or, without a norm (the kernel then reads
/// neither), `x` and `meta` standing in for them.
pub(crate) fn norm_args<'a>(
    norm: Option<RowNorm<'a>>,
    x: &'a DeviceArray,
    meta: &'a DeviceArray,
) -> (&'a DeviceArray, &'a DeviceArray) {
    match norm {
        Some(nm) => (nm.w, nm.params),
        None => (x, meta),
    }
}

/// RMSNorm of each row: `x / sqrt(mean(x²) + eps) · (w + offset)` (offset 1 for `1 + w`
/// norms), on the CPU. The decode step has no norm launch of its own: the reference of the
/// norms folded into [`dense_gemm_normed`] and [`gather_rows_normed`].
pub fn rms_norm_reference(x: &[f32], w: &[f32], eps: f32, offset: f32) -> Vec<f32> {
    let hidden = w.len();
    x.chunks(hidden)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
            let inv = (ms + eps).sqrt();
            row.iter().zip(w).map(move |(v, g)| v / inv * (g + offset))
        })
        .collect()
}

/// `h[t] += x[t] / rms(x[t]) · w`; `params = [eps]`. Grid `(tokens)`; cube: `units` units,
/// each owning columns `u + i · units` (unrolled; see [`crate::routing::gather::gather_rows_kernel`]).
#[cube(launch_unchecked)]
pub fn add_rms_norm_kernel(
    x: &Array<f32>,
    w: &Array<f32>,
    params: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let per = comptime![hidden.div_ceil(units)];
    let base = CUBE_POS_X as usize * hidden;
    let u = UNIT_POS as usize;
    let eps = params[0];
    let mut xv = Array::<f32>::new(per);
    let ss = load_row(x, base, &mut xv, hidden, units);
    // `h` and `w` before any store, in one block: loaded per column between the stores to `h`,
    // each column waits out a round trip.
    let mut hv = Array::<f32>::new(per);
    let mut wv = Array::<f32>::new(per);
    load_row(h, base, &mut hv, hidden, units);
    load_row(w, 0usize, &mut wv, hidden, units);
    let inv = 1.0 / (cube_sum(ss, units, plane_size) / f32::cast_from(hidden) + eps).sqrt();
    #[unroll]
    for i in 0..per {
        let c = u + i * units;
        if c < hidden {
            h[base + c] = hv[i] + xv[i] * inv * wv[i];
        }
    }
}

/// Host side of [`add_rms_norm_kernel`]: `h += rms_norm(x) · w`, `params = [eps]`.
///
/// # Shapes
/// - `x`, `h`: `[tokens, hidden]`; `w`: `[hidden]`
pub fn add_rms_norm<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    hidden: usize,
    x: &DeviceArray,
    w: &DeviceArray,
    params: &DeviceArray,
    h: &DeviceArray,
) -> Result<(), KernelError> {
    need("add_rms_norm x", x, tokens * hidden)?;
    need("add_rms_norm h", h, tokens * hidden)?;
    need("add_rms_norm w", w, hidden)?;
    need("add_rms_norm params", params, 1)?;
    if tokens == 0 {
        return Ok(());
    }
    let (units, plane) = row_units(client, hidden, 16);
    if hidden > 32 * units {
        return Err(bad(format!("add_rms_norm: width {hidden} exceeds 32 values per unit of {units} units")));
    }
    // SAFETY: sizes checked above.
    unsafe {
        add_rms_norm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            x.arg(),
            w.arg(),
            params.arg(),
            h.arg(),
            hidden,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`add_rms_norm`]; updates `h` in place.
pub fn add_rms_norm_reference(x: &[f32], w: &[f32], eps: f32, h: &mut [f32]) {
    let n = rms_norm_reference(x, w, eps, 0.0);
    for (a, b) in h.iter_mut().zip(n) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::testing::{assert_close, client, rand_vec};
    use crate::*;

    /// f32 arithmetic in another order than the CPU (plane sums), plus GPU exp/tanh.
    const FAMILY_TOL: f32 = 2e-5;

    #[test]
    fn add_rms_norm_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(13);
        let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
        let (tokens, hidden) = (4, 72);
        let x = rand_vec(&mut rng, tokens * hidden, 2.0);
        let w = rand_vec(&mut rng, hidden, 1.0);
        let mut h = rand_vec(&mut rng, tokens * hidden, 1.0);
        let hd = up(&h);
        add_rms_norm(&client, tokens, hidden, &up(&x), &up(&w), &up(&[1e-6]), &hd).unwrap();
        add_rms_norm_reference(&x, &w, 1e-6, &mut h);
        assert_close(&read_f32(&client, &hd).unwrap(), &h, FAMILY_TOL, "add_rms_norm");

        // Rows wider than a cube's units (several values per unit, a partial last round).
        let hidden = 3001;
        let x = rand_vec(&mut rng, tokens * hidden, 2.0);
        let w = rand_vec(&mut rng, hidden, 1.0);
        let mut h = rand_vec(&mut rng, tokens * hidden, 1.0);
        let hd = up(&h);
        add_rms_norm(&client, tokens, hidden, &up(&x), &up(&w), &up(&[1e-6]), &hd).unwrap();
        add_rms_norm_reference(&x, &w, 1e-6, &mut h);
        assert_close(&read_f32(&client, &hd).unwrap(), &h, FAMILY_TOL, "add_rms_norm, wide");
    }
}
