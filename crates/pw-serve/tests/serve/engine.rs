//! The scheduler on the tiny Mixtral: batching keeps sequences apart, admission respects the
//! KV budget, cancellation frees KV, sampling is reproducible.

use crate::common;

use std::time::{Duration, Instant};

use pw_serve::{Event, FinishReason, GenerateRequest, SamplingParams, ServeError};

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens, ..Default::default() }
}

#[test]
fn concurrent_greedy_requests_match_generate() {
    let model = common::load_model();
    let (engine, rec) = common::engine(common::config(u64::MAX, 8), None);
    let h = engine.handle();
    let prompts: Vec<Vec<u32>> =
        [3, 9, 17, 30, 5].iter().enumerate().map(|(i, &n)| common::prompt(n, i as u32)).collect();
    let lens = [12, 7, 20, 3, 15];
    let streams: Vec<_> = prompts
        .iter()
        .zip(lens)
        .map(|(p, n)| h.submit(GenerateRequest { prompt: p.clone(), params: greedy(n) }).unwrap())
        .collect();
    for ((s, p), n) in streams.into_iter().zip(&prompts).zip(lens) {
        let c = s.collect_blocking().unwrap();
        let want = common::reference(&model, p, n, true);
        assert_eq!(c.tokens, want, "prompt of {} tokens", p.len());
        let reason = if want.last() == Some(&2) { FinishReason::Stop } else { FinishReason::Length };
        assert_eq!(c.reason, reason);
        assert_eq!((c.usage.prompt_tokens, c.usage.completion_tokens), (p.len(), want.len()));
    }
    // The sequences really ran together.
    assert!(rec.record().peak_active >= 3, "{:?}", rec.record());
    let m = common::wait_metrics(&h, |m| m.requests_finished_total == 5 && m.active_sequences == 0);
    assert_eq!(m.requests_total, 5);
    assert_eq!((m.active_sequences, m.kv_bytes_used, m.kv_bytes_reserved), (0, 0, 0));
    assert!(m.weight_bytes > 0);
}

#[test]
fn a_small_kv_budget_queues_requests() {
    let model = common::load_model();
    let kv = common::kv_layout();
    let (plen, max) = (10, 8);
    // Room for one request's prompt + max_tokens, not two.
    let budget = kv.bytes_for(plen + max) * 3 / 2;
    let (engine, rec) = common::engine(common::config(budget, 8), None);
    let h = engine.handle();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| common::prompt(plen, 10 + i)).collect();
    let params = SamplingParams { ignore_eos: true, ..greedy(max) };
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| h.submit(GenerateRequest { prompt: p.clone(), params: params.clone() }).unwrap())
        .collect();
    for (s, p) in streams.into_iter().zip(&prompts) {
        let c = s.collect_blocking().unwrap();
        assert_eq!(c.tokens, common::reference(&model, p, max, false));
    }
    let r = rec.record();
    assert_eq!(r.peak_active, 1, "{r:?}");
    assert!(r.peak_waiting >= 1, "{r:?}");
    assert!(r.peak_kv_bytes_reserved <= budget && r.peak_kv_bytes_used <= budget, "{r:?}");
    // The most KV one sequence holds at a boundary: the step that makes its last token also
    // frees it, so the peak is after the one before (prompt + all but the last two tokens).
    assert_eq!(r.peak_kv_bytes_used, kv.bytes_for(plen + max - 2));

    // A request that could never fit is refused at once, naming the budget.
    let e = h.submit(GenerateRequest { prompt: common::prompt(plen, 0), params: greedy(100) }).unwrap_err();
    assert!(matches!(e, ServeError::InvalidRequest { param: Some("max_tokens"), .. }), "{e}");
    assert!(e.to_string().contains(&budget.to_string()), "{e}");
}

