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
    // Every launch of few-token items through the GEMV kernel, whatever its item count.
    let base = GemmConfig { gemv_min_items: 1, ..GemmConfig::for_client(client) };
    // The first kernel stays checked (bench-kernels compares against it); the persistent GEMV
    // takes items of at most 2 tokens unless switched off.
    let few = items.iter().all(|i| i.tokens as usize <= GEMV_HOST_MAX_TOKENS);
    let mut cfgs = vec![
        base,
        GemmConfig { warps: 2, rows_per_warp: 3, gemv: false, ..base },
        GemmConfig { specialized: false, ..base },
    ];
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

/// Paged decode attention: f32 accumulation in another order plus the online softmax's
/// rescaling; budget relative to the largest |v| (outputs are convex combinations of V rows).
const ATTN_TOL: f32 = 2e-5;

/// Random paged cache: `lens[s]` tokens per sequence in shuffled blocks, then one decode step
/// (append the new token, attend) on the device against the CPU references.
fn check_paged_attention<KV: Float + CubeElement>(
    shape: PagedAttnShape,
    lens: &[u32],
    to_kv: fn(f32) -> KV,
    from_kv: fn(KV) -> f32,
    what: &str,
) {
    let client = client();
    let mut rng = StdRng::seed_from_u64(11 + lens.len() as u64 + shape.window as u64);
    let (w, bs, seqs) = (shape.slot_width(), shape.block_size, lens.len());
    let pool_blocks = seqs * shape.max_blocks + 3;
    // Hand out blocks in a shuffled order so that no sequence's blocks are contiguous.
    let mut free: Vec<u32> = (0..pool_blocks as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let mut table = vec![0u32; seqs * shape.max_blocks];
    for s in 0..seqs {
        for b in 0..(lens[s] as usize).div_ceil(bs) {
            table[s * shape.max_blocks + b] = free.pop().unwrap();
        }
    }
    let slots = pool_blocks * bs;
    // Pool contents rounded through KV so the reference sees exactly what the device holds.
    let mut kp: Vec<f32> = (0..slots * w).map(|_| from_kv(to_kv(rng.random_range(-1.0f32..1.0)))).collect();
    let mut vp: Vec<f32> = (0..slots * w).map(|_| from_kv(to_kv(rng.random_range(-1.0f32..1.0)))).collect();
    let kd = DeviceArray::from_slice(&client, &kp.iter().map(|&x| to_kv(x)).collect::<Vec<_>>());
    let vd = DeviceArray::from_slice(&client, &vp.iter().map(|&x| to_kv(x)).collect::<Vec<_>>());

    // The new token of each sequence goes to position len - 1.
    let new_slots: Vec<u32> = lens
        .iter()
        .enumerate()
        .map(|(s, &len)| {
            let t = len as usize - 1;
            table[s * shape.max_blocks + t / bs] * bs as u32 + (t % bs) as u32
        })
        .collect();
    let k_new: Vec<f32> = (0..seqs * w).map(|_| from_kv(to_kv(rng.random_range(-1.0f32..1.0)))).collect();
    let v_new: Vec<f32> = (0..seqs * w).map(|_| from_kv(to_kv(rng.random_range(-1.0f32..1.0)))).collect();
    kv_append_reference(shape, &k_new, &v_new, &new_slots, &mut kp, &mut vp);
    let (knd, vnd, sd) = (
        DeviceArray::from_slice(&client, &k_new),
        DeviceArray::from_slice(&client, &v_new),
        DeviceArray::from_slice(&client, &new_slots),
    );
    kv_append::<_, KV>(&client, shape, seqs, &knd, &vnd, &sd, &kd, &vd).unwrap();

    let qn = seqs * shape.n_heads * shape.head_dim;
    let q: Vec<f32> = (0..qn).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let want = paged_decode_attention_reference(shape, scale, &q, &kp, &vp, &table, lens);
    let out = DeviceArray::from_slice(&client, &vec![f32::NAN; qn]);
    let args = [&q[..], &[scale]].map(|a| DeviceArray::from_slice(&client, a));
    let (td, ld) = (DeviceArray::from_slice(&client, &table), DeviceArray::from_slice(&client, lens));
    let max_len = *lens.iter().max().unwrap() as usize;
    paged_decode_attention::<_, KV>(
        &client, shape, seqs, max_len, &args[0], &kd, &vd, &td, &ld, &args[1], &out,
    )
    .unwrap();
    let got = read_f32(&client, &out).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= ATTN_TOL, "{what}: out[{i}] = {g}, reference {w}");
    }
}

fn shape(n_heads: usize, n_kv_heads: usize, head_dim: usize, window: usize) -> PagedAttnShape {
    PagedAttnShape { n_heads, n_kv_heads, head_dim, block_size: 16, max_blocks: 8, window }
}

/// The split-context path: one long sequence cut into many chunks (combine pass), short
/// sequences in one chunk (direct write), and a window whose chunks start mid-sequence.
#[test]
fn paged_decode_attention_splits_match_reference() {
    let long = PagedAttnShape { max_blocks: 40, ..shape(8, 2, 32, 0) };
    let f16 = |x| half::f16::from_f32(x);
    let f32_ = |x: half::f16| x.to_f32();
    check_paged_attention::<half::f16>(long, &[611], f16, f32_, "one long sequence");
    check_paged_attention::<half::f16>(long, &[611, 3, 200, 64], f16, f32_, "mixed lengths");
    check_paged_attention::<half::f16>(shape(8, 2, 32, 0), &[1, 5, 30, 64], f16, f32_, "one chunk each");
    let windowed = PagedAttnShape { max_blocks: 40, ..shape(4, 4, 64, 300) };
    check_paged_attention::<half::f16>(windowed, &[611, 299, 301], f16, f32_, "window 300");
    // Groups wider than the register budget: heads of one KV head split across cubes.
    let wide = PagedAttnShape { max_blocks: 40, ..shape(16, 2, 64, 0) };
    check_paged_attention::<f32>(wide, &[450, 7], |x| x, |x| x, "group 8, d64");
}

