//! The pure core: new desired bit-widths from a snapshot, the damage model and a byte target.
//!
//! # Damage model
//! Page `i` at `b` bits has estimated damage `D_i(b) = w_i · s_i(b)` where `s_i` is the offline
//! global sensitivity (the quantizer's importance-weighted SSE at `b` bits), and
//! `w_i = m_routing(layer, expert) · m_residual(layer, kind)`. Each factor can be switched off
//! for ablations ([`PlannerConfig`]). A move `b → b'` of one page costs `D_i(b') − D_i(b)` and
//! frees `bytes_i(b) − bytes_i(b')` (planes + LUT).
//!
//! # Non-convex curves: lower convex hull
//! `s_i(b)` need not be convex in bytes (nested 2-means can gain little at one bit and much at
//! the next). A one-bit greedy would then stall on a page whose next bit is expensive while the
//! bit after is cheap. The planner instead lets a move drop a page from `b` to any legal
//! `b' < b` and, per page, offers the move with the smallest damage per byte freed. Walking a
//! page like that visits exactly the vertices of the lower convex hull of its points
//! `(bytes(b), D(b))` below the start, so slopes come out non-decreasing per page and merging
//! all pages through one heap is the exact greedy of the fractional relaxation. Ties go to the
//! smaller move (fewer bytes) and then the lower page index, so results are deterministic.
//!
//! # Overshoot
//! Greedy prefixes are optimal for the bytes they free; only the final move can overshoot.
//! Two repairs make the result tight: (1) the final move is replaced by the cheapest single
//! legal move (any page, any depth) that alone covers what was still missing, when that
//! damages less; (2) then any lowered page is raised back towards its start as long as the
//! target stays met and damage falls (largest saving first). The result is within one move's
//! damage of the optimum (fractional bound), and no single page can be raised without missing
//! the target.
//!
//! # Restore
//! With spare bytes the same hull walk runs upwards: the move with the largest damage saved per
//! byte spent that still fits, until nothing fits or nothing helps (zero-benefit raises are
//! never taken). Hysteresis lives in the memory rule ([`crate::KvPressureConfig`]): a spare
//! budget leaves `T + H` free blocks, so a raise never triggers the next lowering by itself.

use std::cell::Cell;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use crate::{MemoryTarget, PageId, PageState, PlanError, RoutingStats, Snapshot};

/// Per-(layer, block kind) multipliers on the global sensitivity from the prompt-residual head.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidualFactors {
    layers: usize,
    /// `[layers, 2]` row-major: gate_up, down.
    values: Vec<f64>,
}

impl ResidualFactors {
    /// Factors from `[layers, 2]` values (gate_up then down per layer), each finite and > 0.
    pub fn new(layers: usize, values: Vec<f64>) -> Result<Self, PlanError> {
        if values.len() != 2 * layers {
            return Err(PlanError::Shape {
                what: "residual factors".into(),
                reason: format!("{} values, expected 2·layers = {}", values.len(), 2 * layers),
            });
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite() || *v <= 0.0) {
            return Err(PlanError::Shape {
                what: "residual factors".into(),
                reason: format!("layer {} block {} is {}, expected finite and > 0", i / 2, i % 2, values[i]),
            });
        }
        Ok(Self { layers, values })
    }

    /// All ones (no correction).
    pub fn ones(layers: usize) -> Self {
        Self { layers, values: vec![1.0; 2 * layers] }
    }

    /// Layers covered.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// The multiplier of `(layer, kind)`.
    pub fn get(&self, layer: usize, kind: pw_format::BlockKind) -> f64 {
        self.values[2 * layer + PageId::kind_index(kind)]
    }
}

/// Options of [`plan`]. The `use_*` switches are the ablations of issue 7.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Use the offline sensitivity tables; without them a page's error is modelled as
    /// `bytes(max_bits) · 4^−b` (a uniform quantizer's MSE per weight falls 4× per bit).
    pub use_sensitivity: bool,
    /// Use routing multipliers and bucket floors.
    pub use_routing: bool,
    /// Use the prompt-residual factors.
    pub use_residual: bool,
    /// Global bit floor (0 = each page's `min_bits`).
    pub floor_bits: u8,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self { use_sensitivity: true, use_routing: true, use_residual: true, floor_bits: 0 }
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// New desired bit-width per page, in snapshot order.
    pub desired: Vec<u8>,
    /// The target planned for.
    pub target: MemoryTarget,
    /// Device bytes of the snapshot's desired state.
    pub bytes_before: u64,
    /// Device bytes of the new desired state.
    pub bytes_after: u64,
    /// Change of estimated damage (positive = more damage).
    pub damage_delta: f64,
    /// Whether the target was met (`Free` beyond what every page at its floor frees is not).
    pub met: bool,
}

