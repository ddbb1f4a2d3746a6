//! `pagedweight serve` end to end on the tiny Mixtral fixture.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn fixture_with_tokenizer() -> tempfile::TempDir {
    let tmp = pw_testkit::fixture_copy("mixtral");
    pw_testkit::write_word_tokenizer(tmp.path(), 96);
    tmp
}

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pagedweight"))
}

#[test]
fn once_prints_the_greedy_completion_and_a_summary() {
    let dir = fixture_with_tokenizer();
    let model = dir.path().to_str().unwrap();
    let o = Command::new(bin())
        .args(["serve", "--model", model, "--once", "w7 w8 w9", "--max-tokens", "12"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    // The completion, the summary, and the experts' memory line (they are pages on every path).
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[2].starts_with("-- memory:") && lines[2].contains("mean 8.00 bits"), "{out}");
    // The same greedy continuation as `pagedweight generate` (dense weights: the 8-bit pages
    // keep this fixture's greedy path).
    let g = Command::new(bin())
        .args(["generate", "--model", model, "--prompt", "w7 w8 w9", "--max-tokens", "12"])
        .output()
        .unwrap();
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    let want = String::from_utf8(g.stdout).unwrap();
    let words = lines[0].split_whitespace().count();
    assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), want.split_whitespace().collect::<Vec<_>>());
    let summary = lines[1];
    assert!(summary.contains(&format!("3 prompt + {words} generated tokens")), "{summary}");
    assert!(summary.contains("tok/s") && summary.contains("KV") && summary.contains("weights"), "{summary}");
}

