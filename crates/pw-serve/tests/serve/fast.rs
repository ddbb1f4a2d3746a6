//! The engine over the fast decode path (`FastStepModel`, fused CubeCL kernels on wgpu) on the
//! shipped tiny Mixtral and tiny Qwen2-MoE: concurrent requests batched together produce exactly the tokens each
//! sequence produces alone, and their KV blocks come back. (That one sequence matches the Burn
//! model is `pw-decode`'s test.)

use std::path::Path;

use cubecl::wgpu::WgpuRuntime;
use pw_models::{Sampler, SamplingConfig};
use pw_serve::{
    DecodeSlot, Engine, EngineConfig, FastStepModel, GenerateRequest, PrefillSlot, SamplingParams, StepModel,
    UsageRecorder,
};
use pw_testkit::{asset, wgpu_client};

use crate::common;

pub(crate) fn slot<'a>(
    seq: u64,
    start: usize,
    tokens: &'a [u32],
    sample: bool,
    sampler: &'a mut Sampler,
) -> PrefillSlot<'a> {
    PrefillSlot { seq, start, tokens, sample, sampler }
}

pub(crate) fn alone(model: &mut dyn StepModel, seq: u64, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
    let tokens = |o: Vec<pw_serve::SeqOutcome>| o.into_iter().map(Result::unwrap).collect::<Vec<u32>>();
    let first = model.prefill(&mut [slot(seq, 0, prompt, true, &mut s)]).unwrap();
    let mut out = vec![first[0].clone().unwrap().unwrap()];
    while out.len() < n {
        let last = *out.last().unwrap();
        out.extend(tokens(model.decode(&mut [DecodeSlot { seq, last, sampler: &mut s }]).unwrap()));
    }
    model.release(seq);
    out
}

#[test]
fn fast_path_batches_equal_each_sequence_alone() {
    batches_equal_alone(&asset("tiny-mixtral"));
}

#[test]
fn fast_path_qwen2_moe_batches_equal_each_sequence_alone() {
    batches_equal_alone(&asset("tiny-qwen2-moe"));
}

fn batches_equal_alone(dir: &Path) {
    let client = wgpu_client();
    let mut model = FastStepModel::<WgpuRuntime, f32>::load(&client, dir, 6, 1 << 22, 4, 128).unwrap();
    let tok = pw_serve::load_tokenizer(dir).unwrap();
    let prompts: Vec<Vec<u32>> = ["ROMEO.\nBut soft", "And God said, Let there be", "KING."]
        .iter()
        .map(|p| tok.encode(*p, true).unwrap().get_ids().to_vec())
        .collect();
    let lens = [9, 5, 12];
    let want: Vec<Vec<u32>> =
        prompts.iter().zip(lens).enumerate().map(|(i, (p, n))| alone(&mut model, i as u64, p, n)).collect();
    assert_eq!(model.kv_bytes_held(), 0, "released sequences give their blocks back");
    assert!(model.weight_bytes() > 0);

    let config = EngineConfig {
        admission: pw_serve::Admission::Reserve,
        kv_budget_bytes: 1 << 22,
        max_batch: 4,
        max_context: 128,
        max_step_tokens: 2048,
        max_waiting: 4096,
        eos_token_ids: vec![2],
    };
    let rec = UsageRecorder::default();
    let engine =
        Engine::start(Box::new(model), std::sync::Arc::new(tok), config, Box::new(rec.clone())).unwrap();
    let h = engine.handle();
    let streams: Vec<_> = prompts
        .iter()
        .zip(lens)
        .map(|(p, n)| {
            let params =
                SamplingParams { temperature: 0.0, max_tokens: n, ignore_eos: true, ..Default::default() };
            h.submit(GenerateRequest { prompt: p.clone(), params }).unwrap()
        })
        .collect();
    for ((s, w), p) in streams.into_iter().zip(&want).zip(&prompts) {
        assert_eq!(&s.collect_blocking().unwrap().tokens, w, "prompt {p:?}");
    }
    assert!(rec.record().peak_active >= 2, "the requests ran together: {:?}", rec.record());
}

