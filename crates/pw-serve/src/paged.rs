//! The memory side of the fast path: one budget ([`Accountant`]) for the experts' pages and the
//! KV cache, and the planner between steps.
//!
//! - KV blocks are leased from the budget as sequences grow (before the step that needs them)
//!   and given back when sequences end.
//! - At every boundary (no step in flight): the routing counts of the sampled steps are folded
//!   into the planner, the KV memory target is computed from the free blocks less those the
//!   next steps will take (`D = max(0, T + 1 − F) · B_KV`, or memory to give back when
//!   `F > T + H`), the plan becomes
//!   the pages' desired bits, and the page table commits: lowerings at once, raisings when
//!   their copy has finished. Nothing waits for a transfer.
//! - A step that still finds no room (a long prompt between two boundaries) runs the same
//!   boundary first: between two decode launches is as safe as between two engine steps.

use cubecl::prelude::*;
use pw_decode::{Decoder, ExpertPage};
use pw_pages::{Accountant, Lease, Use};
use pw_planner::{
    KvPressureConfig, MemoryTarget, PageId, PageState, Planner, PlannerConfig, ResidualFactors,
    RoutingConfig, Snapshot, page_damage, plan,
};

use crate::hook::MemoryState;
use crate::model::StepError;
use crate::page_table::{PageLocation, PageTableView, PageView, PlannerDecision};

/// Who decides the experts' bit-widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPolicy {
    /// Every page stays at its initial bits (the KV cache gets what is left).
    Pinned,
    /// The planner lowers pages under KV pressure and raises them when the cache shrinks.
    Planner,
}

/// Memory options of the fast path.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryOptions {
    /// Device bytes for the experts and the KV cache together (`None`: no limit; the KV cache
    /// is sized from the engine's KV budget and the planner has nothing to do).
    pub budget_bytes: Option<u64>,
    /// Pinned bits or the planner.
    pub policy: WeightPolicy,
    /// The planner's damage model, ablations and global floor.
    pub planner: PlannerConfig,
    /// Routing buckets and floors.
    pub routing: RoutingConfig,
    /// `T_blk`: free KV blocks at or below which pages are lowered.
    pub threshold_blocks: u64,
    /// `H`: free blocks above `T_blk` needed before memory goes back to the weights.
    pub give_back_blocks: u64,
    /// Routing counts are recorded on every n-th step (and downloaded at the boundary after it).
    pub routing_every: u64,
    /// Most bytes one boundary may start raising (0 = no limit), so that a give-back spreads
    /// its copies over several steps.
    pub max_raise_bytes: u64,
    /// How the calibration text was routed (from a PagedWeight checkpoint; empty: unknown):
    /// the planner's routing multiplier is then relative to it.
    pub calibration_routing: Vec<pw_format::LayerRouting>,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            budget_bytes: None,
            policy: WeightPolicy::Planner,
            planner: PlannerConfig::default(),
            routing: RoutingConfig::default(),
            threshold_blocks: 16,
            give_back_blocks: 16,
            routing_every: 1,
            max_raise_bytes: 0,
            calibration_routing: Vec::new(),
        }
    }
}

impl MemoryOptions {
    /// The lowest bit-width the planner may leave a page at, for capacity planning: the global
    /// floor and, with routing on, the hot experts' floor (any expert may turn hot).
    pub fn floor_bits(&self) -> u8 {
        let mut f = self.planner.floor_bits.max(3);
        if self.planner.use_routing {
            f = f
                .max(self.routing.hot_floor_bits)
                .max(self.routing.warm_floor_bits)
                .max(self.routing.cold_floor_bits);
        }
        f.min(8)
    }
}

/// Counters and the planner.
pub(crate) struct PagedMemory {
    accountant: Accountant,
    kv: Lease,
    block_bytes: u64,
    planner: Option<Planner>,
    options: MemoryOptions,
    boundaries: u64,
    state: MemoryState,
    last_decision: Option<PlannerDecision>,
}

fn page_state(p: &ExpertPage) -> PageState {
    PageState {
        id: PageId { layer: p.layer, expert: p.expert, kind: p.kind },
        desired: p.desired,
        committed: p.committed,
        min_bits: p.min_bits,
        max_bits: p.max_bits,
        bytes: p.bytes.clone(),
        sensitivity: p.sensitivity.clone(),
    }
}

fn err(e: impl std::fmt::Display) -> StepError {
    StepError::failed(e.to_string())
}