#[test]
fn serve_on_port_zero_prints_its_url_and_answers() {
    let dir = fixture_with_tokenizer();
    let mut child = Command::new(bin())
        .args(["serve", "--model", dir.path().to_str().unwrap(), "--port", "0", "--served-name", "tiny"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let curl = lines.next().unwrap().unwrap();
    let addr = first.split("http://").nth(1).and_then(|r| r.split('/').next()).unwrap().to_string();
    assert!(curl.starts_with("try: curl http://") && curl.contains("\"model\": \"tiny\""), "{curl}");
    let get = |path: &str, body: Option<&str>| {
        let mut s = TcpStream::connect(&addr).unwrap();
        let req = match body {
            None => format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
            Some(b) => format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
                b.len()
            ),
        };
        s.write_all(req.as_bytes()).unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        resp
    };
    let health = get("/health", None);
    let completion = get("/v1/completions", Some(r#"{"model": "tiny", "prompt": "w3 w4", "max_tokens": 3}"#));
    let unknown = get("/v1/completions", Some(r#"{"model": "other", "prompt": "w3"}"#));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(health.starts_with("HTTP/1.1 200") && health.contains("\"ok\""), "{health}");
    assert!(
        completion.starts_with("HTTP/1.1 200") && completion.contains("\"text_completion\""),
        "{completion}"
    );
    assert!(unknown.starts_with("HTTP/1.1 404") && unknown.contains("model_not_found"), "{unknown}");
}

/// `--fast --gpu-memory-gb`: experts and KV under one budget; `--once` ends with the memory
/// summary (budget, bit mix, KV blocks, page moves).
#[test]
fn once_fast_under_a_memory_budget_prints_the_bit_mix() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-mixtral");
    let o = Command::new(bin())
        .args(["serve", "--fast", "--model", model.to_str().unwrap(), "--gpu-memory-gb", "0.045"])
        .args(["--once", "ROMEO.", "--max-tokens", "6"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    let mem = out.lines().find(|l| l.starts_with("-- memory:")).unwrap_or_else(|| panic!("{out}"));
    assert!(mem.contains("budget") && mem.contains("8-bit") && mem.contains("KV"), "{mem}");
    assert!(mem.contains("mean 8.00 bits"), "no pressure at this budget: {mem}");
    // A budget below the dense weights is refused with a hint.
    let o = Command::new(bin())
        .args(["serve", "--fast", "--model", model.to_str().unwrap(), "--gpu-memory-gb", "0.001"])
        .args(["--once", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("dense weights"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The fast path serves a PagedWeight checkpoint from its calibrated blocks; a Hugging Face
/// directory is quantized at load, and the log says its sensitivities are proxies.
#[test]
fn fast_path_serves_a_pagedweight_checkpoint() {
    let dir = fixture_with_tokenizer();
    let tmp = tempfile::tempdir().unwrap();
    let (calib, q) = (tmp.path().join("calib.txt"), tmp.path().join("q"));
    let words: Vec<String> = (0..64).map(|i| format!("w{}", (i * 7 + 3) % 90)).collect();
    std::fs::write(&calib, words.join(" ")).unwrap();
    let o = Command::new(bin())
        .args(["quantize", "--model", dir.path().to_str().unwrap(), "--out", q.to_str().unwrap()])
        .args(["--calib", calib.to_str().unwrap(), "--ctx", "16", "--calib-tokens", "32"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let serve = |model: &Path| {
        let o = Command::new(bin())
            .args(["serve", "--fast", "--model", model.to_str().unwrap(), "--once", "w7 w8 w9"])
            .args(["--max-tokens", "4"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        let out = String::from_utf8(o.stdout).unwrap();
        assert!(out.lines().any(|l| l.starts_with("-- 3 prompt + 4 generated tokens")), "{out}");
        err
    };
    let err = serve(&q);
    assert!(!err.contains("uniform importance"), "{err}");
    let err = serve(dir.path());
    assert!(err.contains("uniform importance") && err.contains("pagedweight quantize"), "{err}");

    // Issue 28: the reference path (the CPU fallback) serves the checkpoint's experts as pages;
    // `--once` ends with their memory line, and a budget that cannot hold them is refused.
    let cpu = |extra: &[&str]| {
        Command::new(bin())
            .args(["serve", "--device", "cpu", "--model", q.to_str().unwrap(), "--once", "w7 w8 w9"])
            .args(["--max-tokens", "4"])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = cpu(&[]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success() && err.contains("reference path, paged experts"), "{err}");
    let out = String::from_utf8(o.stdout).unwrap();
    let mem = out.lines().find(|l| l.starts_with("-- memory:")).unwrap_or_else(|| panic!("{out}"));
    assert!(mem.contains("mean 8.00 bits"), "{mem}");
    let o = cpu(&["--memory-gb", "0.000001"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success() && err.contains("cannot hold the experts even at 3 bits"), "{err}");
    // A Hugging Face directory under --memory-gb: its experts quantized at load into pages, the
    // log saying the sensitivities are proxies.
    let o = Command::new(bin())
        .args(["serve", "--device", "cpu", "--model", dir.path().to_str().unwrap(), "--memory-gb", "1"])
        .args(["--once", "w7 w8 w9", "--max-tokens", "4"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success() && err.contains("uniform importance"), "{err}");
    assert!(err.contains("reference path, paged experts, planner on"), "{err}");
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.lines().any(|l| l.starts_with("-- memory:")), "{out}");
    // ... and without it: on every path the experts are pages (here at the default 8 bits).
    let o = Command::new(bin())
        .args(["serve", "--device", "cpu", "--model", dir.path().to_str().unwrap()])
        .args(["--once", "w7 w8 w9", "--max-tokens", "4"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success() && err.contains("reference path, paged experts"), "{err}");
    let out = String::from_utf8(o.stdout).unwrap();
    let mem = out.lines().find(|l| l.starts_with("-- memory:")).unwrap_or_else(|| panic!("{out}"));
    assert!(mem.contains("mean 8.00 bits"), "{mem}");
}

/// Issue 32, 2: a context of 10^12 tokens, from config.json or `--max-context`, is refused at
/// start with the field and the bytes named, not a panic or an allocation failure.
#[test]
fn an_absurd_context_is_refused_at_start() {
    let dir = fixture_with_tokenizer();
    let model = dir.path().to_str().unwrap();
    let o = Command::new(bin())
        .args(["serve", "--model", model, "--max-context", "1000000000000", "--once", "w7"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("--max-context") && err.contains("bytes") && !err.contains("panicked"), "{err}");
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(1_000_000_000_000u64);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let o = Command::new(bin()).args(["serve", "--model", model, "--once", "w7"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("max_position_embeddings") && !err.contains("panicked"), "{err}");
}