/// A prompt prefilled in chunks over several calls, beside another sequence's chunks, gives
/// the tokens of the whole prompt at once; a chunk that does not continue its sequence's
/// cache fails alone.
#[test]
fn chunked_prefill_equals_the_whole_prompt() {
    let client = wgpu_client();
    let dir = asset("tiny-mixtral");
    let mut model = FastStepModel::<WgpuRuntime, f32>::load(&client, &dir, 6, 1 << 22, 4, 128).unwrap();
    let greedy = || Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
    let prompt: Vec<u32> = (0..37).map(|i| 3 + (i * 7) % 50).collect();
    let other: Vec<u32> = (0..21).map(|i| 4 + (i * 5) % 40).collect();
    let want = alone(&mut model, 9, &prompt, 4);
    let want_other = alone(&mut model, 10, &other, 1);
    let (mut s, mut t) = (greedy(), greedy());
    let mut got = None;
    let mut got_other = None;
    // Chunks of 10 and 7 tokens, the two sequences side by side in each call.
    let (mut a, mut b) = (0, 0);
    while got.is_none() || got_other.is_none() {
        let (na, nb) = ((prompt.len() - a).min(10), (other.len() - b).min(7));
        let mut slots = Vec::new();
        if na > 0 {
            slots.push(slot(1, a, &prompt[a..a + na], a + na == prompt.len(), &mut s));
        }
        if nb > 0 {
            slots.push(slot(2, b, &other[b..b + nb], b + nb == other.len(), &mut t));
        }
        let out = model.prefill(&mut slots).unwrap();
        let mut out = out.into_iter();
        if na > 0 {
            a += na;
            if let Some(tok) = out.next().unwrap().unwrap() {
                got = Some(tok);
            }
        }
        if nb > 0 {
            b += nb;
            if let Some(tok) = out.next().unwrap().unwrap() {
                got_other = Some(tok);
            }
        }
    }
    assert_eq!(got_other, Some(want_other[0]));
    let mut out = vec![got.unwrap()];
    while out.len() < want.len() {
        let last = *out.last().unwrap();
        let o = model.decode(&mut [DecodeSlot { seq: 1, last, sampler: &mut s }]).unwrap();
        out.push(o[0].clone().unwrap());
    }
    assert_eq!(out, want);
    // A chunk that skips tokens of its sequence fails alone.
    let o = model.prefill(&mut [slot(1, 5, &prompt[..3], true, &mut s)]).unwrap();
    let msg = o[0].clone().expect_err("skipped tokens").to_string();
    assert!(msg.contains("sequence 1"), "{msg}");
    model.release(1);
    model.release(2);
    assert_eq!(model.kv_bytes_held(), 0);
}

/// Issue 32, 2: a context of 10^12 tokens (config.json or --max-context) is refused at load,
/// naming the context and the bytes, before any cache is allocated.
#[test]
fn an_absurd_context_is_refused_at_load() {
    let client = wgpu_client();
    let dir = asset("tiny-mixtral");
    let huge = 1_000_000_000_000;
    // A KV budget too small for one sequence at that context.
    let e =
        FastStepModel::<WgpuRuntime, f32>::load(&client, &dir, 6, 1 << 22, 4, huge).err().expect("refused");
    let msg = e.to_string();
    assert!(msg.contains("1000000000000") && msg.contains("--max-context") && msg.contains("bytes"), "{msg}");
    // The server's default budget (every batch slot at the full context) asks for pools larger
    // than any device buffer.
    let kv = pw_serve::KvLayout::from_config(&pw_hf::ModelConfig::from_dir(&dir).unwrap(), 4);
    let budget = kv.bytes_for(huge).saturating_mul(4);
    let e =
        FastStepModel::<WgpuRuntime, f32>::load(&client, &dir, 6, budget, 4, huge).err().expect("refused");
    let msg = e.to_string();
    assert!(msg.contains("largest") && msg.contains("--max-context"), "{msg}");
}

