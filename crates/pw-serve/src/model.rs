//! The model work of one engine step, behind a trait so a batched fast path can replace the
//! Burn reference path without touching the scheduler.

use std::collections::HashMap;
use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use pw_models::generate::{ids_tensor, last_logits};
use pw_models::{AnyModel, CausalLm, ModelCache, Sampler};

use crate::{KvLayout, ServeError};

/// Identifies one sequence inside a [`StepModel`] (its KV cache / block table).
pub type SeqId = u64;

/// A chunk of a sequence's prompt (or of a resumed sequence's tokens) to prefill.
pub struct PrefillSlot<'a> {
    /// The sequence: new to the model when `start` is 0, else one it holds `start` tokens of.
    pub seq: SeqId,
    /// Tokens already in the sequence's cache.
    pub start: usize,
    /// The chunk, non-empty.
    pub tokens: &'a [u32],
    /// Whether the chunk ends what the sequence has to compute, so a token is sampled after it.
    pub sample: bool,
    /// Picks that token.
    pub sampler: &'a mut Sampler,
}

/// A running sequence to extend by one token.
pub struct DecodeSlot<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// The last token it produced, not yet in its cache.
    pub last: u32,
    /// Picks the next token.
    pub sampler: &'a mut Sampler,
}

/// Why a step, or one sequence of it, did not produce a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// The model failed. Returned for the whole call, it ends every sequence of the call;
    /// returned for one slot, that sequence only.
    #[error("{0}")]
    Failed(String),
    /// The step needs more KV memory than the budget has now. Nothing ran and no state
    /// changed: the engine preempts or requeues sequences and retries after a boundary.
    #[error("{0}")]
    OutOfMemory(String),
}

impl StepError {
    /// A [`StepError::Failed`] with `message`.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::Failed(message.into())
    }
}

/// One sequence's result in a step: its new token, or why it failed (that sequence only).
pub type SeqOutcome = Result<u32, StepError>;

/// One prefill chunk's result: the sampled token when the slot asked for one.
pub type PrefillOutcome = Result<Option<u32>, StepError>;

/// The per-step model work the engine schedules.
///
/// The model owns the KV state of every sequence it has prefilled until [`release`]d; the
/// engine guarantees no call is in flight while its [`crate::BoundaryHook`] runs, so an
/// implementation may commit weight-page moves then.
///
/// [`release`]: StepModel::release
pub trait StepModel: Send {
    /// Vocabulary size (token ids are below it).
    fn vocab_size(&self) -> usize;

    /// KV bytes per token and layer, for admission control.
    fn kv_layout(&self) -> &KvLayout;

    /// Bytes of the model's weights resident on its device.
    fn weight_bytes(&self) -> u64;

