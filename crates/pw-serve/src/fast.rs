//! [`StepModel`] over the fast decode path (`pw-decode`): each engine step is one batched
//! decode step of fused CubeCL launches over the paged KV cache; prompt chunks go through the same
//! kernels, all of a step's chunks together, 16 prompt tokens per launch sequence. The experts live in a
//! page table whose budget the KV cache shares; the planner moves their bit-widths between
//! steps ([`crate::MemoryOptions`]).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use burn_ndarray::NdArray;
use cubecl::prelude::*;
use pw_decode::{DecodeConfig, Decoder, ExpertBlocks};
use pw_hf::{Checkpoint, ModelConfig};
use pw_pages::Accountant;
use pw_planner::{
    BlockKind, FEATURES_PER_LAYER, HEAD_CONFIG_FILE, ResidualFactors, ResidualHead,
    residual_features_from_stats,
};

use crate::model::{
    DecodeSlot, KvDemand, PrefillOutcome, PrefillSlot, SeqId, SeqOutcome, StepError, StepModel,
};
use crate::paged::{MemoryPlan, PagedMemory};
use crate::{KvLayout, MemoryOptions, MemoryState, ServeError, WeightPolicy};

/// Tokens per KV block.
const BLOCK: usize = 16;

/// How to load the fast path.
#[derive(Debug, Clone, PartialEq)]
pub struct FastOptions {
    /// Bit-width every expert starts at (lowered to the highest that fits the budget).
    pub bits: u8,
    /// KV bytes the engine may reserve when there is no memory budget (sizes the cache).
    pub kv_budget_bytes: u64,
    /// Most sequences per engine step.
    pub max_batch: usize,
    /// Longest sequence.
    pub max_context: usize,
    /// Budget, policy and planner options.
    pub memory: MemoryOptions,
    /// Use the prompt-residual head saved beside the checkpoint (`residual_head.json`), when
    /// there is one: each request's prompt statistics go through it after its prefill, and the
    /// planner's damage takes the mean of the running requests' factors.
    pub residual_head: bool,
    /// Most tokens of one decoder step (its step buffers are sized for them; longer prompt
    /// chunks run in several).
    pub max_step_tokens: usize,
}

/// The fast path for the three families, with a `KV` cache (f16 on the GPU).
pub struct FastStepModel<R: Runtime, KV: Float + CubeElement> {
    dec: Decoder<R, KV>,
    kv: KvLayout,
    block_bytes: u64,
    live: HashSet<SeqId>,
    mem: PagedMemory,
    /// The prompt-residual head, when one was loaded.
    head: Option<ResidualHead<NdArray>>,
    /// The head's factors of each running sequence whose prompt it has seen.
    factors: HashMap<SeqId, ResidualFactors>,
    /// Prompts the head has seen.
    head_calls: u64,
    /// KV bytes the engine may reserve (see [`Self::kv_capacity_bytes`]).
    kv_capacity: u64,
}

/// The experts of the model in `dir` and the calibration routing recorded with them: read from
/// a PagedWeight checkpoint, or quantized from a Hugging Face one with uniform importance (its
/// sensitivities then proxies for those `pagedweight quantize` computes, and no routing).
fn load_experts(
    dir: &Path,
    cfg: &DecodeConfig,
    bits: u8,
) -> Result<(ExpertBlocks, Vec<pw_format::LayerRouting>), pw_decode::DecodeError> {
    if pw_models::is_quantized_dir(dir) {
        let ckpt = pw_format::Checkpoint::open(dir)?;
        return Ok((ExpertBlocks::from_checkpoint(&ckpt, cfg, bits)?, ckpt.manifest().routing.clone()));
    }
    Ok((ExpertBlocks::quantize_hf(&Checkpoint::open(dir)?, cfg, bits)?, Vec::new()))
}

