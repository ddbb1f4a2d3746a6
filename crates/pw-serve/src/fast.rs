//! [`StepModel`] over the fast decode path (`pw-decode`): each engine step is one batched
//! decode step of fused CubeCL launches over the paged KV cache; new prompts go through the same
//! kernels, all new sequences together, one position per launch sequence.

use std::collections::HashSet;
use std::path::Path;

use cubecl::prelude::*;
use pw_decode::{DecodeConfig, ExpertBlocks, MixtralDecoder};
use pw_hf::{Checkpoint, ModelConfig};

use crate::model::{DecodeSlot, PrefillSlot, SeqId, StepError, StepModel};
use crate::{KvLayout, ServeError};

/// Sequences per fused step (the kernels' token bucket).
const STEP_BATCH: usize = kernels_cubecl::MAX_TOKENS;
/// Tokens per KV block.
const BLOCK: usize = 16;

/// The fast path for the three families, with a `KV` cache (f16 on the GPU).
pub struct FastStepModel<R: Runtime, KV: Float + CubeElement> {
    dec: MixtralDecoder<R, KV>,
    kv: KvLayout,
    block_bytes: u64,
    live: HashSet<SeqId>,
}

impl<R: Runtime, KV: Float + CubeElement> FastStepModel<R, KV> {
    /// Loads the HF model in `dir` with every expert quantized (uniform importance) and
    /// committed at `bits`, and a KV cache of `kv_budget_bytes` for contexts up to `max_context`.
    pub fn load(
        client: &ComputeClient<R>,
        dir: &Path,
        bits: u8,
        kv_budget_bytes: u64,
        max_batch: usize,
        max_context: usize,
    ) -> Result<Self, ServeError> {
        let model = |e: String| ServeError::Model(format!("{}: {e}", dir.display()));
        let config = ModelConfig::from_dir(dir).map_err(|e| model(e.to_string()))?;
        let cfg = DecodeConfig::from_model(&config).map_err(|e| model(e.to_string()))?;
        let ckpt = Checkpoint::open(dir).map_err(|e| model(e.to_string()))?;
        let experts = ExpertBlocks::quantize_hf(&ckpt, &cfg, bits).map_err(|e| model(e.to_string()))?;
        let geometry = cfg.kv_geometry(BLOCK, size_of::<KV>(), max_context);
        let block_bytes = geometry.block_bytes() as u64;
        // The engine admits by bytes; a sequence may waste up to one partly filled block.
        let blocks = kv_budget_bytes.div_ceil(block_bytes) as usize + max_batch.max(1);
        let dec = MixtralDecoder::load(client, dir, &experts, blocks, BLOCK, max_context)
            .map_err(|e| model(e.to_string()))?;
        let kv = KvLayout::from_config(&config, size_of::<KV>() as u64);
        let mut me = Self { dec, kv, block_bytes, live: HashSet::new() };
        me.warm_up(max_batch).map_err(|e| model(e.0))?;
        Ok(me)
    }

    /// Runs one step at every token bucket up to `max_batch` so each kernel variant is
    /// compiled (NVRTC / SPIR-V) before the first requests, which would otherwise wait for it.
    fn warm_up(&mut self, max_batch: usize) -> Result<(), StepError> {
        let mut b = 1;
        while b <= max_batch.clamp(1, STEP_BATCH) {
            let seqs: Vec<SeqId> = (0..b as u64).map(|i| u64::MAX - i).collect();
            for &s in &seqs {
                self.dec.add_sequence(s).map_err(|e| StepError(e.to_string()))?;
            }
            let step: Vec<(SeqId, u32)> = seqs.iter().map(|&s| (s, 0)).collect();
            let res = self.step(&step);
            for &s in &seqs {
                let _ = self.dec.free_sequence(s);
            }
            res?;
            b *= 2;
        }
        Ok(())
    }

    fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>, StepError> {
        let mut out = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(STEP_BATCH) {
            out.extend(self.dec.step(chunk).map_err(|e| StepError(e.to_string()))?);
        }
        Ok(out)
    }
}

fn sample(sampler: &mut pw_models::Sampler, seq: SeqId, logits: &[f32]) -> Result<u32, StepError> {
    if logits.iter().any(|x| x.is_nan()) {
        return Err(StepError(format!("sequence {seq}: the model produced NaN logits")));
    }
    Ok(sampler.sample(logits))
}

impl<R: Runtime, KV: Float + CubeElement> StepModel for FastStepModel<R, KV>
where
    MixtralDecoder<R, KV>: Send,
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

    fn prefill(&mut self, batch: &mut [PrefillSlot<'_>]) -> Result<Vec<u32>, StepError> {
        for s in batch.iter() {
            self.dec.add_sequence(s.seq).map_err(|e| StepError(e.to_string()))?;
            self.live.insert(s.seq);
        }
        let longest = batch.iter().map(|s| s.prompt.len()).max().unwrap_or(0);
        let mut first = vec![0u32; batch.len()];
        for p in 0..longest {
            let idx: Vec<usize> = (0..batch.len()).filter(|&i| batch[i].prompt.len() > p).collect();
            let step: Vec<(SeqId, u32)> = idx.iter().map(|&i| (batch[i].seq, batch[i].prompt[p])).collect();
            let logits = self.step(&step)?;
            for (&i, l) in idx.iter().zip(&logits) {
                if p + 1 == batch[i].prompt.len() {
                    first[i] = sample(batch[i].sampler, batch[i].seq, l)?;
                }
            }
        }
        Ok(first)
    }

    fn decode(&mut self, batch: &mut [DecodeSlot<'_>]) -> Result<Vec<u32>, StepError> {
        let step: Vec<(SeqId, u32)> = batch.iter().map(|s| (s.seq, s.last)).collect();
        let logits = self.step(&step)?;
        batch.iter_mut().zip(&logits).map(|(s, l)| sample(s.sampler, s.seq, l)).collect()
    }

    fn release(&mut self, seq: SeqId) {
        if self.live.remove(&seq) {
            // The sequence is known, so freeing cannot fail.
            let _ = self.dec.free_sequence(seq);
        }
    }

    fn kv_bytes_held(&self) -> u64 {
        self.dec.kv_tables().used_blocks() as u64 * self.block_bytes
    }
}

/// Loads [`Path`] for the fast path on `client` with an f16 cache: the serving default on a GPU.
pub fn load_fast<R: Runtime>(
    client: &ComputeClient<R>,
    dir: &Path,
    bits: u8,
    kv_budget_bytes: u64,
    max_batch: usize,
    max_context: usize,
) -> Result<Box<dyn StepModel>, ServeError>
where
    MixtralDecoder<R, half::f16>: Send,
{
    Ok(Box::new(FastStepModel::<R, half::f16>::load(
        client,
        dir,
        bits,
        kv_budget_bytes,
        max_batch,
        max_context,
    )?))
}
