//! Models with random weights made on the device, of any [`DecodeConfig`]'s shapes: for speed
//! measurements of full-size models that are not available offline.

use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::DeviceArray;
use kernels_cubecl::fill_uniform;

use crate::DecodeError;
use crate::builder::DecoderBuilder;
use crate::config::{DecodeConfig, Family};
use crate::decoder::Decoder;
use crate::paged::PagedExperts;
use crate::weights::{Weights, load_dense};

/// Random f16 matrices (uniform, `cols^-0.5` wide, times `gain` for the routers so routing is
/// not flat), unit norms, small biases: shapes and memory traffic of a real model.
struct SyntheticWeights<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    seed: u32,
    biases: bool,
}

impl<R: Runtime> Weights<R> for SyntheticWeights<'_, R> {
    fn client(&self) -> &ComputeClient<R> {
        self.client
    }
    fn mat(&mut self, parts: &[(&str, usize)], cols: usize) -> Result<DeviceArray, DecodeError> {
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let gain = if parts.iter().any(|p| p.0.contains("router") || p.0.contains("gate.weight")) {
            4.0
        } else {
            1.0
        };
        let a = DeviceArray::empty::<R, f16>(self.client, rows * cols);
        self.seed += 1;
        fill_uniform::<R, f16>(self.client, &a, self.seed, gain * (cols as f32).powf(-0.5))?;
        Ok(a)
    }
    fn host(&mut self, _name: &str, n: usize, default: Option<f32>) -> Result<Vec<f32>, DecodeError> {
        Ok(vec![default.unwrap_or(1.0); n])
    }
    fn vec_cat(&mut self, parts: &[(&str, usize)]) -> Result<Option<DeviceArray>, DecodeError> {
        if !self.biases {
            return Ok(None);
        }
        let n: usize = parts.iter().map(|p| p.1).sum();
        Ok(Some(DeviceArray::from_slice(self.client, &vec![0.01f32; n])))
    }
}

impl<R: Runtime, KV: Float + CubeElement> DecoderBuilder<'_, R, KV> {
    /// A model of `cfg`'s shapes with random weights made on the device (expert planes: hashed
    /// words; LUTs, dense weights: small uniform values; norms: ones), expert `e` of layer `l`
    /// committed at `bits(l, e)` bits under a page table whose pages store widths 3..=8 (see
    /// [`PagedExperts::synthetic`]), and its KV pools filled with small random values (so
    /// [`Decoder::fill_synthetic`] can stand for a prefill).
    pub fn synthetic(
        self,
        cfg: DecodeConfig,
        bits: &dyn Fn(usize, usize) -> u8,
    ) -> Result<Decoder<R, KV>, DecodeError> {
        let paged = PagedExperts::synthetic(self.client, cfg.moe_shape(), &cfg.sparse, bits, self.budget())?;
        self.synthetic_around(cfg, paged)
    }

    /// [`Self::synthetic`] with random host parents copied through the experts' mover like a
    /// real checkpoint's (see [`PagedExperts::synthetic_host`]): for measuring page transfers
    /// while decoding.
    pub fn synthetic_host(
        self,
        cfg: DecodeConfig,
        bits: &dyn Fn(usize, usize) -> u8,
    ) -> Result<Decoder<R, KV>, DecodeError> {
        let paged =
            PagedExperts::synthetic_host(self.client, cfg.moe_shape(), &cfg.sparse, bits, self.budget())?;
        self.synthetic_around(cfg, paged)
    }

    /// Random dense weights and KV pools around `paged`.
    fn synthetic_around(
        self,
        cfg: DecodeConfig,
        paged: PagedExperts<R>,
    ) -> Result<Decoder<R, KV>, DecodeError> {
        let client = self.client;
        let mut src = SyntheticWeights { client, seed: 7, biases: cfg.family == Family::Qwen2Moe };
        let dense = load_dense(&cfg, "model", &mut src)?;
        let me = self.assemble(cfg, dense, paged)?;
        for l in 0..me.cfg.layers {
            let (k, v) = me.kv.layer(l);
            fill_uniform::<R, KV>(client, k, 0x7000 + 2 * l as u32, 0.5)?;
            fill_uniform::<R, KV>(client, v, 0x7001 + 2 * l as u32, 0.5)?;
        }
        Ok(me)
    }
}
