//! Tests of the module's kernels against their CPU references on random inputs (wgpu:
//! Mesa lavapipe in CI, plane size 8, 32 KiB of shared memory).

use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::testing::{assert_close, client, rand_vec, random_block};
use crate::*;

/// Error budget: |kernel − reference| ≤ GEMM_RTOL · Σ|x·w| per output (f32
/// accumulation in a different order, plus the activation's exp/tanh on the GPU).
const GEMM_RTOL: f32 = 2e-5;

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
    // Every launch of few-token items through the GEMV kernel, whatever its item count.
    let base = GemmConfig { gemv_min_items: 1, ..GemmConfig::for_client(client) };
    // The persistent GEMV takes items of at most 2 tokens unless switched off.
    let few = items.iter().all(|i| i.tokens as usize <= GEMV_HOST_MAX_TOKENS);
    let mut cfgs = vec![base, GemmConfig { warps: 2, rows_per_warp: 3, gemv: false, ..base }];
    if few {
        cfgs.push(GemmConfig { gemv: false, ..base });
    }
    for cfg in cfgs {
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

/// The GPU's build of the persistent GEMV (inner loops unrolled, constant shifts), which the
/// CI device otherwise compiles compactly, a small-cube compact build, and the build that loads
/// plane words a step ahead: two tokens, mixed widths in one launch.
#[test]
fn gemv_unrolled_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(12);
    let mut pool = PoolImage::default();
    let cols = 600; // several GEMV steps of plane words per row
    let a = pool.push(&random_block(&mut rng, 21, cols), 3);
    let b = pool.push(&random_block(&mut rng, 40, cols), 8);
    let items = [a.item(0, 0, 2), b.item(2 * cols as u32, 2 * 21, 1)];
    let x: Vec<f32> = (0..3 * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let y_len = 2 * 21 + 40;
    let planes = DeviceArray::from_slice(&client, &pool.planes);
    let luts = DeviceArray::from_slice(&client, &pool.luts);
    let desc = upload_items(&client, &items);
    let xd = DeviceArray::from_slice(&client, &x);
    let mut want = vec![f32::NAN; y_len];
    ap_gemm_reference(&pool, &items, &x, &mut want, Activation::None);
    let scale = x.iter().map(|v| v.abs()).sum::<f32>() * 0.5 + 1.0;
    let base = GemmConfig { gemv_min_items: 1, ..GemmConfig::for_client(&client) };
    // The GPU's build, a compact one with two warps and one plane word per lane, and one that
    // loads each step's plane words during the previous step (the 3-bit item; 8 bits ignore it).
    for cfg in [
        GemmConfig { unrolled: true, ..base },
        GemmConfig { unrolled: false, warps: 2, gemv_words_per_lane: 1, ..base },
        GemmConfig { unrolled: false, gemv_words_per_lane: 1, gemv_prefetch: true, ..base },
    ] {
        let yd = DeviceArray::from_slice(&client, &vec![f32::NAN; y_len]);
        ap_gemm(&client, cfg, &planes, &luts, &items, &desc, &xd, &yd, Activation::None).unwrap();
        let got = read_f32(&client, &yd).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= GEMM_RTOL * scale, "{cfg:?}: y[{i}] = {g}, reference {w}");
        }
    }
}

