//! [`Decoder`]: a served model on a CubeCL device, decoding batches of sequences over a paged
//! KV cache with its experts under a weight page table. A step checks and reserves its
//! tokens' cache slots, uploads the step's ids, positions and block tables once, runs its
//! family's forward pass (`crate::mixtral`, `crate::qwen2_moe`, `crate::gemma4`) and reads
//! back the logits (or, sampling greedily on the device, only the new ids) once.

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;

use cubecl::prelude::*;
use kernels_cubecl::argmax;
use kernels_cubecl::{DeviceArray, GemmConfig, RESIDUAL_STATS, read_f32, read_f32_prefix, read_u32};
use kernels_cubecl::{GroupedKernel, MmaMode};
use pw_kv::{BlockTables, DevicePools, KvGeometry, SeqId};

use crate::DecodeError;
use crate::builder::DecoderBuilder;
use crate::config::{DecodeConfig, Family};
use crate::paged::PagedExperts;
use crate::route_stats::RouteStats;
use crate::stages::{ExpertAct, Fwd, PrefillRuns, ROUTED_STEP_TOKENS, ResidualSegments, Scratch, Tuning};
use crate::weights::DenseWeights;

/// A MoE model of one of the three families on a CubeCL device, decoding batches of
/// sequences (in steps of up to [`Decoder::max_step_tokens`]) over a paged KV cache of `KV`
/// elements (f16 on the GPU). Built with [`Decoder::builder`].
pub struct Decoder<R: Runtime, KV: Float + CubeElement> {
    pub(crate) client: ComputeClient<R>,
    pub(crate) cfg: DecodeConfig,
    pub(crate) w: DenseWeights,
    /// The routed experts of every sparse layer under the weight page table.
    pub(crate) experts: PagedExperts<R>,
    /// Routing counts of the armed steps, for the planner.
    pub(crate) stats: RouteStats,
    pub(crate) tuning: Tuning,
    pub(crate) kv: DevicePools<R>,
    pub(crate) tables: BlockTables,
    pub(crate) s: Scratch,
    /// Most tokens of one step (what the scratch buffers hold).
    pub(crate) max_step: usize,
    /// Most rows of logits of one step (`≤ max_step`): decodes run in chunks of this many.
    pub(crate) logit_rows: usize,
    /// One greedy-id buffer per chunk of a step.
    pub(crate) ids_out: Vec<DeviceArray>,
    /// Sequences whose prompt statistics are gathered ([`Decoder::track_residual`]): the
    /// device statistics (`[layers, RESIDUAL_STATS, hidden]`) and the tokens they cover.
    pub(crate) residual: HashMap<SeqId, (DeviceArray, usize)>,
    pub(crate) launches: usize,
    pub(crate) _kv: PhantomData<KV>,
}

