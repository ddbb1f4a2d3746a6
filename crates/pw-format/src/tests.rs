use crate::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// Relative error budget of the reference mat-vec against dequantize-then-multiply
/// (both f32 accumulation, different summation order).
const MATVEC_RTOL: f32 = 1e-5;

fn random_block(seed: u64, rows: usize, cols: usize, min_bits: u8, max_bits: u8) -> (Vec<f32>, ApBlock) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.2f32..0.2)).collect();
    let b = ApBlock::quantize("t", &w, None, rows, cols, min_bits, max_bits).unwrap();
    (w, b)
}

#[test]
fn pack_unpack_round_trips_for_every_bit_width() {
    let mut rng = StdRng::seed_from_u64(10);
    for cols in [1usize, 31, 32, 33, 100] {
        let rows = 3;
        let idx: Vec<u8> = (0..rows * cols).map(|_| rng.random()).collect();
        let planes = pack_planes(&idx, rows, cols, 8);
        assert_eq!(planes.len(), 8 * rows * cols.div_ceil(32));
        for bits in 1..=8u8 {
            let got = unpack_indices(&planes, rows, cols, bits);
            let want: Vec<u8> = idx.iter().map(|&i| i >> (8 - bits)).collect();
            assert_eq!(got, want, "cols {cols} bits {bits}");
        }
        // Fewer stored planes hold the same leading planes.
        let five = pack_planes(&idx, rows, cols, 5);
        assert_eq!(&five[..], &planes[..five.len()]);
    }
}

#[test]
fn block_dequantize_matches_quantizer() {
    let mut rng = StdRng::seed_from_u64(11);
    let (rows, cols) = (5, 70);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let q = pw_quant::quantize(&w, None, rows, cols).unwrap();
    let b = ApBlock::from_quantized(&q, 3, 8).unwrap();
    for bits in 3..=8 {
        assert_eq!(b.dequantize_reference(bits), q.dequantize(bits), "bits {bits}");
        assert_eq!(b.sensitivity_at(bits), q.sensitivity(bits));
    }
}

#[test]
fn reference_matmul_matches_dequantize_then_multiply() {
    let (rows, cols, tokens) = (24, 200, 3);
    let (_, b) = random_block(12, rows, cols, 3, 8);
    let mut rng = StdRng::seed_from_u64(13);
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    for bits in 3..=8 {
        let w = b.dequantize_reference(bits);
        let y = b.matmul_reference(bits, &x, tokens);
        for t in 0..tokens {
            for r in 0..rows {
                let want: f64 = (0..cols).map(|c| x[t * cols + c] as f64 * w[r * cols + c] as f64).sum();
                let got = y[t * rows + r];
                let scale: f64 = (0..cols).map(|c| (x[t * cols + c] * w[r * cols + c]).abs() as f64).sum();
                assert!(
                    ((got as f64) - want).abs() <= MATVEC_RTOL as f64 * scale,
                    "bits {bits} t {t} r {r}: {got} vs {want}"
                );
            }
        }
        assert_eq!(b.matvec_reference(bits, &x[..cols]), y[..rows].to_vec());
    }
}

#[test]
fn bytes_scale_with_bits() {
    let (_, b) = random_block(14, 8, 64, 3, 8);
    for bits in 3..=8u8 {
        let (planes, lut) = b.bytes_at(bits);
        assert_eq!(planes, bits as usize * 8 * 2 * 4);
        assert_eq!(lut, 8 * (1 << bits) * 2);
    }
}

fn write_checkpoint(dir: &Path, shard_bytes: usize) -> (ApBlock, ApBlock, Manifest) {
    let (_, gu) = random_block(20, 16, 48, 3, 8);
    let (_, dn) = random_block(21, 24, 8, 4, 7);
    let mut w = CheckpointWriter::create(dir).unwrap().with_shard_bytes(shard_bytes);
    w.set_model_type(Some("mixtral".into()));
    let meta = |name: &str, kind| BlockMeta {
        name: name.into(),
        layer: 0,
        expert: 1,
        kind,
        sources: vec![format!("{name}.src")],
    };
    w.add_block(meta("layers.0.experts.1.gate_up", BlockKind::GateUp), &gu).unwrap();
    w.add_block(meta("layers.0.experts.1.down", BlockKind::Down), &dn).unwrap();
    let emb: Vec<u8> = (0..40u16).flat_map(|v| half::f16::from_f32(v as f32).to_le_bytes()).collect();
    w.add_dense("model.embed_tokens.weight", Dtype::F16, vec![10, 4], emb).unwrap();
    let m = w.finish().unwrap();
    (gu, dn, m)
}