/// Preemptive admission on the budget of the test above: two sequences start at once, the
/// cache runs out as they grow, the later one is preempted and resumed by recomputation, and
/// every stream still yields exactly the reference tokens (greedy and seeded sampling).
#[test]
fn preemption_resumes_sequences_with_their_tokens_unchanged() {
    let model = common::load_model();
    let kv = common::kv_layout();
    let (plen, max) = (10, 8);
    let budget = kv.bytes_for(plen + max) * 3 / 2;
    let cfg = pw_serve::EngineConfig { admission: pw_serve::Admission::Preempt, ..common::config(budget, 8) };
    let (engine, rec) = common::engine(cfg, None);
    let h = engine.handle();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| common::prompt(plen, 10 + i)).collect();
    let params = SamplingParams { ignore_eos: true, ..greedy(max) };
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| h.submit(GenerateRequest { prompt: p.clone(), params: params.clone() }).unwrap())
        .collect();
    for (s, p) in streams.into_iter().zip(&prompts) {
        let c = s.collect_blocking().unwrap();
        assert_eq!(c.tokens, common::reference(&model, p, max, false));
        assert_eq!(c.usage.completion_tokens, max);
        assert_eq!(c.usage.prompt_tokens, plen);
    }
    let m = common::wait_metrics(&h, |m| m.requests_finished_total == 4);
    let r = rec.record();
    assert!(r.peak_active >= 2, "admission reserved more than the sequences held: {r:?}");
    assert!(m.requests_preempted_total >= 1, "the cache never ran out: {m:?}");
    assert!(r.peak_kv_bytes_used <= budget && r.peak_kv_bytes_reserved <= budget, "{r:?}");
    assert_eq!(m.prompt_tokens_total, 4 * plen as u64, "recomputation is not prompt traffic");

    // Seeded sampling survives a preemption: the same request alone (no pressure) and among
    // others under the same tight budget give the same tokens.
    let sampled = SamplingParams { temperature: 0.9, seed: Some(5), ignore_eos: true, ..greedy(max) };
    let alone = {
        let (e, _) = common::engine(common::config(u64::MAX, 8), None);
        let s = e.handle().submit(GenerateRequest { prompt: prompts[3].clone(), params: sampled.clone() });
        s.unwrap().collect_blocking().unwrap().tokens
    };
    let before = m.requests_preempted_total;
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| h.submit(GenerateRequest { prompt: p.clone(), params: sampled.clone() }).unwrap())
        .collect();
    let last = streams.into_iter().map(|s| s.collect_blocking().unwrap().tokens).last().unwrap();
    assert_eq!(last, alone);
    let m = common::wait_metrics(&h, |m| m.requests_finished_total == 8);
    assert!(m.requests_preempted_total > before, "{m:?}");
}

