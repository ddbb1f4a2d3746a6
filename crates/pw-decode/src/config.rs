//! The shapes and per-family switches of the decode path, from the three families' configs.

use kernels_cubecl::{Activation, MoeShape};
use pw_hf::{Gemma4Config, MixtralConfig, ModelConfig, Qwen2MoeConfig};
use pw_kv::{KvGeometry, LayerGeometry};

use crate::DecodeError;

/// Which architecture's layer wiring a decoder runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Pre-norm attention, routed SwiGLU experts.
    Mixtral,
    /// Mixtral plus q/k/v biases, a gated shared expert, dense MLP layers, optional
    /// un-renormalised top-k.
    Qwen2Moe,
    /// Sandwich norms, Q/K/V head norms, K = V full layers, a dense GeGLU branch beside the
    /// experts, a per-layer scalar, scaled embeddings, tied soft-capped head.
    Gemma4,
}

/// Attention geometry of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnLayer {
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding window (0 = none): a query sees itself and the `window − 1` tokens before it.
    pub window: usize,
    /// No `v_proj`: values are the raw key projection (Gemma-4 full layers).
    pub k_eq_v: bool,
    /// RoPE inverse frequencies (`head_dim / 2`; zeros leave pairs unrotated, which is how
    /// Gemma's proportional RoPE rotates only the first pairs).
    pub inv_freq: Vec<f32>,
}

/// The shapes the decode path needs.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeConfig {
    /// Layer wiring.
    pub family: Family,
    /// Vocabulary.
    pub vocab: usize,
    /// Model width H.
    pub hidden: usize,
    /// Routed expert width I.
    pub inter: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Per-layer attention geometry.
    pub attn: Vec<AttnLayer>,
    /// Routed experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the top-k probabilities (Qwen's `norm_topk_prob`).
    pub renormalize: bool,
    /// Per layer: routed experts (Qwen's `mlp_only_layers` are dense).
    pub sparse: Vec<bool>,
    /// Width of the dense MLP (Qwen's dense layers, Gemma's dense branch; 0 = none).
    pub dense_inter: usize,
    /// Width of Qwen's shared expert (0 = none).
    pub shared_inter: usize,
    /// Gate activation of experts and MLPs.
    pub act: Activation,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Attention score scale (`None`: `head_dim^-0.5`).
    pub attn_scale: Option<f32>,
    /// Embedding multiplier (Gemma: √hidden).
    pub embed_scale: f32,
    /// `tanh(x / c) · c` on the logits (0 = off).
    pub softcap: f32,
    /// The head is the embedding matrix.
    pub tied: bool,
}

fn act(a: pw_hf::Activation, what: &str) -> Result<Activation, DecodeError> {
    match a {
        pw_hf::Activation::Silu => Ok(Activation::SiluMul),
        pw_hf::Activation::GeluTanh => Ok(Activation::GeluTanhMul),
        pw_hf::Activation::Gelu => {
            Err(DecodeError::Unsupported(format!("{what}: exact erf GELU in the fast decode path")))
        }
    }
}

impl DecodeConfig {
    /// The shapes of any supported family.
    pub fn from_model(c: &ModelConfig) -> Result<Self, DecodeError> {
        match c {
            ModelConfig::Mixtral(m) => Self::try_from_mixtral(m),
            ModelConfig::Qwen2Moe(q) => Self::from_qwen2_moe(q),
            ModelConfig::Gemma4(g) => Self::from_gemma4(g),
        }
    }

    /// The shapes of a Mixtral config (SiLU experts).
    pub fn from_mixtral(c: &MixtralConfig) -> Self {
        let attn = AttnLayer {
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            window: c.sliding_window.unwrap_or(0),
            k_eq_v: false,
            inv_freq: c.rope.inv_freq(c.head_dim),
        };
        Self {
            family: Family::Mixtral,
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            inter: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            attn: vec![attn; c.num_hidden_layers],
            experts: c.num_local_experts,
            top_k: c.num_experts_per_tok,
            renormalize: true,
            sparse: vec![true; c.num_hidden_layers],
            dense_inter: 0,
            shared_inter: 0,
            act: Activation::SiluMul,
            eps: c.rms_norm_eps as f32,
            attn_scale: None,
            embed_scale: 1.0,
            softcap: 0.0,
            tied: c.tie_word_embeddings,
        }
    }

    fn try_from_mixtral(c: &MixtralConfig) -> Result<Self, DecodeError> {
        let mut s = Self::from_mixtral(c);
        s.act = act(c.hidden_act, "mixtral hidden_act")?;
        Ok(s)
    }