impl<R: Runtime, KV: Float + CubeElement> Decoder<R, KV> {
    /// A builder of a decoder on `client`: set the cache and the options, then load a
    /// checkpoint ([`DecoderBuilder::load`]) or make a synthetic model
    /// ([`DecoderBuilder::synthetic`]).
    pub fn builder(client: &ComputeClient<R>) -> DecoderBuilder<'_, R, KV> {
        DecoderBuilder::new(client)
    }

    /// The model's shapes.
    pub fn config(&self) -> &DecodeConfig {
        &self.cfg
    }

    /// The KV block tables (free/used blocks for admission and the planner).
    pub fn kv_tables(&self) -> &BlockTables {
        &self.tables
    }

    /// Device bytes of the KV pools.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Device bytes of the committed experts (planes + LUTs).
    pub fn expert_bytes(&self) -> usize {
        self.experts.committed_bytes() as usize
    }

    /// Device bytes of the committed experts of layer `l` (0 for a dense layer).
    pub fn layer_expert_bytes(&self, l: usize) -> usize {
        self.experts.layer_bytes(l) as usize
    }

    /// The experts' page tables.
    pub fn experts(&self) -> &PagedExperts<R> {
        &self.experts
    }

    /// The experts' page tables, to set desired bits and commit at a boundary (between steps).
    pub fn experts_mut(&mut self) -> &mut PagedExperts<R> {
        &mut self.experts
    }

    /// The routing counters: arm them before a step, download them after.
    pub fn route_stats_mut(&mut self) -> &mut RouteStats {
        &mut self.stats
    }

    /// Downloads and zeroes the routing counters of the armed steps.
    pub fn take_route_stats(&mut self) -> Result<Option<crate::RoutingCounts>, DecodeError> {
        Ok(self.stats.take(&self.client)?)
    }

    /// Bytes of one KV block (all layers, K and V).
    pub fn kv_block_bytes(&self) -> usize {
        self.kv.geometry().block_bytes()
    }

    /// Device bytes of the dense weights (embedding, attention, routers, MLPs, norms, head).
    pub fn dense_bytes(&self) -> usize {
        self.w.bytes()
    }

    /// Bytes of one expert's gate_up and down pages at the committed width, averaged over
    /// the experts of every sparse layer.
    pub fn expert_page_bytes(&self) -> usize {
        let n = self.experts.layers() * self.cfg.experts;
        self.expert_bytes() / n.max(1)
    }

    /// Re-commits the experts: expert `e` of layer `l` at `bits(l, e)` (both blocks), through
    /// the page table, waiting for every raising (for benchmarks between runs; a synthetic
    /// model's arenas hold 8 bits of every expert, so any mix fits).
    pub fn recommit_synthetic(&mut self, bits: &dyn Fn(usize, usize) -> u8) -> Result<(), DecodeError> {
        self.experts.commit_now(bits)
    }

    /// The compute client the decoder launches on.
    pub fn client(&self) -> &ComputeClient<R> {
        &self.client
    }

    /// The expert kernels' launch shape.
    pub fn gemm_config(&self) -> &GemmConfig {
        &self.tuning.gemm
    }

    /// Whether the router logits are computed inside the routing launch (see
    /// [`DecoderBuilder::fused_router`]).
    pub fn fused_router(&self) -> bool {
        self.tuning.fused_router
    }

    /// Where the routed experts' activation is computed.
    pub fn expert_act(&self) -> ExpertAct {
        self.tuning.expert_act
    }

    /// Where the dense GEMMs run.
    pub fn dense_mma(&self) -> MmaMode {
        self.tuning.dense_mma
    }

    /// Device bytes of the per-step scratch ([`DecodeConfig::scratch_bytes`] of its step size).
    pub fn scratch_bytes(&self) -> u64 {
        self.s.bytes()
    }

    /// Most tokens per routed work item (see [`DecoderBuilder::route_chunk`]).
    pub fn route_chunk(&self) -> usize {
        self.s.route.chunk()
    }

    /// Most tokens of one step: a prompt of more runs in steps of this many (see
    /// [`DecoderBuilder::max_step_tokens`]).
    pub fn max_step_tokens(&self) -> usize {
        self.max_step
    }

    /// Most sequences of one decode step, and of prompts ending in one prefill step (see
    /// [`DecoderBuilder::max_logit_rows`]): a larger batch runs in steps of this many.
    pub fn max_logit_rows(&self) -> usize {
        self.logit_rows
    }

    /// Step sizes (tokens) that together compile every kernel variant a step of up to
    /// [`Self::max_step_tokens`] tokens can take: the token buckets up to
    /// [`kernels_cubecl::MAX_TOKENS`], the smallest step of each grouped-GEMM variant (its
    /// kernel and token groups follow the tokens per expert), both sets of routing tables and
    /// the largest step. A server runs steps of these sizes before its first request, so that
    /// no request waits on a compilation.
    pub fn warm_up_steps(&self) -> Vec<usize> {
        let (k, e) = (self.cfg.top_k, self.cfg.experts);
        let mut sizes: Vec<usize> =
            (0..).map(|i| 1 << i).take_while(|&b| b <= kernels_cubecl::MAX_TOKENS).collect();
        let mut seen = HashSet::new();
        for t in 1..=self.max_step {
            if self.tuning.grouped.grouped(&self.client, t * k, e) {
                let mean = kernels_cubecl::mean_tokens(t * k, e);
                let kernel = GroupedKernel::choose(&self.client, mean);
                if seen.insert((kernel, kernel.token_groups(mean))) {
                    sizes.push(t);
                }
            }
        }
        sizes.extend([ROUTED_STEP_TOKENS, ROUTED_STEP_TOKENS + 1, self.max_step]);
        sizes.retain(|&t| t <= self.max_step);
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// Kernel launches of the last step (all chunks).
    pub fn last_launches(&self) -> usize {
        self.launches
    }

    /// Starts a sequence.
    pub fn add_sequence(&mut self, id: SeqId) -> Result<(), DecodeError> {
        Ok(self.tables.add(id)?)
    }

    /// Ends a sequence and frees its KV blocks (and its prompt statistics, if gathered).
    pub fn free_sequence(&mut self, id: SeqId) -> Result<(), DecodeError> {
        self.residual.remove(&id);
        self.tables.free(id)?;
        Ok(())
    }

    /// Gathers per-channel statistics of the residual stream entering every layer over the
    /// tokens of `id` that the next steps compute (its prompt), until
    /// [`Self::take_residual`]: what the planner's prompt-residual head reads, accumulated on
    /// the device (one launch per layer and tracked sequence of a step).
    pub fn track_residual(&mut self, id: SeqId) {
        let len = self.cfg.layers * RESIDUAL_STATS * self.cfg.hidden;
        let zeros = DeviceArray::from_slice(&self.client, &vec![0f32; len]);
        self.residual.insert(id, (zeros, 0));
    }

    /// The statistics gathered for `id` since [`Self::track_residual`] and the tokens they
    /// cover (`None` if it was not tracked); stops tracking it. Waits for the steps in flight.
    ///
    /// # Shapes
    /// - returns `[layers, RESIDUAL_STATS, hidden]`: Σ|h|, Σh², max|h| per channel
    pub fn take_residual(&mut self, id: SeqId) -> Result<Option<(Vec<f32>, usize)>, DecodeError> {
        match self.residual.remove(&id) {
            Some((stats, tokens)) => Ok(Some((read_f32(&self.client, &stats)?, tokens))),
            None => Ok(None),
        }
    }

    /// Appends `tokens` positions to a sequence's cache without computing them: whatever the
    /// pools hold there stands for their K/V (for benchmarks: a synthetic prefill of a context).
    pub fn fill_synthetic(&mut self, id: SeqId, tokens: usize) -> Result<(), DecodeError> {
        self.tables.append(id, tokens)?;
        Ok(())
    }

    /// One decode step: appends `token` to each listed sequence (distinct; any number, run in
    /// chunks of [`Self::max_logit_rows`]) and returns each one's next-token logits, in batch
    /// order.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>, DecodeError> {
        self.launches = 0;
        let mut out = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(self.logit_rows) {
            self.enqueue(chunk, None)?;
            // Only this chunk's rows: the buffer holds those of the largest step.
            let rows = read_f32_prefix(&self.client, &self.s.logits, chunk.len() * self.cfg.vocab)?;
            out.extend(rows.chunks(self.cfg.vocab).map(<[f32]>::to_vec));
        }
        Ok(out)
    }

    /// Prefills whole prompts: their tokens go through the decode kernels
    /// [`Self::max_step_tokens`] at a time (one step per chunk, each token attending causally to
    /// the positions up to its own; a chunk also ends after [`Self::max_logit_rows`] prompts), so
    /// a prompt of `n` tokens costs `⌈n / max_step_tokens⌉` steps instead of `n`; only each
    /// prompt's last position goes through the LM head. Returns each prompt's next-token logits
    /// (after its last token), in order.
    pub fn prefill(&mut self, prompts: &[(SeqId, &[u32])]) -> Result<Vec<Vec<f32>>, DecodeError> {
        self.launches = 0;
        // (sequence, token, index of the prompt it ends)
        let flat: Vec<(SeqId, u32, Option<usize>)> = prompts
            .iter()
            .enumerate()
            .flat_map(|(i, &(s, p))| {
                p.iter().enumerate().map(move |(j, &tok)| (s, tok, (j + 1 == p.len()).then_some(i)))
            })
            .collect();
        let mut out = vec![Vec::new(); prompts.len()];
        for chunk in prefill_chunks(&flat, self.max_step, self.logit_rows, |f| f.2.is_some()) {
            let batch: Vec<(SeqId, u32)> = chunk.iter().map(|f| (f.0, f.1)).collect();
            let last: Vec<usize> = (0..chunk.len()).filter(|&row| chunk[row].2.is_some()).collect();
            self.enqueue(&batch, Some(&last))?;
            // Only chunks that end a prompt are read back (and waited for): row j of the logits
            // is the prompt that ends at chunk row `last[j]`.
            if !last.is_empty() {
                let all = read_f32_prefix(&self.client, &self.s.logits, last.len() * self.cfg.vocab)?;
                for (j, &row) in last.iter().enumerate() {
                    if let Some(i) = chunk[row].2 {
                        out[i] = all[j * self.cfg.vocab..][..self.cfg.vocab].to_vec();
                    }
                }
            }
        }
        Ok(out)
    }

    /// [`Self::step`] with greedy sampling on the device: only the new token ids come back.
    pub fn step_greedy(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<u32>, DecodeError> {
        self.enqueue_greedy(batch)?;
        self.read_greedy(batch.len())
    }

    /// Enqueues a greedy step without waiting for it (the host's share of a step); read the
    /// ids with [`Self::read_greedy`].
    pub fn enqueue_greedy(&mut self, batch: &[(SeqId, u32)]) -> Result<(), DecodeError> {
        self.launches = 0;
        for (i, chunk) in batch.chunks(self.logit_rows).enumerate() {
            if self.ids_out.len() <= i {
                self.ids_out.push(DeviceArray::empty::<R, u32>(&self.client, self.logit_rows));
            }
            self.enqueue(chunk, None)?;
            argmax(&self.client, chunk.len(), self.cfg.vocab, &self.s.logits, &self.ids_out[i])?;
            self.launches += 1;
        }
        Ok(())
    }

    /// The ids of the last [`Self::enqueue_greedy`] of `n` sequences (waits for the step).
    pub fn read_greedy(&mut self, n: usize) -> Result<Vec<u32>, DecodeError> {
        let mut ids = Vec::with_capacity(n);
        let m = self.logit_rows;
        for (i, buf) in self.ids_out.iter().enumerate().take(n.div_ceil(m)) {
            let got = read_u32(&self.client, buf)?;
            ids.extend_from_slice(&got[..(n - i * m).min(m)]);
        }
        Ok(ids)
    }

    /// Enqueues one chunk of at most [`Self::max_step_tokens`] tokens; the logits land in
    /// `s.logits`, of every token, or with `head_rows` of those rows only (in their order).
    fn enqueue(&mut self, batch: &[(SeqId, u32)], head_rows: Option<&[usize]>) -> Result<(), DecodeError> {
        let t = batch.len();
        if t == 0 {
            return Ok(());
        }
        if let Some(&(_, bad)) = batch.iter().find(|(_, tok)| *tok as usize >= self.cfg.vocab) {
            return Err(DecodeError::Unsupported(format!(
                "token id {bad} outside the vocabulary of {}",
                self.cfg.vocab
            )));
        }
        let seqs: Vec<SeqId> = batch.iter().map(|b| b.0).collect();
        let (slots, positions) = self.reserve(&seqs)?;
        let c = &self.client;
        let ids: Vec<u32> = batch.iter().map(|b| b.1).collect();
        let mut f = Fwd::<R, KV> {
            c,
            cfg: &self.cfg,
            s: &self.s,
            tuning: &self.tuning,
            kv: &self.kv,
            experts: &self.experts,
            stats: &mut self.stats,
            step: self.kv.upload_tokens(c, &self.tables, &seqs, &slots, &positions)?,
            ids: DeviceArray::from_slice(c, &ids),
            pos: DeviceArray::from_slice(c, &positions),
            meta: DeviceArray::from_slice(c, &[t as u32]),
            t,
            head_rows: head_rows.map(|rows| {
                // One stand-in index when no row is wanted (the head then runs no launch).
                let idx: Vec<u32> =
                    if rows.is_empty() { vec![0] } else { rows.iter().map(|&r| r as u32).collect() };
                let n = rows.len();
                (DeviceArray::from_slice(c, &idx), DeviceArray::from_slice(c, &[n as u32]), n)
            }),
            runs: prefill_runs::<R, KV>(&seqs, self.kv.geometry(), c),
            residual: residual_segments(&seqs, &mut self.residual),
            launches: 0,
            _kv: PhantomData,
        };
        match self.cfg.family {
            Family::Mixtral => crate::mixtral::forward(&mut f, &self.w)?,
            Family::Qwen2Moe => crate::qwen2_moe::forward(&mut f, &self.w)?,
            Family::Gemma4 => crate::gemma4::forward(&mut f, &self.w)?,
        }
        self.launches += f.launches;
        Ok(())
    }

    /// Appends one position per listed token to its sequence's cache (a sequence may come
    /// several times: consecutive tokens of its prompt) and returns the new slots and
    /// positions; every sequence's blocks are reserved first so a full cache refuses the
    /// whole step.
    fn reserve(&mut self, seqs: &[SeqId]) -> Result<(Vec<u32>, Vec<u32>), DecodeError> {
        let mut counts: Vec<(SeqId, usize)> = Vec::new();
        for &s in seqs {
            match counts.iter_mut().find(|c| c.0 == s) {
                Some(c) => c.1 += 1,
                None => counts.push((s, 1)),
            }
        }
        let needed: usize =
            counts.iter().map(|&(s, n)| self.tables.blocks_needed(s, n)).sum::<Result<_, _>>()?;
        if needed > self.tables.free_blocks() {
            return Err(pw_kv::KvError::OutOfBlocks {
                seq: seqs[0],
                needed,
                free: self.tables.free_blocks(),
            }
            .into());
        }
        let mut slots = Vec::with_capacity(seqs.len());
        let mut positions = Vec::with_capacity(seqs.len());
        for &s in seqs {
            slots.push(self.tables.append(s, 1)?[0]);
            positions.push(self.tables.len(s)? as u32 - 1);
        }
        Ok((slots, positions))
    }
}

