//! Shared test setup: the wgpu client, random inputs and the closeness check.

use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use pw_format::ApBlock;
use rand::Rng;
use rand::rngs::StdRng;

pub(crate) fn client() -> ComputeClient<WgpuRuntime> {
    pw_testkit::wgpu_client()
}

pub(crate) fn random_block(rng: &mut StdRng, rows: usize, cols: usize) -> ApBlock {
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    ApBlock::quantize("t", &w, None, rows, cols, 3, 8).unwrap()
}

pub(crate) fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "{what}: [{i}] = {g}, reference {w}");
    }
}

pub(crate) fn rand_vec(rng: &mut StdRng, n: usize, r: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-r..r)).collect()
}
