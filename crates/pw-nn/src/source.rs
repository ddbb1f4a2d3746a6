//! Where layer weights come from.

use burn::tensor::{Tensor, TensorData, backend::Backend};

use crate::mlp::GatedMlpConfig;
use crate::moe::{ExpertKeys, Experts};

/// Why a layer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// None of the accepted names exists.
    #[error("tensor `{name}` is missing from the checkpoint")]
    Missing {
        /// The tensor (or the alternatives tried).
        name: String,
    },
    /// The stored shape disagrees with the configuration.
    #[error("tensor `{name}` has shape {got:?}, but the config implies {expected:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Stored shape.
        got: Vec<usize>,
    },
    /// The underlying reader failed (message names file and tensor).
    #[error("{0}")]
    Source(String),
}

/// A provider of named host tensors, in the layout of Hugging Face checkpoints
/// (`[out, in]` linear weights).
pub trait WeightSource<B: Backend> {
    /// Device the layers are created on.
    fn device(&self) -> B::Device;
    /// Whether `name` exists.
    fn has(&self, name: &str) -> bool;
    /// Reads `name` as f32, checking its shape is `expected`.
    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError>;

    /// Reads `name` into a tensor of shape `expected`.
    fn tensor<const D: usize>(&self, name: &str, expected: [usize; D]) -> Result<Tensor<B, D>, LoadError> {
        let data = self.read(name, &expected)?;
        Ok(Tensor::from_data(TensorData::new(data, expected), &self.device()))
    }

    /// Builds the expert bank of one MoE layer. Model files always come through here, so a
    /// source backed by another storage (paged, quantized) returns its own [`Experts`] variant
    /// by overriding this; the default reads dense weights.
    fn experts(
        &self,
        keys: &ExpertKeys,
        num_experts: usize,
        cfg: GatedMlpConfig,
    ) -> Result<Experts<B>, LoadError>
    where
        Self: Sized,
    {
        Experts::load_dense(self, keys, num_experts, cfg)
    }
}

/// Deterministic pseudo-random weights for tests and for `init`: every name exists; norm
/// weights are drawn around one, everything else around zero.
#[derive(Debug, Clone)]
pub struct RandomInit<B: Backend> {
    device: B::Device,
    seed: u64,
    std: f32,
}

impl<B: Backend> RandomInit<B> {
    /// Weights with standard deviation `std`, derived from `seed` and each tensor's name.
    pub fn new(device: &B::Device, seed: u64, std: f32) -> Self {
        Self { device: device.clone(), seed, std }
    }
}

impl<B: Backend> WeightSource<B> for RandomInit<B> {
    fn device(&self) -> B::Device {
        self.device.clone()
    }

    fn has(&self, _name: &str) -> bool {
        true
    }

    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        // FNV-1a of the name, then a SplitMix64 stream: reproducible without a rand dependency.
        let mut state = name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64 ^ self.seed, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let n: usize = expected.iter().product();
        let centre = if name.contains("norm") || name.ends_with("scale") { 1.0 } else { 0.0 };
        Ok((0..n)
            .map(|_| {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                // Uniform in [-1, 1) scaled to the requested standard deviation.
                let u = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                centre + u * self.std * 3f32.sqrt()
            })
            .collect())
    }
}

/// Transposes a row-major `[rows, cols]` matrix on the host.
pub(crate) fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}