/// Fewest rows of one sequence in a step for which its attention runs as a prefill (each
/// run's cache read once for its queries) rather than one query per row.
const PREFILL_MIN_RUN: usize = 4;

/// The step's rows of each tracked sequence as segments `(first row, rows, 0)` (its runs, as
/// [`kernels_cubecl::prefill_runs`] finds them) with the sequence's statistics buffer, counting
/// the tokens they add.
fn residual_segments<'a>(
    seqs: &[SeqId],
    tracked: &'a mut HashMap<SeqId, (DeviceArray, usize)>,
) -> ResidualSegments<'a> {
    let mut segs: HashMap<SeqId, Vec<(u32, u32, u32)>> = HashMap::new();
    for run in kernels_cubecl::prefill_runs(seqs, kernels_cubecl::PREFILL_RUN_ROWS).chunks(2) {
        let seq = seqs[run[0] as usize];
        if tracked.contains_key(&seq) {
            segs.entry(seq).or_default().push((run[0], run[1], 0));
        }
    }
    tracked
        .iter_mut()
        .filter_map(|(id, (stats, tokens))| {
            let s = segs.remove(id)?;
            *tokens += s.iter().map(|x| x.1 as usize).sum::<usize>();
            Some((&*stats, s))
        })
        .collect()
}

