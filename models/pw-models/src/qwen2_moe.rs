//! Qwen1.5-MoE (`qwen2_moe`): like Mixtral but with q/k/v biases, softmax → top-k *without*
//! renormalisation, a shared expert scaled by `sigmoid(shared_expert_gate(x))`, and dense MLP
//! layers where `mlp_only_layers` / `decoder_sparse_step` say so.

use burn::module::Module;
use burn::tensor::{Int, Tensor, backend::Backend};
use pw_hf::Qwen2MoeConfig;
use pw_nn::{
    Attention, AttentionConfig, Embedding, ExpertKeys, GatedMlp, GatedMlpConfig, KvCache, Linear, LoadError,
    NormKind, RandomInit, RmsNorm, RouterConfig, SharedExpert, SparseMoe, WeightSource,
};

use crate::common::{CausalLm, ModelCache, MoeTap, Trace, act};

/// The feed-forward part of a layer.
// One per layer, built once: boxing would buy nothing (and Burn modules do not box).
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Qwen2MoeMlp<B: Backend> {
    /// Routed experts plus the shared expert.
    Sparse(SparseMoe<B>),
    /// A plain SwiGLU MLP (`mlp_only_layers`).
    Dense(GatedMlp<B>),
}

/// One Qwen2-MoE decoder layer.
#[derive(Module, Debug)]
pub struct Qwen2MoeDecoderLayer<B: Backend> {
    input_layernorm: RmsNorm<B>,
    self_attn: Attention<B>,
    post_attention_layernorm: RmsNorm<B>,
    mlp: Qwen2MoeMlp<B>,
}

