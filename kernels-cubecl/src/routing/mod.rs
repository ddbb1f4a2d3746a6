//! MoE routing on the device: softmax → top-k of the router logits, the grouped expert GEMM's
//! work items written straight into its descriptor tables (no host round trip inside a layer),
//! the planner's routing statistics, the gather of the experts' input rows and the weighted
//! combine of their outputs.

pub mod combine;
pub mod gather;
pub mod route;
pub mod router;
#[cfg(test)]
mod tests;

use cubecl::prelude::*;

use crate::device::bad;
use crate::pool::{DESC_WORDS, MAX_TOKENS, PoolSlot};
use crate::{DeviceArray, KernelError};

/// Geometry of one MoE layer for routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Routed experts (≤ 128).
    pub experts: usize,
    /// Experts per token.
    pub k: usize,
    /// Renormalise the top-k probabilities.
    pub renormalize: bool,
    /// Model width H.
    pub hidden: usize,
    /// Expert width I.
    pub inter: usize,
}

/// The committed pages of one layer's experts: per expert its gate_up (`[2I, H]`) and down
/// (`[H, I]`) slot in the weight pool. Flattened to the 6 words per expert the routing kernel
/// copies into descriptors.
pub fn expert_slot_words(shape: MoeShape, slots: &[(PoolSlot, PoolSlot)]) -> Result<Vec<u32>, KernelError> {
    if slots.len() != shape.experts {
        return Err(bad(format!("{} expert slots for {} experts", slots.len(), shape.experts)));
    }
    let mut out = Vec::with_capacity(6 * slots.len());
    for (e, (gu, dn)) in slots.iter().enumerate() {
        if (gu.rows, gu.cols) != (2 * shape.inter as u32, shape.hidden as u32)
            || (dn.rows, dn.cols) != (shape.hidden as u32, shape.inter as u32)
        {
            return Err(bad(format!("expert {e}: slot shapes {gu:?} / {dn:?} do not match {shape:?}")));
        }
        out.extend([gu.plane_off, gu.lut_off, gu.bits, dn.plane_off, dn.lut_off, dn.bits]);
    }
    Ok(out)
}

/// Tokens per routed work item: an expert's tokens are split into items of at most this many.
/// Two, so every routed launch fits the persistent GEMV at its small token buckets: the host
/// cannot know how a batch spreads over the experts, and a decode batch gives each expert
/// about two tokens. An expert with more tokens reads its weights once per item.
pub const ROUTE_CHUNK: usize = 2;

/// Route chunks [`RouteBuffers::with_chunk`] accepts: powers of two up to the persistent
/// GEMV's largest token bucket ([`crate::GEMV_MAX_TOKENS`]; where an item's `x` does not fit in
/// shared memory the routed launch takes the tiled kernel). Wider chunks cut the weight reads
/// of experts with several tokens, at the cost of multiplies for every item and of the GEMV's
/// registers (`benches/results/sass-gemv.md`); [`ROUTE_CHUNK`] stays the default.
pub const ROUTE_CHUNK_CHOICES: [usize; 4] = [1, 2, 4, 8];

/// `chunk` is one of [`ROUTE_CHUNK_CHOICES`].
pub(crate) fn check_route_chunk(chunk: usize) -> Result<(), KernelError> {
    if ROUTE_CHUNK_CHOICES.contains(&chunk) {
        Ok(())
    } else {
        Err(bad(format!("route chunk {chunk}: expected one of {ROUTE_CHUNK_CHOICES:?}")))
    }
}

/// Routing statistics [`moe_route_counted`] accumulates: per expert `e` of the layer,
/// `counts[base + e] +=` its tokens and `mass[base + e] +=` their routing weights.
#[derive(Debug, Clone, Copy)]
pub struct RouteCounters<'a> {
    /// u32 counters, at least `base + experts`.
    pub counts: &'a DeviceArray,
    /// f32 sums, at least `base + experts`.
    pub mass: &'a DeviceArray,
    /// The layer's first entry (`layer · experts`).
    pub base: usize,
}

/// Output buffers of [`moe_route`].
#[derive(Debug, Clone)]
pub struct RouteBuffers {
    /// `[tokens, k]` routing weights.
    pub weights: DeviceArray,
    /// `[tokens, k]` expert of each choice (written by steps routed in two launches).
    pub sel: DeviceArray,
    /// `[tokens · k]` source token of each gathered row.
    pub gather: DeviceArray,
    /// `[tokens, k]` gathered row of each choice.
    pub pos: DeviceArray,
    /// `[experts · chunks + 1, 8]` gate_up work items (see [`RouteBuffers::chunks`]): the live
    /// ones first (expert order), the rest not written; word 0 of the last (header) slot counts
    /// the live ones.
    pub desc_gate_up: DeviceArray,
    /// `[experts · chunks + 1, 8]` down work items, laid out as `desc_gate_up`.
    pub desc_down: DeviceArray,
    /// `[experts, 2]`: each expert's first gathered row and its row count (what the grouped
    /// GEMM reads, [`crate::ap_gemm_grouped`]).
    pub groups: DeviceArray,
    /// Most tokens per work item (see [`RouteBuffers::with_chunk`]).
    chunk: usize,
    /// Most tokens of one routing launch (a multiple of `MAX_TOKENS`).
    capacity: usize,
    /// The layer geometry the tables are sized for.
    shape: MoeShape,
    /// One-element stand-ins for the statistics' buffers when none are kept (never written).
    no_counts: DeviceArray,
    no_mass: DeviceArray,
}