    /// Appends each slot's chunk to its sequence (creating the sequence when `start` is 0) and
    /// samples a token where the slot asks, one outcome per slot in order. An `Err` of the
    /// whole call is about every slot; a sequence that failed alone is an `Err` in its slot and
    /// the others go on.
    fn prefill(&mut self, batch: &mut [PrefillSlot<'_>]) -> Result<Vec<PrefillOutcome>, StepError>;

    /// Extends every sequence of `batch` by its `last` token and samples the next one (outcomes
    /// as in [`StepModel::prefill`]).
    fn decode(&mut self, batch: &mut [DecodeSlot<'_>]) -> Result<Vec<SeqOutcome>, StepError>;

    /// Frees a sequence's KV state (unknown ids are ignored).
    fn release(&mut self, seq: SeqId);

    /// KV bytes all live sequences hold now.
    fn kv_bytes_held(&self) -> u64;

    /// Called between steps (no model call in flight): a model with paged weights runs its
    /// planner and commits finished page moves here, making room for `demand_kv_bytes` more
    /// KV bytes that the next steps will take (queued prompts and decode growth). The default
    /// has nothing to do.
    fn boundary(&mut self, demand_kv_bytes: u64) -> Result<Option<crate::MemoryState>, StepError> {
        let _ = demand_kv_bytes;
        Ok(None)
    }

    /// The expert pages and the memory split as the last boundary left them (called between
    /// steps). `None` for a model without paged experts (the default).
    fn page_table(&self) -> Result<Option<crate::PageTableView>, StepError> {
        Ok(None)
    }
}

/// [`StepModel`] over a Burn [`CausalLm`]: every sequence runs its own forward with its own
/// [`ModelCache`] (the reference path; numerically identical to [`pw_models::generate`]).
pub struct BurnStepModel<B: Backend, M> {
    model: M,
    device: B::Device,
    caches: HashMap<SeqId, ModelCache<B>>,
    kv: KvLayout,
    weight_bytes: u64,
}

impl<B: Backend, M: CausalLm<B>> BurnStepModel<B, M> {
    /// Wraps `model` on `device`; `kv` must describe its caches.
    pub fn new(model: M, device: B::Device, kv: KvLayout, weight_bytes: u64) -> Self {
        Self { model, device, caches: HashMap::new(), kv, weight_bytes }
    }

    /// Appends `ids` to `seq`'s cache (a new cache when `fresh`) and, if `sampler` is given,
    /// samples the token after them.
    fn run(
        &mut self,
        seq: SeqId,
        fresh: bool,
        ids: &[u32],
        sampler: Option<&mut Sampler>,
    ) -> Result<Option<u32>, StepError> {
        if fresh {
            self.caches.insert(seq, self.model.new_cache());
        }
        let Some(cache) = self.caches.get_mut(&seq) else {
            return Err(StepError::failed(format!("sequence {seq} continued before its first chunk")));
        };
        let logits = self.model.forward(ids_tensor::<B>(ids, &self.device), cache, None);
        let Some(sampler) = sampler else { return Ok(None) };
        let row = last_logits(logits);
        if row.iter().any(|x| x.is_nan()) {
            return Err(StepError::failed(format!("sequence {seq}: the model produced NaN logits")));
        }
        Ok(Some(sampler.sample(&row)))
    }
}

impl<B: Backend> BurnStepModel<B, AnyModel<B>> {
    /// Loads the Hugging Face model in `dir` onto `device`.
    pub fn load(dir: &Path, device: &B::Device) -> Result<Self, ServeError> {
        let config = pw_hf::ModelConfig::from_dir(dir).map_err(|e| ServeError::Model(e.to_string()))?;
        let model = AnyModel::<B>::load(dir, device).map_err(|e| ServeError::Model(e.to_string()))?;
        let params = match &model {
            AnyModel::Mixtral(m) => m.num_params(),
            AnyModel::Qwen2Moe(m) => m.num_params(),
            AnyModel::Gemma4(m) => m.num_params(),
        };
        let elem = size_of::<B::FloatElem>() as u64;
        Ok(Self::new(model, device.clone(), KvLayout::from_config(&config, elem), params as u64 * elem))
    }
}

impl<B: Backend, M: CausalLm<B> + Send> StepModel for BurnStepModel<B, M>
where
    B::Device: Send,
{
    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn kv_layout(&self) -> &KvLayout {
        &self.kv
    }

    fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    fn prefill(&mut self, batch: &mut [PrefillSlot<'_>]) -> Result<Vec<PrefillOutcome>, StepError> {
        Ok(batch
            .iter_mut()
            .map(|s| {
                let sampler = if s.sample { Some(&mut *s.sampler) } else { None };
                self.run(s.seq, s.start == 0, s.tokens, sampler)
            })
            .collect())
    }

    fn decode(&mut self, batch: &mut [DecodeSlot<'_>]) -> Result<Vec<SeqOutcome>, StepError> {
        Ok(batch
            .iter_mut()
            .map(|s| {
                if !self.caches.contains_key(&s.seq) {
                    return Err(StepError::failed(format!(
                        "decode of sequence {} before its prefill",
                        s.seq
                    )));
                }
                self.run(s.seq, false, &[s.last], Some(&mut *s.sampler))?
                    .ok_or_else(|| StepError::failed("no token sampled"))
            })
            .collect())
    }

    fn release(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }

    fn kv_bytes_held(&self) -> u64 {
        self.caches
            .values()
            .map(|c| {
                c.layers
                    .iter()
                    .zip(&self.kv.layers)
                    .map(|(l, k)| l.held() as u64 * k.bytes_per_token)
                    .sum::<u64>()
            })
            .sum()
    }
}
