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
    // gate_up [2·I, H] and down [H, I] of one expert: I = 8, H = 48.
    let (_, dn) = random_block(21, 48, 8, 4, 7);
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
    // A manifest consistent in itself (I = 9) that the stored tensors (I = 8) contradict.
    edit_manifest(dir.path(), |v| {
        v["blocks"][0]["rows"] = 18.into();
        v["blocks"][1]["cols"] = 9.into();
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FormatError::Shape { .. }), "{e:?}");
    assert!(s.contains("layers.0.experts.1.gate_up.planes") && s.contains("[8, 18, 2]"), "{s}");
    edit_manifest(dir.path(), |v| {
        v["blocks"][0]["rows"] = 16.into();
        v["blocks"][1]["cols"] = 8.into();
        v["blocks"][0]["sensitivity"] = serde_json::json!([1.0]);
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(&e, FormatError::ManifestEntry { field, .. } if field == "sensitivity"), "{e:?}");
    assert!(s.contains("has 1 entries, bits 3..=8 need 6"), "{s}");
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

/// Writes one block per `(layer, expert, kind, rows, cols)` (bits 3..=8) and the manifest.
fn write_blocks(dir: &Path, specs: &[(usize, usize, BlockKind, usize, usize)]) -> Manifest {
    let mut w = CheckpointWriter::create(dir).unwrap();
    for (i, &(layer, expert, kind, rows, cols)) in specs.iter().enumerate() {
        let (_, b) = random_block(30 + i as u64, rows, cols, 3, 8);
        let name = format!("layers.{layer}.experts.{expert}.{kind:?}");
        w.add_block(BlockMeta { name, layer, expert, kind, sources: vec![] }, &b).unwrap();
    }
    w.finish().unwrap()
}

/// The error of opening `dir`, checked to be a [`FormatError::ManifestEntry`] on `field` whose
/// text names the manifest file and `entry`.
fn entry_err(dir: &Path, entry: &str, field: &str) -> String {
    let (e, s) = open_err(dir);
    assert!(matches!(&e, FormatError::ManifestEntry { field: f, .. } if f == field), "{e:?}");
    assert!(s.contains(MANIFEST_FILE) && s.contains(entry) && s.contains(&format!("`{field}`")), "{s}");
    s
}

#[test]
fn calibration_routing_round_trips_and_is_checked_against_the_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<_> =
        (0..3).flat_map(|e| [(1, e, BlockKind::GateUp, 16, 8), (1, e, BlockKind::Down, 8, 8)]).collect();
    let mut w = CheckpointWriter::create(dir.path()).unwrap();
    for (i, &(layer, expert, kind, rows, cols)) in specs.iter().enumerate() {
        let (_, b) = random_block(40 + i as u64, rows, cols, 3, 8);
        let name = format!("layers.{layer}.experts.{expert}.{kind:?}");
        w.add_block(BlockMeta { name, layer, expert, kind, sources: vec![] }, &b).unwrap();
    }
    let routing = vec![LayerRouting { layer: 1, mass_share: vec![1.5, 0.5, 1.0] }];
    w.set_routing(routing.clone());
    w.finish().unwrap();
    assert_eq!(Checkpoint::open(dir.path()).unwrap().manifest().routing, routing);

    edit_manifest(dir.path(), |v| v["routing"][0]["mass_share"] = serde_json::json!([1.0, 1.0]));
    let s = entry_err(dir.path(), "routing[0] (layer 1)", "mass_share");
    assert!(s.contains("3 experts"), "{s}");
    edit_manifest(dir.path(), |v| v["routing"][0]["mass_share"] = serde_json::json!([1.0, -1.0, 1.0]));
    entry_err(dir.path(), "routing[0] (layer 1)", "mass_share");
    edit_manifest(dir.path(), |v| {
        v["routing"][0]["mass_share"] = serde_json::json!([1.0, 1.0, 1.0]);
        v["routing"][0]["layer"] = 0.into();
    });
    let s = entry_err(dir.path(), "routing[0] (layer 0)", "layer");
    assert!(s.contains("no expert blocks"), "{s}");
    // Checkpoints written before the field existed still open.
    edit_manifest(dir.path(), |v| {
        v.as_object_mut().unwrap().remove("routing");
    });
    assert!(Checkpoint::open(dir.path()).unwrap().manifest().routing.is_empty());
}

#[test]
fn absolute_block_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    // The very shard, by its absolute path: opened without complaint before.
    let abs = dir.path().join("pw-00001.safetensors").to_str().unwrap().to_string();
    edit_manifest(dir.path(), |v| v["blocks"][0]["file"] = abs.clone().into());
    let s = entry_err(dir.path(), "block `layers.0.experts.1.gate_up` (blocks[0])", "file");
    assert!(s.contains("absolute path"), "{s}");
}

