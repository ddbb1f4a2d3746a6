//! Gemma-4 text MoE (the 26B-A4B layout): sandwich norms around attention and feed-forward,
//! a dense GeGLU MLP and a routed expert bank in parallel on the same residual, a per-layer
//! `layer_scalar`, 5:1 sliding/full attention where full layers have wider heads, K = V and
//! proportional RoPE, embeddings × √hidden, tied head and soft-capped logits.

use burn::module::{Module, Param};
use burn::tensor::activation::tanh;
use burn::tensor::{Int, Tensor, backend::Backend};
use pw_hf::Gemma4Config;
use pw_nn::{
    Attention, AttentionConfig, Embedding, ExpertKeys, Experts, GatedMlp, GatedMlpConfig, KvCache, LoadError,
    NormKind, RandomInit, RmsNorm, Router, RouterConfig, WeightSource,
};

use crate::common::{CausalLm, ModelCache, MoeTap, Trace, act};

/// Router, experts and their own norms (absent when `enable_moe_block` is false).
#[derive(Module, Debug)]
pub struct Gemma4Moe<B: Backend> {
    router: Router<B>,
    experts: Experts<B>,
    post_feedforward_layernorm_1: RmsNorm<B>,
    pre_feedforward_layernorm_2: RmsNorm<B>,
    post_feedforward_layernorm_2: RmsNorm<B>,
}

/// One Gemma-4 decoder layer.
#[derive(Module, Debug)]
pub struct Gemma4DecoderLayer<B: Backend> {
    input_layernorm: RmsNorm<B>,
    self_attn: Attention<B>,
    post_attention_layernorm: RmsNorm<B>,
    pre_feedforward_layernorm: RmsNorm<B>,
    mlp: GatedMlp<B>,
    moe: Option<Gemma4Moe<B>>,
    post_feedforward_layernorm: RmsNorm<B>,
    /// `[1]`: the whole residual stream is multiplied by it at the end of the layer.
    layer_scalar: Param<Tensor<B, 1>>,
}

