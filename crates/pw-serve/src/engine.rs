//! The continuous-batching scheduler: one thread owns the model and runs steps; requests come
//! in through a channel and their tokens go out through one channel each.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pw_models::{Sampler, SamplingConfig};
use tokenizers::Tokenizer;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::schedule::{ArrivalReserve, Candidate, Running, StepLimits, StepPlan, plan_step};
use crate::{
    BoundaryHook, BoundaryState, DecodeSlot, IncrementalDetokenizer, KvDemand, KvLayout, Metrics,
    PrefillOutcome, PrefillSlot, ServeError, StepError, StepModel, StepTiming, StopText,
};

/// How admission reserves KV memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Admission {
    /// Reserve prompt + `max_tokens` at admission: a running sequence never waits, but the
    /// budget holds fewer sequences than it could (most stop long before `max_tokens`).
    Reserve,
    /// Reserve what a sequence holds plus its next token. When the running sequences outgrow
    /// the budget, the latest submitted ones are preempted: their KV is freed, their state
    /// (sampler, detokenizer, tokens so far) kept, and they resume before any new request by
    /// recomputing prompt + generated tokens in prefill chunks. Their streams only see a pause.
    #[default]
    Preempt,
}

impl std::str::FromStr for Admission {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reserve" => Ok(Self::Reserve),
            "preempt" => Ok(Self::Preempt),
            other => Err(format!("unknown admission policy `{other}` (expected `reserve` or `preempt`)")),
        }
    }
}

/// Scheduler limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// KV bytes the running sequences may reserve together (see [`Admission`]).
    pub kv_budget_bytes: u64,
    /// How admission reserves KV memory.
    pub admission: Admission,
    /// Most sequences running at once.
    pub max_batch: usize,
    /// Longest sequence (prompt + generated tokens).
    pub max_context: usize,
    /// Tokens through the model per step at most, decodes and prompt chunks together (at
    /// least `max_batch`, so every running sequence decodes each step): long prompts are split
    /// across steps and running sequences keep decoding while they arrive.
    pub max_step_tokens: usize,
    /// Most requests waiting for admission; beyond it `submit` refuses with
    /// [`ServeError::Overloaded`] (HTTP 429) instead of queueing without bound.
    pub max_waiting: usize,
    /// Tokens that end a sequence unless the request sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
}

/// Per-request sampling and stopping.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Nucleus threshold (1 = off).
    pub top_p: f32,
    /// Sampler seed; `None` picks one.
    pub seed: Option<u64>,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Generation ends before the first occurrence of any of these in the text.
    pub stop: Vec<String>,
    /// Generation ends after any of these tokens.
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// A tokenized prompt and how to continue it.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (a final stop token included).
    pub completion_tokens: usize,
}

/// What a request's stream yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token and the text it completes (often empty: a partial character, or text
    /// held back because it may begin a stop string).
    Token {
        /// The token id.
        id: u32,
        /// New text.
        text: String,
    },
    /// The end: text still held back, and why it ended.
    Done {
        /// Last text.
        text: String,
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The model failed; the sequence is gone.
    Failed(String),
}

/// A finished request, collected.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The generated text.
    pub text: String,
    /// The generated token ids.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub reason: FinishReason,
    /// Token counts.
    pub usage: Usage,
}

/// Receives one request's events; dropping it cancels the request (its sequence and KV are
/// freed at the next step).
#[derive(Debug)]
pub struct RequestStream {
    id: u64,
    rx: UnboundedReceiver<Event>,
}

impl RequestStream {
    /// The engine's id of this request.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` once the stream is over (after `Done`/`Failed`, or if the engine
    /// stopped).
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// [`RequestStream::next`] for synchronous callers (not inside an async runtime).
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }

    fn fold(c: &mut Completion, ev: Event) -> Result<bool, ServeError> {
        match ev {
            Event::Token { id, text } => {
                c.tokens.push(id);
                c.text.push_str(&text);
                Ok(false)
            }
            Event::Done { text, reason, usage } => {
                c.text.push_str(&text);
                c.reason = reason;
                c.usage = usage;
                Ok(true)
            }
            Event::Failed(msg) => Err(ServeError::Step(msg)),
        }
    }

    /// Waits for the whole completion.
    pub async fn collect(mut self) -> Result<Completion, ServeError> {
        let mut c = Completion {
            text: String::new(),
            tokens: Vec::new(),
            reason: FinishReason::Length,
            usage: Usage::default(),
        };
        while let Some(ev) = self.next().await {
            if Self::fold(&mut c, ev)? {
                return Ok(c);
            }
        }
        Err(ServeError::EngineStopped)
    }

    /// [`RequestStream::collect`] for synchronous callers.
    pub fn collect_blocking(mut self) -> Result<Completion, ServeError> {
        let mut c = Completion {
            text: String::new(),
            tokens: Vec::new(),
            reason: FinishReason::Length,
            usage: Usage::default(),
        };
        while let Some(ev) = self.blocking_next() {
            if Self::fold(&mut c, ev)? {
                return Ok(c);
            }
        }
        Err(ServeError::EngineStopped)
    }
}

