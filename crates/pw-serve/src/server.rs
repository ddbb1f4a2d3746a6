//! The OpenAI-compatible HTTP API over an [`EngineHandle`].
//!
//! | route | |
//! | --- | --- |
//! | `POST /v1/completions` | `prompt` (string, `[string]` of one, or token ids); `stream: true` gives server-sent events |
//! | `POST /v1/chat/completions` | `messages` rendered with the model's chat template |
//! | `GET /v1/models` | the served model |
//! | `GET /health` | `{"status":"ok"}` |
//! | `GET /metrics` | Prometheus text (per-page series with [`ServerOptions::metrics_per_page`]) |
//! | `GET /v1/page-table` | every expert page's bits, location, routing share and damage; memory split, queue, the planner's last decision and the memory time line |
//! | `GET /dashboard` | a live view of `/v1/page-table` (one self-contained HTML page) |
//!
//! Sampling fields: `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `top_k`,
//! `seed`, `stop` (string or list), `stop_token_ids`, `ignore_eos`, `n` (1 only),
//! `stream_options.include_usage`. Every error status (400, 401, 404, 405, 408, 413, 415, 429,
//! 500, 503) comes with OpenAI's error shape `{"error":{"message","type","param","code"}}`; a
//! client that disconnects cancels its request.
//!
//! Untrusted clients: POST bodies must be `application/json` objects of at most
//! [`ServerOptions::max_body_bytes`], sent within [`ServerOptions::body_timeout`]; headers (and
//! the next request on an idle connection) within [`ServerOptions::header_timeout`]; with an
//! [`ServerOptions::api_key`], `/v1/*` needs `Authorization: Bearer KEY`. Prompts are
//! tokenized on a bounded blocking pool, after a byte check, never on the async runtime.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::Stream;
use serde::Deserialize;
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use crate::{
    ChatMessage, ChatTemplate, EngineHandle, Event, GenerateRequest, RequestStream, SamplingParams,
    ServeError,
};

/// Most stop strings a request may give.
const MAX_STOPS: usize = 16;

/// Limits and access control of the HTTP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerOptions {
    /// Key clients must send as `Authorization: Bearer KEY` on `/v1/*` (`None`: no key).
    pub api_key: Option<String>,
    /// Most bytes of a request body (413 beyond).
    pub max_body_bytes: usize,
    /// Time a client has to send a request's headers, which also closes a connection idle
    /// that long between requests.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body (408 after).
    pub body_timeout: Duration,
    /// `/metrics` also has one series per expert page (bits and bytes), read from the page
    /// table at each scrape.
    pub metrics_per_page: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: 2 << 20,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            metrics_per_page: false,
        }
    }
}

/// Everything the handlers share.
pub struct ServerState {
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    model_name: String,
    created: u64,
    next_id: AtomicU64,
    bad_requests: AtomicU64,
    options: ServerOptions,
    /// Longest text a prompt may have: beyond it the prompt cannot fit the context whatever
    /// it tokenizes to, so it is refused before tokenizing.
    max_prompt_bytes: usize,
    /// Bounds the tokenizations running at once (each may hold a large prompt).
    tokenizing: tokio::sync::Semaphore,
}

impl ServerState {
    /// State for serving `engine` under `model_name`; `chat` is the model's chat template
    /// (without one, `/v1/chat/completions` answers 400).
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<Tokenizer>,
        chat: Option<ChatTemplate>,
        model_name: impl Into<String>,
    ) -> Self {
        // No token stands for more bytes than its longest vocabulary string (byte-level and
        // `▁` spellings are at least as long as the text they cover); the factor leaves room
        // for normalizers that shorten the text.
        let longest = tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        let max_prompt_bytes = engine.config().max_context.saturating_mul(longest).saturating_mul(4);
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            engine,
            tokenizer,
            chat,
            model_name: model_name.into(),
            created: unix_now(),
            next_id: AtomicU64::new(1),
            bad_requests: AtomicU64::new(0),
            options: ServerOptions::default(),
            max_prompt_bytes,
            tokenizing: tokio::sync::Semaphore::new(workers),
        }
    }

    /// The same state under `options`.
    pub fn with_options(mut self, options: ServerOptions) -> Self {
        self.options = options;
        self
    }

    /// The engine behind the server.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The router with every route.
pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/page-table", get(page_table))
        .route("/dashboard", get(dashboard))
        .fallback(not_found)
        // `guard` enforces the body limit itself, with an OpenAI-shaped answer.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves, then lets open requests finish (for at
/// most a minute). Connections get the state's header timeout, which also ends idle ones.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let header_timeout = state.options.header_timeout;
    let app = router(state);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors and the like: wait instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(
                hyper_util::rt::TokioIo::new(stream),
                hyper_util::service::TowerToHyperService::new(app.clone()),
            );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(60), graceful.shutdown()).await;
    Ok(())
}

/// Checks the key and the content type, reads the body under its size and time limits, and
/// gives every error answer OpenAI's JSON shape (axum's own 405 and the like have none).
async fn guard(State(state): State<Arc<ServerState>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let checked = async {
        if let Some(key) = &state.options.api_key
            && parts.uri.path().starts_with("/v1/")
        {
            let sent = parts
                .headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !sent.is_some_and(|s| constant_time_eq(s.as_bytes(), key.as_bytes())) {
                return Err(ApiError::status(
                    StatusCode::UNAUTHORIZED,
                    "missing or incorrect API key: send `Authorization: Bearer KEY`",
                    Some("invalid_api_key"),
                ));
            }
        }
        if parts.method == Method::POST {
            let json = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
            if !json {
                return Err(ApiError::status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "the body must be sent with `Content-Type: application/json`",
                    None,
                ));
            }
        }
        let limit = state.options.max_body_bytes;
        match tokio::time::timeout(state.options.body_timeout, axum::body::to_bytes(body, limit)).await {
            Err(_) => Err(ApiError::status(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {} s", state.options.body_timeout.as_secs_f64()),
                None,
            )),
            Ok(Err(_)) => Err(ApiError::status(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than {limit} bytes or was cut off"),
                None,
            )),
            Ok(Ok(bytes)) => Ok(bytes),
        }
    }
    .await;
    let response = match checked {
        Ok(bytes) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Err(e) => {
            state.bad_requests.fetch_add(1, Ordering::Relaxed);
            return e.into_response();
        }
    };
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        if status.is_client_error() {
            state.bad_requests.fetch_add(1, Ordering::Relaxed);
        }
        let reason = status.canonical_reason().unwrap_or("error").to_lowercase();
        return ApiError::status(status, reason, None).into_response();
    }
    response
}

/// Compares a sent key with the real one in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// An error answer in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
        }
    }

    /// An error of `status`, typed as OpenAI types it.
    fn status(status: StatusCode, message: impl Into<String>, code: Option<&'static str>) -> Self {
        let kind = match status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        Self { status, kind, message: message.into(), param: None, code }
    }
}

impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> Self {
        match e {
            ServeError::InvalidRequest { param, message } => Self::bad(message, param),
            ServeError::Overloaded(message) => Self::status(StatusCode::TOO_MANY_REQUESTS, message, None),
            ServeError::EngineStopped => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                message: e.to_string(),
                param: None,
                code: None,
            },
            ServeError::Template { .. } => Self::bad(e.to_string(), Some("messages")),
            ServeError::Tokenizer(_) => Self::bad(e.to_string(), None),
            other => Self {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "server_error",
                message: other.to_string(),
                param: None,
                code: None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `prompt`: text, a list holding one text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

/// A message's `content`: text or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The body of both generation routes (unknown fields are ignored, as OpenAI clients send many).
#[derive(Debug, Deserialize)]
struct ApiRequest {
    model: String,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

/// Parses a JSON object body, naming the field at fault.
fn parse(body: &[u8]) -> Result<ApiRequest, ApiError> {
    // serde reads a struct from a JSON array too (fields by position): refuse that shape.
    if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ApiError::bad("the body must be a JSON object, not an array", None));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("the body is not valid JSON: {inner}")
        } else if path == "." {
            format!("invalid request: {inner}")
        } else {
            format!("invalid field `{path}`: {inner}")
        };
        ApiError::bad(message, None)
    })
}

