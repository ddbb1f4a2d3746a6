//! Block tables (host) and a multi-step decode through the device pools on wgpu against dense
//! attention over each sequence's full history.

use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use half::f16;
use kernels_cubecl::{DeviceArray, read_f32};
use pw_kv::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn geometry() -> KvGeometry {
    KvGeometry {
        layers: vec![
            LayerGeometry { n_heads: 8, n_kv_heads: 2, head_dim: 32, window: 0 },
            // A sliding layer with its own head count and width (Gemma-4 style).
            LayerGeometry { n_heads: 4, n_kv_heads: 1, head_dim: 64, window: 12 },
        ],
        block_size: 4,
        elem_bytes: 2,
        max_seq_len: 64,
    }
}

#[test]
fn block_bytes_count_every_layer_k_and_v() {
    // 2 (K, V) · 4 tokens · (2·32 + 1·64) elements · 2 bytes.
    assert_eq!(geometry().block_bytes(), 2 * 4 * 128 * 2);
    assert_eq!(geometry().max_blocks_per_seq(), 16);
}

#[test]
fn append_allocates_blocks_lazily_and_free_returns_them() {
    let g = geometry();
    let mut t = BlockTables::new(&g, 5);
    t.add(1).unwrap();
    t.add(2).unwrap();
    assert_eq!(t.append(1, 3).unwrap(), vec![0, 1, 2]);
    assert_eq!(t.used_blocks(), 1);
    // Crossing a block boundary takes the next free block.
    assert_eq!(t.append(2, 1).unwrap(), vec![4]);
    assert_eq!(t.append(1, 2).unwrap(), vec![3, 8]);
    assert_eq!(t.used_blocks(), 3);
    assert_eq!(t.free(1).unwrap(), 2);
    assert_eq!(t.free_blocks(), 4);
    assert_eq!(t.len(2).unwrap(), 1);
    assert_eq!(t.free(1), Err(KvError::UnknownSeq(1)));
}

#[test]
fn out_of_blocks_is_all_or_nothing() {
    let g = geometry();
    let mut t = BlockTables::new(&g, 2);
    t.add(7).unwrap();
    t.append(7, 5).unwrap();
    let err = t.append(7, 8).unwrap_err();
    assert_eq!(err, KvError::OutOfBlocks { seq: 7, needed: 2, free: 0 });
    assert_eq!(t.len(7).unwrap(), 5, "a refused append must not change the sequence");
    assert!(matches!(t.append(7, 100), Err(KvError::TooLong { .. })));
    assert_eq!(t.add(7), Err(KvError::DuplicateSeq(7)));
}

#[test]
fn capacity_grows_and_shrinks_over_free_blocks_only() {
    let g = geometry();
    let mut t = BlockTables::new(&g, 4);
    t.add(1).unwrap();
    t.append(1, 4).unwrap(); // block 0
    t.set_capacity(8).unwrap();
    assert_eq!(t.free_blocks(), 7);
    t.set_capacity(1).unwrap();
    assert_eq!(t.free_blocks(), 0);
    assert!(matches!(t.set_capacity(0), Err(KvError::InUse { .. })));
    t.free(1).unwrap();
    t.set_capacity(0).unwrap();
    assert_eq!(t.capacity(), 0);
}

fn client() -> ComputeClient<WgpuRuntime> {
    pw_testkit::wgpu_client()
}

/// Cached rows of one layer of one sequence, in token order.
type Rows = Vec<Vec<f32>>;

/// Dense attention of one query over a history (f16-rounded K/V rows), per head.
fn dense(l: &LayerGeometry, q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>]) -> Vec<f32> {
    let (d, group) = (l.head_dim, l.n_heads / l.n_kv_heads);
    let start = if l.window > 0 { ks.len().saturating_sub(l.window) } else { 0 };
    let mut out = vec![0f32; l.n_heads * d];
    for h in 0..l.n_heads {
        let off = (h / group) * d;
        let s: Vec<f32> = (start..ks.len())
            .map(|t| {
                q[h * d..][..d].iter().zip(&ks[t][off..off + d]).map(|(a, b)| a * b).sum::<f32>()
                    / (d as f32).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
        for (i, t) in (start..ks.len()).enumerate() {
            for j in 0..d {
                out[h * d + j] += (s[i] - m).exp() / z * vs[t][off + j];
            }
        }
    }
    out
}

/// Three sequences decode 20 steps in one batch; one finishes midway and a new one takes its
/// blocks. Every step's attention output equals dense attention over the true history.
#[test]
fn decode_steps_match_dense_attention_over_the_history() {
    const TOL: f32 = 2e-5;
    let g = geometry();
    let client = client();
    let mut rng = StdRng::seed_from_u64(5);
    let mut tables = BlockTables::new(&g, 24);
    let pools = DevicePools::<WgpuRuntime>::new::<f16>(&client, &g, 24);
    let round = |x: f32| f16::from_f32(x).to_f32();
    // history[seq][layer] = (K rows, V rows)
    let mut history: std::collections::BTreeMap<u64, Vec<(Rows, Rows)>> = Default::default();
    for id in [1u64, 2, 3] {
        tables.add(id).unwrap();
        history.insert(id, vec![(vec![], vec![]); g.layers.len()]);
    }
    let scale = DeviceArray::from_slice(&client, &[1.0 / (32f32).sqrt()]);
    let scale64 = DeviceArray::from_slice(&client, &[1.0 / (64f32).sqrt()]);
    for step in 0..20 {
        if step == 9 {
            tables.free(2).unwrap();
            history.remove(&2);
            tables.add(4).unwrap();
            history.insert(4, vec![(vec![], vec![]); g.layers.len()]);
        }
        let seqs: Vec<u64> = tables.seqs().collect();
        let slots: Vec<u32> = seqs.iter().map(|&s| tables.append(s, 1).unwrap()[0]).collect();
        let arrays = pools.upload_step(&client, &tables, &seqs, &slots).unwrap();
        for (li, l) in g.layers.iter().enumerate() {
            let w = l.n_kv_heads * l.head_dim;
            let qn = l.n_heads * l.head_dim;
            let q: Vec<f32> = (0..seqs.len() * qn).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let kn: Vec<f32> = (0..seqs.len() * w).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
            let vn: Vec<f32> = (0..seqs.len() * w).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
            let out = DeviceArray::from_slice(&client, &vec![f32::NAN; q.len()]);
            let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
            let p = if l.head_dim == 32 { &scale } else { &scale64 };
            pools.decode_layer::<f16>(&client, li, &arrays, &up(&q), &up(&kn), &up(&vn), p, &out).unwrap();
            let got = read_f32(&client, &out).unwrap();
            for (i, s) in seqs.iter().enumerate() {
                let h = &mut history.get_mut(s).unwrap()[li];
                h.0.push(kn[i * w..][..w].to_vec());
                h.1.push(vn[i * w..][..w].to_vec());
                let want = dense(l, &q[i * qn..][..qn], &h.0, &h.1);
                for (j, (a, b)) in got[i * qn..][..qn].iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= TOL, "step {step} seq {s} layer {li} out[{j}] = {a}, dense {b}");
                }
            }
        }
    }
    assert_eq!(tables.len(4).unwrap(), 11);
    assert_eq!(tables.used_blocks(), 5 + 5 + 3);
}