/// What every handle needs to check requests without asking the engine thread.
#[derive(Debug)]
struct Limits {
    vocab_size: usize,
    kv: KvLayout,
    config: EngineConfig,
    weight_bytes: u64,
}

/// The engine thread's answer to a page-table request.
type PageTableReply = tokio::sync::oneshot::Sender<Result<Option<crate::PageTableView>, String>>;

enum Msg {
    Submit(Pending),
    /// The page table, read between two steps.
    PageTable(PageTableReply),
    Shutdown,
}

/// Submits requests to a running [`Engine`]; cheap to clone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Msg>,
    metrics: Arc<Metrics>,
    limits: Arc<Limits>,
    next_id: Arc<AtomicU64>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Submit(p) => write!(f, "Submit({})", p.id),
            Msg::PageTable(_) => write!(f, "PageTable"),
            Msg::Shutdown => write!(f, "Shutdown"),
        }
    }
}

impl EngineHandle {
    /// Checks `req` and queues it. Errors are the client's ([`ServeError::InvalidRequest`]) or
    /// [`ServeError::EngineStopped`].
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, ServeError> {
        let l = &self.limits;
        let p = &req.params;
        if req.prompt.is_empty() {
            return Err(ServeError::invalid("prompt", "the prompt has no tokens"));
        }
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= l.vocab_size) {
            return Err(ServeError::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary of {}", l.vocab_size),
            ));
        }
        if p.max_tokens == 0 {
            return Err(ServeError::invalid("max_tokens", "max_tokens must be at least 1"));
        }
        // Checked: a max_tokens near usize::MAX must not wrap past the context check.
        let total = req.prompt.len().checked_add(p.max_tokens).filter(|&n| n <= l.config.max_context);
        let Some(total) = total else {
            return Err(ServeError::invalid(
                "max_tokens",
                format!(
                    "the prompt ({} tokens) plus max_tokens ({}) exceeds the context length of {} tokens",
                    req.prompt.len(),
                    p.max_tokens,
                    l.config.max_context
                ),
            ));
        };
        if !(p.temperature.is_finite() && p.temperature >= 0.0) {
            return Err(ServeError::invalid("temperature", "temperature must be a finite number ≥ 0"));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(ServeError::invalid("top_p", "top_p must be in (0, 1]"));
        }
        if let Some(bad) = p.stop_token_ids.iter().find(|&&t| t as usize >= l.vocab_size) {
            return Err(ServeError::invalid(
                "stop_token_ids",
                format!("token id {bad} is outside the vocabulary of {}", l.vocab_size),
            ));
        }
        let projected = l.kv.bytes_for(total);
        if projected > l.config.kv_budget_bytes {
            return Err(ServeError::invalid(
                "max_tokens",
                format!(
                    "the request needs {projected} KV bytes (prompt {} + max_tokens {} tokens), more than the \
                     whole KV budget of {} bytes; lower max_tokens or shorten the prompt",
                    req.prompt.len(),
                    p.max_tokens,
                    l.config.kv_budget_bytes
                ),
            ));
        }
        let mut queued = None;
        self.metrics.update(|m| {
            if m.queue_length >= l.config.max_waiting as u64 {
                queued = Some(m.queue_length);
            } else {
                m.requests_total += 1;
                m.queue_length += 1;
            }
        });
        if let Some(n) = queued {
            return Err(ServeError::Overloaded(format!(
                "{n} requests are waiting, the most this server queues; retry later"
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let pending = Pending { id, req, projected, tx, submitted: Instant::now() };
        self.tx.send(Msg::Submit(pending)).map_err(|_| ServeError::EngineStopped)?;
        Ok(RequestStream { id, rx })
    }

    /// The engine's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The model's page table, read by the engine thread between two steps (at once when it
    /// is idle); `None` for a model without paged experts.
    pub async fn page_table(&self) -> Result<Option<crate::PageTableView>, ServeError> {
        self.ask_page_table()?.await.map_err(|_| ServeError::EngineStopped)?.map_err(ServeError::Model)
    }

    /// [`Self::page_table`] for callers outside an async runtime (blocks until the step in
    /// flight ends).
    pub fn blocking_page_table(&self) -> Result<Option<crate::PageTableView>, ServeError> {
        self.ask_page_table()?
            .blocking_recv()
            .map_err(|_| ServeError::EngineStopped)?
            .map_err(ServeError::Model)
    }

    fn ask_page_table(
        &self,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<Option<crate::PageTableView>, String>>, ServeError>
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Msg::PageTable(tx)).map_err(|_| ServeError::EngineStopped)?;
        Ok(rx)
    }

    /// The scheduler limits.
    pub fn config(&self) -> &EngineConfig {
        &self.limits.config
    }

    /// The model's KV layout.
    pub fn kv_layout(&self) -> &KvLayout {
        &self.limits.kv
    }

    /// The model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.limits.vocab_size
    }

    /// Bytes of the model's weights.
    pub fn weight_bytes(&self) -> u64 {
        self.limits.weight_bytes
    }
}

