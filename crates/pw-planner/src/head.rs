//! The prompt-residual head: cheap statistics of the prompt's residual stream per layer → a
//! bounded linear regression → per-(layer, block kind) multipliers on the global sensitivity.
//!
//! # Features
//! [`residual_features`] computes, for the residual stream entering each layer (the embedding
//! output for layer 0, the previous layer's output after that), over all prompt tokens:
//! `ln mean|h|`, `ln rms(h)`, the fraction of energy in the top `max(1, H/16)` channels (mean
//! square per channel), and `ln(max|h| / rms(h))` (outliers): [`FEATURES_PER_LAYER`] per layer,
//! layer-major. All are tensor reductions on the model's device and come back in one read.
//!
//! # Output bound
//! `y = M · tanh(z / M)` with `M = max_log_multiplier`: multipliers stay within `[e^−M, e^M]`
//! whatever the features, so an out-of-distribution prompt cannot blow the plan up.

use std::path::Path;

use burn::config::Config;
use burn::module::{AutodiffModule, Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use crate::{PlanError, ResidualFactors};

/// Features per layer computed by [`residual_features`].
pub const FEATURES_PER_LAYER: usize = 4;
/// File name of the head's config next to a checkpoint.
pub const HEAD_CONFIG_FILE: &str = "residual_head.json";
/// File name of the head's weights (Burn named MessagePack) next to a checkpoint.
pub const HEAD_WEIGHTS_FILE: &str = "residual_head.mpk";

/// Options of a [`ResidualHead`].
#[derive(Config, Debug, PartialEq)]
pub struct ResidualHeadConfig {
    /// Decoder layers of the model.
    pub layers: usize,
    /// Bound `M` on `|ln multiplier|`: multipliers stay in `[e^−M, e^M]` (default 2: 0.14..7.4,
    /// room for the bias to carry a layer's static miscalibration of the SSE sensitivity).
    #[config(default = 2.0)]
    pub max_log_multiplier: f64,
}

impl ResidualHeadConfig {
    /// Input width: [`FEATURES_PER_LAYER`] · layers.
    pub fn n_features(&self) -> usize {
        FEATURES_PER_LAYER * self.layers
    }

    /// Output width: 2 · layers (gate_up, down per layer).
    pub fn n_outputs(&self) -> usize {
        2 * self.layers
    }

    /// A head that predicts multiplier 1 everywhere (zero weights) until trained.
    pub fn init<B: Backend>(&self, device: &B::Device) -> ResidualHead<B> {
        let linear = LinearConfig::new(self.n_features(), self.n_outputs())
            .with_initializer(Initializer::Zeros)
            .init(device);
        ResidualHead { linear, layers: self.layers, max_log: self.max_log_multiplier }
    }
}

/// The bounded linear regression head: `[features] → [2 · layers]` log-multipliers.
///
/// # Target
/// The head predicts `y[l, k] = ln(multiplier)` for layer `l`, block kind `k` (gate_up, down).
/// On a calibration prompt `p`, lowering every expert block of kind `k` in layer `l` to a low
/// bit-width gives a measured damage `KL_p(l, k)` (mean per-token KL of the output
/// distributions) and the global sensitivity predicts `S(l, k)` (sum of the blocks' SSE
/// increase). The training target is `y_p(l, k) = ln(KL_p(l, k) / S(l, k)) − c`, with `c` the
/// mean of `ln(KL / S)` over all prompts and blocks: the planner's greedy order only depends on
/// damage ratios, so a global constant carries no information, and centring keeps an untrained
/// head (zero output) neutral. The bias then learns the static miscalibration of `S` between
/// layers and kinds, the weights how a prompt shifts it.
#[derive(Module, Debug)]
pub struct ResidualHead<B: Backend> {
    /// `[n_features, n_outputs]` on raw (unnormalised) features: training folds its
    /// normalisation into the weights.
    pub linear: Linear<B>,
    layers: usize,
    max_log: f64,
}

impl<B: Backend> ResidualHead<B> {
    /// The config this head was built with.
    pub fn config(&self) -> ResidualHeadConfig {
        ResidualHeadConfig { layers: self.layers, max_log_multiplier: self.max_log }
    }

    /// Bounded log-multipliers `M · tanh(linear(x) / M)`.
    ///
    /// # Shapes
    /// - `features`: `[batch, FEATURES_PER_LAYER · layers]`
    /// - output: `[batch, 2 · layers]`, column `2l + k` for layer `l`, kind `k` (0 gate_up, 1 down)
    pub fn forward(&self, features: Tensor<B, 2>) -> Tensor<B, 2> {
        let m = self.max_log;
        self.linear.forward(features).div_scalar(m).tanh().mul_scalar(m)
    }

    /// Multipliers of one prompt, ready for the planner.
    ///
    /// # Shapes
    /// - `features`: `[FEATURES_PER_LAYER · layers]`
    pub fn factors(&self, features: Tensor<B, 1>) -> Result<ResidualFactors, PlanError> {
        let n = self.config().n_features();
        if features.dims()[0] != n {
            return Err(PlanError::Shape {
                what: "residual features".into(),
                reason: format!("{} values, the head takes {n}", features.dims()[0]),
            });
        }
        let y = self.forward(features.unsqueeze_dim(0)).exp();
        let v: Vec<f64> = y.into_data().convert::<f64>().to_vec().map_err(|e| PlanError::Shape {
            what: "residual head output".into(),
            reason: format!("{e:?}"),
        })?;
        ResidualFactors::new(self.layers, v)
    }

    /// Writes [`HEAD_CONFIG_FILE`] and [`HEAD_WEIGHTS_FILE`] into `dir` (e.g. the checkpoint).
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<(), PlanError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
        let cfg = dir.join(HEAD_CONFIG_FILE);
        self.config().save(&cfg).map_err(|e| file_err(&cfg, e))?;
        let w = dir.join(HEAD_WEIGHTS_FILE);
        let rec = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        self.clone().save_file(w.clone(), &rec).map_err(|e| file_err(&w, e))
    }

    /// Reads a head saved by [`ResidualHead::save`] from `dir`.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, PlanError> {
        let dir = dir.as_ref();
        let cfg_path = dir.join(HEAD_CONFIG_FILE);
        let cfg = ResidualHeadConfig::load(&cfg_path).map_err(|e| file_err(&cfg_path, e))?;
        let w = dir.join(HEAD_WEIGHTS_FILE);
        let rec = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        cfg.init(device).load_file(w.clone(), &rec, device).map_err(|e| file_err(&w, e))
    }
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> PlanError {
    PlanError::File { path: path.to_path_buf(), reason: e.to_string() }
}

