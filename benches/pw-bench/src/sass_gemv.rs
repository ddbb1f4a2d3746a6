//! `pw-bench sass-gemv`: the CUDA C++ of the routed expert GEMV launches of the three
//! models' decode steps, as the CUDA runtime would compile them on the H200, written without
//! a GPU (the IR is expanded on the wgpu client); `scripts/sass_gemv.sh` compiles them for
//! `sm_90a` and reads registers, spills and the inner loops' instructions per weight.

use anyhow::{Context, Result};
use cubecl::prelude::Runtime;
use kernels_cubecl::GroupedKernel;
use kernels_cubecl::cuda_source::{
    gemv_cuda_source, grouped_cuda_source, h200_gemm_config, h200_hardware, prefill_mma_cuda_source,
};
use kernels_cubecl::{Activation, GroupedGemm, LUT_SLOTS, MAX_TOKENS, PagedAttnShape, gemv_plan};
use serde_json::json;

/// Arguments of `sass-gemv`.
#[derive(clap::Args)]
pub struct SassGemvArgs {
    /// Folder for the `.cu` files and `index.json` (one record per launch).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Tokens per routed item (comma-separated; 1 is a batch-1 step, 2 / 4 / 8 the route chunks).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub tokens: Vec<usize>,
}

/// (model, experts, hidden, intermediate, gated activation).
const MODELS: [(&str, usize, usize, usize, Activation); 3] = [
    ("mixtral-8x7b", 8, 4096, 14336, Activation::SiluMul),
    ("qwen1.5-moe-a2.7b", 60, 2048, 1408, Activation::SiluMul),
    ("gemma-4-26b-a4b", 128, 2816, 704, Activation::GeluTanhMul),
];

/// Attention shapes (model, query heads, KV heads, head_dim) of the prefill attention's launches.
const ATTENTION: [(&str, usize, usize, usize); 4] = [
    ("mixtral-8x7b", 32, 8, 128),
    ("qwen1.5-moe-a2.7b", 16, 16, 128),
    ("gemma-4-26b-a4b_sliding", 16, 8, 256),
    ("gemma-4-26b-a4b_full", 16, 2, 512),
];

/// Writes one `.cu` per (model, block, tokens, `x` staging, prefetch) and `index.json`.
pub fn sass_gemv(a: &SassGemvArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::DefaultDevice);
    let hw = h200_hardware();
    let sms = hw.num_streaming_multiprocessors.unwrap_or(1) as usize;
    let mut index = vec![];
    for (model, experts, hidden, inter, gated) in MODELS {
        for &tokens in &a.tokens {
            // Routed items: an expert's tokens in chunks of `tokens` (see `RouteBuffers`).
            let chunk = tokens.next_power_of_two().max(2);
            let n_items = experts * (MAX_TOKENS / chunk);
            for (x_half, prefetch) in [(false, false), (true, false), (false, true), (true, true)] {
                let cfg = kernels_cubecl::GemmConfig {
                    gemv_x_half: x_half,
                    gemv_prefetch: prefetch,
                    ..h200_gemm_config()
                };
                // gate_up with the activation in its epilogue at one token (the decoder's
                // `GATED_MAX_TOKENS`), else plain; down over the applied rows.
                let epilogue = tokens <= kernels_cubecl::GATED_MAX_TOKENS;
                let blocks = [
                    ("gate_up", hidden, Activation::None, epilogue.then_some(gated)),
                    ("down", inter, Activation::Applied, None),
                ];
                for (block, cols, act, glu) in blocks {
                    let name = format!(
                        "{model}_{block}_t{tokens}_x{}_{}",
                        if x_half { "f16" } else { "f32" },
                        if prefetch { "pf" } else { "nopf" }
                    );
                    let Some(plan) = gemv_plan(&hw, cfg, n_items, true, cols, tokens, LUT_SLOTS, glu) else {
                        index.push(json!({"name": name, "model": model, "block": block, "tokens": tokens,
                            "x": if x_half { "f16" } else { "f32" }, "prefetch": prefetch, "gemv": false}));
                        continue;
                    };
                    let src = gemv_cuda_source(&client, cfg, &plan, n_items, true, act, LUT_SLOTS)?;
                    let path = a.out.join(format!("{name}.cu"));
                    std::fs::write(&path, src).with_context(|| format!("writing {}", path.display()))?;
                    index.push(json!({"name": name, "model": model, "block": block, "tokens": tokens,
                        "x": if x_half { "f16" } else { "f32" }, "prefetch": prefetch, "gemv": true,
                        "rows": cfg.gemv_rows, "words_per_lane": cfg.gemv_words_per_lane,
                        "warps": plan.warps, "cubes": plan.cubes, "tb": plan.tb, "glu": plan.glu,
                        "shared_bytes": plan.shared_bytes, "cubes_per_sm": plan.cubes / sms}));
                }
            }
        }
    }
    // The grouped GEMM's launches (gate_up with its activation, down): the per-warp kernel at
    // one, four and eight token groups per pass, the staged one at one, two and four per warp.
    for (model, experts, hidden, inter, gated) in MODELS {
        let (gate_up, down) = GroupedGemm::layer(experts, hidden, inter, gated);
        for (block, g) in [("gate_up", gate_up), ("down", down)] {
            for (kernel, tag, groups) in
                [(GroupedKernel::Mma, "g", [1, 4, 8]), (GroupedKernel::Staged, "staged_g", [1, 2, 4])]
            {
                for groups in groups {
                    let name = format!("grouped_{model}_{block}_{tag}{groups}");
                    let path = a.out.join(format!("{name}.cu"));
                    std::fs::write(&path, grouped_cuda_source(&client, g, kernel, groups)?)
                        .with_context(|| format!("writing {}", path.display()))?;
                    index.push(json!({"name": name, "model": model, "block": block, "token_groups": groups,
                        "grouped": true, "kernel": format!("{kernel:?}")}));
                }
            }
        }
    }
    // The matrix-unit prefill attention at the models' attention shapes (Gemma-4: sliding and
    // full layers), query rows of a fused QKV projection's width.
    for (model, n_heads, n_kv_heads, head_dim) in ATTENTION {
        let shape =
            PagedAttnShape { n_heads, n_kv_heads, head_dim, block_size: 16, max_blocks: 512, window: 0 };
        let name = format!("prefill_mma_{model}");
        let path = a.out.join(format!("{name}.cu"));
        let q_stride = (n_heads + 2 * n_kv_heads) * head_dim;
        std::fs::write(&path, prefill_mma_cuda_source(&client, shape, q_stride)?)
            .with_context(|| format!("writing {}", path.display()))?;
        index.push(json!({"name": name, "model": model, "head_dim": head_dim, "attention": true}));
    }
    let path = a.out.join("index.json");
    std::fs::write(&path, serde_json::to_string_pretty(&index)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("{} launches → {}", index.len(), a.out.display());
    Ok(())
}
