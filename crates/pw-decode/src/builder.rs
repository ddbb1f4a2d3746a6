//! [`DecoderBuilder`]: the KV cache, the memory budget and the kernel choices of a
//! [`Decoder`], fixed when it is built from a checkpoint ([`DecoderBuilder::load`]) or with
//! random weights (`crate::synthetic`).

use std::marker::PhantomData;
use std::path::Path;

use cubecl::prelude::*;
use kernels_cubecl::GemmConfig;
use kernels_cubecl::{GroupedMode, MmaMode, ROUTE_CHUNK, router_fusable};
use pw_hf::ModelConfig;
use pw_kv::{BlockTables, DevicePools};
use pw_pages::Accountant;

use crate::DecodeError;
use crate::config::DecodeConfig;
use crate::decoder::Decoder;
use crate::experts::ExpertBlocks;
use crate::paged::PagedExperts;
use crate::route_stats::RouteStats;
use crate::stages::{ExpertAct, Scratch, Tuning};
use crate::weights::{DenseWeights, HfWeights, load_dense, root};

/// How to build a [`Decoder`]: its KV cache (`kv_blocks` blocks of `block_size` tokens,
/// sequences of at most `max_seq_len`), the budget its expert pages lease from, and the
/// kernel choices. Every option has a default; [`Self::load`] or [`Self::synthetic`] builds.
pub struct DecoderBuilder<'a, R: Runtime, KV> {
    pub(crate) client: &'a ComputeClient<R>,
    kv_blocks: Option<usize>,
    block_size: usize,
    max_seq_len: usize,
    pub(crate) accountant: Option<Accountant>,
    gemm: Option<GemmConfig>,
    fused_router: bool,
    expert_act: ExpertAct,
    dense_mma: MmaMode,
    route_chunk: usize,
    grouped: GroupedMode,
    max_step_tokens: usize,
    max_logit_rows: usize,
    _kv: PhantomData<KV>,
}

/// Most tokens of one decoder step by default (sequences decoding, or prompt tokens): one set
/// of launches per layer for up to this many, so every weight is read once per step and a
/// prompt's expert GEMMs see many tokens per expert.
pub const DEFAULT_MAX_STEP_TOKENS: usize = 2048;

/// Most rows of logits one step computes by default: sequences decoding, or prompts ending in
/// the step (a step of decodes runs in chunks of this many). The logits buffer holds this many
/// rows of the vocabulary rather than one per token of the largest step.
pub const DEFAULT_MAX_LOGIT_ROWS: usize = 256;

impl<'a, R: Runtime, KV: Float + CubeElement> DecoderBuilder<'a, R, KV> {
    /// The defaults: blocks of 16 tokens, sequences of up to 4096, enough blocks for one such
    /// sequence, no memory limit, the default kernel choices.
    pub(crate) fn new(client: &'a ComputeClient<R>) -> Self {
        Self {
            client,
            kv_blocks: None,
            block_size: 16,
            max_seq_len: 4096,
            accountant: None,
            gemm: None,
            fused_router: true,
            expert_act: ExpertAct::GateUpEpilogue,
            dense_mma: MmaMode::AUTO,
            route_chunk: ROUTE_CHUNK,
            grouped: GroupedMode::Auto,
            max_step_tokens: DEFAULT_MAX_STEP_TOKENS,
            max_logit_rows: DEFAULT_MAX_LOGIT_ROWS,
            _kv: PhantomData,
        }
    }

    /// Blocks of the KV cache (default: enough for one sequence of `max_seq_len`).
    pub fn kv_blocks(mut self, blocks: usize) -> Self {
        self.kv_blocks = Some(blocks);
        self
    }

    /// Tokens per KV block (default 16).
    pub fn block_size(mut self, tokens: usize) -> Self {
        self.block_size = tokens;
        self
    }

    /// The longest sequence the cache addresses (default 4096).
    pub fn max_seq_len(mut self, tokens: usize) -> Self {
        self.max_seq_len = tokens;
        self
    }

    /// The budget the expert pages lease from, shared with the KV cache's owner (default: no
    /// memory limit).
    pub fn accountant(mut self, accountant: Accountant) -> Self {
        self.accountant = Some(accountant);
        self
    }

    /// The expert kernels' launch shape (default `GemmConfig::for_client`).
    pub fn gemm(mut self, gemm: GemmConfig) -> Self {
        self.gemm = Some(gemm);
        self
    }

    /// Computes the router logits inside the routing launch where the router is small enough
    /// (`kernels_cubecl::router_fusable`; default `true`), or always with a GEMM of
    /// their own; [`Decoder::fused_router`] tells which the decoder does.
    pub fn fused_router(mut self, on: bool) -> Self {
        self.fused_router = on;
        self
    }

    /// Where the routed experts' activation is computed (default
    /// [`ExpertAct::GateUpEpilogue`]).
    pub fn expert_act(mut self, at: ExpertAct) -> Self {
        self.expert_act = at;
        self
    }

