//! The benchmark binary run as on the GPU machine, scaled down to run on wgpu here.

use std::process::Command;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_pw-bench")
}

/// `bench-serve` scaled down to the shipped model's shape on wgpu: both policies, every
/// request completes, the records carry the fields, the bit mix over time and where
/// the steps' time went.
#[test]
fn bench_serve_scaled_down_writes_both_policies() {
    // Mixtral, and Qwen2-MoE (shared expert dense, routed experts paged).
    for model in ["tiny", "tiny-qwen"] {
        bench_serve_scaled_down(model);
    }
}

/// The JSON records `pw-bench ARGS --out FILE` writes (`args` split on whitespace; the run
/// must succeed).
fn records(args: &str) -> Vec<serde_json::Value> {
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("records.json");
    let o = Command::new(bin())
        .args(args.split_whitespace())
        .args(["--out", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
}

fn bench_serve_scaled_down(model: &str) {
    let records = records(&format!(
        "bench-serve --device wgpu --model {model} --requests 6 --rate 40 --prompt 4,8 --output 4,10 \
         --max-batch 4 --kv-threshold-blocks 2"
    ));
    let policies: Vec<&str> = records.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["pinned-8bit", "planner"]);
    for r in &records {
        for key in [
            "model",
            "policy",
            "req_s",
            "tok_s",
            "ttft_p50_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "max_concurrent",
            "weight_gb",
            "kv_gb",
        ] {
            assert!(!r[key].is_null(), "{key} missing: {r}");
        }
        assert_eq!(r["model"], model, "{r}");
        assert_eq!(r["completed"], 6, "{r}");
        assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["max_concurrent"].as_u64().unwrap() >= 1, "{r}");
        assert!(r["bit_mix"].is_array(), "{r}");
        // Every step's decode and prefill calls and boundaries were timed.
        let parts = &r["step_parts"];
        for part in ["decode", "prefill", "boundary"] {
            assert!(parts[part]["calls"].as_u64().unwrap() >= 1, "{part}: {r}");
            assert!(parts[part]["s_total"].as_f64().unwrap() > 0.0, "{part}: {r}");
        }
        // The boundaries' page work: timed, and one row per pair of consecutive boundaries.
        assert!(r["boundary_commit_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["calls_out_of_memory"].is_u64(), "{r}");
        let costs = &r["boundary_costs"];
        let rows = costs["boundaries"].as_u64().unwrap();
        assert!(rows >= 1, "{r}");
        assert_eq!(costs["still"].as_u64().unwrap() + costs["moving"].as_u64().unwrap(), rows, "{r}");
        assert!(r["planner_unmet"].is_u64(), "{r}");
        // The timeline's one-second bins hold every step's calls and every boundary.
        let bins = r["timeline"].as_array().unwrap();
        assert!(!bins.is_empty(), "{r}");
        let sum = |key: &str| bins.iter().map(|b| b[key].as_f64().unwrap()).sum::<f64>();
        for (bin, part) in [("decode_s", "decode"), ("prefill_s", "prefill"), ("boundary_s", "boundary")] {
            let total = parts[part]["s_total"].as_f64().unwrap();
            assert!((sum(bin) - total).abs() <= 1e-6 * total.max(1.0), "{bin}: {r}");
        }
        let calls = bins.iter().map(|b| b["decode_calls"].as_u64().unwrap()).sum::<u64>();
        assert_eq!(calls, parts["decode"]["calls"].as_u64().unwrap(), "{r}");
        // One row per completed request, whose tokens and first-token times make the totals.
        let served = r["per_request"].as_array().unwrap();
        assert_eq!(served.len(), 6, "{r}");
        let tokens: u64 = served.iter().map(|q| q["output_tokens"].as_u64().unwrap()).sum();
        let wall = r["wall_s"].as_f64().unwrap();
        assert!((tokens as f64 / wall - r["tok_s"].as_f64().unwrap()).abs() < 1e-6, "{r}");
        for q in served {
            let (at, done) = (q["submitted_s"].as_f64().unwrap(), q["done_s"].as_f64().unwrap());
            assert!(at + q["ttft_ms"].as_f64().unwrap() / 1e3 <= done && done <= wall, "{q}");
            assert!((4..=8).contains(&q["prompt_tokens"].as_u64().unwrap()), "{q}");
        }
    }
}

/// `bench-kernels --attention-only --quick --check` on wgpu: the prefill attention check runs
/// every case against the CPU reference within its budget (only the plain kernel here: no f16
/// `mma` on lavapipe), and each model's shape (Gemma-4's two) is timed.
#[test]
fn bench_kernels_attention_check_on_wgpu() {
    let records = records("bench-kernels --device wgpu --attention-only --quick --check");
    let checks: Vec<_> = records.iter().filter(|r| r["kernel"] == "prefill_attention_check").collect();
    assert_eq!(checks.len(), 6, "{records:?}");
    assert!(checks.iter().any(|c| c["case"] == "gemma4 full, head_dim 512"), "{checks:?}");
    for c in &checks {
        assert!(c["rel_err"].as_f64().unwrap() <= c["budget"].as_f64().unwrap(), "{c}");
    }
    let timed: Vec<_> = records.iter().filter(|r| r["kernel"] == "prefill_attention").collect();
    // Mixtral, Qwen1.5-MoE, Gemma-4's sliding and full layers.
    assert_eq!(timed.len(), 4, "{records:?}");
    assert!(timed.iter().any(|r| r["model"] == "gemma4" && r["layers"] == "full"), "{timed:?}");
    assert!(timed.iter().all(|r| r["time_us"].as_f64().unwrap() > 0.0), "{timed:?}");
}