/// The split heuristics: Mixtral's shape at batch 1 and 4096 tokens fills the H200's SMs with
/// GQA groups of 4 heads; a large batch needs no combine pass.
#[test]
fn attention_split_choice() {
    let mixtral = PagedAttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        max_blocks: 256,
        window: 0,
    };
    let sp = AttnSplit::choose(&mixtral, 1, 4096, 32, 132, 232_448);
    assert_eq!((sp.hg, sp.planes, sp.unroll), (4, 4, 4));
    assert!(8 * sp.splits >= 264 && sp.splits * sp.chunk >= 4096, "{sp:?}");
    // 512 tokens: chunks of one plane iteration (4 planes × 4 tokens), 256 cubes, not 72.
    let sp = AttnSplit::choose(&mixtral, 1, 512, 32, 132, 232_448);
    assert_eq!((sp.chunk, sp.splits), (16, 32), "{sp:?}");
    let sp = AttnSplit::choose(&mixtral, 64, 64, 32, 132, 232_448);
    assert_eq!(sp.splits, 1, "{sp:?}");
    // Gemma-4's global layers: head_dim 512, 8 query heads per KV head.
    let gemma = PagedAttnShape {
        n_heads: 16,
        n_kv_heads: 2,
        head_dim: 512,
        block_size: 16,
        max_blocks: 256,
        window: 0,
    };
    let sp = AttnSplit::choose(&gemma, 1, 4096, 32, 132, 232_448);
    assert_eq!(sp.hg, 1, "{sp:?}");
    assert!(sp.planes * sp.hg * (512 + 2) * 4 <= 16 * 1024, "{sp:?}");
}

#[test]
fn paged_decode_attention_matches_reference() {
    let lens = [1, 16, 17, 40, 128];
    // GQA 4:1 in f32, and an f16 cache as on the GPU.
    check_paged_attention::<f32>(shape(8, 2, 32, 0), &lens, |x| x, |x| x, "gqa f32");
    check_paged_attention::<half::f16>(
        shape(8, 2, 32, 0),
        &lens,
        half::f16::from_f32,
        half::f16::to_f32,
        "gqa f16",
    );
    // Multi-head (no grouping) with a wider head, and a sliding window shorter than some sequences.
    check_paged_attention::<half::f16>(
        shape(4, 4, 64, 0),
        &lens,
        half::f16::from_f32,
        half::f16::to_f32,
        "mha d64",
    );
    check_paged_attention::<half::f16>(
        shape(8, 2, 32, 24),
        &lens,
        half::f16::from_f32,
        half::f16::to_f32,
        "window 24",
    );
}

#[test]
fn paged_attention_rejects_bad_shapes() {
    let client = client();
    let a = DeviceArray::from_slice(&client, &[0f32; 64]);
    let u = DeviceArray::from_slice(&client, &[0u32; 8]);
    let bad_group = shape(6, 4, 32, 0);
    let err =
        paged_decode_attention::<_, f32>(&client, bad_group, 1, 1, &a, &a, &a, &u, &u, &a, &a).unwrap_err();
    assert!(err.to_string().contains("multiple of 4 KV heads"), "{err}");
    let bad_dim = shape(2, 1, 12, 0);
    let err =
        paged_decode_attention::<_, f32>(&client, bad_dim, 1, 1, &a, &a, &a, &u, &u, &a, &a).unwrap_err();
    assert!(err.to_string().contains("head_dim 12"), "{err}");
}

/// Decode-step kernels: f32 accumulation in another order (and f32 sin/cos on the device).
const STEP_TOL: f32 = 2e-5;

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "{what}: [{i}] = {g}, reference {w}");
    }
}

fn rand_vec(rng: &mut StdRng, n: usize, r: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-r..r)).collect()
}

#[test]
fn decode_step_kernels_match_reference() {
    use half::f16;
    use kernels_cubecl::step::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(99);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let (hidden, vocab) = (96, 50);
    for tokens in [1usize, 3, 16] {
        let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
        // Embedding.
        let table: Vec<f16> =
            rand_vec(&mut rng, vocab * hidden, 1.0).into_iter().map(f16::from_f32).collect();
        let ids: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..vocab as u32)).collect();
        let h = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * hidden);
        embed(
            &client,
            tokens,
            hidden,
            &DeviceArray::from_slice(&client, &ids),
            &DeviceArray::from_slice(&client, &table),
            &up(&[2.0]),
            &h,
        )
        .unwrap();
        let want_h = embed_reference(&ids, &table, hidden, 2.0);
        assert_close(&read_f32(&client, &h).unwrap(), &want_h, 0.0, "embed");

        // Dense GEMM with bias, and accumulating into a residual.
        for (bias, accumulate) in [(false, false), (true, true)] {
            let g = DenseGemm { n: 70, k: hidden, bias, accumulate, mma: MmaMode::AUTO };
            let wt: Vec<f16> = rand_vec(&mut rng, g.n * g.k, 0.5).into_iter().map(f16::from_f32).collect();
            let b = rand_vec(&mut rng, g.n, 1.0);
            let y0 = rand_vec(&mut rng, tokens * g.n, 1.0);
            let y = up(&y0);
            dense_gemm(&client, g, tokens, &meta, &h, &DeviceArray::from_slice(&client, &wt), &up(&b), &y)
                .unwrap();
            let mut want = y0.clone();
            dense_gemm_reference(g, &want_h, &wt, &b, &mut want);
            assert_close(&read_f32(&client, &y).unwrap(), &want, STEP_TOL, "dense_gemm");
        }
    }
}

