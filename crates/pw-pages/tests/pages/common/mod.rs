//! Shared test fixtures: a small random MoE's expert blocks.

#![allow(dead_code)]

use pw_format::{ApBlock, BlockKind};
use pw_pages::PageKey;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Hidden size and intermediate size of the fixture experts.
pub const HIDDEN: usize = 40;
/// Intermediate size.
pub const INTER: usize = 12;

/// A random block quantized to bits 3..=8.
pub fn random_block(rng: &mut StdRng, rows: usize, cols: usize) -> ApBlock {
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    ApBlock::quantize("t", &w, None, rows, cols, 3, 8).unwrap()
}

/// `layers × experts` experts, each a gate_up `[2·INTER, HIDDEN]` and a down
/// `[HIDDEN, INTER]` page.
pub fn moe_blocks(layers: usize, experts: usize, seed: u64) -> Vec<(String, PageKey, ApBlock)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for layer in 0..layers {
        for expert in 0..experts {
            for (kind, rows, cols) in
                [(BlockKind::GateUp, 2 * INTER, HIDDEN), (BlockKind::Down, HIDDEN, INTER)]
            {
                let name = format!("model.layers.{layer}.experts.{expert}.{kind:?}");
                out.push((name, PageKey { layer, expert, kind }, random_block(&mut rng, rows, cols)));
            }
        }
    }
    out
}

/// Bytes of every block at `bits` (planes + LUT) and arena elements (words, entries).
pub fn size_at(blocks: &[(String, PageKey, ApBlock)], bits: u8) -> (usize, usize, usize) {
    blocks.iter().fold((0, 0, 0), |(bytes, w, l), (_, _, b)| {
        let (pb, lb) = b.bytes_at(bits);
        (bytes + pb + lb, w + pb / 4, l + lb / 2)
    })
}
