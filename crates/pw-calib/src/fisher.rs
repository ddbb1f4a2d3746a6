//! Diagonal Fisher importance of the expert weights.
//!
//! One calibration window is one example: its loss is the mean next-token NLL of the window
//! ([`pw_models::eval::token_nll`]), and the importance of a weight is the sum over windows of
//! its squared gradient. Gradients come from Burn's autodiff through the whole model,
//! including the MoE dispatch (token gather, expert matmuls, weighted combine), so they are
//! exact for the loss the model computes.
//!
//! An expert that no token of a window is routed to takes no part in its loss: its gradient
//! is zero (Burn reports none). An expert never routed to over the whole calibration text
//! has zero importance, which the quantizer treats as uniform.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};
use pw_models::eval::token_nll_traced;
use pw_models::{AnyModel, ExpertBank, Trace};
use pw_nn::Experts;

/// One expert's gradient (or squared-gradient sum) in the parameter layout the model
/// multiplies by (`[in, out]`).
#[derive(Debug, Clone)]
pub struct ExpertGrad<B: Backend> {
    /// `[hidden, 2 · intermediate]`: gate columns, then up.
    pub gate_up: Tensor<B, 2>,
    /// `[intermediate, hidden]`.
    pub down: Tensor<B, 2>,
}

impl<B: Backend> ExpertGrad<B> {
    /// The two matrices in block (checkpoint) layout, rows = outputs: gate+up `[2I, H]` and
    /// down `[H, I]`, on the host.
    pub fn to_rows(&self) -> (Vec<f32>, Vec<f32>) {
        let host = |t: &Tensor<B, 2>| {
            t.clone().transpose().into_data().convert::<f32>().to_vec::<f32>().expect("f32")
        };
        (host(&self.gate_up), host(&self.down))
    }
}

/// The expert weight tensors of a bank, in expert order: `(gate_up, down)`.
fn bank_params<B: Backend>(bank: &ExpertBank<B>) -> Vec<(Tensor<B, 2>, Tensor<B, 2>)> {
    match &bank.experts {
        Experts::Dense(d) => d.gate_up.iter().zip(&d.down).map(|(g, w)| (g.val(), w.val())).collect(),
        // Calibration runs on dense checkpoints; a paged bank is already quantized and has no
        // trainable weights.
        Experts::External(_) => Vec::new(),
    }
}

/// Loss of one window (mean next-token NLL) and its gradient with respect to every expert
/// weight of every bank (`None` for an expert no token was routed to).
///
/// # Shapes
/// - `window`: at least 2 token ids
/// - output: per bank, per expert, an [`ExpertGrad`] (parameter layout)
#[allow(clippy::type_complexity)]
pub fn expert_gradients<B: AutodiffBackend>(
    model: &AnyModel<B>,
    banks: &[ExpertBank<B>],
    window: &[u32],
    device: &B::Device,
) -> (f64, Vec<Vec<Option<ExpertGrad<B::InnerBackend>>>>) {
    expert_gradients_traced(model, banks, window, device, None)
}

/// [`expert_gradients`] that also records the forward pass (router outputs) into `trace`.
#[allow(clippy::type_complexity)]
fn expert_gradients_traced<B: AutodiffBackend>(
    model: &AnyModel<B>,
    banks: &[ExpertBank<B>],
    window: &[u32],
    device: &B::Device,
    trace: Option<&mut Trace<B>>,
) -> (f64, Vec<Vec<Option<ExpertGrad<B::InnerBackend>>>>) {
    let loss = token_nll_traced(model, &[window], device, trace).mean();
    let value: f64 = loss.clone().into_scalar().elem();
    let grads = loss.backward();
    let per_bank = banks
        .iter()
        .map(|bank| {
            bank_params(bank)
                .into_iter()
                .map(|(gu, dn)| {
                    // Both projections of an expert see the same tokens: both or neither.
                    Some(ExpertGrad { gate_up: gu.grad(&grads)?, down: dn.grad(&grads)? })
                })
                .collect()
        })
        .collect();
    (value, per_bank)
}

