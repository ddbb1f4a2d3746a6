//! Routing statistics on the device: per-(layer, expert) token counts and routing mass of a
//! decode step, accumulated by the routing launch itself (`moe_route_counted`) without a host
//! round trip or a launch of their own. The planner needs them
//! once per step (or every few steps): the host downloads two flat `[layers · experts]` arrays.

use cubecl::prelude::*;
pub use kernels_cubecl::route_stats_reference;
use kernels_cubecl::{DeviceArray, KernelError, MoeShape, RouteCounters, fill_zero, read_u32_f32};

use crate::DecodeError;

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

    /// The counters layer `layer`'s routing of `tokens` tokens adds to, for
    /// [`kernels_cubecl::moe_route_counted`] (which accumulates them in the routing
    /// launch itself); `None` unless armed. Counts the tokens once per step.
    pub fn counters(
        &mut self,
        shape: MoeShape,
        layer: usize,
        tokens: usize,
    ) -> Result<Option<RouteCounters<'_>>, DecodeError> {
        if !self.armed || tokens == 0 {
            return Ok(None);
        }
        if layer >= self.layers || shape.experts != self.experts {
            return Err(DecodeError::Unsupported(format!(
                "route stats of layer {layer} ({} experts) for {} layers × {} experts",
                shape.experts, self.layers, self.experts
            )));
        }
        if self.last.is_none_or(|last| layer <= last) {
            self.tokens += tokens as u64;
        }
        self.last = Some(layer);
        Ok(Some(RouteCounters { counts: &self.counts, mass: &self.mass, base: layer * self.experts }))
    }

    /// Downloads the counters and zeroes them (`None` when no token was recorded).
    pub fn take<R: Runtime>(
        &mut self,
        client: &ComputeClient<R>,
    ) -> Result<Option<RoutingCounts>, KernelError> {
        if self.tokens == 0 {
            return Ok(None);
        }
        let (counts, mass) = read_u32_f32(client, &self.counts, &self.mass)?;
        fill_zero::<R, u32>(client, &self.counts);
        fill_zero::<R, f32>(client, &self.mass);
        let tokens = std::mem::take(&mut self.tokens);
        Ok(Some(RoutingCounts { tokens, counts, mass }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels_cubecl::PoolSlot;
    use kernels_cubecl::{MAX_TOKENS, RouteBuffers, expert_slot_words, moe_route_counted, route_reference};

    /// Mass is a sum of at most `tokens` weights in another order: f32 rounding only.
    const MASS_TOL: f32 = 1e-5;

    #[test]
    fn route_stats_matches_reference() {
        let client = pw_testkit::wgpu_client();
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
                let counters = stats.counters(shape, layer, tokens).unwrap();
                moe_route_counted(&client, shape, tokens, &meta, &dl, &slots, &route, counters).unwrap();
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
        // Taken counters start again from zero: nothing recorded, nothing taken, and a new
        // step's counts are that step's alone.
        assert!(stats.take(&client).unwrap().is_none());
        stats.armed = true;
        let logits: Vec<f32> = (0..3 * shape.experts).map(|i| (i % 5) as f32 * 0.25).collect();
        let meta = DeviceArray::from_slice(&client, &[3u32]);
        let dl = DeviceArray::from_slice(&client, &logits);
        let counters = stats.counters(shape, 1, 3).unwrap();
        moe_route_counted(&client, shape, 3, &meta, &dl, &slots, &route, counters).unwrap();
        let (sel, w) = route_reference(shape, &logits);
        let sel: Vec<usize> = sel.iter().map(|&e| e as usize).collect();
        let (mut counts, mut mass) = (vec![0u32; layers * 8], vec![0.0f32; layers * 8]);
        route_stats_reference(shape.experts, 1, &sel, &w, &mut counts, &mut mass);
        let got = stats.take(&client).unwrap().expect("a step was recorded");
        assert_eq!((got.tokens, &got.counts), (3, &counts));
        for (i, (g, r)) in got.mass.iter().zip(&mass).enumerate() {
            assert!((g - r).abs() <= MASS_TOL, "after a take, entry {i}: {g} vs {r}");
        }
    }
}
