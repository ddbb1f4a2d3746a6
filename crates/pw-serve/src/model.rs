//! The model work of one engine step, behind a trait so a batched fast path can replace the
//! Burn reference path without touching the scheduler.

use std::collections::HashMap;
use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use pw_models::generate::{ids_tensor, last_logits};
use pw_models::{AnyModel, CausalLm, LoadedModel, ModelCache, PagedOptions, Sampler};

use crate::paged::{MemoryPlan, PagedMemory, TablePages};
use crate::{KvLayout, MemoryOptions, MemoryState, PageTableView, ServeError};

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

/// KV bytes the engine expects its sequences to add, for a model's [`StepModel::boundary`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvDemand {
    /// Bytes the next steps take (queued prompts, decode growth a few steps ahead): a planner
    /// lowers pages until they are free.
    pub next: u64,
    /// Bytes the running and queued sequences may still take before they finish (at least
    /// `next`): a planner raises pages only into memory beyond them, so that it does not give
    /// the weights what the cache takes back a few steps later.
    pub until_done: u64,
}

impl KvDemand {
    /// In blocks of `block_bytes`, rounded up.
    pub(crate) fn blocks(self, block_bytes: u64) -> crate::paged::DemandBlocks {
        crate::paged::DemandBlocks {
            next: self.next.div_ceil(block_bytes),
            until_done: self.until_done.max(self.next).div_ceil(block_bytes),
        }
    }
}

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
    /// planner and commits finished page moves here, making room for the KV bytes the next
    /// steps will take and raising pages only into memory the sequences will not take before
    /// they finish (see [`KvDemand`]). The default has nothing to do.
    fn boundary(&mut self, demand: KvDemand) -> Result<Option<crate::MemoryState>, StepError> {
        let _ = demand;
        Ok(None)
    }

    /// The expert pages and the memory split as the last boundary left them (called between
    /// steps). `None` for a model without paged experts (the default).
    fn page_table(&self) -> Result<Option<crate::PageTableView>, StepError> {
        Ok(None)
    }
}

/// Tokens per KV block in the reference path's accounting: its caches grow by the token, the
/// budget counts them in blocks as the fast path's paged cache does.
const BLOCK_TOKENS: u64 = 16;

/// The memory side of a Burn model whose experts are pages: the pages and the KV caches lease
/// from one budget, and the planner lowers and raises pages between steps as on the fast path.
struct BurnPaged {
    pages: TablePages,
    mem: PagedMemory,
    block_bytes: u64,
}

/// [`StepModel`] over a Burn [`CausalLm`]: every sequence runs its own forward with its own
/// [`ModelCache`] (the reference path; numerically identical to [`pw_models::generate`]).
pub struct BurnStepModel<B: Backend, M> {
    model: M,
    device: B::Device,
    caches: HashMap<SeqId, ModelCache<B>>,
    kv: KvLayout,
    weight_bytes: u64,
    paged: Option<BurnPaged>,
}

impl<B: Backend, M: CausalLm<B>> BurnStepModel<B, M> {
    /// Wraps `model` on `device`; `kv` must describe its caches.
    pub fn new(model: M, device: B::Device, kv: KvLayout, weight_bytes: u64) -> Self {
        Self { model, device, caches: HashMap::new(), kv, weight_bytes, paged: None }
    }

    /// KV blocks a sequence of `tokens` tokens holds (paged experts only).
    fn blocks_for(kv: &KvLayout, block_bytes: u64, tokens: usize) -> u64 {
        kv.bytes_for(tokens).div_ceil(block_bytes)
    }

    /// KV blocks the live sequences hold (0 without paged experts).
    fn used_blocks(&self) -> u64 {
        let Some(p) = &self.paged else { return 0 };
        self.caches.values().map(|c| Self::blocks_for(&self.kv, p.block_bytes, c.seen())).sum()
    }

