//! Language-model loss over token windows: the one convention shared by perplexity
//! evaluation and the calibration (Fisher) pass.
//!
//! The token stream is cut into disjoint consecutive windows of `ctx` tokens (a last partial
//! window is kept when it has at least two tokens); each window is an independent sequence
//! with a fresh cache, and its loss is the next-token negative log-likelihood at positions
//! `1..len`. Perplexity is `exp(Σ NLL / predicted tokens)`.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::common::{CausalLm, Trace};

/// Disjoint consecutive windows of `ctx` tokens; the last partial one is kept when it has at
/// least two tokens (one prediction).
///
/// # Panics
/// If `ctx < 2` (no window could predict anything).
pub fn token_windows(ids: &[u32], ctx: usize) -> Vec<&[u32]> {
    assert!(ctx >= 2, "a window needs at least 2 tokens, got ctx = {ctx}");
    ids.chunks(ctx).filter(|w| w.len() >= 2).collect()
}

/// Next-token NLL of every position of every window, from one batched forward with a fresh
/// cache. All windows must have the same length.
///
/// # Shapes
/// - `windows`: `batch` windows of `len >= 2` tokens
/// - output: `[batch, len - 1]`, entry `(b, j)` = `−log p(windows[b][j + 1] | windows[b][..=j])`
pub fn token_nll<B: Backend, M: CausalLm<B>>(
    model: &M,
    windows: &[&[u32]],
    device: &B::Device,
) -> Tensor<B, 2> {
    token_nll_traced(model, windows, device, None)
}

/// [`token_nll`] that also records the forward pass into `trace` (residual stream entering
/// each layer, router outputs), for statistics gathered while evaluating.
///
/// # Shapes
/// - `windows`: `batch` windows of `len >= 2` tokens
/// - output: `[batch, len - 1]`; `trace.hidden`: `[batch, len, hidden]` each
pub fn token_nll_traced<B: Backend, M: CausalLm<B>>(
    model: &M,
    windows: &[&[u32]],
    device: &B::Device,
    trace: Option<&mut Trace<B>>,
) -> Tensor<B, 2> {
    let b = windows.len();
    let len = windows.first().map_or(0, |w| w.len());
    assert!(b > 0 && len >= 2, "token_nll needs windows of at least 2 tokens");
    assert!(windows.iter().all(|w| w.len() == len), "windows of one batch must have the same length");
    let ids: Vec<i64> = windows.iter().flat_map(|w| w.iter().map(|&i| i as i64)).collect();
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, len]), device);
    let mut cache = model.new_cache();
    let logits = model.forward(ids.clone(), &mut cache, trace);
    let logp = log_softmax(logits.narrow(1, 0, len - 1), 2);
    let targets = ids.narrow(1, 1, len - 1).reshape([b, len - 1, 1]);
    logp.gather(2, targets).reshape([b, len - 1]).neg()
}

/// Running total of a perplexity evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Perplexity {
    /// Summed NLL (nats), in f64.
    pub nll: f64,
    /// Predicted tokens.
    pub tokens: usize,
}

impl Perplexity {
    /// Adds per-token NLLs (any shape).
    pub fn add<B: Backend, const D: usize>(&mut self, nll: Tensor<B, D>) {
        let values = nll.into_data().convert::<f64>().to_vec::<f64>().expect("float NLL");
        self.tokens += values.len();
        self.nll += values.iter().sum::<f64>();
    }

    /// `exp(nll / tokens)`; NaN before any token.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.tokens as f64).exp()
    }
}

/// Perplexity of `model` on `ids` with the module's window convention, running up to
/// `batch` equal-length windows per forward; `on_windows(n)` is called after each forward
/// with the number of windows it covered (for progress reporting).
pub fn perplexity<B: Backend, M: CausalLm<B>>(
    model: &M,
    ids: &[u32],
    ctx: usize,
    batch: usize,
    device: &B::Device,
    mut on_windows: impl FnMut(usize),
) -> Perplexity {
    perplexity_traced(model, ids, ctx, batch, device, false, |n, _| on_windows(n))
}

/// [`perplexity`] that hands each forward's [`Trace`] to `on_windows(n, trace)` (an empty
/// trace unless `traced`): routing statistics and residual features gathered in the same pass.
pub fn perplexity_traced<B: Backend, M: CausalLm<B>>(
    model: &M,
    ids: &[u32],
    ctx: usize,
    batch: usize,
    device: &B::Device,
    traced: bool,
    mut on_windows: impl FnMut(usize, &Trace<B>),
) -> Perplexity {
    let windows = token_windows(ids, ctx);
    let mut total = Perplexity::default();
    let mut i = 0;
    while i < windows.len() {
        let len = windows[i].len();
        let n = windows[i..].iter().take(batch.max(1)).take_while(|w| w.len() == len).count();
        let mut trace = Trace::default();
        let t = if traced { Some(&mut trace) } else { None };
        total.add(token_nll_traced(model, &windows[i..i + n], device, t));
        on_windows(n, &trace);
        i += n;
    }
    total
}
