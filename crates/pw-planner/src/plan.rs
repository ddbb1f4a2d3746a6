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

/// One page's damage curve and legal range, resolved from all inputs.
#[derive(Debug, Clone, Copy)]
struct Curve<'a> {
    page: &'a PageState,
    weight: f64,
    floor: u8,
    proxy: bool,
}

impl Curve<'_> {
    fn damage(&self, b: u8) -> f64 {
        let s = if self.proxy {
            self.page.bytes_at(self.page.max_bits) as f64 * 0.25f64.powi(b as i32)
        } else {
            self.page.sensitivity_at(b)
        };
        self.weight * s
    }

    fn bytes(&self, b: u8) -> u64 {
        self.page.bytes_at(b)
    }

    /// Cheapest lowering from `cur` by damage per byte freed: `(ratio, to)`.
    fn best_down(&self, cur: u8) -> Option<(f64, u8)> {
        let (dc, bc) = (self.damage(cur), self.bytes(cur));
        let mut best: Option<(f64, u8)> = None;
        // From high to low so that a tie keeps the smaller move.
        for b in (self.floor..cur).rev() {
            let r = (self.damage(b) - dc) / (bc - self.bytes(b)) as f64;
            if best.is_none_or(|(br, _)| r < br) {
                best = Some((r, b));
            }
        }
        best
    }

    /// Best raise from `cur` within `budget` bytes by damage saved per byte: `(ratio, to)`;
    /// only raises that save damage.
    fn best_up(&self, cur: u8, budget: u64) -> Option<(f64, u8)> {
        let (dc, bc) = (self.damage(cur), self.bytes(cur));
        let mut best: Option<(f64, u8)> = None;
        for b in cur + 1..=self.page.max_bits {
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

/// `-0.0` would order below `0.0` under `total_cmp`; ties must stay ties.
fn neg(x: f64) -> f64 {
    if x == 0.0 { 0.0 } else { -x }
}

fn curves<'a>(
    snapshot: &'a Snapshot,
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    config: &PlannerConfig,
) -> Result<Vec<Curve<'a>>, PlanError> {
    snapshot.validate()?;
    let routing = routing.filter(|_| config.use_routing);
    let residual = residual.filter(|_| config.use_residual);
    snapshot
        .pages
        .iter()
        .map(|p| {
            let mut weight = 1.0;
            let mut floor = p.min_bits.max(config.floor_bits);
            if let Some(r) = routing {
                if p.id.layer >= r.layers() || p.id.expert >= r.experts() {
                    return Err(PlanError::Shape {
                        what: "routing statistics".into(),
                        reason: format!("cover {}×{} experts, not page {}", r.layers(), r.experts(), p.id),
                    });
                }
                weight *= r.multiplier(p.id.layer, p.id.expert);
                floor = floor.max(r.floor_bits(p.id.layer, p.id.expert));
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
            Ok(Curve { page: p, weight, floor: floor.min(p.max_bits), proxy: !config.use_sensitivity })
        })
        .collect()
}

/// Estimated damage `Σ_i D_i(bits_i)` of an allocation under the same model as [`plan`].
pub fn estimated_damage(
    snapshot: &Snapshot,
    bits: &[u8],
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    config: &PlannerConfig,
) -> Result<f64, PlanError> {
    if bits.len() != snapshot.pages.len() {
        return Err(PlanError::Shape {
            what: "allocation".into(),
            reason: format!("{} bit-widths for {} pages", bits.len(), snapshot.pages.len()),
        });
    }
    let cs = curves(snapshot, routing, residual, config)?;
    cs.iter()
        .zip(bits)
        .map(|(c, &b)| {
            if (c.page.min_bits..=c.page.max_bits).contains(&b) {
                Ok(c.damage(b))
            } else {
                Err(PlanError::Page {
                    page: c.page.id.to_string(),
                    reason: format!("{b} bits is not stored"),
                })
            }
        })
        .sum()
}

/// The bit floor per page that [`plan`] respects (stored minimum, global floor, routing floor).
pub fn floors(
    snapshot: &Snapshot,
    routing: Option<&RoutingStats>,
    config: &PlannerConfig,
) -> Result<Vec<u8>, PlanError> {
    Ok(curves(snapshot, routing, None, config)?.iter().map(|c| c.floor).collect())
}

/// New desired bit-widths for `target`. Pure: same inputs, same plan.
///
/// `Free(n)` lowers pages (never below their floor) until the desired state holds at least
/// `n` fewer bytes; if even every page at its floor does not free `n`, all reachable lowering
/// is planned and `met` is false. `Spare(n)` raises pages (never above `max_bits`) spending at
/// most `n` bytes. `Hold` returns the desired state unchanged.
pub fn plan(
    snapshot: &Snapshot,
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    target: MemoryTarget,
    config: &PlannerConfig,
) -> Result<Plan, PlanError> {
    let cs = curves(snapshot, routing, residual, config)?;
    let mut cur: Vec<u8> = snapshot.pages.iter().map(|p| p.desired).collect();
    let met = match target {
        MemoryTarget::Hold => true,
        MemoryTarget::Free(n) => lower(&cs, &mut cur, n),
        MemoryTarget::Spare(n) => {
            raise(&cs, &mut cur, n);
            true
        }
    };
    let bytes_before = snapshot.desired_bytes();
    let bytes_after = cs.iter().zip(&cur).map(|(c, &b)| c.bytes(b)).sum();
    let damage_delta =
        cs.iter().zip(&cur).zip(&snapshot.pages).map(|((c, &b), p)| c.damage(b) - c.damage(p.desired)).sum();
    Ok(Plan { desired: cur, target, bytes_before, bytes_after, damage_delta, met })
}

/// Greedy lowering; returns whether `target` bytes were freed.
fn lower(cs: &[Curve], cur: &mut [u8], target: u64) -> bool {
    if target == 0 {
        return true;
    }
    let orig = cur.to_vec();
    let mut heap: BinaryHeap<Cand> = cs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.best_down(cur[i]).map(|(r, to)| Cand { key: neg(r), page: i, to }))
        .collect();
    let mut freed = 0u64;
    let mut last = None;
    while freed < target {
        let Some(Cand { page, to, .. }) = heap.pop() else { break };
        let c = &cs[page];
        freed += c.bytes(cur[page]) - c.bytes(to);
        last = Some((page, cur[page]));
        cur[page] = to;
        if let Some((r, to)) = c.best_down(to) {
            heap.push(Cand { key: neg(r), page, to });
        }
    }
    if freed < target {
        return false;
    }
    if let Some((lp, prev)) = last {
        replace_final_move(cs, cur, &mut freed, target, lp, prev);
    }
    undo_surplus(cs, cur, &orig, &mut freed, target);
    true
}

/// Swaps the final greedy move (page `lp`, which was at `prev`) for the cheapest single legal
/// move that alone covers what was missing before it, when that damages less.
fn replace_final_move(cs: &[Curve], cur: &mut [u8], freed: &mut u64, target: u64, lp: usize, prev: u8) {
    let c = &cs[lp];
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
                continue;
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
fn undo_surplus(cs: &[Curve], cur: &mut [u8], orig: &[u8], freed: &mut u64, target: u64) {
    let lowered: Vec<usize> = (0..cur.len()).filter(|&i| cur[i] < orig[i]).collect();
    loop {
        let surplus = *freed - target;
        let mut best: Option<(f64, usize, u8, u64)> = None;
        for &i in &lowered {
            let c = &cs[i];
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

/// Greedy raising within `budget` bytes.
fn raise(cs: &[Curve], cur: &mut [u8], budget: u64) {
    let mut left = budget;
    let mut heap: BinaryHeap<Cand> = cs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.best_up(cur[i], left).map(|(r, to)| Cand { key: r, page: i, to }))
        .collect();
    while let Some(Cand { page, to, .. }) = heap.pop() {
        let c = &cs[page];
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
}