impl ServerState {
    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.model_name {
            Ok(())
        } else {
            Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                message: format!(
                    "the model `{model}` does not exist; this server serves `{}`",
                    self.model_name
                ),
                param: Some("model"),
                code: Some("model_not_found"),
            })
        }
    }

    /// Tokenizes `text` (call it off the async runtime: see [`ServerState::blocking`]); a text
    /// too long for the context whatever its tokens is refused first.
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        if text.len() > self.max_prompt_bytes {
            return Err(ApiError::bad(
                format!(
                    "the prompt has {} bytes; no prompt over {} bytes fits the context of {} tokens",
                    text.len(),
                    self.max_prompt_bytes,
                    self.engine.config().max_context
                ),
                Some("prompt"),
            ));
        }
        Ok(self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| ApiError::bad(format!("cannot tokenize the prompt: {e}"), Some("prompt")))?
            .get_ids()
            .to_vec())
    }

    /// Sampling parameters of `r`, with `default_max` tokens when the request gives none.
    fn params(
        &self,
        r: &ApiRequest,
        prompt_len: usize,
        default_max: Option<usize>,
    ) -> Result<SamplingParams, ApiError> {
        if let Some(n) = r.n
            && n != 1
        {
            return Err(ApiError::bad("only n = 1 is supported", Some("n")));
        }
        let context = self.engine.config().max_context;
        let room = context.saturating_sub(prompt_len);
        if room == 0 {
            return Err(ApiError::bad(
                format!("the prompt has {prompt_len} tokens; the context length is {context}"),
                Some("prompt"),
            ));
        }
        let max_tokens = match r.max_completion_tokens.or(r.max_tokens) {
            Some(0) => return Err(ApiError::bad("max_tokens must be at least 1", Some("max_tokens"))),
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => default_max.unwrap_or(room).min(room),
        };
        let temperature = r.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
            return Err(ApiError::bad("temperature must be between 0 and 2", Some("temperature")));
        }
        let top_p = r.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad("top_p must be in (0, 1]", Some("top_p")));
        }
        let top_k = match r.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(_) => {
                return Err(ApiError::bad("top_k must be -1 (off), 0 (off) or positive", Some("top_k")));
            }
        };
        let stop = match &r.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::bad(format!("at most {MAX_STOPS} stop strings"), Some("stop")));
        }
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: r.seed.map(|s| s as u64),
            max_tokens,
            stop,
            stop_token_ids: r.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: r.ignore_eos.unwrap_or(false),
        })
    }

    fn next_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Runs `f` (parsing, templating, tokenizing) on the blocking pool, a bounded number at
    /// once, so large prompts never stall the async runtime.
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&ServerState) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let internal = |m: String| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, m, None);
        let _permit = self.tokenizing.acquire().await.map_err(|e| internal(e.to_string()))?;
        let state = self.clone();
        tokio::task::spawn_blocking(move || f(&state)).await.map_err(|e| internal(e.to_string()))?
    }
}

/// Counts 4xx answers for `/metrics`.
fn count_bad<T>(state: &ServerState, r: Result<T, ApiError>) -> Result<T, ApiError> {
    if r.as_ref().is_err_and(|e| e.status.is_client_error()) {
        state.bad_requests.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// The two response formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Builds the JSON objects of one request's answer.
#[derive(Debug, Clone)]
struct Format {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Format {
    fn usage(u: crate::Usage) -> Value {
        json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
               "total_tokens": u.prompt_tokens + u.completion_tokens})
    }

    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
        }
    }

    fn usage_chunk(&self, u: crate::Usage) -> Value {
        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": Self::usage(u)})
    }

    fn whole(&self, c: &crate::Completion) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": c.text, "logprobs": null, "finish_reason": c.reason.as_str()}],
                "usage": Self::usage(c.usage),
            }),
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": null, "finish_reason": c.reason.as_str()}],
                "usage": Self::usage(c.usage),
            }),
        }
    }
}

