//! Top-k routing, expert banks and the sparse MoE block.
//!
//! The expert weights sit behind [`Experts`]: model code only calls
//! [`Experts::forward`] with a [`Routing`], so another storage (paged, quantized) is one more
//! enum variant here and no change in the model files.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::linear::Linear;
use crate::mlp::{Act, GatedMlp, GatedMlpConfig};
use crate::norm::RmsNorm;
use crate::source::{LoadError, WeightSource, transpose};

/// Which experts each token goes to, and with what weight.
#[derive(Debug, Clone)]
pub struct Routing<B: Backend> {
    /// Chosen experts, row-major `[tokens, k]`, in descending probability.
    pub indices: Vec<usize>,
    /// Weight of each choice, `[tokens, k]`.
    pub weights: Tensor<B, 2>,
    /// Full router probabilities, `[tokens, experts]`.
    pub probs: Tensor<B, 2>,
    /// Choices per token.
    pub k: usize,
}

/// Options of a softmax top-k router.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Model width.
    pub hidden: usize,
    /// Routed experts.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Divide the top-k probabilities by their sum (Mixtral, Gemma) or not (Qwen1.5-MoE).
    pub renormalize: bool,
    /// Gemma-4: the router reads `rms_norm(x) · scale · hidden^-0.5`, and its projection is
    /// `{prefix}.proj` with `{prefix}.scale` and `{prefix}.per_expert_scale`.
    pub gemma_scaling: bool,
    /// Epsilon of the Gemma router norm.
    pub norm_eps: f64,
}

/// Softmax over a linear projection, then top-k.
#[derive(Module, Debug)]
pub struct Router<B: Backend> {
    /// `[hidden] -> [experts]` logits.
    pub proj: Linear<B>,
    /// Gemma: weightless input norm.
    pub norm: Option<RmsNorm<B>>,
    /// Gemma: per-channel input scale, `[hidden]`.
    pub scale: Option<Param<Tensor<B, 1>>>,
    /// Gemma: per-expert output scale, `[experts]`.
    pub per_expert_scale: Option<Param<Tensor<B, 1>>>,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the chosen probabilities.
    pub renormalize: bool,
}

impl RouterConfig {
    /// Loads `{prefix}.weight` (Mixtral/Qwen `gate`) or the Gemma `{prefix}.proj` / `.scale` /
    /// `.per_expert_scale`.
    pub fn load<B: Backend>(&self, src: &impl WeightSource<B>, prefix: &str) -> Result<Router<B>, LoadError> {
        let (h, e) = (self.hidden, self.num_experts);
        Ok(if self.gemma_scaling {
            Router {
                proj: Linear::load(src, &format!("{prefix}.proj"), h, e, false)?,
                norm: Some(RmsNorm::weightless(self.norm_eps)),
                scale: Some(Param::from_tensor(src.tensor(&format!("{prefix}.scale"), [h])?)),
                per_expert_scale: Some(Param::from_tensor(
                    src.tensor(&format!("{prefix}.per_expert_scale"), [e])?,
                )),
                top_k: self.top_k,
                renormalize: self.renormalize,
            }
        } else {
            Router {
                proj: Linear::load(src, prefix, h, e, false)?,
                norm: None,
                scale: None,
                per_expert_scale: None,
                top_k: self.top_k,
                renormalize: self.renormalize,
            }
        })
    }
}

impl<B: Backend> Router<B> {
    /// Routes every token.
    ///
    /// # Shapes
    /// - `x`: `[tokens, hidden]`
    /// - output: [`Routing`] with `[tokens, k]` weights
    pub fn forward(&self, x: Tensor<B, 2>) -> Routing<B> {
        let [t, h] = x.dims();
        let mut x = x;
        if let Some(n) = &self.norm {
            x = n.forward(x);
        }
        if let Some(s) = &self.scale {
            x = x * s.val().unsqueeze_dim(0) * (h as f64).powf(-0.5);
        }
        let probs = softmax(self.proj.forward(x), 1);
        let (mut weights, idx) = probs.clone().topk_with_indices(self.top_k, 1);
        if self.renormalize {
            weights = weights.clone() / weights.sum_dim(1);
        }
        let indices: Vec<usize> = idx
            .clone()
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .expect("top-k indices are integers")
            .into_iter()
            .map(|i| i as usize)
            .collect();
        if let Some(pes) = &self.per_expert_scale {
            let flat: Tensor<B, 1, Int> = idx.reshape([t * self.top_k]);
            weights = weights * pes.val().select(0, flat).reshape([t, self.top_k]);
        }
        Routing { indices, weights, probs, k: self.top_k }
    }
}