/// Expert bytes of `experts` if every page were at `bits` (clamped to its range).
fn expert_bytes_at(experts: &ExpertBlocks, bits: u8) -> u64 {
    experts
        .blocks
        .iter()
        .flatten()
        .flat_map(|(g, d)| [g, d])
        .map(|b| {
            let (p, l) = b.bytes_at(bits.clamp(b.min_bits, b.max_bits));
            (p + l) as u64
        })
        .sum()
}

impl<R: Runtime, KV: Float + CubeElement> FastStepModel<R, KV> {
    /// Loads the HF model in `dir` with every expert quantized (uniform importance) and
    /// committed at `bits`, and a KV cache of `kv_budget_bytes` for contexts up to `max_context`;
    /// no memory budget (nothing for a planner to do).
    pub fn load(
        client: &ComputeClient<R>,
        dir: &Path,
        bits: u8,
        kv_budget_bytes: u64,
        max_batch: usize,
        max_context: usize,
    ) -> Result<Self, ServeError> {
        let memory = MemoryOptions { policy: WeightPolicy::Pinned, ..Default::default() };
        let o = FastOptions {
            bits,
            kv_budget_bytes,
            max_batch,
            max_context,
            memory,
            residual_head: false,
            max_step_tokens: pw_decode::DEFAULT_MAX_STEP_TOKENS,
        };
        Self::load_with(client, dir, &o)
    }

    /// Loads the model in `dir` with its experts under a page table: a PagedWeight checkpoint's
    /// blocks as `pagedweight quantize` wrote them (Fisher-weighted, with their sensitivities),
    /// or a Hugging Face model's experts quantized at load with uniform importance. With a
    /// budget, experts and KV cache share it and (policy `Planner`) the planner trades expert
    /// bits for KV blocks between steps.
    pub fn load_with(client: &ComputeClient<R>, dir: &Path, o: &FastOptions) -> Result<Self, ServeError> {
        let model = |e: String| ServeError::Model(format!("{}: {e}", dir.display()));
        let config = ModelConfig::from_dir(dir).map_err(|e| model(e.to_string()))?;
        let cfg = DecodeConfig::from_model(&config).map_err(|e| model(e.to_string()))?;
        let (mut experts, calibration_routing) =
            load_experts(dir, &cfg, o.bits).map_err(|e| model(e.to_string()))?;
        let memory = MemoryOptions { calibration_routing, ..o.memory.clone() };
        let block_bytes = cfg.kv_geometry(BLOCK, size_of::<KV>(), o.max_context).block_bytes() as u64;
        let plan = MemoryPlan::new(
            &o.memory,
            cfg.experts,
            block_bytes,
            o.max_batch,
            o.kv_budget_bytes,
            |b| expert_bytes_at(&experts, b),
            o.bits,
        )
        .map_err(model)?;
        check_context(client, &cfg, size_of::<KV>(), o.max_context, &plan).map_err(model)?;
        let b = plan.initial_bits;
        let at = |blk: &pw_format::ApBlock| b.clamp(blk.min_bits, blk.max_bits);
        experts.bits =
            experts.blocks.iter().map(|l| l.iter().map(|(g, d)| (at(g), at(d))).collect()).collect();
        let accountant = Accountant::new(plan.budget);
        let dec = Decoder::builder(client)
            .kv_blocks(plan.kv_blocks)
            .block_size(BLOCK)
            .max_seq_len(o.max_context)
            .accountant(accountant.clone())
            .max_step_tokens(o.max_step_tokens)
            .load(dir, experts)
            .map_err(|e| model(e.to_string()))?;
        let head = match o.residual_head && dir.join(HEAD_CONFIG_FILE).is_file() {
            true => Some(ResidualHead::load(dir, &Default::default()).map_err(|e| model(e.to_string()))?),
            false => None,
        };
        if let Some(h) = &head
            && h.config().layers != cfg.layers
        {
            return Err(model(format!(
                "{HEAD_CONFIG_FILE}: a head of {} layers for a model of {}",
                h.config().layers,
                cfg.layers
            )));
        }
        let mut me = Self::assemble(dec, accountant, &memory, plan, o.max_batch).map_err(model)?;
        me.head = head;
        Ok(me)
    }