/// An RMSNorm folded into its consumer: the norm's scale is applied after the row's reduction
/// instead of before, and `Σ x²` is summed per lane then across the plane: f32 rounding in
/// another order only.
const NORMED_TOL: f32 = 2e-5;

/// The dense GEMM and the row gather with a fused input RMSNorm (plain and `1 + w`) against
/// [`rms_norm_reference`] followed by the plain references; widths with and without the
/// GEMM's 4-vector rounds, 1, 3 and 16 tokens, bias and residual add.
#[test]
fn dense_gemm_and_gather_normed_match_reference() {
    use half::f16;
    use kernels_cubecl::step::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(101);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    for (k, n) in [(96usize, 70usize), (1000, 37)] {
        for tokens in [1usize, 3, 16] {
            let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
            // Rows of different magnitudes, so the per-token scale matters.
            let x: Vec<f32> =
                (0..tokens * k).map(|i| rng.random_range(-1.0f32..1.0) * (1 + i / k) as f32).collect();
            let g = rand_vec(&mut rng, k, 1.0);
            for (off, bias, accumulate) in [(0.0f32, false, false), (1.0, true, true)] {
                let d = DenseGemm { n, k, bias, accumulate, mma: MmaMode::AUTO };
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
    // Gather with and without the norm: top-3 copies of 5 tokens in a shuffled order; a row
    // narrower than the cube, and one wider (several values per unit, a partial last round).
    for width in [72usize, 3001] {
        let (tokens, k) = (5usize, 3usize);
        let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
        let x = rand_vec(&mut rng, tokens * width, 2.0);
        let g = rand_vec(&mut rng, width, 1.0);
        let idx: Vec<u32> = (0..tokens * k).map(|r| ((r * 7) % tokens) as u32).collect();
        let (xd, gd, id) = (up(&x), up(&g), DeviceArray::from_slice(&client, &idx));
        for off in [None, Some(0.0f32), Some(1.0)] {
            let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * k * width);
            let params = up(&[1e-6, off.unwrap_or(0.0)]);
            let norm = off.map(|_| RowNorm { w: &gd, params: &params });
            gather_rows_normed(&client, tokens, k, width, &meta, &xd, norm, &id, &out).unwrap();
            let want = gather_rows_reference(&x, width, &idx, off.map(|o| (g.as_slice(), 1e-6, o)));
            let tol = if off.is_some() { NORMED_TOL } else { 0.0 };
            assert_close(
                &read_f32(&client, &out).unwrap(),
                &want,
                tol,
                &format!("gather width {width}, {off:?}"),
            );
        }
    }
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
    use kernels_cubecl::step::*;
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

/// Routing and the experts' row gather in one launch (`moe_route_gather`, every cube
/// recomputing the routing, its logits inside wider rows) against `moe_route` +
/// `gather_rows_reference`: the same routing
/// outputs bit for bit (weights, positions, gather order, work items, statistics), and the
/// gathered rows exact without a norm, within NORMED_TOL with one.
#[test]
fn moe_route_gather_matches_reference() {
    use kernels_cubecl::step::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(17);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    for shape in [
        MoeShape { experts: 6, k: 2, renormalize: true, hidden: 64, inter: 48 },
        MoeShape { experts: 40, k: 4, renormalize: false, hidden: 300, inter: 16 },
    ] {
        let h = shape.hidden;
        let slot = |rows, cols| PoolSlot { plane_off: 7, lut_off: 3, rows, cols, bits: 4 };
        let slots =
            vec![(slot(2 * shape.inter as u32, h as u32), slot(h as u32, shape.inter as u32)); shape.experts];
        let slot_words = DeviceArray::from_slice(&client, &expert_slot_words(shape, &slots).unwrap());
        let (want_bufs, bufs) = (RouteBuffers::new(&client, shape), RouteBuffers::new(&client, shape));
        for tokens in [1usize, 5, 16] {
            let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
            let x = rand_vec(&mut rng, tokens * h, 2.0);
            // Few distinct values, so ties between experts occur.
            let logits: Vec<f32> =
                (0..tokens * shape.experts).map(|_| rng.random_range(0..6) as f32 * 0.5).collect();
            let (xd, ld) = (up(&x), up(&logits));
            let g = rand_vec(&mut rng, h, 1.0);
            let (gd, params) = (up(&g), up(&[1e-5, 1.0]));
            let zeros = || DeviceArray::from_slice(&client, &vec![0u32; 3 * shape.experts]);
            let zf = || up(&vec![0.0; 3 * shape.experts]);
            let (wc, wm, gc, gm) = (zeros(), zf(), zeros(), zf());
            let base = 2 * shape.experts;
            let want_stats = Some(RouteCounters { counts: &wc, mass: &wm, base });
            moe_route_counted(&client, shape, tokens, &meta, &ld, &slot_words, &want_bufs, want_stats)
                .unwrap();
            let idx = read_u32(&client, &want_bufs.gather).unwrap()[..tokens * shape.k].to_vec();
            for norm in [None, Some(RowNorm { w: &gd, params: &params })] {
                let xg = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * shape.k * h);
                let stats = norm.is_none().then_some(RouteCounters { counts: &gc, mass: &gm, base });
                // The logits inside wider rows (beside other outputs of their GEMM).
                let layout = LogitsLayout { stride: shape.experts + 11, offset: 5 };
                let wide: Vec<f32> = (0..tokens * layout.stride)
                    .map(|i| {
                        let (t, c) = (i / layout.stride, i % layout.stride);
                        let e = c.wrapping_sub(layout.offset);
                        if e < shape.experts { logits[t * shape.experts + e] } else { 100.0 }
                    })
                    .collect();
                moe_route_gather(
                    &client,
                    shape,
                    tokens,
                    &meta,
                    (&up(&wide), layout),
                    &slot_words,
                    &bufs,
                    stats,
                    &xd,
                    norm,
                    &xg,
                )
                .unwrap();
                let n = tokens * shape.k;
                for (what, a, b) in
                    [("gather", &want_bufs.gather, &bufs.gather), ("pos", &want_bufs.pos, &bufs.pos)]
                {
                    assert_eq!(
                        read_u32(&client, a).unwrap()[..n],
                        read_u32(&client, b).unwrap()[..n],
                        "{what}"
                    );
                }
                let d = shape.experts * ROUTE_CHUNKS * kernels_cubecl::gemm::DESC_WORDS + 1;
                for (a, b) in
                    [(&want_bufs.desc_gate_up, &bufs.desc_gate_up), (&want_bufs.desc_down, &bufs.desc_down)]
                {
                    assert_eq!(
                        read_u32(&client, a).unwrap()[..d],
                        read_u32(&client, b).unwrap()[..d],
                        "work items"
                    );
                }
                assert_eq!(
                    read_f32(&client, &want_bufs.weights).unwrap()[..n],
                    read_f32(&client, &bufs.weights).unwrap()[..n],
                    "weights"
                );
                let want = gather_rows_reference(&x, h, &idx, norm.map(|_| (g.as_slice(), 1e-5, 1.0)));
                let tol = if norm.is_some() { NORMED_TOL } else { 0.0 };
                let what = format!("{shape:?}, {tokens} tokens, norm {}", norm.is_some());
                assert_close(&read_f32(&client, &xg).unwrap(), &want, tol, &what);
            }
            assert_eq!(read_u32(&client, &wc).unwrap(), read_u32(&client, &gc).unwrap(), "statistics counts");
            assert_eq!(read_f32(&client, &wm).unwrap(), read_f32(&client, &gm).unwrap(), "statistics mass");
        }
    }
}

/// Error budget of the router logits folded into the routing launch
/// (`moe_route_gather_router`) against `router_logits_reference`: f32 dot products over
/// `hidden` in another order (planes' partial sums), and the norm's scale applied after them,
/// relative to the largest logit.
const ROUTER_LOGITS_TOL: f32 = 5e-5;

/// The router GEMM, routing and gather in one launch (`moe_route_gather_router`): its logits
/// within ROUTER_LOGITS_TOL of `router_logits_reference`; its routing outputs bit for bit those
/// of `moe_route_counted` over the logits it wrote (weights, positions, gather order, work
/// items, statistics); the gathered rows as `gather_rows_reference` (exact without a norm,
/// NORMED_TOL with one). Mixtral's router shape, and a width that leaves units idle.
#[test]
fn moe_route_gather_router_matches_reference() {
    use kernels_cubecl::step::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(23);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let too_big = MoeShape { experts: 128, k: 8, renormalize: true, hidden: 2816, inter: 704 };
    assert!(!router_fusable(&client, too_big), "Gemma-4's router stays a GEMM");
    for shape in [
        MoeShape { experts: 8, k: 2, renormalize: true, hidden: 4096, inter: 64 },
        MoeShape { experts: 6, k: 3, renormalize: false, hidden: 300, inter: 16 },
    ] {
        assert!(router_fusable(&client, shape), "{shape:?}");
        let h = shape.hidden;
        let slot = |rows, cols| PoolSlot { plane_off: 7, lut_off: 3, rows, cols, bits: 4 };
        let slots =
            vec![(slot(2 * shape.inter as u32, h as u32), slot(h as u32, shape.inter as u32)); shape.experts];
        let slot_words = DeviceArray::from_slice(&client, &expert_slot_words(shape, &slots).unwrap());
        let (want_bufs, bufs) = (RouteBuffers::new(&client, shape), RouteBuffers::new(&client, shape));
        let router: Vec<half::f16> =
            (0..shape.experts * h).map(|_| half::f16::from_f32(rng.random_range(-0.1f32..0.1))).collect();
        let rd = DeviceArray::from_slice(&client, &router);
        for tokens in [1usize, 5, 16] {
            let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
            let x = rand_vec(&mut rng, tokens * h, 2.0);
            let xd = up(&x);
            let g = rand_vec(&mut rng, h, 1.0);
            let (gd, params) = (up(&g), up(&[1e-5, 1.0]));
            for norm in [None, Some(RowNorm { w: &gd, params: &params })] {
                let what = format!("{shape:?}, {tokens} tokens, norm {}", norm.is_some());
                let zeros = || DeviceArray::from_slice(&client, &vec![0u32; 2 * shape.experts]);
                let zf = || up(&vec![0.0; 2 * shape.experts]);
                let (wc, wm, gc, gm) = (zeros(), zf(), zeros(), zf());
                let base = shape.experts;
                let stats = Some(RouteCounters { counts: &gc, mass: &gm, base });
                let xg = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * shape.k * h);
                let ld = up(&vec![f32::NAN; tokens * shape.experts]);
                moe_route_gather_router(
                    &client,
                    shape,
                    tokens,
                    &meta,
                    (&rd, &ld),
                    &slot_words,
                    &bufs,
                    stats,
                    &xd,
                    norm,
                    &xg,
                )
                .unwrap();
                let logits = read_f32(&client, &ld).unwrap();
                let nref = norm.map(|_| (g.as_slice(), 1e-5, 1.0));
                let want = router_logits_reference(&x, &router, h, nref);
                assert_close(&logits, &want, ROUTER_LOGITS_TOL, &format!("logits of {what}"));
                // The routing of the logits the kernel computed (every cube's are the same).
                let want_stats = Some(RouteCounters { counts: &wc, mass: &wm, base });
                moe_route_counted(&client, shape, tokens, &meta, &ld, &slot_words, &want_bufs, want_stats)
                    .unwrap();
                let n = tokens * shape.k;
                for (w, a, b) in
                    [("gather", &want_bufs.gather, &bufs.gather), ("pos", &want_bufs.pos, &bufs.pos)]
                {
                    assert_eq!(
                        read_u32(&client, a).unwrap()[..n],
                        read_u32(&client, b).unwrap()[..n],
                        "{w}: {what}"
                    );
                }
                let d = shape.experts * ROUTE_CHUNKS * kernels_cubecl::gemm::DESC_WORDS + 1;
                for (a, b) in
                    [(&want_bufs.desc_gate_up, &bufs.desc_gate_up), (&want_bufs.desc_down, &bufs.desc_down)]
                {
                    assert_eq!(
                        read_u32(&client, a).unwrap()[..d],
                        read_u32(&client, b).unwrap()[..d],
                        "items"
                    );
                }
                assert_eq!(
                    read_f32(&client, &want_bufs.weights).unwrap()[..n],
                    read_f32(&client, &bufs.weights).unwrap()[..n],
                    "weights: {what}"
                );
                assert_eq!(read_u32(&client, &wc).unwrap(), read_u32(&client, &gc).unwrap(), "counts");
                assert_eq!(read_f32(&client, &wm).unwrap(), read_f32(&client, &gm).unwrap(), "mass");
                let idx = read_u32(&client, &want_bufs.gather).unwrap()[..n].to_vec();
                let want = gather_rows_reference(&x, h, &idx, nref);
                let tol = if norm.is_some() { NORMED_TOL } else { 0.0 };
                assert_close(&read_f32(&client, &xg).unwrap(), &want, tol, &what);
            }
        }
    }
}

fn check_routed_moe(
    client: &ComputeClient<WgpuRuntime>,
    rng: &mut StdRng,
    shape: kernels_cubecl::step::MoeShape,
    chunk: usize,
) {
    use kernels_cubecl::step::*;
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
    let bufs = RouteBuffers::with_chunk(client, shape, chunk).unwrap();
    assert!(RouteBuffers::with_chunk(client, shape, 3).is_err(), "a chunk of 3 tokens");
    for tokens in [1usize, 2, 5, 16] {
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
        kernels_cubecl::families::gated_act(client, rows, i, silu, &gu, (&act_rows, 2 * i)).unwrap();
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
            kernels_cubecl::families::gated_act(client, rows, i, a, &gu, (&split, 2 * i)).unwrap();
            let (f, w) = (read_f32(client, &fused).unwrap(), read_f32(client, &split).unwrap());
            for r in 0..rows {
                assert_eq!(
                    f[r * 2 * i..][..i],
                    w[r * 2 * i..][..i],
                    "{act:?} epilogue, row {r}, {tokens} tokens"
                );
            }
        }
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

#[test]
fn fill_hash_matches_reference() {
    let client = client();
    let out = DeviceArray::empty::<WgpuRuntime, u32>(&client, 300_001);
    fill_hash(&client, &out, 42);
    assert_eq!(read_u32(&client, &out).unwrap(), fill_hash_reference(300_001, 42));
}

/// The prefill expansion is a copy of LUT values: exact, and equal to pw-format's own
/// dequantization of the block.
#[test]
fn dequantize_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(7);
    for (rows, cols) in [(5usize, 100usize), (33, 64), (3, 1000)] {
        let block = random_block(&mut rng, rows, cols);
        for bits in 3..=8u8 {
            let mut pool = PoolImage::default();
            // A leading block so the offsets are not zero.
            pool.push(&random_block(&mut rng, 2, 40), 5);
            let slot = pool.push(&block, bits);
            let planes = DeviceArray::from_slice(&client, &pool.planes);
            let luts = DeviceArray::from_slice(&client, &pool.luts);
            let out = DeviceArray::empty::<WgpuRuntime, half::f16>(&client, rows * cols);
            ap_dequantize(&client, &planes, &luts, slot, &out).unwrap();
            let got = half::f16::from_bytes(&client.read_one(out.handle.clone()).unwrap()).to_vec();
            let want = ap_dequantize_reference(&pool, slot);
            assert_eq!(got[..rows * cols], want[..], "{rows}x{cols} b{bits}");
            let fmt: Vec<half::f16> =
                block.dequantize_reference(bits).iter().map(|&v| half::f16::from_f32(v)).collect();
            assert_eq!(want, fmt, "{rows}x{cols} b{bits}: reference disagrees with pw-format");
        }
    }
    let mut pool = PoolImage::default();
    let slot = pool.push(&random_block(&mut rng, 4, 64), 4);
    let planes = DeviceArray::from_slice(&client, &pool.planes);
    let luts = DeviceArray::from_slice(&client, &pool.luts);
    let small = DeviceArray::empty::<WgpuRuntime, half::f16>(&client, 10);
    assert!(ap_dequantize(&client, &planes, &luts, slot, &small).is_err(), "short output accepted");
}

/// The Qwen2-MoE / Gemma-4 kernels of `families`: f32 arithmetic in another order than the CPU
/// (plane sums), plus GPU exp/tanh.
const FAMILY_TOL: f32 = 2e-5;

/// A dense MLP's down projection over `act(gate) · up` (· the sigmoid gate) of its gate|up
/// rows, the activation fused into the GEMM's loads: against the gated activation's reference
/// then the plain GEMM's; SiLU with and without the gate column (rows padded to a multiple of
/// 8 as the decoder lays them out), GELU; widths with and without the 4-vector rounds.
#[test]
fn dense_gemm_act_matches_reference() {
    use half::f16;
    use kernels_cubecl::step::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(11);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    for inter in [40usize, 520] {
        for (act, gated) in
            [(Activation::SiluMul, false), (Activation::SiluMul, true), (Activation::GeluTanhMul, false)]
        {
            let stride = if gated { (2 * inter + 1).next_multiple_of(8) } else { 2 * inter };
            let a = GatedInput { act, stride, gated };
            for (tokens, bias, accumulate) in [(1usize, false, false), (5, true, true), (16, false, true)] {
                let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
                let d = DenseGemm { n: 70, k: inter, bias, accumulate, mma: MmaMode::AUTO };
                let x = rand_vec(&mut rng, tokens * stride, 3.0);
                let wt: Vec<f16> =
                    rand_vec(&mut rng, d.n * d.k, 0.5).into_iter().map(f16::from_f32).collect();
                let b = rand_vec(&mut rng, d.n, 1.0);
                let y0 = rand_vec(&mut rng, tokens * d.n, 1.0);
                let y = up(&y0);
                let wd = DeviceArray::from_slice(&client, &wt);
                dense_gemm_act(&client, d, tokens, &meta, &up(&x), a, &wd, &up(&b), &y).unwrap();
                let mut want = y0.clone();
                dense_gemm_act_reference(d, &x, a, &wt, &b, &mut want);
                let what = format!("dense_gemm_act {a:?}, k {inter}, {tokens} tokens");
                assert_close(&read_f32(&client, &y).unwrap(), &want, FAMILY_TOL, &what);
            }
        }
    }
    let (meta, x) = (DeviceArray::from_slice(&client, &[1u32]), up(&[0.0; 80]));
    let d = DenseGemm { n: 1, k: 40, bias: false, accumulate: false, mma: MmaMode::AUTO };
    let bad = GatedInput { act: Activation::SiluMul, stride: 80, gated: true };
    assert!(dense_gemm_act(&client, d, 1, &meta, &x, bad, &x, &x, &x).is_err(), "no gate column");
    let bad = GatedInput { act: Activation::None, stride: 80, gated: false };
    assert!(dense_gemm_act(&client, d, 1, &meta, &x, bad, &x, &x, &x).is_err(), "no activation");
}

/// The activation as a launch of its own (batches above `FUSED_ACT_MAX_TOKENS`): against
/// `gated_act_reference`, with and without the sigmoid gate column, SiLU and GELU, a width that
/// ends mid-cube; a stride without room for the gate column is refused.
#[test]
fn gated_act_matches_reference() {
    use kernels_cubecl::families::{gated_act, gated_act_reference};
    use kernels_cubecl::step::GatedInput;
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

/// Gemma-4's head norms, RoPE and K/V append in one launch against `head_norm_reference`, then
/// `rope_reference`, then `kv_append_reference`: with and without K = V, full and partial
/// rotary, spare columns in the projection row and in the query row.
#[test]
fn head_norm_rope_append_matches_reference() {
    use kernels_cubecl::families::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(22);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let (heads, kv_heads, head_dim) = (4, 2, 16);
    for (k_eq_v, rot_dim) in [(false, 16usize), (true, 10)] {
        let src_heads = if k_eq_v { heads + kv_heads } else { heads + 2 * kv_heads };
        let g = HeadNorm {
            heads,
            kv_heads,
            head_dim,
            src_stride: src_heads * head_dim + 3,
            qk_norm: true,
            v_norm: true,
            k_eq_v,
        };
        let shape = PagedAttnShape {
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim,
            block_size: 4,
            max_blocks: 4,
            window: 0,
        };
        let (tokens, pool_slots, w) = (3, 12, shape.slot_width());
        let src = rand_vec(&mut rng, tokens * g.src_stride, 2.0);
        let wn = rand_vec(&mut rng, 2 * head_dim, 1.5);
        let pos = [0u32, 7, 130];
        let slots = [5u32, 0, 9];
        let inv_freq: Vec<f32> =
            (0..rot_dim / 2).map(|i| 10000f32.powf(-((2 * i) as f32) / rot_dim as f32)).collect();
        let (wq, wk, wv) = head_norm_rope_append_reference(g, &src, &wn, 1e-6, &pos, &inv_freq, rot_dim);
        let (mut kp, mut vp) = (vec![0f32; pool_slots * w], vec![0f32; pool_slots * w]);
        kv_append_reference(shape, &wk, &wv, &slots, &mut kp, &mut vp);
        let q_stride = g.out_stride();
        let qd = up(&vec![0.0; tokens * q_stride]);
        let (kd, vd) = (up(&vec![0.0; pool_slots * w]), up(&vec![0.0; pool_slots * w]));
        let (pd, sd) = (DeviceArray::from_slice(&client, &pos), DeviceArray::from_slice(&client, &slots));
        head_norm_rope_append::<_, f32>(
            &client,
            g,
            tokens,
            rot_dim,
            &up(&src),
            &up(&wn),
            &up(&[1e-6]),
            &pd,
            &up(&inv_freq),
            &sd,
            (&qd, q_stride),
            &kd,
            &vd,
        )
        .unwrap();
        let got = read_f32(&client, &qd).unwrap();
        let q: Vec<f32> =
            (0..tokens).flat_map(|t| got[t * q_stride..][..heads * head_dim].to_vec()).collect();
        let what = format!("K = V {k_eq_v}, rot_dim {rot_dim}");
        assert_close(&q, &wq, FAMILY_TOL, &format!("queries, {what}"));
        assert_close(&read_f32(&client, &kd).unwrap(), &kp, FAMILY_TOL, &format!("K pool, {what}"));
        assert_close(&read_f32(&client, &vd).unwrap(), &vp, FAMILY_TOL, &format!("V pool, {what}"));
    }
}

#[test]
fn head_norm_matches_reference() {
    use kernels_cubecl::families::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(12);
    let (heads, kv_heads, head_dim) = (4, 2, 16);
    for (qk_norm, v_norm, k_eq_v) in [(true, true, false), (true, true, true), (false, false, false)] {
        let src_heads = if k_eq_v { heads + kv_heads } else { heads + 2 * kv_heads };
        let g =
            HeadNorm { heads, kv_heads, head_dim, src_stride: src_heads * head_dim, qk_norm, v_norm, k_eq_v };
        let tokens = 3;
        let src = rand_vec(&mut rng, tokens * g.src_stride, 2.0);
        let w = rand_vec(&mut rng, 2 * head_dim, 1.5);
        let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * g.out_stride());
        let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
        head_norm(&client, g, tokens, &up(&src), &up(&w), &up(&[1e-6]), &out).unwrap();
        let want = head_norm_reference(g, &src, &w, 1e-6);
        assert_close(&read_f32(&client, &out).unwrap(), &want, FAMILY_TOL, &format!("head_norm {g:?}"));
    }
}

#[test]
fn add_rms_norm_softcap_argmax_match_reference() {
    use kernels_cubecl::families::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(13);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let (tokens, hidden) = (4, 72);
    let x = rand_vec(&mut rng, tokens * hidden, 2.0);
    let w = rand_vec(&mut rng, hidden, 1.0);
    let mut h = rand_vec(&mut rng, tokens * hidden, 1.0);
    let hd = up(&h);
    add_rms_norm(&client, tokens, hidden, &up(&x), &up(&w), &up(&[1e-6]), &hd).unwrap();
    add_rms_norm_reference(&x, &w, 1e-6, &mut h);
    assert_close(&read_f32(&client, &hd).unwrap(), &h, FAMILY_TOL, "add_rms_norm");

    // Soft-cap over the first 3 of 4 rows only (`meta[0]` = 3).
    let xd = up(&x);
    softcap(&client, 3, hidden, &DeviceArray::from_slice(&client, &[3u32]), &xd, &up(&[1.5])).unwrap();
    let mut want = softcap_reference(&x[..3 * hidden], 1.5);
    want.extend_from_slice(&x[3 * hidden..]);
    assert_close(&read_f32(&client, &xd).unwrap(), &want, FAMILY_TOL, "softcap");

    // Greedy ids, with a tie in row 1 that must go to the lower index: a row narrower than
    // one round of the cube, and a wide one whose tie spans planes and rounds.
    for width in [300, 20_011] {
        let mut v = rand_vec(&mut rng, tokens * width, 1.0);
        v[width + 17] = 5.0;
        v[width + width - 50] = 5.0;
        v[3 * width + width - 1] = 7.0;
        let ids = DeviceArray::empty::<WgpuRuntime, u32>(&client, tokens);
        argmax(&client, tokens, width, &up(&v), &ids).unwrap();
        let want = argmax_reference(&v, width);
        assert_eq!((want[1], want[3]), (17, width as u32 - 1));
        assert_eq!(read_u32(&client, &ids).unwrap(), want, "width {width}");
    }

    // Rows wider than a cube's units (several values per unit, a partial last round).
    let hidden = 3001;
    let x = rand_vec(&mut rng, tokens * hidden, 2.0);
    let w = rand_vec(&mut rng, hidden, 1.0);
    let mut h = rand_vec(&mut rng, tokens * hidden, 1.0);
    let hd = up(&h);
    add_rms_norm(&client, tokens, hidden, &up(&x), &up(&w), &up(&[1e-6]), &hd).unwrap();
    add_rms_norm_reference(&x, &w, 1e-6, &mut h);
    assert_close(&read_f32(&client, &hd).unwrap(), &h, FAMILY_TOL, "add_rms_norm, wide");
}

#[test]
fn gemma_ffn_out_matches_reference() {
    use kernels_cubecl::families::*;
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

#[test]
fn fill_uniform_matches_reference() {
    use kernels_cubecl::families::*;
    let client = client();
    let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, 1_100_003);
    fill_uniform::<WgpuRuntime, f32>(&client, &out, 9, 0.25).unwrap();
    let want = fill_uniform_reference(1_100_003, 9, 0.25);
    assert_close(&read_f32(&client, &out).unwrap(), &want, 0.0, "fill_uniform");
    assert!(
        want.iter().all(|v| v.abs() <= 0.25)
            && want.iter().any(|v| *v > 0.2)
            && want.iter().any(|v| *v < -0.2)
    );
}

/// RoPE + K/V append in one launch against `rope_reference` then `kv_append_reference`: query
/// heads rotated in place, key heads rotated into the K pool, value heads copied; full and
/// partial rotary, an f32 and an f16 pool.
#[test]
fn rope_append_matches_reference() {
    use kernels_cubecl::step::{Rope, rope_reference};
    let client = client();
    let mut rng = StdRng::seed_from_u64(21);
    for (rot_dim, f16_pool) in [(16usize, false), (10, true)] {
        let shape = PagedAttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            block_size: 4,
            max_blocks: 4,
            window: 0,
        };
        let (nh, kvh, hd, w) = (4, 2, 16, shape.slot_width());
        // Q | K | V and 3 spare columns per row, as a fused projection may leave.
        let stride = (nh + 2 * kvh) * hd + 3;
        let layout = RowLayout { stride, k_off: nh * hd, v_off: (nh + kvh) * hd };
        let tokens = 3;
        let qkv = rand_vec(&mut rng, tokens * stride, 1.0);
        let pos = [0u32, 7, 130];
        let inv_freq: Vec<f32> =
            (0..rot_dim / 2).map(|i| 10000f32.powf(-((2 * i) as f32) / rot_dim as f32)).collect();
        let slots = [5u32, 0, 9];
        let pool_slots = 12;

        let mut want_qkv = qkv.clone();
        rope_reference(
            Rope { stride, heads: nh + kvh, head_dim: hd, rot_dim },
            &mut want_qkv,
            &pos,
            &inv_freq,
        );
        let rows = |off: usize| -> Vec<f32> {
            (0..tokens).flat_map(|t| want_qkv[t * stride + off..][..w].to_vec()).collect()
        };
        let (mut kp, mut vp) = (vec![0f32; pool_slots * w], vec![0f32; pool_slots * w]);
        kv_append_reference(shape, &rows(layout.k_off), &rows(layout.v_off), &slots, &mut kp, &mut vp);

        let qd = DeviceArray::from_slice(&client, &qkv);
        let (pd, fd, sd) = (
            DeviceArray::from_slice(&client, &pos),
            DeviceArray::from_slice(&client, &inv_freq),
            DeviceArray::from_slice(&client, &slots),
        );
        let read_pool = |d: &DeviceArray| -> Vec<f32> {
            if f16_pool {
                sync(&client).unwrap();
                let b = client.read_one(d.handle.clone()).unwrap();
                half::f16::from_bytes(&b)[..d.len].iter().map(|x| x.to_f32()).collect()
            } else {
                read_f32(&client, d).unwrap()
            }
        };
        let (kd, vd) = if f16_pool {
            let z = vec![half::f16::ZERO; pool_slots * w];
            (DeviceArray::from_slice(&client, &z), DeviceArray::from_slice(&client, &z))
        } else {
            let z = vec![0f32; pool_slots * w];
            (DeviceArray::from_slice(&client, &z), DeviceArray::from_slice(&client, &z))
        };
        if f16_pool {
            rope_append::<_, half::f16>(
                &client, shape, tokens, layout, rot_dim, &qd, &pd, &fd, &sd, &kd, &vd,
            )
            .unwrap();
        } else {
            rope_append::<_, f32>(&client, shape, tokens, layout, rot_dim, &qd, &pd, &fd, &sd, &kd, &vd)
                .unwrap();
        }
        // f16 pools round each value once (relative 2^-11 of |x| ≤ ~1.5).
        let tol = if f16_pool { 1e-3 } else { STEP_TOL };
        let got = read_f32(&client, &qd).unwrap();
        let q: Vec<f32> = (0..tokens).flat_map(|t| got[t * stride..][..nh * hd].to_vec()).collect();
        let wq: Vec<f32> = (0..tokens).flat_map(|t| want_qkv[t * stride..][..nh * hd].to_vec()).collect();
        assert_close(&q, &wq, STEP_TOL, "rotated queries");
        assert_close(&read_pool(&kd), &kp, tol, &format!("K pool, rot_dim {rot_dim}"));
        assert_close(&read_pool(&vd), &vp, tol, &format!("V pool, rot_dim {rot_dim}"));
    }
    // Keys that do not follow the queries are refused.
    let shape =
        PagedAttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 16, block_size: 4, max_blocks: 4, window: 0 };
    let a = DeviceArray::from_slice(&client, &[0f32; 256]);
    let bad = RowLayout { stride: 128, k_off: 0, v_off: 96 };
    let err = rope_append::<_, f32>(&client, shape, 1, bad, 16, &a, &a, &a, &a, &a, &a).unwrap_err();
    assert!(err.to_string().contains("rope_append"), "{err}");
}