impl Plan {
    /// Bytes freed (negative when pages were raised).
    pub fn freed(&self) -> i64 {
        self.bytes_before as i64 - self.bytes_after as i64
    }

    /// `(page, from, to)` for every page whose desired bit-width changes.
    pub fn changes<'a>(&'a self, snapshot: &'a Snapshot) -> impl Iterator<Item = (PageId, u8, u8)> + 'a {
        snapshot
            .pages
            .iter()
            .zip(&self.desired)
            .filter(|(p, d)| p.desired != **d)
            .map(|(p, d)| (p.id, p.desired, *d))
    }
}

/// Every page's damage curve and legal range, resolved once per call from all inputs into
/// flat arrays: the greedies, the repairs and the sums then read two contiguous arrays instead
/// of each page's own `bytes`/`sensitivity` allocations, and never re-multiply the weights.
#[derive(Debug, Clone, Default)]
struct Curves {
    spans: Vec<Span>,
    /// `D_i(b)` of every page at every stored bit-width, page after page.
    damage: Vec<f64>,
    /// `bytes_i(b)`, laid out like `damage`.
    bytes: Vec<u64>,
    /// `Σ_i bytes_i(desired_i)`: the snapshot's desired bytes.
    desired_bytes: u64,
}

/// Where one page's curve lies in [`Curves`], and its range.
#[derive(Debug, Clone, Copy)]
struct Span {
    /// Index of `b = min` in the flat arrays.
    off: usize,
    min: u8,
    max: u8,
    floor: u8,
    /// The snapshot's desired bit-width.
    desired: u8,
}

// Buffers kept per thread between calls, taken out and put back: a Gemma-4-sized table needs
// ~2 MB of them, and allocating that afresh each call costs more in page faults than the
// planning itself. Results never depend on them (each use clears its buffer first); a nested
// or failed call simply finds an empty buffer and allocates.
thread_local! {
    static CURVES: Cell<Curves> = Cell::new(Curves::default());
    static SEGS: Cell<Vec<Seg>> = const { Cell::new(Vec::new()) };
    static CANDS: Cell<Vec<Cand>> = const { Cell::new(Vec::new()) };
}

/// One page's damage curve and legal range (a view into [`Curves`]).
#[derive(Debug, Clone, Copy)]
struct Curve<'a> {
    damage: &'a [f64],
    bytes: &'a [u64],
    min: u8,
    max: u8,
    floor: u8,
}

impl Curves {
    fn len(&self) -> usize {
        self.spans.len()
    }

    fn get(&self, i: usize) -> Curve<'_> {
        let s = self.spans[i];
        let n = (s.max - s.min) as usize + 1;
        Curve {
            damage: &self.damage[s.off..s.off + n],
            bytes: &self.bytes[s.off..s.off + n],
            min: s.min,
            max: s.max,
            floor: s.floor,
        }
    }

    fn iter(&self) -> impl Iterator<Item = Curve<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

impl Curve<'_> {
    fn damage(&self, b: u8) -> f64 {
        self.damage[(b - self.min) as usize]
    }

    fn bytes(&self, b: u8) -> u64 {
        self.bytes[(b - self.min) as usize]
    }

    /// Cheapest lowering from `cur` by damage per byte freed: `(ratio, to)`.
    fn best_down(&self, cur: u8) -> Option<(f64, u8)> {
        if cur <= self.floor {
            return None;
        }
        let (dc, bc) = (self.damage(cur), self.bytes(cur));
        let ratio = |b: u8| (self.damage(b) - dc) / (bc - self.bytes(b)) as f64;
        // From high to low so that a tie keeps the smaller move. Selects without branches:
        // which depth wins is unpredictable, and a mispredicted branch would discard the
        // divisions already in flight.
        let (mut best_r, mut best_b) = (ratio(cur - 1), cur - 1);
        for b in (self.floor..cur - 1).rev() {
            let r = ratio(b);
            let less = r < best_r;
            best_r = if less { r } else { best_r };
            best_b = if less { b } else { best_b };
        }
        Some((best_r, best_b))
    }

    /// Best raise from `cur` within `budget` bytes by damage saved per byte: `(ratio, to)`;
    /// only raises that save damage.
    fn best_up(&self, cur: u8, budget: u64) -> Option<(f64, u8)> {
        let (dc, bc) = (self.damage(cur), self.bytes(cur));
        let mut best: Option<(f64, u8)> = None;
        for b in cur + 1..=self.max {
            let cost = self.bytes(b) - bc;
            if cost > budget {
                break;
            }
            let gain = dc - self.damage(b);
            if gain <= 0.0 {
                continue;
            }
            let r = gain / cost as f64;
            if best.is_none_or(|(br, _)| r > br) {
                best = Some((r, b));
            }
        }
        best
    }
}

