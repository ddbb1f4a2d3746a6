//! Serving for PagedWeight models: a continuous-batching engine on its own thread and an
//! OpenAI-compatible HTTP server (axum) in front of it.
//!
//! - [`Engine`] owns a [`StepModel`] and runs the step loop: it admits queued requests while
//!   their projected KV bytes fit the budget, runs prefills and decodes in the same step,
//!   streams text per request ([`Event`]), frees cancelled sequences, and calls a
//!   [`BoundaryHook`] between steps (where the planner will commit page moves).
//! - [`StepModel`] is the per-step model work. [`BurnStepModel`] runs the Burn reference path
//!   (one forward per sequence with its own `ModelCache`); a batched fast path implements the
//!   same trait.
//! - [`server`] maps `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health` and
//!   `/metrics` onto an [`EngineHandle`].

mod chat;
mod engine;
mod error;
mod fast;
mod hook;
mod kv;
mod metrics;
mod model;
mod page_table;
mod paged;
mod schedule;
pub mod server;
mod text;

pub use chat::{ChatMessage, ChatTemplate};
pub use engine::{
    Admission, Completion, Engine, EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest,
    RequestStream, SamplingParams, Usage,
};
pub use error::ServeError;
pub use fast::{FastOptions, FastStepModel, load_fast};
pub use hook::{BoundaryHook, BoundaryState, MemoryState, StepTiming, UsageRecord, UsageRecorder};
pub use kv::{KvLayout, LayerKv, max_context};
pub use metrics::{Metrics, MetricsSnapshot};
pub use model::{
    BurnStepModel, DecodeSlot, KvDemand, PrefillOutcome, PrefillSlot, SeqId, SeqOutcome, StepError, StepModel,
};
pub use page_table::{HistorySample, PageLocation, PageTableView, PageView, PlannerDecision};
pub use paged::{MemoryOptions, WeightPolicy};
/// The planner options [`MemoryOptions`] carries.
pub use pw_planner::{PlannerConfig, RoutingConfig};
pub use text::{IncrementalDetokenizer, StopOutcome, StopText};

use std::path::Path;

/// Loads `dir/tokenizer.json`.
pub fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer, ServeError> {
    let path = dir.join("tokenizer.json");
    tokenizers::Tokenizer::from_file(&path).map_err(|e| ServeError::Config {
        path: path.clone(),
        message: format!("cannot load the tokenizer: {e}"),
    })
}

/// End-of-sequence ids of a model directory: those of config.json and of
/// generation_config.json (if present), without duplicates.
pub fn eos_token_ids(dir: &Path) -> Result<Vec<u32>, ServeError> {
    let config = pw_hf::ModelConfig::from_dir(dir).map_err(|e| ServeError::Model(e.to_string()))?;
    let mut ids = config.eos_token_ids().to_vec();
    let path = dir.join("generation_config.json");
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ServeError::Config { path: path.clone(), message: e.to_string() })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ServeError::Config {
            path: path.clone(),
            message: format!("not valid JSON: {e}"),
        })?;
        let extra: Vec<u32> = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => {
                a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect()
            }
            _ => Vec::new(),
        };
        for id in extra {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}
