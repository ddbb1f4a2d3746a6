//! CubeCL kernels of a decode step over the any-precision bit-plane format, generic over the
//! CubeCL runtime (CUDA on the GPU, wgpu in CI). One module per operation; each holds its
//! `#[cube]` kernels, their host launchers, a CPU `*_reference` of each launcher and the tests
//! that compare the two.
//!
//! - [`expert_gemm`]: the routed experts' grouped bit-plane + LUT GEMM (tiled and persistent
//!   GEMV kernels), a different committed bit-width per block in one launch.
//! - [`dense`]: the dense f16 GEMMs (projections, dense MLPs, LM heads), on the SIMT cores or
//!   the matrix units.
//! - [`attention`]: the paged KV cache's append (with RoPE) and decode attention.
//! - [`routing`]: softmax → top-k routing into the expert GEMM's descriptors, the gather of the
//!   experts' input rows, the weighted combine of their outputs.
//! - [`norms`]: RMSNorms (most are folded into the kernel that reads them) and per-head norms.
//! - [`activation`], [`embed`], [`gemma`] (Gemma-4's feed-forward epilogue), [`sampling`],
//!   [`fill`], [`dequantize`] (the prefill path's dense expansion), [`bandwidth`].
//! - [`plane`]: the plane (warp) and cube reductions the kernels share; [`device`] and [`pool`]:
//!   buffers, errors, work items.
//!
//! The host API is re-exported here.

// `#[cube]` generates undocumented launch items.
#[allow(missing_docs)]
pub mod activation;
#[allow(missing_docs)]
pub mod attention;
#[allow(missing_docs)]
pub mod bandwidth;
#[cfg(feature = "cuda")]
pub mod cuda_source;
#[allow(missing_docs)]
pub mod dense;
#[allow(missing_docs)]
pub mod dequantize;
pub mod device;
#[allow(missing_docs)]
pub mod embed;
#[allow(missing_docs)]
pub mod expert_gemm;
#[allow(missing_docs)]
pub mod fill;
#[allow(missing_docs)]
pub mod gemma;
pub mod kernel_cache;
#[allow(missing_docs)]
pub mod norms;
#[allow(missing_docs)]
pub mod plane;
pub mod pool;
#[allow(missing_docs)]
pub mod residual;
#[allow(missing_docs)]
pub mod routing;
#[allow(missing_docs)]
pub mod sampling;
#[cfg(test)]
mod testing;

pub use activation::{Activation, GatedInput, gated_act, gated_act_reference, gelu_tanh, silu};
pub use attention::append::{
    Rope, kv_append, kv_append_reference, kv_append_rows, rope_append, rope_reference,
};
pub use attention::decode::{
    AttnSplit, paged_decode_attention, paged_decode_attention_reference, paged_decode_attention_strided,
};
pub use attention::prefill::{
    PREFILL_RUN_ROWS, PrefillKernel, paged_prefill_attention, prefill_run_rows, prefill_runs,
};
pub use attention::prefill_mma::prefill_mma_run_tokens;
pub use attention::{PagedAttnShape, RowLayout};
pub use bandwidth::{stream_read, stream_read_reference};
pub use dense::matmul::{MATMUL_MIN_ROWS, MATMUL_MIN_TOKENS, MatmulKernel};
pub use dense::mma::{MMA_MIN_TOKENS, MmaMode, MmaTuning, dense_mma_supported};
pub use dense::{
    DenseGemm, dense_gemm, dense_gemm_normed, dense_gemm_normed_reference, dense_gemm_reference,
};
pub use dequantize::{ap_dequantize, ap_dequantize_reference};
pub use device::{
    DeviceArray, KernelError, VIEW_ALIGN, read_f32, read_f32_prefix, read_u32, read_u32_f32, sync,
};
pub use embed::{embed, embed_reference};
pub use expert_gemm::gemv::{
    GEMV_HOST_MAX_TOKENS, GEMV_MAX_TOKENS, GEMV_MIN_ITEMS, GEMV_ROWS, GEMV_WARPS_PER_SM, GemvPlan, gemv_plan,
};
pub use expert_gemm::grouped::{
    ExpertBlock, GROUPED_MAX_TOKEN_GROUPS, GROUPED_MIN_MEAN_TOKENS, GROUPED_STAGED_MIN_MEAN_TOKENS,
    GroupedGemm, GroupedKernel, GroupedMode, ap_gemm_grouped, ap_gemm_grouped_reference,
    ap_gemm_grouped_with, grouped_mma_supported, grouped_x_f16, grouped_x_reference, grouped_x_row,
    mean_tokens,
};
pub use expert_gemm::routed::{GATED_MAX_TOKENS, ap_gemm_routed, ap_gemm_routed_gated};
pub use expert_gemm::{GemmConfig, LUT_SLOTS, ap_gemm, ap_gemm_reference};
pub use fill::{fill_hash, fill_hash_reference, fill_uniform, fill_uniform_reference, fill_zero};
pub use gemma::{GemmaFfnOut, gemma_ffn_out, gemma_ffn_out_reference};
pub use norms::head::{
    HeadNorm, head_norm, head_norm_reference, head_norm_rope_append, head_norm_rope_append_reference,
};
pub use norms::{RowNorm, add_rms_norm, add_rms_norm_reference, rms_norm_reference};
pub use pool::{DESC_WORDS, MAX_TOKENS, PoolImage, PoolSlot, WorkItem, upload_items};
pub use residual::{RESIDUAL_STATS, residual_stats, residual_stats_reference};
pub use routing::combine::moe_combine;
pub use routing::gather::{gather_rows, gather_rows_normed, gather_rows_reference, moe_route_gather};
pub use routing::route::{ROUTE_SHARED_CHOICES, moe_route, moe_route_counted};
pub use routing::router::{
    FUSED_ROUTER_MAX_EXPERTS, FUSED_ROUTER_MAX_WEIGHTS, moe_route_gather_router, router_fusable,
    router_logits_reference,
};
pub use routing::{
    LogitsLayout, MoeShape, ROUTE_CHUNK, ROUTE_CHUNK_CHOICES, RouteBuffers, RouteCounters, expert_slot_words,
    route_reference, route_stats_reference,
};
pub use sampling::{argmax, argmax_reference, softcap, softcap_reference};
