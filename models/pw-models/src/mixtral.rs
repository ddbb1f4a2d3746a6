//! Mixtral: pre-norm decoder, GQA attention with rotate-half RoPE, a sparse MoE of SwiGLU
//! experts with softmax → top-k → renormalised routing, untied head.

use burn::module::Module;
use burn::tensor::{Int, Tensor, backend::Backend};
use pw_hf::MixtralConfig;
use pw_nn::{
    Attention, AttentionConfig, Embedding, ExpertKeys, GatedMlpConfig, Linear, LoadError, NormKind,
    RandomInit, RmsNorm, RouterConfig, SparseMoe, WeightSource,
};

use crate::common::{CausalLm, ModelCache, Trace, act};

/// One Mixtral decoder layer.
#[derive(Module, Debug)]
pub struct MixtralDecoderLayer<B: Backend> {
    input_layernorm: RmsNorm<B>,
    self_attn: Attention<B>,
    post_attention_layernorm: RmsNorm<B>,
    block_sparse_moe: SparseMoe<B>,
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

    /// Loads from a checkpoint laid out as transformers saves `MixtralForCausalLM`.
    pub fn load(cfg: &MixtralConfig, src: &impl WeightSource<B>) -> Result<Self, LoadError> {
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
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
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
                Ok(MixtralDecoderLayer {
                    input_layernorm: RmsNorm::load(
                        src,
                        &format!("{p}.input_layernorm"),
                        h,
                        eps,
                        NormKind::Scale,
                    )?,
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
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(Self {
            embed_tokens: Embedding::load(src, "model.embed_tokens", cfg.vocab_size, h)?,
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
            let residual = h.clone();
            let x = layer.input_layernorm.forward(h);
            h = residual + layer.self_attn.forward(x, kv);

            let residual = h.clone();
            let x = layer.post_attention_layernorm.forward(h);
            let (x, routing) = layer.block_sparse_moe.forward(x);
            h = residual + x;
            Trace::record(&mut trace, &h, Some(routing), false);
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
