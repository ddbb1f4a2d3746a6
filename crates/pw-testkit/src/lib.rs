//! What the workspace's tests share: the transformers fixtures and the shipped models by path,
//! and the wgpu client the kernel tests run on (Mesa lavapipe in CI).

use std::path::{Path, PathBuf};

use cubecl::Runtime;
use cubecl::client::ComputeClient;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

/// The workspace root.
pub fn workspace() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// A transformers fixture (`models/pw-models/tests/fixtures/<name>`): a tiny random
/// checkpoint of one family with its reference logits.
pub fn fixture(name: &str) -> PathBuf {
    workspace().join("models/pw-models/tests/fixtures").join(name)
}

/// A shipped model or sample (`assets/<name>`).
pub fn asset(name: &str) -> PathBuf {
    workspace().join("assets").join(name)
}

/// The default wgpu device's client. Tests never set the runtime directory the Vulkan loader
/// asks for: `.ci/run` exports `XDG_RUNTIME_DIR`, and without it Mesa only warns.
pub fn wgpu_client() -> ComputeClient<WgpuRuntime> {
    WgpuRuntime::client(&WgpuDevice::DefaultDevice)
}

/// A copy of fixture `name` in a temporary directory, for tests that edit it or add files.
pub fn fixture_copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("a temporary directory");
    for entry in std::fs::read_dir(fixture(name)).expect("the fixture directory") {
        let p = entry.expect("a fixture file").path();
        std::fs::copy(&p, tmp.path().join(p.file_name().expect("a file name")))
            .expect("copying a fixture file");
    }
    tmp
}

/// Writes a word-level `tokenizer.json` into `dir` whose word `wN` is token `N` for `N < vocab`
/// (the fixtures ship no tokenizer; text in tests is then `"w3 w17 …"`).
pub fn write_word_tokenizer(dir: &Path, vocab: usize) {
    let words: serde_json::Map<String, serde_json::Value> =
        (0..vocab).map(|i| (format!("w{i}"), serde_json::Value::from(i))).collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("writing tokenizer.json");
}