impl PagedMemory {
    pub(crate) fn new(
        accountant: Accountant,
        block_bytes: u64,
        layers: usize,
        experts: usize,
        options: MemoryOptions,
    ) -> Result<Self, StepError> {
        let kv = accountant.lease(Use::Kv, 0).map_err(err)?;
        let planner = match options.policy {
            WeightPolicy::Pinned => None,
            WeightPolicy::Planner => {
                let kvc = KvPressureConfig {
                    threshold_blocks: options.threshold_blocks,
                    give_back_margin_blocks: options.give_back_blocks,
                    bytes_per_block: block_bytes,
                    min_give_back_bytes: 0,
                };
                let mut p =
                    Planner::new(layers, experts, options.planner.clone(), kvc, options.routing.clone())
                        .map_err(err)?;
                p.routing.set_calibration_routing(&options.calibration_routing).map_err(err)?;
                Some(p)
            }
        };
        let state =
            MemoryState { budget_bytes: accountant.usage().budget, block_bytes, ..Default::default() };
        Ok(Self { accountant, kv, block_bytes, planner, options, boundaries: 0, state, last_decision: None })
    }

    /// Free KV blocks the budget allows now.
    fn free_blocks(&self) -> u64 {
        self.accountant.free() / self.block_bytes
    }

    /// The prompt-residual factors the planner's damage uses from the next boundary on (`None`:
    /// no correction).
    pub(crate) fn set_residual(&mut self, factors: Option<ResidualFactors>) {
        if let Some(p) = &mut self.planner {
            p.residual = factors;
        }
    }

    /// Makes the KV lease cover `blocks` blocks, running the planner first if the budget has
    /// no room.
    pub(crate) fn reserve<R: Runtime, KV: Float + CubeElement>(
        &mut self,
        dec: &mut Decoder<R, KV>,
        blocks: u64,
    ) -> Result<(), StepError> {
        let want = blocks * self.block_bytes;
        if want <= self.kv.bytes() {
            return Ok(());
        }
        let grow = |acct: &Accountant, kv: &mut Lease| -> bool {
            match acct.lease(Use::Kv, want - kv.bytes()) {
                Ok(l) => {
                    kv.absorb(l);
                    true
                }
                Err(_) => false,
            }
        };
        if grow(&self.accountant, &mut self.kv) {
            return Ok(());
        }
        if self.planner.is_some() {
            // Plan as if the missing blocks were already taken.
            let missing = (want - self.kv.bytes()).div_ceil(self.block_bytes);
            self.boundary(dec, blocks, missing)?;
            if grow(&self.accountant, &mut self.kv) {
                return Ok(());
            }
        }
        Err(StepError::OutOfMemory(format!(
            "the KV cache needs {blocks} blocks of {} bytes but the memory budget has room for {} more \
             ({} bytes of weights, {} of KV, budget {})",
            self.block_bytes,
            self.free_blocks(),
            self.accountant.usage().weights,
            self.kv.bytes(),
            self.accountant.usage().budget
        )))
    }

    /// Gives back KV bytes beyond `blocks` blocks.
    pub(crate) fn shrink_to(&mut self, blocks: u64) {
        let want = blocks * self.block_bytes;
        if self.kv.bytes() > want {
            let extra = self.kv.bytes() - want;
            self.kv.shrink(extra);
        }
    }