    /// Where the dense GEMMs (projections, dense MLPs, LM head) run (default `MmaMode::AUTO`:
    /// on the matrix units from a few tokens where the device has them).
    pub fn dense_mma(mut self, mode: MmaMode) -> Self {
        self.dense_mma = mode;
        self
    }

    /// Most tokens per routed work item (default `kernels_cubecl::ROUTE_CHUNK`, one of
    /// `ROUTE_CHUNK_CHOICES`): an expert with more tokens reads its weights once per item.
    pub fn route_chunk(mut self, tokens: usize) -> Self {
        self.route_chunk = tokens;
        self
    }

    /// Where the routed experts run (default `GroupedMode::Auto`: the grouped GEMM once the
    /// experts see enough tokens each, the routed GEMVs below).
    pub fn grouped(mut self, mode: GroupedMode) -> Self {
        self.grouped = mode;
        self
    }

    /// Most tokens of one step (default [`DEFAULT_MAX_STEP_TOKENS`]): larger batches and
    /// prompts run in steps of this many; the scratch buffers are sized for it.
    pub fn max_step_tokens(mut self, tokens: usize) -> Self {
        self.max_step_tokens = tokens;
        self
    }

    /// Most rows of logits of one step (default [`DEFAULT_MAX_LOGIT_ROWS`]): decode batches run
    /// in steps of at most this many sequences, and a prefill step ends at most this many prompts.
    pub fn max_logit_rows(mut self, rows: usize) -> Self {
        self.max_logit_rows = rows;
        self
    }

    /// Loads the dense weights of the checkpoint in `dir` (Hugging Face or PagedWeight, any
    /// supported family) in f16 and its experts from `experts` (quantized from the same
    /// checkpoint, at their bits).
    pub fn load(self, dir: impl AsRef<Path>, experts: ExpertBlocks) -> Result<Decoder<R, KV>, DecodeError> {
        let dir = dir.as_ref();
        let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(dir)?)?;
        let ckpt = crate::experts::dense_checkpoint(dir)?;
        if experts.blocks.len() != cfg.layers {
            return Err(DecodeError::Unsupported(format!(
                "{} expert layers for {} model layers",
                experts.blocks.len(),
                cfg.layers
            )));
        }
        if let Some(l) = (0..cfg.layers).find(|&l| cfg.sparse[l] == experts.blocks[l].is_empty()) {
            return Err(DecodeError::Unsupported(format!(
                "layer {l}: {} expert blocks for a {} layer",
                experts.blocks[l].len(),
                if cfg.sparse[l] { "sparse" } else { "dense" }
            )));
        }
        let client = self.client;
        let shape = cfg.moe_shape();
        let paged = PagedExperts::new(client, shape, experts.blocks, &experts.bits, self.budget(), false)?;
        let dense = load_dense(&cfg, root(&ckpt), &mut HfWeights { client, ckpt: &ckpt })?;
        self.assemble(cfg, dense, paged)
    }

    /// The accountant the expert pages lease from.
    pub(crate) fn budget(&self) -> Accountant {
        self.accountant.clone().unwrap_or_else(|| Accountant::new(u64::MAX))
    }

    /// The decoder of `cfg`'s shapes around its dense weights and experts, with its KV cache,
    /// scratch buffers and kernel choices.
    pub(crate) fn assemble(
        self,
        cfg: DecodeConfig,
        w: DenseWeights,
        experts: PagedExperts<R>,
    ) -> Result<Decoder<R, KV>, DecodeError> {
        let client = self.client;
        let geometry = cfg.kv_geometry(self.block_size, size_of::<KV>(), self.max_seq_len);
        let kv_blocks = self.kv_blocks.unwrap_or(self.max_seq_len.div_ceil(self.block_size));
        let gemm = match self.gemm {
            Some(g) => {
                g.check()?;
                g
            }
            None => GemmConfig::for_client(client),
        };
        let tuning = Tuning {
            gemm,
            fused_router: self.fused_router && cfg.experts > 0 && router_fusable(client, cfg.moe_shape()),
            expert_act: self.expert_act,
            dense_mma: self.dense_mma,
            grouped: self.grouped,
        };
        if self.max_step_tokens == 0 || self.max_logit_rows == 0 {
            return Err(DecodeError::Unsupported(
                "max_step_tokens and max_logit_rows must be at least 1".into(),
            ));
        }
        let logit_rows = self.max_logit_rows.min(self.max_step_tokens);
        Ok(Decoder {
            client: client.clone(),
            s: Scratch::new(client, &cfg, self.route_chunk, self.max_step_tokens, logit_rows)?,
            max_step: self.max_step_tokens,
            logit_rows,
            w,
            stats: RouteStats::new(client, cfg.layers, cfg.experts.max(1)),
            experts,
            tuning,
            kv: DevicePools::new::<KV>(client, &geometry, kv_blocks),
            tables: BlockTables::new(&geometry, kv_blocks),
            cfg,
            ids_out: Vec::new(),
            residual: std::collections::HashMap::new(),
            launches: 0,
            _kv: PhantomData,
        })
    }
}
