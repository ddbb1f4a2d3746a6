//! Kernels against their CPU references on random inputs, on the wgpu runtime
//! (Mesa lavapipe in CI: plane size 8, 32 KiB of shared memory).

use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use kernels_cubecl::*;
use pw_format::ApBlock;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Error budget: |kernel − reference| ≤ GEMM_RTOL · Σ|x·w| per output (f32
/// accumulation in a different order, plus the activation's exp/tanh on the GPU).
const GEMM_RTOL: f32 = 2e-5;

fn client() -> ComputeClient<WgpuRuntime> {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: set once before any thread reads the environment.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    WgpuRuntime::client(&WgpuDevice::DefaultDevice)
}

fn random_block(rng: &mut StdRng, rows: usize, cols: usize) -> ApBlock {
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    ApBlock::quantize("t", &w, None, rows, cols, 3, 8).unwrap()
}

/// Runs `items` on the device and on the CPU and compares every output.
fn check(
    client: &ComputeClient<WgpuRuntime>,
    pool: &PoolImage,
    items: &[WorkItem],
    x: &[f32],
    y_len: usize,
    act: Activation,
    what: &str,
) {
    let planes = DeviceArray::from_slice(client, &pool.planes);
    let luts = DeviceArray::from_slice(client, &pool.luts);
    let desc = upload_items(client, items);
    let xd = DeviceArray::from_slice(client, x);
    let yd = DeviceArray::from_slice(client, &vec![f32::NAN; y_len]);
    let mut want = vec![f32::NAN; y_len];
    ap_gemm_reference(pool, items, x, &mut want, act);
    // The device's own configuration, and several rows per warp (the GPU's).
    let base = GemmConfig::for_client(client);
    for cfg in [base, GemmConfig { warps: 2, rows_per_warp: 3, ..base }] {
        ap_gemm(client, cfg, &planes, &luts, items, &desc, &xd, &yd, act).unwrap();
        let got = read_f32(client, &yd).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if w.is_nan() {
                assert!(g.is_nan(), "{what}: y[{i}] written but no item covers it");
                continue;
            }
            // Budget scale: the reference's magnitude bound, Σ|x|·max|w| (w ≤ 0.5).
            let scale = x.iter().map(|v| v.abs()).sum::<f32>() * 0.5 + 1.0;
            assert!((g - w).abs() <= GEMM_RTOL * scale, "{what} {cfg:?}: y[{i}] = {g}, reference {w}");
        }
    }
}

#[test]
fn gemv_and_skinny_gemm_match_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(1);
    for (rows, cols) in [(37usize, 100usize), (64, 256), (9, 333), (130, 64)] {
        let block = random_block(&mut rng, rows, cols);
        for bits in 3..=8u8 {
            let mut pool = PoolImage::default();
            let slot = pool.push(&block, bits);
            for tokens in [1usize, 3, 8, 16] {
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let item = slot.item(0, 0, tokens as u32);
                check(
                    &client,
                    &pool,
                    &[item],
                    &x,
                    tokens * rows,
                    Activation::None,
                    &format!("{rows}x{cols} b{bits} t{tokens}"),
                );
            }
        }
        // The reference itself agrees with the format crate's.
        let mut pool = PoolImage::default();
        let slot = pool.push(&block, 5);
        let x: Vec<f32> = (0..2 * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut y = vec![0f32; 2 * rows];
        ap_gemm_reference(&pool, &[slot.item(0, 0, 2)], &x, &mut y, Activation::None);
        let want = block.matmul_reference(5, &x, 2);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

#[test]
fn grouped_mixed_bits_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(2);
    let mut pool = PoolImage::default();
    let cols = 96;
    let mut items = Vec::new();
    let (mut x_off, mut y_off) = (0u32, 0u32);
    // Experts of different heights and committed widths, 0..16 tokens each.
    for (e, (rows, bits, tokens)) in
        [(48usize, 3u8, 5u32), (48, 8, 1), (33, 4, 0), (48, 6, 16), (20, 5, 2), (48, 7, 3)]
            .into_iter()
            .enumerate()
    {
        let block = random_block(&mut rng, rows, cols);
        let slot = pool.push(&block, bits);
        items.push(slot.item(x_off, y_off, tokens));
        x_off += tokens * cols as u32;
        y_off += tokens * rows as u32;
        let _ = e;
    }
    let x: Vec<f32> = (0..x_off).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    check(&client, &pool, &items, &x, y_off as usize, Activation::None, "grouped");
}

#[test]
fn fused_activation_down_projection_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, inter) = (40usize, 72usize);
    for act in [Activation::SiluMul, Activation::GeluTanhMul] {
        let mut pool = PoolImage::default();
        let a = pool.push(&random_block(&mut rng, rows, inter), 4);
        let b = pool.push(&random_block(&mut rng, rows, inter), 7);
        let (ta, tb) = (3u32, 6u32);
        let items = [a.item(0, 0, ta), b.item(ta * 2 * inter as u32, ta * rows as u32, tb)];
        let x: Vec<f32> =
            (0..(ta + tb) as usize * 2 * inter).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        check(&client, &pool, &items, &x, (ta + tb) as usize * rows, act, &format!("{act:?}"));
    }
}

#[test]
fn many_tokens_split_into_items_match_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols, tokens) = (64usize, 200usize, 70usize);
    let mut pool = PoolImage::default();
    let slot = pool.push(&random_block(&mut rng, rows, cols), 4);
    let items: Vec<WorkItem> = (0..tokens)
        .step_by(MAX_TOKENS)
        .map(|t0| {
            let t = MAX_TOKENS.min(tokens - t0);
            slot.item((t0 * cols) as u32, (t0 * rows) as u32, t as u32)
        })
        .collect();
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    check(&client, &pool, &items, &x, tokens * rows, Activation::None, "70 tokens");
}

#[test]
fn bad_items_are_rejected() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(5);
    let mut pool = PoolImage::default();
    let slot = pool.push(&random_block(&mut rng, 8, 64), 4);
    let cfg = GemmConfig::for_client(&client);
    let planes = DeviceArray::from_slice(&client, &pool.planes);
    let luts = DeviceArray::from_slice(&client, &pool.luts);
    let x = DeviceArray::from_slice(&client, &vec![0f32; 64 * 17]);
    let y = DeviceArray::from_slice(&client, &vec![0f32; 8 * 17]);
    let cases = [
        (WorkItem { bits: 9, ..slot.item(0, 0, 1) }, "bits 9"),
        (slot.item(0, 0, 17), "17 tokens"),
        (WorkItem { bits: 8, ..slot.item(0, 0, 1) }, "planes past the end"),
        (slot.item(64 * 16 + 1, 0, 1), "x needs"),
    ];
    for (item, msg) in cases {
        let desc = upload_items(&client, &[item]);
        let e = ap_gemm(&client, cfg, &planes, &luts, &[item], &desc, &x, &y, Activation::None).unwrap_err();
        assert!(e.to_string().contains(msg), "{e} should mention {msg}");
    }
}

#[test]
fn stream_read_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(6);
    for words in [4usize, 4 * 1000, 4 * 70_001] {
        let data: Vec<u32> = (0..words).map(|_| rng.random()).collect();
        let d = DeviceArray::from_slice(&client, &data);
        let cubes = 3;
        let out = DeviceArray::empty::<WgpuRuntime, u32>(&client, cubes * 256);
        stream_read(&client, &d, &out, cubes as u32);
        let got = read_u32(&client, &out).unwrap().iter().fold(0, |a, b| a ^ b);
        assert_eq!(got, stream_read_reference(&data), "{words} words");
    }
}
