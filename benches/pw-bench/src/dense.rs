//! `bench-kernels` section of the dense f16 GEMMs of a decode step (projections, dense MLPs,
//! LM heads): the matrix-unit kernel against the plain one at 1 to 16 tokens, checked
//! against the CPU reference first (up to 93 tokens: several token tiles).

use anyhow::{Result, bail};
use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{
    DenseGemm, DeviceArray, MatmulKernel, MmaMode, MmaTuning, RowNorm, dense_gemm_normed,
    dense_gemm_normed_reference, dense_gemm_reference, dense_mma_supported, rms_norm_reference,
};
use serde_json::{Value, json};

use crate::kernels::time_batches;

/// Dense shapes `(model, matrix, n, k)` of the three models (DESIGN.md section 3).
const DENSE_SHAPES: [(&str, &str, usize, usize); 10] = [
    ("mixtral", "qkv", 6144, 4096),
    ("mixtral", "o_proj", 4096, 4096),
    ("mixtral", "lm_head", 32000, 4096),
    ("qwen2_moe", "qkv", 6144, 2048),
    ("qwen2_moe", "shared_gate_up", 11264, 2048),
    ("qwen2_moe", "shared_down", 2048, 5632),
    ("gemma4", "qkv", 8192, 2816),
    ("gemma4", "mlp_gate_up", 4224, 2816),
    ("gemma4", "mlp_down", 2816, 2112),
    ("gemma4", "lm_head", 262144, 2816),
];

/// Error budget of `--check`: `|kernel − reference| ≤ DENSE_RTOL · Σ|x·w|` per output. The
/// matrix units read `x` rounded to TF32 (relative error ≤ 2⁻¹¹ per element).
pub(crate) const DENSE_RTOL: f32 = 1e-3;

/// Worst `|got − want| / Σ|x·w|` over the outputs (`scale[t · n + r] = Σ|x·w|`); a NaN
/// counts as infinite.
fn rel_err(got: &[f32], want: &[f32], scale: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((g, w), s)| {
            let e = (g - w).abs() / s.max(1e-30);
            if e.is_nan() { f32::INFINITY } else { e }
        })
        .fold(0.0, f32::max)
}

/// Random f16 weights, f32 inputs of varied magnitude per token, and `Σ|x·w|` per output.
fn random_case(n: usize, k: usize, tokens: usize, seed: u64) -> (Vec<f16>, Vec<f32>, Vec<f32>) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let w: Vec<f16> = (0..n * k).map(|_| f16::from_f32(0.05 * next())).collect();
    let x: Vec<f32> = (0..tokens * k).map(|i| next() * (1 + 30 * (i / k)) as f32).collect();
    let scale = abs_dot(&w, &x, n, k, tokens);
    (w, x, scale)
}

/// `Σ|x·w|` per output `[tokens, n]`.
fn abs_dot(w: &[f16], x: &[f32], n: usize, k: usize, tokens: usize) -> Vec<f32> {
    let mut scale = vec![0.0f32; tokens * n];
    for t in 0..tokens {
        for r in 0..n {
            scale[t * n + r] =
                w[r * k..][..k].iter().zip(&x[t * k..][..k]).map(|(a, b)| (a.to_f32() * b).abs()).sum();
        }
    }
    scale
}

