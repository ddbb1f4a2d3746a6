//! [`PagedLinear`]: a drop-in replacement for Burn's `Linear` whose weight is an
//! any-precision block (3..8 nested bits) with a bit-width that can change
//! between calls.
//!
//! ```
//! use burn_ndarray::NdArray;
//! use burn::nn::LinearConfig;
//! use burn::tensor::{Distribution, Tensor};
//! use pw_linear::PagedLinear;
//!
//! let device = Default::default();
//! let linear = LinearConfig::new(256, 128).init::<NdArray>(&device);
//! let mut paged = PagedLinear::from_linear(&linear, 8).unwrap();
//! let x = Tensor::<NdArray, 2>::random([3, 256], Distribution::Default, &device);
//! let y8 = paged.forward(x.clone());
//! paged.set_bits(4).unwrap(); // between calls
//! let y4 = paged.forward(x);
//! assert_eq!(y4.dims(), [3, 128]);
//! // 4-bit planes + the 16-entry f16 LUT per row: under half of the f16 weight.
//! assert!(paged.device_bytes() < 256 * 128 * 2 / 2);
//! # let _ = y8;
//! ```
//!
//! The forward pass here multiplies by the weight dequantized at the committed
//! bit-width, which runs on every Burn backend and is the reference the CubeCL
//! kernels (`kernels-cubecl`, used by the paged experts) are tested against.
//! [`PagedLinear::device_bytes`] reports what the bit-plane form needs.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use pw_format::ApBlock;
use std::sync::Arc;

/// Errors of [`PagedLinear`].
#[derive(Debug, thiserror::Error)]
pub enum PagedLinearError {
    /// The requested bit-width is outside the block's stored range.
    #[error("bit-width {bits} is outside the block's stored range {min}..={max}")]
    Bits {
        /// Requested.
        bits: u8,
        /// Lowest stored.
        min: u8,
        /// Highest stored.
        max: u8,
    },
    /// Quantization or format error.
    #[error(transparent)]
    Format(#[from] pw_format::FormatError),
    /// The weight could not be read back as f32.
    #[error("weight tensor: {0}")]
    Data(String),
}

/// A linear layer `y = x · Wᵀ + b` over an any-precision weight.
#[derive(Module, Debug)]
pub struct PagedLinear<B: Backend> {
    /// `W` dequantized at the committed bit-width, `[d_input, d_output]` (Burn's layout).
    weight: Tensor<B, 2>,
    /// Optional bias `[d_output]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The 8-bit parent, kept on the host so nothing is lost by lowering.
    #[module(skip)]
    block: Arc<ApBlock>,
    /// Committed bit-width.
    #[module(skip)]
    bits: u8,
}

impl<B: Backend> PagedLinear<B> {
    /// Quantizes a Burn `Linear` (weight `[d_input, d_output]`) and commits `bits`.
    pub fn from_linear(linear: &Linear<B>, bits: u8) -> Result<Self, PagedLinearError> {
        Self::from_weight(linear.weight.val(), linear.bias.as_ref().map(|b| b.val()), None, bits)
    }

    /// Quantizes a weight in Burn's `[d_input, d_output]` layout with an optional
    /// per-weight importance of the same shape (e.g. a Fisher diagonal).
    pub fn from_weight(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        importance: Option<Tensor<B, 2>>,
        bits: u8,
    ) -> Result<Self, PagedLinearError> {
        let device = weight.device();
        let [d_in, d_out] = weight.dims();
        // The format stores rows = outputs.
        let host = |t: Tensor<B, 2>| -> Result<Vec<f32>, PagedLinearError> {
            t.transpose()
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| PagedLinearError::Data(format!("{e:?}")))
        };
        let w = host(weight)?;
        let imp = importance.map(host).transpose()?;
        let block = ApBlock::quantize("PagedLinear", &w, imp.as_deref(), d_out, d_in, 3, 8)?;
        Self::from_block(block, bias, bits, &device)
    }

    /// Wraps a quantized block (`rows` = outputs), e.g. from a checkpoint.
    pub fn from_block(
        block: ApBlock,
        bias: Option<Tensor<B, 1>>,
        bits: u8,
        device: &B::Device,
    ) -> Result<Self, PagedLinearError> {
        check_bits(&block, bits)?;
        let weight = dequantized(&block, bits, device);
        Ok(Self { weight, bias: bias.map(Param::from_tensor), block: Arc::new(block), bits })
    }

