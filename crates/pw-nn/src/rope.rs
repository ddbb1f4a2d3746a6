//! Rotary position embeddings in the rotate-half layout.

use burn::tensor::{Tensor, TensorData, backend::Backend};

/// Rotate-half RoPE over a whole head, from per-pair inverse frequencies.
///
/// A zero frequency leaves its pair untouched, which is how Gemma-4's "proportional" RoPE
/// rotates only the first pairs of its 512-wide global heads.
#[derive(Debug, Clone)]
pub struct Rope {
    /// One inverse frequency per pair (`head_dim / 2` values).
    pub inv_freq: Vec<f32>,
}

impl Rope {
    /// RoPE for the given inverse frequencies.
    pub fn new(inv_freq: Vec<f32>) -> Self {
        Self { inv_freq }
    }

    /// Rotates `x` for the absolute positions `start..start + seq`.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, seq, head_dim]`
    /// - output: same as `x`
    pub fn apply<B: Backend>(&self, x: Tensor<B, 4>, start: usize) -> Tensor<B, 4> {
        let [_, _, t, hd] = x.dims();
        let half = hd / 2;
        assert_eq!(half, self.inv_freq.len(), "RoPE built for another head_dim");
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        for p in start..start + t {
            for j in 0..hd {
                // f32 product then f32 cos/sin, as transformers computes them.
                let a = self.inv_freq[j % half] * p as f32;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let device = x.device();
        let cos = Tensor::<B, 4>::from_data(TensorData::new(cos, [1, 1, t, hd]), &device);
        let sin = Tensor::<B, 4>::from_data(TensorData::new(sin, [1, 1, t, hd]), &device);
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos + rotated * sin
    }
}