/// Checks the kernels on one shape (plain and normed input, bias, residual add); fails past
/// [`DENSE_RTOL`]. Returns the worst relative error of the plain kernel, the skinny matrix-unit
/// kernel and CubeK's `matmuls` (those that launch on the device), and the names of the
/// `matmuls` that do not.
pub(crate) fn check_dense<R: Runtime>(
    client: &ComputeClient<R>,
    n: usize,
    k: usize,
    tokens: usize,
    matmuls: &[MatmulKernel],
) -> Result<([f32; 3], Vec<&'static str>)> {
    let (w, x, scale) = random_case(n, k, tokens, (n * 7 + k * 3 + tokens) as u64);
    let bias: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.1).collect();
    let y0: Vec<f32> = (0..tokens * n).map(|i| (i % 5) as f32).collect();
    let gw: Vec<f32> = (0..k).map(|i| 0.5 + (i % 3) as f32 * 0.25).collect();
    let up = |v: &[f32]| DeviceArray::from_slice(client, v);
    let (wd, xd, bd, gd, pd) =
        (DeviceArray::from_slice(client, &w), up(&x), up(&bias), up(&gw), up(&[1e-6, 1.0]));
    let meta = DeviceArray::from_slice(client, &[tokens as u32]);
    let mut worst = [0.0f32; 3];
    let mut failed = Vec::new();
    let always = MmaMode::Always(MmaTuning::default());
    let wide = |wide_groups| MmaMode::Always(MmaTuning { wide_groups, ..MmaTuning::default() });
    // The matrix units' slot: the worst of the default tiles and of tiles of 3 and 8 fragments
    // (the same as the default up to 16 tokens); the matmul's: every kernel.
    let mut runs = vec![(0usize, MmaMode::Off), (1, always), (1, wide(3)), (1, wide(8))];
    runs.extend(matmuls.iter().map(|&m| (2, MmaMode::Matmul(m))));
    for (slot, mma) in runs {
        for normed in [false, true] {
            let g = DenseGemm { n, k, bias: true, accumulate: true, mma, plain_rows: None };
            let y = up(&y0);
            let norm = normed.then_some(RowNorm { w: &gd, params: &pd });
            let launched = dense_gemm_normed(client, g, tokens, &meta, &xd, norm, &wd, &bd, &y);
            let got = launched.and_then(|_| kernels_cubecl::read_f32(client, &y));
            let got = match (got, mma) {
                (Ok(got), _) => got,
                (Err(e), MmaMode::Matmul(m)) => {
                    eprintln!("dense matmul {} does not run here: {e}", m.name());
                    failed.push(m.name());
                    break;
                }
                (Err(e), _) => return Err(e.into()),
            };
            let mut want = y0.clone();
            let sc = if normed {
                dense_gemm_normed_reference(g, &x, &gw, 1e-6, 1.0, &w, &bias, &mut want);
                // Σ|x̂·w| of the normed rows x̂.
                let xs = rms_norm_reference(&x, &gw, 1e-6, 1.0);
                abs_dot(&w, &xs, n, k, tokens)
            } else {
                dense_gemm_reference(g, &x, &w, &bias, &mut want);
                scale.clone()
            };
            let err = rel_err(&got, &want, &sc);
            if err > DENSE_RTOL {
                bail!(
                    "dense GEMM {n}x{k}, {tokens} tokens, {mma:?}, normed {normed}: relative error {err:.2e} > {DENSE_RTOL:.0e}"
                );
            }
            worst[slot] = worst[slot].max(err);
        }
    }
    Ok((worst, failed))
}

/// Launch shapes of the matrix-unit kernel compared at 8 tokens (name, unroll, pipeline, x
/// loaded with the round's weights, warps per SM); the first is the default.
const TUNINGS: [(&str, usize, bool, bool, usize); 5] = [
    ("u4", 4, false, true, 16),
    ("u4w", 4, false, true, 32),
    ("u8w", 8, false, true, 32),
    ("u2pw", 2, true, true, 32),
    ("u2p", 2, true, true, 16),
];