    /// Commits a new bit-width; takes effect at the next `forward`.
    pub fn set_bits(&mut self, bits: u8) -> Result<(), PagedLinearError> {
        check_bits(&self.block, bits)?;
        if bits != self.bits {
            self.weight = dequantized(&self.block, bits, &self.weight.device());
            self.bits = bits;
        }
        Ok(())
    }

    /// The committed bit-width.
    pub fn bits(&self) -> u8 {
        self.bits
    }

    /// The any-precision block (host copy of all bit-widths).
    pub fn block(&self) -> &ApBlock {
        &self.block
    }

    /// Bytes of planes + LUT the committed bit-width needs on a device.
    pub fn device_bytes(&self) -> usize {
        let (p, l) = self.block.bytes_at(self.bits);
        p + l
    }

    /// `y = x · Wᵀ + b` at the committed bit-width.
    ///
    /// # Shapes
    /// - `input`: `[..., d_input]`
    /// - returns `[..., d_output]`
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        burn::tensor::module::linear(input, self.weight.clone(), self.bias.as_ref().map(|b| b.val()))
    }
}

fn check_bits(block: &ApBlock, bits: u8) -> Result<(), PagedLinearError> {
    if (block.min_bits..=block.max_bits).contains(&bits) {
        Ok(())
    } else {
        Err(PagedLinearError::Bits { bits, min: block.min_bits, max: block.max_bits })
    }
}

/// The block at `bits` as a `[d_input, d_output]` tensor.
fn dequantized<B: Backend>(block: &ApBlock, bits: u8, device: &B::Device) -> Tensor<B, 2> {
    let w = block.dequantize_reference(bits);
    Tensor::<B, 2>::from_data(TensorData::new(w, [block.rows, block.cols]), device).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::LinearConfig;
    use burn::tensor::Distribution;
    use burn_ndarray::NdArray;

    type B = NdArray;

    /// f32 accumulation in a different order than the reference.
    const FORWARD_RTOL: f32 = 1e-5;

    #[test]
    fn paged_linear_matches_reference() {
        let device = Default::default();
        let linear = LinearConfig::new(70, 33).init::<B>(&device);
        let mut paged = PagedLinear::from_linear(&linear, 8).unwrap();
        let x = Tensor::<B, 2>::random([5, 70], Distribution::Uniform(-1.0, 1.0), &device);
        let xv = x.to_data().to_vec::<f32>().unwrap();
        let bias = linear.bias.as_ref().unwrap().val().to_data().to_vec::<f32>().unwrap();
        for bits in 3..=8 {
            paged.set_bits(bits).unwrap();
            assert_eq!(paged.bits(), bits);
            let y = paged.forward(x.clone()).to_data().to_vec::<f32>().unwrap();
            let want = paged.block().matmul_reference(bits, &xv, 5);
            for (i, (a, w)) in y.iter().zip(&want).enumerate() {
                let w = w + bias[i % 33];
                assert!(
                    (a - w).abs() <= FORWARD_RTOL * (1.0 + w.abs()),
                    "bits {bits} y[{i}] = {a}, reference {w}"
                );
            }
        }
    }

    #[test]
    fn error_against_the_dense_layer_falls_with_bits() {
        let device = Default::default();
        let linear = LinearConfig::new(128, 64).init::<B>(&device);
        let x = Tensor::<B, 2>::random([8, 128], Distribution::Uniform(-1.0, 1.0), &device);
        let dense = linear.forward(x.clone());
        let mut paged = PagedLinear::from_linear(&linear, 3).unwrap();
        let mut prev = f32::INFINITY;
        for bits in 3..=8 {
            paged.set_bits(bits).unwrap();
            let err: f32 = (paged.forward(x.clone()) - dense.clone()).powf_scalar(2.0).sum().into_scalar();
            assert!(err < prev, "error at {bits} bits ({err}) not below {prev}");
            prev = err;
        }
        let (planes, lut) = paged.block().bytes_at(4);
        paged.set_bits(4).unwrap();
        assert_eq!(paged.device_bytes(), planes + lut);
    }

    #[test]
    fn bad_bits_are_an_error() {
        let device = Default::default();
        let linear = LinearConfig::new(32, 8).init::<B>(&device);
        let mut paged = PagedLinear::from_linear(&linear, 5).unwrap();
        assert!(matches!(paged.set_bits(9), Err(PagedLinearError::Bits { bits: 9, .. })));
        assert!(matches!(paged.set_bits(2), Err(PagedLinearError::Bits { bits: 2, .. })));
        assert_eq!(paged.bits(), 5);
        assert!(PagedLinear::<B>::from_linear(&linear, 1).is_err());
    }
}