/// The GEMV with `x` staged as f16 (`GemmConfig::gemv_x_half`): equal to the reference on `x`
/// rounded to f16 within the f32 budget, and to the reference on `x` itself within the f16
/// rounding (≤ 2⁻¹¹ of Σ|x·w| more); mixed widths, one and two tokens, an activation.
#[test]
fn gemv_x_half_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(21);
    let mut pool = PoolImage::default();
    let cols = 200;
    let blocks: Vec<_> = [(30usize, 3u8), (17, 4), (40, 6), (9, 8)]
        .into_iter()
        .map(|(rows, bits)| (rows, pool.push(&random_block(&mut rng, rows, cols), bits)))
        .collect();
    for act in [Activation::None, Activation::SiluMul] {
        let x_cols = if act == Activation::None { cols } else { 2 * cols };
        let (mut items, mut x_off, mut y_off) = (Vec::new(), 0u32, 0u32);
        for (i, (rows, slot)) in blocks.iter().enumerate() {
            let tokens = 1 + (i % 2) as u32;
            items.push(slot.item(x_off, y_off, tokens));
            x_off += tokens * x_cols as u32;
            y_off += tokens * *rows as u32;
        }
        let x: Vec<f32> = (0..x_off).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let planes = DeviceArray::from_slice(&client, &pool.planes);
        let luts = DeviceArray::from_slice(&client, &pool.luts);
        let desc = upload_items(&client, &items);
        let xd = DeviceArray::from_slice(&client, &x);
        let yd = DeviceArray::from_slice(&client, &vec![f32::NAN; y_off as usize]);
        let cfg = GemmConfig { gemv_min_items: 1, gemv_x_half: true, ..GemmConfig::for_client(&client) };
        ap_gemm(&client, cfg, &planes, &luts, &items, &desc, &xd, &yd, act).unwrap();
        let got = read_f32(&client, &yd).unwrap();
        // The staged input is act(x) rounded to f16: the reference on that input.
        let staged: Vec<f32> = if act == Activation::None {
            x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect()
        } else {
            x.chunks(x_cols)
                .flat_map(|r| {
                    (0..cols).map(move |c| {
                        half::f16::from_f32(r[c] / (1.0 + (-r[c]).exp()) * r[cols + c]).to_f32()
                    })
                })
                .collect()
        };
        let staged_items: Vec<WorkItem> = items
            .iter()
            .map(|it| WorkItem { x_off: it.x_off / x_cols as u32 * cols as u32, ..*it })
            .collect();
        let mut want_half = vec![f32::NAN; y_off as usize];
        ap_gemm_reference(&pool, &staged_items, &staged, &mut want_half, Activation::None);
        let mut want = vec![f32::NAN; y_off as usize];
        ap_gemm_reference(&pool, &items, &x, &mut want, act);
        for (it, st) in items.iter().zip(&staged_items) {
            let rows = it.rows as usize;
            for t in 0..it.tokens as usize {
                let xs = &staged[st.x_off as usize + t * cols..][..cols];
                // Σ|x·w| bound: |w| ≤ 0.5.
                let scale = xs.iter().map(|v| v.abs()).sum::<f32>() * 0.5 + 1.0;
                for r in 0..rows {
                    let i = it.y_off as usize + t * rows + r;
                    let (g, h, w) = (got[i], want_half[i], want[i]);
                    assert!(
                        (g - h).abs() <= GEMM_RTOL * scale,
                        "{act:?} y[{i}] = {g}, reference on f16 x {h}"
                    );
                    let half_budget = (GEMM_RTOL + 1.0 / 2048.0) * scale;
                    assert!((g - w).abs() <= half_budget, "{act:?} y[{i}] = {g}, reference {w}");
                }
            }
        }
        // The f16 staging is what ran: some output differs from the f32-staged kernel's.
        let y32 = DeviceArray::from_slice(&client, &vec![f32::NAN; y_off as usize]);
        let cfg32 = GemmConfig { gemv_x_half: false, ..cfg };
        ap_gemm(&client, cfg32, &planes, &luts, &items, &desc, &xd, &y32, act).unwrap();
        let got32 = read_f32(&client, &y32).unwrap();
        assert!(got.iter().zip(&got32).any(|(a, b)| a != b), "{act:?}: f16 staging changed nothing");
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
    // More LUT rows per cube than the kernels' 14-bit LUT bases address.
    let item = slot.item(0, 0, 1);
    let desc = upload_items(&client, &[item]);
    let big = GemmConfig { warps: 16, rows_per_warp: 8, ..cfg };
    let e = ap_gemm(&client, big, &planes, &luts, &[item], &desc, &x, &y, Activation::None).unwrap_err();
    assert!(e.to_string().contains("at most 64 rows per cube"), "{e}");
}

/// A routed MoE layer: two chained GEMMs (the second over SiLU(gate)·up of the first) and a
/// weighted sum, each in f32 in another order than the CPU.
const MOE_TOL: f32 = 1e-4;

/// The same down GEMV over an activation applied by `gated_act` against one applied while
/// staging: the same f32 formula, evaluated by two kernels (the compiler may contract it
/// differently).
const FUSED_ACT_TOL: f32 = 1e-6;