/// The scheduler thread and a handle to it.
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the scheduler thread, which owns `model` and calls `hook` between steps.
    pub fn start(
        model: Box<dyn StepModel>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        hook: Box<dyn BoundaryHook>,
    ) -> Result<Self, ServeError> {
        if config.max_batch == 0 {
            return Err(ServeError::invalid("max_batch", "max_batch must be at least 1"));
        }
        if config.max_context == 0 {
            return Err(ServeError::invalid("max_context", "max_context must be at least 1"));
        }
        if config.max_waiting == 0 {
            return Err(ServeError::invalid("max_waiting", "max_waiting must be at least 1"));
        }
        if config.max_step_tokens < config.max_batch {
            return Err(ServeError::invalid(
                "max_step_tokens",
                format!(
                    "max_step_tokens ({}) must be at least max_batch ({}): every running sequence \
                     decodes one token per step",
                    config.max_step_tokens, config.max_batch
                ),
            ));
        }
        let limits = Arc::new(Limits {
            vocab_size: model.vocab_size(),
            kv: model.kv_layout().clone(),
            config: config.clone(),
            weight_bytes: model.weight_bytes(),
        });
        let metrics = Arc::new(Metrics::default());
        let mut model = model;
        // The paged memory's state from the start (a first boundary, before any step).
        let memory = model.boundary(KvDemand::default()).map_err(|e| ServeError::Model(e.to_string()))?;
        metrics.update(|m| {
            m.kv_budget_bytes = config.kv_budget_bytes;
            m.weight_bytes = limits.weight_bytes;
            m.memory = memory;
        });
        let (tx, rx) = mpsc::channel();
        let mut worker = Worker {
            settled: true,
            kv_layout: limits.kv.clone(),
            model,
            tokenizer,
            config,
            hook,
            metrics: metrics.clone(),
            rx,
            waiting: VecDeque::new(),
            preempted: VecDeque::new(),
            active: Vec::new(),
            reserved: 0,
            step: 0,
            oom_strikes: 0,
            batch_cap: usize::MAX,
            cap_free_blocks: None,
            arrivals: ArrivalReserve::new(ARRIVAL_WINDOW),
            seed_base: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
        };
        let thread = std::thread::Builder::new()
            .name("pw-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| ServeError::Model(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            handle: EngineHandle { tx, metrics, limits, next_id: Arc::new(AtomicU64::new(1)) },
            thread: Some(thread),
        })
    }

    /// A handle for submitting requests.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops the thread (running requests end without a `Done` event) and waits for it.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.handle.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Pending {
    id: u64,
    req: GenerateRequest,
    projected: u64,
    tx: UnboundedSender<Event>,
    submitted: Instant,
}

struct Active {
    id: u64,
    prompt_len: usize,
    /// Prompt then generated ids: what a preempted sequence recomputes when it resumes.
    tokens: Vec<u32>,
    /// Leading `tokens` in the model's cache; the others go in with the coming steps (the
    /// rest of the prompt in chunks, or the last generated token).
    computed: usize,
    params: SamplingParams,
    sampler: Sampler,
    generated: usize,
    detok: IncrementalDetokenizer,
    stop: StopText,
    tx: UnboundedSender<Event>,
    reserved: u64,
    submitted: Instant,
    last_token_at: Option<Instant>,
}

/// Consecutive steps a model may answer [`StepError::OutOfMemory`] (each followed by a
/// boundary, where the planner can free memory) before the sequences involved fail.
const OOM_RETRIES: u32 = 256;

/// Pause between boundaries of an idle engine whose memory has not settled.
const IDLE_BOUNDARY: Duration = Duration::from_millis(1);

/// How long after the last submitted request the planner keeps KV memory for the next one
/// ([`ArrivalReserve`]).
const ARRIVAL_WINDOW: Duration = Duration::from_secs(2);

/// Tokens ahead whose KV growth the planner counts for every running sequence (at most to its
/// `max_tokens`): a decode step takes a block now and then, and pages lowered for each block
/// as it comes would go back up and down with every sequence that ends.
const GROWTH_HORIZON: usize = 64;

/// The state owned by the engine thread.
struct Worker {
    /// Whether the model's last boundary changed nothing (an idle engine may block then).
    settled: bool,
    kv_layout: KvLayout,
    model: Box<dyn StepModel>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    hook: Box<dyn BoundaryHook>,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<Msg>,
    waiting: VecDeque<Pending>,
    /// Preempted sequences, oldest request first; they resume before `waiting` is admitted.
    preempted: VecDeque<Active>,
    active: Vec<Active>,
    reserved: u64,
    step: u64,
    seed_base: u64,
    /// Consecutive steps that produced nothing because the model was out of KV memory.
    oom_strikes: u32,
    /// Most sequences running at once as the model's memory allows: lowered when it runs out
    /// of KV memory, lifted once a sequence ends and frees some or the model's boundary reports
    /// more free KV blocks than when it was set (the planner lowered pages).
    batch_cap: usize,
    /// Free KV blocks the model reported when `batch_cap` was last lowered.
    cap_free_blocks: Option<u64>,
    /// KV memory kept for the next request while requests keep arriving.
    arrivals: ArrivalReserve,
}

