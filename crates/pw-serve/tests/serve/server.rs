//! The HTTP server on a loopback port, driven by a real HTTP client.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pw_serve::server::{ServerOptions, ServerState, serve};
use pw_serve::{ChatMessage, ChatTemplate, Engine, EngineConfig, UsageRecorder};
use serde_json::{Value, json};

struct TestServer {
    base: String,
    http: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    rec: UsageRecorder,
    _engine: Engine,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

const MODEL: &str = "tiny-mixtral";

async fn start(cfg: EngineConfig, delay: Option<Duration>) -> TestServer {
    let dir = common::model_dir();
    let (engine, rec) = common::engine(cfg, delay);
    let chat = ChatTemplate::from_dir(dir.path()).unwrap();
    assert!(chat.is_some());
    serve_engine(engine, rec, common::tokenizer(), chat).await
}

async fn serve_engine(
    engine: Engine,
    rec: UsageRecorder,
    tokenizer: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
) -> TestServer {
    serve_with(engine, rec, tokenizer, chat, ServerOptions::default()).await
}

async fn serve_with(
    engine: Engine,
    rec: UsageRecorder,
    tokenizer: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
    options: ServerOptions,
) -> TestServer {
    let state =
        Arc::new(ServerState::new(engine.handle(), Arc::new(tokenizer), chat, MODEL).with_options(options));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, state, async {
        let _ = rx.await;
    }));
    TestServer {
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        stop: Some(tx),
        rec,
        _engine: engine,
    }
}

impl TestServer {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// The `data:` payloads of a streamed answer.
    async fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let text = r.text().await.unwrap();
        text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }

    async fn metrics_text(&self) -> String {
        self.http.get(format!("{}/metrics", self.base)).send().await.unwrap().text().await.unwrap()
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
            .parse()
            .unwrap()
    }
}

/// Concatenated text deltas of streamed chunks; checks the stream ends with [DONE] and returns
/// the finish reason.
fn deltas(events: &[String], chat: bool) -> (String, String) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let mut text = String::new();
    let mut reason = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let choice = &v["choices"][0];
        let piece = if chat { &choice["delta"]["content"] } else { &choice["text"] };
        text.push_str(piece.as_str().unwrap_or(""));
        if let Some(r) = choice["finish_reason"].as_str() {
            reason = r.to_string();
        }
    }
    (text, reason)
}

