//! The fast path's expert storage under the weight page table: one [`PagedWeights`] per layer
//! (its plane and LUT arenas are the pool the grouped GEMM reads; one pool per layer keeps word
//! offsets within u32 even for Mixtral-8x7B), all leasing from one [`Accountant`] that the KV
//! cache shares. The routing kernel's slot table of a layer is rebuilt only when that layer's
//! page table publishes a commit, so kernels never see a page in transfer. Dense layers (no
//! routed experts) have no table; Qwen2-MoE's shared expert and Gemma-4's dense branch stay
//! dense f16 weights of the decoder.

use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{DeviceArray, MoeShape, PoolSlot, expert_slot_words};
use pw_format::{ApBlock, BlockKind};
use pw_pages::{
    Accountant, BoundaryTimes, CommitReport, CubePool, DeviceMover, MoveError, Mover, PageId, PageKey,
    PagedWeights, Ticket, Write,
};

use crate::DecodeError;

/// The decoder's mover: [`pw_pages::device_mover`] (on CUDA asynchronous pinned copies, the
/// kernels never wait for a raising; elsewhere copies on the client's queue). A synthetic model
/// (random weights for speed measurements) fills its plane arena once with hashed words on the
/// device, skips plane copies (any extent already holds random planes, and full-size host
/// parents need never be touched) and copies its LUTs on the client's queue ([`CubePool`]).
pub struct ExpertMover<R: Runtime> {
    inner: Box<dyn DeviceMover<R>>,
    skip_planes: bool,
}

impl<R: Runtime> ExpertMover<R> {
    /// The arenas.
    pub fn pool(&self) -> &CubePool<R> {
        self.inner.pool()
    }

    fn keep<'a>(&self, writes: &[Write<'a>]) -> Vec<Write<'a>> {
        writes.iter().copied().filter(|w| !(self.skip_planes && matches!(w, Write::Planes { .. }))).collect()
    }
}

impl<R: Runtime> Mover for ExpertMover<R> {
    fn capacity(&self) -> (usize, usize) {
        self.inner.capacity()
    }

    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError> {
        let w = self.keep(writes);
        self.inner.write_ordered(&w)
    }

    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        let w = self.keep(writes);
        self.inner.start(&w)
    }

    fn finished(&mut self, ticket: Ticket) -> Result<bool, MoveError> {
        self.inner.finished(ticket)
    }

    fn publish(&mut self, table: &[PoolSlot]) -> Result<(), MoveError> {
        self.inner.publish(table)
    }

    fn end_boundary(&mut self) -> Result<(), MoveError> {
        self.inner.end_boundary()
    }

    fn waits_for_queue(&self) -> bool {
        self.inner.waits_for_queue()
    }

    fn queue_drained(&mut self) {
        self.inner.queue_drained()
    }

    fn pin_host(&mut self, data: &[u8]) {
        if !self.skip_planes {
            self.inner.pin_host(data)
        }
    }

    fn pin_host_luts(&mut self, data: &[u8]) {
        self.inner.pin_host_luts(data)
    }
}

/// Longest wait of [`PagedExperts::settle`] for the uploads of a load (Mixtral-8x7B's 45 GB
/// at 8 bits take ~1 s at the pinned copy's 55 GB/s, minutes through CubeCL's own uploads).
const SETTLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(1800);
/// How long [`PagedExperts::settle`] waits with no transfer in flight and no page moving.
const STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What one [`PagedExperts::boundary`] did, over all layers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpertCommit {
    /// Pages lowered (committed at once).
    pub lowered: usize,
    /// Raisings committed.
    pub raised: usize,
    /// Raisings whose transfer started.
    pub started: usize,
    /// Raisings that could not start (budget or fragmentation), retried later.
    pub deferred: usize,
    /// Layers whose slot table changed.
    pub published: usize,
    /// Relocations (against arena fragmentation) started or committed.
    pub relocations: usize,
    /// Host time of the boundary's parts over all layers (publishing includes the slot tables'
    /// uploads).
    pub times: BoundaryTimes,
}