/// `DenseGemm::mma` on any device: the matrix-unit kernel where the device has TF32 `mma`
/// (its inputs rounded to TF32: relative error ≤ 2⁻¹¹ per `x`), the plain kernel elsewhere
/// (lavapipe); both within [`DENSE_MMA_RTOL`] of the reference, plain and normed, with bias
/// and residual add, at 1, 3, 8 and 9 tokens (one and two token groups).
const DENSE_MMA_RTOL: f32 = 1e-3;

#[test]
fn dense_mma_matches_reference() {
    use half::f16;
    use kernels_cubecl::step::*;
    let client = client();
    let mut rng = StdRng::seed_from_u64(211);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    for (n, k, tokens) in [(70usize, 96usize, 1usize), (33, 128, 3), (16, 64, 8), (40, 160, 9)] {
        let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
        let x: Vec<f32> =
            (0..tokens * k).map(|i| rng.random_range(-1.0f32..1.0) * (1 + i / k) as f32).collect();
        let wt: Vec<f16> = rand_vec(&mut rng, n * k, 0.5).into_iter().map(f16::from_f32).collect();
        let b = rand_vec(&mut rng, n, 1.0);
        let gw = rand_vec(&mut rng, k, 1.0);
        let (gd, pd) = (up(&gw), up(&[1e-5, 1.0]));
        for normed in [false, true] {
            let d =
                DenseGemm { n, k, bias: true, accumulate: true, mma: MmaMode::Always(MmaTuning::default()) };
            let y0 = rand_vec(&mut rng, tokens * n, 1.0);
            let y = up(&y0);
            let norm = normed.then_some(RowNorm { w: &gd, params: &pd });
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
            let xs = if normed { rms_norm_reference(&x, &gw, 1e-5, 1.0) } else { x.clone() };
            dense_gemm_reference(d, &xs, &wt, &b, &mut want);
            let got = read_f32(&client, &y).unwrap();
            for t in 0..tokens {
                for r in 0..n {
                    let scale: f32 =
                        (0..k).map(|c| (xs[t * k + c] * wt[r * k + c].to_f32()).abs()).sum::<f32>()
                            + b[r].abs();
                    let (g, w) = (got[t * n + r], want[t * n + r]);
                    assert!(
                        (g - w).abs() <= DENSE_MMA_RTOL * scale,
                        "dense mma {n}x{k}, {tokens} tokens, normed {normed}: [{t}, {r}] {g} vs {w}"
                    );
                }
            }
        }
    }
}