fn cfg() -> EngineConfig {
    common::config(u64::MAX, 8)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_and_metrics() {
    let s = start(cfg(), None).await;
    let h: Value = s.http.get(format!("{}/health", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(h["status"], "ok");
    let m: Value = s.http.get(format!("{}/v1/models", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    let r = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap();
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    assert!(s.metric("pw_weight_bytes").await > 0.0);
    assert_eq!(s.metric("pw_active_sequences").await, 0.0);
    assert_eq!(s.metric("pw_kv_bytes_used").await, 0.0);
    // The reference model has no paged experts: the page table says so with a 404.
    let r = s.http.get(format!("{}/v1/page-table", s.base)).send().await.unwrap();
    expect_error(r, 404, "no paged experts").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_equals_the_whole_answer_and_generate() {
    let s = start(cfg(), None).await;
    let tok = common::tokenizer();
    let model = common::load_model();
    let prompt = "the cat is on the mat, and it";
    let body =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (status, whole) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let ids = tok.encode(prompt, true).unwrap().get_ids().to_vec();
    assert_eq!(whole["usage"]["prompt_tokens"], ids.len());
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    assert_eq!(whole["usage"]["total_tokens"], ids.len() + 24);

    // Same text as decoding pw_models::generate's tokens after the prompt.
    let generated = common::reference(&model, &ids, 24, false);
    let full = tok.decode(&[ids.clone(), generated].concat(), true).unwrap();
    let before = tok.decode(&ids, true).unwrap();
    assert_eq!(text, full[before.len()..]);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/completions", &sbody).await;
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    let (streamed, reason) = deltas(
        &events[..events.len() - 2].iter().chain(["[DONE]".to_string()].iter()).cloned().collect::<Vec<_>>(),
        false,
    );
    assert_eq!(streamed, text);
    assert_eq!(reason, "length");

    // Chat: the template's rendering, then the same greedy continuation.
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]);
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.0, "ignore_eos": true});
    let (status, whole) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let chat_text = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let rendered = ChatTemplate::new(common::CHAT_TEMPLATE, "<s>", "</s>")
        .render(
            &[
                ChatMessage { role: "system".into(), content: "be brief".into() },
                ChatMessage { role: "user".into(), content: "the cat".into() },
            ],
            true,
        )
        .unwrap();
    let ids = tok.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], 1, "the template's BOS is the special token");
    assert_eq!(whole["usage"]["prompt_tokens"], ids.len());
    let generated = common::reference(&model, &ids, 16, false);
    let full = tok.decode(&[ids.clone(), generated].concat(), true).unwrap();
    assert_eq!(chat_text, full[tok.decode(&ids, true).unwrap().len()..]);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &sbody).await;
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (streamed, reason) = deltas(&events, true);
    assert_eq!(streamed, chat_text);
    assert_eq!(reason, "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text() {
    let s = start(cfg(), None).await;
    let body =
        json!({"model": MODEL, "prompt": "the cat", "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let (_, whole) = s.post("/v1/completions", &body).await;
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "{text:?}");
    let stop: String = chars[8..10].iter().collect();
    let want = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!(["zzzz-never", stop]);
        b["stream"] = json!(stream);
        let (got, reason) = if stream {
            deltas(&s.stream("/v1/completions", &b).await, false)
        } else {
            let (status, v) = s.post("/v1/completions", &b).await;
            assert_eq!(status, 200, "{v}");
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].as_str().unwrap().to_string(),
            )
        };
        assert_eq!(got, want, "stream {stream}, stop {stop:?} in {text:?}");
        assert_eq!(reason, "stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_reproduce_sampled_text() {
    let s = start(cfg(), None).await;
    let body = |seed: u64| {
        json!({"model": MODEL, "prompt": "the cat", "max_tokens": 30, "temperature": 1.0, "top_p": 0.95, "top_k": 50,
               "seed": seed, "ignore_eos": true})
    };
    let text = |v: Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let a = text(s.post("/v1/completions", &body(3)).await.1);
    let b = text(s.post("/v1/completions", &body(3)).await.1);
    let c = text(s.post("/v1/completions", &body(4)).await.1);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_4xx_and_the_server_keeps_serving() {
    let s = start(cfg(), None).await;
    let long: String = std::iter::repeat_n("the ", 300).collect();
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/completions", "{not json".into(), 400, "not valid JSON"),
        ("/v1/completions", json!({"prompt": "x"}).to_string(), 400, "model"),
        ("/v1/completions", json!({"model": MODEL}).to_string(), 400, "prompt"),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": "ten"}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 0}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 100000}).to_string(),
            400,
            "context",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 1}).to_string(),
            400,
            "context",
        ),
        ("/v1/completions", json!({"model": "gpt-4", "prompt": "x"}).to_string(), 404, "gpt-4"),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "temperature": -1}).to_string(),
            400,
            "temperature",
        ),
        ("/v1/completions", json!({"model": MODEL, "prompt": "x", "top_p": 1.5}).to_string(), 400, "top_p"),
        ("/v1/completions", json!({"model": MODEL, "prompt": "x", "n": 2}).to_string(), 400, "n = 1"),
        ("/v1/completions", json!({"model": MODEL, "prompt": [1, 2, 999]}).to_string(), 400, "999"),
        ("/v1/chat/completions", json!({"model": MODEL}).to_string(), 400, "messages"),
        ("/v1/chat/completions", json!({"model": MODEL, "messages": []}).to_string(), 400, "empty"),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"content": "x"}]}).to_string(),
            400,
            "role",
        ),
        ("/v1/nothing", "{}".into(), 404, "no route"),
    ];
    for (path, body, status, needle) in &cases {
        let (got, v) = s.post_raw(path, body).await;
        assert_eq!(got, *status, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{body}: {v}"));
        assert!(msg.contains(needle), "{body}: {msg}");
        assert!(v["error"]["type"].is_string(), "{v}");
    }
    assert_eq!(s.metric("pw_http_bad_requests_total").await, cases.len() as f64);
    let h = s.http.get(format!("{}/health", s.base)).send().await.unwrap();
    assert_eq!(h.status(), 200);
    let (status, v) =
        s.post("/v1/completions", &json!({"model": MODEL, "prompt": "the", "max_tokens": 3})).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_the_stream_and_frees_its_kv() {
    let s = start(cfg(), Some(Duration::from_millis(10))).await;
    let body = json!({"model": MODEL, "prompt": "the cat", "max_tokens": 200, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut r = s.http.post(format!("{}/v1/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut got = String::new();
    while !got.contains("\"text\":\"") || got.matches("data: ").count() < 3 {
        got.push_str(&String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()));
    }
    assert_eq!(s.metric("pw_active_sequences").await, 1.0);
    assert!(s.metric("pw_kv_bytes_used").await > 0.0);
    drop(r);
    let t0 = Instant::now();
    while s.metric("pw_requests_cancelled_total").await < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the disconnect did not cancel the request");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s.metric("pw_active_sequences").await, 0.0);
    assert_eq!(s.metric("pw_kv_bytes_used").await, 0.0);
    assert_eq!(s.metric("pw_kv_bytes_reserved").await, 0.0);
    assert_eq!(s.metric("pw_requests_finished_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_under_a_small_kv_budget_all_complete() {
    let kv = common::kv_layout();
    let tok = common::tokenizer();
    let prompts =
        ["the cat", "it is on the mat and the", "a", "what is the time? it is", "on", "the end and"];
    let longest = prompts.iter().map(|p| tok.encode(*p, true).unwrap().len()).max().unwrap();
    // Room for two of the longest requests at a time; slowed down so they overlap.
    let budget = kv.bytes_for(longest + 12) * 2;
    let s = Arc::new(start(common::config(budget, 8), Some(Duration::from_millis(5))).await);
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let s = s.clone();
        let p = p.to_string();
        tasks.push(tokio::spawn(async move {
            let body =
                json!({"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
            let (status, whole) = s.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{whole}");
            let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
            if i % 2 == 0 {
                let mut b = body.clone();
                b["stream"] = json!(true);
                let (streamed, _) = deltas(&s.stream("/v1/completions", &b).await, false);
                assert_eq!(streamed, text, "prompt {p:?}");
            }
            text
        }));
    }
    let mut texts = Vec::new();
    for t in tasks {
        texts.push(t.await.unwrap());
    }
    // Each answer equals the same request run alone.
    for (p, text) in prompts.iter().zip(&texts) {
        let body =
            json!({"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
        let (_, alone) = s.post("/v1/completions", &body).await;
        assert_eq!(alone["choices"][0]["text"].as_str().unwrap(), text);
    }
    // The engine updates its metrics just after sending a request's last event.
    let t0 = Instant::now();
    while s.metric("pw_requests_finished_total").await < (prompts.len() * 2 + 3) as f64 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while s.metric("pw_active_sequences").await > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(s.metric("pw_kv_bytes_reserved").await, 0.0);
    assert!(s.metric("pw_time_per_output_token_seconds_count").await >= (prompts.len() * 2 * 11) as f64);
    assert!(s.metric("pw_time_per_output_token_mean_seconds").await > 0.0);
    assert!(s.metric("pw_tokens_per_second").await > 0.0);
    assert_eq!(s.metric("pw_generated_tokens_total").await, ((prompts.len() * 2 + 3) * 12) as f64);
    let r = s.rec.record();
    assert!(r.peak_waiting >= 1 && r.peak_active >= 2, "{r:?}");
    assert!(r.peak_kv_bytes_reserved <= budget, "{r:?}");
}

/// The shipped tiny Mixtral on the fast path (wgpu), experts + KV under one budget so tight that
/// 16 concurrent requests make the planner lower expert pages while they run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_lowers_pages_under_16_concurrent_requests_and_raises_them_after() {
    use cubecl::Runtime;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    use pw_serve::{FastOptions, FastStepModel, MemoryOptions, WeightPolicy};

    let dir = pw_testkit::asset("tiny-mixtral");
    let cfg = pw_hf::ModelConfig::from_dir(&dir).unwrap();
    let pw_hf::ModelConfig::Mixtral(mc) = &cfg else { panic!("not mixtral") };
    // Experts at 8 bits: planes (8 × rows × cols/32 words) + one 256-entry f16 LUT per row.
    let (h, i) = (mc.hidden_size, mc.intermediate_size);
    let page = |rows: usize, cols: usize| (8 * rows * cols.div_ceil(32) * 4 + rows * 256 * 2) as u64;
    let experts8 = (mc.num_hidden_layers * mc.num_local_experts) as u64 * (page(2 * i, h) + page(h, i));
    let block = (mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2 * 2 * 16) as u64;
    let (threshold, margin) = (4u64, 8u64);
    // Room for 24 KV blocks beside the experts at 8 bits; 16 requests need about 48.
    let budget = experts8 + 24 * block;
    let memory = MemoryOptions {
        budget_bytes: Some(budget),
        policy: WeightPolicy::Planner,
        threshold_blocks: threshold,
        give_back_blocks: margin,
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
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    let model = FastStepModel::<WgpuRuntime, half::f16>::load_with(&client, &dir, &options).unwrap();
    assert_eq!(model.decoder().expert_bytes() as u64, experts8, "all experts start at 8 bits");
    let capacity = model.kv_capacity_bytes();
    assert!(capacity > 48 * block, "the planner can make room for every request: {capacity}");
    let tok = pw_serve::load_tokenizer(&dir).unwrap();
    let config = EngineConfig {
        admission: pw_serve::Admission::Reserve,
        kv_budget_bytes: capacity,
        max_batch: 16,
        max_context: 128,
        max_step_tokens: 2048,
        max_waiting: 4096,
        eos_token_ids: pw_serve::eos_token_ids(&dir).unwrap(),
    };
    let rec = UsageRecorder::default();
    let engine =
        Engine::start(Box::new(model), Arc::new(tok.clone()), config, Box::new(rec.clone())).unwrap();
    let chat = ChatTemplate::from_dir(&dir).unwrap();
    let options = ServerOptions { metrics_per_page: true, ..Default::default() };
    let s = Arc::new(serve_with(engine, rec, tok, chat, options).await);
    let name = "pw_expert_bytes{bits=\"8\"}";
    assert_eq!(s.metric(name).await, experts8 as f64);

    // 16 concurrent requests, half streamed, under memory pressure.
    let prompts = [
        "ROMEO.\nBut soft",
        "And God said, Let there be",
        "KING.",
        "O Lord",
        "HAMLET.\nTo be, or",
        "In the beginning",
        "Enter",
        "What is",
        "JULIET.",
        "Blessed are the",
        "Thou art",
        "The king",
        "And it came to pass",
        "Good morrow",
        "Now",
        "My lord,",
    ];
    let mut tasks = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        let s = s.clone();
        let body = json!({"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": true,
                          "stream": k % 2 == 1});
        tasks.push(tokio::spawn(async move {
            if k % 2 == 1 {
                let (text, reason) = deltas(&s.stream("/v1/completions", &body).await, false);
                assert_eq!(reason, "length");
                text
            } else {
                let (status, v) = s.post("/v1/completions", &body).await;
                assert_eq!(status, 200, "{v}");
                assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
                v["choices"][0]["text"].as_str().unwrap().to_string()
            }
        }));
    }
    for t in tasks {
        assert!(!t.await.unwrap().is_empty());
    }
    let r = s.rec.record();
    assert!(r.peak_active >= 8, "the requests ran together: {r:?}");
    assert!(r.peak_kv_bytes_used > 24 * block, "the cache outgrew the room beside 8-bit experts: {r:?}");
    assert!(s.metric("pw_page_moves_total{direction=\"down\"}").await > 0.0, "{}", s.metrics_text().await);
    assert!(s.metric("pw_planner_decisions_total{target=\"free\"}").await > 0.0);
    assert!(s.metric("pw_boundary_page_seconds_total{part=\"lower\"}").await > 0.0);
    // Idle again: the cache is empty and the pages go back up to 8 bits.
    let t0 = Instant::now();
    while s.metric("pw_expert_mean_bits").await < 8.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "pages did not come back: {}",
            s.metrics_text().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(s.metric("pw_page_moves_total{direction=\"up\"}").await > 0.0);
    assert!(s.metric("pw_planner_decisions_total{target=\"spare\"}").await > 0.0);
    assert!(s.metric("pw_boundary_page_seconds_total{part=\"start\"}").await > 0.0);
    assert_eq!(s.metric(name).await, experts8 as f64);
    assert_eq!(s.metric("pw_kv_blocks_used").await, 0.0);

    // Issue 30: the page table over HTTP agrees with the metrics, page by page and in total.
    let v: Value =
        s.http.get(format!("{}/v1/page-table", s.base)).send().await.unwrap().json().await.unwrap();
    let pages = v["pages"].as_array().unwrap();
    assert_eq!(pages.len(), 2 * mc.num_hidden_layers * mc.num_local_experts, "{v}");
    assert_eq!(v["expert_bytes"].as_u64(), Some(experts8));
    assert_eq!(pages.iter().map(|p| p["bytes"].as_u64().unwrap()).sum::<u64>(), experts8);
    assert!(
        pages.iter().all(|p| p["committed_bits"] == 8 && p["desired_bits"] == 8 && p["location"] == "gpu")
    );
    assert_eq!((v["policy"].as_str(), v["model"].as_str()), (Some("planner"), Some(MODEL)));
    assert_eq!((v["queue_depth"].as_u64(), v["kv_blocks_used"].as_u64()), (Some(0), Some(0)));
    assert_eq!(v["last_decision"]["target"], "spare", "the last plan gave memory back: {v}");
    let history = v["history"].as_array().unwrap();
    assert!(!history.is_empty() && history.iter().all(|h| h["budget_bytes"].as_u64() == Some(budget)), "{v}");
    let text = s.metrics_text().await;
    let per_page = text.lines().filter(|l| l.starts_with("pw_page_committed_bits{")).count();
    assert_eq!(per_page, pages.len(), "{text}");
    assert!(text.contains("pw_page_committed_bits{layer=\"0\",expert=\"0\",kind=\"gate_up\"} 8"), "{text}");
    let r = s.http.get(format!("{}/dashboard", s.base)).send().await.unwrap();
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    let html = r.text().await.unwrap();
    assert!(html.contains("/v1/page-table") && !html.contains("src=\"http"), "self-contained page");

    // With the pages settled at 8 bits, greedy text is the same streamed or not (one request
    // at a time uses 3 blocks: no pressure, no page moves).
    let moves = s.metric("pw_page_moves_total{direction=\"down\"}").await;
    for p in ["ROMEO.\nBut soft", "And God said, Let there be", "KING."] {
        let body =
            json!({"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
        let (_, whole) = s.post("/v1/completions", &body).await;
        let mut b = body.clone();
        b["stream"] = json!(true);
        let (streamed, _) = deltas(&s.stream("/v1/completions", &b).await, false);
        assert_eq!(streamed, whole["choices"][0]["text"].as_str().unwrap(), "prompt {p:?}");
    }
    assert_eq!(s.metric("pw_page_moves_total{direction=\"down\"}").await, moves);

    // Bad requests get their 4xx and the server keeps serving.
    let long: String = std::iter::repeat_n("the ", 200).collect();
    for (body, status) in [
        ("{not json".to_string(), 400),
        (json!({"model": "gpt-4", "prompt": "x"}).to_string(), 404),
        (json!({"model": MODEL, "prompt": long, "max_tokens": 8}).to_string(), 400),
        (json!({"model": MODEL, "prompt": "x", "temperature": -1}).to_string(), 400),
    ] {
        let (got, v) = s.post_raw("/v1/completions", &body).await;
        assert_eq!(got, status, "{body}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }

    // A cancelled stream gives its KV blocks back at once.
    let body = json!({"model": MODEL, "prompt": "KING.", "max_tokens": 100, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut r = s.http.post(format!("{}/v1/completions", s.base)).json(&body).send().await.unwrap();
    let mut got = String::new();
    while got.matches("data: ").count() < 3 {
        got.push_str(&String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()));
    }
    assert!(s.metric("pw_kv_blocks_used").await > 0.0);
    assert!(s.metrics_text().await.contains("pw_request_kv_bytes{request="));
    let cancelled = s.metric("pw_requests_cancelled_total").await;
    drop(r);
    let t0 = Instant::now();
    while s.metric("pw_requests_cancelled_total").await < cancelled + 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the disconnect did not cancel the request");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    while s.metric("pw_kv_blocks_used").await > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", s.metrics_text().await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s.metric("pw_active_sequences").await, 0.0);
}

/// A server over the fixture with `options` (its chat template included).
async fn start_with(cfg: EngineConfig, options: ServerOptions) -> TestServer {
    let dir = common::model_dir();
    let (engine, rec) = common::engine(cfg, None);
    let chat = ChatTemplate::from_dir(dir.path()).unwrap();
    serve_with(engine, rec, common::tokenizer(), chat, options).await
}

/// Asserts an OpenAI-shaped error answer of `status` whose message holds `needle`.
async fn expect_error(r: reqwest::Response, status: u16, needle: &str) {
    assert_eq!(r.status().as_u16(), status);
    let ct = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    assert!(ct.starts_with("application/json"), "{status}: content-type {ct}");
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{v}"));
    assert!(msg.contains(needle), "{status}: {msg}");
    assert!(v["error"]["type"].is_string(), "{v}");
}

/// Issue 32, 1: a `max_tokens` of u64::MAX is refused (it wrapped the context check), and the
/// server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_tokens_of_u64_max_is_refused() {
    let s = start(cfg(), None).await;
    for max in [u64::MAX, u64::MAX - 1, 1 << 63, usize::MAX as u64 / 2 + 1] {
        let (status, v) =
            s.post("/v1/completions", &json!({"model": MODEL, "prompt": "the", "max_tokens": max})).await;
        assert_eq!(status, 400, "{max}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("context"), "{v}");
        let (status, v) = s
            .post(
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "max_completion_tokens": max}),
            )
            .await;
        assert_eq!(status, 400, "{max}: {v}");
    }
    let (status, v) =
        s.post("/v1/completions", &json!({"model": MODEL, "prompt": "the", "max_tokens": 2})).await;
    assert_eq!(status, 200, "{v}");
}

/// Issue 32, 4: a prompt too long for the context whatever its tokens is refused by its bytes,
/// before tokenizing; large prompts tokenize off the async runtime, so `/health` stays quick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_are_refused_by_bytes_and_health_stays_responsive() {
    let s = start(cfg(), None).await;
    let huge: String = "the cat ".repeat(240_000); // 1.9 MB
    let t0 = Instant::now();
    let r = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"model": MODEL, "prompt": huge, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, "bytes").await;
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Prompts just under the byte bound still tokenize (and are refused for their tokens),
    // several at once, while /health answers.
    let long: String = "the ".repeat(1500);
    let posts: Vec<_> = (0..8)
        .map(|_| {
            let (http, base, long) = (s.http.clone(), s.base.clone(), long.clone());
            tokio::spawn(async move {
                http.post(format!("{base}/v1/completions"))
                    .json(&json!({"model": MODEL, "prompt": long, "max_tokens": 1}))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    let t0 = Instant::now();
    let h = s.http.get(format!("{}/health", s.base)).send().await.unwrap();
    assert_eq!(h.status(), 200);
    assert!(t0.elapsed() < Duration::from_secs(2), "/health took {:?}", t0.elapsed());
    for p in posts {
        assert_eq!(p.await.unwrap(), 400);
    }
}

/// Issue 32, 5: JSON content type, object bodies, API key, and OpenAI-shaped 401/405/413/415.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_type_key_body_shape_and_error_statuses() {
    let options =
        ServerOptions { api_key: Some("sk-test".into()), max_body_bytes: 4096, ..Default::default() };
    let s = start_with(cfg(), options).await;
    let url = format!("{}/v1/completions", s.base);
    let ok = json!({"model": MODEL, "prompt": "the", "max_tokens": 2});
    // Without a key, with a wrong one, with a right one.
    expect_error(s.http.post(&url).json(&ok).send().await.unwrap(), 401, "API key").await;
    expect_error(s.http.post(&url).bearer_auth("sk-nope").json(&ok).send().await.unwrap(), 401, "API key")
        .await;
    expect_error(s.http.get(format!("{}/v1/models", s.base)).send().await.unwrap(), 401, "API key").await;
    let r = s.http.post(&url).bearer_auth("sk-test").json(&ok).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // /health stays open for load balancers.
    assert_eq!(s.http.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
    // A cross-site form or text/plain POST does not reach the API.
    for ct in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"] {
        let r =
            s.http.post(&url).bearer_auth("sk-test").header("content-type", ct).body(ok.to_string()).send();
        expect_error(r.await.unwrap(), 415, "application/json").await;
    }
    let r = s.http.post(&url).bearer_auth("sk-test").body(ok.to_string()).send().await.unwrap();
    expect_error(r, 415, "application/json").await;
    let r = s
        .http
        .post(&url)
        .bearer_auth("sk-test")
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(ok.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // An array body is not a positional request.
    let r = s.http.post(&url).bearer_auth("sk-test").json(&json!([MODEL, "the"])).send().await.unwrap();
    expect_error(r, 400, "JSON object").await;
    // 413 and 405 in OpenAI's shape.
    let big = json!({"model": MODEL, "prompt": "x".repeat(5000)});
    expect_error(s.http.post(&url).bearer_auth("sk-test").json(&big).send().await.unwrap(), 413, "4096")
        .await;
    expect_error(s.http.get(&url).bearer_auth("sk-test").send().await.unwrap(), 405, "method").await;
}

/// Issue 32, 5: a connection that sends nothing, or stops after part of its headers or body,
/// is closed after the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_connections_are_closed() {
    let timeout = Duration::from_millis(600);
    let options = ServerOptions { header_timeout: timeout, body_timeout: timeout, ..Default::default() };
    let s = start_with(cfg(), options).await;
    let addr = s.base.trim_start_matches("http://").to_string();
    // Blocking sockets on the blocking pool: (bytes sent, time until the server closed, answer).
    let probe = move |bytes: &'static [u8]| {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut c = std::net::TcpStream::connect(&addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c.write_all(bytes).unwrap();
            let t0 = Instant::now();
            let mut buf = Vec::new();
            let closed = c.read_to_end(&mut buf).is_ok();
            (closed, t0.elapsed(), String::from_utf8_lossy(&buf).into_owned())
        })
    };
    let partial: [&'static [u8]; 3] = [
        b"",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"mo",
    ];
    for bytes in partial {
        let (closed, took, answer) = probe(bytes).await.unwrap();
        let sent = String::from_utf8_lossy(bytes);
        assert!(closed, "connection with {sent:?} still open after 10 s");
        assert!(took >= timeout / 2, "closed too early: {took:?}");
        // The server answers 408 for a stalled body, or just closes.
        assert!(answer.is_empty() || answer.contains("408"), "{sent:?}: {answer}");
    }
    // A keep-alive connection idle after a request is closed too.
    let (closed, _, answer) = probe(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    assert!(closed, "idle keep-alive connection still open after 10 s");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Mixed valid and invalid requests, mid-stream disconnects and oversized fields at once: no
/// 5xx, every valid request completes, and the KV cache is empty afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_mixed_traffic_loses_nothing() {
    let s = Arc::new(start(common::config(common::kv_layout().bytes_for(256) * 3, 4), None).await);
    let mut tasks = Vec::new();
    for i in 0..48u64 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let url = format!("{}/v1/completions", s.base);
            match i % 6 {
                // Valid, whole answer.
                0 | 1 => {
                    let max = 4 + i % 9;
                    let body = json!({"model": MODEL, "prompt": format!("the {i}"), "max_tokens": max,
                                      "ignore_eos": true});
                    let (status, v) = s.post("/v1/completions", &body).await;
                    assert_eq!(status, 200, "{v}");
                    assert_eq!(v["usage"]["completion_tokens"], max, "{v}");
                    1
                }
                // Valid, streamed to the end.
                2 => {
                    let body = json!({"model": MODEL, "prompt": "and the", "max_tokens": 6, "stream": true,
                                      "ignore_eos": true});
                    let events = s.stream("/v1/completions", &body).await;
                    assert_eq!(deltas(&events, false).1, "length");
                    1
                }
                // Streamed, then the client goes away mid-stream.
                3 => {
                    let body = json!({"model": MODEL, "prompt": "the", "max_tokens": 200, "stream": true,
                                      "ignore_eos": true});
                    let mut r = s.http.post(&url).json(&body).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    let _ = r.chunk().await;
                    drop(r);
                    0
                }
                // Invalid: oversized fields, bad values, broken JSON.
                4 => {
                    let bodies = [
                        json!({"model": MODEL, "prompt": "the", "max_tokens": u64::MAX}).to_string(),
                        json!({"model": MODEL, "prompt": "the", "stop": vec!["x"; 1000]}).to_string(),
                        json!({"model": "m".repeat(100_000), "prompt": "the"}).to_string(),
                        json!({"model": MODEL, "prompt": vec![5u32; 100_000]}).to_string(),
                        "{\"model\": \"tiny-mixtral\", \"prompt\": \"the\", ".repeat(200),
                    ];
                    for b in bodies {
                        let (status, v) = s.post_raw("/v1/completions", &b).await;
                        assert!((400..500).contains(&status), "{status}: {v}");
                    }
                    0
                }
                // Valid chat.
                _ => {
                    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "the cat"}],
                                      "max_tokens": 3, "ignore_eos": true});
                    let (status, v) = s.post("/v1/chat/completions", &body).await;
                    assert_eq!(status, 200, "{v}");
                    1
                }
            }
        }));
    }
    let mut valid = 0;
    for t in tasks {
        valid += t.await.unwrap();
    }
    assert_eq!(valid, 8 + 8 + 8 + 8);
    // Cancelled streams free their KV at the next step.
    let t0 = Instant::now();
    while s.metric("pw_kv_bytes_used").await != 0.0 || s.metric("pw_active_sequences").await != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", s.metrics_text().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.metric("pw_requests_failed_total").await, 0.0);
}

/// Random and mutated request bodies never get a 5xx or a non-JSON answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_request_bodies_get_clean_answers() {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, TestRunner};
    let s = start(common::config(u64::MAX, 8), None).await;
    let seeds = [
        json!({"model": MODEL, "prompt": "the", "max_tokens": 2}).to_string(),
        json!({"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 2, "stop": ["x"], "seed": 3}).to_string(),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
               "temperature": 0.5, "top_p": 0.9, "top_k": 4})
        .to_string(),
    ];
    let mut runner = TestRunner::new(Config { cases: 600, ..Config::default() });
    let bodies =
        (0..seeds.len(), proptest::collection::vec((0usize..4, 0usize..4096, proptest::num::u8::ANY), 0..6))
            .prop_map(move |(seed, edits)| {
                let mut b = seeds[seed].clone().into_bytes();
                for (op, at, byte) in edits {
                    let at = at % (b.len() + 1);
                    match op {
                        0 if at < b.len() => b[at] = byte,
                        1 => b.insert(at, byte),
                        2 if at < b.len() => {
                            b.remove(at);
                        }
                        3 => b.truncate(at),
                        _ => {}
                    }
                }
                b
            });
    let random = proptest::collection::vec(proptest::num::u8::ANY, 0..256);
    for strategy in [bodies.boxed(), random.boxed()] {
        for _ in 0..300 {
            let body = strategy.new_tree(&mut runner).unwrap().current();
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let r = s
                    .http
                    .post(format!("{}{path}", s.base))
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let text = r.text().await.unwrap();
                assert!(status < 500, "{status} for {:?}: {text}", String::from_utf8_lossy(&body));
                let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
                    panic!("{status} not JSON ({e}) for {:?}", String::from_utf8_lossy(&body))
                });
                if status >= 400 {
                    assert!(v["error"]["message"].is_string(), "{v}");
                }
            }
        }
    }
    assert_eq!(s.http.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
}