impl ExpertCommit {
    fn add(&mut self, r: &CommitReport) {
        self.lowered += r.lowered.len();
        self.raised += r.raised.len();
        self.started += r.started.len();
        self.deferred += r.deferred.len();
        self.published += r.published as usize;
        self.relocations += r.relocating.len() + r.relocated.len();
        self.times.add(&r.times);
    }
}

/// One page as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertPage {
    /// Decoder layer.
    pub layer: usize,
    /// Expert.
    pub expert: usize,
    /// gate_up or down.
    pub kind: BlockKind,
    /// Desired bits (what the table moves towards).
    pub desired: u8,
    /// Committed bits (what the kernels read).
    pub committed: u8,
    /// Stored range.
    pub min_bits: u8,
    /// Stored range.
    pub max_bits: u8,
    /// Device bytes (planes + LUT) per bit-width `min_bits..=max_bits`.
    pub bytes: Vec<u64>,
    /// Offline sensitivity per bit-width `min_bits..=max_bits`.
    pub sensitivity: Vec<f64>,
    /// Target of the raising whose copy is in flight, if any.
    pub raising_to: Option<u8>,
}

/// One sparse layer's committed expert pool as a step reads it.
pub(crate) struct LayerPool<'a> {
    pub(crate) planes: &'a DeviceArray,
    pub(crate) luts: &'a DeviceArray,
    pub(crate) slots: &'a DeviceArray,
}

/// Every sparse layer's experts under a page table.
pub struct PagedExperts<R: Runtime> {
    client: ComputeClient<R>,
    shape: MoeShape,
    /// Page tables of the sparse layers, in layer order.
    layers: Vec<PagedWeights<ExpertMover<R>>>,
    /// Per decoder layer: its index into `layers` (`None`: dense layer).
    index: Vec<Option<usize>>,
    /// Committed slot tables, parallel to `layers`.
    slots: Vec<DeviceArray>,
    accountant: Accountant,
}

/// Device bytes of a block at `bits` (planes + LUT).
fn block_bytes(b: &ApBlock, bits: u8) -> u64 {
    let (p, l) = b.bytes_at(bits);
    (p + l) as u64
}