    /// A model of `cfg`'s shapes with random weights whose expert pages move between random
    /// host parents and the device through the same mover as a checkpoint's (see
    /// [`pw_decode::DecoderBuilder::synthetic_host`]), under the same memory options: for
    /// serving benchmarks of full-size models. Host memory: every page at 8 bits.
    pub fn synthetic(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        o: &FastOptions,
    ) -> Result<Self, ServeError> {
        let model = |e: String| ServeError::Model(format!("synthetic {}-layer model: {e}", cfg.layers));
        let block_bytes = cfg.kv_geometry(BLOCK, size_of::<KV>(), o.max_context).block_bytes() as u64;
        let (h, i) = (cfg.hidden as u64, cfg.inter as u64);
        let words = |rows: u64, cols: u64| rows * cols.div_ceil(32) * 4;
        let page_pair =
            |b: u8| -> u64 { b as u64 * (words(2 * i, h) + words(h, i)) + ((2 * i + h) << b) * 2 };
        let pages = (cfg.sparse.iter().filter(|&&s| s).count() * cfg.experts) as u64;
        let plan = MemoryPlan::new(
            &o.memory,
            cfg.experts,
            block_bytes,
            o.max_batch,
            o.kv_budget_bytes,
            |b| pages * page_pair(b.clamp(3, 8)),
            o.bits,
        )
        .map_err(model)?;
        check_context(client, &cfg, size_of::<KV>(), o.max_context, &plan).map_err(model)?;
        let accountant = Accountant::new(plan.budget);
        let dec = Decoder::builder(client)
            .kv_blocks(plan.kv_blocks)
            .block_size(BLOCK)
            .max_seq_len(o.max_context)
            .accountant(accountant.clone())
            .max_step_tokens(o.max_step_tokens)
            .synthetic_host(cfg.clone(), &|_, _| plan.initial_bits)
            .map_err(|e| model(e.to_string()))?;
        Self::assemble(dec, accountant, &o.memory, plan, o.max_batch).map_err(model)
    }

    fn assemble(
        dec: Decoder<R, KV>,
        accountant: Accountant,
        memory: &MemoryOptions,
        plan: MemoryPlan,
        max_batch: usize,
    ) -> Result<Self, String> {
        let (layers, experts) = (dec.config().layers, dec.config().experts);
        let block_bytes = dec.kv_block_bytes() as u64;
        let kv = pool_layout(dec.config(), size_of::<KV>());
        let mem = PagedMemory::new(accountant, block_bytes, layers, experts, memory.clone())
            .map_err(|e| e.to_string())?;
        let mut me = Self {
            dec,
            kv,
            block_bytes,
            live: HashSet::new(),
            mem,
            head: None,
            factors: HashMap::new(),
            head_calls: 0,
            kv_capacity: plan.kv_capacity,
        };
        me.warm_up(max_batch).map_err(|e| e.to_string())?;
        me.boundary(KvDemand::default()).map_err(|e| e.to_string())?;
        Ok(me)
    }

    /// KV bytes the engine may reserve for running sequences (its admission budget): with a
    /// memory budget, what is left beside the most expert bytes the policy's floors can hold
    /// (pinned: the initial bits; planner: [`MemoryOptions::floor_bytes`]), less the planner's free-block reserve and one partly filled block per sequence.
    pub fn kv_capacity_bytes(&self) -> u64 {
        self.kv_capacity
    }

    /// The decoder.
    pub fn decoder(&self) -> &Decoder<R, KV> {
        &self.dec
    }

    /// Prompts the residual head has seen (one per request whose prefill completed).
    pub fn residual_head_calls(&self) -> u64 {
        self.head_calls
    }

