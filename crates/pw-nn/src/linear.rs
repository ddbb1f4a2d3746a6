//! Linear projections and token embeddings.

use burn::module::{Module, Param};
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::source::{LoadError, WeightSource, transpose};

/// `y = x Wᵀ + b` with `W` stored transposed (`[in, out]`) so the forward is one matmul.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// Weight, `[in, out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// Optional bias, `[out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Linear<B> {
    /// Loads `{prefix}.weight` (`[out, in]`, as PyTorch stores it) and, if `bias`, `{prefix}.bias`.
    pub fn load(
        src: &impl WeightSource<B>,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        let w = src.read(&format!("{prefix}.weight"), &[d_out, d_in])?;
        let weight =
            Tensor::from_data(TensorData::new(transpose(&w, d_out, d_in), [d_in, d_out]), &src.device());
        let bias = if bias {
            Some(Param::from_tensor(src.tensor(&format!("{prefix}.bias"), [d_out])?))
        } else {
            None
        };
        Ok(Self { weight: Param::from_tensor(weight), bias })
    }

    /// Loads the bias only if the checkpoint has one.
    pub fn load_auto_bias(
        src: &impl WeightSource<B>,
        prefix: &str,
        d_in: usize,
        d_out: usize,
    ) -> Result<Self, LoadError> {
        let bias = src.has(&format!("{prefix}.bias"));
        Self::load(src, prefix, d_in, d_out, bias)
    }

    /// Applies the projection to the last dimension.
    ///
    /// # Shapes
    /// - `x`: `[..., in]`
    /// - output: `[..., out]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let [d_in, d_out] = self.weight.dims();
        let rows: usize = dims[..D - 1].iter().product();
        let mut y = x.reshape([rows, d_in]).matmul(self.weight.val());
        if let Some(b) = &self.bias {
            y = y + b.val().unsqueeze_dim(0);
        }
        let mut out = dims;
        out[D - 1] = d_out;
        y.reshape(out)
    }
}

/// Token embedding table, also usable as a tied output head.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// `[vocab, hidden]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    /// Loads `{prefix}.weight` of shape `[vocab, hidden]`.
    pub fn load(
        src: &impl WeightSource<B>,
        prefix: &str,
        vocab: usize,
        hidden: usize,
    ) -> Result<Self, LoadError> {
        Ok(Self { weight: Param::from_tensor(src.tensor(&format!("{prefix}.weight"), [vocab, hidden])?) })
    }

    /// Looks up token ids.
    ///
    /// # Shapes
    /// - `ids`: `[batch, seq]`
    /// - output: `[batch, seq, hidden]`
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, t] = ids.dims();
        let [_, h] = self.weight.dims();
        self.weight.val().select(0, ids.reshape([b * t])).reshape([b, t, h])
    }

    /// Scores hidden states against every embedding (tied output head).
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]`
    /// - output: `[batch, seq, vocab]`
    pub fn attend(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = h.dims();
        let [v, _] = self.weight.dims();
        h.reshape([b * t, d]).matmul(self.weight.val().transpose()).reshape([b, t, v])
    }
}