impl<B: Backend> Qwen2MoeDecoderLayer<B> {
    /// Loads decoder layer `i` (`model.layers.{i}`): sparse or dense as the config says.
    pub fn load(cfg: &Qwen2MoeConfig, src: &impl WeightSource<B>, i: usize) -> Result<Self, LoadError> {
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let act = act(cfg.hidden_act);
        let router = RouterConfig {
            hidden: h,
            num_experts: cfg.num_experts,
            top_k: cfg.num_experts_per_tok,
            renormalize: cfg.norm_topk_prob,
            gemma_scaling: false,
            norm_eps: eps,
        };
        let p = format!("model.layers.{i}");
        let attn = AttentionConfig {
            hidden: h,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            qkv_bias: cfg.qkv_bias,
            qk_norm: false,
            v_norm: false,
            k_eq_v: false,
            scale: None,
            sliding_window: cfg.layer_windows[i],
            norm_eps: eps,
            inv_freq: cfg.rope.inv_freq(cfg.head_dim),
        };
        let mlp = if cfg.sparse_layers[i] {
            let keys = ExpertKeys {
                fused: vec![format!("{p}.mlp.experts")],
                per_expert: vec![(format!("{p}.mlp.experts"), ["gate_proj", "up_proj", "down_proj"])],
            };
            let expert = GatedMlpConfig { hidden: h, intermediate: cfg.moe_intermediate_size, act };
            let shared = if cfg.shared_expert_intermediate_size > 0 {
                Some(SharedExpert::load(
                    src,
                    &format!("{p}.mlp.shared_expert"),
                    &format!("{p}.mlp.shared_expert_gate"),
                    GatedMlpConfig { hidden: h, intermediate: cfg.shared_expert_intermediate_size, act },
                )?)
            } else {
                None
            };
            Qwen2MoeMlp::Sparse(SparseMoe {
                router: router.load(src, &format!("{p}.mlp.gate"))?,
                experts: src.experts(&keys, cfg.num_experts, expert)?,
                shared,
            })
        } else {
            Qwen2MoeMlp::Dense(GatedMlpConfig { hidden: h, intermediate: cfg.intermediate_size, act }.load(
                src,
                &format!("{p}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
            )?)
        };
        Ok(Self {
            input_layernorm: RmsNorm::load(src, &format!("{p}.input_layernorm"), h, eps, NormKind::Scale)?,
            self_attn: attn.load(src, &format!("{p}.self_attn"))?,
            post_attention_layernorm: RmsNorm::load(
                src,
                &format!("{p}.post_attention_layernorm"),
                h,
                eps,
                NormKind::Scale,
            )?,
            mlp,
        })
    }

    /// Runs the new positions through the layer; also returns what its sparse block read
    /// (`None` for a dense layer).
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]`
    /// - output: `[batch, seq, hidden]`, the tap's input `[batch · seq, hidden]`
    pub fn forward(&self, h: Tensor<B, 3>, kv: &mut KvCache<B>) -> (Tensor<B, 3>, Option<MoeTap<B>>) {
        let residual = h.clone();
        let x = self.input_layernorm.forward(h);
        let h = residual + self.self_attn.forward(x, kv);

        let residual = h.clone();
        let x = self.post_attention_layernorm.forward(h);
        let (x, tap) = match &self.mlp {
            Qwen2MoeMlp::Sparse(moe) => {
                let [b, t, d] = x.dims();
                let input = x.clone().reshape([b * t, d]);
                let (y, routing) = moe.forward(x);
                (y, Some(MoeTap { input, routing }))
            }
            Qwen2MoeMlp::Dense(mlp) => (mlp.forward(x), None),
        };
        (residual + x, tap)
    }
}

/// Qwen2-MoE for causal LM.
#[derive(Module, Debug)]
pub struct Qwen2Moe<B: Backend> {
    embed_tokens: Embedding<B>,
    layers: Vec<Qwen2MoeDecoderLayer<B>>,
    norm: RmsNorm<B>,
    /// `None` when tied to the embeddings.
    lm_head: Option<Linear<B>>,
    vocab_size: usize,
}

impl<B: Backend> Qwen2Moe<B> {
    /// Random weights of the given shape (tests, training from scratch).
    pub fn init(cfg: &Qwen2MoeConfig, device: &B::Device) -> Self {
        Self::load(cfg, &RandomInit::new(device, 0, 0.05)).expect("random weights always load")
    }

    /// Loads the token embedding (`model.embed_tokens`); its output is the model's first
    /// hidden state.
    pub fn load_embedding(
        cfg: &Qwen2MoeConfig,
        src: &impl WeightSource<B>,
    ) -> Result<Embedding<B>, LoadError> {
        Embedding::load(src, "model.embed_tokens", cfg.vocab_size, cfg.hidden_size)
    }

    /// Loads from a checkpoint laid out as transformers saves `Qwen2MoeForCausalLM`.
    pub fn load(cfg: &Qwen2MoeConfig, src: &impl WeightSource<B>) -> Result<Self, LoadError> {
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Qwen2MoeDecoderLayer::load(cfg, src, i))
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(Self {
            embed_tokens: Self::load_embedding(cfg, src)?,
            layers,
            norm: RmsNorm::load(src, "model.norm", h, eps, NormKind::Scale)?,
            lm_head: if cfg.tie_word_embeddings {
                None
            } else {
                Some(Linear::load(src, "lm_head", h, cfg.vocab_size, false)?)
            },
            vocab_size: cfg.vocab_size,
        })
    }
}

impl<B: Backend> CausalLm<B> for Qwen2Moe<B> {
    fn forward(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: &mut ModelCache<B>,
        mut trace: Option<&mut Trace<B>>,
    ) -> Tensor<B, 3> {
        let mut h = self.embed_tokens.forward(ids);
        Trace::record(&mut trace, &h, None, true);
        for (layer, kv) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let (next, tap) = layer.forward(h, kv);
            h = next;
            Trace::record(&mut trace, &h, tap.map(|t| t.routing), false);
        }
        let h = self.norm.forward(h);
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed_tokens.attend(h),
        }
    }

    fn new_cache(&self) -> ModelCache<B> {
        ModelCache::new(self.layers.len())
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}