    /// A prompt's statistics through the head: its factors, kept while the sequence runs.
    fn prompt_factors(&mut self, seq: SeqId) -> Result<(), StepError> {
        let Some(head) = &self.head else { return Ok(()) };
        let failed = |e: String| StepError::failed(format!("sequence {seq}: residual head: {e}"));
        let Some((stats, tokens)) = self.dec.take_residual(seq).map_err(|e| failed(e.to_string()))? else {
            return Ok(());
        };
        let (layers, hidden) = (self.dec.config().layers, self.dec.config().hidden);
        let f = residual_features_from_stats(&stats, tokens, layers, hidden)
            .map_err(|e| failed(e.to_string()))?;
        let x = Tensor::<NdArray, 1>::from_data(
            TensorData::new(f, [FEATURES_PER_LAYER * layers]),
            &Default::default(),
        );
        let factors = head.factors(x).map_err(|e| failed(e.to_string()))?;
        self.factors.insert(seq, factors);
        self.head_calls += 1;
        Ok(())
    }

    /// The mean of the running sequences' residual factors per (layer, block kind), for the
    /// planner (`None` when no running prompt has been through the head).
    fn combined_factors(&self) -> Option<ResidualFactors> {
        let n = self.factors.len();
        let first = self.factors.values().next()?;
        let layers = first.layers();
        let mut sum = vec![0.0; 2 * layers];
        for f in self.factors.values() {
            for (l, pair) in sum.chunks_mut(2).enumerate() {
                pair[0] += f.get(l, BlockKind::GateUp);
                pair[1] += f.get(l, BlockKind::Down);
            }
        }
        ResidualFactors::new(layers, sum.into_iter().map(|v| v / n as f64).collect()).ok()
    }

    /// Runs, before the first request, steps at each of [`Decoder::warm_up_steps`] where the
    /// batch cap and the memory budget allow, so that every kernel variant serving can reach is
    /// compiled (NVRTC / SPIR-V) before the requests that would otherwise wait for it: a decode
    /// step of that many fresh sequences, as many one-token prompts ending in one step (the LM
    /// head over their rows), and a prompt of that length followed by one decode over its
    /// context (whose attention splits when long). Under the planner, which samples the routing
    /// on some steps, everything runs a second time with the routing statistics on; what the
    /// warm-up routed is then dropped.
    fn warm_up(&mut self, max_batch: usize) -> Result<(), StepError> {
        let room = (self.kv_capacity / self.block_bytes.max(1)) as usize * BLOCK;
        let longest = self.dec.kv_tables().max_tokens().min(room).saturating_sub(1);
        let batch = max_batch.clamp(1, self.dec.max_logit_rows());
        let sizes = self.dec.warm_up_steps();
        let batches: Vec<usize> =
            sizes.iter().copied().filter(|&t| t <= batch && t * BLOCK <= room).collect();
        let mut prompts: Vec<usize> = sizes.iter().copied().filter(|&t| t <= longest).collect();
        // The largest step the KV room allows, where it is less than a whole step.
        if longest > 0 && prompts.last() != Some(&longest) && longest < self.dec.max_step_tokens() {
            prompts.push(longest);
        }
        let passes = if self.mem.samples_routing() { 2 } else { 1 };
        for pass in 0..passes {
            self.dec.route_stats_mut().armed = pass == 1;
            for &t in &batches {
                self.warm_up_batch(t)?;
            }
            for &t in &prompts {
                if !self.warm_up_prompt(t)? {
                    break;
                }
            }
        }
        self.dec.route_stats_mut().armed = false;
        self.dec.take_route_stats().map_err(|e| StepError::failed(e.to_string()))?;
        Ok(())
    }

    /// A decode step of `t` fresh sequences, then `t` one-token prompts ending in one step. A
    /// batch the budget cannot hold now is left out: serving cannot run it either until the
    /// planner frees memory.
    fn warm_up_batch(&mut self, t: usize) -> Result<(), StepError> {
        let seqs: Vec<SeqId> = (0..t as u64).map(|i| u64::MAX - i).collect();
        let step: Vec<(SeqId, u32)> = seqs.iter().map(|&s| (s, 0)).collect();
        let prompt = [0u32];
        let chunks: Vec<(SeqId, &[u32])> = seqs.iter().map(|&s| (s, &prompt[..])).collect();
        let res = self.with_fresh(&seqs, |me| me.step(&step).map(drop)).and_then(|()| {
            self.with_fresh(&seqs, |me| {
                me.lease(seqs.iter().map(|&s| (s, 1)))?;
                me.dec.prefill(&chunks).map(drop).map_err(|e| StepError::failed(e.to_string()))
            })
        });
        match res {
            Err(e @ StepError::Failed(_)) => Err(e),
            _ => Ok(()),
        }
    }

