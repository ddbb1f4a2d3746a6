//! Mixtral: pre-norm decoder, GQA attention with rotate-half RoPE, a sparse MoE of SwiGLU
//! experts with softmax → top-k → renormalised routing, untied head.

use burn::module::Module;
use burn::tensor::{Int, Tensor, backend::Backend};
use pw_hf::MixtralConfig;
use pw_nn::{
    Attention, AttentionConfig, Embedding, ExpertKeys, GatedMlpConfig, KvCache, Linear, LoadError, NormKind,
    RandomInit, RmsNorm, RouterConfig, SparseMoe, WeightSource,
};

use crate::common::{CausalLm, ModelCache, MoeTap, Trace, act};

/// One Mixtral decoder layer.
#[derive(Module, Debug)]
pub struct MixtralDecoderLayer<B: Backend> {
    input_layernorm: RmsNorm<B>,
    self_attn: Attention<B>,
    post_attention_layernorm: RmsNorm<B>,
    block_sparse_moe: SparseMoe<B>,
}

impl<B: Backend> MixtralDecoderLayer<B> {
    /// Loads decoder layer `i` (`model.layers.{i}`).
    pub fn load(cfg: &MixtralConfig, src: &impl WeightSource<B>, i: usize) -> Result<Self, LoadError> {
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let attn = AttentionConfig {
            hidden: h,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            qkv_bias: false,
            qk_norm: false,
            v_norm: false,
            k_eq_v: false,
            scale: None,
            sliding_window: cfg.sliding_window,
            norm_eps: eps,
            inv_freq: cfg.rope.inv_freq(cfg.head_dim),
        };
        let router = RouterConfig {
            hidden: h,
            num_experts: cfg.num_local_experts,
            top_k: cfg.num_experts_per_tok,
            renormalize: true,
            gemma_scaling: false,
            norm_eps: eps,
        };
        let expert =
            GatedMlpConfig { hidden: h, intermediate: cfg.intermediate_size, act: act(cfg.hidden_act) };
        let p = format!("model.layers.{i}");
        // Original checkpoints: `block_sparse_moe` per expert; transformers-5 in-memory
        // layout: `mlp` with fused experts.
        let moe = if src.has(&format!("{p}.mlp.gate.weight")) {
            format!("{p}.mlp")
        } else {
            format!("{p}.block_sparse_moe")
        };
        let keys = ExpertKeys {
            fused: vec![format!("{moe}.experts")],
            per_expert: vec![(format!("{moe}.experts"), ["w1", "w3", "w2"])],
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
            block_sparse_moe: SparseMoe {
                router: router.load(src, &format!("{moe}.gate"))?,
                experts: src.experts(&keys, cfg.num_local_experts, expert)?,
                shared: None,
            },
        })
    }

    /// Runs the new positions through the layer; also returns what its sparse block read.
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
        let [b, t, d] = x.dims();
        let input = x.clone().reshape([b * t, d]);
        let (x, routing) = self.block_sparse_moe.forward(x);
        (residual + x, Some(MoeTap { input, routing }))
    }
}

/// Mixtral for causal LM.
#[derive(Module, Debug)]
pub struct Mixtral<B: Backend> {
    embed_tokens: Embedding<B>,
    layers: Vec<MixtralDecoderLayer<B>>,
    norm: RmsNorm<B>,
    /// `None` when tied to the embeddings.
    lm_head: Option<Linear<B>>,
    vocab_size: usize,
}

impl<B: Backend> Mixtral<B> {
    /// Random weights of the given shape (tests, training from scratch).
    pub fn init(cfg: &MixtralConfig, device: &B::Device) -> Self {
        Self::load(cfg, &RandomInit::new(device, 0, 0.05)).expect("random weights always load")
    }

    /// Loads the token embedding (`model.embed_tokens`); its output is the model's first
    /// hidden state.
    pub fn load_embedding(
        cfg: &MixtralConfig,
        src: &impl WeightSource<B>,
    ) -> Result<Embedding<B>, LoadError> {
        Embedding::load(src, "model.embed_tokens", cfg.vocab_size, cfg.hidden_size)
    }

    /// Loads from a checkpoint laid out as transformers saves `MixtralForCausalLM`.
    pub fn load(cfg: &MixtralConfig, src: &impl WeightSource<B>) -> Result<Self, LoadError> {
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| MixtralDecoderLayer::load(cfg, src, i))
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

impl<B: Backend> CausalLm<B> for Mixtral<B> {
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