/// Heap entry: the largest `key` pops first, then the lowest page index.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cand {
    key: f64,
    page: usize,
    to: u8,
}

impl Eq for Cand {}

impl Ord for Cand {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.total_cmp(&other.key).then_with(|| other.page.cmp(&self.page))
    }
}

impl PartialOrd for Cand {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

fn curves(
    snapshot: &Snapshot,
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    config: &PlannerConfig,
) -> Result<Curves, PlanError> {
    let routing = routing.filter(|_| config.use_routing);
    let residual = residual.filter(|_| config.use_residual);
    let mut cs = CURVES.with(Cell::take);
    cs.spans.clear();
    cs.damage.clear();
    cs.bytes.clear();
    cs.desired_bytes = 0;
    // An expert's pages are usually adjacent: its bucket is looked up once for them.
    let mut expert_terms: Option<((usize, usize), f64, u8)> = None;
    for (i, p) in snapshot.pages.iter().enumerate() {
        if let Some(ahead) = snapshot.pages.get(i + PREFETCH_PAGES) {
            prefetch_tables(ahead);
        }
        if !p.is_valid() {
            p.validate()?;
        }
        let mut weight = 1.0;
        let mut floor = p.min_bits.max(config.floor_bits);
        if let Some(r) = routing {
            if p.id.layer >= r.layers() || p.id.expert >= r.experts() {
                return Err(PlanError::Shape {
                    what: "routing statistics".into(),
                    reason: format!("cover {}×{} experts, not page {}", r.layers(), r.experts(), p.id),
                });
            }
            let key = (p.id.layer, p.id.expert);
            let (multiplier, expert_floor) = match expert_terms {
                Some((k, m, f)) if k == key => (m, f),
                _ => {
                    let terms = (r.multiplier(key.0, key.1), r.floor_bits(key.0, key.1));
                    expert_terms = Some((key, terms.0, terms.1));
                    terms
                }
            };
            weight *= multiplier;
            floor = floor.max(expert_floor);
        }
        if let Some(f) = residual {
            if p.id.layer >= f.layers() {
                return Err(PlanError::Shape {
                    what: "residual factors".into(),
                    reason: format!("cover {} layers, not page {}", f.layers(), p.id),
                });
            }
            weight *= f.get(p.id.layer, p.id.kind);
        }
        let off = cs.damage.len();
        if config.use_sensitivity {
            cs.damage.extend(p.sensitivity.iter().map(|&s| weight * s));
        } else {
            // Without sensitivity tables: a uniform quantizer's error, 4× less per bit.
            let top = p.bytes_at(p.max_bits) as f64;
            cs.damage.extend((p.min_bits..=p.max_bits).map(|b| weight * (top * 0.25f64.powi(b as i32))));
        }
        cs.bytes.extend_from_slice(&p.bytes);
        cs.desired_bytes += p.bytes[(p.desired - p.min_bits) as usize];
        cs.spans.push(Span {
            off,
            min: p.min_bits,
            max: p.max_bits,
            floor: floor.min(p.max_bits),
            desired: p.desired,
        });
    }
    Ok(cs)
}

/// How many pages ahead [`curves`] starts loading a page's tables.
const PREFETCH_PAGES: usize = 8;

/// Starts loading a page's `bytes` and `sensitivity` ahead of use: they are separate small
/// allocations, and waiting for each in turn made up most of the pass over a large table.
#[inline(always)]
fn prefetch_tables(p: &PageState) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: SSE is part of the x86_64 baseline, and a prefetch is only a hint: it
        // reads nothing into the program and never faults, whatever the address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p.bytes.as_ptr().cast());
            _mm_prefetch::<_MM_HINT_T0>(p.sensitivity.as_ptr().cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Estimated damage `Σ_i D_i(bits_i)` of an allocation under the same model as [`plan`].
pub fn estimated_damage(
    snapshot: &Snapshot,
    bits: &[u8],
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    config: &PlannerConfig,
) -> Result<f64, PlanError> {
    Ok(page_damage(snapshot, bits, routing, residual, config)?.iter().sum())
}

/// Each page's estimated damage `D_i(bits_i)` under the same model as [`plan`] (what the
/// planner weighs when it lowers that page), in page order.
pub fn page_damage(
    snapshot: &Snapshot,
    bits: &[u8],
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    config: &PlannerConfig,
) -> Result<Vec<f64>, PlanError> {
    if bits.len() != snapshot.pages.len() {
        return Err(PlanError::Shape {
            what: "allocation".into(),
            reason: format!("{} bit-widths for {} pages", bits.len(), snapshot.pages.len()),
        });
    }
    let cs = curves(snapshot, routing, residual, config)?;
    let damage = cs
        .iter()
        .zip(bits)
        .zip(&snapshot.pages)
        .map(|((c, &b), p)| {
            if (c.min..=c.max).contains(&b) {
                Ok(c.damage(b))
            } else {
                Err(PlanError::Page { page: p.id.to_string(), reason: format!("{b} bits is not stored") })
            }
        })
        .collect();
    CURVES.with(|c| c.set(cs));
    damage
}

/// The bit floor per page that [`plan`] respects (stored minimum, global floor, routing floor).
pub fn floors(
    snapshot: &Snapshot,
    routing: Option<&RoutingStats>,
    config: &PlannerConfig,
) -> Result<Vec<u8>, PlanError> {
    let cs = curves(snapshot, routing, None, config)?;
    let floors = cs.spans.iter().map(|s| s.floor).collect();
    CURVES.with(|c| c.set(cs));
    Ok(floors)
}

/// New desired bit-widths for `target`. Pure: same inputs, same plan.
///
/// `Free(n)` lowers pages (never below their floor) until the desired state holds at least
/// `n` fewer bytes; if even every page at its floor does not free `n`, all reachable lowering
/// is planned and `met` is false. `Spare(n)` raises pages (never above `max_bits`) spending at
/// most `n` bytes. `Hold` returns the desired state unchanged.
///
/// Keeps its working buffers per thread between calls (about 2 MB for a Gemma-4-sized table
/// of 7680 pages) so that a call between decode steps does not fault fresh memory in.
pub fn plan(
    snapshot: &Snapshot,
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    target: MemoryTarget,
    config: &PlannerConfig,
) -> Result<Plan, PlanError> {
    let cs = curves(snapshot, routing, residual, config)?;
    let mut cur: Vec<u8> = cs.spans.iter().map(|s| s.desired).collect();
    let met = match target {
        MemoryTarget::Hold => true,
        MemoryTarget::Free(n) => lower(&cs, &mut cur, n),
        MemoryTarget::Spare(n) => {
            raise(&cs, &mut cur, n);
            true
        }
    };
    let bytes_before = cs.desired_bytes;
    let bytes_after = cs.iter().zip(&cur).map(|(c, &b)| c.bytes(b)).sum();
    let damage_delta =
        cs.iter().zip(&cur).zip(&cs.spans).map(|((c, &b), s)| c.damage(b) - c.damage(s.desired)).sum();
    CURVES.with(|c| c.set(cs));
    Ok(Plan { desired: cur, target, bytes_before, bytes_after, damage_delta, met })
}

/// One segment of a page's hull walk: `from → to` moves `bytes`; `key` orders it (damage per
/// byte freed when lowering, minus damage saved per byte spent when raising); `step` is its
/// position along the page's walk.
#[derive(Debug, Clone, Copy)]
struct Seg {
    key: f64,
    page: u32,
    step: u8,
    from: u8,
    to: u8,
    bytes: u64,
}

/// The greedy's total order: key, then page index, then position along the page.
fn seg_order(a: &Seg, b: &Seg) -> Ordering {
    a.key.total_cmp(&b.key).then(a.page.cmp(&b.page)).then(a.step.cmp(&b.step))
}

/// Where a lowering greedy stopped.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Greedy {
    /// Target reached: bytes freed and the final move (page, the bit-width it left).
    Reached { freed: u64, page: usize, from: u8 },
    /// Every page at its floor and still short.
    Short,
}

/// Greedy lowering; returns whether `target` bytes were freed.
///
/// Every page's hull walk from its desired bit-width is independent of the other pages, so
/// the greedy takes exactly the shortest prefix, in [`seg_order`], of all pages' hull
/// segments whose bytes reach the target. Small targets (the per-step case: a few KV blocks)
/// run a heap (pop the cheapest segment, push that page's next) and stop after a few pops;
/// large ones (or a heap that takes more than `pages / 8 + 16` pops) find the prefix's last
/// segment over all segments in linear time ([`cutoff`]; a Gemma-4 table has ~38k). Both
/// produce the same prefix.
fn lower(cs: &Curves, cur: &mut [u8], target: u64) -> bool {
    if target == 0 {
        return true;
    }
    let orig = cur.to_vec();
    // A bit step frees about an eighth of a page: up to ~pages/8 steps, the heap is cheaper.
    // (`cur` is still the snapshot's desired state.)
    let max_pops = if target <= cs.desired_bytes / 64 { cs.len() / 8 + 16 } else { 0 };
    let heap = if max_pops > 0 { lower_heap(cs, cur, target, max_pops) } else { None };
    let outcome = heap.unwrap_or_else(|| {
        cur.copy_from_slice(&orig);
        lower_select(cs, cur, target)
    });
    let Greedy::Reached { mut freed, page, from } = outcome else { return false };
    replace_final_move(cs, cur, &mut freed, target, page, from);
    undo_surplus(cs, cur, &orig, &mut freed, target);
    true
}

/// The heap greedy; `None` after `max_pops` pops without reaching the target.
fn lower_heap(cs: &Curves, cur: &mut [u8], target: u64, max_pops: usize) -> Option<Greedy> {
    // Max-heap on −ratio: the cheapest pops first; ties to the lower page index.
    let mut cands = CANDS.with(Cell::take);
    cands.clear();
    cands.extend(
        cs.iter()
            .enumerate()
            .filter_map(|(i, c)| c.best_down(cur[i]).map(|(r, to)| Cand { key: -r + 0.0, page: i, to })),
    );
    let mut heap = BinaryHeap::from(cands);
    let mut freed = 0u64;
    let mut outcome = None;
    for _ in 0..max_pops {
        let Some(Cand { key, page, to }) = heap.pop() else {
            outcome = Some(Greedy::Short);
            break;
        };
        let c = cs.get(page);
        let from = cur[page];
        freed += c.bytes(from) - c.bytes(to);
        cur[page] = to;
        if freed >= target {
            outcome = Some(Greedy::Reached { freed, page, from });
            break;
        }
        if let Some((r, next)) = c.best_down(to) {
            // Same clamp as `lower_select`: slopes along a page never decrease.
            heap.push(Cand { key: (-r).min(key) + 0.0, page, to: next });
        }
    }
    CANDS.with(|c| c.set(heap.into_vec()));
    outcome
}

/// The selection greedy over all hull segments ([`cutoff`]; once a quickselect, hence the test name).
fn lower_select(cs: &Curves, cur: &mut [u8], target: u64) -> Greedy {
    let mut segs = SEGS.with(Cell::take);
    segs.clear();
    for (i, c) in cs.iter().enumerate() {
        let mut at = cur[i];
        let mut prev_key = f64::NEG_INFINITY;
        let mut step = 0;
        while let Some((r, to)) = c.best_down(at) {
            // Hull slopes never decrease along a page; rounding must not reorder them.
            // (`+ 0.0` turns −0 into 0: `total_cmp` would order them.)
            let key = r.max(prev_key) + 0.0;
            prev_key = key;
            segs.push(Seg { key, page: i as u32, step, from: at, to, bytes: c.bytes(at) - c.bytes(to) });
            at = to;
            step += 1;
        }
    }
    let last = cutoff(&segs, target);
    let mut freed = 0;
    // Whether a segment is taken is unpredictable: select without branching.
    for s in &segs {
        let take = last.is_none_or(|l| seg_order(s, &l) != Ordering::Greater);
        let p = s.page as usize;
        cur[p] = if take { cur[p].min(s.to) } else { cur[p] };
        freed += if take { s.bytes } else { 0 };
    }
    SEGS.with(|c| c.set(segs));
    match last {
        Some(s) => Greedy::Reached { freed, page: s.page as usize, from: s.from },
        None => Greedy::Short,
    }
}

/// Buckets of [`cutoff`]'s byte histogram.
const BUCKETS: usize = 4096;

/// `key` as an integer in the order of `f64::total_cmp`.
fn key_rank(key: f64) -> u64 {
    let b = key.to_bits();
    if b >> 63 == 1 { !b } else { b | 1 << 63 }
}

/// The last segment, in [`seg_order`], of the shortest prefix of `segs` whose bytes reach
/// `need`; `None` when all of them do not.
///
/// One pass sums bytes per bucket of key rank (a float's rank grows like its logarithm, so
/// the buckets are fine where keys crowd), the bucket where the running sum reaches `need`
/// is found, and only that bucket's segments are put in order ([`shortest_prefix`]): every
/// earlier bucket lies wholly before it in [`seg_order`], every later one wholly after.
/// Two light passes instead of a quickselect that moves all segments several times.
fn cutoff(segs: &[Seg], need: u64) -> Option<Seg> {
    let (lo, hi) = segs.iter().fold((u64::MAX, 0), |(lo, hi), s| {
        let r = key_rank(s.key);
        (lo.min(r), hi.max(r))
    });
    if segs.is_empty() {
        return None;
    }
    // `(hi - lo) >> shift < BUCKETS`.
    let shift = (u64::BITS - (hi - lo).leading_zeros()).saturating_sub(BUCKETS.trailing_zeros());
    let bucket = |s: &Seg| ((key_rank(s.key) - lo) >> shift) as usize;
    let mut hist = vec![0u64; BUCKETS];
    for s in segs {
        hist[bucket(s)] += s.bytes;
    }
    let mut before = 0u64;
    let t = hist.iter().position(|&h| {
        let reached = before.saturating_add(h) >= need;
        if !reached {
            before += h;
        }
        reached
    })?;
    let mut within: Vec<Seg> = segs.iter().filter(|s| bucket(s) == t).copied().collect();
    shortest_prefix(&mut within, need - before).1
}

/// Reorders `segs` so that `segs[..n]` is the shortest prefix in [`seg_order`] whose bytes
/// reach `need`, and returns `n` with the prefix's last segment in that order; `None` (and
/// `n = segs.len()`) when all of them do not reach it.
fn shortest_prefix(segs: &mut [Seg], mut need: u64) -> (usize, Option<Seg>) {
    let (mut lo, mut hi) = (0, segs.len());
    while lo < hi {
        // Median of three as pivot, moved to the end (deterministic; no RNG in a pure fn).
        let mid = lo + (hi - lo) / 2;
        let mut ends = [lo, mid, hi - 1];
        ends.sort_by(|&a, &b| seg_order(&segs[a], &segs[b]));
        segs.swap(ends[1], hi - 1);
        let pivot = segs[hi - 1];
        let mut store = lo;
        let mut left_bytes = 0u64;
        // Branch-free Lomuto: `segs[store..i]` are all after the pivot, so swapping one of
        // them with `segs[i]` when that is after the pivot too only permutes that run.
        for i in lo..hi - 1 {
            let s = segs[i];
            let less = seg_order(&s, &pivot) == Ordering::Less;
            left_bytes += s.bytes * less as u64;
            segs[i] = segs[store];
            segs[store] = s;
            store += less as usize;
        }
        segs.swap(store, hi - 1);
        if left_bytes >= need {
            hi = store;
            continue;
        }
        need -= left_bytes;
        if pivot.bytes >= need {
            return (store + 1, Some(pivot));
        }
        need -= pivot.bytes;
        lo = store + 1;
    }
    (segs.len(), None)
}

/// Swaps the final greedy move (page `lp`, which was at `prev`) for the cheapest single legal
/// move that alone covers what was missing before it, when that damages less.
fn replace_final_move(cs: &Curves, cur: &mut [u8], freed: &mut u64, target: u64, lp: usize, prev: u8) {
    let c = cs.get(lp);
    let step_bytes = c.bytes(prev) - c.bytes(cur[lp]);
    let step_damage = c.damage(cur[lp]) - c.damage(prev);
    let before = *freed - step_bytes;
    let need = target - before;
    // (damage, bytes, page, to): the greedy move itself is the incumbent.
    let mut best = (step_damage, step_bytes, lp, cur[lp]);
    for (j, c) in cs.iter().enumerate() {
        let from = if j == lp { prev } else { cur[j] };
        for b in c.floor..from {
            let bytes = c.bytes(from) - c.bytes(b);
            if bytes < need {
                // Bytes freed only shrink as `b` rises; ties are broken by (bytes, page), so
                // the scan order does not matter.
                break;
            }
            let dmg = c.damage(b) - c.damage(from);
            let better = dmg < best.0 || (dmg == best.0 && (bytes, j) < (best.1, best.2));
            if better {
                best = (dmg, bytes, j, b);
            }
        }
    }
    let (_, bytes, j, b) = best;
    cur[lp] = prev;
    cur[j] = b;
    *freed = before + bytes;
}

/// Raises lowered pages back towards `orig` while `target` stays met, largest saving first.
fn undo_surplus(cs: &Curves, cur: &mut [u8], orig: &[u8], freed: &mut u64, target: u64) {
    // The surplus only shrinks and a page's raises only change when it is raised itself, so
    // a page whose cheapest raise (one bit) does not fit the surplus now never will: only
    // the few others are rescanned per raise.
    let surplus = *freed - target;
    let lowered: Vec<usize> = (0..cur.len())
        .filter(|&i| {
            let c = cs.get(i);
            cur[i] < orig[i] && c.bytes(cur[i] + 1) - c.bytes(cur[i]) <= surplus
        })
        .collect();
    loop {
        let surplus = *freed - target;
        let mut best: Option<(f64, usize, u8, u64)> = None;
        for &i in &lowered {
            let c = cs.get(i);
            for b in cur[i] + 1..=orig[i] {
                let cost = c.bytes(b) - c.bytes(cur[i]);
                if cost > surplus {
                    break;
                }
                let gain = c.damage(cur[i]) - c.damage(b);
                if gain > 0.0 && best.is_none_or(|(g, ..)| gain > g) {
                    best = Some((gain, i, b, cost));
                }
            }
        }
        let Some((_, i, b, cost)) = best else { return };
        cur[i] = b;
        *freed -= cost;
    }
}

/// Greedy raising within `budget` bytes: the move with the most damage saved per byte that
/// still fits, until nothing fits or helps.
///
/// Until the first move that does not fit, that greedy takes the longest prefix (in
/// [`seg_order`] on minus the ratio) of all pages' upward hull segments that fits in the
/// budget, found by [`cutoff`]; from there a heap finishes with what is left, re-planning a
/// page under the remaining budget when its best move no longer fits.
fn raise(cs: &Curves, cur: &mut [u8], budget: u64) {
    if budget == 0 {
        return;
    }
    let mut segs = SEGS.with(Cell::take);
    segs.clear();
    for (i, c) in cs.iter().enumerate() {
        let mut at = cur[i];
        let mut prev_key = f64::NEG_INFINITY;
        let mut step = 0;
        while let Some((r, to)) = c.best_up(at, u64::MAX) {
            let key = (-r).max(prev_key) + 0.0;
            prev_key = key;
            segs.push(Seg { key, page: i as u32, step, from: at, to, bytes: c.bytes(to) - c.bytes(at) });
            at = to;
            step += 1;
        }
    }
    // The shortest prefix exceeding the budget, minus its last segment, is the longest that fits.
    let last = cutoff(&segs, budget.saturating_add(1));
    let mut left = budget;
    for s in &segs {
        let take = last.is_none_or(|l| seg_order(s, &l) == Ordering::Less);
        let p = s.page as usize;
        cur[p] = if take { cur[p].max(s.to) } else { cur[p] };
        left -= if take { s.bytes } else { 0 };
    }
    SEGS.with(|c| c.set(segs));
    if last.is_some() {
        raise_heap(cs, cur, left);
    }
}

/// The heap greedy of [`raise`].
fn raise_heap(cs: &Curves, cur: &mut [u8], budget: u64) {
    let mut left = budget;
    let mut cands = CANDS.with(Cell::take);
    cands.clear();
    cands.extend(
        cs.iter()
            .enumerate()
            .filter_map(|(i, c)| c.best_up(cur[i], left).map(|(r, to)| Cand { key: r, page: i, to })),
    );
    let mut heap = BinaryHeap::from(cands);
    while let Some(Cand { page, to, .. }) = heap.pop() {
        let c = cs.get(page);
        let cost = c.bytes(to) - c.bytes(cur[page]);
        if cost > left {
            // Planned under a larger budget: re-plan this page under what is left.
            if let Some((r, to)) = c.best_up(cur[page], left) {
                heap.push(Cand { key: r, page, to });
            }
            continue;
        }
        left -= cost;
        cur[page] = to;
        if let Some((r, to)) = c.best_up(to, left) {
            heap.push(Cand { key: r, page, to });
        }
    }
    CANDS.with(|c| c.set(heap.into_vec()));
}

#[cfg(test)]
#[path = "plan_reference.rs"]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockKind, PageId};

