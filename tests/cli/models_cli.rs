//! `pagedweight logits` / `generate` end to end on the tiny transformers fixtures.

use std::process::Command;

use pw_hf::Checkpoint;
use pw_testkit::{fixture, fixture_copy, write_word_tokenizer};

/// Same bound as the library's f32 fixture tests.
const F32_TOL: f32 = 5e-5;

fn reference(name: &str) -> Checkpoint {
    let dir = fixture(name);
    Checkpoint::from_files(dir.clone(), &[dir.join("ref.safetensors")]).unwrap()
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pagedweight")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn logits_command_matches_transformers() {
    let r = reference("qwen2_moe");
    let ids: Vec<String> = r.read_i64("input_ids").unwrap().1.iter().map(|i| i.to_string()).collect();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.safetensors");
    let (ok, _, err) = run(&[
        "logits",
        "--model",
        fixture("qwen2_moe").to_str().unwrap(),
        "--ids",
        &ids.join(","),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let got = Checkpoint::from_files(tmp.path().to_path_buf(), &[out]).unwrap().read_f32("logits").unwrap();
    let want = r.read_f32("logits").unwrap();
    assert_eq!(got.shape, want.shape);
    let err = got.data.iter().zip(&want.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < F32_TOL, "logits differ by {err}");
}

#[test]
fn generate_command_streams_the_greedy_continuation() {
    let r = reference("gemma4");
    let prompt: Vec<String> = r.read_i64("input_ids").unwrap().1.iter().map(|i| format!("w{i}")).collect();
    let want: Vec<String> = r.read_i64("generated").unwrap().1.iter().map(|i| format!("w{i}")).collect();
    let dir = fixture_copy("gemma4");
    write_word_tokenizer(dir.path(), 96);
    // The fixture's eos (id 1) must not cut the comparison short: transformers ran without it.
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), cfg.replace("\"eos_token_id\": 1,", "")).unwrap();
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    let (ok, out, err) = run(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        &prompt.join(" "),
        "--max-tokens",
        &want.len().to_string(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), want.join(" "));

    // Chat mode wraps the prompt with the template, and sampling is reproducible by seed.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": "w2", "chat_template": "{{ bos_token }}{% for m in messages %} w5 {{ m['content'] }} w6{% endfor %}"}"#,
    )
    .unwrap();
    let sample = |seed: &str| {
        let (ok, out, err) = run(&[
            "generate",
            "--model",
            dir.path().to_str().unwrap(),
            "--prompt",
            "w7 w8",
            "--chat",
            "--max-tokens",
            "6",
            "--temperature",
            "1.0",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "--seed",
            seed,
        ]);
        assert!(ok, "{err}");
        out
    };
    let a = sample("11");
    assert_eq!(a, sample("11"));
    assert_eq!(a.split_whitespace().count(), 6, "{a}");
}

#[test]
fn cli_errors_name_the_problem() {
    let (ok, _, err) =
        run(&["logits", "--model", "/nonexistent", "--ids", "1,2", "--out", "/tmp/x.safetensors"]);
    assert!(!ok && err.contains("/nonexistent/config.json"), "{err}");
    let (ok, _, err) = run(&[
        "logits",
        "--model",
        fixture("mixtral").to_str().unwrap(),
        "--ids",
        "1,999",
        "--out",
        "/tmp/x",
    ]);
    assert!(!ok && err.contains("999"), "{err}");
    let (ok, _, err) = run(&["generate", "--model", fixture("mixtral").to_str().unwrap(), "--prompt", "hi"]);
    assert!(!ok && err.contains("tokenizer.json"), "{err}");
}