    /// The shapes of a Qwen2-MoE config.
    pub fn from_qwen2_moe(c: &Qwen2MoeConfig) -> Result<Self, DecodeError> {
        let attn = (0..c.num_hidden_layers)
            .map(|i| AttnLayer {
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                window: c.layer_windows[i].unwrap_or(0),
                k_eq_v: false,
                inv_freq: c.rope.inv_freq(c.head_dim),
            })
            .collect();
        Ok(Self {
            family: Family::Qwen2Moe,
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            inter: c.moe_intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            attn,
            experts: c.num_experts,
            top_k: c.num_experts_per_tok,
            renormalize: c.norm_topk_prob,
            sparse: c.sparse_layers.clone(),
            dense_inter: c.intermediate_size,
            shared_inter: c.shared_expert_intermediate_size,
            act: act(c.hidden_act, "qwen2_moe hidden_act")?,
            eps: c.rms_norm_eps as f32,
            attn_scale: None,
            embed_scale: 1.0,
            softcap: 0.0,
            tied: c.tie_word_embeddings,
        })
    }

    /// The shapes of a Gemma-4 text config.
    pub fn from_gemma4(c: &Gemma4Config) -> Result<Self, DecodeError> {
        if !c.enable_moe_block {
            return Err(DecodeError::Unsupported(
                "Gemma-4 without its MoE block in the fast decode path".into(),
            ));
        }
        let attn = c
            .layers
            .iter()
            .map(|l| {
                let rope = if l.sliding { c.rope_sliding } else { c.rope_full };
                AttnLayer {
                    kv_heads: l.num_key_value_heads,
                    head_dim: l.head_dim,
                    window: if l.sliding { c.sliding_window } else { 0 },
                    k_eq_v: l.k_eq_v,
                    inv_freq: rope.inv_freq(l.head_dim),
                }
            })
            .collect();
        Ok(Self {
            family: Family::Gemma4,
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            inter: c.moe_intermediate_size,
            layers: c.layers.len(),
            heads: c.num_attention_heads,
            attn,
            experts: c.num_experts,
            top_k: c.top_k_experts,
            renormalize: true,
            sparse: vec![true; c.layers.len()],
            dense_inter: c.intermediate_size,
            shared_inter: 0,
            act: act(c.hidden_activation, "gemma4 hidden_activation")?,
            eps: c.rms_norm_eps as f32,
            attn_scale: Some(1.0),
            embed_scale: (c.hidden_size as f32).sqrt(),
            softcap: c.final_logit_softcapping.unwrap_or(0.0) as f32,
            tied: true,
        })
    }

    /// Width of layer `l`'s fused Q|K|V row as the cache kernels read it.
    pub fn qkv_width(&self, l: usize) -> usize {
        (self.heads + 2 * self.attn[l].kv_heads) * self.attn[l].head_dim
    }

    /// Rows of layer `l`'s fused projection weight (no V rows when K = V).
    pub fn proj_rows(&self, l: usize) -> usize {
        let a = &self.attn[l];
        (self.heads + if a.k_eq_v { 1 } else { 2 } * a.kv_heads) * a.head_dim
    }

    /// Rows of the dense gate|up weight of layer `l`'s MLP (shared expert: plus its gate row),
    /// or 0 when the layer has none.
    pub fn mlp_rows(&self, l: usize) -> usize {
        match self.family {
            Family::Mixtral => 0,
            Family::Qwen2Moe if self.sparse[l] => {
                if self.shared_inter > 0 {
                    2 * self.shared_inter + 1
                } else {
                    0
                }
            }
            _ => 2 * self.dense_inter,
        }
    }

    /// Width of layer `l`'s MLP (0 = none).
    pub fn mlp_inter(&self, l: usize) -> usize {
        match self.family {
            Family::Qwen2Moe if self.sparse[l] => self.shared_inter,
            Family::Mixtral => 0,
            _ => self.dense_inter,
        }
    }

    /// Routing geometry for the kernels.
    pub fn moe_shape(&self) -> MoeShape {
        MoeShape {
            experts: self.experts,
            k: self.top_k,
            renormalize: self.renormalize,
            hidden: self.hidden,
            inter: self.inter,
        }
    }