/// Features of a prompt's residual stream. For the stream entering each layer (the embedding
/// output for layer 0, the previous layer's output after that), over all prompt tokens:
/// `ln mean|h|`, `ln rms(h)`, the fraction of energy in the top `max(1, H/16)` channels (mean
/// square per channel), and `ln(max|h| / rms(h))` (outliers): [`FEATURES_PER_LAYER`] per layer,
/// layer-major. All are tensor reductions on the model's device, read back once by the caller.
///
/// # Shapes
/// - `hidden`: at least `layers` tensors `[batch, seq, hidden]`; entry `l` is the stream
///   entering layer `l` (pw-models' `Trace::hidden` has exactly this layout plus the final output)
/// - output: `[FEATURES_PER_LAYER · layers]`
pub fn residual_features<B: Backend>(
    hidden: &[Tensor<B, 3>],
    layers: usize,
) -> Result<Tensor<B, 1>, PlanError> {
    if hidden.len() < layers || layers == 0 {
        return Err(PlanError::Shape {
            what: "residual stream".into(),
            reason: format!(
                "{} hidden states for {layers} layers (need one entering each layer)",
                hidden.len()
            ),
        });
    }
    let eps = 1e-12;
    let mut parts = Vec::with_capacity(layers * FEATURES_PER_LAYER);
    for (l, h) in hidden[..layers].iter().enumerate() {
        let [b, s, d] = h.dims();
        if b * s == 0 || d == 0 {
            return Err(PlanError::Shape {
                what: format!("residual stream entering layer {l}"),
                reason: format!("shape [{b}, {s}, {d}] has no values"),
            });
        }
        let flat: Tensor<B, 2> = h.clone().reshape([b * s, d]);
        let sq = flat.clone().powi_scalar(2);
        let mean_abs = flat.clone().abs().mean();
        let ms = sq.clone().mean();
        let rms = ms.clone().sqrt();
        let energy: Tensor<B, 1> = sq.mean_dim(0).reshape([d]);
        let k = (d / 16).max(1);
        let top = energy.clone().topk(k, 0).sum().div(energy.sum().add_scalar(eps));
        let peak = flat.abs().max().div(rms.clone().add_scalar(eps));
        parts.push(mean_abs.add_scalar(eps).log());
        parts.push(rms.add_scalar(eps).log());
        parts.push(top);
        parts.push(peak.add_scalar(eps).log());
    }
    Ok(Tensor::cat(parts, 0))
}