/// Importance of one bank's experts, in block layout (rows = outputs).
#[derive(Debug, Clone, PartialEq)]
pub struct BankImportance {
    /// Per expert `[2I, H]` (gate rows, then up rows).
    pub gate_up: Vec<Vec<f32>>,
    /// Per expert `[H, I]`.
    pub down: Vec<Vec<f32>>,
    /// Per expert: windows in which at least one token was routed to it.
    pub routed_windows: Vec<usize>,
    /// Per expert: the routing weights its tokens carried, summed over the calibration text.
    pub routing_mass: Vec<f64>,
}

impl BankImportance {
    /// Per expert, its share of the layer's routing-weight mass (1 = an average expert; all 1
    /// when no mass was seen).
    pub fn mass_share(&self) -> Vec<f64> {
        crate::quantize::mass_share(&self.routing_mass)
    }
}

/// Running sum of squared per-window gradients, kept on the device.
#[derive(Debug)]
pub struct FisherPass<B: AutodiffBackend> {
    acc: Vec<Vec<Option<ExpertGrad<B::InnerBackend>>>>,
    routed: Vec<Vec<usize>>,
    mass: Vec<Vec<f64>>,
    windows: usize,
    loss_sum: f64,
}

impl<B: AutodiffBackend> FisherPass<B> {
    /// An empty pass over `banks`.
    pub fn new(banks: &[ExpertBank<B>]) -> Self {
        Self {
            acc: banks.iter().map(|b| vec![None; b.num_experts]).collect(),
            routed: banks.iter().map(|b| vec![0; b.num_experts]).collect(),
            mass: banks.iter().map(|b| vec![0.0; b.num_experts]).collect(),
            windows: 0,
            loss_sum: 0.0,
        }
    }

    /// Adds one window (one example) and returns its loss; its router outputs add to each
    /// expert's routing mass.
    pub fn add_window(
        &mut self,
        model: &AnyModel<B>,
        banks: &[ExpertBank<B>],
        window: &[u32],
        device: &B::Device,
    ) -> f64 {
        let mut trace = Trace::default();
        let (loss, grads) = expert_gradients_traced(model, banks, window, device, Some(&mut trace));
        for (mass, bank) in self.mass.iter_mut().zip(banks) {
            let Some(Some(r)) = trace.routing.get(bank.layer) else { continue };
            let w = r.weights.clone().into_data().convert::<f64>();
            for (&e, &w) in r.indices.iter().zip(w.as_slice::<f64>().unwrap_or_default()) {
                if let Some(m) = mass.get_mut(e) {
                    *m += w;
                }
            }
        }
        for ((acc, routed), bank) in self.acc.iter_mut().zip(&mut self.routed).zip(grads) {
            for ((a, r), g) in acc.iter_mut().zip(routed.iter_mut()).zip(bank) {
                let Some(g) = g else { continue };
                *r += 1;
                let sq = ExpertGrad { gate_up: g.gate_up.powi_scalar(2), down: g.down.powi_scalar(2) };
                *a = Some(match a.take() {
                    None => sq,
                    Some(s) => ExpertGrad { gate_up: s.gate_up + sq.gate_up, down: s.down + sq.down },
                });
            }
        }
        self.windows += 1;
        self.loss_sum += loss;
        loss
    }

    /// Windows added so far.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// Mean loss of the windows added so far.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.windows as f64
    }

    /// The importance of every bank on the host (zeros for never-routed experts).
    pub fn finish(self, banks: &[ExpertBank<B>]) -> Vec<BankImportance> {
        self.acc
            .into_iter()
            .zip(self.routed)
            .zip(self.mass)
            .zip(banks)
            .map(|(((acc, routed_windows), routing_mass), bank)| {
                let (h, i) = (bank.cfg.hidden, bank.cfg.intermediate);
                let (gate_up, down) = acc
                    .into_iter()
                    .map(|a| match a {
                        Some(g) => g.to_rows(),
                        None => (vec![0.0; 2 * i * h], vec![0.0; h * i]),
                    })
                    .unzip();
                BankImportance { gate_up, down, routed_windows, routing_mass }
            })
            .collect()
    }
}