    /// The boundary: the planner (if any) and the page table's commit. `used_blocks`: KV
    /// blocks the live sequences hold; `missing`: blocks the next steps will lease (counted as
    /// taken, so the planner makes room for them before they are asked for).
    pub(crate) fn boundary<R: Runtime, KV: Float + CubeElement>(
        &mut self,
        dec: &mut Decoder<R, KV>,
        used_blocks: u64,
        missing: u64,
    ) -> Result<MemoryState, StepError> {
        self.shrink_to(used_blocks);
        self.boundaries += 1;
        let mut changed = 0usize;
        if let Some(p) = self.planner.as_mut() {
            if let Some(rc) = dec.take_route_stats().map_err(err)? {
                p.observe(rc.tokens.min(u32::MAX as u64) as u32, &rc.counts, &rc.mass).map_err(err)?;
            }
            let pages = dec.experts().pages();
            let snapshot = Snapshot { pages: pages.iter().map(page_state).collect() };
            let free = (self.accountant.free() / self.block_bytes).saturating_sub(missing);
            let mut target = p.kv.target(free, snapshot.pending_bytes());
            if let MemoryTarget::Spare(s) = target
                && self.options.max_raise_bytes > 0
            {
                target = MemoryTarget::Spare(s.min(self.options.max_raise_bytes));
            }
            if target != MemoryTarget::Hold {
                let plan =
                    plan(&snapshot, Some(&p.routing), p.residual.as_ref(), target, &p.config).map_err(err)?;
                for (i, (page, &d)) in snapshot.pages.iter().zip(&plan.desired).enumerate() {
                    if page.desired != d {
                        dec.experts_mut().set_desired(i, d).map_err(err)?;
                        changed += 1;
                    }
                }
                if changed > 0 {
                    let (name, bytes) = match target {
                        MemoryTarget::Free(b) => {
                            self.state.planner_lower_total += 1;
                            ("free", b)
                        }
                        MemoryTarget::Spare(b) => {
                            self.state.planner_raise_total += 1;
                            ("spare", b)
                        }
                        MemoryTarget::Hold => ("hold", 0),
                    };
                    self.last_decision = Some(PlannerDecision {
                        boundary: self.boundaries,
                        target: name,
                        target_bytes: bytes,
                        pages_changed: changed,
                        bytes_before: plan.bytes_before,
                        bytes_after: plan.bytes_after,
                        met: plan.met,
                    });
                }
                if !plan.met {
                    self.state.planner_unmet_total += 1;
                }
            }
            // Record the routing of the next step when it is a sampled one.
            dec.route_stats_mut().armed = self.boundaries.is_multiple_of(self.options.routing_every.max(1));
        }
        let commit = dec.experts_mut().boundary().map_err(err)?;
        self.state.page_moves_down_total += commit.lowered as u64;
        self.state.page_moves_up_total += commit.raised as u64;
        self.state.deferred_total += commit.deferred as u64;
        self.state.weight_bytes_by_bits = dec.experts().bytes_by_bits();
        self.state.settled = changed == 0 && commit.lowered + commit.raised + commit.started == 0;
        self.state.kv_blocks_used = used_blocks;
        self.state.kv_blocks_free = self.free_blocks();
        self.state.budget_bytes = self.accountant.usage().budget;
        Ok(self.state.clone())
    }

    /// Every page's state and the memory split as the last boundary left them, with the
    /// planner's routing shares and damage estimates (see [`PageTableView`]).
    pub(crate) fn view<R: Runtime, KV: Float + CubeElement>(
        &self,
        dec: &Decoder<R, KV>,
    ) -> Result<PageTableView, StepError> {
        let pages = dec.experts().pages();
        // Per page, from the planner: routing share, calibration share (when known), damage.
        let planned: Vec<(f64, Option<f64>, f64)> = match &self.planner {
            Some(p) => {
                let snapshot = Snapshot { pages: pages.iter().map(page_state).collect() };
                let desired: Vec<u8> = pages.iter().map(|x| x.desired).collect();
                let d = page_damage(&snapshot, &desired, Some(&p.routing), p.residual.as_ref(), &p.config)
                    .map_err(err)?;
                // Shares are relative to the layer's mean expert; the view gives fractions.
                let (r, n) = (&p.routing, p.routing.experts() as f64);
                pages
                    .iter()
                    .zip(d)
                    .map(|(x, damage)| {
                        let calibration = r.calibration_share(x.layer, x.expert).map(|s| s / n);
                        (r.share(x.layer, x.expert) / n, calibration, damage)
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        let views = pages
            .iter()
            .enumerate()
            .map(|(i, p)| PageView {
                layer: p.layer,
                expert: p.expert,
                kind: p.kind.name(),
                desired_bits: p.desired,
                committed_bits: p.committed,
                location: if p.committed == 0 {
                    PageLocation::Host
                } else if p.raising_to.is_some() {
                    PageLocation::InTransfer
                } else {
                    PageLocation::Gpu
                },
                bytes: p
                    .committed
                    .checked_sub(p.min_bits)
                    .and_then(|i| p.bytes.get(i as usize))
                    .copied()
                    .unwrap_or(0),
                routing_share: planned.get(i).map(|x| x.0),
                calibration_share: planned.get(i).and_then(|x| x.1),
                damage: planned.get(i).map(|x| x.2),
            })
            .collect();
        let cfg = dec.config();
        Ok(PageTableView {
            policy: if self.planner.is_some() { "planner" } else { "pinned" },
            boundary: self.boundaries,
            layers: cfg.layers,
            experts: cfg.experts,
            budget_bytes: self.accountant.usage().budget,
            expert_bytes: self.state.weight_bytes(),
            block_bytes: self.block_bytes,
            kv_blocks_used: self.state.kv_blocks_used,
            kv_blocks_free: self.free_blocks(),
            mean_bits: self.state.mean_bits(),
            last_decision: self.last_decision.clone(),
            pages: views,
        })
    }
}
