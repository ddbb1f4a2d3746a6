//! End-to-end tests of the `pagedweight` binary.

use std::process::{Command, Output};

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/sample/minilm-l0-ffn-down.safetensors");

fn pw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pagedweight")).args(args).output().expect("run pagedweight")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn quantize_tensor_prints_decreasing_errors_and_writes_an_inspectable_block() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.safetensors");
    let o = pw(&["quantize-tensor", "--input", SAMPLE, "--tensor", "weight", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> =
        String::from_utf8(o.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 6);
    let errs: Vec<f64> = lines.iter().map(|v| v["rel_err"].as_f64().unwrap()).collect();
    let bits: Vec<u64> = lines.iter().map(|v| v["bits"].as_u64().unwrap()).collect();
    assert_eq!(bits, [3, 4, 5, 6, 7, 8]);
    // A real trained FFN matrix: each extra bit roughly halves the error.
    assert!(errs.windows(2).all(|e| e[1] < e[0] * 0.7), "{errs:?}");
    assert!(errs[0] < 0.25 && errs[5] < 0.01, "{errs:?}");

    let o = pw(&["inspect", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("384x1536, bits 3..=8"), "{text}");
    // 8 bits: 8 planes of 384 rows x 48 words x 4 bytes, LUT 384 x 256 x 2 bytes.
    assert!(
        text.contains(&format!("{}", 8 * 384 * 48 * 4)) && text.contains(&format!("{}", 384 * 256 * 2)),
        "{text}"
    );
}

#[test]
fn quantize_tensor_with_importance_and_bit_range() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.safetensors");
    let spec = format!("{SAMPLE}:weight");
    let o = pw(&[
        "quantize-tensor",
        "--input",
        SAMPLE,
        "--tensor",
        "weight",
        "--importance",
        &spec,
        "--min-bits",
        "4",
        "--max-bits",
        "6",
        "--out",
        out.to_str().unwrap(),
    ]);
    // The sample has negative values: not a valid importance.
    assert!(!o.status.success());
    assert!(stderr(&o).contains("importance at row"), "{}", stderr(&o));

    let imp = dir.path().join("imp.safetensors");
    let ones: Vec<u8> = (0..384 * 1536).flat_map(|_| 1f32.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![384, 1536], &ones).unwrap();
    safetensors::serialize_to_file([("fisher", view)], None, &imp).unwrap();
    let spec = format!("{}:fisher", imp.display());
    let o = pw(&[
        "quantize-tensor",
        "--input",
        SAMPLE,
        "--tensor",
        "weight",
        "--importance",
        &spec,
        "--min-bits",
        "4",
        "--max-bits",
        "6",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8(o.stdout).unwrap().lines().count(), 3);
}

#[test]
fn bad_input_names_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.safetensors");
    let o = pw(&["quantize-tensor", "--input", SAMPLE, "--tensor", "nope", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("`nope` is missing") && e.contains("minilm-l0-ffn-down.safetensors"), "{e}");
    assert!(!e.contains("panicked"), "{e}");

    let o = pw(&["inspect", dir.path().join("missing").to_str().unwrap()]);
    assert!(!o.status.success() && !stderr(&o).contains("panicked"));
    let o = pw(&["inspect", SAMPLE]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a checkpoint directory"), "{}", stderr(&o));
}

#[test]
fn inspect_prints_a_checkpoint_manifest() {
    use pw_format::{ApBlock, BlockKind, BlockMeta, CheckpointWriter};
    let dir = tempfile::tempdir().unwrap();
    let mut w = CheckpointWriter::create(dir.path()).unwrap();
    let data: Vec<f32> = (0..64 * 96).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect();
    for (e, kind) in [(0, BlockKind::GateUp), (1, BlockKind::Down)] {
        let b = ApBlock::quantize("b", &data, None, 64, 96, 3, 8).unwrap();
        let name = format!("model.layers.0.experts.{e}.{kind:?}");
        w.add_block(BlockMeta { name, layer: 0, expert: e, kind, sources: vec![] }, &b).unwrap();
    }
    w.finish().unwrap();
    let o = pw(&["inspect", "--blocks", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("blocks: 2") && text.contains("bit range shared by all blocks: 3..=8"), "{text}");
    assert!(text.contains("model.layers.0.experts.1.Down"), "{text}");
    // Two blocks at 3 bits: 2 x (3 planes x 64 rows x 3 words x 4 B) planes, 2 x 64 x 8 x 2 B LUTs.
    let row3 = text.lines().find(|l| l.trim_start().starts_with("3 ")).unwrap();
    let nums: Vec<usize> = row3.split_whitespace().map(|v| v.parse().unwrap()).collect();
    assert_eq!(nums, [3, 2 * 3 * 64 * 3 * 4, 2 * 64 * 8 * 2, 2 * 3 * 64 * 3 * 4 + 2 * 64 * 8 * 2]);
}