/// What happened to a sequence after its new token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    Running,
    Finished,
    Cancelled,
    Failed,
}

/// What one model call of a step produced.
#[derive(Debug, Default, Clone, Copy)]
struct Ran {
    /// Tokens sampled.
    generated: usize,
    /// Prompt and recomputed tokens that went into the cache.
    prefilled: u64,
}

impl std::ops::AddAssign for Ran {
    fn add_assign(&mut self, o: Self) {
        self.generated += o.generated;
        self.prefilled += o.prefilled;
    }
}

/// Runs `f`, turning a panic inside the model into a step error so the engine keeps serving.
fn guarded<T>(f: impl FnOnce() -> Result<T, StepError>) -> Result<T, StepError> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => Err(StepError::Failed(
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the model panicked".into()),
        )),
    }
}

/// Ends `seqs` with `msg` (their KV is freed with the step's other ended sequences).
fn fail_all(seqs: impl Iterator<Item = Active>, msg: &str, ended: &mut Vec<(Active, After)>) {
    for a in seqs {
        let _ = a.tx.send(Event::Failed(msg.to_string()));
        ended.push((a, After::Failed));
    }
}

/// Hands a sequence its new token: detokenizes, applies the stop rules and sends the events.
/// A sequence ends at `max_context` tokens whatever its `max_tokens`.
fn deliver(
    a: &mut Active,
    tok: u32,
    tokenizer: &Tokenizer,
    eos: &[u32],
    max_context: usize,
    metrics: &Metrics,
) -> After {
    let now = Instant::now();
    let gap = now.duration_since(a.last_token_at.unwrap_or(a.submitted)).as_secs_f64();
    let first = a.last_token_at.is_none();
    metrics.update(|m| {
        if first {
            m.time_to_first_token_seconds_sum += gap;
            m.time_to_first_token_count += 1;
        } else {
            m.time_per_output_token_seconds_sum += gap;
            m.time_per_output_token_count += 1;
        }
    });
    a.last_token_at = Some(now);
    a.generated += 1;
    a.tokens.push(tok);
    let piece = match a.detok.push(tokenizer, tok) {
        Ok(p) => p,
        Err(e) => {
            let _ = a.tx.send(Event::Failed(e.to_string()));
            return After::Failed;
        }
    };
    let usage = Usage { prompt_tokens: a.prompt_len, completion_tokens: a.generated };
    let out = a.stop.push(&piece);
    if out.stopped {
        let _ = a.tx.send(Event::Token { id: tok, text: out.emit });
        let sent = a.tx.send(Event::Done { text: String::new(), reason: FinishReason::Stop, usage });
        return if sent.is_ok() { After::Finished } else { After::Cancelled };
    }
    let stop_token = (!a.params.ignore_eos && eos.contains(&tok)) || a.params.stop_token_ids.contains(&tok);
    let reason = if stop_token {
        Some(FinishReason::Stop)
    } else if a.generated >= a.params.max_tokens || a.tokens.len() >= max_context {
        Some(FinishReason::Length)
    } else {
        None
    };
    if a.tx.send(Event::Token { id: tok, text: out.emit }).is_err() {
        return After::Cancelled;
    }
    let Some(reason) = reason else { return After::Running };
    // The end: release what the detokenizer and the stop matcher held back.
    let tail = a.detok.flush(tokenizer).unwrap_or_default();
    let o = a.stop.push(&tail);
    let (text, reason) =
        if o.stopped { (o.emit, FinishReason::Stop) } else { (o.emit + &a.stop.finish(), reason) };
    match a.tx.send(Event::Done { text, reason, usage }) {
        Ok(()) => After::Finished,
        Err(_) => After::Cancelled,
    }
}

