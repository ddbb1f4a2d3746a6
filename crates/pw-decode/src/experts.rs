//! Expert storage of the decode path: the any-precision blocks of every layer and the
//! per-layer device pools (committed planes + LUTs, and the slot words the routing kernel
//! copies into the grouped GEMM's descriptors). All of it sits here so that moving the pools
//! under the weight page table touches this file only.

use cubecl::prelude::*;
use kernels_cubecl::step::{MoeShape, expert_slot_words};
use kernels_cubecl::{DeviceArray, PoolImage, PoolSlot};
use pw_format::ApBlock;
use pw_hf::Checkpoint;

use crate::config::{DecodeConfig, Family};
use crate::{DecodeError, read};

/// The any-precision experts of every layer (`[layer][expert] = (gate_up [2I, H], down [H, I])`;
/// empty for a layer without routed experts) and the bit-width each is committed at. The page
/// table will own this; until then the decoder uploads them once.
#[derive(Debug, Clone)]
pub struct ExpertBlocks {
    /// Blocks per layer and expert.
    pub blocks: Vec<Vec<(ApBlock, ApBlock)>>,
    /// Committed bits per layer and expert (gate_up, down).
    pub bits: Vec<Vec<(u8, u8)>>,
}

impl ExpertBlocks {
    /// Quantizes the experts of an HF checkpoint of `cfg`'s family (per-expert or fused
    /// layout) with uniform importance, all committed at `bits`.
    pub fn quantize_hf(ckpt: &Checkpoint, cfg: &DecodeConfig, bits: u8) -> Result<Self, DecodeError> {
        let (h, i) = (cfg.hidden, cfg.inter);
        let mut blocks = Vec::with_capacity(cfg.layers);
        let mut all_bits = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let mut layer = Vec::with_capacity(cfg.experts);
            if cfg.sparse[l] {
                for e in 0..cfg.experts {
                    let (gate_up, down) = expert_weights(ckpt, l, e, cfg)?;
                    let gu = ApBlock::quantize(
                        &format!("layers.{l}.experts.{e}.gate_up"),
                        &gate_up,
                        None,
                        2 * i,
                        h,
                        3,
                        8,
                    )?;
                    let dn =
                        ApBlock::quantize(&format!("layers.{l}.experts.{e}.down"), &down, None, h, i, 3, 8)?;
                    layer.push((gu, dn));
                }
            }
            all_bits.push(vec![(bits, bits); layer.len()]);
            blocks.push(layer);
        }
        Ok(Self { blocks, bits: all_bits })
    }
}

