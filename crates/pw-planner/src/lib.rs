//! The quality-aware planner of PagedWeight (DESIGN.md §2, Memory target and Quality-aware
//! planner).
//!
//! - [`plan`]: the pure core. From a [`Snapshot`] of the page table (per page: desired and
//!   committed bits, stored range, bytes and offline sensitivity per bit-width), optional
//!   [`RoutingStats`] and [`ResidualFactors`], and a [`MemoryTarget`], it returns new desired
//!   bit-widths: greedy lowering by smallest damage per byte freed (lower convex hull per page,
//!   bit floors, legal moves only) or greedy raising by largest damage saved per byte.
//! - [`KvPressureConfig`]: the target from KV pressure, `D = max(0, T + 1 − F) · B_KV`, and the
//!   give-back rule with its hysteresis band.
//! - [`RoutingStats`]: decayed per-(layer, expert) selection frequency and routing mass,
//!   updated once per step from flat device-side counts; hot/warm/cold buckets with floors and
//!   damage multipliers.
//! - [`Placement`]: which GPU of a host holds each expert (balanced by routing share per layer
//!   and committed bytes), [`plan_per_gpu`] with a target per GPU, and [`Placement::relieve`]
//!   to hand an expert from a GPU short of memory to one with room.
//! - [`ResidualHead`]: a Burn module mapping [`residual_features`] of the prompt to
//!   per-(layer, kind) sensitivity multipliers, trained with [`train_residual_head`].
//!
//! # Calling it from the decode loop
//! [`Planner`] bundles the state. Between decode steps (a safe boundary) the engine folds the
//! step's routing counts in with [`Planner::observe`] (one download of two flat arrays for all
//! layers), then calls [`Planner::at_boundary`] with the page table's [`Snapshot`] and the free
//! KV blocks: it asks [`KvPressureConfig::target`] (accounting [`Snapshot::pending_bytes`]) and,
//! unless that is [`MemoryTarget::Hold`], runs [`plan`]; the engine hands [`Plan::changes`] to
//! the page table as new desired bit-widths. The residual factors are computed once per prompt
//! (after prefill) with [`ResidualHead::factors`] and stored in [`Planner::residual`].
//!
//! # Training the residual head
//! `cargo run --release --example train_residual_head -- --model HF_DIR --out PW_DIR` (root
//! package) extracts the features through pw-models' `Trace`, measures per-(layer, kind) KL
//! damage of lowering each layer's blocks, fits the head and saves it with
//! [`ResidualHead::save`]; the target is defined in [`ResidualHead`]'s docs.
//!
//! # Defaults
//! [`RoutingConfig`], [`KvPressureConfig`] and [`PlannerConfig`] document each default and the
//! measurement that should confirm it.

mod error;
mod head;
mod hook;
mod memory;
mod placement;
mod plan;
mod routing;
mod snapshot;

pub use error::PlanError;
pub use head::{
    CHANNEL_STATS, FEATURES_PER_LAYER, HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, HeadTrainingConfig, ResidualHead,
    ResidualHeadConfig, TrainReport, inference_head, residual_features, residual_features_from_stats,
    train_residual_head,
};
pub use hook::Planner;
pub use memory::{KvPressureConfig, MemoryTarget, kv_block_bytes};
pub use placement::{ExpertMove, Placement, plan_per_gpu};
pub use plan::{Plan, PlannerConfig, ResidualFactors, estimated_damage, floors, page_damage, plan};
pub use pw_format::BlockKind;
pub use routing::{Bucket, MIN_CALIBRATION_SHARE, RoutingConfig, RoutingStats, accumulate_choices};
pub use snapshot::{PageId, PageState, Snapshot};
