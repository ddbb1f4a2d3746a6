//! The prompt-residual head: features, a planted linear relation, save/load, fine-tuning.

use burn::backend::Autodiff;
use burn::tensor::{Tensor, TensorData};
use burn_ndarray::NdArray;
use pw_planner::{
    BlockKind, CHANNEL_STATS, FEATURES_PER_LAYER, HeadTrainingConfig, ResidualHead, ResidualHeadConfig,
    inference_head, residual_features, residual_features_from_stats, train_residual_head,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

type B = NdArray<f32>;
type AB = Autodiff<NdArray<f32>>;

/// Features with very different scales and offsets (as raw log-statistics have), and targets
/// `M · tanh((x·W + b) / M)` from a planted `W`, `b`.
fn planted(rng: &mut StdRng, n: usize, cfg: &ResidualHeadConfig) -> (Vec<f32>, Vec<f32>) {
    let (f, o) = (cfg.n_features(), cfg.n_outputs());
    let scale: Vec<f64> = (0..f).map(|j| 10f64.powi(j as i32 % 4 - 2)).collect();
    let offset: Vec<f64> = (0..f).map(|j| (j as f64 - 3.0) * 2.0).collect();
    let w: Vec<f64> = (0..f * o).map(|k| rng.random_range(-0.3..0.3) / scale[k / o]).collect();
    let b: Vec<f64> = (0..o).map(|_| rng.random_range(-0.3..0.3)).collect();
    let mut x = Vec::with_capacity(n * f);
    let mut y = Vec::with_capacity(n * o);
    for _ in 0..n {
        let row: Vec<f64> = (0..f).map(|j| offset[j] + scale[j] * rng.random_range(-1.0..1.0)).collect();
        for k in 0..o {
            let mut z = b[k];
            for j in 0..f {
                z += (row[j] - offset[j]) * w[j * o + k];
            }
            let m = cfg.max_log_multiplier;
            y.push((m * (z / m).tanh()) as f32);
        }
        x.extend(row.iter().map(|v| *v as f32));
    }
    (x, y)
}

fn to_vec(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().to_vec().unwrap()
}

#[test]
fn head_learns_a_planted_linear_relation() {
    let dev = Default::default();
    let cfg = ResidualHeadConfig::new(3);
    let mut rng = StdRng::seed_from_u64(11);
    let (n, held) = (256, 64);
    let (x, y) = planted(&mut rng, n + held, &cfg);
    let (f, o) = (cfg.n_features(), cfg.n_outputs());
    let xt = Tensor::<AB, 2>::from_data(TensorData::new(x[..n * f].to_vec(), [n, f]), &dev);
    let yt = Tensor::<AB, 2>::from_data(TensorData::new(y[..n * o].to_vec(), [n, o]), &dev);
    let head = cfg.init::<AB>(&dev);
    let (head, report) = train_residual_head(head, xt, yt, &HeadTrainingConfig::new()).unwrap();
    eprintln!("{report:?}");
    assert!(report.initial_loss > 1e-2, "the planted relation is not trivial: {}", report.initial_loss);
    assert!(report.final_loss < 1e-4, "final loss {} ≥ 1e-4", report.final_loss);
    // Held-out samples of the same relation: predictions within 0.02 in log space.
    let inf = inference_head(&head);
    let pred = to_vec(inf.forward(Tensor::from_data(TensorData::new(x[n * f..].to_vec(), [held, f]), &dev)));
    let worst = pred.iter().zip(&y[n * o..]).map(|(p, t)| (p - t).abs()).fold(0f32, f32::max);
    assert!(worst < 0.02, "worst held-out error {worst}");
}

#[test]
fn untrained_head_is_neutral_and_outputs_are_bounded() {
    let dev = Default::default();
    let cfg = ResidualHeadConfig::new(2).with_max_log_multiplier(0.5);
    let head = cfg.init::<B>(&dev);
    let feats =
        Tensor::<B, 1>::from_data(TensorData::new(vec![3.0f32; cfg.n_features()], [cfg.n_features()]), &dev);
    let f = head.factors(feats.clone()).unwrap();
    assert_eq!(f.layers(), 2);
    assert!((0..2).all(|l| f.get(l, BlockKind::GateUp) == 1.0 && f.get(l, BlockKind::Down) == 1.0));
    // Huge weights cannot push a multiplier beyond e^±M.
    let mut head = head;
    head.linear.weight = burn::module::Param::from_tensor(
        Tensor::ones([cfg.n_features(), cfg.n_outputs()], &dev).mul_scalar(1e3),
    );
    let f = head.factors(feats).unwrap();
    for l in 0..2 {
        let v = f.get(l, BlockKind::Down);
        assert!(v <= 0.5f64.exp() + 1e-6 && v > 1.6, "{v}");
    }
    let e = head.factors(Tensor::zeros([3], &dev)).unwrap_err();
    assert!(e.to_string().contains("residual features"), "{e}");
}

#[test]
fn save_load_round_trip_and_fine_tuning_continues_from_the_loaded_head() {
    let dev = Default::default();
    let cfg = ResidualHeadConfig::new(2);
    let mut rng = StdRng::seed_from_u64(12);
    let n = 128;
    let (x, y) = planted(&mut rng, n, &cfg);
    let (f, o) = (cfg.n_features(), cfg.n_outputs());
    let xt = || Tensor::<AB, 2>::from_data(TensorData::new(x.clone(), [n, f]), &dev);
    let yt = Tensor::<AB, 2>::from_data(TensorData::new(y.clone(), [n, o]), &dev);
    let short = HeadTrainingConfig::new().with_epochs(30);
    let (head, r1) = train_residual_head(cfg.init::<AB>(&dev), xt(), yt.clone(), &short).unwrap();
    let dir = tempfile::tempdir().unwrap();
    head.save(dir.path()).unwrap();
    let loaded = ResidualHead::<AB>::load(dir.path(), &dev).unwrap();
    assert_eq!(loaded.config(), cfg);
    let a: Vec<f32> = head.forward(xt()).into_data().to_vec().unwrap();
    let b: Vec<f32> = loaded.forward(xt()).into_data().to_vec().unwrap();
    assert_eq!(a, b, "loaded head predicts the same");
    // Fine-tuning starts where the saved head left off.
    let (_, r2) = train_residual_head(loaded, xt(), yt, &short).unwrap();
    assert!(
        (r2.initial_loss - r1.final_loss).abs() <= 1e-4 * r1.final_loss.max(1e-6) + 1e-7,
        "{r1:?} {r2:?}"
    );
    assert!(r2.final_loss < r2.initial_loss, "{r2:?}");
    // A missing directory names the file.
    let e = ResidualHead::<B>::load(dir.path().join("nope"), &dev).unwrap_err();
    assert!(e.to_string().contains("residual_head.json"), "{e}");
}

#[test]
fn features_are_the_documented_statistics() {
    let dev = Default::default();
    // Layer 0: every value ±2 (mean|h| = rms = max = 2, energy spread evenly over 32 channels);
    // layer 1: one channel of 4s, the rest 0.
    let d = 32;
    let h0: Vec<f32> = (0..2 * 3 * d).map(|i| if i % 3 == 0 { -2.0 } else { 2.0 }).collect();
    let h1: Vec<f32> = (0..2 * 3 * d).map(|i| if i % d == 5 { 4.0 } else { 0.0 }).collect();
    let hidden = vec![
        Tensor::<B, 3>::from_data(TensorData::new(h0, [2, 3, d]), &dev),
        Tensor::<B, 3>::from_data(TensorData::new(h1, [2, 3, d]), &dev),
        Tensor::<B, 3>::zeros([2, 3, d], &dev),
    ];
    let f: Vec<f32> = residual_features(&hidden, 2).unwrap().into_data().to_vec().unwrap();
    assert_eq!(f.len(), 2 * FEATURES_PER_LAYER);
    let ln2 = 2f32.ln();
    let close = |a: f32, b: f32| (a - b).abs() < 1e-4;
    // Layer 0: ln 2, ln 2, top-2-of-32 energy = 2/32, ln(2/2) = 0.
    assert!(close(f[0], ln2) && close(f[1], ln2) && close(f[2], 2.0 / 32.0) && close(f[3], 0.0), "{f:?}");
    // Layer 1: mean|h| = 4/32, rms = sqrt(16/32), all energy in one channel, max/rms = 4/sqrt(0.5).
    assert!(close(f[4], (4.0f32 / 32.0).ln()) && close(f[5], 0.5f32.sqrt().ln()), "{f:?}");
    assert!(close(f[6], 1.0) && close(f[7], (4.0 / 0.5f32.sqrt()).ln()), "{f:?}");
    let e = residual_features(&hidden[..1], 2).unwrap_err();
    assert!(e.to_string().contains("residual stream"), "{e}");
}

/// The features from per-channel statistics (what the fast decoder accumulates) equal
/// `residual_features` of the same streams: random values of three layers, 7 tokens, 40
/// channels (top 2), one layer with an outlier channel.
#[test]
fn features_from_channel_statistics_match_the_tensor_features() {
    let dev = Default::default();
    let mut rng = StdRng::seed_from_u64(3);
    let (layers, tokens, d) = (3, 7, 40);
    let mut hidden = vec![];
    let mut stats = vec![0f32; layers * CHANNEL_STATS * d];
    for l in 0..layers {
        let h: Vec<f32> = (0..tokens * d)
            .map(|i| {
                rng.random_range(-1.0f32..1.0) * if l == 2 && i % d == 9 { 30.0 } else { 1.0 + l as f32 }
            })
            .collect();
        for (i, &v) in h.iter().enumerate() {
            let (c, base) = (i % d, l * CHANNEL_STATS * d);
            stats[base + c] += v.abs();
            stats[base + d + c] += v * v;
            stats[base + 2 * d + c] = stats[base + 2 * d + c].max(v.abs());
        }
        hidden.push(Tensor::<B, 3>::from_data(TensorData::new(h, [1, tokens, d]), &dev));
    }
    let want: Vec<f32> = residual_features(&hidden, layers).unwrap().into_data().to_vec().unwrap();
    let got = residual_features_from_stats(&stats, tokens, layers, d).unwrap();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!((a - b).abs() < 1e-4, "feature {i}: {a} vs {b}");
    }
    let e = residual_features_from_stats(&stats, tokens, layers + 1, d).unwrap_err();
    assert!(e.to_string().contains("residual statistics"), "{e}");
}
