//! Online routing statistics: decayed per-(layer, expert) selection frequency and routing-weight
//! mass, and the hot/warm/cold buckets the planner derives from them.
//!
//! The decode loop counts, per step and on the device, how many tokens chose each expert and
//! the sum of their routing weights, for all layers at once; [`RoutingStats::update`] takes
//! those two flat `[layers · experts]` arrays after a single download per step, so nothing here
//! implies a host round trip per layer.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// How hot an expert is, by its share of its layer's routing-weight mass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bucket {
    /// Share `>= hot_share`.
    Hot,
    /// In between (and every expert before any observation).
    Warm,
    /// Share `< cold_share`.
    Cold,
}

/// Options of [`RoutingStats`].
///
/// Defaults and why:
/// - `half_life_steps = 64`: a decode step of one sequence is one token, so the statistics
///   follow the topic of the last few hundred tokens, slower than the planner's cadence (one
///   call per step) yet fast enough to follow a new prompt within one reply.
/// - Buckets by *mass share* `s = mass_e / mean_e(mass)` (1 = an average expert): to first order
///   the damage of quantizing an expert's block is the error of its output times the routing
///   weight it is mixed in with, summed over the tokens routed to it, i.e. proportional to `s`.
///   `hot_share = 2`, `cold_share = 0.5`, multipliers hot 2 / warm 1 / cold 0.5 are that
///   proportionality evaluated at the bucket edges (coarse on purpose: a bucket changes rarely,
///   so pages do not flap with noise in `s`). Hot experts get a 5-bit floor: they carry at least
///   twice the average mass, and below 5 bits the nested k-means error of a typical block grows
///   about 4x per bit.
/// - The measurement that should confirm or replace these: on calibration text, the KL between
///   output distributions when one expert's block is lowered, regressed on its mass share
///   (`examples/train_residual_head.rs` measures per-block KL; run it per expert) — the slope
///   gives the multipliers, the knee of KL vs bits under high share gives the hot floor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingConfig {
    /// Steps after which an observation's weight has halved.
    pub half_life_steps: f64,
    /// Mass share at or above which an expert is hot.
    pub hot_share: f64,
    /// Mass share below which an expert is cold.
    pub cold_share: f64,
    /// Bit floor of hot experts' pages.
    pub hot_floor_bits: u8,
    /// Bit floor of warm experts' pages.
    pub warm_floor_bits: u8,
    /// Bit floor of cold experts' pages.
    pub cold_floor_bits: u8,
    /// Damage multiplier of hot experts.
    pub hot_multiplier: f64,
    /// Damage multiplier of warm experts.
    pub warm_multiplier: f64,
    /// Damage multiplier of cold experts.
    pub cold_multiplier: f64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            half_life_steps: 64.0,
            hot_share: 2.0,
            cold_share: 0.5,
            hot_floor_bits: 5,
            warm_floor_bits: 3,
            cold_floor_bits: 3,
            hot_multiplier: 2.0,
            warm_multiplier: 1.0,
            cold_multiplier: 0.5,
        }
    }
}

impl RoutingConfig {
    /// Checks the values' domains.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |field, reason: String| Err(PlanError::Config { field, reason });
        if !(self.half_life_steps.is_finite() && self.half_life_steps > 0.0) {
            return bad("half_life_steps", format!("{} must be finite and > 0", self.half_life_steps));
        }
        if !(self.cold_share >= 0.0 && self.cold_share <= self.hot_share && self.hot_share.is_finite()) {
            return bad(
                "hot_share",
                format!("need 0 <= cold_share ({}) <= hot_share ({})", self.cold_share, self.hot_share),
            );
        }
        for (field, m) in [
            ("hot_multiplier", self.hot_multiplier),
            ("warm_multiplier", self.warm_multiplier),
            ("cold_multiplier", self.cold_multiplier),
        ] {
            if !(m.is_finite() && m > 0.0) {
                return bad(field, format!("{m} must be finite and > 0"));
            }
        }
        Ok(())
    }

    /// Per-step decay factor `λ = 0.5^(1 / half_life_steps)`.
    pub fn decay(&self) -> f64 {
        0.5f64.powf(1.0 / self.half_life_steps)
    }
}

/// Decayed routing statistics of every (layer, expert).
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingStats {
    layers: usize,
    experts: usize,
    config: RoutingConfig,
    decay: f64,
    /// Decayed sum of per-step selection fractions (tokens choosing e / tokens).
    freq: Vec<f64>,
    /// Decayed sum of per-step mean routing weight given to e.
    mass: Vec<f64>,
    /// Per layer, the sum of `mass` over its experts (kept with `mass`, so a share is O(1):
    /// the planner asks for one per page).
    layer_mass: Vec<f64>,
    /// Decayed sum of the observation weights: dividing by it removes the start-up bias, so a
    /// constant input reads back exactly after one step.
    norm: f64,
    steps: u64,
    /// Each expert's share on the calibration text, `[layers · experts]` (empty: not known).
    calibration: Vec<f64>,
}

