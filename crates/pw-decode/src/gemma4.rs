//! Gemma-4's forward pass (transformers' `Gemma4ForCausalLM`, text model) over the decode
//! stages: scaled embeddings, Q/K/V head norms (K = V on full layers), sandwich norms, a
//! dense GeGLU branch beside the routed experts, a per-layer scalar, a tied soft-capped head.

use cubecl::prelude::*;

use crate::DecodeError;
use crate::stages::{AttnOut, Fwd, Logits, MlpOut};
use crate::weights::DenseWeights;

/// One chunk of a step: the tokens' next-token logits into the scratch logits.
pub(crate) fn forward<R: Runtime, KV: Float + CubeElement>(
    f: &mut Fwd<'_, R, KV>,
    w: &DenseWeights,
) -> Result<(), DecodeError> {
    // h = embed_tokens(ids) · √hidden
    f.embed(&w.embed)?;
    for (l, layer) in w.layers.iter().enumerate() {
        f.residual_stats(l)?;
        let (Some(g), Some(router), Some(mlp)) = (&layer.gemma, &layer.router, &layer.mlp) else {
            return Err(DecodeError::Unsupported("Gemma-4 layer without experts or MLP".into()));
        };
        let ex = f.expert_pool(l)?;
        // h += post_attention_layernorm(o_proj(attention(head_norms(qkv_proj(input_layernorm(h))))))
        f.attention(l, layer, AttnOut::Scratch)?;
        f.add_norm(&layer.post_attn_norm)?;
        // Dense branch: mlp(pre_feedforward_layernorm(h)).
        f.mlp_up(l, mlp, &g.pre_ff)?;
        f.mlp_down(l, mlp, MlpOut::Scratch)?;
        // Experts: routed by router(router_norm(h)), over pre_feedforward_layernorm_2(h).
        f.router_logits(router, &g.router_norm)?;
        f.route_gather(l, &ex, Logits::Router, &g.pre_ff2)?;
        f.experts(&ex)?;
        // h = (h + post_ff_norm(post_ff_norm_1(mlp) + post_ff_norm_2(experts · per_expert_scale))) · layer_scalar
        f.gemma_ffn_out(g)?;
    }
    // logits = softcap(lm_head(norm(h)))
    f.final_norm_head(&w.final_norm, w.head())
}
