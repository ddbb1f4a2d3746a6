//! Gated activations `act(gate) · up`: the [`Activation`] codes the expert and dense GEMMs apply
//! while loading their input, their CPU formulas, and the activation as a launch of its own
//! ([`gated_act`]).

use cubecl::prelude::*;

use crate::device::{bad, column_grid, need};
use crate::{DeviceArray, KernelError};

/// What the kernel applies to `x` while staging it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x` is `[tokens, K]`, used as is.
    None,
    /// `x` is `[tokens, 2K]` = gate | up; the kernel uses `silu(gate) · up`.
    SiluMul,
    /// `x` is `[tokens, 2K]` = gate | up; the kernel uses `gelu_tanh(gate) · up`.
    GeluTanhMul,
    /// `x` is `[tokens, 2K]` whose first half already holds `act(gate) · up` (written by
    /// [`gated_act`] with a row stride of `2K`); the kernel uses that half.
    Applied,
}

impl Activation {
    pub(crate) fn code(self) -> u32 {
        match self {
            Self::None => 0,
            Self::SiluMul => 1,
            Self::GeluTanhMul => 2,
            Self::Applied => 3,
        }
    }
}

/// `act(g)` for an [`Activation`] code (1: SiLU, 2: GELU with the tanh approximation, HF's
/// `gelu_pytorch_tanh`).
#[cube]
pub(crate) fn act_fn(g: f32, #[comptime] act: u32) -> f32 {
    if comptime![act == 1] {
        g / (1.0 + (-g).exp())
    } else {
        let inner = 0.797_884_6 * (g + 0.044715 * g * g * g);
        0.5 * g * (1.0 + inner.tanh())
    }
}

/// `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation.
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())
}

/// A dense MLP's gate|up rows as [`gated_act`] reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedInput {
    /// The activation of the gate half (not [`Activation::None`]).
    pub act: Activation,
    /// Elements per gate|up row: `2·k`, or more (a multiple of 8 when `gated`).
    pub stride: usize,
    /// Scale each token by the sigmoid of its row's column `2·k` (Qwen's shared-expert gate).
    pub gated: bool,
}

impl GatedInput {
    /// Rejects an input without an activation or whose rows cannot hold gate and up halves of
    /// `width` (and the gate column when `gated`); `what` names the launcher.
    pub(crate) fn check(&self, what: &str, width: usize) -> Result<(), KernelError> {
        let gating = matches!(self.act, Activation::SiluMul | Activation::GeluTanhMul);
        if !gating || self.stride < 2 * width + self.gated as usize {
            return Err(bad(format!("{what}: {self:?} for width {width}")));
        }
        Ok(())
    }
}

/// `out[t · out_stride + i] = act(x[t, i]) · x[t, inter + i] · s_t` over gate|up rows of
/// `stride` (`s_t` the sigmoid of `x[t, 2·inter]` when `gated`, else 1). Grid:
/// [`crate::device::column_grid`], a column per unit.
#[cube(launch_unchecked)]
pub fn gated_act_kernel(
    x: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] inter: usize,
    #[comptime] stride: usize,
    #[comptime] act: u32,
    #[comptime] gated: bool,
    #[comptime] out_stride: usize,
) {
    let t = CUBE_POS_X as usize;
    let c = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if c < inter {
        let row = t * stride;
        let mut v = act_fn(x[row + c], act) * x[row + inter + c];
        if comptime![gated] {
            v /= 1.0 + (-x[row + 2 * inter]).exp();
        }
        out[t * out_stride + c] = v;
    }
}

