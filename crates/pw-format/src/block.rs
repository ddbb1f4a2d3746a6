//! One any-precision block: bit-planes, per-row LUTs, sensitivities, and the
//! CPU reference operators that every GPU kernel is tested against.

use crate::{FormatError, StFile, TensorMap};
use half::f16;
use pw_quant::{MAX_BITS, MIN_BITS, Quantized};
use safetensors::Dtype;

/// Weights per packed word.
pub const WORD_BITS: usize = 32;

/// An any-precision matrix `[rows, cols]` stored as bit-planes + LUTs.
///
/// See the crate docs for the byte layout.
#[derive(Debug, Clone, PartialEq)]
pub struct ApBlock {
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Lowest bit-width with a stored LUT.
    pub min_bits: u8,
    /// Highest bit-width: the number of stored planes.
    pub max_bits: u8,
    /// `[max_bits, rows, words_per_row]`.
    pub planes: Vec<u32>,
    /// `luts[b - min_bits]` is `[rows, 2^b]` (f16, ascending per row).
    pub luts: Vec<Vec<f16>>,
    /// Importance-weighted squared error per bit-width `min_bits..=max_bits`.
    pub sensitivity: Vec<f64>,
}

/// Packs 8-bit parent indices `[rows, cols]` into `planes` bit-planes
/// `[planes, rows, ceil(cols/32)]`; plane `p` holds bit `7 − p`.
pub fn pack_planes(indices: &[u8], rows: usize, cols: usize, planes: u8) -> Vec<u32> {
    let words = cols.div_ceil(WORD_BITS);
    let mut out = vec![0u32; planes as usize * rows * words];
    for r in 0..rows {
        let row = &indices[r * cols..(r + 1) * cols];
        for (w, chunk) in row.chunks(WORD_BITS).enumerate() {
            for p in 0..planes as usize {
                let shift = 7 - p;
                let word = chunk
                    .iter()
                    .enumerate()
                    .fold(0u32, |acc, (j, &i)| acc | ((((i >> shift) & 1) as u32) << j));
                out[(p * rows + r) * words + w] = word;
            }
        }
    }
    out
}

/// Reads the `bits`-bit indices `[rows, cols]` from the first `bits` planes.
pub fn unpack_indices(planes: &[u32], rows: usize, cols: usize, bits: u8) -> Vec<u8> {
    let words = cols.div_ceil(WORD_BITS);
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let (w, j) = (c / WORD_BITS, c % WORD_BITS);
            let mut idx = 0u8;
            for p in 0..bits as usize {
                idx = (idx << 1) | ((planes[(p * rows + r) * words + w] >> j) & 1) as u8;
            }
            out[r * cols + c] = idx;
        }
    }
    out
}

impl ApBlock {
    /// Packs a quantizer result, keeping bit-widths `min_bits..=max_bits`.
    pub fn from_quantized(q: &Quantized, min_bits: u8, max_bits: u8) -> Result<Self, FormatError> {
        check_range("quantized", min_bits, max_bits)?;
        Ok(Self {
            rows: q.rows,
            cols: q.cols,
            min_bits,
            max_bits,
            planes: pack_planes(&q.indices, q.rows, q.cols, max_bits),
            luts: (min_bits..=max_bits).map(|b| q.luts[(b - MIN_BITS) as usize].clone()).collect(),
            sensitivity: (min_bits..=max_bits).map(|b| q.sensitivity(b)).collect(),
        })
    }

    /// Quantizes a row-major f32 matrix (importance `None` = all ones).
    pub fn quantize(
        name: &str,
        weights: &[f32],
        importance: Option<&[f32]>,
        rows: usize,
        cols: usize,
        min_bits: u8,
        max_bits: u8,
    ) -> Result<Self, FormatError> {
        check_range(name, min_bits, max_bits)?;
        let q = pw_quant::quantize(weights, importance, rows, cols)
            .map_err(|source| FormatError::Quant { tensor: name.into(), source })?;
        Self::from_quantized(&q, min_bits, max_bits)
    }

    /// u32 words per row of one plane.
    pub fn words_per_row(&self) -> usize {
        self.cols.div_ceil(WORD_BITS)
    }

    /// Plane `p` (0 = most significant), `[rows, words_per_row]`.
    pub fn plane(&self, p: u8) -> &[u32] {
        let n = self.rows * self.words_per_row();
        &self.planes[p as usize * n..(p as usize + 1) * n]
    }

    /// The LUT of bit-width `bits`, `[rows, 2^bits]`.
    pub fn lut(&self, bits: u8) -> &[f16] {
        &self.luts[self.bit_slot(bits)]
    }

    /// Importance-weighted squared error at `bits`.
    pub fn sensitivity_at(&self, bits: u8) -> f64 {
        self.sensitivity[self.bit_slot(bits)]
    }

    fn bit_slot(&self, bits: u8) -> usize {
        assert!(
            (self.min_bits..=self.max_bits).contains(&bits),
            "bit-width {bits} outside the block's range {}..={}",
            self.min_bits,
            self.max_bits
        );
        (bits - self.min_bits) as usize
    }

