//! The grouped expert kernels' work items and the host image of a weight pool (the page table
//! owns the device pool; tests and benchmarks build one directly).

use cubecl::prelude::*;
use half::f16;
use pw_format::ApBlock;

use crate::DeviceArray;

/// Largest token count of one work item.
pub const MAX_TOKENS: usize = 16;

/// u32 fields per work item in the descriptor table.
pub const DESC_WORDS: usize = 8;

/// One block × token group of a grouped launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkItem {
    /// Offset of the block's plane 0 in the plane pool (u32 words).
    pub plane_off: u32,
    /// Offset of the block's LUT in the LUT pool (f16 elements).
    pub lut_off: u32,
    /// Output rows N.
    pub rows: u32,
    /// Input columns K.
    pub cols: u32,
    /// Committed bit-width (3..=8): planes `0..bits` and the LUT of that width.
    pub bits: u32,
    /// Offset of the item's first token row in `x` (elements).
    pub x_off: u32,
    /// Offset of the item's first output row in `y` (elements); `y` is `[tokens, rows]`.
    pub y_off: u32,
    /// Tokens, 0..=16.
    pub tokens: u32,
}

impl WorkItem {
    fn words(&self) -> [u32; DESC_WORDS] {
        [self.plane_off, self.lut_off, self.rows, self.cols, self.bits, self.x_off, self.y_off, self.tokens]
    }
}

/// Host image of a device weight pool: the committed planes and LUT of each
/// block, concatenated. The page table owns the real pool; tests and benches
/// build one directly.
#[derive(Debug, Default, Clone)]
pub struct PoolImage {
    /// Plane words.
    pub planes: Vec<u32>,
    /// LUT entries.
    pub luts: Vec<f16>,
}

/// Where [`PoolImage::push`] put a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSlot {
    /// Plane offset (u32 words).
    pub plane_off: u32,
    /// LUT offset (f16 elements).
    pub lut_off: u32,
    /// Rows.
    pub rows: u32,
    /// Columns.
    pub cols: u32,
    /// Bits committed.
    pub bits: u32,
}

impl PoolImage {
    /// Appends planes `0..bits` and the `bits`-wide LUT of `block`.
    pub fn push(&mut self, block: &ApBlock, bits: u8) -> PoolSlot {
        let slot = PoolSlot {
            plane_off: self.planes.len() as u32,
            lut_off: self.luts.len() as u32,
            rows: block.rows as u32,
            cols: block.cols as u32,
            bits: bits as u32,
        };
        for p in 0..bits {
            self.planes.extend_from_slice(block.plane(p));
        }
        self.luts.extend_from_slice(block.lut(bits));
        slot
    }

    /// Bytes of planes + LUTs.
    pub fn bytes(&self) -> usize {
        self.planes.len() * 4 + self.luts.len() * 2
    }
}

impl PoolSlot {
    /// A work item over this block.
    pub fn item(&self, x_off: u32, y_off: u32, tokens: u32) -> WorkItem {
        WorkItem {
            plane_off: self.plane_off,
            lut_off: self.lut_off,
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            x_off,
            y_off,
            tokens,
        }
    }
}

/// Uploads the descriptor table of `items`.
pub fn upload_items<R: Runtime>(client: &ComputeClient<R>, items: &[WorkItem]) -> DeviceArray {
    let words: Vec<u32> = items.iter().flat_map(|i| i.words()).collect();
    DeviceArray::from_slice(client, &words)
}

/// Smallest compiled token bucket holding `tokens`.
pub(crate) fn token_bucket(tokens: usize) -> usize {
    tokens.next_power_of_two().max(1)
}