#[test]
fn dropping_the_stream_frees_the_sequence_and_its_kv() {
    let (engine, _) = common::engine(common::config(u64::MAX, 4), Some(Duration::from_millis(10)));
    let h = engine.handle();
    let params = SamplingParams { ignore_eos: true, ..greedy(200) };
    let mut s = h.submit(GenerateRequest { prompt: common::prompt(8, 1), params }).unwrap();
    for _ in 0..3 {
        assert!(matches!(s.blocking_next(), Some(Event::Token { .. })));
    }
    let m = h.metrics().snapshot();
    assert_eq!(m.active_sequences, 1);
    assert!(m.kv_bytes_used > 0 && m.kv_bytes_reserved > 0, "{m:?}");
    drop(s);
    let t0 = Instant::now();
    loop {
        let m = h.metrics().snapshot();
        if m.requests_cancelled_total == 1 {
            assert_eq!((m.active_sequences, m.kv_bytes_used, m.kv_bytes_reserved), (0, 0, 0), "{m:?}");
            // Cancelled long before its 200 tokens (≥ 2 s at 10 ms per step).
            assert!(m.generated_tokens_total < 100, "{m:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "not cancelled: {m:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_stop_tokens_end_the_sequence() {
    let (engine, _) = common::engine(common::config(u64::MAX, 4), None);
    let h = engine.handle();
    let run = |seed, stop_token_ids: Vec<u32>| {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
            seed: Some(seed),
            ignore_eos: true,
            stop_token_ids,
            ..greedy(24)
        };
        h.submit(GenerateRequest { prompt: common::prompt(6, 3), params })
            .unwrap()
            .collect_blocking()
            .unwrap()
    };
    let (a, b, c) = (run(7, vec![]), run(7, vec![]), run(8, vec![]));
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.text, b.text);
    assert_ne!(a.tokens, c.tokens);
    // Stopping at a token the seed-7 stream produces cuts it right after that token.
    let at = a.tokens[5];
    let cut = run(7, vec![at]);
    let first = a.tokens.iter().position(|&t| t == at).unwrap();
    assert_eq!(cut.tokens, a.tokens[..=first]);
    assert_eq!(cut.reason, FinishReason::Stop);
}

#[test]
fn bad_requests_are_refused_with_the_field() {
    let (engine, _) = common::engine(common::config(u64::MAX, 4), None);
    let h = engine.handle();
    let cases: Vec<(Vec<u32>, SamplingParams, &str)> = vec![
        (vec![], greedy(4), "prompt"),
        (vec![3, 96], greedy(4), "prompt"),
        (vec![3], greedy(0), "max_tokens"),
        (common::prompt(250, 0), greedy(10), "max_tokens"),
        (vec![3], SamplingParams { temperature: f32::NAN, ..greedy(4) }, "temperature"),
        (vec![3], SamplingParams { top_p: 0.0, ..greedy(4) }, "top_p"),
        (vec![3], SamplingParams { stop_token_ids: vec![1000], ..greedy(4) }, "stop_token_ids"),
    ];
    for (prompt, params, field) in cases {
        match h.submit(GenerateRequest { prompt, params }) {
            Err(ServeError::InvalidRequest { param: Some(p), .. }) => assert_eq!(p, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    // Still serving.
    let c = h
        .submit(GenerateRequest { prompt: vec![3, 4], params: greedy(2) })
        .unwrap()
        .collect_blocking()
        .unwrap();
    assert!(!c.tokens.is_empty());
}

/// Fails every decode while `fail` is set.
struct Flaky {
    inner: Box<dyn pw_serve::StepModel>,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl pw_serve::StepModel for Flaky {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn kv_layout(&self) -> &pw_serve::KvLayout {
        self.inner.kv_layout()
    }
    fn weight_bytes(&self) -> u64 {
        self.inner.weight_bytes()
    }
    fn prefill(
        &mut self,
        batch: &mut [pw_serve::PrefillSlot<'_>],
    ) -> Result<Vec<pw_serve::PrefillOutcome>, pw_serve::StepError> {
        self.inner.prefill(batch)
    }
    fn decode(
        &mut self,
        batch: &mut [pw_serve::DecodeSlot<'_>],
    ) -> Result<Vec<pw_serve::SeqOutcome>, pw_serve::StepError> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("device lost");
        }
        self.inner.decode(batch)
    }
    fn release(&mut self, seq: pw_serve::SeqId) {
        self.inner.release(seq)
    }
    fn kv_bytes_held(&self) -> u64 {
        self.inner.kv_bytes_held()
    }
}

#[test]
fn a_failing_step_ends_its_sequences_and_the_engine_keeps_serving() {
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let inner = Box::new(
        pw_serve::BurnStepModel::<common::B, _>::load(&common::fixture(), &Default::default()).unwrap(),
    );
    let engine = pw_serve::Engine::start(
        Box::new(Flaky { inner, fail: fail.clone() }),
        std::sync::Arc::new(common::tokenizer()),
        common::config(u64::MAX, 4),
        Box::new(pw_serve::UsageRecorder::default()),
    )
    .unwrap();
    let h = engine.handle();
    let params = SamplingParams { ignore_eos: true, ..greedy(5) };
    let e = h
        .submit(GenerateRequest { prompt: vec![3, 4, 5], params: params.clone() })
        .unwrap()
        .collect_blocking();
    match e {
        Err(ServeError::Step(msg)) => assert!(msg.contains("device lost"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let m = common::wait_metrics(&h, |m| m.requests_failed_total == 1 && m.steps_total >= 2);
    assert_eq!((m.active_sequences, m.kv_bytes_used, m.kv_bytes_reserved), (0, 0, 0), "{m:?}");
    fail.store(false, std::sync::atomic::Ordering::SeqCst);
    let c = h.submit(GenerateRequest { prompt: vec![3, 4, 5], params }).unwrap().collect_blocking().unwrap();
    assert_eq!(c.tokens, common::reference(&common::load_model(), &[3, 4, 5], 5, false));
}

/// Wraps a model: one sequence's decodes fail in its own slot, and decodes of more than
/// `room` sequences answer out-of-memory before running anything; with `grow_to`, the
/// boundary after an out-of-memory step makes room for that many (as a planner lowering pages
/// does) and reports it as free KV blocks.
struct Picky {
    inner: Box<dyn pw_serve::StepModel>,
    bad_seq: Option<pw_serve::SeqId>,
    room: usize,
    ooms: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    grow_to: Option<usize>,
    widest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl pw_serve::StepModel for Picky {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn kv_layout(&self) -> &pw_serve::KvLayout {
        self.inner.kv_layout()
    }
    fn weight_bytes(&self) -> u64 {
        self.inner.weight_bytes()
    }
    fn prefill(
        &mut self,
        batch: &mut [pw_serve::PrefillSlot<'_>],
    ) -> Result<Vec<pw_serve::PrefillOutcome>, pw_serve::StepError> {
        self.inner.prefill(batch)
    }
    fn decode(
        &mut self,
        batch: &mut [pw_serve::DecodeSlot<'_>],
    ) -> Result<Vec<pw_serve::SeqOutcome>, pw_serve::StepError> {
        if batch.len() > self.room {
            self.ooms.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return Err(pw_serve::StepError::OutOfMemory(format!("room for {} sequences", self.room)));
        }
        self.widest.fetch_max(batch.len(), std::sync::atomic::Ordering::SeqCst);
        let seqs: Vec<pw_serve::SeqId> = batch.iter().map(|s| s.seq).collect();
        let mut out = self.inner.decode(batch)?;
        for (o, s) in out.iter_mut().zip(seqs) {
            if Some(s) == self.bad_seq {
                *o = Err(pw_serve::StepError::failed(format!("sequence {s}: poisoned")));
            }
        }
        Ok(out)
    }
    fn release(&mut self, seq: pw_serve::SeqId) {
        self.inner.release(seq)
    }
    fn kv_bytes_held(&self) -> u64 {
        self.inner.kv_bytes_held()
    }
    fn boundary(
        &mut self,
        _demand: pw_serve::KvDemand,
    ) -> Result<Option<pw_serve::MemoryState>, pw_serve::StepError> {
        let Some(n) = self.grow_to else { return Ok(None) };
        if self.ooms.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.room = self.room.max(n);
        }
        let free = self.room.min(1 << 20) as u64;
        Ok(Some(pw_serve::MemoryState {
            kv_blocks_free: free,
            block_bytes: 1,
            settled: true,
            ..Default::default()
        }))
    }
}

fn picky_engine(
    bad_seq: Option<u64>,
    room: usize,
    cfg: pw_serve::EngineConfig,
) -> (pw_serve::Engine, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    picky_growing(bad_seq, room, None, cfg).0
}

type Counter = std::sync::Arc<std::sync::atomic::AtomicUsize>;

/// A [`Picky`] engine; returns it with its out-of-memory count and its widest decode.
fn picky_growing(
    bad_seq: Option<u64>,
    room: usize,
    grow_to: Option<usize>,
    cfg: pw_serve::EngineConfig,
) -> ((pw_serve::Engine, Counter), Counter) {
    let inner = Box::new(
        pw_serve::BurnStepModel::<common::B, _>::load(&common::fixture(), &Default::default()).unwrap(),
    );
    let ooms = Counter::default();
    let widest = Counter::default();
    let engine = pw_serve::Engine::start(
        Box::new(Picky { inner, bad_seq, room, ooms: ooms.clone(), grow_to, widest: widest.clone() }),
        std::sync::Arc::new(common::tokenizer()),
        cfg,
        Box::new(pw_serve::UsageRecorder::default()),
    )
    .unwrap();
    ((engine, ooms), widest)
}

/// Once the model's boundary reports more free KV blocks than when it ran out (its planner
/// lowered pages), the engine admits again without waiting for a sequence to end.
#[test]
fn room_made_after_an_out_of_memory_step_is_used_at_once() {
    let cfg =
        pw_serve::EngineConfig { admission: pw_serve::Admission::Preempt, ..common::config(u64::MAX, 8) };
    let ((engine, ooms), widest) = picky_growing(None, 2, Some(8), cfg);
    let h = engine.handle();
    let params = SamplingParams { ignore_eos: true, ..greedy(12) };
    let streams: Vec<_> = (0..6)
        .map(|i| {
            h.submit(GenerateRequest { prompt: common::prompt(6, 40 + i), params: params.clone() }).unwrap()
        })
        .collect();
    for s in streams {
        assert_eq!(s.collect_blocking().unwrap().tokens.len(), 12);
    }
    assert!(ooms.load(std::sync::atomic::Ordering::SeqCst) >= 1, "the model never ran out");
    // Without the lift, two sequences decode until they end, then the other four together.
    let w = widest.load(std::sync::atomic::Ordering::SeqCst);
    assert!(w >= 5, "the widest decode after room was made: {w}");
}

/// Issue 32, 1: the error of one sequence fails that sequence only; the others of the same
/// steps complete with their reference tokens.
#[test]
fn an_error_of_one_sequence_fails_that_sequence_only() {
    let model = common::load_model();
    // Engine ids count from 1 in submission order: the second request is poisoned.
    let (engine, _) = picky_engine(Some(2), usize::MAX, common::config(u64::MAX, 8));
    let h = engine.handle();
    let params = SamplingParams { ignore_eos: true, ..greedy(6) };
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| common::prompt(5 + i, i as u32)).collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| h.submit(GenerateRequest { prompt: p.clone(), params: params.clone() }).unwrap())
        .collect();
    for (i, (s, p)) in streams.into_iter().zip(&prompts).enumerate() {
        let id = s.id();
        match s.collect_blocking() {
            Err(ServeError::Step(msg)) => {
                assert_eq!(id, 2, "request {i} failed: {msg}");
                assert!(msg.contains("poisoned"), "{msg}");
            }
            Ok(c) => {
                assert_ne!(id, 2, "the poisoned sequence completed");
                assert_eq!(c.tokens, common::reference(&model, p, 6, false));
            }
            Err(e) => panic!("{e}"),
        }
    }
    let m = common::wait_metrics(&h, |m| m.requests_finished_total == 3 && m.requests_failed_total == 1);
    assert_eq!((m.active_sequences, m.kv_bytes_used), (0, 0), "{m:?}");
}

/// A model out of KV memory makes the engine preempt and retry, never fail: every request
/// completes with its reference tokens.
#[test]
fn out_of_memory_steps_preempt_instead_of_failing() {
    let model = common::load_model();
    let cfg =
        pw_serve::EngineConfig { admission: pw_serve::Admission::Preempt, ..common::config(u64::MAX, 8) };
    let (engine, ooms) = picky_engine(None, 2, cfg);
    let h = engine.handle();
    let params = SamplingParams { ignore_eos: true, ..greedy(8) };
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| common::prompt(6, 20 + i)).collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| h.submit(GenerateRequest { prompt: p.clone(), params: params.clone() }).unwrap())
        .collect();
    for (s, p) in streams.into_iter().zip(&prompts) {
        assert_eq!(s.collect_blocking().unwrap().tokens, common::reference(&model, p, 8, false));
    }
    let m = common::wait_metrics(&h, |m| m.requests_finished_total == 5);
    assert_eq!(m.requests_failed_total, 0, "{m:?}");
    assert!(ooms.load(std::sync::atomic::Ordering::SeqCst) >= 1, "the model never ran out");
    assert_eq!(m.calls_out_of_memory_total, ooms.load(std::sync::atomic::Ordering::SeqCst) as u64, "{m:?}");
    assert!(m.requests_preempted_total >= 1, "{m:?}");
}

/// Issue 32, 1: `max_tokens` near `usize::MAX` is refused (it wrapped the context check), and
/// no sequence ever grows past the context, whatever its `max_tokens`.
#[test]
fn max_tokens_cannot_wrap_past_the_context() {
    let (engine, _) = common::engine(common::config(u64::MAX, 4), None);
    let h = engine.handle();
    for max in [usize::MAX, usize::MAX - 2, usize::MAX / 2 + 1] {
        let r = h.submit(GenerateRequest { prompt: vec![3, 4, 5], params: greedy(max) });
        match r {
            Err(ServeError::InvalidRequest { param, .. }) => assert_eq!(param, Some("max_tokens")),
            other => panic!("max_tokens {max}: {other:?}"),
        }
    }
    // Exactly the context is allowed and ends there.
    let params = SamplingParams { ignore_eos: true, ..greedy(256 - 3) };
    let c = h.submit(GenerateRequest { prompt: vec![3, 4, 5], params }).unwrap().collect_blocking().unwrap();
    assert_eq!(c.usage.prompt_tokens + c.usage.completion_tokens, 256);
    assert_eq!(c.reason, FinishReason::Length);
}

/// Issue 32, 5: beyond `max_waiting` queued requests, `submit` refuses with `Overloaded`.
#[test]
fn a_full_queue_refuses_with_overloaded() {
    let cfg = pw_serve::EngineConfig { max_waiting: 2, ..common::config(u64::MAX, 1) };
    let (engine, _) = common::engine(cfg, Some(Duration::from_millis(20)));
    let h = engine.handle();
    let params = SamplingParams { ignore_eos: true, ..greedy(50) };
    let mut streams = Vec::new();
    let mut refused = 0;
    for i in 0..8 {
        match h.submit(GenerateRequest { prompt: common::prompt(4, i), params: params.clone() }) {
            Ok(s) => streams.push(s),
            Err(ServeError::Overloaded(msg)) => {
                refused += 1;
                assert!(msg.contains("waiting"), "{msg}");
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused >= 1 && streams.len() >= 2, "{refused} refused, {} queued", streams.len());
    for s in streams {
        assert_eq!(s.collect_blocking().unwrap().usage.completion_tokens, 50);
    }
}

/// A step budget of 8 tokens: prompts of up to 40 tokens are prefilled in chunks across steps
/// beside the sequences already decoding, and every output equals the sequence's own
/// generation.
#[test]
fn long_prompts_are_prefilled_in_chunks_beside_decoding_sequences() {
    let model = common::load_model();
    let cfg = pw_serve::EngineConfig { max_step_tokens: 8, ..common::config(u64::MAX, 4) };
    let (engine, rec) = common::engine(cfg, None);
    let h = engine.handle();
    let lens = [(3, 12), (40, 6), (25, 9), (33, 4), (5, 10)];
    let prompts: Vec<Vec<u32>> =
        lens.iter().enumerate().map(|(i, &(n, _))| common::prompt(n, 40 + i as u32)).collect();
    let params = |n| SamplingParams { ignore_eos: true, ..greedy(n) };
    let streams: Vec<_> = prompts
        .iter()
        .zip(lens)
        .map(|(p, (_, n))| h.submit(GenerateRequest { prompt: p.clone(), params: params(n) }).unwrap())
        .collect();
    for ((s, p), (_, n)) in streams.into_iter().zip(&prompts).zip(lens) {
        assert_eq!(s.collect_blocking().unwrap().tokens, common::reference(&model, p, n, false), "{p:?}");
    }
    let m = common::wait_metrics(&h, |m| m.requests_finished_total == 5 && m.active_sequences == 0);
    let prompt_tokens: usize = lens.iter().map(|l| l.0).sum();
    assert_eq!(m.prefill_tokens_total, prompt_tokens as u64, "no preemption, so each prompt token once");
    // The model calls and boundaries were timed, and the counters reach /metrics.
    assert!(
        m.decode_seconds_total > 0.0 && m.prefill_seconds_total > 0.0 && m.boundary_seconds_total > 0.0,
        "{m:?}"
    );
    let text = h.metrics().prometheus();
    for name in ["pw_decode_seconds_total", "pw_prefill_seconds_total", "pw_boundary_seconds_total"] {
        assert!(text.contains(&format!("\n{name} ")), "{name} missing from {text}");
    }
    // 106 prompt tokens at most 8 per step: at least 14 steps, and the decodes ran beside them.
    assert!(m.steps_total >= 14, "{m:?}");
    assert!(rec.record().peak_active >= 2, "{:?}", rec.record());
    assert_eq!((m.kv_bytes_used, m.kv_bytes_reserved), (0, 0));
}

#[test]
fn a_step_budget_below_the_batch_is_refused() {
    let cfg = pw_serve::EngineConfig { max_step_tokens: 3, ..common::config(u64::MAX, 4) };
    let model =
        pw_serve::BurnStepModel::<common::B, _>::load(&common::fixture(), &Default::default()).unwrap();
    let e = pw_serve::Engine::start(
        Box::new(model),
        std::sync::Arc::new(common::tokenizer()),
        cfg,
        Box::new(pw_serve::UsageRecorder::default()),
    )
    .err()
    .expect("refused");
    assert!(e.to_string().contains("max_step_tokens"), "{e}");
}
