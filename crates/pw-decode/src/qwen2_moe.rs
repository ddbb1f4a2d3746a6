//! Qwen2-MoE's forward pass (transformers' `Qwen2MoeForCausalLM`) over the decode stages:
//! Mixtral's layer with q/k/v biases, plus a sigmoid-gated shared expert beside the routed
//! ones, and dense MLP layers (`mlp_only_layers`).

use cubecl::prelude::*;

use crate::DecodeError;
use crate::stages::{AttnOut, Fwd, Logits, MlpOut};
use crate::weights::DenseWeights;

/// One chunk of a step: the tokens' next-token logits into the scratch logits.
pub(crate) fn forward<R: Runtime, KV: Float + CubeElement>(
    f: &mut Fwd<'_, R, KV>,
    w: &DenseWeights,
) -> Result<(), DecodeError> {
    // h = embed_tokens(ids)
    f.embed(&w.embed)?;
    for (l, layer) in w.layers.iter().enumerate() {
        f.residual_stats(l)?;
        // h += o_proj(attention(rope(qkv_proj(input_layernorm(h)) + bias)))
        f.attention(l, layer, AttnOut::Residual)?;
        let norm = &layer.post_attn_norm;
        if !f.cfg.sparse[l] {
            // Dense layer: h += mlp(post_attention_layernorm(h)).
            let mlp = layer.mlp.as_ref().ok_or_else(|| missing(l, "MLP"))?;
            f.mlp_up(l, mlp, norm)?;
            f.mlp_down(l, mlp, MlpOut::Residual)?;
            continue;
        }
        // Sparse layer, x = post_attention_layernorm(h):
        // h += experts(x) + sigmoid(shared_expert_gate(x)) · shared_expert(x).
        // Everything that reads h runs before the combine writes it; the additions keep their
        // order (experts, then shared expert).
        let ex = f.expert_pool(l)?;
        match (&layer.router, &layer.mlp) {
            // The router's rows ride in the shared expert's gate|up GEMM.
            (None, Some(shared)) => {
                f.mlp_up(l, shared, norm)?;
                f.route_gather(l, &ex, Logits::Mlp, norm)?;
            }
            (Some(router), None) => f.route(l, &ex, router, norm)?,
            _ => return Err(missing(l, "router")),
        }
        f.experts(&ex)?;
        f.combine()?;
        if let Some(shared) = &layer.mlp {
            f.mlp_down(l, shared, MlpOut::Residual)?;
        }
    }
    // logits = lm_head(norm(h))
    f.final_norm_head(&w.final_norm, w.head())
}

fn missing(l: usize, what: &str) -> DecodeError {
    DecodeError::Unsupported(format!("layer {l}: no {what}"))
}
