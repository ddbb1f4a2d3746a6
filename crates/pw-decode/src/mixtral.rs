//! The decode path of the Mixtral architecture (pre-norm GQA attention with rotate-half RoPE,
//! softmax → top-k → renormalised routing over SwiGLU experts, untied head).

use std::path::Path;

use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::step::{
    DenseGemm, MoeShape, Rope, RouteBuffers, ap_gemm_routed, dense_gemm, embed, gather_rows, moe_combine,
    moe_route, rms_norm, rope,
};
use kernels_cubecl::{
    Activation, DeviceArray, GemmConfig, MAX_TOKENS, RowLayout, kv_append_rows,
    paged_decode_attention_strided, read_f32,
};
use pw_format::ApBlock;
use pw_hf::{Checkpoint, MixtralConfig, ModelConfig};
use pw_kv::{BlockTables, DevicePools, KvGeometry, LayerGeometry, SeqId};
use pw_pages::Accountant;

use crate::DecodeError;
use crate::experts::{PagedExperts, synthetic_block, synthetic_luts};
use crate::route_stats::RouteStats;

/// The shapes the decode path needs.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeConfig {
    /// Vocabulary.
    pub vocab: usize,
    /// Model width H.
    pub hidden: usize,
    /// Expert width I.
    pub inter: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Routed experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Sliding window (0 = none).
    pub window: usize,
    /// RoPE inverse frequencies (`head_dim / 2`).
    pub inv_freq: Vec<f32>,
}

impl DecodeConfig {
    /// The shapes of a Mixtral config.
    pub fn from_mixtral(c: &MixtralConfig) -> Self {
        Self {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            inter: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            experts: c.num_local_experts,
            top_k: c.num_experts_per_tok,
            eps: c.rms_norm_eps as f32,
            window: c.sliding_window.unwrap_or(0),
            inv_freq: c.rope.inv_freq(c.head_dim),
        }
    }

    fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The paged cache geometry of this model with `elem_bytes` per cached element.
    pub fn kv_geometry(&self, block_size: usize, elem_bytes: usize, max_seq_len: usize) -> KvGeometry {
        let l = LayerGeometry {
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
        };
        KvGeometry { layers: vec![l; self.layers], block_size, elem_bytes, max_seq_len }
    }
}

/// The any-precision experts of every layer (`[layer][expert] = (gate_up [2I, H], down [H, I])`)
/// and the bit-width each starts committed at; the decoder hands them to its page table
/// ([`PagedExperts`]).
#[derive(Debug, Clone)]
pub struct ExpertBlocks {
    /// Blocks per layer and expert.
    pub blocks: Vec<Vec<(ApBlock, ApBlock)>>,
    /// Committed bits per layer and expert (gate_up, down).
    pub bits: Vec<Vec<(u8, u8)>>,
}

impl ExpertBlocks {
    /// Quantizes the experts of an HF Mixtral checkpoint (per-expert `w1/w3/w2` or fused
    /// `gate_up_proj`/`down_proj`) with uniform importance, all committed at `bits`.
    pub fn quantize_hf(ckpt: &Checkpoint, cfg: &DecodeConfig, bits: u8) -> Result<Self, DecodeError> {
        let (h, i) = (cfg.hidden, cfg.inter);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let mut layer = Vec::with_capacity(cfg.experts);
            for e in 0..cfg.experts {
                let (gate_up, down) = expert_weights(ckpt, l, e, cfg)?;
                let gu = ApBlock::quantize(
                    &format!("layers.{l}.experts.{e}.gate_up"),
                    &gate_up,
                    None,
                    2 * i,
                    h,
                    3,
                    8,
                )?;
                let dn = ApBlock::quantize(&format!("layers.{l}.experts.{e}.down"), &down, None, h, i, 3, 8)?;
                layer.push((gu, dn));
            }
            blocks.push(layer);
        }
        let bits = vec![vec![(bits, bits); cfg.experts]; cfg.layers];
        Ok(Self { blocks, bits })
    }
}

