//! Mixtral's forward pass (transformers' `MixtralForCausalLM`) over the decode stages:
//! pre-norm attention and routed SwiGLU experts in every layer.

use cubecl::prelude::*;

use crate::DecodeError;
use crate::stages::{AttnOut, Fwd};
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
        // h += o_proj(attention(rope(qkv_proj(input_layernorm(h)))))
        f.attention(l, layer, AttnOut::Residual)?;
        // h += block_sparse_moe(post_attention_layernorm(h)): router, top-k, experts, combine.
        let ex = f.expert_pool(l)?;
        let router = layer.router.as_ref().ok_or_else(|| no_router(l))?;
        f.route(l, &ex, router, &layer.post_attn_norm)?;
        f.experts(&ex)?;
        f.combine()?;
    }
    // logits = lm_head(norm(h))
    f.final_norm_head(&w.final_norm, w.head())
}

fn no_router(l: usize) -> DecodeError {
    DecodeError::Unsupported(format!("layer {l}: no router"))
}