/// A whole MoE layer's expert work on the device (route → gather → gate_up → down with SiLU·up →
/// combine) against the CPU: routing reference, then the grouped GEMM reference per expert.
#[test]
fn routed_moe_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(7);
    // Six experts, and two experts that both get every token (16 > ROUTE_CHUNK: split items),
    // the latter also in items of four tokens (a larger GEMV bucket).
    for (shape, chunk) in [
        (MoeShape { experts: 6, k: 2, renormalize: true, hidden: 64, inter: 48 }, ROUTE_CHUNK),
        (MoeShape { experts: 2, k: 2, renormalize: false, hidden: 64, inter: 48 }, ROUTE_CHUNK),
        (MoeShape { experts: 2, k: 2, renormalize: false, hidden: 64, inter: 48 }, 4),
    ] {
        check_routed_moe(&client, &mut rng, shape, chunk);
    }
}

fn check_routed_moe(client: &ComputeClient<WgpuRuntime>, rng: &mut StdRng, shape: MoeShape, chunk: usize) {
    let (h, i) = (shape.hidden, shape.inter);
    let mut pool = PoolImage::default();
    let slots: Vec<(PoolSlot, PoolSlot)> = (0..shape.experts)
        .map(|e| {
            let gu = pool.push(&random_block(rng, 2 * i, h), 3 + (e % 6) as u8);
            let dn = pool.push(&random_block(rng, h, i), 8 - (e % 6) as u8);
            (gu, dn)
        })
        .collect();
    let planes = DeviceArray::from_slice(client, &pool.planes);
    let luts = DeviceArray::from_slice(client, &pool.luts);
    let slot_words = DeviceArray::from_slice(client, &expert_slot_words(shape, &slots).unwrap());
    // The routed launches through the GEMV kernel (few items here; at most `chunk` tokens
    // each, so every token count takes it).
    let cfg = GemmConfig { gemv_min_items: 1, ..GemmConfig::for_client(client) };
    // Room for steps of more than MAX_TOKENS tokens (routed in a cube of their own).
    let bufs = RouteBuffers::with_capacity(client, shape, chunk, 40).unwrap();
    assert!(RouteBuffers::with_chunk(client, shape, 3).is_err(), "a chunk of 3 tokens");
    for tokens in [1usize, 2, 5, 16, 40] {
        let meta = DeviceArray::from_slice(client, &[tokens as u32]);
        let x = rand_vec(rng, tokens * h, 1.0);
        let logits = rand_vec(rng, tokens * shape.experts, 3.0);
        let hres = rand_vec(rng, tokens * h, 1.0);
        let (xd, hd) = (DeviceArray::from_slice(client, &x), DeviceArray::from_slice(client, &hres));
        let xg = DeviceArray::empty::<WgpuRuntime, f32>(client, tokens * shape.k * h);
        let gu = DeviceArray::empty::<WgpuRuntime, f32>(client, tokens * shape.k * 2 * i);
        let dn = DeviceArray::empty::<WgpuRuntime, f32>(client, tokens * shape.k * h);
        moe_route(
            client,
            shape,
            tokens,
            &meta,
            &DeviceArray::from_slice(client, &logits),
            &slot_words,
            &bufs,
        )
        .unwrap();
        gather_rows(client, tokens, shape.k, h, &meta, &xd, &bufs.gather, &xg).unwrap();
        ap_gemm_routed(
            client,
            cfg,
            &planes,
            &luts,
            &bufs.desc_gate_up,
            chunk,
            shape.experts,
            2 * i,
            h,
            tokens,
            &xg,
            &gu,
            Activation::None,
        )
        .unwrap();
        // The down GEMV applying SiLU·up while staging its input, and over rows whose gate half
        // a `gated_act` launch already turned into SiLU(gate)·up (`Activation::Applied`).
        let rows = tokens * shape.k;
        let (dn2, act_rows) = (
            DeviceArray::empty::<WgpuRuntime, f32>(client, rows * h),
            DeviceArray::empty::<WgpuRuntime, f32>(client, rows * 2 * i),
        );
        let silu = GatedInput { act: Activation::SiluMul, stride: 2 * i, gated: false };
        gated_act(client, rows, i, silu, &gu, (&act_rows, 2 * i)).unwrap();
        for (input, act, out) in [(&gu, Activation::SiluMul, &dn), (&act_rows, Activation::Applied, &dn2)] {
            let (e, desc) = (shape.experts, &bufs.desc_down);
            ap_gemm_routed(client, cfg, &planes, &luts, desc, chunk, e, h, i, tokens, input, out, act)
                .unwrap();
        }
        assert_close(
            &read_f32(client, &dn2).unwrap()[..rows * h],
            &read_f32(client, &dn).unwrap()[..rows * h],
            FUSED_ACT_TOL,
            &format!("down over applied rows, {tokens} tokens"),
        );
        // The gate_up GEMV with the activation in its epilogue (at most GATED_MAX_TOKENS tokens
        // per item) writes the gate halves that `gated_act` writes, bit for bit (the same row
        // sums, the same activation code).
        for act in [Activation::SiluMul, Activation::GeluTanhMul] {
            let (fused, split) = (
                DeviceArray::empty::<WgpuRuntime, f32>(client, rows * 2 * i),
                DeviceArray::empty::<WgpuRuntime, f32>(client, rows * 2 * i),
            );
            let (e, desc) = (shape.experts, &bufs.desc_gate_up);
            let gated = |y| {
                ap_gemm_routed_gated(
                    client,
                    cfg,
                    &planes,
                    &luts,
                    desc,
                    chunk,
                    e,
                    2 * i,
                    h,
                    tokens,
                    &xg,
                    y,
                    act,
                )
            };
            let launched = gated(&fused).unwrap();
            assert_eq!(launched, tokens.min(chunk) <= GATED_MAX_TOKENS, "gated GEMV at {tokens} tokens");
            if !launched {
                continue;
            }
            let a = GatedInput { act, stride: 2 * i, gated: false };
            gated_act(client, rows, i, a, &gu, (&split, 2 * i)).unwrap();
            let (f, w) = (read_f32(client, &fused).unwrap(), read_f32(client, &split).unwrap());
            for r in 0..rows {
                assert_eq!(
                    f[r * 2 * i..][..i],
                    w[r * 2 * i..][..i],
                    "{act:?} epilogue, row {r}, {tokens} tokens"
                );
            }
        }
        check_grouped_routing(client, shape, &bufs, (&planes, &luts, &slot_words), rows, &xg, &dn);
        moe_combine(client, tokens, shape.k, h, &dn, &bufs.pos, &bufs.weights, &hd).unwrap();

        let (sel, wts) = route_reference(shape, &logits);
        assert_close(
            &read_f32(client, &bufs.weights).unwrap()[..tokens * shape.k],
            &wts,
            1e-6,
            "route weights",
        );
        let mut want = hres.clone();
        for t in 0..tokens {
            for j in 0..shape.k {
                let (gs, ds) = slots[sel[t * shape.k + j] as usize];
                let mut g = vec![0f32; 2 * i];
                ap_gemm_reference(&pool, &[gs.item(0, 0, 1)], &x[t * h..][..h], &mut g, Activation::None);
                let mut d = vec![0f32; h];
                ap_gemm_reference(&pool, &[ds.item(0, 0, 1)], &g, &mut d, Activation::SiluMul);
                for c in 0..h {
                    want[t * h + c] += wts[t * shape.k + j] * d[c];
                }
            }
        }
        assert_close(&read_f32(client, &hd).unwrap(), &want, MOE_TOL, &format!("moe layer, {tokens} tokens"));
    }
}