/// Checkpoint names of an expert bank, tried in order: the fused transformers-5 layout
/// (`{prefix}.gate_up_proj [E, 2I, H]`, `{prefix}.down_proj [E, H, I]`) and the per-expert layout
/// (`{prefix}.{e}.{gate}.weight` etc.).
#[derive(Debug, Clone)]
pub struct ExpertKeys {
    /// Prefixes of fused tensors.
    pub fused: Vec<String>,
    /// Prefixes of per-expert tensors with the gate, up and down names.
    pub per_expert: Vec<(String, [&'static str; 3])>,
}

/// Which of the [`ExpertKeys`] layouts a checkpoint uses, resolved against a [`WeightSource`].
///
/// Everything that maps an expert bank to checkpoint tensors (dense loading, the quantizer,
/// the quantized checkpoint) goes through this one resolution, so they cannot disagree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `{prefix}.gate_up_proj [E, 2I, H]` and `{prefix}.down_proj [E, H, I]`.
    Fused {
        /// Tensor prefix, e.g. `model.layers.0.mlp.experts`.
        prefix: String,
    },
    /// `{prefix}.{e}.{gate|up|down}.weight`.
    PerExpert {
        /// Tensor prefix, e.g. `model.layers.0.block_sparse_moe.experts`.
        prefix: String,
        /// Gate, up and down projection names, e.g. `["w1", "w3", "w2"]`.
        names: [&'static str; 3],
    },
}

impl ExpertKeys {
    /// The first layout whose tensors `src` has: fused (`{p}.gate_up_proj`), then per expert
    /// (`{p}.0.{gate}.weight`).
    pub fn resolve<B: Backend>(&self, src: &impl WeightSource<B>) -> Result<ExpertLayout, LoadError> {
        if let Some(p) = self.fused.iter().find(|p| src.has(&format!("{p}.gate_up_proj"))) {
            return Ok(ExpertLayout::Fused { prefix: p.clone() });
        }
        if let Some((p, names)) =
            self.per_expert.iter().find(|(p, [g, _, _])| src.has(&format!("{p}.0.{g}.weight")))
        {
            return Ok(ExpertLayout::PerExpert { prefix: p.clone(), names: *names });
        }
        let mut tried: Vec<String> = self.fused.iter().map(|p| format!("{p}.gate_up_proj")).collect();
        tried.extend(self.per_expert.iter().map(|(p, [g, _, _])| format!("{p}.0.{g}.weight")));
        Err(LoadError::Missing { name: tried.join(" or ") })
    }
}

impl ExpertLayout {
    /// The tensor prefix of the bank.
    pub fn prefix(&self) -> &str {
        match self {
            Self::Fused { prefix } | Self::PerExpert { prefix, .. } => prefix,
        }
    }

    /// Every checkpoint tensor the bank of `num_experts` experts is read from.
    pub fn tensor_names(&self, num_experts: usize) -> Vec<String> {
        match self {
            Self::Fused { prefix } => vec![format!("{prefix}.gate_up_proj"), format!("{prefix}.down_proj")],
            Self::PerExpert { prefix, names } => (0..num_experts)
                .flat_map(|e| names.iter().map(move |n| format!("{prefix}.{e}.{n}.weight")))
                .collect(),
        }
    }

    /// The checkpoint tensors expert `e`'s gate+up and down projections come from.
    pub fn expert_sources(&self, e: usize) -> (Vec<String>, Vec<String>) {
        match self {
            Self::Fused { prefix } => {
                (vec![format!("{prefix}.gate_up_proj")], vec![format!("{prefix}.down_proj")])
            }
            Self::PerExpert { prefix, names: [g, u, d] } => (
                vec![format!("{prefix}.{e}.{g}.weight"), format!("{prefix}.{e}.{u}.weight")],
                vec![format!("{prefix}.{e}.{d}.weight")],
            ),
        }
    }

    /// Reads every expert in the checkpoint's own (output-major) layout: per expert the
    /// gate+up matrix `[2I, H]` (gate rows first) and the down matrix `[H, I]`.
    pub fn read_rows<B: Backend>(
        &self,
        src: &impl WeightSource<B>,
        num_experts: usize,
        cfg: GatedMlpConfig,
    ) -> Result<ExpertRows, LoadError> {
        let (e, h, i) = (num_experts, cfg.hidden, cfg.intermediate);
        let mut rows = ExpertRows { gate_up: Vec::with_capacity(e), down: Vec::with_capacity(e) };
        match self {
            Self::Fused { prefix } => {
                let gu = src.read(&format!("{prefix}.gate_up_proj"), &[e, 2 * i, h])?;
                let dn = src.read(&format!("{prefix}.down_proj"), &[e, h, i])?;
                rows.gate_up.extend(gu.chunks_exact(2 * i * h).map(<[f32]>::to_vec));
                rows.down.extend(dn.chunks_exact(h * i).map(<[f32]>::to_vec));
            }
            Self::PerExpert { prefix, names: [g, u, d] } => {
                for x in 0..e {
                    let mut both = src.read(&format!("{prefix}.{x}.{g}.weight"), &[i, h])?;
                    both.extend(src.read(&format!("{prefix}.{x}.{u}.weight"), &[i, h])?);
                    rows.gate_up.push(both);
                    rows.down.push(src.read(&format!("{prefix}.{x}.{d}.weight"), &[h, i])?);
                }
            }
        }
        Ok(rows)
    }
}

/// Host copies of an expert bank in checkpoint (output-major) layout, the layout of the
/// quantized blocks: rows are outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertRows {
    /// Per expert `[2 · intermediate, hidden]`: gate rows, then up rows.
    pub gate_up: Vec<Vec<f32>>,
    /// Per expert `[hidden, intermediate]`.
    pub down: Vec<Vec<f32>>,
}

/// Every expert of a layer as full-precision matrices, one pair per expert (the unit a paged
/// bank moves around).
#[derive(Module, Debug)]
pub struct DenseExperts<B: Backend> {
    /// Per expert `[hidden, 2 · intermediate]`: gate columns first, then up.
    pub gate_up: Vec<Param<Tensor<B, 2>>>,
    /// Per expert `[intermediate, hidden]`.
    pub down: Vec<Param<Tensor<B, 2>>>,
    /// Gate activation.
    #[module(skip)]
    pub act: Act,
}

/// An expert bank implemented outside this crate (the paged bank of `pw-linear`, whose weights
/// live in a page table on the device): the models only call [`ExpertBank::forward`].
pub trait ExpertBank<B: Backend>: Send + Sync + std::fmt::Debug {
    /// Number of routed experts.
    fn num_experts(&self) -> usize;

