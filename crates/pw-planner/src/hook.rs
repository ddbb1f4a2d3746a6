//! The planner hook the decode loop calls between steps.

use crate::{
    KvPressureConfig, MemoryTarget, Plan, PlanError, PlannerConfig, ResidualFactors, RoutingConfig,
    RoutingStats, Snapshot, plan,
};

/// Everything the planner keeps across decode steps: options, routing statistics and the
/// current prompt's residual factors. The page table owns the [`Snapshot`]; the engine owns
/// the KV block count.
#[derive(Debug, Clone)]
pub struct Planner {
    /// Damage model and ablation switches.
    pub config: PlannerConfig,
    /// Memory target and give-back rule.
    pub kv: KvPressureConfig,
    /// Decayed routing statistics.
    pub routing: RoutingStats,
    /// The current prompt's multipliers (`None` = no correction).
    pub residual: Option<ResidualFactors>,
}

impl Planner {
    /// A planner for `layers × experts` with empty routing statistics.
    pub fn new(
        layers: usize,
        experts: usize,
        config: PlannerConfig,
        kv: KvPressureConfig,
        routing: RoutingConfig,
    ) -> Result<Self, PlanError> {
        kv.validate()?;
        Ok(Self { config, kv, routing: RoutingStats::new(layers, experts, routing)?, residual: None })
    }

    /// Folds one step's router counts in (see [`RoutingStats::update`]).
    ///
    /// # Shapes
    /// - `counts`, `mass`: `[layers · experts]`, layer-major
    pub fn observe(&mut self, tokens: u32, counts: &[u32], mass: &[f32]) -> Result<(), PlanError> {
        self.routing.update(tokens, counts, mass)
    }

    /// At a safe boundary: the target from `free_blocks` (negative: blocks short, see
    /// [`KvPressureConfig::target`]) and what is in flight in `snapshot`, and the new desired
    /// bit-widths when there is something to do (`None` on hold).
    pub fn at_boundary(&self, snapshot: &Snapshot, free_blocks: i64) -> Result<Option<Plan>, PlanError> {
        match self.kv.target(free_blocks, snapshot.pending_bytes()) {
            MemoryTarget::Hold => Ok(None),
            t => plan(snapshot, Some(&self.routing), self.residual.as_ref(), t, &self.config).map(Some),
        }
    }
}