    /// The heap and the quickselect greedies agree, ties and non-convex curves included.
    #[test]
    fn heap_and_quickselect_greedies_agree() {
        let mut seed = 12345u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for case in 0..300 {
            let pages: Vec<PageState> = (0..12)
                .map(|i| {
                    let mut bytes = vec![10 + (next() % 5) as u64];
                    let mut sens = vec![100.0 + (next() % 4) as f64 * 25.0];
                    for _ in 0..5 {
                        bytes.push(bytes.last().unwrap() + 1 + (next() % 3) as u64);
                        // Coarse values: many exact ties between pages.
                        sens.push(sens.last().unwrap() * [0.25, 0.5, 0.75, 1.0][(next() % 4) as usize]);
                    }
                    let d = 3 + (next() % 6) as u8;
                    PageState {
                        id: PageId { layer: i, expert: 0, kind: BlockKind::Down },
                        desired: d,
                        committed: d,
                        min_bits: 3,
                        max_bits: 8,
                        bytes,
                        sensitivity: sens,
                    }
                })
                .collect();
            let snap = Snapshot { pages };
            let cfg = PlannerConfig { use_routing: false, use_residual: false, ..PlannerConfig::default() };
            let cs = curves(&snap, None, None, &cfg).unwrap();
            let start: Vec<u8> = snap.pages.iter().map(|p| p.desired).collect();
            let target = 1 + (next() % 120) as u64;
            let mut a = start.clone();
            let mut b = start.clone();
            let ha = lower_heap(&cs, &mut a, target, usize::MAX).unwrap();
            let hb = lower_select(&cs, &mut b, target);
            assert_eq!((ha, &a), (hb, &b), "case {case}, target {target}");
            // Raising: quickselect + heap finish against the heap alone.
            let budget = (next() % 80) as u64;
            let mut a = start.clone();
            let mut b = start.clone();
            raise(&cs, &mut a, budget);
            raise_heap(&cs, &mut b, budget);
            assert_eq!(a, b, "case {case}, budget {budget}");
        }
    }