#[test]
fn checkpoint_round_trips() {
    for shard_bytes in [1usize, DEFAULT_SHARD_BYTES] {
        let dir = tempfile::tempdir().unwrap();
        let (gu, dn, m) = write_checkpoint(dir.path(), shard_bytes);
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.manifest(), &m);
        assert_eq!(m.bit_range(), Some((4, 7)));
        assert_eq!(ck.block("layers.0.experts.1.gate_up").unwrap(), gu);
        assert_eq!(ck.block("layers.0.experts.1.down").unwrap(), dn);
        let e = ck.dense("model.embed_tokens.weight").unwrap();
        assert_eq!(e.shape(), &[10, 4]);
        assert_eq!(view_to_f32(&e).unwrap()[7], 7.0);
        let files: std::collections::BTreeSet<_> = m.blocks.iter().map(|b| b.file.clone()).collect();
        assert_eq!(files.len(), if shard_bytes == 1 { 2 } else { 1 }, "sharding");
        assert!(matches!(ck.block("nope"), Err(FormatError::UnknownBlock { .. })));
    }
}

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join(MANIFEST_FILE);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

fn open_err(dir: &Path) -> (FormatError, String) {
    let e = Checkpoint::open(dir).unwrap_err();
    let s = e.to_string();
    (e, s)
}

#[test]
fn wrong_version_or_magic_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    edit_manifest(dir.path(), |v| v["version"] = 99.into());
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FormatError::Version { found: 99, supported: VERSION, .. }), "{e:?}");
    assert!(s.contains(MANIFEST_FILE) && s.contains("version"), "{s}");
    edit_manifest(dir.path(), |v| v["magic"] = "gguf".into());
    assert!(matches!(open_err(dir.path()).0, FormatError::Magic { .. }));
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    edit_manifest(dir.path(), |v| v["blocks"][1]["name"] = "layers.0.experts.9.down".into());
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FormatError::MissingTensor { .. }), "{e:?}");
    assert!(s.contains("layers.0.experts.9.down.planes") && s.contains("pw-00001.safetensors"), "{s}");
}

#[test]
fn shape_mismatch_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    edit_manifest(dir.path(), |v| v["blocks"][0]["rows"] = 17.into());
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FormatError::Shape { .. }), "{e:?}");
    assert!(s.contains("layers.0.experts.1.gate_up.planes") && s.contains("[8, 17, 2]"), "{s}");
    edit_manifest(dir.path(), |v| {
        v["blocks"][0]["rows"] = 16.into();
        v["blocks"][0]["sensitivity"] = serde_json::json!([1.0]);
    });
    assert!(matches!(open_err(dir.path()).0, FormatError::Block { .. }));
}

#[test]
fn truncated_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    let f = dir.path().join("pw-00001.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 10).unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FormatError::Safetensors { .. }), "{e:?}");
    assert!(s.contains("pw-00001.safetensors") && s.contains("truncated"), "{s}");
    // A missing shard names the file too.
    std::fs::remove_file(&f).unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FormatError::Io { .. }) && s.contains("pw-00001.safetensors"), "{s}");
}

#[test]
fn invalid_bit_range_is_rejected() {
    let w = vec![0.5f32; 64];
    assert!(matches!(ApBlock::quantize("x", &w, None, 2, 32, 2, 8), Err(FormatError::Block { .. })));
    assert!(matches!(ApBlock::quantize("x", &w, None, 2, 32, 6, 5), Err(FormatError::Block { .. })));
    let bad = vec![f32::NAN; 64];
    let e = ApBlock::quantize("layer.w", &bad, None, 2, 32, 3, 8).unwrap_err();
    assert!(e.to_string().contains("layer.w") && e.to_string().contains("row 0, column 0"), "{e}");
}