/// Statistics per channel that [`residual_features_from_stats`] reads: the sum of `|h|`, the sum
/// of `h²` and the largest `|h|` over the prompt's tokens.
pub const CHANNEL_STATS: usize = 3;

/// [`residual_features`] on the host from per-channel statistics of the stream entering each
/// layer over a prompt of `tokens` tokens, as a decoder accumulates them on its device without
/// reading the stream back.
///
/// # Shapes
/// - `stats`: `[layers, CHANNEL_STATS, width]` (Σ|h|, Σh², max|h| per channel)
/// - output: `[FEATURES_PER_LAYER · layers]`
pub fn residual_features_from_stats(
    stats: &[f32],
    tokens: usize,
    layers: usize,
    width: usize,
) -> Result<Vec<f32>, PlanError> {
    if tokens == 0 || layers == 0 || width == 0 || stats.len() != layers * CHANNEL_STATS * width {
        return Err(PlanError::Shape {
            what: "residual statistics".into(),
            reason: format!(
                "{} values over {tokens} tokens, expected {layers} layers x {CHANNEL_STATS} x {width} channels",
                stats.len()
            ),
        });
    }
    let eps = 1e-12;
    let n = (tokens * width) as f64;
    let mut out = Vec::with_capacity(FEATURES_PER_LAYER * layers);
    for l in stats.chunks(CHANNEL_STATS * width) {
        let (abs, sq, peak) = (&l[..width], &l[width..2 * width], &l[2 * width..]);
        let mean_abs = abs.iter().map(|&v| v as f64).sum::<f64>() / n;
        let rms = (sq.iter().map(|&v| v as f64).sum::<f64>() / n).sqrt();
        let mut energy: Vec<f64> = sq.iter().map(|&v| v as f64 / tokens as f64).collect();
        let total: f64 = energy.iter().sum();
        energy.sort_by(|a, b| b.total_cmp(a));
        let top = energy[..(width / 16).max(1)].iter().sum::<f64>() / (total + eps);
        let max = peak.iter().fold(0f32, |m, &v| m.max(v)) as f64;
        out.extend(
            [(mean_abs + eps).ln(), (rms + eps).ln(), top, (max / (rms + eps) + eps).ln()].map(|v| v as f32),
        );
    }
    Ok(out)
}

/// Options of [`train_residual_head`].
#[derive(Config, Debug)]
pub struct HeadTrainingConfig {
    /// Full-batch Adam steps.
    #[config(default = 1500)]
    pub epochs: usize,
    /// Adam learning rate (on standardised features).
    #[config(default = 0.02)]
    pub learning_rate: f64,
    /// L2 penalty on the standardised-space weights (ridge), against few prompts and many
    /// correlated features.
    #[config(default = 1e-4)]
    pub l2: f64,
}

/// What training did.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// Mean squared error of the log-multipliers before training.
    pub initial_loss: f64,
    /// Mean squared error after training.
    pub final_loss: f64,
    /// Steps taken.
    pub epochs: usize,
}

