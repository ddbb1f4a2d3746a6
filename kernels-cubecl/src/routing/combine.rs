//! The experts' outputs back into the residual stream: `h[t] += Σ_j weights[t, j] · y[pos[t, j]]`.

use cubecl::prelude::*;

use crate::device::{column_grid, need};
use crate::{DeviceArray, KernelError};

/// `h[t] += Σ_j weights[t, j] · y[pos[t, j]]` (the experts' outputs back into the residual
/// stream, in a fixed order). Grid: [`crate::device::column_grid`], a column per unit, rather
/// than one cube per token walking its row in a loop of dependent loads.
#[cube(launch_unchecked)]
pub fn moe_combine_kernel(
    y: &Array<f32>,
    pos: &Array<u32>,
    weights: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] k: usize,
    #[comptime] hidden: usize,
) {
    let t = CUBE_POS_X as usize;
    let c = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if c < hidden {
        let mut acc = 0.0f32;
        #[unroll]
        for j in 0..k {
            acc += weights[t * k + j] * y[pos[t * k + j] as usize * hidden + c];
        }
        h[t * hidden + c] += acc;
    }
}

/// `h[t] += Σ_j weights[t, j] · y[pos[t, j]]`.
///
/// # Shapes
/// - `y`: `[tokens · k, hidden]`; `pos`, `weights`: `[tokens, k]`; `h`: `[tokens, hidden]`
#[allow(clippy::too_many_arguments)]
pub fn moe_combine<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    k: usize,
    hidden: usize,
    y: &DeviceArray,
    pos: &DeviceArray,
    weights: &DeviceArray,
    h: &DeviceArray,
) -> Result<(), KernelError> {
    need("combine y", y, tokens * k * hidden)?;
    need("combine h", h, tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above; positions come from `moe_route`, below `tokens · k`.
    let (count, dim) = column_grid(tokens, hidden);
    unsafe {
        moe_combine_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            y.arg(),
            pos.arg(),
            weights.arg(),
            h.arg(),
            k,
            hidden,
        )
    };
    Ok(())
}
