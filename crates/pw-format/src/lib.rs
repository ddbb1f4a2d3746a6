//! Storage of any-precision expert blocks and the quantized checkpoint format.
//!
//! # Byte layout of one block
//!
//! A block is a matrix `W` of `rows × cols` (output × input) quantized by
//! [`pw_quant`] to an 8-bit parent index per weight, of which bit-width `b`
//! uses the top `b` bits.
//!
//! - **Planes**: a little-endian `u32` tensor `[max_bits, rows, W]` with
//!   `W = ceil(cols / 32)`. Bit `j` (LSB = 0) of word `planes[p][r][w]` is
//!   bit `7 − p` of the parent index of weight `(r, 32·w + j)`: plane 0 holds
//!   the most significant bit. Columns past `cols` in the last word are 0.
//!   Reading `b` bits reads planes `0..b` only, so bytes read scale exactly
//!   with `b`, and dropping trailing planes lowers the bit-width in place:
//!   `idx_b = Σ_{p<b} bit_p << (b − 1 − p)`.
//! - **LUTs**: for each bit-width `b` in `min_bits..=max_bits`, an f16 tensor
//!   `[rows, 2^b]` of ascending centroids; weight `(r, c)` at `b` bits is
//!   `lut_b[r][idx_b(r, c)]`.
//! - **Sensitivity**: the importance-weighted squared error `Σ w (x − x̂_b)²`
//!   of the block at each stored bit-width (in the manifest).
//!
//! In a safetensors file a block named `P` is the tensors `P.planes` and
//! `P.lut{b}`.
//!
//! ```
//! use pw_format::ApBlock;
//! let (rows, cols) = (4, 40);
//! let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 257) as f32 / 257.0 - 0.5).collect();
//! let block = ApBlock::quantize("demo", &w, None, rows, cols, 3, 8).unwrap();
//! assert_eq!(block.words_per_row(), 2); // 40 columns → 2 words per plane row
//! assert_eq!(block.planes.len(), 8 * rows * 2);
//! // Weight (1, 33) at 4 bits, decoded by hand from planes 0..4.
//! let (r, c, bits) = (1, 33, 4u8);
//! let mut idx = 0usize;
//! for p in 0..bits {
//!     let word = block.plane(p)[r * block.words_per_row() + c / 32];
//!     idx = (idx << 1) | ((word >> (c % 32)) & 1) as usize;
//! }
//! let value = block.lut(bits)[r * 16 + idx].to_f32();
//! assert_eq!(value, block.dequantize_reference(bits)[r * cols + c]);
//! // Plane bytes scale with the bit-width; the LUT is 2^b f16 per row.
//! assert_eq!(block.bytes_at(4), (4 * rows * 2 * 4, rows * 16 * 2));
//! ```
//!
//! # Checkpoint directory
//!
//! `config.json` and tokenizer files of the source model, the manifest
//! [`MANIFEST_FILE`] (magic, version, one [`BlockEntry`] per
//! (layer, expert, gate_up | down) with shape, bit range and sensitivity, and
//! the file of every unchanged tensor), and `pw-NNNNN.safetensors` shards.

mod block;
mod checkpoint;
mod error;
mod st;

pub use block::{ApBlock, WORD_BITS, pack_planes, unpack_indices};
pub use checkpoint::{
    BlockEntry, BlockKind, BlockMeta, Checkpoint, CheckpointWriter, DEFAULT_SHARD_BYTES, LayerRouting, MAGIC,
    MANIFEST_FILE, Manifest, PARTIAL_FILE, VERSION,
};
pub use error::FormatError;
pub use safetensors::Dtype;
pub use st::{StFile, TensorMap, view_to_f32, write_tensors};

#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod tests;
