//! Routing statistics on the device: per-(layer, expert) token counts and routing mass of a
//! decode step, accumulated from the outputs of `moe_route` (the grouped kernel's work items,
//! the choices' gathered rows and weights) without a host round trip. The planner needs them
//! once per step (or every few steps): the host downloads two flat `[layers · experts]` arrays.

use cubecl::prelude::*;
use kernels_cubecl::gemm::DESC_WORDS;
use kernels_cubecl::step::{MoeShape, ROUTE_CHUNKS, RouteBuffers};
use kernels_cubecl::{DeviceArray, KernelError, MAX_TOKENS, read_f32, read_u32};

use crate::DecodeError;

/// One unit per expert `e` of layer `base / experts`: its token count is the sum of its work
/// items' token counts, its first gathered row is its first item's `x` offset / `hidden`, and
/// its mass is the sum of the routing weights of the choices whose gathered row falls in
/// `[first, first + count)` (rows are grouped by expert).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn route_stats_kernel(
    desc: &Array<u32>,
    pos: &Array<u32>,
    weights: &Array<f32>,
    meta: &Array<u32>,
    counts: &mut Array<u32>,
    mass: &mut Array<f32>,
    base: u32,
    #[comptime] experts: usize,
    #[comptime] k: usize,
    #[comptime] chunks: usize,
    #[comptime] hidden: usize,
    #[comptime] words: usize,
) {
    let e = UNIT_POS as usize;
    if e < experts {
        let tokens = meta[0] as usize;
        let mut count = 0u32;
        #[unroll]
        for c in 0..chunks {
            count += desc[(e * chunks + c) * words + 7usize];
        }
        let first = desc[e * chunks * words + 5usize] / hidden as u32;
        let mut m = 0.0f32;
        for i in 0..tokens * k {
            let row = pos[i];
            if row >= first && row < first + count {
                m += weights[i];
            }
        }
        counts[base as usize + e] += count;
        mass[base as usize + e] += m;
    }
}

/// CPU reference of one layer's accumulation: `counts[layer · E + e] +=` choices of `e`,
/// `mass[layer · E + e] +=` their weights.
///
/// # Shapes
/// - `choices`, `weights`: `[tokens, k]` (expert index and routing weight of each choice)
/// - `counts`, `mass`: `[layers · experts]`
pub fn route_stats_reference(
    experts: usize,
    layer: usize,
    choices: &[usize],
    weights: &[f32],
    counts: &mut [u32],
    mass: &mut [f32],
) {
    for (&e, &w) in choices.iter().zip(weights) {
        counts[layer * experts + e] += 1;
        mass[layer * experts + e] += w;
    }
}

/// Routing counts and mass of the sampled decode steps, on the device.
#[derive(Debug)]
pub struct RouteStats {
    counts: DeviceArray,
    mass: DeviceArray,
    layers: usize,
    experts: usize,
    /// Tokens routed through every layer since the last [`RouteStats::take`].
    tokens: u64,
    /// The last layer recorded: a layer at or below it starts the next step's tokens (the
    /// first sparse layer need not be layer 0).
    last: Option<usize>,
    /// Whether the next step accumulates.
    pub armed: bool,
}

/// What [`RouteStats::take`] downloads.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingCounts {
    /// Tokens that went through every layer.
    pub tokens: u64,
    /// `[layers · experts]`: how many of them chose each expert.
    pub counts: Vec<u32>,
    /// `[layers · experts]`: the sum of their routing weights.
    pub mass: Vec<f32>,
}

