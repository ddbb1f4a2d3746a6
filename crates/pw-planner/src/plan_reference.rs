//! The planner as it was before the flat curve table (one page's `bytes`/`sensitivity` read
//! through its [`PageState`] at every step, the heap greedy alone, the surplus undone by full
//! rescans): the reference that [`crate::plan`] must reproduce exactly, bit for bit.

use std::collections::BinaryHeap;

use super::Cand;
use crate::{
    MemoryTarget, PageState, Plan, PlanError, PlannerConfig, ResidualFactors, RoutingStats, Snapshot,
};

#[derive(Clone, Copy)]
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

    fn best_down(&self, cur: u8) -> Option<(f64, u8)> {
        let (dc, bc) = (self.damage(cur), self.bytes(cur));
        let mut best: Option<(f64, u8)> = None;
        for b in (self.floor..cur).rev() {
            let r = (self.damage(b) - dc) / (bc - self.bytes(b)) as f64;
            if best.is_none_or(|(br, _)| r < br) {
                best = Some((r, b));
            }
        }
        best
    }

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

fn curves<'a>(
    snapshot: &'a Snapshot,
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    config: &PlannerConfig,
) -> Result<Vec<Curve<'a>>, PlanError> {
    let routing = routing.filter(|_| config.use_routing);
    let residual = residual.filter(|_| config.use_residual);
    snapshot
        .pages
        .iter()
        .map(|p| {
            p.validate()?;
            let mut weight = 1.0;
            let mut floor = p.min_bits.max(config.floor_bits);
            if let Some(r) = routing {
                weight *= r.multiplier(p.id.layer, p.id.expert);
                floor = floor.max(r.floor_bits(p.id.layer, p.id.expert));
            }
            if let Some(f) = residual {
                weight *= f.get(p.id.layer, p.id.kind);
            }
            Ok(Curve { page: p, weight, floor: floor.min(p.max_bits), proxy: !config.use_sensitivity })
        })
        .collect()
}

/// The reference of [`crate::plan`] (inputs assumed in shape).
pub(crate) fn plan_reference(
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

/// Heap greedy (pop the cheapest move, push that page's next), then the two repairs.
fn lower(cs: &[Curve], cur: &mut [u8], target: u64) -> bool {
    if target == 0 {
        return true;
    }
    let orig = cur.to_vec();
    let mut heap: BinaryHeap<Cand> = cs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.best_down(cur[i]).map(|(r, to)| Cand { key: -r + 0.0, page: i, to }))
        .collect();
    let mut freed = 0u64;
    let (lp, prev) = loop {
        let Some(Cand { key, page, to }) = heap.pop() else { return false };
        let c = &cs[page];
        let from = cur[page];
        freed += c.bytes(from) - c.bytes(to);
        cur[page] = to;
        if freed >= target {
            break (page, from);
        }
        if let Some((r, next)) = c.best_down(to) {
            heap.push(Cand { key: (-r).min(key) + 0.0, page, to: next });
        }
    };
    // Replace the final move by the cheapest single move covering what was missing.
    let c = &cs[lp];
    let step_bytes = c.bytes(prev) - c.bytes(cur[lp]);
    let step_damage = c.damage(cur[lp]) - c.damage(prev);
    let before = freed - step_bytes;
    let need = target - before;
    let mut best = (step_damage, step_bytes, lp, cur[lp]);
    for (j, c) in cs.iter().enumerate() {
        let from = if j == lp { prev } else { cur[j] };
        for b in c.floor..from {
            let bytes = c.bytes(from) - c.bytes(b);
            if bytes < need {
                continue;
            }
            let dmg = c.damage(b) - c.damage(from);
            if dmg < best.0 || (dmg == best.0 && (bytes, j) < (best.1, best.2)) {
                best = (dmg, bytes, j, b);
            }
        }
    }
    let (_, bytes, j, b) = best;
    cur[lp] = prev;
    cur[j] = b;
    freed = before + bytes;
    // Undo surplus: rescan every lowered page per raise.
    let lowered: Vec<usize> = (0..cur.len()).filter(|&i| cur[i] < orig[i]).collect();
    loop {
        let surplus = freed - target;
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
        let Some((_, i, b, cost)) = best else { return true };
        cur[i] = b;
        freed -= cost;
    }
}

/// Heap greedy raising, re-planning a page whose best move no longer fits.
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