    /// Bytes a device needs at `bits`: `(planes, lut)`.
    pub fn bytes_at(&self, bits: u8) -> (usize, usize) {
        (bits as usize * self.rows * self.words_per_row() * 4, self.rows * (1usize << bits) * 2)
    }

    /// The `bits`-bit indices `[rows, cols]`.
    pub fn indices(&self, bits: u8) -> Vec<u8> {
        self.bit_slot(bits);
        unpack_indices(&self.planes, self.rows, self.cols, bits)
    }

    /// Reference dequantization at `bits`: `[rows, cols]` f32.
    pub fn dequantize_reference(&self, bits: u8) -> Vec<f32> {
        let lut = self.lut(bits);
        let n = 1usize << bits;
        let idx = self.indices(bits);
        idx.iter().enumerate().map(|(i, &k)| lut[(i / self.cols) * n + k as usize].to_f32()).collect()
    }

    /// Reference `y = x · Wᵀ` at `bits`, decoding from the planes directly
    /// with f32 accumulation.
    ///
    /// # Shapes
    /// - `x`: `[cols]`
    /// - returns `[rows]`
    pub fn matvec_reference(&self, bits: u8, x: &[f32]) -> Vec<f32> {
        self.matmul_reference(bits, x, 1)
    }

    /// Reference `Y = X · Wᵀ` at `bits` for `tokens` rows of `X`.
    ///
    /// # Shapes
    /// - `x`: `[tokens, cols]`
    /// - returns `[tokens, rows]`
    pub fn matmul_reference(&self, bits: u8, x: &[f32], tokens: usize) -> Vec<f32> {
        assert_eq!(x.len(), tokens * self.cols, "x must be [tokens, cols]");
        let lut = self.lut(bits);
        let n = 1usize << bits;
        let words = self.words_per_row();
        let mut y = vec![0f32; tokens * self.rows];
        let mut w_row = vec![0f32; self.cols];
        for r in 0..self.rows {
            for (c, w) in w_row.iter_mut().enumerate() {
                let (wd, j) = (c / WORD_BITS, c % WORD_BITS);
                let mut idx = 0usize;
                for p in 0..bits as usize {
                    idx = (idx << 1) | ((self.planes[(p * self.rows + r) * words + wd] >> j) & 1) as usize;
                }
                *w = lut[r * n + idx].to_f32();
            }
            for t in 0..tokens {
                let xt = &x[t * self.cols..(t + 1) * self.cols];
                y[t * self.rows + r] = xt.iter().zip(&w_row).map(|(a, b)| a * b).sum();
            }
        }
        y
    }

    /// The block as safetensors tensors `{prefix}.planes` and `{prefix}.lut{b}`.
    pub fn tensors(&self, prefix: &str) -> TensorMap {
        let mut m = TensorMap::new();
        m.insert(
            format!("{prefix}.planes"),
            (
                Dtype::U32,
                vec![self.max_bits as usize, self.rows, self.words_per_row()],
                bytemuck::cast_slice(&self.planes).to_vec(),
            ),
        );
        for b in self.min_bits..=self.max_bits {
            let lut = self.lut(b);
            m.insert(
                format!("{prefix}.lut{b}"),
                (Dtype::F16, vec![self.rows, 1 << b], lut.iter().flat_map(|v| v.to_le_bytes()).collect()),
            );
        }
        m
    }

    /// Reads a block written by [`ApBlock::tensors`], checking every shape and dtype.
    pub fn read(
        file: &StFile,
        prefix: &str,
        rows: usize,
        cols: usize,
        min_bits: u8,
        max_bits: u8,
        sensitivity: Vec<f64>,
    ) -> Result<Self, FormatError> {
        check_range(prefix, min_bits, max_bits)?;
        if sensitivity.len() != (max_bits - min_bits + 1) as usize {
            return Err(FormatError::Block {
                block: prefix.into(),
                reason: format!(
                    "sensitivity has {} entries, bits {min_bits}..={max_bits} need {}",
                    sensitivity.len(),
                    max_bits - min_bits + 1
                ),
            });
        }
        let words = cols.div_ceil(WORD_BITS);
        let t = file.expect(&format!("{prefix}.planes"), Dtype::U32, &[max_bits as usize, rows, words])?;
        let planes = t.data().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let mut luts = Vec::new();
        for b in min_bits..=max_bits {
            let t = file.expect(&format!("{prefix}.lut{b}"), Dtype::F16, &[rows, 1 << b])?;
            luts.push(t.data().chunks_exact(2).map(|c| f16::from_le_bytes(c.try_into().unwrap())).collect());
        }
        Ok(Self { rows, cols, min_bits, max_bits, planes, luts, sensitivity })
    }
}

/// Checks `MIN_BITS <= min <= max <= MAX_BITS`.
pub(crate) fn check_range(block: &str, min_bits: u8, max_bits: u8) -> Result<(), FormatError> {
    if MIN_BITS <= min_bits && min_bits <= max_bits && max_bits <= MAX_BITS {
        Ok(())
    } else {
        Err(FormatError::Block {
            block: block.into(),
            reason: format!("bit range {min_bits}..={max_bits} is outside {MIN_BITS}..={MAX_BITS}"),
        })
    }
}
