//! Any-precision quantizer: one 8-bit *parent* per matrix row from which every
//! bit-width 3..8 is obtained by dropping least-significant index bits.
//!
//! Per output row:
//! 1. **Seed** — exact importance-weighted 1-D k-means with 2³ centroids on the
//!    sorted row ([`kmeans::optimal_partition`]).
//! 2. **Upscale** 3 → 8 — every cluster is split by the exact optimal weighted
//!    2-means of its sorted members ([`kmeans::optimal_split`]); child `2c` is
//!    the left half and `2c + 1` the right one, so the new bit is the least
//!    significant and indices nest: `idx_b = idx_{b+1} >> 1`.
//!
//! Centroids are rounded to f16, the precision the look-up tables are stored
//! in. Should rounding ever make a split worse than its parent, both children
//! keep the parent's centroid, so the importance-weighted error never grows
//! with the bit-width.
//!
//! Importance is a non-negative weight per matrix element (a Fisher diagonal,
//! or all ones). A row whose importance is all zero falls back to uniform
//! weights for its codebook; its importance-weighted error stays zero. The result is deterministic and independent of the thread count.
//!
//! ```
//! let w: Vec<f32> = (0..64).map(|i| ((i * 37) % 64) as f32 / 64.0 - 0.5).collect();
//! let q = pw_quant::quantize(&w, None, 2, 32).unwrap();
//! // 8-bit parent indices; the 3-bit index is the top 3 bits.
//! let i8 = q.indices[5] as usize;
//! let lut3 = q.lut(3, 0);
//! assert_eq!(lut3.len(), 8);
//! let approx = lut3[i8 >> 5].to_f32();
//! assert!((approx - w[5]).abs() < 0.1);
//! assert!(q.sensitivity(8) <= q.sensitivity(3));
//! ```

pub mod kmeans;

use half::f16;
use kmeans::{KmeansScratch, Prefix};
use rayon::prelude::*;

/// Lowest bit-width stored (the k-means seed).
pub const MIN_BITS: u8 = 3;
/// Highest bit-width stored (the parent).
pub const MAX_BITS: u8 = 8;
/// Number of bit-widths `MIN_BITS..=MAX_BITS`.
pub const NUM_WIDTHS: usize = (MAX_BITS - MIN_BITS + 1) as usize;

/// Why a matrix cannot be quantized.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    /// `rows * cols` does not match the data length.
    #[error("shape {rows}x{cols} needs {expected} weights, got {got}")]
    Shape {
        /// Declared rows.
        rows: usize,
        /// Declared columns.
        cols: usize,
        /// `rows * cols`.
        expected: usize,
        /// Length of the data.
        got: usize,
    },
    /// The importance array has a different length than the weights.
    #[error("importance has {got} elements but the weights have {expected}")]
    ImportanceShape {
        /// Number of weights.
        expected: usize,
        /// Number of importance values.
        got: usize,
    },
    /// A weight is NaN or infinite.
    #[error("weight at row {row}, column {col} is {value}: weights must be finite")]
    NonFiniteWeight {
        /// Row of the bad value.
        row: usize,
        /// Column of the bad value.
        col: usize,
        /// The value.
        value: f32,
    },
    /// An importance value is negative, NaN or infinite.
    #[error("importance at row {row}, column {col} is {value}: it must be finite and >= 0")]
    BadImportance {
        /// Row of the bad value.
        row: usize,
        /// Column of the bad value.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A centroid does not fit in f16.
    #[error("row {row} has a centroid {value} outside the f16 range")]
    F16Overflow {
        /// Row of the bad value.
        row: usize,
        /// The centroid.
        value: f64,
    },
    /// The matrix has no columns.
    #[error("cannot quantize a matrix with {rows} rows and 0 columns")]
    NoColumns {
        /// Declared rows.
        rows: usize,
    },
}