/// `items` cut into consecutive chunks of at most `max` items, each holding at most `rows` items
/// for which `ends` holds (a prefill step's prompts that end in it: its rows of logits).
fn prefill_chunks<T>(items: &[T], max: usize, rows: usize, ends: impl Fn(&T) -> bool) -> Vec<&[T]> {
    let mut chunks = Vec::new();
    let (mut start, mut ended) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        if ends(item) {
            ended += 1;
        }
        if i + 1 - start == max || ended == rows || i + 1 == items.len() {
            chunks.push(&items[start..=i]);
            (start, ended) = (i + 1, 0);
        }
    }
    chunks
}

/// The step's rows in runs of one sequence on the device, once for each run length the layers'
/// prefill attention serves best ([`kernels_cubecl::prefill_run_rows`]), when some run has at
/// least [`PREFILL_MIN_RUN`] rows; none otherwise (the step decodes).
fn prefill_runs<R: Runtime, KV: 'static>(
    seqs: &[SeqId],
    geometry: &KvGeometry,
    c: &ComputeClient<R>,
) -> Vec<PrefillRuns> {
    let any_run = kernels_cubecl::prefill_runs(seqs, kernels_cubecl::PREFILL_RUN_ROWS)
        .chunks(2)
        .any(|r| r[1] as usize >= PREFILL_MIN_RUN);
    if !any_run {
        return Vec::new();
    }
    let mut lengths: Vec<usize> = (0..geometry.layers.len())
        .map(|l| kernels_cubecl::prefill_run_rows::<R, KV>(c, &geometry.attn_shape(l)))
        .collect();
    lengths.sort_unstable();
    lengths.dedup();
    lengths
        .into_iter()
        .map(|max_rows| {
            let runs = kernels_cubecl::prefill_runs(seqs, max_rows);
            let longest = runs.chunks(2).map(|r| r[1] as usize).max().unwrap_or(0);
            PrefillRuns { runs: DeviceArray::from_slice(c, &runs), count: runs.len() / 2, longest, max_rows }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::prefill_chunks;

    /// Chunks end at `max` items or after `rows` items that end a prompt, and cover every item
    /// once in order.
    #[test]
    fn prefill_chunks_bound_tokens_and_rows() {
        // Items: prompt lengths 3, 1, 1, 1, 5 (true = a prompt's last token).
        let ends = [false, false, true, true, true, true, false, false, false, false, true];
        let lens = |max, rows| -> Vec<usize> {
            let chunks = prefill_chunks(&ends, max, rows, |e| *e);
            assert_eq!(chunks.concat(), ends, "max {max}, rows {rows}");
            chunks.iter().map(|c| c.len()).collect()
        };
        assert_eq!(lens(100, 100), [11]);
        assert_eq!(lens(4, 100), [4, 4, 3]);
        assert_eq!(lens(100, 2), [4, 2, 5]);
        assert_eq!(lens(3, 1), [3, 1, 1, 1, 3, 2]);
        assert!(prefill_chunks(&[] as &[bool], 4, 2, |e| *e).is_empty());
    }
}