impl RouteBuffers {
    /// Buffers for up to `MAX_TOKENS` tokens, in work items of [`ROUTE_CHUNK`] tokens.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, shape: MoeShape) -> Self {
        Self::with_chunk(client, shape, ROUTE_CHUNK).expect("ROUTE_CHUNK is a valid chunk")
    }

    /// Buffers whose routing cuts an expert's tokens into work items of at most `chunk` tokens
    /// (one of [`ROUTE_CHUNK_CHOICES`]); the routed GEMMs read each item's weights once.
    pub fn with_chunk<R: Runtime>(
        client: &ComputeClient<R>,
        shape: MoeShape,
        chunk: usize,
    ) -> Result<Self, KernelError> {
        Self::with_capacity(client, shape, chunk, MAX_TOKENS)
    }

    /// [`Self::with_chunk`] for routing launches of up to `tokens` tokens (rounded up to a
    /// multiple of `MAX_TOKENS`): a decode step of that many sequences or prompt tokens.
    pub fn with_capacity<R: Runtime>(
        client: &ComputeClient<R>,
        shape: MoeShape,
        chunk: usize,
        tokens: usize,
    ) -> Result<Self, KernelError> {
        check_route_chunk(chunk)?;
        let (capacity, n, table) = Self::sizes(shape, chunk, tokens);
        Ok(Self {
            weights: DeviceArray::empty::<R, f32>(client, n),
            sel: DeviceArray::empty::<R, u32>(client, n),
            gather: DeviceArray::empty::<R, u32>(client, n),
            pos: DeviceArray::empty::<R, u32>(client, n),
            desc_gate_up: DeviceArray::empty::<R, u32>(client, table),
            desc_down: DeviceArray::empty::<R, u32>(client, table),
            groups: DeviceArray::empty::<R, u32>(client, 2 * shape.experts),
            chunk,
            capacity,
            shape,
            no_counts: DeviceArray::empty::<R, u32>(client, 1),
            no_mass: DeviceArray::empty::<R, f32>(client, 1),
        })
    }

    /// Capacity in tokens, choices and words of each descriptor table of buffers for steps of
    /// `tokens` tokens with items of `chunk` tokens.
    fn sizes(shape: MoeShape, chunk: usize, tokens: usize) -> (usize, usize, usize) {
        let capacity = tokens.max(1).next_multiple_of(MAX_TOKENS);
        let n = capacity * shape.k;
        // Both tables: `experts · chunks` items and the header slot.
        (capacity, n, (shape.experts * Self::items_per_expert(shape, chunk, capacity) + 1) * DESC_WORDS)
    }

    /// Items per expert in the tables: room for every live item of a step of `capacity` tokens
    /// (at most `capacity · k / chunk` plus one partial item per expert), spread over the
    /// experts.
    fn items_per_expert(shape: MoeShape, chunk: usize, capacity: usize) -> usize {
        let experts = shape.experts.max(1);
        ((capacity * shape.k).div_ceil(chunk.max(1)) + experts).div_ceil(experts)
    }

    /// Device bytes of these buffers.
    pub fn bytes(&self) -> u64 {
        let all = [
            &self.weights,
            &self.sel,
            &self.gather,
            &self.pos,
            &self.desc_gate_up,
            &self.desc_down,
            &self.groups,
            &self.no_counts,
            &self.no_mass,
        ];
        4 * all.iter().map(|a| a.len as u64).sum::<u64>()
    }

    /// Device bytes of [`Self::with_capacity`]'s buffers, for memory budgets.
    pub fn bytes_for(shape: MoeShape, chunk: usize, tokens: usize) -> u64 {
        let (_, n, table) = Self::sizes(shape, chunk, tokens);
        4 * (4 * n + 2 * table + 2 * shape.experts + 2) as u64
    }

    /// Most tokens per work item: what [`ap_gemm_routed`] and [`ap_gemm_routed_gated`] take
    /// with these buffers' tables.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Work items per expert in the tables (the live items are packed at the front, so an
    /// expert may have more).
    pub fn chunks(&self) -> usize {
        Self::items_per_expert(self.shape, self.chunk, self.capacity)
    }

    /// Most tokens of one routing launch into these buffers.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The statistics counters a routing launch writes: the caller's, or these buffers' unused
    /// stand-ins (the kernel compiled without statistics never touches them), with the layer's
    /// first entry.
    fn counters<'a>(&'a self, stats: Option<RouteCounters<'a>>) -> (&'a DeviceArray, &'a DeviceArray, usize) {
        match stats {
            Some(st) => (st.counts, st.mass, st.base),
            None => (&self.no_counts, &self.no_mass, 0),
        }
    }
}

/// Where each token's router logits sit: `logits[t · stride + offset ..][..experts]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogitsLayout {
    /// Elements per token row (`experts` for a buffer of logits only).
    pub stride: usize,
    /// The first logit in the row (after the other outputs of the GEMM that computed them).
    pub offset: usize,
}

/// CPU routing: per token the top-k experts (descending probability, lower index first on
/// ties) and their weights.
pub fn route_reference(shape: MoeShape, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let (mut sel, mut wts) = (vec![], vec![]);
    for row in logits.chunks(shape.experts) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
        let mut order: Vec<usize> = (0..shape.experts).collect();
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        let p: Vec<f32> = order[..shape.k].iter().map(|&e| (row[e] - m).exp() / z).collect();
        let s: f32 = p.iter().sum();
        for (j, &e) in order[..shape.k].iter().enumerate() {
            sel.push(e as u32);
            wts.push(if shape.renormalize { p[j] / s } else { p[j] });
        }
    }
    (sel, wts)
}

/// CPU reference of the statistics of [`moe_route_counted`] for one layer:
/// `counts[layer · E + e] +=` choices of `e`, `mass[layer · E + e] +=` their weights.
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