impl<R: Runtime> PagedExperts<R> {
    /// Pages over `blocks` (`[layer][expert] = (gate_up, down)`; an empty layer is dense),
    /// committed at `bits` (`[layer][expert] = (gate_up, down)`) before this returns, leasing
    /// from `accountant`.
    /// Each layer's arenas hold all its pages at their top width plus room for one page in
    /// transfer. `synthetic`: see [`ExpertMover`].
    pub fn new(
        client: &ComputeClient<R>,
        shape: MoeShape,
        blocks: Vec<Vec<(ApBlock, ApBlock)>>,
        bits: &[Vec<(u8, u8)>],
        accountant: Accountant,
        synthetic: bool,
    ) -> Result<Self, DecodeError> {
        if bits.len() != blocks.len() || bits.iter().zip(&blocks).any(|(b, l)| b.len() != l.len()) {
            return Err(DecodeError::Unsupported("expert bit-widths do not match the expert blocks".into()));
        }
        let mut layers = Vec::with_capacity(blocks.len());
        let mut index = Vec::with_capacity(blocks.len());
        for (l, layer) in blocks.into_iter().enumerate() {
            if layer.is_empty() {
                index.push(None);
                continue;
            }
            if layer.len() != shape.experts {
                return Err(DecodeError::Unsupported(format!(
                    "layer {l}: {} experts, the model has {}",
                    layer.len(),
                    shape.experts
                )));
            }
            let (mut words, mut luts, mut max_words, mut max_lut) = (0usize, 0usize, 0usize, 0usize);
            for b in layer.iter().flat_map(|(g, d)| [g, d]) {
                let w = b.max_bits as usize * b.rows * b.words_per_row();
                let t = b.rows << b.max_bits;
                (words, luts) = (words + w, luts + t);
                (max_words, max_lut) = (max_words.max(w), max_lut.max(t));
            }
            // Slack: a raising that cannot grow in place copies the page beside its old
            // extent, and every raising holds its new LUT beside the committed one.
            let (plane_words, lut_entries) = (words + max_words, luts + 2 * max_lut);
            // A synthetic model copies only LUTs, which CubeCL's queue takes at once; raising a
            // full-size one 3 → 8 bits through the CUDA mover needed thousands of boundaries
            // (relocations against fragmentation, each committed a boundary later) for Mixtral.
            let inner: Box<dyn DeviceMover<R>> = if synthetic {
                Box::new(CubePool::new(client.clone(), plane_words, lut_entries))
            } else {
                pw_pages::device_mover(client, plane_words, lut_entries).map_err(pw_pages::PageError::from)?
            };
            if synthetic {
                kernels_cubecl::fill_hash(client, inner.pool().planes(), l as u32);
            }
            let mover = ExpertMover { inner, skip_planes: synthetic };
            let pages: Vec<(String, PageKey, ApBlock)> = layer
                .into_iter()
                .enumerate()
                .flat_map(|(e, (g, d))| {
                    [
                        (
                            format!("layers.{l}.experts.{e}.gate_up"),
                            PageKey { layer: l, expert: e, kind: BlockKind::GateUp },
                            g,
                        ),
                        (
                            format!("layers.{l}.experts.{e}.down"),
                            PageKey { layer: l, expert: e, kind: BlockKind::Down },
                            d,
                        ),
                    ]
                })
                .collect();
            let mut table = PagedWeights::new(pages, accountant.clone(), mover)?;
            for (e, &(bg, bd)) in bits[l].iter().enumerate() {
                table.set_desired(PageId(2 * e), bg)?;
                table.set_desired(PageId(2 * e + 1), bd)?;
            }
            let report = table.boundary()?;
            if let Some(d) = report.deferred.first() {
                return Err(DecodeError::Unsupported(format!(
                    "layer {l}: the experts do not fit at their initial bit-widths: {}",
                    d.reason
                )));
            }
            index.push(Some(layers.len()));
            layers.push(table);
        }
        let mut me = Self { client: client.clone(), shape, slots: Vec::new(), layers, index, accountant };
        me.slots = me.slot_tables(&(0..me.layers.len()).collect::<Vec<_>>())?;
        // The first boundary started every page's upload; an asynchronous mover commits them
        // at later boundaries (which refresh the slot tables).
        me.settle()?;
        Ok(me)
    }

    /// Whether some page's desired bits differ from its committed ones.
    fn pending(&self) -> bool {
        self.layers
            .iter()
            .any(|t| t.ids().any(|id| t.info(id).is_ok_and(|p| p.desired != 0 && p.desired != p.committed)))
    }

