//! [`PagedLinear`]: a drop-in replacement for Burn's `Linear` whose weight is an
//! any-precision block (3..8 nested bits) with a bit-width that can change
//! between calls; [`PagedExperts`]: an MoE layer's expert bank whose
//! gate_up/down blocks are pages of a shared [`PageTable`], each of them also
//! usable as a [`PagedLinear`] view.
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
//! # Where the weight lives and how `forward` runs
//! A `PagedLinear` is a view of one page of a [`PageTable`]: a standalone layer
//! owns a table of one page, the layers of a [`PagedExperts`] bank share their
//! model's table (no copy of the planes). On a CubeCL backend (Burn's wgpu and
//! CUDA backends without fusion) whose device holds the table, `forward` launches
//! the grouped bit-plane + LUT kernel of `kernels-cubecl` on the planes and LUT
//! of the page's committed bit-width; on every other backend (ndarray, autodiff)
//! it multiplies by the block dequantized on the host at that bit-width, the
//! format crate's CPU reference.

mod cube;
mod experts;
mod table;

pub use experts::{ExpertLinears, PagedExperts};
pub use pw_pages::{Accountant, CommitReport, MemoryUsage, PageError, PageId, PageInfo, PageKey};
pub use table::{PageTable, arena_size_at};

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use pw_format::{ApBlock, BlockKind};

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
    /// The page table refused an operation.
    #[error(transparent)]
    Page(#[from] PageError),
    /// The weight could not be read back as f32.
    #[error("weight tensor: {0}")]
    Data(String),
    /// A kernel launch was refused (inconsistent work items or buffers).
    #[error("kernel: {0}")]
    Kernel(String),
    /// A bank's pages do not fit the model's expert shape or activation.
    #[error("expert bank: {0}")]
    Bank(String),
}

/// A linear layer `y = x · Wᵀ + b` over an any-precision weight: a view of one page of a
/// [`PageTable`].
#[derive(Module, Debug)]
pub struct PagedLinear<B: Backend> {
    /// Optional bias `[d_output]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The table holding the weight (the host keeps its 8-bit parent, so nothing is lost by
    /// lowering; the device its committed planes and LUT).
    #[module(skip)]
    table: PageTable,
    /// The weight's page.
    #[module(skip)]
    page: PageId,
    /// `(d_output, d_input)`.
    #[module(skip)]
    shape: (usize, usize),
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

    /// Wraps a quantized block (`rows` = outputs), e.g. from a checkpoint, in a table of its
    /// own on `device` with room for every stored bit-width.
    pub fn from_block(
        block: ApBlock,
        bias: Option<Tensor<B, 1>>,
        bits: u8,
        device: &B::Device,
    ) -> Result<Self, PagedLinearError> {
        check_bits(&block, bits)?;
        let (planes, luts) = arena_size_at([&block], block.max_bits);
        // A raising holds its new LUT beside the committed one until it commits.
        let arena = (planes, 2 * luts);
        let key = PageKey { layer: 0, expert: 0, kind: BlockKind::GateUp };
        let table = PageTable::new(
            vec![("PagedLinear".to_string(), key, block)],
            Accountant::new(u64::MAX / 2),
            arena,
            device,
        )?;
        let page = table.page(key)?;
        table.set_desired(page, bits)?;
        table.settle()?;
        Self::view(table, page, bias)
    }

    /// A view of page `page` of a shared table (no copy of its planes): what
    /// [`PagedExperts`] hands out for each expert's gate_up and down.
    pub fn view(
        table: PageTable,
        page: PageId,
        bias: Option<Tensor<B, 1>>,
    ) -> Result<Self, PagedLinearError> {
        let info = table.info(page)?;
        Ok(Self { bias: bias.map(Param::from_tensor), table, page, shape: (info.rows, info.cols) })
    }

    /// Asks for a new bit-width and commits it: on a standalone layer at once; on a view of a
    /// shared table this is a full [`PageTable::settle`] (every page's desired bits commit).
    /// Takes effect at the next `forward`.
    pub fn set_bits(&mut self, bits: u8) -> Result<(), PagedLinearError> {
        let info = self.table.info(self.page)?;
        if !(info.min_bits..=info.max_bits).contains(&bits) {
            return Err(PagedLinearError::Bits { bits, min: info.min_bits, max: info.max_bits });
        }
        self.table.set_desired(self.page, bits)?;
        self.table.settle()?;
        Ok(())
    }

    /// The committed bit-width (0 if the page is not resident).
    pub fn bits(&self) -> u8 {
        self.table.info(self.page).map_or(0, |i| i.committed)
    }

    /// A copy of the any-precision block (host copy of all bit-widths).
    pub fn block(&self) -> ApBlock {
        self.table.parent(self.page).expect("a view's page exists")
    }

    /// The table the weight lives in.
    pub fn table(&self) -> &PageTable {
        &self.table
    }

    /// The weight's page in [`Self::table`].
    pub fn page(&self) -> PageId {
        self.page
    }

    /// Bytes of planes + LUT the committed bit-width holds on the device.
    pub fn device_bytes(&self) -> usize {
        self.table.info(self.page).map_or(0, |i| i.gpu_bytes)
    }

    /// `y = x · Wᵀ + b` at the committed bit-width.
    ///
    /// # Shapes
    /// - `input`: `[..., d_input]`
    /// - returns `[..., d_output]`
    ///
    /// # Panics
    /// If `d_input` does not match the weight, or the page is not resident (committed bits 0),
    /// as Burn's own layers panic on mismatched shapes.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let dims = input.dims();
        let (n, k) = self.shape;
        assert_eq!(dims[D - 1], k, "PagedLinear: input has {} features, the weight {k}", dims[D - 1]);
        let t = dims[..D - 1].iter().product::<usize>();
        let y = cube::linear(&self.table, self.page, input.reshape([t, k]))
            .unwrap_or_else(|e| panic!("PagedLinear: {e}"));
        let mut out = dims;
        out[D - 1] = n;
        let y = y.reshape(out);
        match &self.bias {
            Some(b) => y + b.val().unsqueeze(),
            None => y,
        }
    }
}

fn check_bits(block: &ApBlock, bits: u8) -> Result<(), PagedLinearError> {
    if (block.min_bits..=block.max_bits).contains(&bits) {
        Ok(())
    } else {
        Err(PagedLinearError::Bits { bits, min: block.min_bits, max: block.max_bits })
    }
}

/// The `[rows, cols]` host matrix as a `[cols, rows]` tensor (Burn's `[in, out]` layout).
pub(crate) fn dequantized<B: Backend>(
    w: Vec<f32>,
    rows: usize,
    cols: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    Tensor::<B, 2>::from_data(TensorData::new(w, [rows, cols]), device).transpose()
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