    /// The paged cache geometry of this model with `elem_bytes` per cached element.
    pub fn kv_geometry(&self, block_size: usize, elem_bytes: usize, max_seq_len: usize) -> KvGeometry {
        let layers = self
            .attn
            .iter()
            .map(|a| LayerGeometry {
                n_heads: self.heads,
                n_kv_heads: a.kv_heads,
                head_dim: a.head_dim,
                window: a.window,
            })
            .collect();
        KvGeometry { layers, block_size, elem_bytes, max_seq_len }
    }

    /// Bytes of the dense weights on the device: matrices in f16 (attention, router, dense MLP,
    /// shared expert, embedding and an untied head), norms, biases and scales in f32. The
    /// memory budget subtracts it before it splits the rest between experts and the KV cache.
    pub fn dense_bytes(&self) -> u64 {
        let h = self.hidden as u64;
        let per_layer: u64 = (0..self.layers)
            .map(|l| {
                let hd = self.attn[l].head_dim as u64;
                let router = if self.sparse[l] { self.experts as u64 } else { 0 };
                let f16s =
                    (self.proj_rows(l) as u64 + self.heads as u64 * hd + router + self.mlp_rows(l) as u64)
                        * h
                        + h * self.mlp_inter(l) as u64;
                let extra_f32s = match self.family {
                    Family::Mixtral => 0,
                    Family::Qwen2Moe => self.qkv_width(l) as u64,
                    // q/k head norms, pre-FF, router scale, second pre-FF, three post-FF norms,
                    // the per-expert scale and the layer scalar.
                    Family::Gemma4 => 2 * hd + 6 * h + self.experts as u64 + 1,
                };
                f16s * 2 + (2 * h + extra_f32s) * 4
            })
            .sum();
        let heads = if self.tied { 1 } else { 2 };
        per_layer + heads * self.vocab as u64 * h * 2 + h * 4
    }

    /// Device bytes of a decoder's per-step scratch for steps of up to `tokens` tokens and
    /// `logit_rows` rows of logits with routing items of `route_chunk` tokens: activations,
    /// logits and routing tables, which a memory budget holds beside the weights and the KV
    /// cache.
    pub fn scratch_bytes(&self, tokens: usize, logit_rows: usize, route_chunk: usize) -> u64 {
        let floats: usize = crate::stages::scratch_sizes(self, tokens, logit_rows).iter().sum();
        4 * floats as u64 + crate::stages::route_bytes(self, route_chunk, tokens)
    }

    /// [`Self::scratch_bytes`] of a decoder built with the builder's step size and routing items.
    pub fn default_scratch_bytes(&self) -> u64 {
        self.step_scratch_bytes(crate::DEFAULT_MAX_STEP_TOKENS)
    }

    /// [`Self::scratch_bytes`] of a decoder of steps of `tokens` tokens and the builder's other
    /// defaults (rows of logits, routing items).
    pub fn step_scratch_bytes(&self, tokens: usize) -> u64 {
        self.scratch_bytes(tokens, crate::DEFAULT_MAX_LOGIT_ROWS, kernels_cubecl::ROUTE_CHUNK)
    }

    /// Parameters of the model, dense and expert, for reports.
    pub fn expert_params(&self) -> usize {
        self.sparse.iter().filter(|s| **s).count() * self.experts * 3 * self.hidden * self.inter
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use pw_hf::{Checkpoint, ModelConfig};

    use super::DecodeConfig;

    /// The checkpoint's non-expert tensors as the device holds them: matrices in f16, vectors
    /// in f32.
    fn checkpoint_dense_bytes(ckpt: &Checkpoint) -> u64 {
        ckpt.names()
            .filter(|n| !n.contains(".experts."))
            .map(|n| {
                let (_, shape) = ckpt.info(n).unwrap();
                let elems: usize = shape.iter().product();
                (elems * if shape.len() >= 2 { 2 } else { 4 }) as u64
            })
            .sum()
    }

    #[test]
    fn dense_bytes_matches_the_checkpoint_of_every_family() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for dir in [
            "models/pw-models/tests/fixtures/mixtral",
            "models/pw-models/tests/fixtures/qwen2_moe",
            "models/pw-models/tests/fixtures/gemma4",
            "assets/tiny-mixtral",
            "assets/tiny-qwen2-moe",
        ] {
            let dir = root.join(dir);
            let cfg = DecodeConfig::from_model(&ModelConfig::from_dir(&dir).unwrap()).unwrap();
            let ckpt = Checkpoint::open(&dir).unwrap();
            assert_eq!(cfg.dense_bytes(), checkpoint_dense_bytes(&ckpt), "{}", dir.display());
        }
    }
}