/// `(gate_up [2I·H], down [H·I])` of one expert, row-major as the kernels read them.
fn expert_weights(
    ckpt: &Checkpoint,
    l: usize,
    e: usize,
    cfg: &DecodeConfig,
) -> Result<(Vec<f32>, Vec<f32>), DecodeError> {
    let (h, i) = (cfg.hidden, cfg.inter);
    let per = format!("model.layers.{l}.block_sparse_moe.experts.{e}");
    if ckpt.contains(&format!("{per}.w1.weight")) {
        let mut gate_up = read(ckpt, &format!("{per}.w1.weight"), &[i, h])?;
        gate_up.extend(read(ckpt, &format!("{per}.w3.weight"), &[i, h])?);
        return Ok((gate_up, read(ckpt, &format!("{per}.w2.weight"), &[h, i])?));
    }
    let fused = format!("model.layers.{l}.mlp.experts");
    let gu = read(ckpt, &format!("{fused}.gate_up_proj"), &[cfg.experts, 2 * i, h])?;
    let dn = read(ckpt, &format!("{fused}.down_proj"), &[cfg.experts, h, i])?;
    Ok((gu[e * 2 * i * h..][..2 * i * h].to_vec(), dn[e * h * i..][..h * i].to_vec()))
}

fn read(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, DecodeError> {
    let t = ckpt.read_f32(name)?;
    if t.shape != shape {
        return Err(DecodeError::Shape { name: name.into(), expected: shape.to_vec(), got: t.shape });
    }
    Ok(t.data)
}

fn half(v: &[f32]) -> Vec<f16> {
    v.iter().map(|&x| f16::from_f32(x)).collect()
}

struct Layer {
    input_norm: DeviceArray,
    wqkv: DeviceArray,
    wo: DeviceArray,
    post_norm: DeviceArray,
    router: DeviceArray,
}

/// Per-step scratch buffers, sized for `MAX_TOKENS` tokens.
struct Scratch {
    h: DeviceArray,
    xn: DeviceArray,
    qkv: DeviceArray,
    attn: DeviceArray,
    router_logits: DeviceArray,
    xg: DeviceArray,
    gate_up: DeviceArray,
    down: DeviceArray,
    logits: DeviceArray,
    route: RouteBuffers,
    norm_params: DeviceArray,
    one: DeviceArray,
    scale: DeviceArray,
    none: DeviceArray,
}

/// A Mixtral-architecture model on a CubeCL device, decoding batches of up to 16 sequences
/// over a paged KV cache of `KV` elements (f16 on the GPU).
pub struct MixtralDecoder<R: Runtime, KV: Float + CubeElement> {
    client: ComputeClient<R>,
    cfg: DecodeConfig,
    embed: DeviceArray,
    final_norm: DeviceArray,
    lm_head: DeviceArray,
    layers: Vec<Layer>,
    /// The experts under the weight page table (arenas, committed slot tables).
    experts: PagedExperts<R>,
    /// Routing counts of the armed steps, for the planner.
    stats: RouteStats,
    gemm: GemmConfig,
    kv: DevicePools<R>,
    tables: BlockTables,
    s: Scratch,
    _kv: std::marker::PhantomData<KV>,
}

impl<R: Runtime, KV: Float + CubeElement> MixtralDecoder<R, KV> {
    /// Loads the dense weights of an HF Mixtral checkpoint in f16 and the experts from
    /// `experts`, with a KV cache of `kv_blocks` blocks of `block_size` tokens; no memory limit.
    pub fn load(
        client: &ComputeClient<R>,
        dir: impl AsRef<Path>,
        experts: &ExpertBlocks,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        Self::load_paged(
            client,
            dir,
            experts.clone(),
            Accountant::new(u64::MAX),
            kv_blocks,
            block_size,
            max_seq_len,
        )
    }

    /// [`Self::load`] with the experts' pages leasing from `accountant` (the budget the KV
    /// cache shares).
    pub fn load_paged(
        client: &ComputeClient<R>,
        dir: impl AsRef<Path>,
        experts: ExpertBlocks,
        accountant: Accountant,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        let dir = dir.as_ref();
        let ModelConfig::Mixtral(mc) = ModelConfig::from_dir(dir)? else {
            return Err(DecodeError::Unsupported(format!(
                "{}: the fast decode path covers the Mixtral architecture so far",
                dir.display()
            )));
        };
        if mc.tie_word_embeddings {
            return Err(DecodeError::Unsupported("tied embeddings in the fast decode path".into()));
        }
        let cfg = DecodeConfig::from_mixtral(&mc);
        let ckpt = Checkpoint::open(dir)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let up16 = |name: &str, shape: &[usize]| -> Result<DeviceArray, DecodeError> {
            Ok(DeviceArray::from_slice(client, &half(&read(&ckpt, name, shape)?)))
        };
        let up32 = |name: &str, shape: &[usize]| -> Result<DeviceArray, DecodeError> {
            Ok(DeviceArray::from_slice(client, &read(&ckpt, name, shape)?))
        };
        if experts.blocks.len() != cfg.layers {
            return Err(DecodeError::Unsupported(format!(
                "{} expert layers for {} model layers",
                experts.blocks.len(),
                cfg.layers
            )));
        }
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            let mut wqkv = read(&ckpt, &format!("{p}.self_attn.q_proj.weight"), &[cfg.heads * hd, h])?;
            wqkv.extend(read(&ckpt, &format!("{p}.self_attn.k_proj.weight"), &[cfg.kv_heads * hd, h])?);
            wqkv.extend(read(&ckpt, &format!("{p}.self_attn.v_proj.weight"), &[cfg.kv_heads * hd, h])?);
            layers.push(Layer {
                input_norm: up32(&format!("{p}.input_layernorm.weight"), &[h])?,
                wqkv: DeviceArray::from_slice(client, &half(&wqkv)),
                wo: up16(&format!("{p}.self_attn.o_proj.weight"), &[h, cfg.heads * hd])?,
                post_norm: up32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                router: up16(&format!("{p}.block_sparse_moe.gate.weight"), &[cfg.experts, h])
                    .or_else(|_| up16(&format!("{p}.mlp.gate.weight"), &[cfg.experts, h]))?,
            });
        }
        let paged =
            PagedExperts::new(client, moe_shape(&cfg), experts.blocks, &experts.bits, accountant, false)?;
        let embed = up16("model.embed_tokens.weight", &[cfg.vocab, h])?;
        let final_norm = up32("model.norm.weight", &[h])?;
        let lm_head = up16("lm_head.weight", &[cfg.vocab, h])?;
        Ok(Self::assemble(
            client,
            cfg,
            embed,
            final_norm,
            lm_head,
            layers,
            paged,
            kv_blocks,
            block_size,
            max_seq_len,
        ))
    }

    /// A model of `cfg`'s shapes with random weights made on the device side where they are
    /// large (expert planes: hashed words; LUTs, dense weights: small uniform values), every
    /// expert committed at `bits`: for speed measurements of full-size models that are not
    /// available offline. No memory limit.
    pub fn synthetic(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        bits: u8,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        Self::synthetic_paged(
            client,
            cfg,
            bits,
            Accountant::new(u64::MAX),
            kv_blocks,
            block_size,
            max_seq_len,
        )
    }

    /// [`Self::synthetic`] with the experts under a page table leasing from `accountant`:
    /// every page stores widths 3..=8 (random planes hashed on the device, random LUTs).
    pub fn synthetic_paged(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        bits: u8,
        accountant: Accountant,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self, DecodeError> {
        if !(3..=8).contains(&bits) {
            return Err(DecodeError::Unsupported(format!("bits {bits} outside 3..=8")));
        }
        let (h, hd, i) = (cfg.hidden, cfg.head_dim, cfg.inter);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand16 = |n: usize, a: f32| -> DeviceArray {
            let v: Vec<f16> = (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    f16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a)
                })
                .collect();
            DeviceArray::from_slice(client, &v)
        };
        let ones = |n: usize| DeviceArray::from_slice(client, &vec![1.0f32; n]);
        let wscale = (h as f32).powf(-0.5);
        let (gu_luts, dn_luts) = (synthetic_luts(2 * i, 0.05, 1), synthetic_luts(h, 0.05, 2));
        let blocks: Vec<Vec<(ApBlock, ApBlock)>> = (0..cfg.layers)
            .map(|_| {
                (0..cfg.experts)
                    .map(|_| (synthetic_block(2 * i, h, &gu_luts), synthetic_block(h, i, &dn_luts)))
                    .collect()
            })
            .collect();
        let initial = vec![vec![(bits, bits); cfg.experts]; cfg.layers];
        let paged = PagedExperts::new(client, moe_shape(&cfg), blocks, &initial, accountant, true)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            layers.push(Layer {
                input_norm: ones(h),
                wqkv: rand16(cfg.qkv_width() * h, wscale),
                wo: rand16(h * cfg.heads * hd, wscale),
                post_norm: ones(h),
                router: rand16(cfg.experts * h, 4.0 * wscale),
            });
        }
        let embed = rand16(cfg.vocab * h, 1.0);
        let lm_head = rand16(cfg.vocab * h, wscale);
        Ok(Self::assemble(
            client,
            cfg,
            embed,
            ones(h),
            lm_head,
            layers,
            paged,
            kv_blocks,
            block_size,
            max_seq_len,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        client: &ComputeClient<R>,
        cfg: DecodeConfig,
        embed: DeviceArray,
        final_norm: DeviceArray,
        lm_head: DeviceArray,
        layers: Vec<Layer>,
        experts: PagedExperts<R>,
        kv_blocks: usize,
        block_size: usize,
        max_seq_len: usize,
    ) -> Self {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let geometry = cfg.kv_geometry(block_size, size_of::<KV>(), max_seq_len);
        let t = MAX_TOKENS;
        let scratch = |n: usize| DeviceArray::empty::<R, f32>(client, n);
        let s = Scratch {
            h: scratch(t * h),
            xn: scratch(t * h),
            qkv: scratch(t * cfg.qkv_width()),
            attn: scratch(t * cfg.heads * hd),
            router_logits: scratch(t * cfg.experts),
            xg: scratch(t * cfg.top_k * h),
            gate_up: scratch(t * cfg.top_k * 2 * cfg.inter),
            down: scratch(t * cfg.top_k * h),
            logits: scratch(t * cfg.vocab),
            route: RouteBuffers::new(client, moe_shape(&cfg)),
            norm_params: DeviceArray::from_slice(client, &[cfg.eps, 0.0]),
            one: DeviceArray::from_slice(client, &[1.0f32]),
            scale: DeviceArray::from_slice(client, &[(hd as f32).powf(-0.5)]),
            none: DeviceArray::from_slice(client, &[0.0f32]),
        };
        Self {
            client: client.clone(),
            embed,
            final_norm,
            lm_head,
            layers,
            stats: RouteStats::new(client, cfg.layers, cfg.experts),
            experts,
            gemm: GemmConfig::for_client(client),
            kv: DevicePools::new::<KV>(client, &geometry, kv_blocks),
            tables: BlockTables::new(&geometry, kv_blocks),
            s,
            cfg,
            _kv: std::marker::PhantomData,
        }
    }

    /// The model's shapes.
    pub fn config(&self) -> &DecodeConfig {
        &self.cfg
    }

    /// The KV block tables (free/used blocks for admission and the planner).
    pub fn kv_tables(&self) -> &BlockTables {
        &self.tables
    }

    /// Device bytes of the committed experts (planes + LUTs).
    pub fn expert_bytes(&self) -> usize {
        self.experts.committed_bytes() as usize
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

    /// Device bytes of the dense weights (embedding, attention, routers, norms, head).
    pub fn dense_bytes(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| (l.wqkv.len + l.wo.len + l.router.len) * 2 + (l.input_norm.len + l.post_norm.len) * 4)
            .sum();
        per_layer + (self.embed.len + self.lm_head.len) * 2 + self.final_norm.len * 4
    }

    /// Mean bytes of one layer's gate_up and down pages of one expert at the committed width.
    pub fn expert_page_bytes(&self) -> usize {
        self.expert_bytes() / (self.cfg.experts * self.cfg.layers).max(1)
    }

    /// Starts a sequence.
    pub fn add_sequence(&mut self, id: SeqId) -> Result<(), DecodeError> {
        Ok(self.tables.add(id)?)
    }

    /// Ends a sequence and frees its KV blocks.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<(), DecodeError> {
        self.tables.free(id)?;
        Ok(())
    }

    /// One decode step: appends `token` to each listed sequence (at most 16, distinct) and
    /// returns each one's next-token logits, in batch order.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>, DecodeError> {
        let t = batch.len();
        if t == 0 {
            return Ok(vec![]);
        }
        if t > MAX_TOKENS {
            return Err(DecodeError::Unsupported(format!("{t} sequences in one step, at most {MAX_TOKENS}")));
        }
        if let Some(&(_, bad)) = batch.iter().find(|(_, tok)| *tok as usize >= self.cfg.vocab) {
            return Err(DecodeError::Unsupported(format!(
                "token id {bad} outside the vocabulary of {}",
                self.cfg.vocab
            )));
        }
        let seqs: Vec<SeqId> = batch.iter().map(|b| b.0).collect();
        // Reserve every sequence's slot first so a full cache refuses the whole step.
        let needed: usize = seqs.iter().map(|&s| self.tables.blocks_needed(s, 1)).sum::<Result<_, _>>()?;
        if needed > self.tables.free_blocks() {
            return Err(pw_kv::KvError::OutOfBlocks {
                seq: seqs[0],
                needed,
                free: self.tables.free_blocks(),
            }
            .into());
        }
        let mut slots = Vec::with_capacity(t);
        let mut positions = Vec::with_capacity(t);
        for &s in &seqs {
            slots.push(self.tables.append(s, 1)?[0]);
            positions.push(self.tables.len(s)? as u32 - 1);
        }
        let c = &self.client;
        let cfg = &self.cfg;
        let s = &self.s;
        let step = self.kv.upload_step(c, &self.tables, &seqs, &slots)?;
        let ids: Vec<u32> = batch.iter().map(|b| b.1).collect();
        let ids = DeviceArray::from_slice(c, &ids);
        let pos = DeviceArray::from_slice(c, &positions);
        let meta = DeviceArray::from_slice(c, &[t as u32]);
        let (h, hd, qkv_w) = (cfg.hidden, cfg.head_dim, cfg.qkv_width());
        let inv_freq = DeviceArray::from_slice(c, &cfg.inv_freq);
        let shape = moe_shape(cfg);

        embed(c, t, h, &ids, &self.embed, &s.one, &s.h)?;
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(c, t, h, &s.h, &layer.input_norm, &s.norm_params, &s.xn)?;
            let qkv = DenseGemm { n: qkv_w, k: h, bias: false, accumulate: false };
            dense_gemm(c, qkv, t, &meta, &s.xn, &layer.wqkv, &s.none, &s.qkv)?;
            let r = Rope { stride: qkv_w, heads: cfg.heads + cfg.kv_heads, head_dim: hd, rot_dim: hd };
            rope(c, r, t, &s.qkv, &pos, &inv_freq)?;
            let attn_shape = self.kv.geometry().attn_shape(li);
            let (kp, vp) = self.kv.layer(li);
            let layout =
                RowLayout { stride: qkv_w, k_off: cfg.heads * hd, v_off: (cfg.heads + cfg.kv_heads) * hd };
            kv_append_rows::<R, KV>(c, attn_shape, t, layout, &s.qkv, &s.qkv, &step.slots, kp, vp)?;
            paged_decode_attention_strided::<R, KV>(
                c,
                attn_shape,
                t,
                &s.qkv,
                qkv_w,
                kp,
                vp,
                &step.table,
                &step.lens,
                &s.scale,
                &s.attn,
            )?;
            let o = DenseGemm { n: h, k: cfg.heads * hd, bias: false, accumulate: true };
            dense_gemm(c, o, t, &meta, &s.attn, &layer.wo, &s.none, &s.h)?;

            rms_norm(c, t, h, &s.h, &layer.post_norm, &s.norm_params, &s.xn)?;
            let router = DenseGemm { n: cfg.experts, k: h, bias: false, accumulate: false };
            dense_gemm(c, router, t, &meta, &s.xn, &layer.router, &s.none, &s.router_logits)?;
            moe_route(c, shape, t, &meta, &s.router_logits, self.experts.slots(li), &s.route)?;
            self.stats.record(c, shape, li, t, &meta, &s.route)?;
            gather_rows(c, t, cfg.top_k, h, &meta, &s.xn, &s.route.gather, &s.xg)?;
            let (e, i) = (cfg.experts, cfg.inter);
            ap_gemm_routed(
                c,
                self.gemm,
                self.experts.planes(li),
                self.experts.luts(li),
                &s.route.desc_gate_up,
                e,
                2 * i,
                t,
                &s.xg,
                &s.gate_up,
                Activation::None,
            )?;
            ap_gemm_routed(
                c,
                self.gemm,
                self.experts.planes(li),
                self.experts.luts(li),
                &s.route.desc_down,
                e,
                h,
                t,
                &s.gate_up,
                &s.down,
                Activation::SiluMul,
            )?;
            moe_combine(c, t, cfg.top_k, h, &s.down, &s.route.pos, &s.route.weights, &s.h)?;
        }
        rms_norm(c, t, h, &s.h, &self.final_norm, &s.norm_params, &s.xn)?;
        let head = DenseGemm { n: cfg.vocab, k: h, bias: false, accumulate: false };
        dense_gemm(c, head, t, &meta, &s.xn, &self.lm_head, &s.none, &s.logits)?;
        let all = read_f32(c, &s.logits)?;
        Ok(all.chunks(cfg.vocab).take(t).map(<[f32]>::to_vec).collect())
    }
}

fn moe_shape(cfg: &DecodeConfig) -> MoeShape {
    MoeShape { experts: cfg.experts, k: cfg.top_k, renormalize: true, hidden: cfg.hidden, inter: cfg.inter }
}