    /// The flat-table planner (bucketed cutoff, filtered surplus scan, per-thread buffers)
    /// reproduces the reference planner (per-page reads, heap greedy, full rescans) exactly:
    /// same bits, bytes, `met` and bit-identical damage, on random non-convex tables with
    /// ties, uneven bit ranges, routing, residual factors, floors and the proxy model.
    #[test]
    fn plans_match_the_reference_planner() {
        use crate::{RoutingConfig, RoutingStats};
        use rand::{Rng, SeedableRng, rngs::StdRng};

        let mut rng = StdRng::seed_from_u64(2026);
        let mut checked = 0;
        for case in 0..400 {
            let (layers, experts) = match case % 10 {
                9 => (12, 64), // 1536 pages: large enough for the selection path and buckets
                _ => (1 + rng.random_range(0..4), 1 + rng.random_range(0..6)),
            };
            let mut pages = Vec::new();
            for layer in 0..layers {
                for expert in 0..experts {
                    for kind in [BlockKind::GateUp, BlockKind::Down] {
                        let min = 1 + rng.random_range(0..4u8);
                        let max = min + rng.random_range(0..6u8);
                        let mut bytes = vec![1 + rng.random_range(0..40u64)];
                        let mut sens = vec![rng.random_range(1..9) as f64 * 64.0];
                        for _ in min..max {
                            bytes.push(bytes.last().unwrap() + 1 + rng.random_range(0..6u64));
                            // Coarse factors: exact ties between and within pages; 1.0 and
                            // 1.25 make curves flat or rising (non-convex, zero-gain raises).
                            let f = [0.125, 0.25, 0.5, 0.75, 1.0, 1.25][rng.random_range(0..6)];
                            sens.push(sens.last().unwrap() * f);
                        }
                        let desired = rng.random_range(min..=max);
                        let committed = rng.random_range(min..=max);
                        let id = PageId { layer, expert, kind };
                        pages.push(PageState {
                            id,
                            desired,
                            committed,
                            min_bits: min,
                            max_bits: max,
                            bytes,
                            sensitivity: sens,
                        });
                    }
                }
            }
            let snap = Snapshot { pages };
            let mut routing = RoutingStats::new(layers, experts, RoutingConfig::default()).unwrap();
            for _ in 0..rng.random_range(0..4) {
                let counts: Vec<u32> = (0..layers * experts).map(|_| rng.random_range(0..8)).collect();
                let mass: Vec<f32> = counts.iter().map(|&c| c as f32 * 0.3).collect();
                routing.update(8, &counts, &mass).unwrap();
            }
            let residual =
                ResidualFactors::new(layers, (0..2 * layers).map(|_| rng.random_range(0.5..2.0)).collect())
                    .unwrap();
            let cfg = PlannerConfig {
                use_sensitivity: rng.random_range(0..5) > 0,
                use_routing: rng.random_range(0..3) > 0,
                use_residual: rng.random_range(0..3) > 0,
                floor_bits: [0, 0, 0, 2, 4][rng.random_range(0..5)],
            };
            let total = snap.desired_bytes();
            let targets = [
                MemoryTarget::Hold,
                MemoryTarget::Free(0),
                MemoryTarget::Free(1 + rng.random_range(0..total / 32 + 1)),
                MemoryTarget::Free(rng.random_range(0..total + 1)),
                MemoryTarget::Free(total + 1),
                MemoryTarget::Spare(rng.random_range(0..total / 16 + 1)),
                MemoryTarget::Spare(rng.random_range(0..total + 1)),
                MemoryTarget::Spare(u64::MAX),
            ];
            for t in targets {
                let got = plan(&snap, Some(&routing), Some(&residual), t, &cfg).unwrap();
                let want =
                    reference::plan_reference(&snap, Some(&routing), Some(&residual), t, &cfg).unwrap();
                let same = got == want && got.damage_delta.to_bits() == want.damage_delta.to_bits();
                assert!(same, "case {case} {t:?} {cfg:?}:\n got {got:?}\nwant {want:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, 3200);
    }
}