/// The grouped GEMMs over the routing's groups table (gate_up with SiLU·up in its epilogue, then
/// down) give the routed GEMVs' down rows `dn`.
fn check_grouped_routing(
    client: &ComputeClient<WgpuRuntime>,
    shape: MoeShape,
    bufs: &RouteBuffers,
    (planes, luts, slots): (&DeviceArray, &DeviceArray, &DeviceArray),
    rows: usize,
    xg: &DeviceArray,
    dn: &DeviceArray,
) {
    let (h, i, e) = (shape.hidden, shape.inter, shape.experts);
    let act = DeviceArray::empty::<WgpuRuntime, f32>(client, rows * i);
    let out = DeviceArray::empty::<WgpuRuntime, f32>(client, rows * h);
    let (gu, down) = GroupedGemm::layer(e, h, i, Activation::SiluMul);
    for (g, x, y) in [(gu, xg, &act), (down, &act, &out)] {
        ap_gemm_grouped(client, g, true, planes, luts, slots, &bufs.groups, rows, 2, x, y).unwrap();
    }
    assert_close(
        &read_f32(client, &out).unwrap()[..rows * h],
        &read_f32(client, dn).unwrap()[..rows * h],
        MOE_TOL,
        &format!("grouped down rows, {rows} rows"),
    );
}

