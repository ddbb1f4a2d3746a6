//! Layer-level behaviour that the model fixtures do not isolate.

use burn::tensor::{Tensor, TensorData};
use burn_ndarray::NdArray;
use pw_nn::{AttentionConfig, KvCache, NormKind, RandomInit, RmsNorm, Rope, RouterConfig, WeightSource};

type B = NdArray<f32>;

/// Pure f32 arithmetic on tiny tensors.
const TOL: f32 = 1e-5;

fn vec3(t: Tensor<B, 3>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A fixed weight source: every tensor is `value` everywhere.
struct Constant(f32);

impl WeightSource<B> for Constant {
    fn device(&self) -> burn_ndarray::NdArrayDevice {
        Default::default()
    }
    fn has(&self, _: &str) -> bool {
        true
    }
    fn read(&self, _: &str, expected: &[usize]) -> Result<Vec<f32>, pw_nn::LoadError> {
        Ok(vec![self.0; expected.iter().product()])
    }
}

#[test]
fn rms_norm_variants() {
    let x = Tensor::<B, 2>::from_data(TensorData::new(vec![3.0f32, 4.0], [1, 2]), &Default::default());
    // rms = sqrt((9 + 16) / 2); eps 0.
    let rms = (12.5f32).sqrt();
    let scale = RmsNorm::load(&Constant(0.5), "n", 2, 0.0, NormKind::Scale).unwrap();
    let one_plus = RmsNorm::load(&Constant(0.5), "n", 2, 0.0, NormKind::OnePlus).unwrap();
    let none = RmsNorm::<B>::load(&Constant(0.5), "n", 2, 0.0, NormKind::Weightless).unwrap();
    let get = |n: &RmsNorm<B>| n.forward(x.clone()).into_data().to_vec::<f32>().unwrap();
    assert!(max_diff(&get(&scale), &[0.5 * 3.0 / rms, 0.5 * 4.0 / rms]) < TOL);
    assert!(max_diff(&get(&one_plus), &[1.5 * 3.0 / rms, 1.5 * 4.0 / rms]) < TOL);
    assert!(max_diff(&get(&none), &[3.0 / rms, 4.0 / rms]) < TOL);
}

#[test]
fn proportional_rope_leaves_the_unrotated_pairs_alone() {
    let device = Default::default();
    let hd = 8;
    // Two rotating pairs out of four, as 0.5-partial proportional RoPE would give.
    let rope = Rope::new(vec![1.0, 0.1, 0.0, 0.0]);
    let data: Vec<f32> = (0..hd * 3).map(|i| (i as f32 * 0.7).sin()).collect();
    let x = Tensor::<B, 4>::from_data(TensorData::new(data.clone(), [1, 1, 3, hd]), &device);
    let y = rope.apply(x, 5).into_data().to_vec::<f32>().unwrap();
    for t in 0..3 {
        let (xr, yr) = (&data[t * hd..(t + 1) * hd], &y[t * hd..(t + 1) * hd]);
        // Pairs (i, i + 4): pairs 2 and 3 untouched, 0 and 1 rotated by angle p·f.
        for i in [2, 3] {
            assert!((xr[i] - yr[i]).abs() < TOL && (xr[i + 4] - yr[i + 4]).abs() < TOL);
        }
        for (i, f) in [(0usize, 1.0f32), (1, 0.1)] {
            let a = (5 + t) as f32 * f;
            let want0 = xr[i] * a.cos() - xr[i + 4] * a.sin();
            let want1 = xr[i + 4] * a.cos() + xr[i] * a.sin();
            assert!((yr[i] - want0).abs() < TOL && (yr[i + 4] - want1).abs() < TOL);
        }
    }
}

fn attention(window: Option<usize>, k_eq_v: bool) -> AttentionConfig {
    AttentionConfig {
        hidden: 16,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        qkv_bias: false,
        qk_norm: k_eq_v,
        v_norm: k_eq_v,
        k_eq_v,
        scale: None,
        sliding_window: window,
        norm_eps: 1e-6,
        inv_freq: Rope::new(vec![1.0, 0.3, 0.1, 0.01]).inv_freq,
    }
}

/// Token-by-token decoding through the cache equals one pass over the whole sequence, and a
/// sliding layer keeps only `window - 1` entries.
#[test]
fn cached_attention_equals_full_pass() {
    let device = Default::default();
    let src = RandomInit::<B>::new(&device, 7, 0.3);
    let data: Vec<f32> = (0..10 * 16).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let x = Tensor::<B, 3>::from_data(TensorData::new(data, [1, 10, 16]), &device);
    for (window, k_eq_v) in [(None, false), (Some(3), false), (Some(4), true)] {
        let attn = attention(window, k_eq_v).load(&src, "a").unwrap();
        let full = vec3(attn.forward(x.clone(), &mut KvCache::new()));
        let mut cache = KvCache::new();
        // A 4-token prefill, then one token at a time.
        let mut pieces = vec3(attn.forward(x.clone().narrow(1, 0, 4), &mut cache));
        for t in 4..10 {
            pieces.extend(vec3(attn.forward(x.clone().narrow(1, t, 1), &mut cache)));
            if let Some(w) = window {
                assert_eq!(cache.held(), w - 1);
            }
        }
        assert_eq!(cache.seen(), 10);
        let err = max_diff(&full, &pieces);
        assert!(err < TOL, "window {window:?}: cached vs full {err}");
    }
    // The window matters: a windowed layer differs from a full one past the window.
    let a = attention(Some(3), false).load(&src, "a").unwrap();
    let b = attention(None, false).load(&src, "a").unwrap();
    let (ya, yb) = (vec3(a.forward(x.clone(), &mut KvCache::new())), vec3(b.forward(x, &mut KvCache::new())));
    assert!(max_diff(&ya[..3 * 16], &yb[..3 * 16]) < TOL);
    assert!(max_diff(&ya, &yb) > 1e-3);
}

#[test]
fn router_renormalisation_and_expert_scale() {
    let device = Default::default();
    let src = RandomInit::<B>::new(&device, 3, 0.5);
    let x = Tensor::<B, 2>::from_data(
        TensorData::new((0..5 * 8).map(|i| (i as f32 * 0.31).cos()).collect::<Vec<_>>(), [5, 8]),
        &device,
    );
    let cfg = |renormalize, gemma_scaling| RouterConfig {
        hidden: 8,
        num_experts: 6,
        top_k: 2,
        renormalize,
        gemma_scaling,
        norm_eps: 1e-6,
    };
    let plain = cfg(false, false).load(&src, "r").unwrap().forward(x.clone());
    let renorm = cfg(true, false).load(&src, "r").unwrap().forward(x.clone());
    assert_eq!(plain.indices, renorm.indices);
    let p = plain.weights.into_data().to_vec::<f32>().unwrap();
    let r = renorm.weights.into_data().to_vec::<f32>().unwrap();
    let probs = plain.probs.into_data().to_vec::<f32>().unwrap();
    for tok in 0..5 {
        let s = p[2 * tok] + p[2 * tok + 1];
        assert!(s < 1.0 && (r[2 * tok] + r[2 * tok + 1] - 1.0).abs() < TOL);
        // The chosen probabilities are the two largest of the row.
        let mut row: Vec<f32> = probs[6 * tok..6 * tok + 6].to_vec();
        row.sort_by(|a, b| b.total_cmp(a));
        assert!((p[2 * tok] - row[0]).abs() < TOL && (p[2 * tok + 1] - row[1]).abs() < TOL);
    }
    // Gemma: the per-expert scale multiplies the renormalised weights.
    let g = cfg(true, true).load(&src, "g").unwrap();
    let scale = g.per_expert_scale.as_ref().unwrap().val().into_data().to_vec::<f32>().unwrap();
    let routed = g.forward(x);
    let w = routed.weights.into_data().to_vec::<f32>().unwrap();
    for tok in 0..5 {
        let (e0, e1) = (routed.indices[2 * tok], routed.indices[2 * tok + 1]);
        assert!((w[2 * tok] / scale[e0] + w[2 * tok + 1] / scale[e1] - 1.0).abs() < TOL);
    }
}

/// `Σ w²·x²` per gate+up input channel and `Σ w²·(silu(g)·u)²` per down input channel, in plain
/// loops over the routed (token, slot) pairs.
fn input_moments_reference(
    x: &[f32],
    gate_up: &[Vec<f32>],
    (h, i): (usize, usize),
    indices: &[usize],
    weights: &[f32],
    k: usize,
) -> Vec<Option<(Vec<f64>, Vec<f64>)>> {
    let mut out: Vec<Option<(Vec<f64>, Vec<f64>)>> = vec![None; gate_up.len()];
    for (slot, (&e, &w)) in indices.iter().zip(weights).enumerate() {
        let row = &x[(slot / k) * h..(slot / k + 1) * h];
        let (gu, dn) = out[e].get_or_insert_with(|| (vec![0.0; h], vec![0.0; i]));
        let w2 = (w as f64).powi(2);
        for (s, &v) in gu.iter_mut().zip(row) {
            *s += w2 * (v as f64).powi(2);
        }
        // gate_up is `[in, out]`: column j of gate, column i + j of up.
        for (j, d) in dn.iter_mut().enumerate() {
            let dot =
                |c: usize| (0..h).map(|r| row[r] as f64 * gate_up[e][r * 2 * i + c] as f64).sum::<f64>();
            let (g, u) = (dot(j), dot(i + j));
            let a = g / (1.0 + (-g).exp()) * u;
            *d += w2 * a * a;
        }
    }
    out
}

#[test]
fn expert_input_moments_match_reference() {
    let device = Default::default();
    let (h, i, e, k, t) = (12, 10, 5, 2, 9);
    let src = RandomInit::<B>::new(&device, 5, 0.4);
    let keys = pw_nn::ExpertKeys { fused: vec!["x".into()], per_expert: vec![] };
    let cfg = pw_nn::GatedMlpConfig { hidden: h, intermediate: i, act: pw_nn::Act::Silu };
    let pw_nn::Experts::Dense(experts) = pw_nn::Experts::<B>::load_dense(&src, &keys, e, cfg).unwrap() else {
        unreachable!()
    };
    let xs: Vec<f32> = (0..t * h).map(|j| (j as f32 * 0.37).sin()).collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(xs.clone(), [t, h]), &device);
    // Expert 4 is never chosen; expert 0 by most tokens.
    let indices: Vec<usize> =
        (0..t * k).map(|s| if s % k == 0 { (s / k) % 2 } else { 2 + (s / k) % 2 }).collect();
    let weights: Vec<f32> = (0..t * k).map(|s| 0.2 + 0.05 * s as f32).collect();
    let routing = pw_nn::Routing {
        indices: indices.clone(),
        weights: Tensor::<B, 2>::from_data(TensorData::new(weights.clone(), [t, k]), &device),
        probs: Tensor::<B, 2>::zeros([t, e], &device),
        k,
    };
    let got = experts.input_moments(x, &routing);
    let gate_up: Vec<Vec<f32>> =
        experts.gate_up.iter().map(|p| p.val().into_data().to_vec::<f32>().unwrap()).collect();
    let want = input_moments_reference(&xs, &gate_up, (h, i), &indices, &weights, k);
    assert_eq!(got.len(), e);
    for (ex, (g, w)) in got.into_iter().zip(want).enumerate() {
        match (g, w) {
            (None, None) => assert_eq!(ex, 4),
            (Some((gu, dn)), Some((wgu, wdn))) => {
                let gu = gu.into_data().to_vec::<f32>().unwrap();
                let dn = dn.into_data().to_vec::<f32>().unwrap();
                for (a, b) in gu.iter().zip(&wgu).chain(dn.iter().zip(&wdn)) {
                    assert!((*a as f64 - b).abs() <= 1e-5 * b.abs() + 1e-7, "expert {ex}: {a} vs {b}");
                }
            }
            (g, w) => panic!("expert {ex}: got {} want {}", g.is_some(), w.is_some()),
        }
    }
}
