//! RMSNorm in the variants the families use.

use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};

use crate::source::{LoadError, WeightSource};

/// How the learned weight enters the normalisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `x̂ · w` (Llama, Mixtral, Qwen, Gemma-4).
    Scale,
    /// `x̂ · (1 + w)` (Gemma 1–3, whose checkpoints store the offset from one).
    OnePlus,
    /// `x̂` alone: no weight is stored (Gemma-4 v_norm and router norm).
    Weightless,
}

/// Root-mean-square normalisation over the last dimension.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[dim]`, absent for [`NormKind::Weightless`].
    pub weight: Option<Param<Tensor<B, 1>>>,
    /// Added to the mean square.
    pub eps: f64,
    /// Whether the weight is stored as an offset from one.
    pub one_plus: bool,
}

impl<B: Backend> RmsNorm<B> {
    /// Loads `{prefix}.weight` unless `kind` is weightless.
    pub fn load(
        src: &impl WeightSource<B>,
        prefix: &str,
        dim: usize,
        eps: f64,
        kind: NormKind,
    ) -> Result<Self, LoadError> {
        let weight = match kind {
            NormKind::Weightless => None,
            _ => Some(Param::from_tensor(src.tensor(&format!("{prefix}.weight"), [dim])?)),
        };
        Ok(Self { weight, eps, one_plus: kind == NormKind::OnePlus })
    }

    /// A weightless norm (nothing to load).
    pub fn weightless(eps: f64) -> Self {
        Self { weight: None, eps, one_plus: false }
    }

    /// Normalises the last dimension.
    ///
    /// # Shapes
    /// - `x`: `[..., dim]`
    /// - output: same as `x`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let ms = (x.clone() * x.clone()).mean_dim(D - 1);
        let y = x * (ms + self.eps).powf_scalar(-0.5);
        match &self.weight {
            None => y,
            Some(w) => {
                let mut shape = [1usize; D];
                shape[D - 1] = w.dims()[0];
                let w = w.val().reshape(shape);
                if self.one_plus { y * (w + 1.0) } else { y * w }
            }
        }
    }
}
