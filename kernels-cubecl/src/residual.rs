//! Per-channel statistics of the residual stream over a prompt's tokens, accumulated on the
//! device layer by layer across the prompt's steps: what the planner's prompt-residual head
//! reads as features (`pw_planner::residual_features`) without reading the stream back.

use cubecl::prelude::*;

use crate::device::{bad, need};
use crate::{DeviceArray, KernelError};

/// Statistics per channel: the sum of `|h|`, the sum of `h²` and the largest `|h|`.
pub const RESIDUAL_STATS: usize = 3;

/// Units per cube of [`residual_stats_kernel`] (a unit per channel).
const STATS_UNITS: usize = 256;

/// Adds the rows of each segment `s` (`segs[3s ..] = (first row, rows, slot)`) of `h` (`[rows,
/// width]`) into the statistics of its slot at layer `layer`: with `base = ((slot · layers +
/// layer) · 3) · width`, `stats[base + c] += Σ|h[r, c]|`, `stats[base + width + c] += Σ h[r, c]²`,
/// `stats[base + 2 · width + c] = max(·, max |h[r, c]|)`. Grid `(segments, ⌈width / units⌉)`, a
/// unit per channel: each statistic has one writer, so no atomics.
#[cube(launch_unchecked)]
pub fn residual_stats_kernel(
    h: &Array<f32>,
    segs: &Array<u32>,
    stats: &mut Array<f32>,
    layer: u32,
    #[comptime] width: usize,
    #[comptime] layers: usize,
) {
    let s = CUBE_POS_X as usize;
    let c = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if c >= width {
        terminate!();
    }
    let first = segs[3usize * s] as usize;
    let rows = segs[3usize * s + 1usize] as usize;
    let slot = segs[3usize * s + 2usize] as usize;
    let mut abs_sum = 0.0f32;
    let mut sq_sum = 0.0f32;
    let mut peak = 0.0f32;
    for r in first..first + rows {
        let v = h[r * width + c];
        abs_sum += v.abs();
        sq_sum += v * v;
        peak = max(peak, v.abs());
    }
    let base = (slot * layers + layer as usize) * comptime![RESIDUAL_STATS * width];
    stats[base + c] += abs_sum;
    stats[base + width + c] += sq_sum;
    stats[base + comptime![2 * width] + c] = max(stats[base + comptime![2 * width] + c], peak);
}

/// [`residual_stats_kernel`] of `segments` (`(first row, rows, slot)` triples, uploaded here)
/// of `h` at layer `layer` into `stats` (`[slots, layers, 3, width]`, zeroed by the caller
/// when a slot starts a prompt). Does not synchronise.
///
/// # Shapes
/// - `h`: `[rows, width]`; `stats`: `[slots, layers, RESIDUAL_STATS, width]`
#[allow(clippy::too_many_arguments)]
pub fn residual_stats<R: Runtime>(
    client: &ComputeClient<R>,
    h: &DeviceArray,
    width: usize,
    segments: &[(u32, u32, u32)],
    stats: &DeviceArray,
    layer: usize,
    layers: usize,
) -> Result<(), KernelError> {
    if layer >= layers || width == 0 {
        return Err(bad(format!("residual_stats: layer {layer} of {layers}, width {width}")));
    }
    let per_slot = layers * RESIDUAL_STATS * width;
    for &(first, rows, slot) in segments {
        need("residual_stats h", h, (first + rows) as usize * width)?;
        need("residual_stats stats", stats, (slot as usize + 1) * per_slot)?;
    }
    if segments.is_empty() {
        return Ok(());
    }
    let flat: Vec<u32> = segments.iter().flat_map(|&(f, r, s)| [f, r, s]).collect();
    let segs = DeviceArray::from_slice(client, &flat);
    // SAFETY: every segment's rows lie inside `h` and its slot inside `stats` (checked above);
    // units past `width` exit.
    unsafe {
        residual_stats_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(segments.len() as u32, width.div_ceil(STATS_UNITS) as u32, 1),
            CubeDim::new_1d(STATS_UNITS as u32),
            h.arg(),
            segs.arg(),
            stats.arg(),
            layer as u32,
            width,
            layers,
        )
    };
    Ok(())
}

/// CPU reference of [`residual_stats`].
pub fn residual_stats_reference(
    h: &[f32],
    width: usize,
    segments: &[(u32, u32, u32)],
    stats: &mut [f32],
    layer: usize,
    layers: usize,
) {
    for &(first, rows, slot) in segments {
        let base = (slot as usize * layers + layer) * RESIDUAL_STATS * width;
        for r in first as usize..(first + rows) as usize {
            for c in 0..width {
                let v = h[r * width + c];
                stats[base + c] += v.abs();
                stats[base + width + c] += v * v;
                stats[base + 2 * width + c] = stats[base + 2 * width + c].max(v.abs());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::read_f32;
    use crate::testing::{assert_close, client, rand_vec};

    /// Sums of `|h|` and `h²` over up to 40 rows in another order than the CPU's.
    const STATS_TOL: f32 = 1e-5;

    /// Two layers of two steps, segments of two slots (one slot in two segments of a step),
    /// a width that leaves units idle: the device statistics against the reference.
    #[test]
    fn residual_stats_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(41);
        let (width, layers, slots) = (300, 2, 3);
        let mut want = vec![0f32; slots * layers * RESIDUAL_STATS * width];
        let stats = DeviceArray::from_slice(&client, &want);
        for (step, segments) in [vec![(0u32, 7u32, 2u32), (7, 1, 0), (8, 30, 2)], vec![(3, 37, 1), (0, 3, 2)]]
            .into_iter()
            .enumerate()
        {
            let rows = 40;
            let h = rand_vec(&mut rng, rows * width, 3.0);
            let hd = DeviceArray::from_slice(&client, &h);
            for layer in 0..layers {
                residual_stats(&client, &hd, width, &segments, &stats, layer, layers).unwrap();
                residual_stats_reference(&h, width, &segments, &mut want, layer, layers);
            }
            let got = read_f32(&client, &stats).unwrap();
            assert_close(&got, &want, STATS_TOL, &format!("step {step}"));
        }
        let e = residual_stats(&client, &stats, width, &[(0, 1, 3)], &stats, 0, layers).unwrap_err();
        assert!(e.to_string().contains("residual_stats stats"), "{e}");
    }
}