    /// With paged experts: leases, under the budget, the blocks in use plus those that
    /// appending `(held, extra)` tokens to each listed sequence takes, the planner making room
    /// first when there is none. A shortage is [`StepError::OutOfMemory`] with nothing run.
    fn reserve(&mut self, appends: &[(usize, usize)]) -> Result<(), StepError> {
        let used = self.used_blocks();
        let Some(p) = &mut self.paged else { return Ok(()) };
        let blocks = |t: usize| Self::blocks_for(&self.kv, p.block_bytes, t);
        let extra: u64 = appends.iter().map(|&(held, n)| blocks(held + n) - blocks(held)).sum();
        p.mem.reserve(&mut p.pages, used + extra)
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

    /// Loads the PagedWeight checkpoint in `dir` (what `pagedweight quantize` writes) with its
    /// experts as pages on `device` (host arenas on ndarray), committed at `bits` or the highest
    /// width that fits. The pages and the KV caches share `memory`'s budget (none: the experts
    /// plus `kv_budget_bytes` of cache), and under the planner policy the planner lowers and
    /// raises pages between steps with the checkpoint's sensitivities and calibration routing,
    /// as on the fast path. Returns the model and the KV bytes the engine may reserve.
    pub fn load_paged(
        dir: &Path,
        device: &B::Device,
        bits: u8,
        memory: &MemoryOptions,
        max_batch: usize,
        kv_budget_bytes: u64,
    ) -> Result<(Self, u64), ServeError> {
        let model_err = |e: String| ServeError::Model(format!("{}: {e}", dir.display()));
        let config = pw_hf::ModelConfig::from_dir(dir).map_err(|e| model_err(e.to_string()))?;
        let ckpt = pw_format::Checkpoint::open(dir).map_err(|e| model_err(e.to_string()))?;
        let blocks = &ckpt.manifest().blocks;
        let layers = blocks.iter().map(|b| b.layer + 1).max().unwrap_or(0);
        let experts = blocks.iter().map(|b| b.expert + 1).max().unwrap_or(0);
        let expert_bytes = |bits: u8| -> u64 {
            blocks
                .iter()
                .map(|b| {
                    let (p, l) = b.bytes_at(bits.clamp(b.min_bits, b.max_bits));
                    (p + l) as u64
                })
                .sum()
        };
        let elem = size_of::<B::FloatElem>() as u64;
        let kv = KvLayout::from_config(&config, elem);
        let block_bytes = kv.bytes_per_token() * BLOCK_TOKENS;
        let memory = MemoryOptions { calibration_routing: ckpt.manifest().routing.clone(), ..memory.clone() };
        let plan =
            MemoryPlan::new(&memory, experts, block_bytes, max_batch, kv_budget_bytes, expert_bytes, bits)
                .map_err(model_err)?;
        let opts = PagedOptions { bits: Some(plan.initial_bits), weight_budget: Some(plan.budget) };
        let loaded = LoadedModel::<B>::load_paged(dir, opts, device).map_err(|e| model_err(e.to_string()))?;
        let table = loaded.pages.ok_or_else(|| model_err("the checkpoint has no expert pages".into()))?;
        let step_err = |e: StepError| model_err(e.to_string());
        let pages = TablePages::new(table.clone(), layers, experts).map_err(step_err)?;
        let mem =
            PagedMemory::new(table.accountant(), block_bytes, layers, experts, memory).map_err(step_err)?;
        let dense = match &loaded.model {
            AnyModel::Mixtral(m) => m.num_params(),
            AnyModel::Qwen2Moe(m) => m.num_params(),
            AnyModel::Gemma4(m) => m.num_params(),
        } as u64
            * elem;
        let mut me = Self::new(loaded.model, device.clone(), kv, dense);
        me.paged = Some(BurnPaged { pages, mem, block_bytes });
        me.boundary(KvDemand::default()).map_err(step_err)?;
        Ok((me, plan.kv_capacity))
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
        self.weight_bytes + self.paged.as_ref().map_or(0, |p| p.pages.committed_bytes())
    }

    fn prefill(&mut self, batch: &mut [PrefillSlot<'_>]) -> Result<Vec<PrefillOutcome>, StepError> {
        let appends: Vec<(usize, usize)> = batch.iter().map(|s| (s.start, s.tokens.len())).collect();
        self.reserve(&appends)?;
        Ok(batch
            .iter_mut()
            .map(|s| {
                let sampler = if s.sample { Some(&mut *s.sampler) } else { None };
                self.run(s.seq, s.start == 0, s.tokens, sampler)
            })
            .collect())
    }

    fn decode(&mut self, batch: &mut [DecodeSlot<'_>]) -> Result<Vec<SeqOutcome>, StepError> {
        let appends: Vec<(usize, usize)> =
            batch.iter().filter_map(|s| self.caches.get(&s.seq).map(|c| (c.seen(), 1))).collect();
        self.reserve(&appends)?;
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
        if let Some(p) = &self.paged {
            return self.used_blocks() * p.block_bytes;
        }
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

    fn boundary(&mut self, demand: KvDemand) -> Result<Option<MemoryState>, StepError> {
        let used = self.used_blocks();
        let Some(p) = &mut self.paged else { return Ok(None) };
        let blocks = demand.blocks(p.block_bytes);
        p.mem.boundary(&mut p.pages, used, blocks).map(Some)
    }

    fn page_table(&self) -> Result<Option<PageTableView>, StepError> {
        self.paged.as_ref().map(|p| p.mem.view(&p.pages)).transpose()
    }
}