    /// Runs boundaries until every page holds its desired bits, waiting for the transfers in
    /// flight: for loading and benchmarks, never while serving. Fails when nothing moves any
    /// more (a mix that does not fit the budget or the arenas) or after [`SETTLE_LIMIT`].
    fn settle(&mut self) -> Result<(), DecodeError> {
        let start = std::time::Instant::now();
        let mut last_progress = start;
        loop {
            let r = self.boundary()?;
            if !self.pending() {
                return Ok(());
            }
            let now = std::time::Instant::now();
            if r.raised + r.started + r.lowered + r.relocations > 0 {
                last_progress = now;
            }
            let in_flight = self
                .layers
                .iter()
                .any(|t| t.ids().any(|id| t.info(id).is_ok_and(|p| p.raising_to.is_some())));
            // A deferred raising may wait for a relocation, which the page state does not show.
            let stalled = !in_flight && now - last_progress > STALL_LIMIT;
            if stalled || now - start > SETTLE_LIMIT {
                return Err(DecodeError::Unsupported(
                    "expert pages did not reach the requested bit-widths (budget, arena space or a transfer that never finished)".into(),
                ));
            }
            kernels_cubecl::sync(&self.client)?;
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// The committed slot tables of sparse layers `layers`, in one upload.
    fn slot_tables(&self, layers: &[usize]) -> Result<Vec<DeviceArray>, DecodeError> {
        let words = layers
            .iter()
            .map(|&l| {
                let t = self.layers[l].table();
                let pairs: Vec<(PoolSlot, PoolSlot)> = t.chunks(2).map(|c| (c[0], c[1])).collect();
                expert_slot_words(self.shape, &pairs)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let parts: Vec<&[u32]> = words.iter().map(Vec::as_slice).collect();
        Ok(DeviceArray::from_slices(&self.client, &parts))
    }

    /// Random-weight experts for speed measurements: every sparse layer (`sparse[l]`) holds
    /// `shape.experts` pages of widths 3..=8 (random planes hashed on the device, random LUTs),
    /// expert `e` of layer `l` committed at `bits(l, e)` for both its blocks.
    pub fn synthetic(
        client: &ComputeClient<R>,
        shape: MoeShape,
        sparse: &[bool],
        bits: &dyn Fn(usize, usize) -> u8,
        accountant: Accountant,
    ) -> Result<Self, DecodeError> {
        Self::synthetic_with(client, shape, sparse, bits, accountant, false)
    }

    /// [`Self::synthetic`] with random host parents (8 planes of random words per page) that
    /// every load and raising copies through the mover like a real checkpoint's: for measuring
    /// page transfers. Host memory: every page at 8 bits.
    pub fn synthetic_host(
        client: &ComputeClient<R>,
        shape: MoeShape,
        sparse: &[bool],
        bits: &dyn Fn(usize, usize) -> u8,
        accountant: Accountant,
    ) -> Result<Self, DecodeError> {
        Self::synthetic_with(client, shape, sparse, bits, accountant, true)
    }

    fn synthetic_with(
        client: &ComputeClient<R>,
        shape: MoeShape,
        sparse: &[bool],
        bits: &dyn Fn(usize, usize) -> u8,
        accountant: Accountant,
        host_planes: bool,
    ) -> Result<Self, DecodeError> {
        let (h, i) = (shape.hidden, shape.inter);
        let (gu_luts, dn_luts) = (synthetic_luts(2 * i, 0.05, 1), synthetic_luts(h, 0.05, 2));
        let mut blocks = Vec::with_capacity(sparse.len());
        let mut initial = Vec::with_capacity(sparse.len());
        let mut seed = 1u64;
        for (l, &s) in sparse.iter().enumerate() {
            let n = if s { shape.experts } else { 0 };
            let mut layer = Vec::with_capacity(n);
            for _ in 0..n {
                let (mut g, mut d) = (synthetic_block(2 * i, h, &gu_luts), synthetic_block(h, i, &dn_luts));
                if host_planes {
                    for b in [&mut g, &mut d] {
                        seed += 1;
                        random_words(&mut b.planes, seed);
                    }
                }
                layer.push((g, d));
            }
            blocks.push(layer);
            let mut b = Vec::with_capacity(n);
            for e in 0..n {
                let x = bits(l, e);
                if !(3..=8).contains(&x) {
                    return Err(DecodeError::Unsupported(format!("bits {x} outside 3..=8")));
                }
                b.push((x, x));
            }
            initial.push(b);
        }
        Self::new(client, shape, blocks, &initial, accountant, !host_planes)
    }

    /// Commits expert `e` of layer `l` at `bits(l, e)` (both blocks) and waits until every
    /// raising has landed: for benchmarks between runs, never while serving.
    pub fn commit_now(&mut self, bits: &dyn Fn(usize, usize) -> u8) -> Result<(), DecodeError> {
        for (l, ix) in self.index.clone().into_iter().enumerate() {
            let Some(ix) = ix else { continue };
            for e in 0..self.shape.experts {
                let b = bits(l, e);
                self.layers[ix].set_desired(PageId(2 * e), b)?;
                self.layers[ix].set_desired(PageId(2 * e + 1), b)?;
            }
        }
        self.settle()
    }

    /// Layer `l`'s arenas and slot table as the step reads them; `None` for a dense layer.
    pub(crate) fn layer(&self, l: usize) -> Option<LayerPool<'_>> {
        let ix = self.index.get(l).copied().flatten()?;
        let pool = self.layers[ix].mover().pool();
        Some(LayerPool { planes: pool.planes(), luts: pool.luts(), slots: &self.slots[ix] })
    }

    fn table(&self, l: usize) -> Option<&PagedWeights<ExpertMover<R>>> {
        self.index.get(l).copied().flatten().map(|ix| &self.layers[ix])
    }

    /// Whether decoder layer `l` has routed experts.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.table(l).is_some()
    }

    /// Layer `l`'s plane arena (u32 words); `None` for a dense layer.
    pub fn planes(&self, l: usize) -> Option<&DeviceArray> {
        self.table(l).map(|t| t.mover().pool().planes())
    }

    /// Layer `l`'s LUT arena (f16 entries); `None` for a dense layer.
    pub fn luts(&self, l: usize) -> Option<&DeviceArray> {
        self.table(l).map(|t| t.mover().pool().luts())
    }

    /// Layer `l`'s committed slot table for the routing kernel (`[experts · 6]`); `None` for a
    /// dense layer.
    pub fn slots(&self, l: usize) -> Option<&DeviceArray> {
        self.index.get(l).copied().flatten().map(|ix| &self.slots[ix])
    }

    /// Committed device bytes of layer `l`'s experts (0 for a dense layer).
    pub fn layer_bytes(&self, l: usize) -> u64 {
        self.table(l)
            .map_or(0, |t| t.ids().filter_map(|id| t.info(id).ok()).map(|p| p.gpu_bytes as u64).sum())
    }

    /// The shared memory budget.
    pub fn accountant(&self) -> &Accountant {
        &self.accountant
    }

    /// Sparse layers (those with a page table).
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// The page tables, one per sparse layer in layer order (pages ordered expert-major,
    /// gate_up before down).
    pub fn tables(&self) -> &[PagedWeights<ExpertMover<R>>] {
        &self.layers
    }

    /// Every page in a fixed order (sparse layer, expert, gate_up then down); `layer` is the
    /// decoder layer. [`Self::set_desired`]
    /// takes indices into it.
    pub fn pages(&self) -> Vec<ExpertPage> {
        let mut out = Vec::new();
        for t in &self.layers {
            for id in t.ids() {
                let (Ok(info), Ok(b)) = (t.info(id), t.parent(id)) else { continue };
                let committed = info.committed;
                out.push(ExpertPage {
                    layer: info.key.layer,
                    expert: info.key.expert,
                    kind: info.key.kind,
                    desired: if info.desired == 0 { committed } else { info.desired },
                    committed,
                    min_bits: b.min_bits,
                    max_bits: b.max_bits,
                    bytes: (b.min_bits..=b.max_bits).map(|x| block_bytes(b, x)).collect(),
                    sensitivity: b.sensitivity.clone(),
                    raising_to: info.raising_to,
                });
            }
        }
        out
    }

    /// Every page's (desired, committed) bits in [`Self::pages`]' order (desired = committed
    /// where none was asked): what a boundary's planner refreshes, without copying the pages'
    /// fixed tables.
    pub fn page_bits(&self) -> Vec<(u8, u8)> {
        self.layers.iter().flat_map(|t| t.bits()).collect()
    }

    /// Asks for `bits` on page `index` of [`Self::pages`]; committed at the next boundary.
    pub fn set_desired(&mut self, index: usize, bits: u8) -> Result<(), DecodeError> {
        let per = 2 * self.shape.experts;
        let table = self
            .layers
            .get_mut(index / per)
            .ok_or_else(|| DecodeError::Unsupported(format!("expert page {index} out of range")))?;
        Ok(table.set_desired(PageId(index % per), bits)?)
    }

    /// The safe point between decode steps: every layer's [`PagedWeights::boundary`] (lowerings
    /// commit at once, finished raisings commit, new raisings start; the kernels' queue waited
    /// for at most once, see [`pw_pages::boundaries`]), and the slot tables of the layers that
    /// published, uploaded together. Never waits for a transfer.
    pub fn boundary(&mut self) -> Result<ExpertCommit, DecodeError> {
        let mut out = ExpertCommit::default();
        let client = &self.client;
        let drain = || kernels_cubecl::sync(client).map_err(|e| MoveError(e.to_string()));
        let (reports, waited) = pw_pages::boundaries(&mut self.layers, drain)?;
        // Waiting for the kernels is part of starting copies (the mover would wait itself).
        out.times.start += waited;
        out.times.start_mover += waited;
        for r in &reports {
            out.add(r);
        }
        let published: Vec<usize> =
            reports.iter().enumerate().filter(|(_, r)| r.published).map(|(l, _)| l).collect();
        if !published.is_empty() {
            let upload = std::time::Instant::now();
            let views = self.slot_tables(&published)?;
            for (l, v) in published.into_iter().zip(views) {
                self.slots[l] = v;
            }
            out.times.publish += upload.elapsed();
        }
        Ok(out)
    }

    /// Committed device bytes per bit-width (index = bits, 0..=8).
    pub fn bytes_by_bits(&self) -> [u64; 9] {
        let mut out = [0u64; 9];
        for t in &self.layers {
            for (o, b) in out.iter_mut().zip(t.bytes_by_bits()) {
                *o += b;
            }
        }
        out
    }

    /// Committed device bytes of all experts.
    pub fn committed_bytes(&self) -> u64 {
        self.bytes_by_bits().iter().sum()
    }

    /// Device bytes every page would take at `bits` (clamped to its range).
    pub fn bytes_at(&self, bits: u8) -> u64 {
        let mut total = 0;
        for t in &self.layers {
            for id in t.ids() {
                if let Ok(b) = t.parent(id) {
                    total += block_bytes(b, bits.clamp(b.min_bits, b.max_bits));
                }
            }
        }
        total
    }

    /// Bytes of the device arenas as allocated (planes + LUTs of every layer).
    pub fn arena_bytes(&self) -> u64 {
        self.layers.iter().map(|t| t.mover().capacity()).map(|(p, l)| (p * 4 + l * 2) as u64).sum()
    }
}

/// Host parents of random-weight experts for speed measurements: planes all zero (the
/// synthetic mover never copies them, so the allocation stays untouched), small random LUTs
/// (ascending per row, as the quantizer writes them) shared by every page of a shape, and a
/// sensitivity that falls 4× per bit (a uniform quantizer's MSE).
pub fn synthetic_block(rows: usize, cols: usize, luts: &[Vec<f16>]) -> ApBlock {
    let words = cols.div_ceil(32);
    let sensitivity = (3..=8u8).map(|b| (rows * cols) as f64 * 4f64.powi(-(b as i32))).collect();
    ApBlock {
        rows,
        cols,
        min_bits: 3,
        max_bits: 8,
        planes: vec![0u32; 8 * rows * words],
        luts: luts.to_vec(),
        sensitivity,
    }
}

/// Fills `out` with xorshift words from `seed`, on every core (a full-size model's parents are
/// gigabytes).
fn random_words(out: &mut [u32], seed: u64) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = out.len().div_ceil(threads).max(1 << 16);
    std::thread::scope(|s| {
        for (c, part) in out.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                let mut z = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (c as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9))
                    | 1;
                for w in part {
                    z ^= z << 13;
                    z ^= z >> 7;
                    z ^= z << 17;
                    *w = (z >> 16) as u32;
                }
            });
        }
    });
}

/// Random ascending LUTs of `rows` rows for widths 3..=8 with values in `±scale`.
pub fn synthetic_luts(rows: usize, scale: f32, seed: u64) -> Vec<Vec<f16>> {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    (3..=8u32)
        .map(|b| {
            let n = 1usize << b;
            let mut out = Vec::with_capacity(rows * n);
            for _ in 0..rows {
                let mut row: Vec<f32> = (0..n).map(|_| (next() * 2.0 - 1.0) * scale).collect();
                row.sort_by(f32::total_cmp);
                out.extend(row.into_iter().map(f16::from_f32));
            }
            out
        })
        .collect()
}
