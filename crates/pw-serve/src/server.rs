//! The OpenAI-compatible HTTP API over an [`EngineHandle`].
//!
//! | route | |
//! | --- | --- |
//! | `POST /v1/completions` | `prompt` (string, `[string]` of one, or token ids); `stream: true` gives server-sent events |
//! | `POST /v1/chat/completions` | `messages` rendered with the model's chat template |
//! | `GET /v1/models` | the served model |
//! | `GET /health` | `{"status":"ok"}` |
//! | `GET /metrics` | Prometheus text |
//!
//! Sampling fields: `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `top_k`,
//! `seed`, `stop` (string or list), `stop_token_ids`, `ignore_eos`, `n` (1 only),
//! `stream_options.include_usage`. Bad requests get a 4xx with OpenAI's error shape
//! `{"error":{"message","type","param","code"}}`; a client that disconnects cancels its request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
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

/// Everything the handlers share.
pub struct ServerState {
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    model_name: String,
    created: u64,
    next_id: AtomicU64,
    bad_requests: AtomicU64,
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
        Self {
            engine,
            tokenizer,
            chat,
            model_name: model_name.into(),
            created: unix_now(),
            next_id: AtomicU64::new(1),
            bad_requests: AtomicU64::new(0),
        }
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
        .fallback(not_found)
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
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
}

impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> Self {
        match e {
            ServeError::InvalidRequest { param, message } => Self::bad(message, param),
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

/// Parses a JSON body, naming the field at fault.
fn parse(body: &[u8]) -> Result<ApiRequest, ApiError> {
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

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
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
    let r = (|| {
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
    })();
    let (r, prompt) = count_bad(&state, r)?;
    // 16 tokens is OpenAI's default for completions.
    let out = generate(state.clone(), r, prompt, Kind::Completion, Some(16)).await;
    count_bad(&state, out)
}

async fn chat_completions(State(state): State<Arc<ServerState>>, body: Bytes) -> Result<Response, ApiError> {
    let r = (|| {
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
    })();
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
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
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