/// A quantized matrix: 8-bit parent indices and one f16 LUT per row per bit-width.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Parent (8-bit) index of every weight, row-major `[rows, cols]`.
    pub indices: Vec<u8>,
    /// `luts[b - 3]` is `[rows, 2^b]`: the centroids of bit-width `b`, ascending.
    pub luts: Vec<Vec<f16>>,
    /// Importance-weighted squared reconstruction error `Σ w (x − x̂_b)²` per bit-width.
    pub sse: [f64; NUM_WIDTHS],
}

impl Quantized {
    /// The LUT of `row` at bit-width `bits` (`2^bits` centroids).
    pub fn lut(&self, bits: u8, row: usize) -> &[f16] {
        let n = 1usize << bits;
        &self.luts[(bits - MIN_BITS) as usize][row * n..(row + 1) * n]
    }

    /// Importance-weighted squared error of the whole matrix at `bits`.
    pub fn sensitivity(&self, bits: u8) -> f64 {
        self.sse[(bits - MIN_BITS) as usize]
    }

    /// Reconstructed weights at `bits`, row-major `[rows, cols]`.
    pub fn dequantize(&self, bits: u8) -> Vec<f32> {
        let shift = MAX_BITS - bits;
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            let lut = self.lut(bits, r);
            let idx = &self.indices[r * self.cols..(r + 1) * self.cols];
            out.extend(idx.iter().map(|&i| lut[(i >> shift) as usize].to_f32()));
        }
        out
    }
}

/// Result of quantizing one row.
#[derive(Debug, Clone, PartialEq)]
pub struct RowCodebook {
    /// 8-bit parent index of every element.
    pub indices: Vec<u8>,
    /// `luts[b - 3]`: the `2^b` centroids of bit-width `b`, ascending.
    pub luts: Vec<Vec<f16>>,
    /// Importance-weighted squared error per bit-width `3..=8`.
    pub sse: [f64; NUM_WIDTHS],
}

/// Per-thread reusable buffers.
#[derive(Debug, Default)]
pub struct RowScratch {
    order: Vec<u64>,
    values: Vec<f64>,
    weights: Vec<f64>,
    counts: Vec<f64>,
    uid: Vec<u32>,
    prefix: Prefix,
    kmeans: KmeansScratch,
}

/// Quantizes a row-major `[rows, cols]` matrix with an optional importance of
/// the same shape (`None` = all ones). Rows are processed in parallel.
pub fn quantize(
    weights: &[f32],
    importance: Option<&[f32]>,
    rows: usize,
    cols: usize,
) -> Result<Quantized, QuantError> {
    let expected = rows * cols;
    if weights.len() != expected {
        return Err(QuantError::Shape { rows, cols, expected, got: weights.len() });
    }
    if cols == 0 {
        return Err(QuantError::NoColumns { rows });
    }
    if let Some(imp) = importance
        && imp.len() != expected
    {
        return Err(QuantError::ImportanceShape { expected, got: imp.len() });
    }
    let rows_out: Vec<RowCodebook> = (0..rows)
        .into_par_iter()
        .map_init(RowScratch::default, |scratch, r| {
            let x = &weights[r * cols..(r + 1) * cols];
            let w = importance.map(|imp| &imp[r * cols..(r + 1) * cols]);
            quantize_row_with(x, w, scratch).map_err(|e| e.at_row(r))
        })
        .collect::<Result<_, _>>()?;

    let mut indices = Vec::with_capacity(expected);
    let mut luts: Vec<Vec<f16>> = (MIN_BITS..=MAX_BITS).map(|b| Vec::with_capacity(rows << b)).collect();
    let mut sse = [0.0; NUM_WIDTHS];
    for row in rows_out {
        indices.extend_from_slice(&row.indices);
        for (dst, src) in luts.iter_mut().zip(&row.luts) {
            dst.extend_from_slice(src);
        }
        for (a, b) in sse.iter_mut().zip(row.sse) {
            *a += b;
        }
    }
    Ok(Quantized { rows, cols, indices, luts, sse })
}