impl RoutingStats {
    /// Empty statistics for `layers × experts`.
    pub fn new(layers: usize, experts: usize, config: RoutingConfig) -> Result<Self, PlanError> {
        config.validate()?;
        Ok(Self {
            layers,
            experts,
            decay: config.decay(),
            config,
            freq: vec![0.0; layers * experts],
            mass: vec![0.0; layers * experts],
            layer_mass: vec![0.0; layers],
            norm: 0.0,
            steps: 0,
            calibration: Vec::new(),
        })
    }

    /// Sets each expert's mass share on the calibration text its pages' sensitivities were
    /// measured on (Fisher importance already weighs an expert by that use), `[layers ·
    /// experts]` layer-major: the damage multiplier then follows the share *relative* to it, so
    /// an expert used as in calibration gets 1 instead of being counted twice.
    pub fn set_calibration_shares(&mut self, shares: Vec<f64>) -> Result<(), PlanError> {
        let n = self.layers * self.experts;
        if shares.len() != n {
            return Err(PlanError::Shape {
                what: "calibration routing shares".into(),
                reason: format!("{} entries, expected layers·experts = {n}", shares.len()),
            });
        }
        if let Some(i) = shares.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
            return Err(PlanError::Shape {
                what: "calibration routing shares".into(),
                reason: format!(
                    "layer {} expert {} has {}, expected finite and >= 0",
                    i / self.experts,
                    i % self.experts,
                    shares[i]
                ),
            });
        }
        self.calibration = shares;
        Ok(())
    }

    /// [`Self::set_calibration_shares`] from the calibration routing `quantize` recorded in a
    /// checkpoint's manifest (layers it does not list get 1); false, and nothing set, when it
    /// recorded none.
    pub fn set_calibration_routing(
        &mut self,
        routing: &[pw_format::LayerRouting],
    ) -> Result<bool, PlanError> {
        if routing.is_empty() {
            return Ok(false);
        }
        let mut shares = vec![1.0; self.layers * self.experts];
        for r in routing {
            if r.layer >= self.layers || r.mass_share.len() != self.experts {
                return Err(PlanError::Shape {
                    what: format!("calibration routing of layer {}", r.layer),
                    reason: format!(
                        "{} experts; the planner covers {} layers of {} experts",
                        r.mass_share.len(),
                        self.layers,
                        self.experts
                    ),
                });
            }
            shares[r.layer * self.experts..][..self.experts].copy_from_slice(&r.mass_share);
        }
        self.set_calibration_shares(shares)?;
        Ok(true)
    }

    /// The expert's calibration share, when set.
    pub fn calibration_share(&self, layer: usize, expert: usize) -> Option<f64> {
        self.calibration.get(self.idx(layer, expert)).copied()
    }

    /// Whether calibration shares are set.
    pub fn has_calibration(&self) -> bool {
        !self.calibration.is_empty()
    }

    /// Layers covered.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Experts per layer covered.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// The options.
    pub fn config(&self) -> &RoutingConfig {
        &self.config
    }

    /// Steps observed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Folds in one step: `tokens` tokens went through every layer; `counts[l · E + e]` of them
    /// chose expert `e` in layer `l`, with routing weights summing to `mass[l · E + e]`.
    /// A step without tokens changes nothing.
    ///
    /// # Shapes
    /// - `counts`, `mass`: `[layers · experts]`, layer-major
    pub fn update(&mut self, tokens: u32, counts: &[u32], mass: &[f32]) -> Result<(), PlanError> {
        let n = self.layers * self.experts;
        for (what, len) in [("routing counts", counts.len()), ("routing mass", mass.len())] {
            if len != n {
                return Err(PlanError::Shape {
                    what: what.into(),
                    reason: format!(
                        "{len} entries, expected layers·experts = {}·{} = {n}",
                        self.layers, self.experts
                    ),
                });
            }
        }
        if let Some(i) = mass.iter().position(|m| !m.is_finite() || *m < 0.0) {
            return Err(PlanError::Shape {
                what: "routing mass".into(),
                reason: format!(
                    "layer {} expert {} has {}, expected finite and >= 0",
                    i / self.experts,
                    i % self.experts,
                    mass[i]
                ),
            });
        }
        if tokens == 0 {
            return Ok(());
        }
        let (lambda, t) = (self.decay, tokens as f64);
        for i in 0..n {
            self.freq[i] = lambda * self.freq[i] + (1.0 - lambda) * counts[i] as f64 / t;
            self.mass[i] = lambda * self.mass[i] + (1.0 - lambda) * mass[i] as f64 / t;
        }
        for (l, total) in self.layer_mass.iter_mut().enumerate() {
            *total = self.mass[l * self.experts..(l + 1) * self.experts].iter().sum();
        }
        self.norm = lambda * self.norm + (1.0 - lambda);
        self.steps += 1;
        Ok(())
    }

    fn idx(&self, layer: usize, expert: usize) -> usize {
        debug_assert!(layer < self.layers && expert < self.experts);
        layer * self.experts + expert
    }

    /// Decayed fraction of tokens that chose the expert (0 before any step).
    pub fn frequency(&self, layer: usize, expert: usize) -> f64 {
        if self.norm == 0.0 { 0.0 } else { self.freq[self.idx(layer, expert)] / self.norm }
    }

    /// Decayed mean routing weight per token given to the expert (0 before any step).
    pub fn mass(&self, layer: usize, expert: usize) -> f64 {
        if self.norm == 0.0 { 0.0 } else { self.mass[self.idx(layer, expert)] / self.norm }
    }

    /// The expert's mass relative to its layer's mean (1 = average; 1 before any step or when
    /// the layer saw no mass).
    pub fn share(&self, layer: usize, expert: usize) -> f64 {
        let total = self.layer_mass[layer];
        if total <= 0.0 { 1.0 } else { self.mass[self.idx(layer, expert)] * self.experts as f64 / total }
    }

    /// The expert's share over its calibration share (1 = used as on the calibration text, and
    /// before any step); the plain [`Self::share`] without calibration shares. A calibration
    /// share is read as at least [`MIN_CALIBRATION_SHARE`], so an expert the calibration text
    /// never reached counts as hot as soon as it carries mass.
    pub fn relative_share(&self, layer: usize, expert: usize) -> f64 {
        if self.calibration.is_empty() {
            return self.share(layer, expert);
        }
        if self.layer_mass[layer] <= 0.0 {
            return 1.0;
        }
        self.share(layer, expert) / self.calibration[self.idx(layer, expert)].max(MIN_CALIBRATION_SHARE)
    }

    /// The expert's bucket by its share (what its bit floor follows: a heavily used expert
    /// keeps its floor whatever calibration saw).
    pub fn bucket(&self, layer: usize, expert: usize) -> Bucket {
        self.bucket_of(self.share(layer, expert))
    }

    fn bucket_of(&self, s: f64) -> Bucket {
        if s >= self.config.hot_share {
            Bucket::Hot
        } else if s < self.config.cold_share {
            Bucket::Cold
        } else {
            Bucket::Warm
        }
    }

    /// Bit floor of the expert's pages.
    pub fn floor_bits(&self, layer: usize, expert: usize) -> u8 {
        match self.bucket(layer, expert) {
            Bucket::Hot => self.config.hot_floor_bits,
            Bucket::Warm => self.config.warm_floor_bits,
            Bucket::Cold => self.config.cold_floor_bits,
        }
    }

    /// Damage multiplier of the expert's pages, by the bucket of its [relative
    /// share](Self::relative_share).
    pub fn multiplier(&self, layer: usize, expert: usize) -> f64 {
        match self.bucket_of(self.relative_share(layer, expert)) {
            Bucket::Hot => self.config.hot_multiplier,
            Bucket::Warm => self.config.warm_multiplier,
            Bucket::Cold => self.config.cold_multiplier,
        }
    }
}