/// Where a family keeps layer `l`'s experts: `(prefix, [gate, up, down])` of the per-expert
/// layout (`{prefix}.{e}.{name}.weight`) and the prefix of the fused one
/// (`{fused}.gate_up_proj [E, 2I, H]`, `{fused}.down_proj [E, H, I]`).
pub(crate) fn expert_keys(cfg: &DecodeConfig, root: &str, l: usize) -> (String, [&'static str; 3], String) {
    let p = format!("{root}.layers.{l}");
    match cfg.family {
        Family::Mixtral => {
            (format!("{p}.block_sparse_moe.experts"), ["w1", "w3", "w2"], format!("{p}.mlp.experts"))
        }
        Family::Qwen2Moe => {
            (format!("{p}.mlp.experts"), ["gate_proj", "up_proj", "down_proj"], format!("{p}.mlp.experts"))
        }
        Family::Gemma4 => {
            (format!("{p}.experts"), ["gate_proj", "up_proj", "down_proj"], format!("{p}.experts"))
        }
    }
}

/// `(gate_up [2I·H], down [H·I])` of one expert, row-major as the kernels read them.
pub fn expert_weights(
    ckpt: &Checkpoint,
    l: usize,
    e: usize,
    cfg: &DecodeConfig,
) -> Result<(Vec<f32>, Vec<f32>), DecodeError> {
    let (h, i) = (cfg.hidden, cfg.inter);
    let (per, [g, u, d], fused) = expert_keys(cfg, crate::root(ckpt), l);
    if ckpt.contains(&format!("{per}.{e}.{g}.weight")) {
        let mut gate_up = read(ckpt, &format!("{per}.{e}.{g}.weight"), &[i, h])?;
        gate_up.extend(read(ckpt, &format!("{per}.{e}.{u}.weight"), &[i, h])?);
        return Ok((gate_up, read(ckpt, &format!("{per}.{e}.{d}.weight"), &[h, i])?));
    }
    let gu = read(ckpt, &format!("{fused}.gate_up_proj"), &[cfg.experts, 2 * i, h])?;
    let dn = read(ckpt, &format!("{fused}.down_proj"), &[cfg.experts, h, i])?;
    Ok((gu[e * 2 * i * h..][..2 * i * h].to_vec(), dn[e * h * i..][..h * i].to_vec()))
}

/// One layer's expert pool on the device.
pub(crate) struct LayerExperts {
    pub(crate) slots: DeviceArray,
    /// This layer's expert pool: plane words and f16 LUT entries (one pool per layer keeps
    /// offsets within u32 even for Mixtral-8x7B).
    pub(crate) planes: DeviceArray,
    pub(crate) luts: DeviceArray,
    /// Bytes of the committed planes + LUTs.
    committed: usize,
}

impl LayerExperts {
    /// Uploads the committed planes and LUTs of one layer's blocks.
    pub(crate) fn upload<R: Runtime>(
        client: &ComputeClient<R>,
        shape: MoeShape,
        blocks: &[(ApBlock, ApBlock)],
        bits: &[(u8, u8)],
    ) -> Result<Self, DecodeError> {
        let mut pool = PoolImage::default();
        let slots: Vec<_> = blocks
            .iter()
            .zip(bits)
            .map(|((gu, dn), &(bg, bd))| (pool.push(gu, bg), pool.push(dn, bd)))
            .collect();
        let words = expert_slot_words(shape, &slots)?;
        Ok(Self {
            slots: DeviceArray::from_slice(client, &words),
            planes: DeviceArray::from_slice(client, &pool.planes),
            luts: DeviceArray::from_slice(client, &pool.luts),
            committed: pool.bytes(),
        })
    }

    /// Random planes (hashed words) and LUTs (small uniform values) made on the device, sized
    /// for every expert at 8 bits, with expert `e` committed at `bits[e]` for both its blocks.
    pub(crate) fn synthetic<R: Runtime>(
        client: &ComputeClient<R>,
        shape: MoeShape,
        bits: &[u8],
        seed: u32,
    ) -> Result<Self, DecodeError> {
        let (_, planes_len, luts_len) = packed_slots(shape, &vec![8; bits.len()])?;
        let planes = DeviceArray::empty::<R, u32>(client, planes_len);
        kernels_cubecl::fill_hash(client, &planes, seed);
        let luts = DeviceArray::empty::<R, half::f16>(client, luts_len);
        kernels_cubecl::families::fill_uniform::<R, half::f16>(client, &luts, seed ^ 0x5bd1, 0.05)?;
        let mut me = Self { slots: DeviceArray::empty::<R, u32>(client, 1), planes, luts, committed: 0 };
        me.recommit_synthetic(client, shape, bits)?;
        Ok(me)
    }

    /// Re-packs a synthetic pool at other bit-widths (the pool holds 8 bits of every expert, so
    /// any mix fits): only the slot words change; the planes read are whatever lies there.
    pub(crate) fn recommit_synthetic<R: Runtime>(
        &mut self,
        client: &ComputeClient<R>,
        shape: MoeShape,
        bits: &[u8],
    ) -> Result<(), DecodeError> {
        let (slots, p, lu) = packed_slots(shape, bits)?;
        if p > self.planes.len || lu > self.luts.len {
            return Err(DecodeError::Unsupported("a synthetic pool re-packed past its size".into()));
        }
        self.slots = DeviceArray::from_slice(client, &expert_slot_words(shape, &slots)?);
        self.committed = p * 4 + lu * 2;
        Ok(())
    }

    /// Bytes of the committed planes + LUTs (what a step reads of the experts it routes to).
    pub(crate) fn bytes(&self) -> usize {
        self.committed
    }
}

/// Per expert its (gate_up, down) slots, then the plane words and LUT entries they take.
type Packed = (Vec<(PoolSlot, PoolSlot)>, usize, usize);

/// Slots of `bits.len()` experts packed back to back (expert `e`: gate_up then down, both at
/// `bits[e]`), and the plane words and LUT entries they take.
fn packed_slots(shape: MoeShape, bits: &[u8]) -> Result<Packed, DecodeError> {
    let (h, i) = (shape.hidden, shape.inter);
    let (gu_words, dn_words) = (2 * i * h.div_ceil(32), h * i.div_ceil(32));
    let (mut p, mut lu) = (0usize, 0usize);
    let mut slots = Vec::with_capacity(bits.len());
    for &b in bits {
        if !(3..=8).contains(&b) {
            return Err(DecodeError::Unsupported(format!("bits {b} outside 3..=8")));
        }
        let b = b as usize;
        let gu = PoolSlot {
            plane_off: p as u32,
            lut_off: lu as u32,
            rows: 2 * i as u32,
            cols: h as u32,
            bits: b as u32,
        };
        p += gu_words * b;
        lu += (2 * i) << b;
        let dn = PoolSlot {
            plane_off: p as u32,
            lut_off: lu as u32,
            rows: h as u32,
            cols: i as u32,
            bits: b as u32,
        };
        p += dn_words * b;
        lu += h << b;
        slots.push((gu, dn));
    }
    if p > u32::MAX as usize || lu > u32::MAX as usize {
        return Err(DecodeError::Unsupported(format!(
            "a layer's expert pool of {p} words exceeds u32 offsets"
        )));
    }
    Ok((slots, p, lu))
}