    /// Sum over each token's chosen experts of `weight · expert(x)`.
    ///
    /// # Shapes
    /// - `x`: `[tokens, hidden]`
    /// - output: `[tokens, hidden]`
    fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2>;

    /// The concrete bank, for callers that know its type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A shared handle on an [`ExpertBank`]. Its weights are not Burn parameters (they are not
/// trained or saved through Burn records), so the module skips them. Burn's derive cannot skip
/// a field generic over the backend (its autodiff mapping would have to change the bank's
/// backend), so the bank is stored type-erased and recovered in [`Self::bank`].
#[derive(Module, Debug)]
pub struct ExternalExperts<B: Backend> {
    #[module(skip)]
    bank: Arc<dyn Any + Send + Sync>,
    num_experts: usize,
    backend: PhantomData<B>,
}

/// What [`ExternalExperts`] stores.
struct BankOf<B: Backend>(Arc<dyn ExpertBank<B>>);

impl<B: Backend> ExternalExperts<B> {
    /// Wraps `bank`.
    pub fn new(bank: Arc<dyn ExpertBank<B>>) -> Self {
        let num_experts = bank.num_experts();
        Self { bank: Arc::new(BankOf(bank)), num_experts, backend: PhantomData }
    }

    /// The bank, or `None` when the module was mapped to another backend (e.g. the inner
    /// backend of autodiff), which an external bank does not follow.
    pub fn bank(&self) -> Option<&Arc<dyn ExpertBank<B>>> {
        self.bank.downcast_ref::<BankOf<B>>().map(|b| &b.0)
    }

    fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2> {
        self.bank()
            .expect("an external expert bank runs only on the backend it was built for")
            .forward(x, routing)
    }
}

/// The expert bank of one MoE layer.
#[derive(Module, Debug)]
pub enum Experts<B: Backend> {
    /// Full-precision weights, all resident.
    Dense(DenseExperts<B>),
    /// Weights in another storage (the paged any-precision bank).
    External(ExternalExperts<B>),
}

impl<B: Backend> DenseExperts<B> {
    /// Builds the bank from checkpoint-layout matrices (see [`ExpertRows`]), transposing them
    /// to the `[in, out]` layout the forward multiplies by.
    pub fn from_rows(rows: ExpertRows, cfg: GatedMlpConfig, device: &B::Device) -> Self {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let param = |m: Vec<f32>, r: usize, c: usize| {
            Param::from_tensor(Tensor::from_data(TensorData::new(transpose(&m, r, c), [c, r]), device))
        };
        Self {
            gate_up: rows.gate_up.into_iter().map(|m| param(m, 2 * i, h)).collect(),
            down: rows.down.into_iter().map(|m| param(m, h, i)).collect(),
            act: cfg.act,
        }
    }
}

impl<B: Backend> Experts<B> {
    /// Loads a dense bank of `num_experts` SwiGLU/GeGLU experts from either layout.
    pub fn load_dense(
        src: &impl WeightSource<B>,
        keys: &ExpertKeys,
        num_experts: usize,
        cfg: GatedMlpConfig,
    ) -> Result<Self, LoadError> {
        let rows = keys.resolve(src)?.read_rows(src, num_experts, cfg)?;
        // One matrix pair per expert: the unit a paged bank will move and re-quantize.
        Ok(Experts::Dense(DenseExperts::from_rows(rows, cfg, &src.device())))
    }

    /// Number of experts.
    pub fn num_experts(&self) -> usize {
        match self {
            Experts::Dense(d) => d.gate_up.len(),
            Experts::External(e) => e.num_experts,
        }
    }

    /// Sum over each token's chosen experts of `weight · expert(x)`.
    ///
    /// # Shapes
    /// - `x`: `[tokens, hidden]`
    /// - output: `[tokens, hidden]`
    pub fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2> {
        match self {
            Experts::Dense(d) => d.forward(x, routing),
            Experts::External(e) => e.forward(x, routing),
        }
    }
}

impl<B: Backend> DenseExperts<B> {
    fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2> {
        let [t, h] = x.dims();
        let e = self.gate_up.len();
        let [_, i2] = self.gate_up[0].dims();
        let i = i2 / 2;
        let k = routing.k;
        let device = x.device();
        // Group (token, slot) pairs by expert, as the HF eager loop does.
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); e];
        for (pos, &ex) in routing.indices.iter().enumerate() {
            by_expert[ex].push((pos / k, pos));
        }
        let flat_w = routing.weights.clone().reshape([t * k, 1]);
        // Expert outputs are stacked expert by expert, then gathered back into (token, slot)
        // order and summed over the slots: a functional combine, no in-place scatter.
        let mut outputs = Vec::with_capacity(e);
        let mut row_of_slot = vec![0i64; t * k];
        let mut row = 0i64;
        for (ex, pairs) in by_expert.iter().enumerate() {
            if pairs.is_empty() {
                continue;
            }
            let n = pairs.len();
            let tok = Tensor::<B, 1, Int>::from_data(
                TensorData::new(pairs.iter().map(|p| p.0 as i64).collect::<Vec<_>>(), [n]),
                &device,
            );
            let slot = Tensor::<B, 1, Int>::from_data(
                TensorData::new(pairs.iter().map(|p| p.1 as i64).collect::<Vec<_>>(), [n]),
                &device,
            );
            let xs = x.clone().select(0, tok);
            let gu = xs.matmul(self.gate_up[ex].val());
            let g = gu.clone().narrow(1, 0, i);
            let u = gu.narrow(1, i, i);
            let y = (self.act.apply(g) * u).matmul(self.down[ex].val());
            outputs.push(y * flat_w.clone().select(0, slot));
            for p in pairs {
                row_of_slot[p.1] = row;
                row += 1;
            }
        }
        let order = Tensor::<B, 1, Int>::from_data(TensorData::new(row_of_slot, [t * k]), &device);
        Tensor::cat(outputs, 0).select(0, order).reshape([t, k, h]).sum_dim(1).reshape([t, h])
    }