#[test]
fn parent_dir_block_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    write_checkpoint(&ck, DEFAULT_SHARD_BYTES);
    // The shard now sits beside the checkpoint directory, reached by `..`.
    std::fs::rename(ck.join("pw-00001.safetensors"), tmp.path().join("pw-00001.safetensors")).unwrap();
    edit_manifest(&ck, |v| {
        for b in v["blocks"].as_array_mut().unwrap() {
            b["file"] = "../pw-00001.safetensors".into();
        }
        v["dense"]["model.embed_tokens.weight"] = "../pw-00001.safetensors".into();
    });
    let s = entry_err(&ck, "blocks[0]", "file");
    assert!(s.contains("`..` component"), "{s}");
}

#[test]
fn dense_file_outside_the_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    write_checkpoint(&ck, DEFAULT_SHARD_BYTES);
    std::fs::copy(ck.join("pw-00001.safetensors"), tmp.path().join("other.safetensors")).unwrap();
    edit_manifest(&ck, |v| v["dense"]["model.embed_tokens.weight"] = "sub/../../other.safetensors".into());
    entry_err(&ck, "dense tensor `model.embed_tokens.weight`", "file");
}

#[cfg(unix)]
#[test]
fn symlink_out_of_the_directory_is_refused_and_one_inside_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    write_checkpoint(&ck, DEFAULT_SHARD_BYTES);
    let outside = tmp.path().join("elsewhere.safetensors");
    std::fs::rename(ck.join("pw-00001.safetensors"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, ck.join("pw-00001.safetensors")).unwrap();
    let s = entry_err(&ck, "blocks[0]", "file");
    assert!(s.contains("outside the checkpoint directory") && s.contains("elsewhere.safetensors"), "{s}");
    // A link that stays inside the directory is fine.
    std::fs::remove_file(ck.join("pw-00001.safetensors")).unwrap();
    std::fs::rename(&outside, ck.join("real.safetensors")).unwrap();
    std::os::unix::fs::symlink("real.safetensors", ck.join("pw-00001.safetensors")).unwrap();
    Checkpoint::open(&ck).unwrap();
    // So is the Hugging Face cache layout: snapshots/<rev>/file -> ../../blobs/<hash>.
    let repo = tmp.path().join("models--x--y");
    let (snap, blobs) = (repo.join("snapshots/abc"), repo.join("blobs"));
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::rename(ck.join("real.safetensors"), blobs.join("f00d")).unwrap();
    std::os::unix::fs::symlink("../../blobs/f00d", snap.join("pw-00001.safetensors")).unwrap();
    std::fs::copy(ck.join(MANIFEST_FILE), snap.join(MANIFEST_FILE)).unwrap();
    Checkpoint::open(&snap).unwrap();
    // A link to something that is not a regular file is refused too.
    std::fs::remove_file(ck.join("pw-00001.safetensors")).unwrap();
    std::fs::create_dir(ck.join("adir")).unwrap();
    std::os::unix::fs::symlink("adir", ck.join("pw-00001.safetensors")).unwrap();
    let s = entry_err(&ck, "blocks[0]", "file");
    assert!(s.contains("not a regular file"), "{s}");
}

#[test]
fn duplicate_block_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    // The same entry twice: opened before, and counted twice by every byte total.
    edit_manifest(dir.path(), |v| {
        let b = v["blocks"][1].clone();
        v["blocks"].as_array_mut().unwrap().push(b);
    });
    let s = entry_err(dir.path(), "block `layers.0.experts.1.down` (blocks[2])", "name");
    assert!(s.contains("duplicates blocks[1]"), "{s}");
}

#[test]
fn two_blocks_for_one_layer_expert_kind_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let gu = (0, 1, BlockKind::GateUp, 16, 64);
    write_blocks(dir.path(), &[gu, (0, 2, BlockKind::GateUp, 16, 64)]);
    // Distinct names and tensors, one key.
    edit_manifest(dir.path(), |v| v["blocks"][1]["expert"] = 1.into());
    let s = entry_err(dir.path(), "block `layers.0.experts.2.GateUp` (blocks[1])", "kind");
    assert!(s.contains("layer 0 expert 1 GateUp is also block `layers.0.experts.1.GateUp`"), "{s}");
}

#[test]
fn bit_range_errors_name_the_manifest_and_field() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    edit_manifest(dir.path(), |v| v["blocks"][0]["min_bits"] = 9.into());
    let s = entry_err(dir.path(), "blocks[0]", "min_bits");
    assert!(s.contains("9 is outside 3..=8"), "{s}");
    edit_manifest(dir.path(), |v| {
        v["blocks"][0]["min_bits"] = 3.into();
        v["blocks"][1]["max_bits"] = 2.into();
    });
    entry_err(dir.path(), "blocks[1]", "max_bits");
    edit_manifest(dir.path(), |v| {
        v["blocks"][1]["max_bits"] = 7.into();
        v["blocks"][1]["min_bits"] = 8.into();
    });
    let s = entry_err(dir.path(), "block `layers.0.experts.1.down` (blocks[1])", "min_bits");
    assert!(s.contains("8 exceeds max_bits 7"), "{s}");
}

