//! The fast decode path against the Burn-ops models (`pw-models`, the reference) of all three
//! families (the transformers fixtures and the shipped tiny models), with the same
//! any-precision experts in both: continuous batches of sequences of different lengths that
//! join and leave at different steps, prompts fed token by token or prefilled in chunks, every step's logits compared
//! with a full recomputation of each sequence.

use std::path::Path;

use burn_ndarray::NdArray;
use cubecl::wgpu::WgpuRuntime;
use kernels_cubecl::{GroupedMode, ROUTE_CHUNK};
use pw_decode::{
    DEFAULT_MAX_LOGIT_ROWS, DEFAULT_MAX_STEP_TOKENS, DecodeConfig, Decoder, DecoderBuilder, ExpertAct,
    ExpertBlocks,
};
use pw_hf::{Checkpoint, ModelConfig};
use pw_models::generate::{argmax, ids_tensor, last_logits};
use pw_models::{AnyModel, CausalLm, HfSource};
use pw_nn::{LoadError, WeightSource};
use pw_testkit::{asset, fixture};

type B = NdArray<f32>;

/// f32 KV cache: only the summation order differs from the reference.
const F32_KV_TOL: f32 = 2e-4;
/// f16 KV cache (as on the GPU): K/V rounded to 11 significant bits.
const F16_KV_TOL: f32 = 5e-3;
/// f16 KV cache on the Gemma-4 fixture: its scores are unscaled (scale 1 over unit-RMS q/k
/// from random norm weights) and its logits soft-capped at 2, so the same K/V rounding moves
/// the logits about twice as much relative to their largest.
const GEMMA_F16_KV_TOL: f32 = 1.5e-2;

/// The HF checkpoint with every expert replaced by its dequantized any-precision block (and
/// every other matrix rounded to f16 as the decoder stores it), in
/// either layout (per expert: `...experts.E.{w1|gate_proj, w3|up_proj, w2|down_proj}.weight`;
/// fused: `...experts.{gate_up_proj, down_proj}`).
struct Dequantized<'a> {
    inner: HfSource<'a, B>,
    experts: &'a ExpertBlocks,
    inter: usize,
}

impl Dequantized<'_> {
    fn gate_up(&self, l: usize, e: usize) -> Vec<f32> {
        let (gu, _) = &self.experts.blocks[l][e];
        gu.dequantize_reference(self.experts.bits[l][e].0)
    }
    fn down(&self, l: usize, e: usize) -> Vec<f32> {
        let (_, dn) = &self.experts.blocks[l][e];
        dn.dequantize_reference(self.experts.bits[l][e].1)
    }
}

impl WeightSource<B> for Dequantized<'_> {
    fn device(&self) -> burn_ndarray::NdArrayDevice {
        self.inner.device()
    }
    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }
    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        let parts: Vec<&str> = name.split('.').collect();
        let (Some(li), Some(xi)) =
            (parts.iter().position(|p| *p == "layers"), parts.iter().position(|p| *p == "experts"))
        else {
            // The decoder keeps matrices in f16 (norms, biases, scales in f32): round the
            // reference's the same way, so the fixtures' f32 weights compare exactly.
            let v = self.inner.read(name, expected)?;
            return Ok(if expected.len() == 2 {
                v.into_iter().map(|x| half::f16::from_f32(x).to_f32()).collect()
            } else {
                v
            });
        };
        let l: usize = parts[li + 1].parse().unwrap();
        if let Ok(e) = parts[xi + 1].parse::<usize>() {
            let n = self.inter * self.experts.blocks[l][e].0.cols;
            return Ok(match parts[xi + 2] {
                "w1" | "gate_proj" => self.gate_up(l, e)[..n].to_vec(),
                "w3" | "up_proj" => self.gate_up(l, e)[n..].to_vec(),
                _ => self.down(l, e),
            });
        }
        let experts = self.experts.blocks[l].len();
        Ok(match parts[xi + 1] {
            "gate_up_proj" => (0..experts).flat_map(|e| self.gate_up(l, e)).collect(),
            _ => (0..experts).flat_map(|e| self.down(l, e)).collect(),
        })
    }
}

