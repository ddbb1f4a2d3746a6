//! `pagedweight quantize` and `eval-ppl` end to end on the tiny transformers fixtures, with a
//! word-level tokenizer (word `wN` is token N).

use std::path::Path;
use std::process::Command;

use pw_testkit::{fixture_copy, write_word_tokenizer};

/// The bound for the shipped model: 8-bit perplexity within 0.5% of the original.
const SHIPPED_Q8_RTOL: f64 = 5e-3;
/// Perplexity of the 8-bit checkpoint vs the original (observed 4e-6 relative on the random
/// Mixtral fixture, whose 8-bit logits differ by ~3e-4 of their scale).
const PPL_Q8_RTOL: f64 = 1e-3;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pagedweight")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Copy of a fixture with a word-level tokenizer over its 96 ids and a calib.txt.
fn model_dir(name: &str) -> tempfile::TempDir {
    let tmp = fixture_copy(name);
    write_word_tokenizer(tmp.path(), 96);
    std::fs::write(tmp.path().join("calib.txt"), text(120, 3)).unwrap();
    tmp
}

/// `n` pseudo-random words.
fn text(n: usize, seed: usize) -> String {
    (0..n).map(|i| format!("w{}", (i * 53 + seed * 17 + (i * i) % 7) % 96)).collect::<Vec<_>>().join(" ")
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

fn eval(model: &Path, text: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["eval-ppl", "--model", model.to_str().unwrap(), "--text", text.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (ok, out, err) = run(&args);
    assert!(ok, "{err}");
    let keys: Vec<&str> = out.split('"').skip(1).step_by(2).collect();
    assert_eq!(keys, ["ppl", "tokens", "expert_bytes"], "{out}");
    json(&out)
}

#[test]
fn quantize_then_eval_ppl_mixtral() {
    let src = model_dir("mixtral");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    // No --calib: calib.txt beside the model.
    let (ok, stdout, err) = run(&[
        "quantize",
        "--model",
        src.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--ctx",
        "16",
        "--calib-tokens",
        "64",
        "--threads",
        "2",
    ]);
    assert!(ok, "{err}");
    let summary = json(&stdout);
    // 3 layers x 4 experts x (gate_up, down).
    assert_eq!(summary["blocks"], 24, "{summary}");
    assert_eq!((summary["calib_tokens"].as_u64(), summary["calib_windows"].as_u64()), (Some(64), Some(4)));
    for f in ["config.json", "tokenizer.json", "generation_config.json", "pagedweight.json"] {
        assert!(out.join(f).is_file(), "{f} missing from the checkpoint");
    }

    let heldout = tmp.path().join("heldout.txt");
    std::fs::write(&heldout, text(150, 11)).unwrap();
    let hf = eval(src.path(), &heldout, &["--ctx", "32"]);
    // 150 tokens in windows of 32: four full (31 predictions each) and one of 22 (21).
    assert_eq!(hf["tokens"], 4 * 31 + 21);
    // f32 experts: 3 layers x 4 experts x 3 matrices of 48x32 x 4 bytes.
    assert_eq!(hf["expert_bytes"], 3 * 4 * 3 * 48 * 32 * 4);
    let q8 = eval(&out, &heldout, &["--ctx", "32", "--bits", "8"]);
    let q3 = eval(&out, &heldout, &["--ctx", "32", "--bits", "3", "--batch", "1"]);
    assert_eq!(q8["tokens"], hf["tokens"]);
    // Planes + LUTs: per gate_up block (96 rows, 32 cols = 1 word) b·96·4 + 96·2^b·2 bytes,
    // per down block (32 rows, 48 cols = 2 words) b·32·2·4 + 32·2^b·2.
    let bytes = |b: u64| 12 * (b * 96 * 4 + 96 * (1 << b) * 2 + b * 32 * 2 * 4 + 32 * (1 << b) * 2);
    assert_eq!(q8["expert_bytes"], bytes(8));
    assert_eq!(q3["expert_bytes"], bytes(3));
    let (p, p8, p3) = (hf["ppl"].as_f64().unwrap(), q8["ppl"].as_f64().unwrap(), q3["ppl"].as_f64().unwrap());
    let rel8 = (p8 - p).abs() / p;
    assert!(rel8 <= PPL_Q8_RTOL, "ppl {p} vs 8-bit {p8}: {rel8:e}");
    assert!((p3 - p).abs() / p > rel8, "3-bit ppl {p3} should move further from {p} than 8-bit {p8}");
    // Without --bits a quantized checkpoint runs at its highest bit-width.
    assert_eq!(eval(&out, &heldout, &["--ctx", "32"])["ppl"], q8["ppl"]);

    // logits (and so generate) accept the quantized directory too.
    let logits = tmp.path().join("l.safetensors");
    let (ok, _, err) = run(&[
        "logits",
        "--model",
        out.to_str().unwrap(),
        "--ids",
        "1,2,3",
        "--out",
        logits.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
}

#[test]
fn quantize_and_eval_errors_name_the_problem() {
    let src = model_dir("qwen2_moe");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    std::fs::remove_file(src.path().join("calib.txt")).unwrap();
    let m = src.path().to_str().unwrap();
    let (ok, _, err) = run(&["quantize", "--model", m, "--out", out.to_str().unwrap()]);
    assert!(!ok && err.contains("calib.txt") && err.contains("--calib"), "{err}");
    let missing = tmp.path().join("nope.txt");
    let (ok, _, err) = run(&[
        "quantize",
        "--model",
        m,
        "--out",
        out.to_str().unwrap(),
        "--calib",
        missing.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("nope.txt"), "{err}");

    let heldout = tmp.path().join("t.txt");
    std::fs::write(&heldout, text(20, 1)).unwrap();
    let (ok, _, err) = run(&["eval-ppl", "--model", m, "--text", heldout.to_str().unwrap(), "--bits", "4"]);
    assert!(!ok && err.contains("no pagedweight.json"), "{err}");
    let (ok, _, err) = run(&["eval-ppl", "--model", m, "--text", missing.to_str().unwrap()]);
    assert!(!ok && err.contains("nope.txt"), "{err}");
    std::fs::write(&heldout, "w1").unwrap();
    let (ok, _, err) = run(&["eval-ppl", "--model", m, "--text", heldout.to_str().unwrap()]);
    assert!(!ok && err.contains("1 tokens"), "{err}");
    let (ok, _, err) = run(&["eval-ppl", "--model", m, "--text", heldout.to_str().unwrap(), "--ctx", "1"]);
    assert!(!ok && err.contains("--ctx 1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The shipped default model, quantized with fast settings (1024 calibration tokens): 8-bit
/// perplexity on the first 2048 held-out tokens within 0.5% of the original, 3-bit worse.
#[test]
fn shipped_model_quantizes_with_8_bit_perplexity_within_half_a_percent() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-mixtral");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let m = dir.to_str().unwrap();
    let (ok, _, err) =
        run(&["quantize", "--model", m, "--out", out.to_str().unwrap(), "--calib-tokens", "1024"]);
    assert!(ok, "{err}");
    let heldout = dir.join("heldout.txt");
    let fast = ["--max-tokens", "2048", "--batch", "4"];
    let p = eval(&dir, &heldout, &fast)["ppl"].as_f64().unwrap();
    let at = |b: &str| {
        let mut args = fast.to_vec();
        args.extend(["--bits", b]);
        eval(&out, &heldout, &args)["ppl"].as_f64().unwrap()
    };
    let (p8, p3) = (at("8"), at("3"));
    assert!((p8 - p).abs() / p <= SHIPPED_Q8_RTOL, "8-bit ppl {p8} vs {p}");
    assert!(p3 > p8, "3-bit ppl {p3} should exceed 8-bit {p8}");
}

/// `eval-ppl --expert-budget-bytes --policy`: uniform takes the highest single bit-width that
/// fits, the planner a mixed allocation within the budget (using the residual head saved beside
/// the checkpoint); an HF directory gives the FP16 figure; a budget below every block at 3 bits
/// and an unknown policy token are errors that say so.
#[test]
fn eval_ppl_under_an_expert_budget() {
    let src = model_dir("mixtral");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let (ok, _, err) = run(&[
        "quantize",
        "--model",
        src.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--ctx",
        "16",
        "--calib-tokens",
        "64",
    ]);
    assert!(ok, "{err}");
    // A head with zero weights (multipliers 1) beside the checkpoint: the planner must load it.
    let head = pw_planner::ResidualHeadConfig::new(3).init::<burn_ndarray::NdArray<f32>>(&Default::default());
    head.save(&out).unwrap();
    let heldout = tmp.path().join("heldout.txt");
    std::fs::write(&heldout, text(150, 11)).unwrap();
    // Same byte formula as `quantize_then_eval_ppl_mixtral`: 24 blocks of the fixture.
    let bytes = |b: u64| 12 * (b * 96 * 4 + 96 * (1 << b) * 2 + b * 32 * 2 * 4 + 32 * (1 << b) * 2);
    let budget = bytes(4) + (bytes(5) - bytes(4)) / 2;
    let at = |model: &Path, policy: &str, budget: u64| {
        let b = budget.to_string();
        let (ok, out, err) = run(&[
            "eval-ppl",
            "--model",
            model.to_str().unwrap(),
            "--text",
            heldout.to_str().unwrap(),
            "--ctx",
            "32",
            "--expert-budget-bytes",
            &b,
            "--policy",
            policy,
        ]);
        (ok, out, err)
    };
    let get = |model: &Path, policy: &str| {
        let (ok, out, err) = at(model, policy, budget);
        assert!(ok, "{policy}: {err}");
        // The documented leading keys, in order.
        let at = |k: &str| out.find(&format!("\"{k}\":")).unwrap_or_else(|| panic!("no {k} in {out}"));
        assert!(out.starts_with("{\"policy\":") && at("ppl") < at("expert_bytes"), "{out}");
        json(&out)
    };
    let uniform = get(&out, "uniform");
    assert_eq!(uniform["policy"], "uniform");
    assert_eq!(uniform["bits"], 4, "{uniform}");
    assert_eq!(uniform["expert_bytes"], bytes(4));
    assert_eq!(uniform["bits_histogram"], serde_json::json!({"4": 24}));
    let q4 = eval(&out, &heldout, &["--ctx", "32", "--bits", "4"]);
    assert_eq!(uniform["ppl"], q4["ppl"], "uniform at 4 bits is the --bits 4 model");

    for policy in ["planner", "planner,no-routing,no-residual,no-sensitivity"] {
        let p = get(&out, policy);
        assert_eq!(p["policy"], policy);
        let used = p["expert_bytes"].as_u64().unwrap();
        assert!(used <= budget && used > bytes(4), "{policy}: {used} bytes for a budget of {budget}");
        let hist = p["bits_histogram"].as_object().unwrap();
        assert!(hist.len() >= 2, "{policy}: a mixed allocation, got {p}");
        // Per-prompt plans report the mean pages per bit-width over the windows.
        let pages: f64 = hist.values().map(|v| v.as_f64().unwrap()).sum();
        assert!((pages - 24.0).abs() < 0.05, "{policy}: {p}");
        assert!(p["ppl"].as_f64().unwrap().is_finite());
    }
    let planner = get(&out, "planner");
    assert_eq!(planner["residual"], "head-per-prompt");
    assert_eq!(planner["routing_multiplier"], "relative", "quantize recorded the calibration routing");
    // 150 tokens in windows of 32: five prompts; a zero head gives them all factors 1, so one
    // allocation and the same perplexity as the head on the text's mean features.
    assert_eq!(
        (planner["prompts"].as_u64(), planner["allocations"].as_u64()),
        (Some(5), Some(1)),
        "{planner}"
    );
    let text_mean = get(&out, "planner,text-residual");
    assert_eq!(text_mean["residual"], "head-text-mean");
    assert_eq!(text_mean["ppl"], planner["ppl"]);
    // A head whose weights read the features gives prompts their own plans, each within the
    // budget (random weights at a few scales: large ones saturate the bound for every prompt).
    <burn_ndarray::NdArray<f32> as burn::tensor::backend::Backend>::seed(&Default::default(), 7);
    let mut allocations = Vec::new();
    for std in [0.01, 0.1, 1.0] {
        let mut planted = head.clone();
        let w = burn::tensor::Tensor::<burn_ndarray::NdArray<f32>, 2>::random(
            planted.linear.weight.dims(),
            burn::tensor::Distribution::Normal(0.0, std),
            &Default::default(),
        );
        planted.linear.weight = burn::module::Param::from_tensor(w);
        planted.save(&out).unwrap();
        let varied = get(&out, "planner");
        assert!(varied["expert_bytes"].as_u64().unwrap() <= budget, "{varied}");
        assert!(varied["ppl"].as_f64().unwrap().is_finite(), "{varied}");
        allocations.push(varied["allocations"].as_u64().unwrap());
    }
    assert!(allocations.iter().any(|&a| a >= 2), "allocations per head scale: {allocations:?}");
    head.save(&out).unwrap();
    let absolute = get(&out, "planner,absolute-routing");
    assert_eq!(
        (&absolute["policy"], &absolute["routing_multiplier"]),
        (&"planner,absolute-routing".into(), &"absolute".into())
    );
    // The bytes-only ablation skips the statistics pass.
    assert_eq!(get(&out, "planner,no-routing,no-residual")["residual"], "off");

    let fp16 = get(src.path(), "planner");
    assert_eq!(fp16["policy"], "fp16");
    assert_eq!(fp16["expert_bytes"], 3 * 4 * 3 * 48 * 32 * 4);

    let (ok, _, err) = at(&out, "uniform", bytes(3) - 1);
    assert!(!ok && err.contains("below") && err.contains(&bytes(3).to_string()), "{err}");
    let (ok, _, err) = at(&out, "planner", bytes(3) - 1);
    assert!(!ok && err.contains(&bytes(3).to_string()), "{err}");
    let (ok, _, err) = at(&out, "planner,no-routin", budget);
    assert!(!ok && err.contains("no-routin") && err.contains("no-routing"), "{err}");
    let (ok, _, err) = at(&out, "greedy", budget);
    assert!(!ok && err.contains("greedy") && err.contains("uniform"), "{err}");
    let (ok, _, err) = at(&out, "uniform,no-routing", budget);
    assert!(!ok && err.contains("uniform"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `generate --bits` / `--weight-budget-gb` run a quantized model through the paged experts
/// (the page table on the host arenas here; the grouped kernel on GPU backends).
#[test]
fn generate_runs_a_quantized_model_through_paged_experts() {
    let src = model_dir("mixtral");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let (ok, _, err) = run(&[
        "quantize",
        "--model",
        src.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--ctx",
        "16",
        "--calib-tokens",
        "32",
    ]);
    assert!(ok, "{err}");
    let q = out.to_str().unwrap();
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", q, "--prompt", "w3 w5 w7", "--max-tokens", "5"];
        args.extend_from_slice(extra);
        run(&args)
    };
    // Dequantized at 8 bits vs paged at 8 bits: the same greedy tokens.
    let (ok, dense, err) = generate(&[]);
    assert!(ok, "{err}");
    let (ok, paged, err) = generate(&["--bits", "8"]);
    assert!(ok, "{err}");
    assert_eq!(paged, dense);
    assert!(err.contains("paged experts: 24 pages at 8 bits"), "{err}");
    // Bytes per bit-width as in `quantize_then_eval_ppl_mixtral`: 3 bits 47616, 4 bits 79872.
    let (ok, _, err) = generate(&["--weight-budget-gb", "0.00005"]);
    assert!(ok && err.contains("at 3 bits"), "{err}");
    let (ok, _, err) = generate(&["--weight-budget-gb", "0.00008"]);
    assert!(ok && err.contains("at 4 bits"), "{err}");
    let (ok, _, err) = generate(&["--weight-budget-gb", "0.00004"]);
    assert!(!ok);
    assert!(err.contains("need 47616 bytes at 3 bits") && err.contains("budget of 40000 bytes"), "{err}");
    let (ok, _, err) = generate(&["--weight-budget-gb", "0.00008", "--bits", "5"]);
    assert!(!ok && err.contains("need 136704 bytes at 5 bits"), "{err}");
    // Paged experts need a quantized checkpoint.
    let (ok, _, err) =
        run(&["generate", "--model", src.path().to_str().unwrap(), "--prompt", "w1", "--bits", "4"]);
    assert!(!ok && err.contains("pagedweight.json"), "{err}");
}

/// Weights that give NaN logits make `eval-ppl` fail, naming the cause, instead of printing
/// `"ppl":null` and exiting 0.
#[test]
fn eval_ppl_fails_on_non_finite_logits() {
    let tmp = model_dir("mixtral");
    let path = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let norm = "model.norm.weight";
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let (_, dtype, _, data) = tensors.iter_mut().find(|t| t.0 == norm).expect("the fixture has a final norm");
    assert_eq!(*dtype, safetensors::Dtype::F32);
    for w in data.chunks_exact_mut(4) {
        w.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let heldout = tmp.path().join("t.txt");
    std::fs::write(&heldout, text(40, 2)).unwrap();
    let (ok, out, err) =
        run(&["eval-ppl", "--model", tmp.path().to_str().unwrap(), "--text", heldout.to_str().unwrap()]);
    assert!(!ok, "eval-ppl succeeded on NaN weights: {out}");
    assert!(err.contains("not finite"), "{err}");
    assert!(!out.contains("null"), "{out}");
}