    /// Per expert, the second moments of what its two projections read, each routed token
    /// weighted by its routing weight squared (the factor the expert's output is scaled by):
    /// `Σ w²·x²` over the gate+up input channels and `Σ w²·(act(g)·u)²` over the down input
    /// channels. `None` for an expert no token chose. These are the diagonal of each
    /// projection's weighted input Gram matrix, the importance a layer-at-a-time calibration
    /// pass can gather without gradients.
    ///
    /// # Shapes
    /// - `x`: `[tokens, hidden]` (the experts' input)
    /// - output: per expert, `([hidden], [intermediate])`
    pub fn input_moments(
        &self,
        x: Tensor<B, 2>,
        routing: &Routing<B>,
    ) -> Vec<Option<(Tensor<B, 1>, Tensor<B, 1>)>> {
        let [t, _] = x.dims();
        let k = routing.k;
        let device = x.device();
        let [_, i2] = self.gate_up[0].dims();
        let i = i2 / 2;
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.gate_up.len()];
        for (pos, &ex) in routing.indices.iter().enumerate() {
            by_expert[ex].push((pos / k, pos));
        }
        let w2 = routing.weights.clone().reshape([t * k, 1]).powi_scalar(2);
        by_expert
            .iter()
            .enumerate()
            .map(|(ex, pairs)| {
                if pairs.is_empty() {
                    return None;
                }
                let n = pairs.len();
                let ids = |f: fn(&(usize, usize)) -> usize| {
                    Tensor::<B, 1, Int>::from_data(
                        TensorData::new(pairs.iter().map(|p| f(p) as i64).collect::<Vec<_>>(), [n]),
                        &device,
                    )
                };
                let xs = x.clone().select(0, ids(|p| p.0));
                let ws = w2.clone().select(0, ids(|p| p.1));
                let gu = xs.clone().matmul(self.gate_up[ex].val());
                let a = self.act.apply(gu.clone().narrow(1, 0, i)) * gu.narrow(1, i, i);
                let moment = |m: Tensor<B, 2>| {
                    let c = m.dims()[1];
                    (m.powi_scalar(2) * ws.clone()).sum_dim(0).reshape([c])
                };
                Some((moment(xs), moment(a)))
            })
            .collect()
    }
}

/// An always-on expert whose output is scaled by `sigmoid(gate(x))` (Qwen1.5-MoE).
#[derive(Module, Debug)]
pub struct SharedExpert<B: Backend> {
    /// The expert MLP.
    pub mlp: GatedMlp<B>,
    /// `[hidden] -> [1]` gate.
    pub gate: Linear<B>,
}

impl<B: Backend> SharedExpert<B> {
    /// Loads `{mlp_prefix}.{gate,up,down}_proj` and `{gate_prefix}.weight`.
    pub fn load(
        src: &impl WeightSource<B>,
        mlp_prefix: &str,
        gate_prefix: &str,
        cfg: GatedMlpConfig,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            mlp: cfg.load(src, mlp_prefix, ["gate_proj", "up_proj", "down_proj"])?,
            gate: Linear::load(src, gate_prefix, cfg.hidden, 1, false)?,
        })
    }

    /// # Shapes
    /// - `x`: `[tokens, hidden]`
    /// - output: `[tokens, hidden]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        sigmoid(self.gate.forward(x.clone())) * self.mlp.forward(x)
    }
}

/// Router + experts (+ optional shared expert): the Mixtral / Qwen2-MoE sparse block.
#[derive(Module, Debug)]
pub struct SparseMoe<B: Backend> {
    /// Top-k router.
    pub router: Router<B>,
    /// Routed experts.
    pub experts: Experts<B>,
    /// Shared expert.
    pub shared: Option<SharedExpert<B>>,
}

impl<B: Backend> SparseMoe<B> {
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]`
    /// - output: `[batch, seq, hidden]` and the routing of the `batch · seq` tokens
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Routing<B>) {
        let [b, t, h] = x.dims();
        let flat = x.reshape([b * t, h]);
        let routing = self.router.forward(flat.clone());
        let mut y = self.experts.forward(flat.clone(), &routing);
        if let Some(s) = &self.shared {
            y = y + s.forward(flat);
        }
        (y.reshape([b, t, h]), routing)
    }
}
