//! Tests of the module's kernels against their CPU references on random inputs (wgpu:
//! Mesa lavapipe in CI, plane size 8, 32 KiB of shared memory).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::testing::{assert_close, client, rand_vec};
use crate::*;

/// Dense GEMM: f32 accumulation in another order.
const STEP_TOL: f32 = 2e-5;

/// The plain dense GEMM with bias, and accumulating into a residual, at 1, 3 and 16 tokens and
/// at 37 (three token tiles, the last ragged).
#[test]
fn dense_gemm_matches_reference() {
    use half::f16;
    let client = client();
    let mut rng = StdRng::seed_from_u64(99);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let hidden = 96;
    for tokens in [1usize, 3, 16, 37] {
        let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
        let x = rand_vec(&mut rng, tokens * hidden, 2.0);
        let h = up(&x);
        for (bias, accumulate) in [(false, false), (true, true)] {
            let g = DenseGemm { bias, accumulate, ..DenseGemm::new(70, hidden) };
            let wt: Vec<f16> = rand_vec(&mut rng, g.n * g.k, 0.5).into_iter().map(f16::from_f32).collect();
            let b = rand_vec(&mut rng, g.n, 1.0);
            let y0 = rand_vec(&mut rng, tokens * g.n, 1.0);
            let y = up(&y0);
            dense_gemm(&client, g, tokens, &meta, &h, &DeviceArray::from_slice(&client, &wt), &up(&b), &y)
                .unwrap();
            let mut want = y0.clone();
            dense_gemm_reference(g, &x, &wt, &b, &mut want);
            assert_close(&read_f32(&client, &y).unwrap(), &want, STEP_TOL, "dense_gemm");
        }
    }
}

/// An RMSNorm folded into its consumer: the norm's scale is applied after the row's reduction
/// instead of before, and `Σ x²` is summed per lane then across the plane: f32 rounding in
/// another order only.
const NORMED_TOL: f32 = 2e-5;

/// The dense GEMM with a fused input RMSNorm (plain and `1 + w`) against [`rms_norm_reference`]
/// followed by the plain reference; widths with and without the GEMM's 4-vector rounds, 1, 3,
/// 16 and 37 tokens, bias and residual add.
#[test]
fn dense_gemm_normed_matches_reference() {
    use half::f16;
    let client = client();
    let mut rng = StdRng::seed_from_u64(101);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    for (k, n) in [(96usize, 70usize), (1000, 37)] {
        for tokens in [1usize, 3, 16, 37] {
            let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
            // Rows of different magnitudes, so the per-token scale matters.
            let x: Vec<f32> =
                (0..tokens * k).map(|i| rng.random_range(-1.0f32..1.0) * (1 + i / k) as f32).collect();
            let g = rand_vec(&mut rng, k, 1.0);
            for (off, bias, accumulate) in [(0.0f32, false, false), (1.0, true, true)] {
                let d = DenseGemm { n, k, bias, accumulate, mma: MmaMode::AUTO, plain_rows: None };
                let wt: Vec<f16> = rand_vec(&mut rng, n * k, 0.5).into_iter().map(f16::from_f32).collect();
                let b = rand_vec(&mut rng, n, 1.0);
                let y0 = rand_vec(&mut rng, tokens * n, 1.0);
                let y = up(&y0);
                let (gw, params) = (up(&g), up(&[1e-5, off]));
                let norm = Some(RowNorm { w: &gw, params: &params });
                dense_gemm_normed(
                    &client,
                    d,
                    tokens,
                    &meta,
                    &up(&x),
                    norm,
                    &DeviceArray::from_slice(&client, &wt),
                    &up(&b),
                    &y,
                )
                .unwrap();
                let mut want = y0.clone();
                dense_gemm_normed_reference(d, &x, &g, 1e-5, off, &wt, &b, &mut want);
                let what = format!("dense_gemm_normed k {k}, {tokens} tokens, offset {off}");
                assert_close(&read_f32(&client, &y).unwrap(), &want, NORMED_TOL, &what);
            }
        }
    }
}

