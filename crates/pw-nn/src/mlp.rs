//! Gated feed-forward blocks (SwiGLU / GeGLU).

use burn::module::Module;
use burn::tensor::activation::{gelu, gelu_approximate, silu};
use burn::tensor::{Tensor, backend::Backend};

use crate::linear::Linear;
use crate::source::{LoadError, WeightSource};

/// Gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// SiLU: SwiGLU.
    Silu,
    /// tanh-approximated GELU: GeGLU as in Gemma.
    GeluTanh,
    /// Exact GELU.
    Gelu,
}

impl Act {
    /// Applies the activation.
    pub fn apply<B: Backend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Act::Silu => silu(x),
            Act::GeluTanh => gelu_approximate(x),
            Act::Gelu => gelu(x),
        }
    }
}

/// Shape of a gated MLP.
#[derive(Debug, Clone, Copy)]
pub struct GatedMlpConfig {
    /// Model width.
    pub hidden: usize,
    /// Intermediate width.
    pub intermediate: usize,
    /// Gate activation.
    pub act: Act,
}

/// `down(act(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct GatedMlp<B: Backend> {
    /// Gate projection.
    pub gate: Linear<B>,
    /// Up projection.
    pub up: Linear<B>,
    /// Down projection.
    pub down: Linear<B>,
    /// Gate activation.
    #[module(skip)]
    pub act: Act,
}

impl GatedMlpConfig {
    /// Loads `{prefix}.{gate}`, `{prefix}.{up}`, `{prefix}.{down}` (e.g. `gate_proj`/`up_proj`/`down_proj`).
    pub fn load<B: Backend>(
        &self,
        src: &impl WeightSource<B>,
        prefix: &str,
        names: [&str; 3],
    ) -> Result<GatedMlp<B>, LoadError> {
        let (h, i) = (self.hidden, self.intermediate);
        Ok(GatedMlp {
            gate: Linear::load(src, &format!("{prefix}.{}", names[0]), h, i, false)?,
            up: Linear::load(src, &format!("{prefix}.{}", names[1]), h, i, false)?,
            down: Linear::load(src, &format!("{prefix}.{}", names[2]), i, h, false)?,
            act: self.act,
        })
    }
}

impl<B: Backend> GatedMlp<B> {
    /// # Shapes
    /// - `x`: `[..., hidden]`
    /// - output: `[..., hidden]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let g = self.act.apply(self.gate.forward(x.clone()));
        self.down.forward(g * self.up.forward(x))
    }
}
