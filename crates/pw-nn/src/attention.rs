//! Grouped-query attention with a KV cache, optional sliding window, QK/V norms and K=V.

use burn::module::Module;
use burn::tensor::activation::softmax;
use burn::tensor::{Tensor, TensorData, backend::Backend};

use crate::linear::Linear;
use crate::norm::{NormKind, RmsNorm};
use crate::rope::Rope;
use crate::source::{LoadError, WeightSource};

/// Geometry and options of one attention layer.
#[derive(Debug, Clone)]
pub struct AttentionConfig {
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Load q/k/v biases when the checkpoint has them.
    pub qkv_bias: bool,
    /// RMSNorm (with weight) on queries and keys per head, before RoPE (Gemma).
    pub qk_norm: bool,
    /// Weightless RMSNorm on values per head (Gemma).
    pub v_norm: bool,
    /// No `v_proj`: values are the raw key projection (Gemma-4 full layers).
    pub k_eq_v: bool,
    /// Score scale; `None` means `head_dim^-0.5`.
    pub scale: Option<f64>,
    /// Each query sees itself and the `window - 1` tokens before it.
    pub sliding_window: Option<usize>,
    /// Epsilon of the q/k/v norms.
    pub norm_eps: f64,
    /// Inverse RoPE frequencies, `head_dim / 2` values.
    pub inv_freq: Vec<f32>,
}

/// Keys and values of past tokens for one attention layer.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    k: Option<Tensor<B, 4>>,
    v: Option<Tensor<B, 4>>,
    /// Absolute position of the first cached entry (sliding layers drop old ones).
    first: usize,
    /// Tokens seen so far = absolute position of the next token.
    next: usize,
}

impl<B: Backend> Default for KvCache<B> {
    fn default() -> Self {
        Self { k: None, v: None, first: 0, next: 0 }
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens seen so far.
    pub fn seen(&self) -> usize {
        self.next
    }

    /// Entries actually held (at most the window minus one on sliding layers).
    pub fn held(&self) -> usize {
        self.next - self.first
    }
}

/// Multi-head attention with grouped key/value heads.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection.
    pub q_proj: Linear<B>,
    /// Key projection.
    pub k_proj: Linear<B>,
    /// Value projection; absent when K = V.
    pub v_proj: Option<Linear<B>>,
    /// Output projection.
    pub o_proj: Linear<B>,
    /// Per-head query norm.
    pub q_norm: Option<RmsNorm<B>>,
    /// Per-head key norm.
    pub k_norm: Option<RmsNorm<B>>,
    /// Per-head value norm.
    pub v_norm: Option<RmsNorm<B>>,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f64,
    /// Sliding window (0 = none).
    pub window: usize,
    /// Rotary embedding.
    #[module(skip)]
    pub rope: Rope,
}

impl AttentionConfig {
    /// Loads `{prefix}.{q,k,v,o}_proj` and, as configured, `{prefix}.{q,k}_norm`.
    pub fn load<B: Backend>(
        &self,
        src: &impl WeightSource<B>,
        prefix: &str,
    ) -> Result<Attention<B>, LoadError> {
        let (h, hd) = (self.hidden, self.head_dim);
        let (q_out, kv_out) = (self.n_heads * hd, self.n_kv_heads * hd);
        let proj = |name: &str, d_in, d_out, bias_allowed: bool| {
            let p = format!("{prefix}.{name}");
            if bias_allowed {
                Linear::load_auto_bias(src, &p, d_in, d_out)
            } else {
                Linear::load(src, &p, d_in, d_out, false)
            }
        };
        let norm =
            |name: &str, kind| RmsNorm::load(src, &format!("{prefix}.{name}"), hd, self.norm_eps, kind);
        Ok(Attention {
            q_proj: proj("q_proj", h, q_out, self.qkv_bias)?,
            k_proj: proj("k_proj", h, kv_out, self.qkv_bias)?,
            v_proj: if self.k_eq_v { None } else { Some(proj("v_proj", h, kv_out, self.qkv_bias)?) },
            o_proj: proj("o_proj", q_out, h, false)?,
            q_norm: self.qk_norm.then(|| norm("q_norm", NormKind::Scale)).transpose()?,
            k_norm: self.qk_norm.then(|| norm("k_norm", NormKind::Scale)).transpose()?,
            v_norm: self.v_norm.then(|| norm("v_norm", NormKind::Weightless)).transpose()?,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: hd,
            scale: self.scale.unwrap_or((hd as f64).powf(-0.5)),
            window: self.sliding_window.unwrap_or(0),
            rope: Rope::new(self.inv_freq.clone()),
        })
    }
}

impl<B: Backend> Attention<B> {
    /// Attends the new tokens `x` to the cached ones and to each other (causally), then
    /// appends them to `cache`.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]` (new tokens only)
    /// - output: `[batch, seq, hidden]`
    pub fn forward(&self, x: Tensor<B, 3>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let start = cache.next;

        let mut q = self.q_proj.forward(x.clone()).reshape([b, t, nh, hd]);
        if let Some(n) = &self.q_norm {
            q = n.forward(q);
        }
        let q = self.rope.apply(q.swap_dims(1, 2), start);

        let k_raw = self.k_proj.forward(x.clone()).reshape([b, t, nkv, hd]);
        // K = V layers take values from the key projection before its norm and RoPE.
        let mut v = match &self.v_proj {
            Some(p) => p.forward(x).reshape([b, t, nkv, hd]),
            None => k_raw.clone(),
        };
        let mut k = k_raw;
        if let Some(n) = &self.k_norm {
            k = n.forward(k);
        }
        let k = self.rope.apply(k.swap_dims(1, 2), start);
        if let Some(n) = &self.v_norm {
            v = n.forward(v);
        }
        let v = v.swap_dims(1, 2);

        let (k, v) = match (cache.k.take(), cache.v.take()) {
            (Some(pk), Some(pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
            _ => (k, v),
        };
        let first = cache.first;
        let s = k.dims()[2];

        // Additive mask over absolute positions: causal, and inside the window if any.
        let mut mask = Vec::with_capacity(t * s);
        for qi in 0..t {
            let qp = start + qi;
            for kj in 0..s {
                let kp = first + kj;
                let visible = kp <= qp && (self.window == 0 || kp + self.window > qp);
                mask.push(if visible { 0.0f32 } else { f32::NEG_INFINITY });
            }
        }
        let mask = Tensor::<B, 4>::from_data(TensorData::new(mask, [1, 1, t, s]), &q.device());

        let rep = nh / nkv;
        let expand = |m: Tensor<B, 4>| {
            if rep == 1 {
                m
            } else {
                m.unsqueeze_dim::<5>(2).expand([b, nkv, rep, s, hd]).reshape([b, nh, s, hd])
            }
        };
        let scores = q.matmul(expand(k.clone()).swap_dims(2, 3)) * self.scale + mask;
        let probs = softmax(scores, 3);
        let out = probs.matmul(expand(v.clone())).swap_dims(1, 2).reshape([b, t, nh * hd]);

        // Keep only what future queries can still see.
        let keep = if self.window > 0 { s.min(self.window - 1) } else { s };
        if keep > 0 {
            cache.k = Some(k.narrow(2, s - keep, keep));
            cache.v = Some(v.narrow(2, s - keep, keep));
        }
        cache.first = start + t - keep;
        cache.next = start + t;

        self.o_proj.forward(out)
    }
}