/// The grouped MMA kernel's input: `x` rounded to f16 in B-fragment order, exactly as the
/// reference orders and rounds it, rows of a wider stride, a last word of 16 columns (zeros
/// after them), whole words and two steps of four words, the second partial.
#[test]
fn grouped_x_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(27);
    for (rows, k, stride) in [(5usize, 48usize, 52usize), (3, 64, 64), (2, 200, 200)] {
        let x = rand_vec(&mut rng, rows * stride, 3.0);
        let xp = grouped_x_f16(&client, rows, k, stride, &DeviceArray::from_slice(&client, &x)).unwrap();
        let got = half::f16::from_bytes(&client.read_one(xp.handle.clone()).unwrap())[..xp.len].to_vec();
        assert_eq!(got, grouped_x_reference(&x, rows, k, stride), "{rows} rows of {k} (stride {stride})");
    }
    let x = DeviceArray::from_slice(&client, &[0.0f32; 8]);
    assert!(grouped_x_f16(&client, 2, 8, 4, &x).is_err(), "a stride below the columns");
}

/// The grouped GEMM against its reference: experts of bit-widths 3..8 in one launch, experts
/// with no tokens, one token, odd counts and 300 tokens, the gated gate_up epilogue (SiLU and
/// GELU), the plain gate_up and a down launch reading rows of a wider stride over 48 columns
/// (a last plane word of 16).
#[test]
fn grouped_gemm_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(26);
    let (h, i) = (64usize, 48usize);
    let shape = MoeShape { experts: 6, k: 2, renormalize: true, hidden: h, inter: i };
    let counts = [3u32, 0, 1, 17, 300, 6];
    let bits = [3u8, 8, 4, 5, 6, 7];
    let mut pool = PoolImage::default();
    let slots: Vec<_> = bits
        .iter()
        .map(|&b| {
            (pool.push(&random_block(&mut rng, 2 * i, h), b), pool.push(&random_block(&mut rng, h, i), b))
        })
        .collect();
    let slot_words = expert_slot_words(shape, &slots).unwrap();
    let mut groups = Vec::new();
    let mut rows = 0u32;
    for &c in &counts {
        groups.extend([rows, c]);
        rows += c;
    }
    let rows = rows as usize;
    let planes = DeviceArray::from_slice(&client, &pool.planes);
    let luts = DeviceArray::from_slice(&client, &pool.luts);
    let slots_d = DeviceArray::from_slice(&client, &slot_words);
    let groups_d = DeviceArray::from_slice(&client, &groups);
    let cases = [
        (ExpertBlock::GateUp, 2 * i, h, h, Activation::SiluMul, i + 3),
        (ExpertBlock::GateUp, 2 * i, h, h + 4, Activation::GeluTanhMul, i),
        (ExpertBlock::GateUp, 2 * i, h, h, Activation::None, 2 * i),
        (ExpertBlock::Down, h, i, 2 * i, Activation::None, h),
    ];
    for (block, n, k, x_stride, epilogue, y_stride) in cases {
        let g = GroupedGemm { experts: shape.experts, rows: n, cols: k, block, x_stride, y_stride, epilogue };
        let x = rand_vec(&mut rng, rows * x_stride, 1.0);
        let xd = DeviceArray::from_slice(&client, &x);
        let yd = DeviceArray::from_slice(&client, &vec![f32::NAN; rows * y_stride]);
        let mut want = vec![f32::NAN; rows * y_stride];
        ap_gemm_grouped_reference(g, &pool.planes, &pool.luts, &slot_words, &groups, &x, &mut want);
        ap_gemm_grouped(&client, g, true, &planes, &luts, &slots_d, &groups_d, rows, 8, &xd, &yd).unwrap();
        let got = read_f32(&client, &yd).unwrap();
        let scale = k as f32 * 0.5;
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            if b.is_nan() {
                assert!(a.is_nan(), "{g:?}: y[{j}] written outside the output columns");
                continue;
            }
            let budget = GEMM_RTOL * scale * if epilogue == Activation::None { 1.0 } else { scale };
            assert!((a - b).abs() <= budget, "{g:?}: y[{j}] = {a}, reference {b}");
        }
    }
    let bad = GroupedGemm {
        experts: 6,
        rows: 2 * i,
        cols: h,
        block: ExpertBlock::Down,
        x_stride: h,
        y_stride: i,
        epilogue: Activation::SiluMul,
    };
    let e =
        ap_gemm_grouped(&client, bad, true, &planes, &luts, &slots_d, &groups_d, rows, 8, &planes, &planes);
    assert!(e.is_err(), "a gated epilogue on the down block is refused");
}