/// Issue 32, 1: a sequence that reaches its table's end fails alone; the sequence decoding
/// beside it in the same step goes on.
#[test]
fn a_sequence_at_the_context_end_fails_alone() {
    let client = wgpu_client();
    let dir = asset("tiny-mixtral");
    let mut model = FastStepModel::<WgpuRuntime, f32>::load(&client, &dir, 6, 1 << 22, 4, 32).unwrap();
    let mut s = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
    let mut t = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
    let full: Vec<u32> = (0..32).map(|i| 3 + i % 50).collect();
    let short = [3u32, 4, 5];
    let first =
        model.prefill(&mut [slot(1, 0, &full, true, &mut s), slot(2, 0, &short, true, &mut t)]).unwrap();
    let (a, b) = (first[0].clone().unwrap().unwrap(), first[1].clone().unwrap().unwrap());
    let out = model
        .decode(&mut [
            DecodeSlot { seq: 1, last: a, sampler: &mut s },
            DecodeSlot { seq: 2, last: b, sampler: &mut t },
        ])
        .unwrap();
    let msg = out[0].as_ref().expect_err("the full sequence cannot grow").to_string();
    assert!(msg.contains("sequence 1") && msg.contains("32"), "{msg}");
    assert!(out[1].is_ok(), "{:?}", out[1]);
    // A prompt longer than the table fails alone at prefill too.
    let long: Vec<u32> = vec![5; 40];
    let out = model.prefill(&mut [slot(3, 0, &long, true, &mut s)]).unwrap();
    assert!(out[0].is_err());
    model.release(1);
    model.release(2);
    model.release(3);
    assert_eq!(model.kv_bytes_held(), 0);
}

/// 32 greedy requests: prompts of 3..42 tokens below `vocab`, and their output lengths (4..12).
pub(crate) fn mixed_requests(vocab: u32) -> Vec<(Vec<u32>, usize)> {
    (0..32u32)
        .map(|i| {
            let len = 3 + (i * 37 % 40) as usize;
            let prompt = (0..len as u32).map(|j| 3 + (i * 131 + j * 17) % (vocab - 3)).collect();
            (prompt, 4 + (i % 9) as usize)
        })
        .collect()
}

/// Preempt admission under `kv_budget_bytes`, 16 sequences and 32 tokens per step, context 128.
pub(crate) fn pressure_config(kv_budget_bytes: u64) -> EngineConfig {
    EngineConfig {
        admission: pw_serve::Admission::Preempt,
        kv_budget_bytes,
        max_batch: 16,
        max_context: 128,
        max_step_tokens: 32,
        max_waiting: 4096,
        eos_token_ids: vec![],
    }
}

/// Submits `requests` (greedy, `ignore_eos`) and returns their streams in order.
pub(crate) fn submit_all(
    h: &pw_serve::EngineHandle,
    requests: &[(Vec<u32>, usize)],
) -> Vec<pw_serve::RequestStream> {
    requests
        .iter()
        .map(|(p, n)| {
            let params =
                SamplingParams { temperature: 0.0, max_tokens: *n, ignore_eos: true, ..Default::default() };
            h.submit(GenerateRequest { prompt: p.clone(), params }).unwrap()
        })
        .collect()
}

