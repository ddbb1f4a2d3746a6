//! Tests of the module's kernels against their CPU references on random inputs (wgpu:
//! Mesa lavapipe in CI, plane size 8, 32 KiB of shared memory).

use cubecl::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::testing::{assert_close, client, rand_vec};
use crate::*;

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

/// RoPE + K/V append in one launch against `rope_reference` then `kv_append_reference`: query
/// heads rotated in place, key heads rotated into the K pool, value heads copied; full and
/// partial rotary, an f32 and an f16 pool.
#[test]
fn rope_append_matches_reference() {
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

/// Prefill attention against the per-row reference: a step of a 37-row prompt chunk at
/// positions 10..47 (runs cut at 16 rows, and at 40: sub-blocks of a cube), a decode row of another sequence and a 20-row
/// chunk from position 0; GQA groups of 4 and 1, f16 and f32 pools, with and without a window
/// shorter than a run (rows whose first keys are masked).
#[test]
fn paged_prefill_attention_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(29);
    // (sequence, first position, rows)
    let chunks = [(0usize, 10usize, 37usize), (1, 4, 1), (2, 0, 20)];
    for (shape, what) in [
        (PagedAttnShape { block_size: 4, max_blocks: 16, ..shape(8, 2, 16, 0) }, "group 4"),
        (PagedAttnShape { block_size: 4, max_blocks: 16, ..shape(4, 4, 32, 7) }, "group 1, window 7"),
    ] {
        let w = shape.slot_width();
        let seqs = chunks.len();
        let pool_blocks = seqs * shape.max_blocks;
        let mut free: Vec<u32> = (0..pool_blocks as u32).collect();
        for i in (1..free.len()).rev() {
            free.swap(i, rng.random_range(0..=i));
        }
        let seq_tables: Vec<Vec<u32>> =
            (0..seqs).map(|_| (0..shape.max_blocks).map(|_| free.pop().unwrap()).collect()).collect();
        let slots = pool_blocks * shape.block_size;
        let f16r = |x: f32| half::f16::from_f32(x).to_f32();
        let kp: Vec<f32> = (0..slots * w).map(|_| f16r(rng.random_range(-1.0f32..1.0))).collect();
        let vp: Vec<f32> = (0..slots * w).map(|_| f16r(rng.random_range(-1.0f32..1.0))).collect();
        // The step's rows: each row's table row and length (position + 1).
        let (mut table, mut lens, mut row_seq) = (Vec::new(), Vec::new(), Vec::new());
        for &(s, p0, n) in &chunks {
            for p in p0..p0 + n {
                table.extend_from_slice(&seq_tables[s]);
                lens.push(p as u32 + 1);
                row_seq.push(s);
            }
        }
        let rows = lens.len();
        let width = shape.n_heads * shape.head_dim;
        let q_stride = width + 8;
        let q: Vec<f32> = (0..rows * q_stride).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let dense_q: Vec<f32> = (0..rows).flat_map(|r| q[r * q_stride..][..width].to_vec()).collect();
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let want = paged_decode_attention_reference(shape, scale, &dense_q, &kp, &vp, &table, &lens);
        let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
        let up32 = |v: &[u32]| DeviceArray::from_slice(&client, v);
        let out = up(&vec![f32::NAN; rows * width]);
        let (td, ld) = (up32(&table), up32(&lens));
        let args = [up(&q), up(&[scale])];
        let run = |kd: &DeviceArray, vd: &DeviceArray, f16: bool, max_rows: usize| {
            let runs = prefill_runs(&row_seq, max_rows);
            if max_rows == 16 {
                assert_eq!(runs, vec![0, 16, 16, 16, 32, 5, 37, 1, 38, 16, 54, 4], "runs cut at 16 rows");
            }
            let longest = runs.chunks(2).map(|r| r[1] as usize).max().unwrap();
            let rd = up32(&runs);
            let r = if f16 {
                paged_prefill_attention::<_, half::f16>(
                    &client,
                    shape,
                    PrefillKernel::Auto,
                    rows,
                    &rd,
                    runs.len() / 2,
                    longest,
                    &args[0],
                    q_stride,
                    kd,
                    vd,
                    &td,
                    &ld,
                    &args[1],
                    &out,
                )
            } else {
                paged_prefill_attention::<_, f32>(
                    &client,
                    shape,
                    PrefillKernel::Auto,
                    rows,
                    &rd,
                    runs.len() / 2,
                    longest,
                    &args[0],
                    q_stride,
                    kd,
                    vd,
                    &td,
                    &ld,
                    &args[1],
                    &out,
                )
            };
            r.unwrap();
            let got = read_f32(&client, &out).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= ATTN_TOL,
                    "{what} (f16 {f16}, runs of {max_rows}): out[{i}] = {g}, reference {w}"
                );
            }
        };
        let h = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>();
        let (k16, v16) =
            (DeviceArray::from_slice(&client, &h(&kp)), DeviceArray::from_slice(&client, &h(&vp)));
        // Runs longer than a cube's rows go in sub-blocks.
        for max_rows in [16, 40] {
            run(&k16, &v16, true, max_rows);
            run(&up(&kp), &up(&vp), false, max_rows);
        }
    }
}

/// The matrix-unit prefill kernel's run length: 64 rows over the GQA group where the head
/// dimension (to 128, or 256) and the group fit, none without f16 `mma` or past them; on a device without it
/// (lavapipe) `PrefillKernel::Mma` is refused with an error naming the launch.
#[test]
fn prefill_mma_run_tokens_and_refusal() {
    let qwen = shape(16, 16, 128, 0);
    let mixtral = shape(32, 8, 128, 0);
    assert_eq!(prefill_mma_run_tokens(&qwen, true), Some(64));
    assert_eq!(prefill_mma_run_tokens(&mixtral, true), Some(16));
    assert_eq!(prefill_mma_run_tokens(&qwen, false), None);
    assert_eq!(prefill_mma_run_tokens(&shape(16, 8, 256, 1024), true), Some(32), "head_dim 256");
    assert_eq!(prefill_mma_run_tokens(&shape(16, 2, 512, 0), true), Some(8), "head_dim 512");
    assert_eq!(prefill_mma_run_tokens(&shape(16, 2, 384, 0), true), None, "head_dim 384");
    assert_eq!(prefill_mma_run_tokens(&shape(6, 2, 64, 0), true), None, "group 3");
    assert_eq!(prefill_mma_run_tokens(&shape(4, 4, 48, 0), true), None, "head_dim 48");

    let client = client();
    let s = PagedAttnShape { block_size: 4, max_blocks: 4, ..shape(4, 4, 32, 0) };
    assert_eq!(prefill_run_rows::<_, half::f16>(&client, &s), PREFILL_RUN_ROWS);
    let a = DeviceArray::from_slice(&client, &vec![0f32; 4096]);
    let u = DeviceArray::from_slice(&client, &[0u32, 4, 0, 0]);
    let table = DeviceArray::from_slice(&client, &[0u32; 64]);
    let err = paged_prefill_attention::<_, half::f16>(
        &client,
        s,
        PrefillKernel::Mma,
        4,
        &u,
        1,
        4,
        &a,
        128,
        &a,
        &a,
        &table,
        &u,
        &a,
        &a,
    )
    .unwrap_err();
    assert!(err.to_string().contains("matrix-unit"), "{err}");
}