impl Worker {
    fn run(&mut self) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() && self.preempted.is_empty() {
                // Idle but the model's memory is still moving (pages going back up now that the
                // cache is empty): keep calling boundaries until it settles. Memory held for
                // the next request goes back when its reserve ends: a boundary then.
                let wait =
                    if self.settled { self.arrivals.ends_in(Instant::now()) } else { Some(IDLE_BOUNDARY) };
                if let Some(wait) = wait {
                    match self.rx.recv_timeout(wait) {
                        Ok(Msg::Submit(p)) => self.enqueue(p),
                        Ok(Msg::PageTable(reply)) => {
                            self.answer_page_table(reply);
                            continue;
                        }
                        Ok(Msg::Shutdown) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            self.memory_boundary();
                            continue;
                        }
                    }
                } else {
                    // Idle: block until work arrives (or every handle is gone).
                    match self.rx.recv() {
                        Ok(Msg::Submit(p)) => self.enqueue(p),
                        Ok(Msg::PageTable(reply)) => {
                            self.answer_page_table(reply);
                            continue;
                        }
                        Ok(Msg::Shutdown) | Err(_) => return,
                    }
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(Msg::Submit(p)) => self.enqueue(p),
                    Ok(Msg::PageTable(reply)) => self.answer_page_table(reply),
                    Ok(Msg::Shutdown) => return,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if self.active.is_empty() && self.waiting.is_empty() && self.preempted.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            self.drop_cancelled();
            self.preempt();
            let plan = self.plan();
            self.admit(plan.admit.len());
            let (tokens, timing) = self.step(plan);
            self.boundary(tokens, timing);
        }
    }

    /// Queues a submitted request and notes what its KV will need (the next steps' growth
    /// included) for [`Self::kv_demand`].
    fn enqueue(&mut self, p: Pending) {
        let len = p.req.prompt.len() + p.req.params.max_tokens.min(GROWTH_HORIZON);
        self.arrivals.note(p.submitted, self.kv_layout.bytes_for(len.min(self.config.max_context)));
        self.waiting.push_back(p);
    }

    /// Frees requests whose receiver is gone: queued ones leave the queue, running ones free
    /// their KV now.
    fn drop_cancelled(&mut self) {
        let before = self.waiting.len() + self.preempted.len();
        self.waiting.retain(|p| !p.tx.is_closed());
        // A preempted sequence holds no KV (nor reservation): dropping it is enough.
        self.preempted.retain(|a| !a.tx.is_closed());
        let mut cancelled = (before - self.waiting.len() - self.preempted.len()) as u64;
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].tx.is_closed() {
                let a = self.active.swap_remove(i);
                self.release(&a);
                cancelled += 1;
            } else {
                i += 1;
            }
        }
        if cancelled > 0 {
            self.batch_cap = usize::MAX;
            self.metrics.update(|m| m.requests_cancelled_total += cancelled);
        }
    }

    fn release(&mut self, a: &Active) {
        // Memory given back: the next boundary may raise pages (also when idle).
        self.settled = false;
        self.model.release(a.id);
        self.reserved -= a.reserved;
    }

    /// [`Admission::Preempt`]: sizes each running sequence's reservation for the coming step
    /// (the tokens its KV will hold after it) and, while they outgrow the budget, preempts the
    /// latest submitted one: its KV is freed and it waits, state intact, to be resumed.
    fn preempt(&mut self) {
        if self.config.admission != Admission::Preempt {
            return;
        }
        for a in &mut self.active {
            a.reserved = self.kv_layout.bytes_for(a.tokens.len());
        }
        self.reserved = self.active.iter().map(|a| a.reserved).sum();
        let mut preempted = 0;
        // One sequence always fits: `submit` refuses requests that cannot fit alone.
        while self.reserved > self.config.kv_budget_bytes && self.active.len() > 1 {
            let Some(i) = (0..self.active.len()).max_by_key(|&i| self.active[i].id) else { break };
            let a = self.active.swap_remove(i);
            self.requeue(a);
            preempted += 1;
        }
        if preempted > 0 {
            self.metrics.update(|m| m.requests_preempted_total += preempted);
        }
    }

    /// The step's plan ([`plan_step`]): running sequences oldest first, then the preempted
    /// (oldest request first) and the queued requests as candidates.
    fn plan(&mut self) -> StepPlan {
        self.active.sort_by_key(|a| a.id);
        let kv = &self.kv_layout;
        let running: Vec<Running> =
            self.active.iter().map(|a| Running { pending: a.tokens.len() - a.computed }).collect();
        let batch = self.config.max_batch.min(self.batch_cap).max(1);
        let room = batch.saturating_sub(self.active.len()).max(1);
        let candidates: Vec<Candidate> = self
            .preempted
            .iter()
            .map(|a| Candidate { tokens: a.tokens.len(), kv_bytes: kv.bytes_for(a.tokens.len()) })
            .chain(
                self.waiting
                    .iter()
                    .map(|p| Candidate { tokens: p.req.prompt.len(), kv_bytes: self.admission_bytes(p) }),
            )
            .take(room)
            .collect();
        let limits = StepLimits {
            tokens: self.config.max_step_tokens,
            batch,
            kv_room: self.config.kv_budget_bytes.saturating_sub(self.reserved),
        };
        plan_step(&running, &candidates, limits)
    }

    /// KV bytes admission reserves for queued request `p` (see [`Admission`]).
    fn admission_bytes(&self, p: &Pending) -> u64 {
        match self.config.admission {
            Admission::Reserve => p.projected,
            Admission::Preempt => self.kv_layout.bytes_for(p.req.prompt.len()),
        }
    }

    /// Moves the first `n` candidates to the running set, preempted ones first, then queued
    /// requests first come first served; each reserves its KV bytes and starts with an empty
    /// cache (a resumed sequence recomputes its prompt and what it generated).
    fn admit(&mut self, n: usize) {
        let mut prompt_tokens = 0;
        for _ in 0..n {
            if let Some(mut a) = self.preempted.pop_front() {
                a.reserved = self.kv_layout.bytes_for(a.tokens.len());
                a.computed = 0;
                self.reserved += a.reserved;
                self.active.push(a);
                continue;
            }
            let Some(p) = self.waiting.pop_front() else { break };
            let len = p.req.prompt.len();
            let need = self.admission_bytes(&p);
            self.reserved += need;
            prompt_tokens += len as u64;
            let params = p.req.params;
            // Unseeded requests still get distinct, fixed streams.
            let seed = params.seed.unwrap_or(self.seed_base ^ p.id.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let sampler = Sampler::new(SamplingConfig {
                temperature: params.temperature,
                top_k: params.top_k,
                top_p: params.top_p,
                seed,
                max_tokens: params.max_tokens,
                stop_tokens: Vec::new(),
            });
            self.active.push(Active {
                id: p.id,
                prompt_len: len,
                detok: IncrementalDetokenizer::new(&p.req.prompt),
                tokens: p.req.prompt,
                computed: 0,
                stop: StopText::new(&params.stop),
                params,
                sampler,
                generated: 0,
                tx: p.tx,
                reserved: need,
                submitted: p.submitted,
                last_token_at: None,
            });
        }
        if prompt_tokens > 0 {
            self.metrics.update(|m| m.prompt_tokens_total += prompt_tokens);
        }
    }

    /// One step as `plan` says (the running sequences sorted oldest first, the admitted ones
    /// after them): one model call for the sequences that decode, one for the prompt chunks.
    /// Returns the number of tokens generated and the calls' times.
    fn step(&mut self, plan: StepPlan) -> (usize, StepTiming) {
        let eos = std::mem::take(&mut self.config.eos_token_ids);
        let mut ended: Vec<(Active, After)> = Vec::new();
        let (mut decode, mut prefill) = (Vec::new(), Vec::new());
        let feed = plan.feed.into_iter().chain(plan.admit);
        for (a, n) in std::mem::take(&mut self.active).into_iter().zip(feed) {
            match n {
                0 => self.active.push(a),
                1 if a.computed > 0 && a.computed + 1 == a.tokens.len() => decode.push(a),
                n => prefill.push((a, n)),
            }
        }
        let mut ran = Ran::default();
        let mut timing = StepTiming { decode_seqs: decode.len(), ..StepTiming::default() };
        if !decode.is_empty() {
            let t0 = Instant::now();
            let model = &mut self.model;
            let result = {
                let mut slots: Vec<DecodeSlot<'_>> = decode
                    .iter_mut()
                    .map(|a| DecodeSlot { seq: a.id, last: a.tokens[a.computed], sampler: &mut a.sampler })
                    .collect();
                guarded(|| model.decode(&mut slots))
            };
            timing.decode = t0.elapsed();
            let result = result.map(|o| o.into_iter().map(|r| r.map(Some)).collect());
            let fed = decode.into_iter().map(|a| (a, 1)).collect();
            ran += self.conclude(fed, result, &eos, &mut ended);
        }
        if !prefill.is_empty() {
            timing.prefill_tokens = prefill.iter().map(|(_, n)| n).sum();
            let t0 = Instant::now();
            let model = &mut self.model;
            let result = {
                let mut slots: Vec<PrefillSlot<'_>> = prefill
                    .iter_mut()
                    .map(|(a, n)| PrefillSlot {
                        seq: a.id,
                        start: a.computed,
                        tokens: &a.tokens[a.computed..a.computed + *n],
                        sample: a.computed + *n == a.tokens.len(),
                        sampler: &mut a.sampler,
                    })
                    .collect();
                guarded(|| model.prefill(&mut slots))
            };
            timing.prefill = t0.elapsed();
            ran += self.conclude(prefill, result, &eos, &mut ended);
        }
        if ran.generated > 0 {
            self.oom_strikes = 0;
        }
        self.metrics.update(|m| {
            m.step_prefill_tokens = ran.prefilled;
            m.prefill_tokens_total += ran.prefilled;
            m.decode_seconds_total += timing.decode.as_secs_f64();
            m.prefill_seconds_total += timing.prefill.as_secs_f64();
        });
        self.end(ended);
        self.config.eos_token_ids = eos;
        (ran.generated, timing)
    }

    /// Settles one model call of the step: its outcomes, or (out of KV memory, nothing ran)
    /// the newest sequence of the call makes room and the others run again next step, or
    /// (any other error of the whole call) every sequence of the call fails.
    fn conclude(
        &mut self,
        mut seqs: Vec<(Active, usize)>,
        result: Result<Vec<PrefillOutcome>, StepError>,
        eos: &[u32],
        ended: &mut Vec<(Active, After)>,
    ) -> Ran {
        match self.outcomes(result, seqs.len()) {
            Ok(outcomes) => self.settle(seqs, outcomes, eos, ended),
            Err(StepError::OutOfMemory(_)) if self.oom_strikes < OOM_RETRIES => {
                // Requeued, the newest frees its KV; with a single sequence in the call, the
                // boundary's planner makes room (an admitted request fits alone).
                self.oom_strikes += 1;
                self.metrics.update(|m| m.calls_out_of_memory_total += 1);
                if seqs.len() > 1 || !self.active.is_empty() {
                    let newest = (0..seqs.len()).max_by_key(|&i| seqs[i].0.id).unwrap_or(0);
                    let (a, _) = seqs.swap_remove(newest);
                    if a.computed > 0 {
                        self.metrics.update(|m| m.requests_preempted_total += 1);
                    }
                    self.requeue(a);
                }
                self.active.extend(seqs.into_iter().map(|(a, _)| a));
                self.batch_cap = self.active.len().max(1);
                let free = self.metrics.snapshot().memory.map(|m| m.kv_blocks_free);
                self.cap_free_blocks = free;
                Ran::default()
            }
            Err(e) => {
                if matches!(e, StepError::OutOfMemory(_)) {
                    let n = seqs.len() as u64;
                    self.metrics.update(|m| m.requests_failed_out_of_memory_total += n);
                }
                fail_all(seqs.into_iter().map(|(a, _)| a), &e.to_string(), ended);
                Ran::default()
            }
        }
    }

    /// Frees the sequences that ended this step and counts them.
    fn end(&mut self, ended: Vec<(Active, After)>) {
        if ended.is_empty() {
            return;
        }
        // Memory came back: the batch may grow again.
        self.batch_cap = usize::MAX;
        self.cap_free_blocks = None;
        let (mut finished, mut cancelled, mut failed) = (0, 0, 0);
        for (a, after) in &ended {
            self.release(a);
            match after {
                After::Finished => finished += 1,
                After::Cancelled => cancelled += 1,
                After::Failed => failed += 1,
                After::Running => {}
            }
        }
        self.metrics.update(|m| {
            m.requests_finished_total += finished;
            m.requests_cancelled_total += cancelled;
            m.requests_failed_total += failed;
        });
    }

    /// A model call's outcomes, one per slot, or the error of the whole call.
    fn outcomes(
        &self,
        result: Result<Vec<PrefillOutcome>, StepError>,
        n: usize,
    ) -> Result<Vec<PrefillOutcome>, StepError> {
        let outcomes = result?;
        if outcomes.len() != n {
            return Err(StepError::failed(format!(
                "the model returned {} outcomes for {n} sequences",
                outcomes.len()
            )));
        }
        Ok(outcomes)
    }

    /// Hands each sequence its outcome: its fed tokens are now in the cache, and a sampled
    /// token goes on to [`deliver`]; an error ends that sequence alone.
    fn settle(
        &mut self,
        seqs: Vec<(Active, usize)>,
        outcomes: Vec<PrefillOutcome>,
        eos: &[u32],
        ended: &mut Vec<(Active, After)>,
    ) -> Ran {
        let mut ran = Ran::default();
        for ((mut a, fed), outcome) in seqs.into_iter().zip(outcomes) {
            if outcome.is_ok() {
                // All but a generated token's first pass are prompt or recomputed tokens.
                let fresh = a.generated > 0 && a.computed + fed == a.tokens.len();
                ran.prefilled += (fed - usize::from(fresh)) as u64;
                a.computed += fed;
            }
            match outcome {
                Ok(None) => self.active.push(a),
                Ok(Some(t)) => {
                    ran.generated += 1;
                    let max_context = self.config.max_context;
                    match deliver(&mut a, t, &self.tokenizer, eos, max_context, &self.metrics) {
                        After::Running => self.active.push(a),
                        after => ended.push((a, after)),
                    }
                }
                Err(e) => fail_all(std::iter::once(a), &e.to_string(), ended),
            }
        }
        ran
    }

    /// Frees a running sequence's KV and puts it, state intact, among the preempted (oldest
    /// request first): it resumes by recomputing its tokens.
    fn requeue(&mut self, a: Active) {
        self.release(&a);
        let at = self.preempted.partition_point(|p| p.id < a.id);
        self.preempted.insert(at, a);
    }

    /// KV bytes the next steps will add (`next`): the running sequences' growth over the next
    /// [`GROWTH_HORIZON`] tokens (at most to their `max_tokens`), and the prompts of the
    /// candidates the batch has room for (at most what admission could still reserve) or, while
    /// requests keep arriving, the largest recent one ([`ArrivalReserve`]), whichever is more;
    /// and what they may add before they finish (`until_done`): the same with every sequence
    /// grown to its `max_tokens`.
    fn kv_demand(&self) -> KvDemand {
        let kv = &self.kv_layout;
        let max_context = self.config.max_context;
        let (mut next, mut until_done) = (0, 0);
        for a in &self.active {
            let end = (a.prompt_len + a.params.max_tokens).min(max_context).max(a.tokens.len() + 1);
            let ahead = (a.tokens.len() + GROWTH_HORIZON).min(end);
            let held = kv.bytes_for(a.computed);
            next += kv.bytes_for(ahead).saturating_sub(held);
            until_done += kv.bytes_for(end).saturating_sub(held);
        }
        let room = self.config.max_batch.saturating_sub(self.active.len());
        // (tokens now, tokens at the end) of the candidates the batch has room for.
        let queued: Vec<(usize, usize)> = self
            .preempted
            .iter()
            .map(|a| (a.tokens.len(), a.prompt_len + a.params.max_tokens))
            .chain(
                self.waiting
                    .iter()
                    .map(|p| (p.req.prompt.len(), p.req.prompt.len() + p.req.params.max_tokens)),
            )
            .take(room)
            .collect();
        let queued_next: u64 = queued.iter().map(|&(n, _)| kv.bytes_for(n)).sum();
        let queued_done: u64 = queued.iter().map(|&(n, end)| kv.bytes_for(end.min(max_context).max(n))).sum();
        let arriving = if room == 0 { 0 } else { self.arrivals.bytes(Instant::now()) };
        let admissible = self.config.kv_budget_bytes.saturating_sub(self.reserved);
        next += queued_next.max(arriving).min(admissible);
        until_done += queued_done.max(arriving).min(admissible);
        KvDemand { next, until_done: until_done.max(next) }
    }

    /// The model's own boundary (planner and page commits); its state goes to the metrics.
    fn memory_boundary(&mut self) -> Option<crate::MemoryState> {
        let demand = self.kv_demand();
        let model = &mut self.model;
        match guarded(|| model.boundary(demand)) {
            Ok(state) => {
                self.settled = state.as_ref().is_none_or(|m| m.settled);
                if let Some(m) = &state {
                    self.metrics.update(|s| s.memory = Some(m.clone()));
                }
                state
            }
            Err(e) => {
                // The model's memory state is unknown: end what runs, keep serving.
                self.settled = true;
                let failed = self.active.len() as u64;
                let msg = e.to_string();
                for a in std::mem::take(&mut self.active) {
                    let _ = a.tx.send(Event::Failed(msg.clone()));
                    self.release(&a);
                }
                self.metrics.update(|m| m.requests_failed_total += failed);
                None
            }
        }
    }

    /// Answers a page-table request (no model call is in flight here).
    fn answer_page_table(&self, reply: PageTableReply) {
        let _ = reply.send(self.model.page_table().map_err(|e| e.to_string()));
    }

    /// The step boundary: the model's memory boundary, publish the state (with the step's
    /// `timing` and the boundary's own), then let the hook act on it.
    fn boundary(&mut self, tokens: usize, timing: StepTiming) {
        self.step += 1;
        let t0 = Instant::now();
        let memory = self.memory_boundary();
        let timing = StepTiming { boundary: t0.elapsed(), ..timing };
        if let (Some(at), Some(m)) = (self.cap_free_blocks, &memory)
            && m.kv_blocks_free > at
        {
            // The planner made room since the model ran out: the batch may grow again.
            self.batch_cap = usize::MAX;
            self.cap_free_blocks = None;
        }
        let state = BoundaryState {
            step: self.step,
            active: self.active.len(),
            waiting: self.waiting.len() + self.preempted.len(),
            step_tokens: tokens,
            kv_bytes_used: self.model.kv_bytes_held(),
            kv_bytes_reserved: self.reserved,
            kv_budget_bytes: self.config.kv_budget_bytes,
            weight_bytes: self.model.weight_bytes(),
            memory,
            timing,
        };
        let kv = &self.kv_layout;
        let per_request: Vec<(u64, u64)> =
            self.active.iter().map(|a| (a.id, kv.bytes_for(a.computed))).collect();
        self.metrics.record_tokens(tokens as u64);
        if let Some(mem) = &state.memory {
            self.metrics.record_history(|t_s| crate::HistorySample {
                t_s,
                mean_bits: mem.mean_bits(),
                expert_bytes: mem.weight_bytes(),
                kv_bytes: mem.kv_blocks_used * mem.block_bytes,
                budget_bytes: mem.budget_bytes,
                queue: state.waiting as u64,
                active: state.active as u64,
            });
        }
        self.metrics.update(|m| {
            m.steps_total = state.step;
            m.boundary_seconds_total += timing.boundary.as_secs_f64();
            m.queue_length = state.waiting as u64;
            m.active_sequences = state.active as u64;
            m.kv_bytes_used = state.kv_bytes_used;
            m.kv_bytes_reserved = state.kv_bytes_reserved;
            m.weight_bytes = state.weight_bytes;
            m.request_kv_bytes = per_request;
        });
        self.hook.on_boundary(&state);
    }
}