#[test]
fn gate_up_and_down_of_one_expert_must_agree() {
    let dir = tempfile::tempdir().unwrap();
    // Written as two experts, each alone and consistent: gate_up [16, 64], down [48, 8].
    write_blocks(dir.path(), &[(0, 1, BlockKind::GateUp, 16, 64), (0, 2, BlockKind::Down, 48, 8)]);
    // Made one expert, every tensor still matches its entry, but H is 64 for one and 48 for the other.
    edit_manifest(dir.path(), |v| v["blocks"][1]["expert"] = 1.into());
    let s = entry_err(dir.path(), "blocks[0]", "rows");
    assert!(s.contains("gate_up 16x64 and down 48x8") && s.contains("blocks[1]"), "{s}");
}

#[test]
fn experts_of_one_layer_share_a_shape() {
    let dir = tempfile::tempdir().unwrap();
    write_blocks(dir.path(), &[(0, 0, BlockKind::Down, 48, 8), (1, 1, BlockKind::Down, 40, 8)]);
    edit_manifest(dir.path(), |v| v["blocks"][1]["layer"] = 0.into());
    let s = entry_err(dir.path(), "blocks[1]", "rows");
    assert!(s.contains("shape 40x8 differs from 48x8"), "{s}");
}

#[test]
fn odd_gate_up_rows_zero_shapes_and_bad_sensitivity_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    edit_manifest(dir.path(), |v| v["blocks"][0]["rows"] = 15.into());
    entry_err(dir.path(), "blocks[0]", "rows");
    edit_manifest(dir.path(), |v| {
        v["blocks"][0]["rows"] = 16.into();
        v["blocks"][1]["cols"] = 0.into();
    });
    entry_err(dir.path(), "blocks[1]", "cols");
    edit_manifest(dir.path(), |v| {
        v["blocks"][1]["cols"] = 8.into();
        v["blocks"][1]["sensitivity"][2] = (-1.0).into();
    });
    let s = entry_err(dir.path(), "blocks[1]", "sensitivity");
    assert!(s.contains("-1 is not a finite error"), "{s}");
}

#[test]
fn byte_counts_that_overflow_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), DEFAULT_SHARD_BYTES);
    // 8 planes x 2^62 rows x 4 bytes overflows usize; gate_up and down kept in agreement.
    let rows = 1u64 << 62;
    edit_manifest(dir.path(), |v| {
        v["blocks"][0]["rows"] = rows.into();
        v["blocks"][1]["cols"] = (rows / 2).into();
    });
    let s = entry_err(dir.path(), "blocks[0]", "rows");
    assert!(s.contains("overflows"), "{s}");
    // Each block fits (1.75 · 2^63 bytes at 3 bits) but the two together do not.
    let block = |layer| BlockEntry {
        name: format!("layers.{layer}.down"),
        layer,
        expert: 0,
        kind: BlockKind::Down,
        rows: 1 << 59,
        cols: 32,
        min_bits: 3,
        max_bits: 3,
        file: "pw-00001.safetensors".into(),
        sensitivity: vec![0.0],
        sources: vec![],
    };
    let mut m = Manifest {
        magic: MAGIC.into(),
        version: VERSION,
        model_type: None,
        blocks: vec![block(0)],
        dense: Default::default(),
        routing: vec![],
    };
    m.validate(Path::new(MANIFEST_FILE)).unwrap();
    m.blocks.push(block(1));
    let e = m.validate(Path::new(MANIFEST_FILE)).unwrap_err().to_string();
    assert!(e.contains("blocks[1]") && e.contains("overflows"), "{e}");
}

#[test]
fn writer_refuses_a_block_added_twice() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = random_block(40, 16, 64, 3, 8);
    let mut w = CheckpointWriter::create(dir.path()).unwrap();
    let meta =
        || BlockMeta { name: "b".into(), layer: 0, expert: 0, kind: BlockKind::GateUp, sources: vec![] };
    w.add_block(meta(), &b).unwrap();
    w.add_block(meta(), &b).unwrap();
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("duplicates blocks[0]"), "{e}");
    assert!(!dir.path().join(MANIFEST_FILE).exists(), "no manifest for a refused checkpoint");
}

/// A header whose eight tensors of 2^61 − 1 bytes end at 2^64 − 8, with no data.
pub(crate) fn offsets_near_usize_max() -> Vec<u8> {
    let size = (1u64 << 61) - 1;
    let entries: Vec<String> = (0..8u64)
        .map(|k| {
            format!(
                r#""t{k}":{{"dtype":"U8","shape":[{size}],"data_offsets":[{},{}]}}"#,
                k * size,
                (k + 1) * size
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes
}

#[test]
fn shard_offsets_that_overflow_are_an_error_not_a_panic() {
    // safetensors 0.6 overflows adding the header length to these offsets (a panic in test builds).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pw-00001.safetensors");
    std::fs::write(&path, offsets_near_usize_max()).unwrap();
    let e = StFile::open(&path).unwrap_err();
    assert!(matches!(e, FormatError::Safetensors { .. }), "{e:?}");
    assert!(
        e.to_string().contains("pw-00001.safetensors") && e.to_string().contains("past the 0 data bytes"),
        "{e}"
    );
}