impl QuantError {
    /// Rewrites the row of a per-row error to the matrix row.
    fn at_row(self, r: usize) -> Self {
        match self {
            Self::NonFiniteWeight { col, value, .. } => Self::NonFiniteWeight { row: r, col, value },
            Self::BadImportance { col, value, .. } => Self::BadImportance { row: r, col, value },
            Self::F16Overflow { value, .. } => Self::F16Overflow { row: r, value },
            e => e,
        }
    }
}

/// Quantizes one row (`importance = None` means all ones).
pub fn quantize_row(x: &[f32], importance: Option<&[f32]>) -> Result<RowCodebook, QuantError> {
    quantize_row_with(x, importance, &mut RowScratch::default())
}

/// A cluster of distinct sorted values `[lo, hi)` and its (f16-rounded) centroid.
#[derive(Debug, Clone, Copy)]
struct Cluster {
    lo: usize,
    hi: usize,
    centroid: f64,
}

/// [`quantize_row`] with caller-owned scratch buffers.
pub fn quantize_row_with(
    x: &[f32],
    importance: Option<&[f32]>,
    s: &mut RowScratch,
) -> Result<RowCodebook, QuantError> {
    let k = x.len();
    if k == 0 {
        return Err(QuantError::NoColumns { rows: 1 });
    }
    if let Some((col, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::NonFiniteWeight { row: 0, col, value });
    }
    let mut uniform = true;
    if let Some(imp) = importance {
        if let Some((col, &value)) = imp.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v >= 0.0)) {
            return Err(QuantError::BadImportance { row: 0, col, value });
        }
        // An all-zero importance row carries no information: treat it as uniform.
        uniform = imp.iter().all(|&v| v == 0.0);
    }
    let imp_at = |i: usize| if uniform { 1.0 } else { importance.map_or(1.0, |imp| imp[i] as f64) };

    // Sort once and merge equal values, so equal weights always share an index.
    // One u64 key per element (order-preserving f32 bits, then position) sorts
    // several times faster than a comparator over indices.
    s.order.clear();
    s.order.extend(x.iter().enumerate().map(|(i, v)| ((sortable_bits(*v) as u64) << 32) | i as u64));
    s.order.sort_unstable();
    s.values.clear();
    s.weights.clear();
    s.counts.clear();
    s.uid.clear();
    s.uid.resize(k, 0);
    for &key in &s.order {
        let i = key as u32;
        let v = x[i as usize] as f64;
        let w = imp_at(i as usize);
        if s.values.last() == Some(&v) {
            *s.weights.last_mut().unwrap() += w;
            *s.counts.last_mut().unwrap() += 1.0;
        } else {
            s.values.push(v);
            s.weights.push(w);
            s.counts.push(1.0);
        }
        s.uid[i as usize] = (s.values.len() - 1) as u32;
    }
    let n = s.values.len();
    s.prefix.rebuild(&s.values, &s.weights);

    // Seed: exact k-means with at most 8 clusters; missing clusters (rows with
    // fewer distinct values) repeat the last centroid and are never indexed.
    let seed_k = (1usize << MIN_BITS).min(n);
    let (bounds, _) = kmeans::optimal_partition(&s.prefix, seed_k, &mut s.kmeans);
    let mut level: Vec<Cluster> =
        bounds.windows(2).map(|b| Cluster { lo: b[0], hi: b[1], centroid: 0.0 }).collect();
    for c in &mut level {
        c.centroid = round_f16(centroid(s, c.lo, c.hi, 0.0))?;
    }
    while level.len() < 1 << MIN_BITS {
        let last = *level.last().unwrap();
        level.push(Cluster { lo: n, hi: n, centroid: last.centroid });
    }

    let mut luts = Vec::with_capacity(NUM_WIDTHS);
    let mut sse = [0.0; NUM_WIDTHS];
    for bits in MIN_BITS..=MAX_BITS {
        if bits > MIN_BITS {
            level = upscale(s, &level)?;
        }
        luts.push(level.iter().map(|c| f16::from_f64(c.centroid)).collect::<Vec<_>>());
        sse[(bits - MIN_BITS) as usize] =
            level.iter().map(|c| cluster_error(s, c.lo, c.hi, c.centroid)).sum();
    }

    if uniform && importance.is_some() {
        // The importance given is zero everywhere (e.g. an expert no calibration token was
        // routed to): uniform weights only chose the codebook, the importance-weighted error
        // is zero, and reporting the unweighted one would put this row on another scale.
        sse = [0.0; NUM_WIDTHS];
    }

    // Map distinct values to their 8-bit cluster, then every element.
    let mut idx_of_uid = vec![0u8; n];
    for (c, cl) in level.iter().enumerate() {
        idx_of_uid[cl.lo..cl.hi].fill(c as u8);
    }
    let indices = s.uid.iter().map(|&u| idx_of_uid[u as usize]).collect();
    Ok(RowCodebook { indices, luts, sse })
}