fn sse_json(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The request's events as server-sent events; dropping the stream (client gone) drops the
/// [`RequestStream`], which cancels the request.
fn sse_stream(rs: RequestStream, fmt: Format) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let mut first = VecDeque::new();
    if fmt.kind == Kind::Chat {
        first.push_back(sse_json(&fmt.chunk(Some(""), true, None)));
    }
    futures_util::stream::unfold((rs, fmt, first, false), |(mut rs, fmt, mut queue, mut done)| async move {
        loop {
            if let Some(ev) = queue.pop_front() {
                return Some((Ok(ev), (rs, fmt, queue, done)));
            }
            if done {
                return None;
            }
            match rs.next().await {
                Some(Event::Token { text, .. }) => {
                    if !text.is_empty() {
                        queue.push_back(sse_json(&fmt.chunk(Some(&text), false, None)));
                    }
                }
                Some(Event::Done { text, reason, usage }) => {
                    let text = (!text.is_empty()).then_some(text.as_str());
                    queue.push_back(sse_json(&fmt.chunk(text, false, Some(reason.as_str()))));
                    if fmt.include_usage {
                        queue.push_back(sse_json(&fmt.usage_chunk(usage)));
                    }
                    queue.push_back(SseEvent::default().data("[DONE]"));
                    done = true;
                }
                Some(Event::Failed(msg)) => {
                    queue.push_back(sse_json(&json!({"error": {"message": msg, "type": "server_error"}})));
                    queue.push_back(SseEvent::default().data("[DONE]"));
                    done = true;
                }
                None => {
                    let msg = "the engine stopped";
                    queue.push_back(sse_json(&json!({"error": {"message": msg, "type": "server_error"}})));
                    queue.push_back(SseEvent::default().data("[DONE]"));
                    done = true;
                }
            }
        }
    })
}

async fn generate(
    state: Arc<ServerState>,
    r: ApiRequest,
    prompt: Vec<u32>,
    kind: Kind,
    default_max: Option<usize>,
) -> Result<Response, ApiError> {
    let params = state.params(&r, prompt.len(), default_max)?;
    let stream = state.engine.submit(GenerateRequest { prompt, params })?;
    let fmt = Format {
        kind,
        id: state.next_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: unix_now(),
        model: state.model_name.clone(),
        include_usage: r.stream_options.as_ref().is_some_and(|o| o.include_usage),
    };
    if r.stream.unwrap_or(false) {
        Ok(Sse::new(sse_stream(stream, fmt)).keep_alive(KeepAlive::default()).into_response())
    } else {
        let c = stream.collect().await?;
        Ok(axum::Json(fmt.whole(&c)).into_response())
    }
}

async fn completions(State(state): State<Arc<ServerState>>, body: Bytes) -> Result<Response, ApiError> {
    let r = state.blocking(move |state| {
        let r = parse(&body)?;
        state.check_model(&r.model)?;
        let prompt = match &r.prompt {
            None => return Err(ApiError::bad("missing field `prompt`", Some("prompt"))),
            Some(Prompt::Text(t)) => state.encode(t, true)?,
            Some(Prompt::Texts(v)) if v.len() == 1 => state.encode(&v[0], true)?,
            Some(Prompt::Texts(_)) => {
                return Err(ApiError::bad("a list prompt must hold exactly one string", Some("prompt")));
            }
            Some(Prompt::Tokens(ids)) => ids.clone(),
        };
        Ok((r, prompt))
    });
    let r = r.await;
    let (r, prompt) = count_bad(&state, r)?;
    // 16 tokens is OpenAI's default for completions.
    let out = generate(state.clone(), r, prompt, Kind::Completion, Some(16)).await;
    count_bad(&state, out)
}