/// Issue 28: 32 concurrent requests of mixed prompt lengths through the fast path with KV room
/// for about three of them and a step budget of 32 tokens, so prompts are chunked and running
/// sequences are preempted and resumed: every request completes with the tokens it generates
/// alone, and the cache and the reservations are empty afterwards.
fn thirty_two_requests_under_kv_pressure(dir: &Path) {
    let client = wgpu_client();
    // The cache holds every request; the engine's KV budget (admission) about four.
    let mut model = FastStepModel::<WgpuRuntime, f32>::load(&client, dir, 6, 1 << 20, 16, 128).unwrap();
    let budget = 3 * model.kv_layout().bytes_for(48);
    let requests = mixed_requests(model.vocab_size() as u32);
    let want: Vec<Vec<u32>> =
        requests.iter().enumerate().map(|(i, (p, n))| alone(&mut model, 1000 + i as u64, p, *n)).collect();
    let tok = pw_serve::load_tokenizer(dir).unwrap();
    let rec = UsageRecorder::default();
    let engine = Engine::start(
        Box::new(model),
        std::sync::Arc::new(tok),
        pressure_config(budget),
        Box::new(rec.clone()),
    )
    .unwrap();
    let h = engine.handle();
    for (i, (s, w)) in submit_all(&h, &requests).into_iter().zip(&want).enumerate() {
        assert_eq!(&s.collect_blocking().unwrap().tokens, w, "request {i}");
    }
    let m = common::wait_metrics(&h, |m| m.active_sequences == 0 && m.requests_finished_total == 32);
    assert_eq!((m.requests_failed_total, m.queue_length), (0, 0), "{m:?}");
    assert!(m.requests_preempted_total > 0, "the budget forced preemption: {m:?}");
    assert_eq!((m.kv_bytes_used, m.kv_bytes_reserved), (0, 0), "{m:?}");
    let r = rec.record();
    assert!(r.peak_active >= 4 && r.peak_kv_bytes_reserved <= budget, "{r:?}");
}

#[test]
fn thirty_two_mixtral_requests_under_kv_pressure_match_alone() {
    thirty_two_requests_under_kv_pressure(&asset("tiny-mixtral"));
}

#[test]
fn thirty_two_qwen2_moe_requests_under_kv_pressure_match_alone() {
    thirty_two_requests_under_kv_pressure(&asset("tiny-qwen2-moe"));
}

#[test]
fn thirty_two_gemma4_requests_under_kv_pressure_match_alone() {
    let dir = pw_testkit::fixture_copy("gemma4");
    let vocab = pw_hf::ModelConfig::from_dir(dir.path()).unwrap().vocab_size();
    pw_testkit::write_word_tokenizer(dir.path(), vocab);
    thirty_two_requests_under_kv_pressure(dir.path());
}