/// Times the dense GEMMs of [`DENSE_SHAPES`] (of `--models`, all when empty) at `--dense-tokens`
/// (default 1 to 2048, to 16 with `--quick`; LM heads to 256) on the plain kernel (to 16
/// tokens), on the matrix units (default launch shape; the others of [`TUNINGS`] at 8 tokens,
/// tiles of 4 and 8 fragments past 16 tokens) and, from 64 tokens, on the CubeK matmul kernels
/// `matmuls`, weights rotated through `--rotate-bytes` of copies, after checking the kernels
/// with `--check`. Records: `kernel` `dense_f16` / `dense_f16_mma` / `dense_f16_matmul`,
/// `effective_gbps` = weight bytes / time, against `hbm` (GB/s), `tflops`.
pub(crate) fn dense_records<R: Runtime>(
    client: &ComputeClient<R>,
    a: &crate::kernels::BenchKernelsArgs,
    hbm: f64,
    matmuls: &[MatmulKernel],
) -> Result<Vec<Value>> {
    let (rotate_bytes, launches, check, quick) = (a.rotate_bytes, a.launches, a.check, a.quick);
    let dense_tokens = a.dense_tokens.as_slice();
    let mut records = Vec::new();
    let mma_ok = dense_mma_supported(client);
    eprintln!("dense GEMM on the matrix units: {}", if mma_ok { "supported" } else { "not supported" });
    if check {
        for (n, k, t) in [
            (70usize, 96usize, 1usize),
            (33, 2048, 3),
            (100, 4096, 8),
            (257, 1024, 16),
            (300, 2048, 93),
            (200, 1024, 301),
        ] {
            // CubeK's kernels compile per shape: checked on the shapes past a token tile.
            let run = if t > 16 { matmuls } else { &[] };
            let ([plain, mma, matmul], failed) = check_dense(client, n, k, t, run)?;
            // No matmul checked on this shape: no figure.
            let matmul = (!run.is_empty()).then_some(matmul);
            eprintln!(
                "check {n}x{k} {t} tokens: relative error plain {plain:.1e}, mma {mma:.1e}, matmul {matmul:?} (not run: {failed:?})"
            );
            records.push(json!({"check": "dense_gemm", "n": n, "k": k, "tokens": t,
                "rel_err_plain": plain, "rel_err_mma": mma, "rel_err_matmul": matmul, "matmul_not_run": failed,
                "mma_supported": mma_ok, "budget": DENSE_RTOL}));
        }
    }
    let shapes: &[_] = if quick { &DENSE_SHAPES[3..4] } else { &DENSE_SHAPES };
    for &(model, matrix, n, k) in shapes.iter().filter(|s| a.wants(s.0)) {
        let bytes = n * k * 2;
        let copies = (rotate_bytes / bytes).clamp(2, 64);
        let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32(((i % 13) as f32 - 6.0) * 0.01)).collect();
        let ws: Vec<DeviceArray> = (0..copies).map(|_| DeviceArray::from_slice(client, &w)).collect();
        let token_list: &[usize] = match (dense_tokens, quick) {
            ([], true) => &[1, 2, 4, 8, 16],
            ([], false) => &[1, 2, 4, 8, 16, 64, 256, 1024, 2048],
            (list, _) => list,
        };
        // A prompt's LM head reads its last rows only (at most a logits buffer of 256).
        let head = matrix == "lm_head";
        for &tokens in token_list.iter().filter(|&&t| !head || t <= 256) {
            let x = DeviceArray::from_slice(client, &vec![0.01f32; tokens * k]);
            let y = DeviceArray::empty::<R, f32>(client, tokens * n);
            let meta = DeviceArray::from_slice(client, &[tokens as u32]);
            let gw = DeviceArray::from_slice(client, &vec![1.0f32; k]);
            let gp = DeviceArray::from_slice(client, &[1e-6f32, 0.0]);
            // The plain kernel multiplies per token on the ALUs: past 16 tokens it only takes time.
            let mut runs: Vec<(&str, MmaMode)> = Vec::new();
            if tokens <= 16 {
                runs.push(("plain", MmaMode::Off));
            }
            if tokens <= 2 {
                // The step's projections and LM heads read a normed input.
                runs.push(("plain-normed", MmaMode::Off));
            }
            for &(name, unroll, pipeline, x_ahead, warps_per_sm) in &TUNINGS {
                if name == TUNINGS[0].0 || tokens == 8 {
                    let t = MmaTuning { unroll, pipeline, x_ahead, warps_per_sm, ..MmaTuning::default() };
                    runs.push((name, MmaMode::Always(t)));
                }
            }
            if tokens > 16 {
                for (name, wide_groups) in [("wide4", 4), ("wide8", 8)] {
                    runs.push((name, MmaMode::Always(MmaTuning { wide_groups, ..MmaTuning::default() })));
                }
            }
            if tokens >= 64 {
                for &m in matmuls {
                    runs.push((m.name(), MmaMode::Matmul(m)));
                }
            }
            let mut plain = 0.0;
            for (name, mode) in runs {
                let g = DenseGemm { n, k, bias: false, accumulate: false, mma: mode, plain_rows: None };
                let norm = (name == "plain-normed").then_some(RowNorm { w: &gw, params: &gp });
                if let MmaMode::Matmul(m) = mode {
                    let first = dense_gemm_normed(client, g, tokens, &meta, &x, norm, &ws[0], &x, &y)
                        .and_then(|_| kernels_cubecl::sync(client));
                    if let Err(e) = first {
                        eprintln!("dense matmul {} {matrix} t{tokens}: does not run: {e}", m.name());
                        continue;
                    }
                }
                let secs = time_batches(client, launches, |i| {
                    dense_gemm_normed(client, g, tokens, &meta, &x, norm, &ws[i % copies], &x, &y).unwrap()
                })?
                .device;
                if name == "plain" {
                    plain = secs;
                }
                let rec = json!({
                    "kernel": match mode {
                        MmaMode::Off => "dense_f16",
                        MmaMode::Matmul(_) => "dense_f16_matmul",
                        _ => "dense_f16_mma",
                    },
                    "variant": name, "tflops": 2.0 * (n * k * tokens) as f64 / secs / 1e12,
                    "model": model, "shape": format!("{matrix} {n}x{k}"), "tokens": tokens, "time_us": secs * 1e6,
                    "effective_gbps": bytes as f64 / secs / 1e9, "hbm_read_gbps": hbm,
                    "speedup_over_plain": (plain > 0.0).then(|| plain / secs), "mma_supported": mma_ok,
                });
                eprintln!("{rec}");
                records.push(rec);
            }
        }
    }
    Ok(records)
}