/// Fits `head` to `(features, target log-multipliers)` pairs with Adam on the mean squared
/// error (plus ridge). Starts from the head's current weights, so the same call fine-tunes a
/// loaded head on new prompts. Features are standardised for the optimisation and the
/// standardisation is folded back into the weights, so the returned head takes raw features.
/// Targets are clipped to 0.999 of the output bound.
///
/// # Shapes
/// - `features`: `[samples, FEATURES_PER_LAYER · layers]`
/// - `targets`: `[samples, 2 · layers]`
pub fn train_residual_head<B: AutodiffBackend>(
    head: ResidualHead<B>,
    features: Tensor<B, 2>,
    targets: Tensor<B, 2>,
    config: &HeadTrainingConfig,
) -> Result<(ResidualHead<B>, TrainReport), PlanError> {
    let cfg = head.config();
    let [n, f] = features.dims();
    let [nt, o] = targets.dims();
    if n == 0 || nt != n || f != cfg.n_features() || o != cfg.n_outputs() {
        return Err(PlanError::Shape {
            what: "training data".into(),
            reason: format!(
                "features [{n}, {f}] and targets [{nt}, {o}]; the head takes [N, {}] → [N, {}] with N ≥ 1",
                cfg.n_features(),
                cfg.n_outputs()
            ),
        });
    }
    let device = features.device();
    let host = |t: Tensor<B, 2>, what: &str| -> Result<Vec<f32>, PlanError> {
        t.into_data()
            .convert::<f32>()
            .to_vec()
            .map_err(|e| PlanError::Shape { what: what.into(), reason: format!("{e:?}") })
    };
    let x = host(features.clone(), "training features")?;
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(PlanError::Shape {
            what: "training features".into(),
            reason: format!("sample {} feature {} is {}", i / f, i % f, x[i]),
        });
    }
    // Standardisation on the host: N·F is small (prompts × a few features per layer).
    let mut mean = vec![0f64; f];
    let mut std = vec![0f64; f];
    for r in x.chunks(f) {
        for (m, v) in mean.iter_mut().zip(r) {
            *m += *v as f64 / n as f64;
        }
    }
    for r in x.chunks(f) {
        for ((s, v), m) in std.iter_mut().zip(r).zip(&mean) {
            *s += (*v as f64 - m).powi(2) / n as f64;
        }
    }
    for (s, m) in std.iter_mut().zip(&mean) {
        *s = s.sqrt();
        // A constant feature carries nothing; scale 1 keeps its (zero) column finite.
        if *s <= 1e-6 * (1.0 + m.abs()) {
            *s = 1.0;
        }
    }
    let row = |v: &[f64]| {
        Tensor::<B, 1>::from_data(TensorData::new(v.iter().map(|x| *x as f32).collect(), [f]), &device)
    };
    let (mean_t, std_t) = (row(&mean).unsqueeze_dim::<2>(0), row(&std).unsqueeze_dim::<2>(0));
    let xn = (features.clone() - mean_t.clone()) / std_t.clone();
    let bound = 0.999 * cfg.max_log_multiplier;
    let y = targets.clamp(-bound, bound);

    // Unfold: W_n = diag(std)·W, b_n = b + mean·W.
    let std_col: Tensor<B, 2> = std_t.clone().transpose();
    let w = head.linear.weight.val();
    let b = head.linear.bias.as_ref().map(|b| b.val()).unwrap_or_else(|| Tensor::zeros([o], &device));
    let wn = w.clone() * std_col.clone();
    let bn = b + mean_t.clone().matmul(w).reshape([o]);
    let mut norm_head = set_linear(head, wn, bn);

    let mse = |h: &ResidualHead<B>, x: Tensor<B, 2>| -> Tensor<B, 1> {
        (h.forward(x) - y.clone()).powi_scalar(2).mean()
    };
    let initial_loss = scalar(mse(&norm_head, xn.clone()))?;
    let mut optim = AdamConfig::new().init::<B, ResidualHead<B>>();
    for _ in 0..config.epochs {
        let reg = norm_head.linear.weight.val().powi_scalar(2).sum().mul_scalar(config.l2);
        let loss = mse(&norm_head, xn.clone()) + reg;
        let grads = GradientsParams::from_grads(loss.backward(), &norm_head);
        norm_head = optim.step(config.learning_rate, norm_head, grads);
    }

    // Fold: W = diag(1/std)·W_n, b = b_n − (mean/std)·W_n.
    let wn = norm_head.linear.weight.val().detach();
    let bn = norm_head
        .linear
        .bias
        .as_ref()
        .map(|b| b.val().detach())
        .unwrap_or_else(|| Tensor::zeros([o], &device));
    let w = wn.clone() / std_col;
    let b = bn - (mean_t / std_t).matmul(wn).reshape([o]);
    let head = set_linear(norm_head, w, b);
    let final_loss = scalar(mse(&head, features))?;
    Ok((head, TrainReport { initial_loss, final_loss, epochs: config.epochs }))
}

fn set_linear<B: Backend>(mut head: ResidualHead<B>, w: Tensor<B, 2>, b: Tensor<B, 1>) -> ResidualHead<B> {
    // Fresh leaves: the values were computed from other tensors' graphs.
    head.linear.weight = Param::from_tensor(w.detach());
    head.linear.bias = Some(Param::from_tensor(b.detach()));
    head
}

fn scalar<B: Backend>(t: Tensor<B, 1>) -> Result<f64, PlanError> {
    t.into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .map_err(|e| PlanError::Shape { what: "loss".into(), reason: format!("{e:?}") })
        .map(|v| v[0])
}

/// The inference copy of a trained head (drops the autodiff graph).
pub fn inference_head<B: AutodiffBackend>(head: &ResidualHead<B>) -> ResidualHead<B::InnerBackend> {
    head.valid()
}