async fn chat_completions(State(state): State<Arc<ServerState>>, body: Bytes) -> Result<Response, ApiError> {
    let r = state.blocking(move |state| {
        let r = parse(&body)?;
        state.check_model(&r.model)?;
        let Some(messages) = &r.messages else {
            return Err(ApiError::bad("missing field `messages`", Some("messages")));
        };
        if messages.is_empty() {
            return Err(ApiError::bad("`messages` is empty", Some("messages")));
        }
        let Some(template) = &state.chat else {
            return Err(ApiError::bad(
                "this model has no chat template (tokenizer_config.json `chat_template`); use /v1/completions",
                Some("messages"),
            ));
        };
        let mut msgs = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::bad(
                                    format!(
                                        "messages[{i}]: content part of type `{kind}` is not supported (text only)"
                                    ),
                                    Some("messages"),
                                ));
                            }
                        }
                    }
                    s
                }
            };
            msgs.push(ChatMessage { role: m.role.clone(), content });
        }
        let text = template.render(&msgs, true)?;
        // The template writes the BOS and role markers itself.
        let prompt = state.encode(&text, false)?;
        Ok((r, prompt))
    });
    let r = r.await;
    let (r, prompt) = count_bad(&state, r)?;
    let out = generate(state.clone(), r, prompt, Kind::Chat, None).await;
    count_bad(&state, out)
}

async fn models(State(state): State<Arc<ServerState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "pagedweight",
        "max_model_len": state.engine.config().max_context,
    }]}))
    .into_response()
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(state): State<Arc<ServerState>>) -> Response {
    let mut text = state.engine.metrics().prometheus();
    text.push_str(&format!(
        "# HELP pw_http_bad_requests_total Requests answered with a 4xx.\n\
         # TYPE pw_http_bad_requests_total counter\npw_http_bad_requests_total {}\n",
        state.bad_requests.load(Ordering::Relaxed)
    ));
    if state.options.metrics_per_page
        && let Ok(Ok(Some(view))) = tokio::time::timeout(PAGE_TABLE_WAIT, state.engine.page_table()).await
    {
        crate::metrics::page_metrics(&mut text, &view);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// Longest a page-table read waits for the step in flight to end.
const PAGE_TABLE_WAIT: Duration = Duration::from_secs(30);

async fn page_table(State(state): State<Arc<ServerState>>) -> Result<Response, ApiError> {
    let view = match tokio::time::timeout(PAGE_TABLE_WAIT, state.engine.page_table()).await {
        Err(_) => {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine did not reach a step boundary in time",
                None,
            ));
        }
        Ok(Err(e)) => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None)),
        Ok(Ok(None)) => {
            return Err(ApiError::status(
                StatusCode::NOT_FOUND,
                "this server's model has no paged experts (the reference path serves it)",
                None,
            ));
        }
        Ok(Ok(Some(v))) => v,
    };
    let metrics = state.engine.metrics();
    let m = metrics.snapshot();
    let mut body = serde_json::to_value(&view)
        .map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None))?;
    if let Value::Object(o) = &mut body {
        o.insert("model".into(), json!(state.model_name));
        o.insert("step".into(), json!(m.steps_total));
        o.insert("queue_depth".into(), json!(m.queue_length));
        o.insert("active_sequences".into(), json!(m.active_sequences));
        o.insert("kv_bytes_used".into(), json!(m.kv_bytes_used));
        o.insert("history".into(), json!(metrics.history()));
    }
    Ok(axum::Json(body).into_response())
}

async fn dashboard() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")],
        include_str!("dashboard.html"),
    )
        .into_response()
}

async fn not_found(State(state): State<Arc<ServerState>>, uri: axum::http::Uri) -> ApiError {
    state.bad_requests.fetch_add(1, Ordering::Relaxed);
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        message: format!("no route {uri}"),
        param: None,
        code: None,
    }
}