    /// A prompt of `t` tokens, then one decode over its context; false when the budget cannot
    /// hold it now (nor, then, a longer one).
    fn warm_up_prompt(&mut self, t: usize) -> Result<bool, StepError> {
        let seq = u64::MAX;
        let res = self.with_fresh(&[seq], |me| {
            me.lease(std::iter::once((seq, t)))?;
            me.dec.prefill(&[(seq, &vec![0u32; t])]).map_err(|e| StepError::failed(e.to_string()))?;
            me.step(&[(seq, 0)]).map(drop)
        });
        match res {
            Ok(()) => Ok(true),
            Err(StepError::OutOfMemory(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Runs `f` with `seqs` added to the decoder as fresh sequences, and frees them after
    /// whatever `f` returned.
    fn with_fresh<T>(
        &mut self,
        seqs: &[SeqId],
        f: impl FnOnce(&mut Self) -> Result<T, StepError>,
    ) -> Result<T, StepError> {
        let added = seqs.iter().try_for_each(|&s| self.dec.add_sequence(s));
        let res = added.map_err(|e| StepError::failed(e.to_string())).and_then(|()| f(self));
        for &s in seqs {
            let _ = self.dec.free_sequence(s);
        }
        res
    }

    /// Reserves, under the memory budget, the KV blocks in use plus those that appending
    /// its count of tokens to each listed sequence will take. A shortage is
    /// [`StepError::OutOfMemory`] with nothing changed.
    fn lease(&mut self, appends: impl Iterator<Item = (SeqId, usize)>) -> Result<(), StepError> {
        let t = self.dec.kv_tables();
        let mut needed = t.used_blocks();
        for (s, tokens) in appends {
            needed += t.blocks_needed(s, tokens).map_err(|e| StepError::failed(e.to_string()))?;
        }
        self.mem.reserve(&mut self.dec, needed as u64)
    }

    /// Appends one token to each sequence of `batch` and returns their logits. The blocks of
    /// the whole step are leased before the first launch, so a shortage changes nothing.
    fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>, StepError> {
        self.lease(batch.iter().map(|&(s, _)| (s, 1)))?;
        self.dec.step(batch).map_err(|e| StepError::failed(e.to_string()))
    }

    /// Whether `seq`, holding `held` tokens, can take `extra` more: a sequence that would
    /// outgrow its table fails alone, before the step.
    fn room(&self, seq: SeqId, held: usize, extra: usize) -> Result<(), StepError> {
        let max = self.dec.kv_tables().max_tokens();
        match held.checked_add(extra) {
            Some(n) if n <= max => Ok(()),
            _ => Err(StepError::failed(format!(
                "sequence {seq}: {held} + {extra} tokens exceed the context of {max} tokens"
            ))),
        }
    }
}

/// Refuses, before anything is allocated, a context length whose KV cache cannot exist: one
/// sequence at `max_context` must fit the KV capacity, and each layer's K or V pool must fit
/// the device's largest buffer.
fn check_context<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &DecodeConfig,
    elem_bytes: usize,
    max_context: usize,
    plan: &MemoryPlan,
) -> Result<(), String> {
    let geometry = cfg.kv_geometry(BLOCK, elem_bytes, max_context);
    let block_bytes = geometry.block_bytes() as u64;
    let one_seq = (max_context.div_ceil(BLOCK) as u64).saturating_mul(block_bytes);
    if one_seq > plan.kv_capacity {
        return Err(format!(
            "a context of {max_context} tokens (--max-context, else max_position_embeddings in config.json) \
             needs {one_seq} bytes of KV cache for one sequence, more than the {} bytes the KV cache has; \
             lower --max-context or give the cache more memory",
            plan.kv_capacity
        ));
    }
    let widest = cfg.attn.iter().map(|a| a.kv_heads * a.head_dim).max().unwrap_or(0) as u64;
    let pool = (plan.kv_blocks as u64).saturating_mul((BLOCK * elem_bytes) as u64).saturating_mul(widest);
    let largest = client.properties().memory.max_page_size;
    if pool > largest {
        return Err(format!(
            "a KV cache of {} blocks (sized from a context of {max_context} tokens × the batch, or \
             --kv-budget-bytes) needs K/V buffers of {pool} bytes per layer; the device's largest \
             buffer is {largest} bytes: lower --max-context, --max-batch or --kv-budget-bytes",
            plan.kv_blocks
        ));
    }
    Ok(())
}

/// The engine's view of the paged cache's bytes per token. One block id addresses the same
/// slots in every layer's pools, so a sliding-window layer keeps its old blocks for the life of
/// the sequence: the accounting counts every layer in full, or admission would promise more
/// than the pool holds once a sequence passes the window.
fn pool_layout(cfg: &DecodeConfig, elem_bytes: usize) -> KvLayout {
    let layers = cfg
        .attn
        .iter()
        .map(|a| crate::LayerKv {
            bytes_per_token: (a.kv_heads * a.head_dim * 2 * elem_bytes) as u64,
            window: None,
        })
        .collect();
    KvLayout { layers }
}

fn sample(sampler: &mut pw_models::Sampler, seq: SeqId, logits: &[f32]) -> SeqOutcome {
    if logits.iter().any(|x| x.is_nan()) {
        return Err(StepError::failed(format!("sequence {seq}: the model produced NaN logits")));
    }
    Ok(sampler.sample(logits))
}

impl<R: Runtime, KV: Float + CubeElement> StepModel for FastStepModel<R, KV>
where
    Decoder<R, KV>: Send,
{
    fn vocab_size(&self) -> usize {
        self.dec.config().vocab
    }

    fn kv_layout(&self) -> &KvLayout {
        &self.kv
    }

    fn weight_bytes(&self) -> u64 {
        (self.dec.expert_bytes() + self.dec.dense_bytes()) as u64
    }

    fn prefill(&mut self, batch: &mut [PrefillSlot<'_>]) -> Result<Vec<PrefillOutcome>, StepError> {
        let t = self.dec.kv_tables();
        let mut out: Vec<PrefillOutcome> = batch
            .iter()
            .map(|s| {
                if s.start > 0 {
                    let held = match self.live.contains(&s.seq) {
                        true => t.len(s.seq).map_err(|e| StepError::failed(e.to_string()))?,
                        false => 0,
                    };
                    if held != s.start {
                        return Err(StepError::failed(format!(
                            "sequence {}: a chunk at token {} but the cache holds {held} tokens",
                            s.seq, s.start
                        )));
                    }
                }
                self.room(s.seq, s.start, s.tokens.len()).map(|()| None)
            })
            .collect();
        let run: Vec<usize> = (0..batch.len()).filter(|&i| out[i].is_ok()).collect();
        let fresh: Vec<SeqId> =
            run.iter().map(|&i| &batch[i]).filter(|s| s.start == 0).map(|s| s.seq).collect();
        for &seq in &fresh {
            self.dec.add_sequence(seq).map_err(|e| StepError::failed(e.to_string()))?;
            self.live.insert(seq);
            if self.head.is_some() {
                self.dec.track_residual(seq);
            }
        }
        // Lease the blocks of every chunk, then run them together (a chunk of n tokens costs
        // ⌈n / 16⌉ decode launches, not n). Without the memory, the new sequences are dropped
        // again and the engine retries them later.
        if let Err(e) = self.lease(run.iter().map(|&i| (batch[i].seq, batch[i].tokens.len()))) {
            for &seq in &fresh {
                self.release(seq);
            }
            return Err(e);
        }
        let chunks: Vec<(SeqId, &[u32])> = run.iter().map(|&i| (batch[i].seq, batch[i].tokens)).collect();
        let logits = self.dec.prefill(&chunks).map_err(|e| StepError::failed(e.to_string()))?;
        for (&i, l) in run.iter().zip(&logits) {
            let s = &mut batch[i];
            if s.sample {
                out[i] = sample(s.sampler, s.seq, l).map(Some);
                self.prompt_factors(s.seq)?;
            }
        }
        Ok(out)
    }

    fn decode(&mut self, batch: &mut [DecodeSlot<'_>]) -> Result<Vec<SeqOutcome>, StepError> {
        let t = self.dec.kv_tables();
        let mut out: Vec<SeqOutcome> = batch
            .iter()
            .map(|s| {
                let held = t.len(s.seq).map_err(|e| StepError::failed(e.to_string()))?;
                self.room(s.seq, held, 1).map(|()| 0)
            })
            .collect();
        let run: Vec<usize> = (0..batch.len()).filter(|&i| out[i].is_ok()).collect();
        if run.is_empty() {
            return Ok(out);
        }
        let step: Vec<(SeqId, u32)> = run.iter().map(|&i| (batch[i].seq, batch[i].last)).collect();
        let logits = self.step(&step)?;
        for (&i, l) in run.iter().zip(&logits) {
            out[i] = sample(batch[i].sampler, batch[i].seq, l);
        }
        Ok(out)
    }

    fn release(&mut self, seq: SeqId) {
        if self.live.remove(&seq) {
            // The sequence is known, so freeing cannot fail.
            let _ = self.dec.free_sequence(seq);
        }
        self.factors.remove(&seq);
    }

    fn kv_bytes_held(&self) -> u64 {
        self.dec.kv_tables().used_blocks() as u64 * self.block_bytes
    }

    fn boundary(&mut self, demand: KvDemand) -> Result<Option<MemoryState>, StepError> {
        let used = self.dec.kv_tables().used_blocks() as u64;
        self.mem.set_residual(self.combined_factors());
        self.mem.boundary(&mut self.dec, used, demand.blocks(self.block_bytes)).map(Some)
    }

    fn page_table(&self) -> Result<Option<crate::PageTableView>, StepError> {
        self.mem.view(&self.dec).map(Some)
    }
}

/// Loads [`Path`] for the fast path on `client` with an f16 cache: the serving default on a GPU.
/// Returns the model and the KV bytes the engine may reserve.
pub fn load_fast<R: Runtime>(
    client: &ComputeClient<R>,
    dir: &Path,
    options: &FastOptions,
) -> Result<(Box<dyn StepModel>, u64), ServeError>
where
    Decoder<R, half::f16>: Send,
{
    let m = FastStepModel::<R, half::f16>::load_with(client, dir, options)?;
    let cap = m.kv_capacity_bytes();
    Ok((Box::new(m), cap))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past Gemma's sliding window the engine's byte count still equals what the paged pool
    /// takes: whole blocks of every layer.
    #[test]
    fn pool_layout_counts_what_the_block_pool_takes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/pw-models/tests/fixtures/gemma4");
        let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(&dir).unwrap()).unwrap();
        let window = cfg.attn.iter().map(|a| a.window).max().unwrap();
        assert!(window > 0, "the fixture has sliding layers");
        let geometry = cfg.kv_geometry(BLOCK, 2, 256);
        let layout = pool_layout(&cfg, 2);
        for blocks in [1, window.div_ceil(BLOCK), window.div_ceil(BLOCK) + 3] {
            let tokens = blocks * BLOCK;
            assert_eq!(layout.bytes_for(tokens), (blocks * geometry.block_bytes()) as u64, "{tokens} tokens");
        }
        // The HF layout caps sliding layers at the window, which the shared pool does not.
        let hf = KvLayout::from_config(&ModelConfig::from_dir(&dir).unwrap(), 2);
        assert!(hf.bytes_for(4 * window) < layout.bytes_for(4 * window));
    }
}
