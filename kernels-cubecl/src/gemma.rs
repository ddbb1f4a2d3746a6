//! Gemma-4's feed-forward epilogue in one launch: the routed experts' weighted sum, the dense
//! MLP's output, the three post-feed-forward norms and the layer scalar.

use cubecl::prelude::*;

use crate::device::{bad, need, row_units};
use crate::norms::rms_norm_reference;
use crate::plane::{cube_sum, load_row};
use crate::routing::route::plane_top_k;
use crate::routing::{MoeShape, route_reference};
use crate::{DeviceArray, KernelError};

/// The buffers [`gemma_ffn_out`] reads and writes.
#[derive(Debug, Clone, Copy)]
pub struct GemmaFfnOut<'a> {
    /// `[tokens, experts]` router logits.
    pub logits: &'a DeviceArray,
    /// `[experts]` per-expert output scale.
    pub per_expert_scale: &'a DeviceArray,
    /// `[tokens, k]` gathered row of each choice (from `moe_route`).
    pub pos: &'a DeviceArray,
    /// `[tokens · k, hidden]` expert outputs.
    pub down: &'a DeviceArray,
    /// `[tokens, hidden]` dense MLP output.
    pub mlp: &'a DeviceArray,
    /// `[3 · hidden]` = post_feedforward_layernorm_1 | _2 | post_feedforward_layernorm.
    pub norms: &'a DeviceArray,
    /// `[1]` layer scalar.
    pub scalar: &'a DeviceArray,
    /// `[eps]`.
    pub params: &'a DeviceArray,
    /// `[tokens, hidden]` residual stream, updated.
    pub h: &'a DeviceArray,
}

/// Gemma-4's feed-forward epilogue for token `t` (grid `(tokens)`, cube: `units` units, unit
/// `u` owning columns `u + i · units` in registers): routing recomputed from `logits[t]` by
/// each plane with the routing's own selection ([`crate::routing::route::plane_top_k`]: softmax, top-k
/// with lower expert first on ties), renormalised, times `per_expert_scale[e]`;
/// `y = Σ_j w_j · down[pos[t, j]]`; then `h = (h + norm(norm(m)·post1 + norm(y)·post2)·post) ·
/// scalar[0]`.
/// `norms = [post1 | post2 | post]` (`3·hidden`), `params = [eps]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn gemma_ffn_out_kernel(
    logits: &Array<f32>,
    pes: &Array<f32>,
    pos: &Array<u32>,
    down: &Array<f32>,
    m: &Array<f32>,
    norms: &Array<f32>,
    scalar: &Array<f32>,
    params: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
) {
    let per = comptime![hidden.div_ceil(units)];
    let t = CUBE_POS_X as usize;
    let u = UNIT_POS as usize;
    let base = t * hidden;
    let lb = t * experts;
    let eps = params[0];
    // Every plane selects the token's experts itself, as the routing does (no barrier), rather
    // than each unit scanning all experts k times.
    let mut esel = Array::<u32>::new(k);
    let mut wsel = Array::<f32>::new(k);
    plane_top_k(&logits.to_slice(), lb, u % plane_size, &mut esel, &mut wsel, experts, k, plane_size);
    // Every load that does not depend on the reductions first, in one block: loads behind a
    // guard, a division's slow-path branch or a store to `h` are issued one round trip at a
    // time.
    let mut rows = Array::<u32>::new(k);
    let mut scale = Array::<f32>::new(k);
    let mut sum = 0.0f32;
    #[unroll]
    for j in 0..k {
        rows[j] = pos[t * k + j];
        scale[j] = pes[esel[j] as usize];
        sum += wsel[j];
    }
    let mut post1 = Array::<f32>::new(per);
    let mut post2 = Array::<f32>::new(per);
    let mut post = Array::<f32>::new(per);
    let mut hv = Array::<f32>::new(per);
    let mut mv = Array::<f32>::new(per);
    load_row(norms, 0usize, &mut post1, hidden, units);
    load_row(norms, hidden, &mut post2, hidden, units);
    load_row(norms, 2 * hidden, &mut post, hidden, units);
    load_row(h, base, &mut hv, hidden, units);
    let ss_m = load_row(m, base, &mut mv, hidden, units);
    let rsum = 1.0 / sum;
    #[unroll]
    for j in 0..k {
        wsel[j] = wsel[j] * rsum * scale[j];
    }
    // Pass 1: the experts' sum and its sum of squares (columns past `hidden` read the last one
    // and count zero).
    let mut yv = Array::<f32>::new(per);
    let mut ss_y = 0.0f32;
    #[unroll]
    for i in 0..per {
        let c = min(u + i * units, hidden - 1);
        let mut y = 0.0f32;
        #[unroll]
        for j in 0..k {
            y += wsel[j] * down[rows[j] as usize * hidden + c];
        }
        y = select(u + i * units < hidden, y, 0.0f32);
        yv[i] = y;
        ss_y += y * y;
    }
    let hf = f32::cast_from(hidden);
    let inv_y = 1.0 / (cube_sum(ss_y, units, plane_size) / hf + eps).sqrt();
    let inv_m = 1.0 / (cube_sum(ss_m, units, plane_size) / hf + eps).sqrt();
    let mut ss_x = 0.0f32;
    #[unroll]
    for i in 0..per {
        let x = mv[i] * inv_m * post1[i] + yv[i] * inv_y * post2[i];
        yv[i] = x;
        ss_x += x * x;
    }
    let inv_x = 1.0 / (cube_sum(ss_x, units, plane_size) / hf + eps).sqrt();
    let s = scalar[0];
    #[unroll]
    for i in 0..per {
        let c = u + i * units;
        if c < hidden {
            h[base + c] = (hv[i] + yv[i] * inv_x * post[i]) * s;
        }
    }
}