impl<B: Backend> Gemma4DecoderLayer<B> {
    /// Loads decoder layer `i` (under `model.` or `model.language_model.`, as the checkpoint
    /// has it).
    pub fn load(cfg: &Gemma4Config, src: &impl WeightSource<B>, i: usize) -> Result<Self, LoadError> {
        let root = Gemma4::<B>::root(src);
        let spec = &cfg.layers[i];
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let norm = |name: String| RmsNorm::load(src, &name, h, eps, NormKind::Scale);
        let p = format!("{root}.layers.{i}");
        let rope = if spec.sliding { cfg.rope_sliding } else { cfg.rope_full };
        let attn = AttentionConfig {
            hidden: h,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: spec.num_key_value_heads,
            head_dim: spec.head_dim,
            qkv_bias: true,
            qk_norm: true,
            v_norm: true,
            k_eq_v: spec.k_eq_v,
            // Q/K norms replace the 1/√d scaling.
            scale: Some(1.0),
            sliding_window: spec.sliding.then_some(cfg.sliding_window),
            norm_eps: eps,
            inv_freq: rope.inv_freq(spec.head_dim),
        };
        let moe = if cfg.enable_moe_block {
            let router = RouterConfig {
                hidden: h,
                num_experts: cfg.num_experts,
                top_k: cfg.top_k_experts,
                renormalize: true,
                gemma_scaling: true,
                norm_eps: eps,
            };
            let keys = ExpertKeys {
                fused: vec![format!("{p}.experts")],
                per_expert: vec![(format!("{p}.experts"), ["gate_proj", "up_proj", "down_proj"])],
            };
            let expert = GatedMlpConfig {
                hidden: h,
                intermediate: cfg.moe_intermediate_size,
                act: act(cfg.hidden_activation),
            };
            Some(Gemma4Moe {
                router: router.load(src, &format!("{p}.router"))?,
                experts: src.experts(&keys, cfg.num_experts, expert)?,
                post_feedforward_layernorm_1: norm(format!("{p}.post_feedforward_layernorm_1"))?,
                pre_feedforward_layernorm_2: norm(format!("{p}.pre_feedforward_layernorm_2"))?,
                post_feedforward_layernorm_2: norm(format!("{p}.post_feedforward_layernorm_2"))?,
            })
        } else {
            None
        };
        let scalar_name = format!("{p}.layer_scalar");
        // transformers initialises the buffer to one when a checkpoint lacks it.
        let layer_scalar = if src.has(&scalar_name) {
            src.tensor(&scalar_name, [1])?
        } else {
            Tensor::ones([1], &src.device())
        };
        Ok(Self {
            input_layernorm: norm(format!("{p}.input_layernorm"))?,
            self_attn: attn.load(src, &format!("{p}.self_attn"))?,
            post_attention_layernorm: norm(format!("{p}.post_attention_layernorm"))?,
            pre_feedforward_layernorm: norm(format!("{p}.pre_feedforward_layernorm"))?,
            mlp: GatedMlpConfig {
                hidden: h,
                intermediate: cfg.intermediate_size,
                act: act(cfg.hidden_activation),
            }
            .load(src, &format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"])?,
            moe,
            post_feedforward_layernorm: norm(format!("{p}.post_feedforward_layernorm"))?,
            layer_scalar: Param::from_tensor(layer_scalar),
        })
    }

    /// Runs the new positions through the layer; also returns what its expert bank read (its
    /// own pre-norm of the residual; `None` without a MoE block).
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]`
    /// - output: `[batch, seq, hidden]`, the tap's input `[batch · seq, hidden]`
    pub fn forward(&self, h: Tensor<B, 3>, kv: &mut KvCache<B>) -> (Tensor<B, 3>, Option<MoeTap<B>>) {
        let residual = h.clone();
        let x = self.input_layernorm.forward(h);
        let x = self.self_attn.forward(x, kv);
        let h = residual + self.post_attention_layernorm.forward(x);

        let residual = h.clone();
        let x = self.mlp.forward(self.pre_feedforward_layernorm.forward(h));
        let (x, tap) = match &self.moe {
            None => (x, None),
            Some(moe) => {
                let [b, t, d] = residual.dims();
                // The router and experts read the residual itself, not the MLP's input.
                let flat = residual.clone().reshape([b * t, d]);
                let routing = moe.router.forward(flat.clone());
                let input = moe.pre_feedforward_layernorm_2.forward(flat);
                let y = moe.experts.forward(input.clone(), &routing);
                let y = moe.post_feedforward_layernorm_2.forward(y.reshape([b, t, d]));
                (moe.post_feedforward_layernorm_1.forward(x) + y, Some(MoeTap { input, routing }))
            }
        };
        let h = residual + self.post_feedforward_layernorm.forward(x);
        (h * self.layer_scalar.val().reshape([1, 1, 1]), tap)
    }
}

/// Gemma-4 text model for causal LM.
#[derive(Module, Debug)]
pub struct Gemma4<B: Backend> {
    embed_tokens: Embedding<B>,
    embed_scale: f64,
    layers: Vec<Gemma4DecoderLayer<B>>,
    norm: RmsNorm<B>,
    /// `tanh(x / c) · c` on the logits (0 = off).
    final_logit_softcapping: f64,
    vocab_size: usize,
}

impl<B: Backend> Gemma4<B> {
    /// Random weights of the given shape (tests, training from scratch).
    pub fn init(cfg: &Gemma4Config, device: &B::Device) -> Self {
        Self::load(cfg, &RandomInit::new(device, 0, 0.05)).expect("random weights always load")
    }

    /// The text model's prefix: `model.language_model` in `Gemma4ForConditionalGeneration`,
    /// else `model`.
    fn root(src: &impl WeightSource<B>) -> &'static str {
        if src.has("model.language_model.embed_tokens.weight") { "model.language_model" } else { "model" }
    }

    /// Loads the token embedding and the scale (√hidden) its output is multiplied by to give
    /// the model's first hidden state.
    pub fn load_embedding(
        cfg: &Gemma4Config,
        src: &impl WeightSource<B>,
    ) -> Result<(Embedding<B>, f64), LoadError> {
        let h = cfg.hidden_size;
        let table = Embedding::load(src, &format!("{}.embed_tokens", Self::root(src)), cfg.vocab_size, h)?;
        // transformers casts √hidden to the weight dtype; f32 here.
        Ok((table, (h as f64).sqrt()))
    }

    /// Loads `Gemma4ForCausalLM` (`model.`) or the text part of
    /// `Gemma4ForConditionalGeneration` (`model.language_model.`).
    pub fn load(cfg: &Gemma4Config, src: &impl WeightSource<B>) -> Result<Self, LoadError> {
        let root = Self::root(src);
        let layers = (0..cfg.layers.len())
            .map(|i| Gemma4DecoderLayer::load(cfg, src, i))
            .collect::<Result<Vec<_>, LoadError>>()?;
        if !cfg.tie_word_embeddings {
            return Err(LoadError::Source("Gemma-4 with an untied lm_head is not supported".into()));
        }
        let (embed_tokens, embed_scale) = Self::load_embedding(cfg, src)?;
        Ok(Self {
            embed_tokens,
            embed_scale,
            layers,
            norm: RmsNorm::load(
                src,
                &format!("{root}.norm"),
                cfg.hidden_size,
                cfg.rms_norm_eps,
                NormKind::Scale,
            )?,
            final_logit_softcapping: cfg.final_logit_softcapping.unwrap_or(0.0),
            vocab_size: cfg.vocab_size,
        })
    }
}

impl<B: Backend> CausalLm<B> for Gemma4<B> {
    fn forward(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: &mut ModelCache<B>,
        mut trace: Option<&mut Trace<B>>,
    ) -> Tensor<B, 3> {
        let mut h = self.embed_tokens.forward(ids) * self.embed_scale;
        Trace::record(&mut trace, &h, None, true);
        for (layer, kv) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let (next, tap) = layer.forward(h, kv);
            h = next;
            Trace::record(&mut trace, &h, tap.map(|t| t.routing), false);
        }
        let logits = self.embed_tokens.attend(self.norm.forward(h));
        if self.final_logit_softcapping > 0.0 {
            let c = self.final_logit_softcapping;
            tanh(logits / c) * c
        } else {
            logits
        }
    }

    fn new_cache(&self) -> ModelCache<B> {
        ModelCache::new(self.layers.len())
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}