/// The activation of a dense MLP's gate|up rows as a launch of its own ([`gated_act_kernel`])
/// between its two dense GEMMs; the shared expert's sigmoid gate is a per-token scale, so it
/// is applied here and the down projection reads plain rows. Rows of `out` are
/// `out_stride` apart (`inter` for packed rows; `2 · inter` leaves each in the gate half of a
/// gate|up-shaped row, what [`crate::Activation::Applied`] reads).
///
/// # Shapes
/// - `x`: `[tokens, a.stride]`; `out`: `[tokens, out_stride]` (the first `inter` of each row)
pub fn gated_act<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    inter: usize,
    a: GatedInput,
    x: &DeviceArray,
    (out, out_stride): (&DeviceArray, usize),
) -> Result<(), KernelError> {
    a.check("gated_act", inter)?;
    if out_stride < inter {
        return Err(bad(format!("gated_act: output rows of {out_stride} for width {inter}")));
    }
    need("gated_act x", x, tokens * a.stride)?;
    need("gated_act out", out, tokens.saturating_sub(1) * out_stride + inter)?;
    if tokens == 0 || inter == 0 {
        return Ok(());
    }
    let (count, dim) = column_grid(tokens, inter);
    // SAFETY: sizes checked above; the kernel bounds-checks its column.
    unsafe {
        gated_act_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            x.arg(),
            out.arg(),
            inter,
            a.stride,
            a.act.code(),
            a.gated,
            out_stride,
        )
    };
    Ok(())
}

/// `out[t, i] = act(x[t, i]) · x[t, inter + i]` (· `sigmoid(x[t, 2·inter])` when `gated`) of
/// rows of `stride`, on the CPU: the reference of [`gated_act`].
pub fn gated_act_reference(x: &[f32], inter: usize, stride: usize, act: Activation, gated: bool) -> Vec<f32> {
    let f = |g: f32| if act == Activation::SiluMul { silu(g) } else { gelu_tanh(g) };
    x.chunks(stride)
        .flat_map(|row| {
            let s = if gated { 1.0 / (1.0 + (-row[2 * inter]).exp()) } else { 1.0 };
            (0..inter).map(move |i| f(row[i]) * row[inter + i] * s)
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

    /// The activation as a launch of its own: against
    /// `gated_act_reference`, with and without the sigmoid gate column, SiLU and GELU, a width that
    /// ends mid-cube; a stride without room for the gate column is refused.
    #[test]
    fn gated_act_matches_reference() {
        let client = client();
        let mut rng = StdRng::seed_from_u64(12);
        for (inter, act, gated) in [
            (300usize, Activation::SiluMul, true),
            (40, Activation::GeluTanhMul, false),
            (256, Activation::SiluMul, false),
        ] {
            let stride = if gated { (2 * inter + 1).next_multiple_of(8) } else { 2 * inter };
            let a = GatedInput { act, stride, gated };
            let tokens = 5;
            let x = rand_vec(&mut rng, tokens * stride, 3.0);
            let want = gated_act_reference(&x, inter, stride, act, gated);
            // Packed rows, and rows left in the gate half of gate|up-shaped rows (what
            // `Activation::Applied` reads).
            for out_stride in [inter, 2 * inter] {
                let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * out_stride);
                let xd = DeviceArray::from_slice(&client, &x);
                gated_act(&client, tokens, inter, a, &xd, (&out, out_stride)).unwrap();
                let got: Vec<f32> = read_f32(&client, &out).unwrap()[..tokens * out_stride]
                    .chunks(out_stride)
                    .flat_map(|row| row[..inter].to_vec())
                    .collect();
                let what = format!("gated_act {a:?}, width {inter}, output rows of {out_stride}");
                assert_close(&got, &want, FAMILY_TOL, &what);
            }
        }
        let x = DeviceArray::from_slice(&client, &[0.0f32; 80]);
        let bad = GatedInput { act: Activation::SiluMul, stride: 80, gated: true };
        assert!(gated_act(&client, 1, 40, bad, &x, (&x, 40)).is_err(), "no gate column");
        let applied = GatedInput { act: Activation::Applied, stride: 80, gated: false };
        assert!(gated_act(&client, 1, 40, applied, &x, (&x, 40)).is_err(), "no activation to apply");
        let ok = GatedInput { act: Activation::SiluMul, stride: 80, gated: false };
        assert!(gated_act(&client, 1, 40, ok, &x, (&x, 39)).is_err(), "output rows too short");
    }
}