impl RouteStats {
    /// Zeroed counters for `layers × experts`, not armed.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, layers: usize, experts: usize) -> Self {
        let n = layers * experts;
        Self {
            counts: DeviceArray::from_slice(client, &vec![0u32; n]),
            mass: DeviceArray::from_slice(client, &vec![0.0f32; n]),
            layers,
            experts,
            tokens: 0,
            last: None,
            armed: false,
        }
    }

    /// Adds layer `layer`'s routing of `tokens` tokens (outputs of `moe_route` in `route`).
    /// Does nothing unless armed. Returns the launches it made (0 or 1).
    pub fn record<R: Runtime>(
        &mut self,
        client: &ComputeClient<R>,
        shape: MoeShape,
        layer: usize,
        tokens: usize,
        meta: &DeviceArray,
        route: &RouteBuffers,
    ) -> Result<usize, DecodeError> {
        if !self.armed || tokens == 0 {
            return Ok(0);
        }
        if layer >= self.layers || shape.experts != self.experts || tokens > MAX_TOKENS {
            return Err(DecodeError::Unsupported(format!(
                "route stats of layer {layer} ({} experts, {tokens} tokens) for {} layers × {} experts",
                shape.experts, self.layers, self.experts
            )));
        }
        if self.last.is_none_or(|last| layer <= last) {
            self.tokens += tokens as u64;
        }
        self.last = Some(layer);
        let arg = |a: &DeviceArray| {
            // SAFETY: `len` is the element count the buffer was created with.
            unsafe { ArrayArg::<R>::from_raw_parts(a.handle.clone(), a.len.max(1)) }
        };
        // SAFETY: `desc` holds experts · ROUTE_CHUNKS items of DESC_WORDS words and `pos` /
        // `weights` MAX_TOKENS · k entries (RouteBuffers::new); the kernel reads `meta[0] · k`
        // of them and writes `counts` / `mass` at `layer · experts + e < layers · experts`.
        unsafe {
            route_stats_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(shape.experts as u32),
                arg(&route.desc_gate_up),
                arg(&route.pos),
                arg(&route.weights),
                arg(meta),
                arg(&self.counts),
                arg(&self.mass),
                (layer * self.experts) as u32,
                shape.experts,
                shape.k,
                ROUTE_CHUNKS,
                shape.hidden,
                DESC_WORDS,
            )
        };
        Ok(1)
    }

    /// Downloads the counters and zeroes them (`None` when no token was recorded).
    pub fn take<R: Runtime>(
        &mut self,
        client: &ComputeClient<R>,
    ) -> Result<Option<RoutingCounts>, KernelError> {
        if self.tokens == 0 {
            return Ok(None);
        }
        let counts = read_u32(client, &self.counts)?;
        let mass = read_f32(client, &self.mass)?;
        let n = self.layers * self.experts;
        self.counts = DeviceArray::from_slice(client, &vec![0u32; n]);
        self.mass = DeviceArray::from_slice(client, &vec![0.0f32; n]);
        let tokens = std::mem::take(&mut self.tokens);
        Ok(Some(RoutingCounts { tokens, counts, mass }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    use kernels_cubecl::PoolSlot;
    use kernels_cubecl::step::{expert_slot_words, moe_route, route_reference};

    /// Mass is a sum of at most `tokens` weights in another order: f32 rounding only.
    const MASS_TOL: f32 = 1e-5;

    #[test]
    fn route_stats_matches_reference() {
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            // SAFETY: set once before any thread reads the environment.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
        }
        let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
        let shape = MoeShape { experts: 8, k: 2, renormalize: true, hidden: 32, inter: 16 };
        let (layers, mut state) = (3usize, 12345u64);
        let slot = |rows, cols| PoolSlot { plane_off: 0, lut_off: 0, rows, cols, bits: 4 };
        let slots = vec![(slot(32, 32), slot(32, 16)); shape.experts];
        let slots = DeviceArray::from_slice(&client, &expert_slot_words(shape, &slots).unwrap());
        let route = RouteBuffers::new(&client, shape);
        let mut stats = RouteStats::new(&client, layers, shape.experts);
        let (mut counts, mut mass) = (vec![0u32; layers * 8], vec![0.0f32; layers * 8]);
        // Two steps (13 then 16 tokens) over layers 0 and 2; an unarmed step records nothing.
        for (step, tokens, armed) in [(0, 13usize, true), (1, 5, false), (2, MAX_TOKENS, true)] {
            stats.armed = armed;
            for layer in [0usize, 2] {
                let logits: Vec<f32> = (0..tokens * shape.experts)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        // Few distinct values, so ties between experts occur.
                        (state % 7) as f32 * 0.5
                    })
                    .collect();
                let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
                let dl = DeviceArray::from_slice(&client, &logits);
                moe_route(&client, shape, tokens, &meta, &dl, &slots, &route).unwrap();
                stats.record(&client, shape, layer, tokens, &meta, &route).unwrap();
                if armed {
                    let (sel, w) = route_reference(shape, &logits);
                    let sel: Vec<usize> = sel.iter().map(|&e| e as usize).collect();
                    route_stats_reference(shape.experts, layer, &sel, &w, &mut counts, &mut mass);
                }
            }
            let _ = step;
        }
        let got = stats.take(&client).unwrap().expect("tokens were recorded");
        assert_eq!(got.tokens, 13 + MAX_TOKENS as u64);
        assert_eq!(got.counts, counts);
        assert!(got.counts[8..16].iter().all(|&c| c == 0), "layer 1 was never routed");
        for (i, (g, r)) in got.mass.iter().zip(&mass).enumerate() {
            assert!((g - r).abs() <= MASS_TOL, "entry {i}: {g} vs {r}");
        }
        // Taken counters start again from zero.
        assert!(stats.take(&client).unwrap().is_none());
    }
}