/// A sequence of the test: id, prompt, the step it joins at, the step it leaves at.
type Plan = (u64, Vec<u32>, usize, usize);

/// The fixture's reference model (Burn ops, dequantized experts), the quantized experts it was
/// built from (mixed committed bits: 8, 6, 4 and 3 across experts, as the planner leaves them)
/// and the lavapipe client.
fn setup(dir: &Path) -> (AnyModel<B>, ExpertBlocks, cubecl::client::ComputeClient<WgpuRuntime>) {
    let config = ModelConfig::from_dir(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    // The decoder's own view of the shapes, used to quantize the experts.
    let cfg = DecodeConfig::from_model(&config).unwrap();
    let mut experts = ExpertBlocks::quantize_hf(&ckpt, &cfg, 8).unwrap();
    for (l, layer) in experts.bits.iter_mut().enumerate() {
        for (e, b) in layer.iter_mut().enumerate() {
            let bits = [8u8, 6, 4, 3][(l + e) % 4];
            *b = (bits, bits.max(4));
        }
    }
    let device = Default::default();
    let src = Dequantized { inner: HfSource::new(&ckpt, &device), experts: &experts, inter: cfg.inter };
    let reference = AnyModel::<B>::from_source(&config, &src).unwrap();
    (reference, experts, pw_testkit::wgpu_client())
}

/// The reference's next-token logits after `ids`, and the decoder's error against them
/// relative to their largest magnitude.
fn error_against_reference(reference: &AnyModel<B>, ids: &[u32], logits: &[f32]) -> (Vec<f32>, f32) {
    let device = Default::default();
    let want =
        last_logits(reference.forward(ids_tensor::<B>(ids, &device), &mut reference.new_cache(), None));
    let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
    let err = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
    (want, err)
}

/// The decoder of the checkpoint in `dir` with `experts`, a cache of `blocks` blocks of 4
/// tokens and sequences of up to `max_seq`, and the options `opts` sets.
fn load<KV: cubecl::prelude::Float + cubecl::prelude::CubeElement>(
    client: &cubecl::prelude::ComputeClient<WgpuRuntime>,
    dir: &Path,
    experts: &ExpertBlocks,
    blocks: usize,
    max_seq: usize,
    opts: impl FnOnce(DecoderBuilder<'_, WgpuRuntime, KV>) -> DecoderBuilder<'_, WgpuRuntime, KV>,
) -> Decoder<WgpuRuntime, KV> {
    let b = Decoder::builder(client).kv_blocks(blocks).block_size(4).max_seq_len(max_seq);
    opts(b).load(dir, experts.clone()).unwrap()
}

/// Runs `steps` continuous-batching steps of `plan` on the decoder and checks every sequence's
/// logits against a full recomputation with the Burn model.
fn check(dir: &Path, kv_f16: bool, tol: f32, plan: &[Plan], steps: usize, max_seq: usize) {
    let (reference, experts, client) = setup(dir);
    let blocks = 4 * max_seq.div_ceil(4) + 4;
    let mut fast = if kv_f16 {
        let f16_kv = || load(&client, dir, &experts, blocks, max_seq, |b| b);
        Box::new(Run::<half::f16>(f16_kv(), Some(f16_kv()), vec![])) as Box<dyn Step>
    } else {
        Box::new(Run::<f32>(load(&client, dir, &experts, blocks, max_seq, |b| b), None, vec![]))
    };

    let mut seqs: Vec<(u64, Vec<u32>, Vec<u32>)> = vec![];
    for step in 0..steps {
        for (id, p, start, _) in plan {
            if *start == step {
                fast.add(*id);
                seqs.push((*id, p.clone(), vec![]));
            }
        }
        for (id, _, _, end) in plan {
            if *end == step {
                fast.free(*id);
                seqs.retain(|s| s.0 != *id);
            }
        }
        // Next token of each sequence: its prompt first, then its own greedy choice.
        let batch: Vec<(u64, u32)> = seqs
            .iter()
            .map(|(id, p, fed)| (*id, if fed.len() < p.len() { p[fed.len()] } else { *fed.last().unwrap() }))
            .collect();
        let got = fast.step(&batch);
        let greedy = fast.greedy_of_last(&batch);
        for (((_, p, fed), ((id, tok), logits)), g) in
            seqs.iter_mut().zip(batch.iter().zip(&got)).zip(&greedy)
        {
            let mut next = fed.clone();
            if next.len() < p.len() {
                next.push(*tok);
            }
            let all: Vec<u32> = if fed.len() < p.len() { next.clone() } else { fed.clone() };
            let (want, err) = error_against_reference(&reference, &all, logits);
            assert!(
                err <= tol,
                "{}: step {step} seq {id} (len {}): logits error {err:e} > {tol:e}",
                dir.display(),
                all.len()
            );
            assert_eq!(argmax(logits), argmax(&want), "step {step} seq {id}: greedy choice differs");
            if let Some(g) = g {
                assert_eq!(*g, argmax(logits), "step {step} seq {id}: on-device greedy id differs");
            }
            if fed.len() < p.len() {
                *fed = next;
            }
            if fed.len() >= p.len() {
                fed.push(argmax(logits));
            }
        }
    }
}

/// Three sequences: 1 and 2 from the start (prompts of 5 and 9), 3 joins at step 4, 1 leaves
/// at step 8.
fn short_plan() -> Vec<Plan> {
    vec![
        (1, vec![1, 49, 30, 12, 77], 0, 8),
        (2, vec![1, 90, 91, 92, 93, 94, 95, 2, 7], 0, usize::MAX),
        (3, vec![1, 40, 5], 4, usize::MAX),
    ]
}

fn check_short(dir: &Path, kv_f16: bool, tol: f32) {
    check(dir, kv_f16, tol, &short_plan(), 12, 64);
}

trait Step {
    fn add(&mut self, id: u64);
    fn free(&mut self, id: u64);
    fn step(&mut self, batch: &[(u64, u32)]) -> Vec<Vec<f32>>;
    /// The device-side greedy ids of the batch just stepped, where the decoder can redo it
    /// (`None`: not checked).
    fn greedy_of_last(&mut self, batch: &[(u64, u32)]) -> Vec<Option<u32>>;
}

/// The decoder under test and, with an f16 cache, a twin fed the same batches that samples
/// greedily on the device (`step_greedy`), whose ids must be the argmax of the first's logits.
struct Run<KV: cubecl::prelude::Float + cubecl::prelude::CubeElement>(
    Decoder<WgpuRuntime, KV>,
    Option<Decoder<WgpuRuntime, KV>>,
    Vec<u32>,
);

impl<KV: cubecl::prelude::Float + cubecl::prelude::CubeElement> Step for Run<KV> {
    fn add(&mut self, id: u64) {
        self.0.add_sequence(id).unwrap();
        if let Some(t) = &mut self.1 {
            t.add_sequence(id).unwrap();
        }
    }
    fn free(&mut self, id: u64) {
        self.0.free_sequence(id).unwrap();
        if let Some(t) = &mut self.1 {
            t.free_sequence(id).unwrap();
        }
    }
    fn step(&mut self, batch: &[(u64, u32)]) -> Vec<Vec<f32>> {
        if let Some(t) = &mut self.1 {
            self.2 = t.step_greedy(batch).unwrap();
        }
        self.0.step(batch).unwrap()
    }
    fn greedy_of_last(&mut self, batch: &[(u64, u32)]) -> Vec<Option<u32>> {
        if self.1.is_some() { self.2.iter().map(|&i| Some(i)).collect() } else { vec![None; batch.len()] }
    }
}

#[test]
fn mixtral_shipped_f32_cache() {
    check_short(&asset("tiny-mixtral"), false, F32_KV_TOL);
}

#[test]
fn mixtral_shipped_f16_cache() {
    check_short(&asset("tiny-mixtral"), true, F16_KV_TOL);
}

#[test]
fn mixtral_fixture_f16_cache() {
    check_short(&fixture("mixtral"), true, F16_KV_TOL);
}

#[test]
fn qwen2_moe_fixture_f32_cache() {
    // Biases, shared expert with its gate, a dense layer (`mlp_only_layers`), no renormalisation.
    check_short(&fixture("qwen2_moe"), false, F32_KV_TOL);
}

#[test]
fn qwen2_moe_shipped_f16_cache() {
    check_short(&asset("tiny-qwen2-moe"), true, F16_KV_TOL);
}

#[test]
fn gemma4_fixture_f32_cache() {
    check_short(&fixture("gemma4"), false, F32_KV_TOL);
}

/// Window 8: sequence 1 reaches 22 tokens, sequence 2 21, sequence 3 joins late and ends at 12.
fn window_plan() -> Vec<Plan> {
    vec![
        (1, vec![1, 49, 30, 12, 77, 5, 6, 7, 8, 9, 10, 11], 0, usize::MAX),
        (2, vec![1, 90, 91, 92, 93], 1, usize::MAX),
        (3, vec![1, 40, 5], 10, usize::MAX),
    ]
}

#[test]
fn gemma4_fixture_past_the_window_f32_cache() {
    check(&fixture("gemma4"), false, F32_KV_TOL, &window_plan(), 22, 32);
}

#[test]
fn gemma4_fixture_past_the_window_f16_cache() {
    check(&fixture("gemma4"), true, GEMMA_F16_KV_TOL, &window_plan(), 22, 32);
}

#[test]
fn gemma4_multimodal_layout_f32_cache() {
    check_short(&fixture("gemma4_mm"), false, F32_KV_TOL);
}

/// Three prompts of 20, 5 and 19 tokens (44 in all).
fn three_prompts() -> Vec<(u64, Vec<u32>)> {
    vec![
        (1, (0..20).map(|i| (i * 7 + 1) % 50).collect()),
        (2, vec![1, 90, 91, 92, 93]),
        (3, (0..19).map(|i| (i * 3 + 2) % 60).collect()),
    ]
}

/// A PagedWeight checkpoint of the shipped model (its experts as blocks, every other tensor
/// unchanged, the layout `pagedweight quantize` writes) loads through
/// [`ExpertBlocks::from_checkpoint`] and the checkpoint's own shards: the same blocks with their
/// sensitivities, committed at the requested bits clamped to each block's range, and with the
/// same committed bits the same logits as the Hugging Face directory serving those blocks.
#[test]
fn pagedweight_checkpoint_serves_its_blocks() {
    use pw_format::{BlockKind, CheckpointWriter};
    let dir = asset("tiny-mixtral");
    let (_, experts, client) = setup(&dir);
    let hf = Checkpoint::open(&dir).unwrap();
    let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(&dir).unwrap()).unwrap();
    let out = tempfile::tempdir().unwrap();
    // Small shards, so the dense tensors span several files.
    let mut w = CheckpointWriter::create(out.path()).unwrap().with_shard_bytes(1 << 20);
    experts.write_checkpoint(&hf, &cfg, &mut w).unwrap();
    w.copy_file(&dir.join("config.json")).unwrap();
    w.finish().unwrap();
    let pw = pw_format::Checkpoint::open(out.path()).unwrap();
    let mut loaded = ExpertBlocks::from_checkpoint(&pw, &cfg, 5).unwrap();
    assert_eq!(loaded.blocks, experts.blocks, "blocks as written");
    assert!(loaded.bits.iter().flatten().all(|&b| b == (5, 5)), "committed at the requested bits");
    let high = ExpertBlocks::from_checkpoint(&pw, &cfg, 8).unwrap();
    assert!(high.bits.iter().flatten().all(|&(g, d)| g == 8 && d == 8));
    loaded.bits = experts.bits.clone();
    let prompts = three_prompts();
    let refs: Vec<(u64, &[u32])> = prompts.iter().map(|(id, p)| (*id, p.as_slice())).collect();
    let blocks = prompts.iter().map(|p| (p.1.len() + 3).div_ceil(4)).sum::<usize>();
    let run = |d: &Path, x: &ExpertBlocks| {
        let mut dec = load::<f32>(&client, d, x, blocks, 48, |b| b);
        for (id, _) in &prompts {
            dec.add_sequence(*id).unwrap();
        }
        let first = dec.prefill(&refs).unwrap();
        let batch: Vec<(u64, u32)> =
            prompts.iter().zip(&first).map(|((id, _), l)| (*id, argmax(l))).collect();
        (first, dec.step(&batch).unwrap())
    };
    assert_eq!(run(&dir, &experts), run(out.path(), &loaded), "logits of the two directories");
    // A checkpoint that lacks an expert's block names it.
    let mut short = pw.manifest().clone();
    short.blocks.retain(|b| !(b.layer == 1 && b.expert == 2 && b.kind == BlockKind::Down));
    std::fs::write(out.path().join(pw_format::MANIFEST_FILE), serde_json::to_string(&short).unwrap())
        .unwrap();
    let e = ExpertBlocks::from_checkpoint(&pw_format::Checkpoint::open(out.path()).unwrap(), &cfg, 8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Down block for layer 1, expert 2"), "{e}");
}

/// Whole prompts prefilled through the decode kernels in steps of `max_step` tokens (at 16:
/// several tokens of one sequence per step, prompts crossing step boundaries and, on Gemma,
/// its sliding window of 8; at the default all 44 in one step), then two decode steps: every
/// next-token logit against the reference.
fn check_prefill(dir: &Path, tol: f32, route_chunk: usize, grouped: GroupedMode, max_step: usize) {
    check_prompts(dir, tol, route_chunk, grouped, (max_step, DEFAULT_MAX_LOGIT_ROWS), &three_prompts());
}

/// [`check_prefill`] of `prompts`, decoded together, in steps of at most `max_step` tokens
/// and `logit_rows` rows of logits.
fn check_prompts(
    dir: &Path,
    tol: f32,
    route_chunk: usize,
    grouped: GroupedMode,
    (max_step, logit_rows): (usize, usize),
    prompts: &[(u64, Vec<u32>)],
) {
    let (reference, experts, client) = setup(dir);
    let blocks = prompts.iter().map(|p| (p.1.len() + 3).div_ceil(4)).sum::<usize>();
    let mut dec = load::<f32>(&client, dir, &experts, blocks, 48, |b| {
        b.route_chunk(route_chunk).grouped(grouped).max_step_tokens(max_step).max_logit_rows(logit_rows)
    });
    let rows = logit_rows.min(max_step);
    assert_eq!(
        (dec.route_chunk(), dec.max_step_tokens(), dec.max_logit_rows()),
        (route_chunk, max_step, rows)
    );
    // What a memory budget sets aside for the scratch is what the decoder holds.
    let scratch = dec.config().scratch_bytes(max_step, rows, route_chunk);
    assert_eq!(dec.scratch_bytes(), scratch, "{}", dir.display());
    for (id, _) in prompts {
        dec.add_sequence(*id).unwrap();
    }
    let refs: Vec<(u64, &[u32])> = prompts.iter().map(|(id, p)| (*id, p.as_slice())).collect();
    let mut logits = dec.prefill(&refs).unwrap();
    let mut fed: Vec<Vec<u32>> = prompts.iter().map(|p| p.1.clone()).collect();
    for step in 0..3 {
        let mut batch = vec![];
        for ((id, l), all) in prompts.iter().map(|p| p.0).zip(&logits).zip(fed.iter_mut()) {
            let (want, err) = error_against_reference(&reference, all, l);
            assert!(
                err <= tol,
                "{}: step {step} seq {id} (len {}): error {err:e} > {tol:e}",
                dir.display(),
                all.len()
            );
            assert_eq!(argmax(l), argmax(&want), "step {step} seq {id}: greedy choice differs");
            all.push(argmax(l));
            batch.push((id, argmax(l)));
        }
        logits = dec.step(&batch).unwrap();
    }
}

/// Prefill in steps of 16 tokens, and in one step of 44 (past the kernels' 16-token tiles, the
/// routing in a cube of its own).
#[test]
fn mixtral_shipped_chunked_prefill() {
    for max_step in [16, DEFAULT_MAX_STEP_TOKENS] {
        check_prefill(&asset("tiny-mixtral"), F32_KV_TOL, ROUTE_CHUNK, GroupedMode::Off, max_step);
    }
}

/// Prefill steps of 16 tokens give the tiny Mixtral's experts several tokens each: routed
/// items of 4 and 8 tokens (the GEMV's larger buckets) against the Burn reference.
#[test]
fn mixtral_shipped_chunked_prefill_wide_route_items() {
    for chunk in [4, 8] {
        check_prefill(&asset("tiny-mixtral"), F32_KV_TOL, chunk, GroupedMode::Off, 16);
    }
}

#[test]
fn gemma4_fixture_chunked_prefill_past_the_window() {
    for max_step in [16, DEFAULT_MAX_STEP_TOKENS] {
        check_prefill(&fixture("gemma4"), F32_KV_TOL, ROUTE_CHUNK, GroupedMode::Off, max_step);
    }
}

/// The routed experts through the grouped GEMM (its plain kernel here; a step of 44 tokens
/// gives each expert several) on the three families against the Burn reference.
#[test]
fn grouped_experts_chunked_prefill() {
    for dir in [asset("tiny-mixtral"), fixture("qwen2_moe"), fixture("gemma4")] {
        check_prefill(&dir, F32_KV_TOL, ROUTE_CHUNK, GroupedMode::Always, DEFAULT_MAX_STEP_TOKENS);
    }
}

/// Decode steps of 40 sequences in one step (and in steps of 16 tokens, or of 16 rows of
/// logits: the prefill of the 40 prompts then ends 16 of them per step) on the default options,
/// with the grouped GEMM and with the GEMVs: every sequence's logits against the reference.
#[test]
fn decode_steps_of_many_sequences() {
    let prompts: Vec<(u64, Vec<u32>)> =
        (0..40u64).map(|s| (s + 1, vec![(s as u32 * 13 + 1) % 90, (s as u32 * 7 + 3) % 90])).collect();
    let all = DEFAULT_MAX_LOGIT_ROWS;
    for (grouped, steps) in [
        (GroupedMode::Always, (64, all)),
        (GroupedMode::Off, (64, all)),
        (GroupedMode::Auto, (16, all)),
        (GroupedMode::Auto, (64, 16)),
    ] {
        check_prompts(&asset("tiny-mixtral"), F32_KV_TOL, ROUTE_CHUNK, grouped, steps, &prompts);
    }
}

/// Launches of one layer of the fast path, by kind (the RMSNorms are folded into the GEMMs and
/// the experts' gather, so none is a launch): QKV GEMM, RoPE + append, attention, O GEMM,
/// routing (+ statistics) with the gather, gate_up (the experts' activation in its epilogue),
/// down, combine. A small router (Mixtral's, see `router_fusable`) is computed in the routing
/// launch; a larger one adds its GEMM.
const MOE_LAYER_LAUNCHES: usize = 8;
/// A router GEMM of its own (Gemma-4's 128 × 2816 router, too big to recompute per cube).
const ROUTER_GEMM_LAUNCHES: usize = 1;
/// Qwen2-MoE's shared expert beside the routed ones: its gate|up GEMM (with the router's rows
/// after them), the activation act(gate)·up (· its sigmoid gate) in a launch of its own
/// (`FUSED_ACT_MAX_TOKENS` is 0), and the down GEMM.
const MLP_LAUNCHES: usize = 3;
/// A dense layer: the attention's four launches and the MLP.
const DENSE_LAYER_LAUNCHES: usize = 4 + MLP_LAUNCHES;
/// Gemma-4: the MoE layer with its router GEMM and its combine replaced by the FFN epilogue
/// (its head norms ride in the RoPE + append launch), plus the attention output's add-norm and
/// the dense GeGLU branch.
const GEMMA_LAYER_LAUNCHES: usize = MOE_LAYER_LAUNCHES + ROUTER_GEMM_LAUNCHES + 1 + MLP_LAUNCHES;

/// `Decoder::last_launches` of one step of a single sequence, with and without the routing
/// statistics armed, and of a greedy step: the embedding, every layer's launches by kind, the
/// LM head (the final norm folded in), Gemma's soft-cap, and the device argmax.
#[test]
fn launches_per_layer() {
    let client = pw_testkit::wgpu_client();
    for (dir, sparse, dense) in [
        (fixture("mixtral"), MOE_LAYER_LAUNCHES, DENSE_LAYER_LAUNCHES),
        // The router's rows ride in the shared expert's gate|up GEMM.
        (fixture("qwen2_moe"), MOE_LAYER_LAUNCHES + MLP_LAUNCHES, DENSE_LAYER_LAUNCHES),
        (fixture("gemma4"), GEMMA_LAYER_LAUNCHES, 0),
    ] {
        let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(&dir).unwrap()).unwrap();
        let experts = ExpertBlocks::quantize_hf(&Checkpoint::open(&dir).unwrap(), &cfg, 4).unwrap();
        let mut dec = load::<f32>(&client, &dir, &experts, 8, 16, |b| b);
        let layers: usize = cfg.sparse.iter().map(|&s| if s { sparse } else { dense }).sum();
        let want = 1 + layers + 1 + usize::from(cfg.softcap > 0.0);
        dec.add_sequence(1).unwrap();
        dec.step(&[(1, 1)]).unwrap();
        assert_eq!(dec.last_launches(), want, "{}", dir.display());
        dec.route_stats_mut().armed = true;
        dec.step(&[(1, 2)]).unwrap();
        assert!(dec.take_route_stats().unwrap().is_some(), "{}: routing recorded", dir.display());
        assert_eq!(dec.last_launches(), want, "{}: statistics armed", dir.display());
        dec.route_stats_mut().armed = false;
        dec.step_greedy(&[(1, 3)]).unwrap();
        assert_eq!(dec.last_launches(), want + 1, "{}: greedy", dir.display());
        if dir != fixture("mixtral") {
            continue;
        }
        // Two tokens per routed item: the experts' activation is a launch of its own
        // (`GATED_MAX_TOKENS`). Mixtral's router back in a GEMM of its own: one more launch per
        // sparse layer, the same greedy tokens as with the router in the routing launch.
        let sparse_layers = cfg.sparse.iter().filter(|&&s| s).count();
        let mut router_gemm = load::<f32>(&client, &dir, &experts, 8, 16, |b| b.fused_router(false));
        assert!(!router_gemm.fused_router(), "the fused router switched off");
        router_gemm.add_sequence(2).unwrap();
        let ids = router_gemm.step_greedy(&[(2, 1), (2, 2)]).unwrap();
        let router_gemms = sparse_layers * ROUTER_GEMM_LAUNCHES;
        assert_eq!(router_gemm.last_launches(), want + 1 + sparse_layers + router_gemms, "router GEMM");
        assert!(dec.fused_router(), "Mixtral's router fusable");
        dec.add_sequence(3).unwrap();
        assert_eq!(dec.step_greedy(&[(3, 1), (3, 2)]).unwrap(), ids, "same tokens either way");
        assert_eq!(dec.last_launches(), want + 1 + sparse_layers, "fused router");
        // One token: the activation in the gate_up GEMV's epilogue; in a launch of its own one
        // more per sparse layer. The same token each way.
        dec.add_sequence(4).unwrap();
        let one = dec.step_greedy(&[(4, 1)]).unwrap();
        assert_eq!(dec.last_launches(), want + 1, "activation in the epilogue");
        let mut own = load::<f32>(&client, &dir, &experts, 8, 16, |b| b.expert_act(ExpertAct::Launch));
        own.add_sequence(5).unwrap();
        assert_eq!(own.step_greedy(&[(5, 1)]).unwrap(), one, "same token, activation own launch");
        assert_eq!(own.last_launches(), want + 1 + sparse_layers, "activation own launch");
    }
}

/// A Mixtral checkpoint without a router is reported under Mixtral's key name, not under the
/// `mlp.gate` fallback's (issue 32, 7).
#[test]
fn a_missing_mixtral_router_is_named_as_mixtral_names_it() {
    let (_, experts, client) = setup(&fixture("mixtral"));
    let tmp = pw_testkit::fixture_copy("mixtral");
    let path = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let router = "model.layers.0.block_sparse_moe.gate.weight";
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        st.tensors().into_iter().filter(|(n, _)| n != router).collect();
    assert!(kept.len() + 1 == st.len(), "the fixture has {router}");
    safetensors::serialize_to_file(kept, None, &path).unwrap();
    let b = Decoder::<WgpuRuntime, f32>::builder(&client).kv_blocks(16).block_size(4).max_seq_len(64);
    let e = b.load(tmp.path(), experts).err().expect("no router");
    let msg = e.to_string();
    assert!(msg.contains(router) && !msg.contains("mlp.gate"), "{msg}");
}

/// Error budget of the prompt statistics against the reference's residual stream: sums over
/// up to 20 tokens of a stream computed with f32 KV in another summation order, relative to
/// the largest value of each statistic.
const RESIDUAL_STATS_TOL: f32 = 1e-3;

/// The residual statistics of tracked prompts (`track_residual`, steps of 16 tokens: one
/// prompt crosses a step, another shares its steps untracked) against the Burn reference's
/// stream entering every layer (`Trace::hidden`): Σ|h|, Σh², max|h| per channel and the token
/// count, on the three families; untracked and taken sequences give `None`.
#[test]
fn residual_statistics_of_tracked_prompts() {
    for dir in [asset("tiny-mixtral"), fixture("qwen2_moe"), fixture("gemma4")] {
        let (reference, experts, client) = setup(&dir);
        let mut dec = load::<f32>(&client, &dir, &experts, 16, 48, |b| b.max_step_tokens(16));
        let (cfg, prompts) = (dec.config().clone(), three_prompts());
        for (id, _) in &prompts {
            dec.add_sequence(*id).unwrap();
        }
        dec.track_residual(1);
        dec.track_residual(3);
        let refs: Vec<(u64, &[u32])> = prompts.iter().map(|(id, p)| (*id, p.as_slice())).collect();
        dec.prefill(&refs).unwrap();
        for (id, prompt) in [&prompts[0], &prompts[2]] {
            let (got, tokens) = dec.take_residual(*id).unwrap().unwrap();
            assert_eq!(tokens, prompt.len(), "{}: tokens of {id}", dir.display());
            let device = Default::default();
            let mut trace = pw_models::Trace::default();
            reference.forward(ids_tensor::<B>(prompt, &device), &mut reference.new_cache(), Some(&mut trace));
            let h = cfg.hidden;
            for l in 0..cfg.layers {
                let stream: Vec<f32> = trace.hidden[l].clone().into_data().to_vec().unwrap();
                let mut want = vec![0f32; 3 * h];
                for (i, &v) in stream.iter().enumerate() {
                    let c = i % h;
                    want[c] += v.abs();
                    want[h + c] += v * v;
                    want[2 * h + c] = want[2 * h + c].max(v.abs());
                }
                let g = &got[l * 3 * h..][..3 * h];
                for (k, name) in ["sum |h|", "sum h^2", "max |h|"].iter().enumerate() {
                    let (a, b) = (&g[k * h..][..h], &want[k * h..][..h]);
                    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
                    assert!(
                        err <= RESIDUAL_STATS_TOL,
                        "{}: seq {id} layer {l} {name}: {err:e}",
                        dir.display()
                    );
                }
            }
        }
        assert!(dec.take_residual(1).unwrap().is_none(), "taken once");
        assert!(dec.take_residual(2).unwrap().is_none(), "never tracked");
    }
}