/// Issue 28: the same 32 requests with the experts and the KV cache under one budget that holds
/// 8-bit experts beside 16 KV blocks (the requests need more): the planner lowers pages while
/// they run, every request completes with all its tokens, none fails, and the cache is empty
/// afterwards.
fn thirty_two_requests_under_a_planned_budget(dir: &Path) {
    use pw_serve::{FastOptions, MemoryOptions, WeightPolicy};
    let client = wgpu_client();
    let probe = FastStepModel::<WgpuRuntime, half::f16>::load(&client, dir, 8, 1 << 18, 1, 128).unwrap();
    let (experts8, block) = (probe.decoder().expert_bytes() as u64, probe.decoder().kv_block_bytes() as u64);
    let pages8 = probe.decoder().experts().pages();
    drop(probe);
    let memory = MemoryOptions {
        budget_bytes: Some(experts8 + 16 * block),
        policy: WeightPolicy::Planner,
        threshold_blocks: 4,
        give_back_blocks: 8,
        ..Default::default()
    };
    let options = FastOptions {
        bits: 8,
        kv_budget_bytes: 0,
        max_batch: 16,
        max_context: 128,
        memory,
        residual_head: false,
        max_step_tokens: pw_decode::DEFAULT_MAX_STEP_TOKENS,
    };
    let model = FastStepModel::<WgpuRuntime, half::f16>::load_with(&client, dir, &options).unwrap();
    let requests = mixed_requests(model.vocab_size() as u32);
    let config = pressure_config(model.kv_capacity_bytes());
    let tok = pw_serve::load_tokenizer(dir).unwrap();
    let engine =
        Engine::start(Box::new(model), std::sync::Arc::new(tok), config, Box::new(UsageRecorder::default()))
            .unwrap();
    let h = engine.handle();
    let streams = submit_all(&h, &requests);
    // Issue 30: the page table while the planner works shows a lowering as it is.
    let lowered = loop {
        let v = h.blocking_page_table().unwrap().expect("the fast path has a page table");
        if v.pages.iter().any(|p| p.committed_bits < 8) {
            break v;
        }
        assert!(h.metrics().snapshot().requests_finished_total < 32, "no lowered page seen while serving");
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    check_page_table(&lowered, &pages8);
    let d = lowered.last_decision.as_ref().expect("a planner decision");
    assert!(d.target == "free" && d.pages_changed > 0 && d.bytes_after < d.bytes_before, "{d:?}");
    for (i, (s, (_, n))) in streams.into_iter().zip(&requests).enumerate() {
        assert_eq!(s.collect_blocking().unwrap().tokens.len(), *n, "request {i}");
    }
    common::all_served_after_lowering(&h, 32);
    // Idle: the view agrees with the metrics' memory state once both have settled.
    let idle = loop {
        let v = h.blocking_page_table().unwrap().unwrap();
        let m = h.metrics().snapshot().memory.unwrap();
        if m.settled && v.expert_bytes == m.weight_bytes() {
            break v;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    check_page_table(&idle, &pages8);
    assert_eq!((idle.kv_blocks_used, idle.policy), (0, "planner"));
}

/// A page-table view against the page table's own facts: one entry per (sparse layer, expert,
/// kind) in the decoder's order, each page's bytes those of its committed bits, lowerings
/// committed at once (desired = committed unless a raising is in flight), and the totals.
fn check_page_table(v: &pw_serve::PageTableView, pages: &[pw_decode::ExpertPage]) {
    assert_eq!(v.pages.len(), pages.len());
    for (got, want) in v.pages.iter().zip(pages) {
        let kind = if want.kind == pw_format::BlockKind::GateUp { "gate_up" } else { "down" };
        assert_eq!((got.layer, got.expert, got.kind), (want.layer, want.expert, kind));
        let bits = got.committed_bits;
        assert!((want.min_bits..=want.max_bits).contains(&bits), "{got:?}");
        assert_eq!(got.bytes, want.bytes[(bits - want.min_bits) as usize], "{got:?}");
        match got.location {
            pw_serve::PageLocation::InTransfer => assert!(got.desired_bits > bits, "{got:?}"),
            pw_serve::PageLocation::Gpu => assert!(got.desired_bits >= bits, "{got:?}"),
            pw_serve::PageLocation::Host => panic!("a resident page shown on the host: {got:?}"),
        }
        let share = got.routing_share.expect("the planner's routing share");
        assert!((0.0..=1.0).contains(&share), "{got:?}");
        assert!(got.damage.is_some_and(f64::is_finite), "{got:?}");
    }
    let total: u64 = v.pages.iter().map(|p| p.bytes).sum();
    assert_eq!(total, v.expert_bytes);
    let mean = v.pages.iter().map(|p| p.committed_bits as f64 * p.bytes as f64).sum::<f64>() / total as f64;
    assert!((mean - v.mean_bits).abs() < 1e-9, "{mean} vs {}", v.mean_bits);
}

#[test]
fn thirty_two_mixtral_requests_under_a_planned_budget_all_complete() {
    thirty_two_requests_under_a_planned_budget(&asset("tiny-mixtral"));
}

#[test]
fn thirty_two_qwen2_moe_requests_under_a_planned_budget_all_complete() {
    thirty_two_requests_under_a_planned_budget(&asset("tiny-qwen2-moe"));
}

/// Issue 29: a PagedWeight checkpoint's calibration routing reaches the served planner (its
/// routing multiplier is relative to it) and shows in the page table; a Hugging Face directory
/// has none.
#[test]
fn the_checkpoints_calibration_routing_reaches_the_planner() {
    use pw_format::{CheckpointWriter, LayerRouting};
    use pw_serve::{FastOptions, MemoryOptions, WeightPolicy};
    let dir = asset("tiny-mixtral");
    let hf = pw_hf::Checkpoint::open(&dir).unwrap();
    let cfg = pw_decode::DecodeConfig::from_model(&pw_hf::ModelConfig::from_dir(&dir).unwrap()).unwrap();
    let experts = pw_decode::ExpertBlocks::quantize_hf(&hf, &cfg, 8).unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut w = CheckpointWriter::create(out.path()).unwrap();
    experts.write_checkpoint(&hf, &cfg, &mut w).unwrap();
    w.copy_file(&dir.join("config.json")).unwrap();
    // Planted: expert e of layer l had share (1 + l + e) / mean.
    let planted = |l: usize, e: usize| (1 + l + e) as f64;
    let routing: Vec<LayerRouting> = (0..cfg.layers)
        .filter(|&l| cfg.sparse[l])
        .map(|l| {
            let raw: Vec<f64> = (0..cfg.experts).map(|e| planted(l, e)).collect();
            let mean = raw.iter().sum::<f64>() / cfg.experts as f64;
            LayerRouting { layer: l, mass_share: raw.iter().map(|r| r / mean).collect() }
        })
        .collect();
    w.set_routing(routing.clone());
    w.finish().unwrap();

    let client = wgpu_client();
    let memory = MemoryOptions {
        budget_bytes: Some(experts.blocks.len() as u64 * (1 << 24)),
        policy: WeightPolicy::Planner,
        ..Default::default()
    };
    let options = FastOptions {
        bits: 8,
        kv_budget_bytes: 0,
        max_batch: 4,
        max_context: 64,
        memory,
        residual_head: false,
        max_step_tokens: pw_decode::DEFAULT_MAX_STEP_TOKENS,
    };
    let view = |d: &Path| {
        let m = FastStepModel::<WgpuRuntime, half::f16>::load_with(&client, d, &options).unwrap();
        m.page_table().unwrap().expect("the fast path has a page table")
    };
    let v = view(out.path());
    assert!(!v.pages.is_empty());
    for p in &v.pages {
        let want =
            routing.iter().find(|r| r.layer == p.layer).unwrap().mass_share[p.expert] / cfg.experts as f64;
        let got = p.calibration_share.expect("every page has its calibration share");
        assert!((got - want).abs() < 1e-12, "layer {} expert {}: {got} vs {want}", p.layer, p.expert);
    }
    assert!(view(&dir).pages.iter().all(|p| p.calibration_share.is_none()), "no routing in an HF directory");
}

/// Issue 29: a residual head beside the checkpoint whose only weight reads layer 0's `ln rms(h)`
/// feature into layer 0's gate_up factor. Each prompt goes through the head once, after its
/// prefill; while the request runs the planner's damage of layer 0's gate_up pages is the
/// head-less damage times `exp(M · tanh(x / M))` and every other page's is unchanged; two prompts
/// with different statistics give different factors; the factors leave with the request, and
/// with `residual_head: false` the head is not read (the head-less damage).
#[test]
fn the_residual_head_weighs_each_running_prompt_into_the_damage() {
    use burn::module::Param;
    use burn::tensor::{Tensor, TensorData};
    use pw_planner::{PlannerConfig, ResidualHeadConfig};
    use pw_serve::{FastOptions, MemoryOptions, WeightPolicy};
    type Cpu = burn_ndarray::NdArray<f32>;

    let dir = pw_testkit::fixture_copy("mixtral");
    let client = wgpu_client();
    let probe = FastStepModel::<WgpuRuntime, f32>::load(&client, dir.path(), 4, 1 << 18, 1, 64).unwrap();
    let (experts4, block) = (probe.decoder().expert_bytes() as u64, probe.decoder().kv_block_bytes() as u64);
    let (layers, vocab) = (probe.decoder().config().layers, probe.vocab_size() as u32);
    drop(probe);
    let cfg = ResidualHeadConfig::new(layers);
    let mut head = cfg.init::<Cpu>(&Default::default());
    let mut w = vec![0f32; cfg.n_features() * cfg.n_outputs()];
    // Feature 1 of layer 0 (ln rms) into output 0 (layer 0, gate_up); Burn's weight is [in, out].
    w[cfg.n_outputs()] = 1.0;
    let w = Tensor::<Cpu, 2>::from_data(
        TensorData::new(w, [cfg.n_features(), cfg.n_outputs()]),
        &Default::default(),
    );
    head.linear.weight = Param::from_tensor(w);
    head.save(dir.path()).unwrap();

    // No pressure and no give-back (the pages keep their bits), and no routing multiplier (the
    // prompts' routing would change every page's damage): only the residual factors move it.
    let memory = MemoryOptions {
        budget_bytes: Some(experts4 + 16 * block),
        policy: WeightPolicy::Planner,
        threshold_blocks: 0,
        give_back_blocks: 1 << 20,
        planner: PlannerConfig { use_routing: false, ..Default::default() },
        ..Default::default()
    };
    let load = |residual_head| {
        let o = FastOptions {
            bits: 4,
            kv_budget_bytes: 0,
            max_batch: 4,
            max_context: 64,
            memory: memory.clone(),
            residual_head,
            max_step_tokens: pw_decode::DEFAULT_MAX_STEP_TOKENS,
        };
        FastStepModel::<WgpuRuntime, f32>::load_with(&client, dir.path(), &o).unwrap()
    };
    // Each page's (layer, kind, damage) at a boundary, after prefilling `prompt` as sequence 1.
    let damage = |m: &mut FastStepModel<WgpuRuntime, f32>, prompt: Option<&[u32]>| {
        if let Some(p) = prompt {
            let mut s = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
            m.prefill(&mut [slot(1, 0, p, true, &mut s)]).unwrap()[0].clone().unwrap();
        }
        m.boundary(pw_serve::KvDemand::default()).unwrap();
        let v = m.page_table().unwrap().expect("the fast path has a page table");
        v.pages.iter().map(|p| (p.layer, p.kind, p.damage.expect("planner damage"))).collect::<Vec<_>>()
    };
    let prompts: [Vec<u32>; 2] = [(0..9).map(|i| (i * 5 + 1) % vocab).collect(), vec![3, 3, 3, vocab - 1]];
    let mut plain = load(false);
    let base = damage(&mut plain, None);
    assert!(base.iter().any(|d| d.2 > 0.0), "some page is below its parent's bits: {base:?}");
    let mut model = load(true);
    let mut factors = vec![];
    for (n, p) in prompts.iter().enumerate() {
        let with = damage(&mut model, Some(p));
        assert_eq!(model.residual_head_calls(), n as u64 + 1, "one head call per prompt");
        let mut factor = None;
        for (a, b) in with.iter().zip(&base) {
            assert_eq!((a.0, a.1), (b.0, b.1));
            if b.2 == 0.0 {
                continue;
            }
            let r = a.2 / b.2;
            if (a.0, a.1) == (0, "gate_up") {
                assert!(factor.is_none_or(|f: f64| (f - r).abs() < 1e-9 * f), "one factor per (layer, kind)");
                factor = Some(r);
            } else {
                assert!((r - 1.0).abs() < 1e-9, "layer {} {}: {r}", a.0, a.1);
            }
        }
        let f = factor.expect("a damaged layer-0 gate_up page");
        assert!((f - 1.0).abs() > 1e-3, "prompt {n}: factor {f}");
        factors.push(f);
        model.release(1);
        assert_eq!(damage(&mut model, None), base, "the factors leave with the request");
    }
    assert!((factors[0] - factors[1]).abs() > 1e-3 * factors[0], "{factors:?}");
}
