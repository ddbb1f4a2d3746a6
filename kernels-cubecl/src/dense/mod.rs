//! The dense f16 skinny GEMM of a decode step (projections, dense MLPs, LM heads):
//! `y (+)= x · Wᵀ (+ bias)` with `W` f16 `[n, k]` row-major, optionally reading `x` through an
//! RMSNorm ([`RowNorm`]) so the norm needs no launch of its own. It runs on the plain SIMT kernel
//! ([`simt`]), on the matrix units in tiles of a few tokens ([`mma`]), or, in steps of many
//! tokens, as CubeK's f16 matmul ([`matmul`]).

pub mod matmul;
pub mod mma;
pub mod simt;
#[cfg(test)]
mod tests;

use cubecl::prelude::*;
use half::f16;

use crate::device::need;
use crate::norms::{RowNorm, rms_norm_reference};
use crate::{DeviceArray, KernelError};
use matmul::{MATMUL_MIN_ROWS, MATMUL_MIN_TOKENS};
use mma::{MMA_MIN_TOKENS, MmaMode};

/// Options of a dense skinny GEMM launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseGemm {
    /// Output features (rows of `W`).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Add `bias` (f32 `[n]`).
    pub bias: bool,
    /// `y += x·Wᵀ` (a residual add) instead of `y = x·Wᵀ`.
    pub accumulate: bool,
    /// Where it runs: the plain kernel or the matrix units ([`mma::dense_mma_kernel`]).
    pub mma: MmaMode,
    /// Rows per plane of the plain kernel at one or two tokens (1 or 2; other values are
    /// ignored). `None`: the launcher's choice, two with a norm or at two tokens, else one.
    pub plain_rows: Option<usize>,
}

impl DenseGemm {
    /// `y = x·Wᵀ` of `n` rows and `k` columns, no bias, [`MmaMode::AUTO`].
    pub fn new(n: usize, k: usize) -> Self {
        Self { n, k, bias: false, accumulate: false, mma: MmaMode::AUTO, plain_rows: None }
    }
}

/// `y (+)= x · Wᵀ (+ bias)` with `W` f16 `[n, k]` row-major; `meta[0]` = tokens (any number:
/// the skinny kernels take them in tiles of up to 16, large steps go through CubeK's matmul,
/// see [`mma::MmaTuning::matmul`]).
///
/// # Shapes
/// - `x`: `[tokens, k]`; `w`: `[n, k]`; `y`: `[tokens, n]`
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    dense_gemm_normed(client, g, tokens, meta, x, None, w, bias, y)
}

/// [`dense_gemm`] of `norm(x)` when `norm` is given: `y (+)= rms_norm(x) · Wᵀ (+ bias)` in one
/// launch (the norm is a per-token scale applied after each row's reduction, see
/// [`decode::dense_gemm_kernel`]), so a norm feeding a projection costs no launch.
///
/// # Shapes
/// - `x`: `[tokens, k]`; `norm.w`: `[k]`; `w`: `[n, k]`; `y`: `[tokens, n]`
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_normed<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    let input = match norm {
        Some(nm) => GemmInput::Norm(nm),
        None => GemmInput::Plain,
    };
    dense_gemm_launch(client, g, tokens, meta, x, input, w, bias, y)
}

/// What the dense GEMM does to `x` while loading it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum GemmInput<'a> {
    Plain,
    Norm(RowNorm<'a>),
}

#[allow(clippy::too_many_arguments)]
fn dense_gemm_launch<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    input: GemmInput<'_>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    need("dense_gemm x", x, tokens * g.k)?;
    need("dense_gemm w", w, g.n * g.k)?;
    need("dense_gemm y", y, tokens * g.n)?;
    if g.bias {
        need("dense_gemm bias", bias, g.n)?;
    }
    if let GemmInput::Norm(nm) = input {
        need("dense_gemm norm weight", nm.w, g.k)?;
        need("dense_gemm norm params", nm.params, 2)?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let norm = match input {
        GemmInput::Norm(nm) => Some(nm),
        _ => None,
    };
    let large = match g.mma {
        MmaMode::Matmul(m) => Some(m),
        MmaMode::Auto(t) if tokens >= MATMUL_MIN_TOKENS && g.n >= MATMUL_MIN_ROWS => {
            t.matmul.filter(|_| crate::grouped_mma_supported(client))
        }
        _ => None,
    };
    if let Some(kernel) = large {
        match matmul::launch(client, g, kernel, tokens, meta, x, norm, w, bias, y) {
            // A shape CubeK cannot set up (it says so before launching) falls back to the
            // skinny kernels under `Auto`.
            Err(_) if matches!(g.mma, MmaMode::Auto(_)) => {}
            r => return r,
        }
    }
    let tuning = match g.mma {
        MmaMode::Off | MmaMode::Matmul(_) => None,
        MmaMode::Auto(t) => (tokens >= MMA_MIN_TOKENS).then_some(t),
        MmaMode::Always(t) => Some(t),
    };
    if let Some(tuning) = tuning
        && g.k.is_multiple_of(mma::MMA_STEP_COLS)
        && mma::dense_mma_supported(client)
    {
        mma::launch(client, g, tuning, tokens, meta, x, norm, w, bias, y);
        return Ok(());
    }
    simt::launch(client, g, tokens, meta, x, input, w, bias, y);
    Ok(())
}

/// CPU reference of [`dense_gemm`]; updates `y` in place.
pub fn dense_gemm_reference(g: DenseGemm, x: &[f32], w: &[f16], bias: &[f32], y: &mut [f32]) {
    for (t, xr) in x.chunks(g.k).enumerate() {
        for r in 0..g.n {
            let mut s: f32 = w[r * g.k..][..g.k].iter().zip(xr).map(|(a, b)| a.to_f32() * b).sum();
            if g.bias {
                s += bias[r];
            }
            let o = &mut y[t * g.n + r];
            *o = if g.accumulate { *o + s } else { s };
        }
    }
}

/// CPU reference of [`dense_gemm_normed`]: [`rms_norm_reference`] of `x` with `norm_w`,
/// `[eps, offset]`, then [`dense_gemm_reference`]; updates `y` in place.
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_normed_reference(
    g: DenseGemm,
    x: &[f32],
    norm_w: &[f32],
    eps: f32,
    offset: f32,
    w: &[f16],
    bias: &[f32],
    y: &mut [f32],
) {
    dense_gemm_reference(g, &rms_norm_reference(x, norm_w, eps, offset), w, bias, y);
}