/// Host side of [`gemma_ffn_out_kernel`].
pub fn gemma_ffn_out<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    experts: usize,
    k: usize,
    hidden: usize,
    b: GemmaFfnOut<'_>,
) -> Result<(), KernelError> {
    if experts > 128 || k == 0 || k > experts {
        return Err(bad(format!("gemma_ffn_out: {experts} experts, top-{k}")));
    }
    need("gemma_ffn_out logits", b.logits, tokens * experts)?;
    need("gemma_ffn_out per_expert_scale", b.per_expert_scale, experts)?;
    need("gemma_ffn_out pos", b.pos, tokens * k)?;
    need("gemma_ffn_out down", b.down, tokens * k * hidden)?;
    need("gemma_ffn_out mlp", b.mlp, tokens * hidden)?;
    need("gemma_ffn_out norms", b.norms, 3 * hidden)?;
    need("gemma_ffn_out scalar", b.scalar, 1)?;
    need("gemma_ffn_out params", b.params, 1)?;
    need("gemma_ffn_out h", b.h, tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    let (units, plane) = row_units(client, hidden, 16);
    if hidden > 32 * units {
        return Err(bad(format!(
            "gemma_ffn_out: width {hidden} exceeds 32 values per unit of {units} units"
        )));
    }
    // SAFETY: sizes checked above; `pos` entries come from `moe_route`, below `tokens · k`.
    unsafe {
        gemma_ffn_out_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            b.logits.arg(),
            b.per_expert_scale.arg(),
            b.pos.arg(),
            b.down.arg(),
            b.mlp.arg(),
            b.norms.arg(),
            b.scalar.arg(),
            b.params.arg(),
            b.h.arg(),
            experts,
            k,
            hidden,
            units,
            plane,
        )
    };
    Ok(())
}

/// CPU reference of [`gemma_ffn_out`] with the experts' outputs given per token and choice
/// (`down[t, j]` is the output of token `t`'s `j`-th choice); updates `h` in place.
#[allow(clippy::too_many_arguments)]
pub fn gemma_ffn_out_reference(
    logits: &[f32],
    experts: usize,
    k: usize,
    per_expert_scale: &[f32],
    down: &[f32],
    mlp: &[f32],
    norms: &[f32],
    scalar: f32,
    eps: f32,
    h: &mut [f32],
) {
    let hidden = norms.len() / 3;
    let shape = MoeShape { experts, k, renormalize: true, hidden, inter: 1 };
    let (sel, wts) = route_reference(shape, logits);
    let norm = |x: &[f32], w: &[f32]| rms_norm_reference(x, w, eps, 0.0);
    for (t, hrow) in h.chunks_mut(hidden).enumerate() {
        let mut y = vec![0f32; hidden];
        for j in 0..k {
            let w = wts[t * k + j] * per_expert_scale[sel[t * k + j] as usize];
            for (c, yy) in y.iter_mut().enumerate() {
                *yy += w * down[(t * k + j) * hidden + c];
            }
        }
        let a = norm(&mlp[t * hidden..][..hidden], &norms[..hidden]);
        let b = norm(&y, &norms[hidden..2 * hidden]);
        let x: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
        let x = norm(&x, &norms[2 * hidden..]);
        for (hh, xx) in hrow.iter_mut().zip(x) {
            *hh = (*hh + xx) * scalar;
        }
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
    fn gemma_ffn_out_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(14);
        let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
        // One plane, and several planes reducing through shared memory.
        for hidden in [48, 1000] {
            let (tokens, experts, k) = (5, 12, 3);
            let logits = rand_vec(&mut rng, tokens * experts, 3.0);
            let pes: Vec<f32> = (0..experts).map(|e| 0.5 + e as f32 * 0.1).collect();
            // Per (token, choice) outputs, stored at a permuted gathered row as `moe_route` would.
            let per_choice = rand_vec(&mut rng, tokens * k * hidden, 1.0);
            let pos: Vec<u32> = (0..(tokens * k) as u32).map(|i| (i * 7) % (tokens * k) as u32).collect();
            let mut down = vec![0f32; tokens * k * hidden];
            for (i, &p) in pos.iter().enumerate() {
                down[p as usize * hidden..][..hidden].copy_from_slice(&per_choice[i * hidden..][..hidden]);
            }
            let mlp = rand_vec(&mut rng, tokens * hidden, 2.0);
            let norms = rand_vec(&mut rng, 3 * hidden, 1.0);
            let mut h = rand_vec(&mut rng, tokens * hidden, 1.0);
            let hd = up(&h);
            let b = GemmaFfnOut {
                logits: &up(&logits),
                per_expert_scale: &up(&pes),
                pos: &DeviceArray::from_slice(&client, &pos),
                down: &up(&down),
                mlp: &up(&mlp),
                norms: &up(&norms),
                scalar: &up(&[0.7]),
                params: &up(&[1e-6]),
                h: &hd,
            };
            gemma_ffn_out(&client, tokens, experts, k, hidden, b).unwrap();
            gemma_ffn_out_reference(&logits, experts, k, &pes, &per_choice, &mlp, &norms, 0.7, 1e-6, &mut h);
            assert_close(
                &read_f32(&client, &hd).unwrap(),
                &h,
                FAMILY_TOL,
                &format!("gemma_ffn_out, hidden {hidden}"),
            );
        }
    }
}