/// `DenseGemm::mma` on any device: the matrix-unit kernel where the device has TF32 `mma`
/// (its inputs rounded to TF32: relative error ≤ 2⁻¹¹ per `x`), the plain kernel elsewhere
/// (lavapipe); both within [`DENSE_MMA_RTOL`] of the reference, plain and normed, with bias
/// and residual add, at 1, 3, 8 and 9 tokens (one and two token groups) and 41 (three token
/// tiles).
const DENSE_MMA_RTOL: f32 = 1e-3;

#[test]
fn dense_mma_matches_reference() {
    let mut rng = StdRng::seed_from_u64(211);
    for (n, k, tokens) in [(70usize, 96usize, 1usize), (33, 128, 3), (16, 64, 8), (40, 160, 9), (24, 96, 41)]
    {
        for normed in [false, true] {
            let d = DenseGemm {
                n,
                k,
                bias: true,
                accumulate: true,
                mma: MmaMode::Always(MmaTuning::default()),
                plain_rows: None,
            };
            assert_within_rtol(&mut rng, d, tokens, normed, "dense mma");
        }
    }
}

/// Runs `d` over `tokens` random rows of growing magnitude (through a `1 + w` RMSNorm when
/// `normed`) and asserts every output within [`DENSE_MMA_RTOL`] · `Σ|x·w| + |b|` of the
/// reference.
fn assert_within_rtol(rng: &mut StdRng, d: DenseGemm, tokens: usize, normed: bool, what: &str) {
    use half::f16;
    let client = client();
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let (n, k) = (d.n, d.k);
    let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
    let x: Vec<f32> = (0..tokens * k).map(|i| rng.random_range(-1.0f32..1.0) * (1 + i / k) as f32).collect();
    let wt: Vec<f16> = rand_vec(rng, n * k, 0.5).into_iter().map(f16::from_f32).collect();
    let b = rand_vec(rng, n, 1.0);
    let gw = rand_vec(rng, k, 1.0);
    let (gd, pd) = (up(&gw), up(&[1e-5, 1.0]));
    let y0 = rand_vec(rng, tokens * n, 1.0);
    let y = up(&y0);
    let norm = normed.then_some(RowNorm { w: &gd, params: &pd });
    let wd = DeviceArray::from_slice(&client, &wt);
    dense_gemm_normed(&client, d, tokens, &meta, &up(&x), norm, &wd, &up(&b), &y).unwrap();
    let mut want = y0.clone();
    let xs = if normed { rms_norm_reference(&x, &gw, 1e-5, 1.0) } else { x.clone() };
    dense_gemm_reference(d, &xs, &wt, &b, &mut want);
    let got = read_f32(&client, &y).unwrap();
    for t in 0..tokens {
        for r in 0..n {
            let scale: f32 =
                (0..k).map(|c| (xs[t * k + c] * wt[r * k + c].to_f32()).abs()).sum::<f32>() + b[r].abs();
            let (g, w) = (got[t * n + r], want[t * n + r]);
            assert!(
                (g - w).abs() <= DENSE_MMA_RTOL * scale,
                "{what} {n}x{k}, {tokens} tokens, normed {normed}, bias {}: [{t}, {r}] {g} vs {w}",
                d.bias
            );
        }
    }
}

/// The large-step matmul ([`MmaMode::Matmul`]): `x` rounded to f16 after its norm (relative
/// error ≤ 2⁻¹¹ per element), f32 accumulation: within [`DENSE_MMA_RTOL`] of the reference,
/// plain and normed, direct and with bias and residual add, at odd sizes. Lavapipe has no
/// matrix units, so CubeK's unit kernel runs here; the matrix-unit kernels are checked by
/// `pw-bench bench-kernels --check` on the GPU.
#[test]
fn dense_matmul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(307);
    for (n, k, tokens) in [(72usize, 96usize, 5usize), (40, 160, 33)] {
        for (normed, bias, accumulate) in [(false, false, false), (true, true, true), (false, true, true)] {
            let mma = MmaMode::Matmul(MatmulKernel::Unit);
            let d = DenseGemm { n, k, bias, accumulate, mma, plain_rows: None };
            assert_within_rtol(&mut rng, d, tokens, normed, "dense matmul");
        }
    }
}