/// Smallest calibration share [`RoutingStats::relative_share`] divides by.
pub const MIN_CALIBRATION_SHARE: f64 = 1e-3;

/// Host-side accumulation of one layer's router output into the flat per-step arrays that
/// [`RoutingStats::update`] takes (the CPU path; the GPU decode path fills the same arrays with
/// a scatter-add on the device).
///
/// # Shapes
/// - `counts`, `mass`: `[layers · experts]`, layer-major
/// - `indices`, `weights`: `[tokens, k]` row-major, the router's choices and their weights
pub fn accumulate_choices(
    counts: &mut [u32],
    mass: &mut [f32],
    experts: usize,
    layer: usize,
    indices: &[usize],
    weights: &[f32],
) -> Result<(), PlanError> {
    if indices.len() != weights.len() {
        return Err(PlanError::Shape {
            what: format!("layer {layer} router output"),
            reason: format!("{} indices but {} weights", indices.len(), weights.len()),
        });
    }
    let base = layer * experts;
    if base + experts > counts.len() || counts.len() != mass.len() {
        return Err(PlanError::Shape {
            what: format!("layer {layer} router output"),
            reason: format!(
                "counts/mass hold {}/{} entries, too few for layer {layer} of {experts} experts",
                counts.len(),
                mass.len()
            ),
        });
    }
    for (&e, &w) in indices.iter().zip(weights) {
        if e >= experts {
            return Err(PlanError::Shape {
                what: format!("layer {layer} router output"),
                reason: format!("expert index {e} >= {experts} experts"),
            });
        }
        counts[base + e] += 1;
        mass[base + e] += w;
    }
    Ok(())
}