/// Splits every cluster by its optimal weighted 2-means (one more bit).
fn upscale(s: &RowScratch, level: &[Cluster]) -> Result<Vec<Cluster>, QuantError> {
    let mut next = Vec::with_capacity(level.len() * 2);
    for p in level {
        if p.hi - p.lo < 2 {
            // Nothing to split: the right child is empty and copies the parent.
            next.push(*p);
            next.push(Cluster { lo: p.hi, hi: p.hi, centroid: p.centroid });
            continue;
        }
        let (t, _) = kmeans::optimal_split(&s.prefix, p.lo, p.hi);
        let l = Cluster { lo: p.lo, hi: t, centroid: round_f16(centroid(s, p.lo, t, p.centroid))? };
        let r = Cluster { lo: t, hi: p.hi, centroid: round_f16(centroid(s, t, p.hi, p.centroid))? };
        let split = cluster_error(s, l.lo, l.hi, l.centroid) + cluster_error(s, r.lo, r.hi, r.centroid);
        if split <= cluster_error(s, p.lo, p.hi, p.centroid) {
            next.extend([l, r]);
        } else {
            // f16 rounding made the split worse: keep the parent's value on both sides.
            next.extend([Cluster { centroid: p.centroid, ..l }, Cluster { centroid: p.centroid, ..r }]);
        }
    }
    Ok(next)
}

/// Weighted mean of distinct values `[lo, hi)`; the plain mean when their
/// importance is all zero; `fallback` when the cluster is empty.
fn centroid(s: &RowScratch, lo: usize, hi: usize, fallback: f64) -> f64 {
    if lo == hi {
        return fallback;
    }
    let (v, w) = (&s.values[lo..hi], &s.weights[lo..hi]);
    let tw: f64 = w.iter().sum();
    if tw > 0.0 {
        v.iter().zip(w).map(|(x, w)| x * w).sum::<f64>() / tw
    } else {
        let c = &s.counts[lo..hi];
        v.iter().zip(c).map(|(x, c)| x * c).sum::<f64>() / c.iter().sum::<f64>()
    }
}

/// `Σ w (x − c)²` over distinct values `[lo, hi)`, computed directly (not from
/// prefix sums) so error comparisons are exact up to f64 rounding.
fn cluster_error(s: &RowScratch, lo: usize, hi: usize, c: f64) -> f64 {
    s.values[lo..hi].iter().zip(&s.weights[lo..hi]).map(|(x, w)| w * (x - c) * (x - c)).sum()
}

/// Maps an f32 to a u32 whose unsigned order is the float's total order.
fn sortable_bits(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

fn round_f16(v: f64) -> Result<f64, QuantError> {
    let h = f16::from_f64(v);
    if h.is_finite() { Ok(h.to_f64()) } else { Err(QuantError::F16Overflow { row: 0, value: v }) }
}

#[cfg(test)]
mod tests;
