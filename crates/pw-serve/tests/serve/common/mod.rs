//! Shared test fixtures: the tiny Mixtral with a Llama-style byte-fallback tokenizer.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use burn_ndarray::NdArray;
use pw_models::AnyModel;
use pw_serve::{
    BurnStepModel, DecodeSlot, Engine, EngineConfig, KvLayout, PrefillSlot, SeqId, StepError, StepModel,
    UsageRecorder,
};
use serde_json::{Value, json};
use tokenizers::Tokenizer;

/// The CPU backend of the tests.
pub type B = NdArray<f32>;

/// The committed tiny Mixtral (vocab 96, context 256, eos 2).
pub fn fixture() -> PathBuf {
    pw_testkit::fixture("mixtral")
}

/// The chat template written into the test model directory.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

/// A Llama-style tokenizer with 96 ids: specials, a few UTF-8 byte-fallback tokens (é, €, 😀),
/// `▁`, a-z, digits, punctuation and BPE merges. Multi-byte characters span several tokens.
pub fn tokenizer_json() -> Value {
    let mut vocab: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    for b in [0xC3u8, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80] {
        vocab.push(format!("<0x{b:02X}>"));
    }
    vocab.push("▁".into());
    vocab.extend(('a'..='z').map(String::from));
    vocab.extend(('0'..='9').map(String::from));
    vocab.extend([".", ",", "!", "?"].map(String::from));
    let merges: Vec<(&str, &str)> = vec![
        ("▁", "t"),
        ("▁", "a"),
        ("▁", "s"),
        ("▁", "w"),
        ("▁", "i"),
        ("▁", "o"),
        ("▁", "b"),
        ("▁", "c"),
        ("▁", "h"),
        ("▁", "m"),
        ("t", "h"),
        ("h", "e"),
        ("i", "n"),
        ("e", "r"),
        ("a", "n"),
        ("r", "e"),
        ("o", "n"),
        ("a", "t"),
        ("e", "n"),
        ("n", "d"),
        ("t", "i"),
        ("e", "s"),
        ("o", "r"),
        ("t", "e"),
        ("e", "d"),
        ("i", "s"),
        ("i", "t"),
        ("a", "l"),
        ("a", "r"),
        ("s", "t"),
        ("▁t", "h"),
        ("▁th", "e"),
        ("▁a", "n"),
        ("▁an", "d"),
        ("▁i", "n"),
        ("▁i", "s"),
        ("▁i", "t"),
        ("▁o", "f"),
        ("in", "g"),
        ("i", "on"),
        ("▁t", "o"),
        ("▁w", "h"),
        ("▁h", "e"),
    ];
    for (a, b) in &merges {
        vocab.push(format!("{a}{b}"));
    }
    assert_eq!(vocab.len(), 96);
    let vocab_map: serde_json::Map<String, Value> =
        vocab.iter().enumerate().map(|(i, t)| (t.clone(), Value::from(i))).collect();
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab_map,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
}

/// The test tokenizer.
pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_bytes(tokenizer_json().to_string()).expect("test tokenizer")
}

/// A copy of the fixture with tokenizer.json and a tokenizer_config.json holding a chat template.
pub fn model_dir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(tmp.path().join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    let cfg = json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE});
    std::fs::write(tmp.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    tmp
}

/// The fixture model on the CPU.
pub fn load_model() -> AnyModel<B> {
    AnyModel::<B>::load(fixture(), &Default::default()).unwrap()
}

/// Wraps a model to make each step take at least `delay`, so a test can act while a request runs.
pub struct Slow<M> {
    pub inner: M,
    pub delay: Duration,
}

impl<M: StepModel> StepModel for Slow<M> {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn kv_layout(&self) -> &KvLayout {
        self.inner.kv_layout()
    }
    fn weight_bytes(&self) -> u64 {
        self.inner.weight_bytes()
    }
    fn prefill(&mut self, batch: &mut [PrefillSlot<'_>]) -> Result<Vec<pw_serve::PrefillOutcome>, StepError> {
        self.inner.prefill(batch)
    }
    fn decode(&mut self, batch: &mut [DecodeSlot<'_>]) -> Result<Vec<pw_serve::SeqOutcome>, StepError> {
        std::thread::sleep(self.delay);
        self.inner.decode(batch)
    }
    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }
    fn kv_bytes_held(&self) -> u64 {
        self.inner.kv_bytes_held()
    }
}

/// Engine limits for the fixture: context 256, eos 2.
pub fn config(kv_budget_bytes: u64, max_batch: usize) -> EngineConfig {
    EngineConfig {
        admission: pw_serve::Admission::Reserve,
        kv_budget_bytes,
        max_batch,
        max_context: 256,
        max_step_tokens: 512,
        max_waiting: 4096,
        eos_token_ids: vec![2],
    }
}

/// Bytes per cached token of the fixture on f32.
pub fn kv_layout() -> KvLayout {
    BurnStepModel::<B, _>::load(&fixture(), &Default::default()).unwrap().kv_layout().clone()
}

/// An engine over the fixture, optionally slowed down, with a usage recorder as its hook.
pub fn engine(cfg: EngineConfig, delay: Option<Duration>) -> (Engine, UsageRecorder) {
    let model = BurnStepModel::<B, _>::load(&fixture(), &Default::default()).unwrap();
    let model: Box<dyn StepModel> = match delay {
        Some(delay) => Box::new(Slow { inner: model, delay }),
        None => Box::new(model),
    };
    let rec = UsageRecorder::default();
    let engine = Engine::start(model, Arc::new(tokenizer()), cfg, Box::new(rec.clone())).unwrap();
    (engine, rec)
}

/// Deterministic prompt ids of length `n` (no specials).
pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 37 + salt * 11) % 93).collect()
}

/// Greedy tokens of `pw_models::generate` with eos 2.
pub fn reference(model: &AnyModel<B>, prompt: &[u32], max_tokens: usize, eos: bool) -> Vec<u32> {
    let mut s = pw_models::Sampler::new(pw_models::SamplingConfig {
        max_tokens,
        stop_tokens: if eos { vec![2] } else { vec![] },
        ..Default::default()
    });
    pw_models::generate(model, prompt, &mut s, &Default::default(), |_| true)
}

/// Waits until all `n` requests have finished, then checks that none failed, the queue and the
/// KV cache are empty, and the planner lowered pages on the way; returns the metrics.
pub fn all_served_after_lowering(h: &pw_serve::EngineHandle, n: u64) -> pw_serve::MetricsSnapshot {
    let m = wait_metrics(h, |m| m.active_sequences == 0 && m.requests_finished_total == n);
    assert_eq!((m.requests_failed_total, m.queue_length), (0, 0), "{m:?}");
    assert_eq!((m.kv_bytes_used, m.kv_bytes_reserved), (0, 0), "{m:?}");
    let mem = m.memory.as_ref().expect("paged memory state");
    assert!(
        mem.page_moves_down_total > 0 && mem.planner_lower_total > 0,
        "the planner lowered pages: {mem:?}"
    );
    m
}

/// Polls the engine's metrics until `ok` holds (the engine updates them after it has sent a
/// request's last event), failing after 10 s.
pub fn wait_metrics(
    h: &pw_serve::EngineHandle,
    ok: impl Fn(&pw_serve::MetricsSnapshot) -> bool,
) -> pw_serve::MetricsSnapshot {
    let t0 = std::time::Instant::now();
    loop {
        let m = h.metrics().snapshot();
        if ok(&m) {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "metrics never reached the expected state: {m:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}
