//! Autodiff gradients of the expert weights against finite differences, in f64.
//!
//! A test binary of its own: Burn keys a device's default float type by device, shared by
//! `NdArray<f32>` and `NdArray<f64>`, and fixes it at first use; this process uses f64 only.

mod common;

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_ndarray::NdArray;
use common::{calib_ids, fixture};
use pw_calib::expert_gradients;
use pw_format::BlockKind;
use pw_hf::ModelConfig;
use pw_models::eval::token_nll;
use pw_models::{AnyModel, HfSource, LoadedModel};
use pw_nn::{ExpertLayout, LoadError, WeightSource};

type Cpu64 = NdArray<f64>;
type Ad64 = Autodiff<Cpu64>;

/// Autodiff gradient vs central finite difference (f64, step 2^-10): relative to the larger of
/// the two, plus an absolute floor for near-zero gradients.
const FD_RTOL: f64 = 1e-4;
const FD_ATOL: f64 = 1e-9;

/// A source that adds `delta` to one element of one tensor.
struct Perturbed<'a, B: Backend> {
    inner: HfSource<'a, B>,
    tensor: String,
    index: usize,
    delta: f32,
}

impl<B: Backend> WeightSource<B> for Perturbed<'_, B> {
    fn device(&self) -> B::Device {
        self.inner.device()
    }
    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }
    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        let mut v = self.inner.read(name, expected)?;
        if name == self.tensor {
            v[self.index] += self.delta;
        }
        Ok(v)
    }
}

/// Where element `(row, col)` of expert `e`'s `kind` block lives in the checkpoint.
fn checkpoint_element(
    layout: &ExpertLayout,
    e: usize,
    kind: BlockKind,
    (row, col): (usize, usize),
    (h, i): (usize, usize),
) -> (String, usize) {
    match (layout, kind) {
        (ExpertLayout::Fused { prefix }, BlockKind::GateUp) => {
            (format!("{prefix}.gate_up_proj"), (e * 2 * i + row) * h + col)
        }
        (ExpertLayout::Fused { prefix }, BlockKind::Down) => {
            (format!("{prefix}.down_proj"), (e * h + row) * i + col)
        }
        (ExpertLayout::PerExpert { prefix, names: [g, u, _] }, BlockKind::GateUp) => {
            let (n, r) = if row < i { (g, row) } else { (u, row - i) };
            (format!("{prefix}.{e}.{n}.weight"), r * h + col)
        }
        (ExpertLayout::PerExpert { prefix, names: [_, _, d] }, BlockKind::Down) => {
            (format!("{prefix}.{e}.{d}.weight"), row * i + col)
        }
    }
}

/// Autodiff gradients of expert weights equal central finite differences of the same loss,
/// for the gate, up and down projections, in the per-expert and the fused layout.
fn gradient_matches_finite_difference(name: &str) {
    let dir = fixture(name);
    let device = Default::default();
    let config = ModelConfig::from_dir(&dir).unwrap();
    let loaded = LoadedModel::<Ad64>::load(&dir, None, &device).unwrap();
    let window = calib_ids(12, 96, 3);
    let (loss, grads) = expert_gradients(&loaded.model, &loaded.banks, &window, &device);
    let hf = pw_hf::Checkpoint::open(&dir).unwrap();
    let loss_at = |tensor: &str, index: usize, delta: f32| -> f64 {
        let src =
            Perturbed { inner: HfSource::<Cpu64>::new(&hf, &device), tensor: tensor.into(), index, delta };
        let model = AnyModel::<Cpu64>::from_source(&config, &src).unwrap();
        let nll: Tensor<Cpu64, 2> = token_nll(&model, &[&window], &device);
        assert_eq!(nll.dtype(), DType::F64, "the finite differences must run in f64");
        nll.mean().into_scalar()
    };
    assert!((loss - loss_at("", 0, 0.0)).abs() < 1e-12, "autodiff and plain forward disagree on the loss");

    // Last MoE layer: a perturbation there cannot change any later routing decision.
    let bank_idx = loaded.banks.len() - 1;
    let bank = &loaded.banks[bank_idx];
    let (h, i) = (bank.cfg.hidden, bank.cfg.intermediate);
    let (e, g) = grads[bank_idx].iter().enumerate().find_map(|(e, g)| g.as_ref().map(|g| (e, g))).unwrap();
    let (gu, dn) = g.to_rows();
    let argmax = |v: &[f32], lo: usize, hi: usize| {
        (lo..hi).max_by(|&a, &b| v[a].abs().total_cmp(&v[b].abs())).unwrap()
    };
    // The largest gradient among gate rows, among up rows, and in down.
    let picks = [
        (BlockKind::GateUp, argmax(&gu, 0, i * h), &gu, h),
        (BlockKind::GateUp, argmax(&gu, i * h, 2 * i * h), &gu, h),
        (BlockKind::Down, argmax(&dn, 0, h * i), &dn, i),
    ];
    // A power of two: w ± step is exact in f32 for |w| < 2^13, so the step is exactly known.
    // Not smaller: Burn computes sigmoid (hence SiLU) in f32 even on an f64 backend, and that
    // rounding divided by the step would dominate the difference quotient.
    let step = 2f32.powi(-10);
    for (kind, flat, grad, cols) in picks {
        let (tensor, index) = checkpoint_element(&bank.layout, e, kind, (flat / cols, flat % cols), (h, i));
        let fd = (loss_at(&tensor, index, step) - loss_at(&tensor, index, -step)) / (2.0 * step as f64);
        let ad = grad[flat] as f64;
        let err = (ad - fd).abs();
        if std::env::var_os("PW_SHOW_ERR").is_some() {
            eprintln!("{name}: `{tensor}`[{index}]: autodiff {ad:e}, finite difference {fd:e}");
        }
        assert!(
            err <= FD_RTOL * ad.abs().max(fd.abs()) + FD_ATOL,
            "{name}: `{tensor}`[{index}]: autodiff {ad:e} vs finite difference {fd:e}"
        );
        assert!(ad.abs() > 1e-6, "{name}: the chosen gradient is too small to test anything: {ad:e}");
    }
}

#[test]
fn expert_gradients_match_finite_differences_per_expert_layout() {
    gradient_matches_finite_difference("mixtral");
}

#[test]
fn expert_gradients_match_finite_differences_fused_gemma4() {
    gradient_matches_finite_difference("gemma4");
}
