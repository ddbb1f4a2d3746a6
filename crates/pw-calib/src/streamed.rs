//! Layer-streamed importance of the expert weights, for models whose Fisher pass does not fit.
//!
//! One forward pass over the calibration windows holds one decoder layer at a time
//! ([`pw_models::LayerStream`]): every window's hidden state goes through layer `l`, each
//! expert's routed inputs add to its second moments ([`DenseExperts::input_moments`]), then the
//! layer is dropped and the next one read. The importance of weight `(r, c)` of a projection is
//! the second moment of its input channel `c` (routing weight squared included): the diagonal of
//! the input Gram matrix, to which the expected squared output error of perturbing that weight
//! is proportional. It is the same for every output row and needs no gradients, so the pass
//! holds the hidden states and one layer instead of the whole model and its gradients.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use pw_hf::{Checkpoint, ModelConfig};
use pw_models::LayerStream;
use pw_nn::{DenseExperts, ExpertLayout, Experts, GatedMlpConfig, KvCache};

use crate::CalibError;

/// Calibration windows of one length run through a layer together at most this many at a time.
pub(crate) const WINDOW_BATCH: usize = 8;

/// One MoE layer's layer-streamed importance.
#[derive(Debug, Clone)]
pub struct StreamedBank {
    /// Decoder layer index.
    pub layer: usize,
    /// Where the bank's weights live in the checkpoint.
    pub layout: ExpertLayout,
    /// Shape and activation of each expert.
    pub cfg: GatedMlpConfig,
    /// Per expert `[hidden]`: the weighted second moment of each gate+up input channel.
    pub gate_up: Vec<Vec<f32>>,
    /// Per expert `[intermediate]`: the same for the down projection's inputs.
    pub down: Vec<Vec<f32>>,
    /// Per expert: windows in which at least one token was routed to it.
    pub routed_windows: Vec<usize>,
    /// Per expert: the routing weights its tokens carried, summed over the calibration text.
    pub routing_mass: Vec<f64>,
}

/// Runs `windows` through the Hugging Face checkpoint in `model_dir` one layer at a time on
/// `device` and returns every MoE layer's importance, in layer order. `progress(done, total)`
/// is called after each layer.
pub fn streamed_importance<B: Backend>(
    model_dir: &Path,
    windows: &[&[u32]],
    device: &B::Device,
    progress: impl FnMut(usize, usize),
) -> Result<Vec<StreamedBank>, CalibError> {
    let mut out = Vec::new();
    streamed_importance_each::<B>(model_dir, windows, device, progress, |bank| {
        out.push(bank);
        true
    })?;
    Ok(out)
}

/// [`streamed_importance`] handing each MoE layer's bank to `on_bank` as soon as its layer is
/// done, so the caller can quantize a layer while the pass runs the next ones. The pass stops
/// after a bank for which `on_bank` returns false. Returns the banks handed over.
pub fn streamed_importance_each<B: Backend>(
    model_dir: &Path,
    windows: &[&[u32]],
    device: &B::Device,
    mut progress: impl FnMut(usize, usize),
    mut on_bank: impl FnMut(StreamedBank) -> bool,
) -> Result<usize, CalibError> {
    let config = ModelConfig::from_dir(model_dir)?;
    if config.routed_experts().iter().all(|&e| e == 0) {
        return Err(CalibError::NoExperts { dir: model_dir.to_path_buf() });
    }
    let ckpt = Checkpoint::open(model_dir)?;
    let stream = LayerStream::<B>::new(config, &ckpt, device);
    // Consecutive windows of one length share a batch.
    let mut batches: Vec<Vec<&[u32]>> = Vec::new();
    for w in windows {
        match batches.last_mut() {
            Some(b) if b.len() < WINDOW_BATCH && b[0].len() == w.len() => b.push(w),
            _ => batches.push(vec![w]),
        }
    }
    let ids = batches
        .iter()
        .map(|b| {
            let ids: Vec<i64> = b.iter().flat_map(|w| w.iter().map(|&t| t as i64)).collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b.len(), b[0].len()]), device)
        })
        .collect();
    let mut hidden = stream.embed(ids)?;
    let layers = stream.num_layers();
    let mut handed = 0;
    for l in 0..layers {
        let (layer, bank) = stream.layer(l)?;
        let mut acc = bank.as_ref().map(|b| Accumulator::new(b.num_experts));
        for (h, batch) in hidden.iter_mut().zip(&batches) {
            let (next, tap) = layer.forward(h.clone(), &mut KvCache::new());
            *h = next;
            if let (Some(acc), Some(tap), Some(bank)) = (acc.as_mut(), tap, bank.as_ref()) {
                let Experts::Dense(experts) = &bank.experts else {
                    unreachable!("a Hugging Face checkpoint loads dense experts")
                };
                acc.add(experts, tap.input, &tap.routing, batch[0].len())?;
            }
        }
        progress(l + 1, layers);
        if let (Some(acc), Some(bank)) = (acc, bank) {
            handed += 1;
            if !on_bank(acc.finish(bank.layer, bank.layout, bank.cfg)) {
                break;
            }
        }
    }
    Ok(handed)
}

/// One layer's sums, on the device until the layer is done.
struct Accumulator<B: Backend> {
    moments: Vec<Option<(Tensor<B, 1>, Tensor<B, 1>)>>,
    routed_windows: Vec<usize>,
    routing_mass: Vec<f64>,
}

impl<B: Backend> Accumulator<B> {
    fn new(experts: usize) -> Self {
        Self {
            moments: vec![None; experts],
            routed_windows: vec![0; experts],
            routing_mass: vec![0.0; experts],
        }
    }

    /// Adds one batch of windows of `len` tokens each.
    fn add(
        &mut self,
        experts: &DenseExperts<B>,
        input: Tensor<B, 2>,
        routing: &pw_nn::Routing<B>,
        len: usize,
    ) -> Result<(), CalibError> {
        let weights = routing.weights.clone().into_data().convert::<f64>();
        let weights = weights.as_slice::<f64>().map_err(|e| CalibError::Setting {
            setting: "routing weights",
            value: format!("{e:?}"),
            reason: "could not be read back from the device".into(),
        })?;
        let k = routing.k.max(1);
        let mut last_window = vec![usize::MAX; self.moments.len()];
        for (pos, (&e, &w)) in routing.indices.iter().zip(weights).enumerate() {
            self.routing_mass[e] += w;
            let window = pos / k / len;
            if last_window[e] != window {
                last_window[e] = window;
                self.routed_windows[e] += 1;
            }
        }
        for (sum, m) in self.moments.iter_mut().zip(experts.input_moments(input, routing)) {
            let Some((gu, dn)) = m else { continue };
            *sum = Some(match sum.take() {
                None => (gu, dn),
                Some((a, b)) => (a + gu, b + dn),
            });
        }
        Ok(())
    }

    fn finish(self, layer: usize, layout: ExpertLayout, cfg: GatedMlpConfig) -> StreamedBank {
        let host = |t: Tensor<B, 1>| t.into_data().convert::<f32>().to_vec::<f32>().expect("f32");
        let (gate_up, down) = self
            .moments
            .into_iter()
            .map(|m| match m {
                Some((gu, dn)) => (host(gu), host(dn)),
                None => (vec![0.0; cfg.hidden], vec![0.0; cfg.intermediate]),
            })
            .unzip();
        StreamedBank {
            layer,
            layout,
            cfg,
            gate_up,
            down,
            routed_windows: self.routed_windows,
            routing_mass: self.routing_mass,
        }
    }
}
