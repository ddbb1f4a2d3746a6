//! Fuzzing on the stable toolchain: property tests that feed random bytes and mutated valid
//! manifests and shards to the checkpoint reader. Every call must return `Ok` or an error, never
//! panic (proptest runs each case under `catch_unwind`, so a panic fails the test and is shrunk
//! to a small input), and a manifest that is accepted must hold what validation promises.
//!
//! `PROPTEST_CASES=100000 cargo test -p pw-format fuzz` runs deeper; `PROPTEST_RNG_SEED` replays.

use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::Value;

// One copy of the mutators for both crates' fuzz tests.
#[path = "../../pw-hf/src/mutate.rs"]
mod mutate;

use crate::tests::offsets_near_usize_max;
use crate::*;
use mutate::{apply, apply_json, config, edits, json_edits};

/// Blocks of the seed checkpoint: two layers of two experts, gate_up `[16, 64]` and down
/// `[64, 8]`, bit ranges 3..=8 and 4..=7.
fn seed_blocks() -> Vec<(BlockMeta, ApBlock)> {
    let mut out = Vec::new();
    for layer in 0..2 {
        for expert in 0..2 {
            for (kind, rows, cols, lo, hi) in
                [(BlockKind::GateUp, 16, 64, 3, 8), (BlockKind::Down, 64, 8, 4, 7)]
            {
                let w: Vec<f32> =
                    (0..rows * cols).map(|i| ((i * 7919 + layer) % 257) as f32 / 257.0 - 0.5).collect();
                let name = format!("layers.{layer}.experts.{expert}.{kind:?}");
                let block = ApBlock::quantize(&name, &w, None, rows, cols, lo, hi).unwrap();
                let sources = vec![format!("{name}.weight")];
                out.push((BlockMeta { name, layer, expert, kind, sources }, block));
            }
        }
    }
    out
}

/// Writes the seed checkpoint (blocks over two shards, two dense tensors) into `dir`.
fn write_seed(dir: &Path) -> Manifest {
    let mut w = CheckpointWriter::create(dir).unwrap().with_shard_bytes(8 << 10);
    w.set_model_type(Some("mixtral".into()));
    for (meta, block) in seed_blocks() {
        w.add_block(meta, &block).unwrap();
    }
    w.add_dense("model.norm.weight", Dtype::F32, vec![4], vec![0; 16]).unwrap();
    w.add_dense("lm_head.weight", Dtype::F16, vec![2, 4], vec![0; 16]).unwrap();
    w.finish().unwrap()
}

/// The seed manifest as JSON.
fn seed_manifest() -> &'static Value {
    static SEED: OnceLock<Value> = OnceLock::new();
    SEED.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let m = write_seed(dir.path());
        assert!(m.blocks.iter().map(|b| &b.file).collect::<HashSet<_>>().len() > 1, "seed spans shards");
        serde_json::to_value(m).unwrap()
    })
}

/// Parses `text` as a manifest: must return; an error names the manifest; an accepted manifest
/// has unique names and keys, byte counts that fit, and files inside the directory.
fn parse_manifest(text: &str) {
    let path = Path::new("fuzz/pagedweight.json");
    match Manifest::from_json_str(text, path) {
        Err(e) => assert!(e.to_string().contains("fuzz/pagedweight.json"), "{e}"),
        Ok(m) => accepted(&m),
    }
}

/// What [`Manifest::validate`] promises of a manifest it accepts.
fn accepted(m: &Manifest) {
    let mut names = HashSet::new();
    let mut keys = HashSet::new();
    for b in &m.blocks {
        assert!(names.insert(&b.name) && keys.insert((b.layer, b.expert, b.kind)), "{b:?}");
        assert!((3..=8).contains(&b.min_bits) && b.min_bits <= b.max_bits && b.max_bits <= 8, "{b:?}");
        assert!(b.checked_bytes_at(b.max_bits).is_some(), "{b:?}");
        assert_eq!(b.sensitivity.len(), (b.max_bits - b.min_bits + 1) as usize);
    }
    for file in m.blocks.iter().map(|b| &b.file).chain(m.dense.values()) {
        assert!(
            !file.is_empty() && !Path::new(file).has_root() && !file.split('/').any(|c| c == ".."),
            "{file}"
        );
    }
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    fn fuzz_manifest_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        parse_manifest(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn fuzz_manifest_mutated_text(edits in edits()) {
        let text = serde_json::to_string_pretty(seed_manifest()).unwrap();
        parse_manifest(&String::from_utf8_lossy(&apply(text.as_bytes(), &edits, usize::MAX)));
    }

    #[test]
    fn fuzz_manifest_mutated_values(edits in json_edits()) {
        parse_manifest(&apply_json(seed_manifest(), &edits).to_string());
    }
}

/// A seed checkpoint directory per test, its pristine shards, and the shard names.
fn seed_dir() -> (tempfile::TempDir, Vec<(String, Vec<u8>)>) {
    let dir = tempfile::tempdir().unwrap();
    let m = write_seed(dir.path());
    let files: HashSet<&String> = m.blocks.iter().map(|b| &b.file).chain(m.dense.values()).collect();
    let shards = files.into_iter().map(|f| (f.clone(), std::fs::read(dir.path().join(f)).unwrap())).collect();
    (dir, shards)
}

/// Opens `dir`: must return; an accepted checkpoint holds its promises and every block and
/// dense tensor it names reads.
fn open_everything(dir: &Path) {
    let Ok(ck) = Checkpoint::open(dir) else { return };
    accepted(ck.manifest());
    for b in &ck.manifest().blocks {
        let block = ck.block(&b.name).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((block.rows, block.cols, block.max_bits), (b.rows, b.cols, b.max_bits));
    }
    for name in ck.manifest().dense.keys() {
        ck.dense(name).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn fuzz_checkpoint_open_mutated_manifests_and_shards() {
    // Through the file system: one directory, rewritten per case (a thousand cases each).
    let (dir, shards) = seed_dir();
    let manifest = dir.path().join(MANIFEST_FILE);
    let pristine = std::fs::read(&manifest).unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(config(1000));
    runner
        .run(&json_edits(), |edits| {
            std::fs::write(&manifest, apply_json(seed_manifest(), &edits).to_string()).unwrap();
            open_everything(dir.path());
            Ok(())
        })
        .unwrap();
    std::fs::write(&manifest, &pristine).unwrap();
    Checkpoint::open(dir.path()).unwrap();
    let shard = (0..shards.len(), edits(), prop::bool::weighted(0.8));
    runner
        .run(&shard, |(i, edits, header)| {
            let (name, bytes) = &shards[i];
            let focus = if header {
                u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize + 8
            } else {
                usize::MAX
            };
            std::fs::write(dir.path().join(name), apply(bytes, &edits, focus)).unwrap();
            open_everything(dir.path());
            std::fs::write(dir.path().join(name), bytes).unwrap();
            Ok(())
        })
        .unwrap();
}

#[test]
fn fuzz_regression_shard_offsets_near_usize_max() {
    let (dir, shards) = seed_dir();
    std::fs::write(dir.path().join(&shards[0].0), offsets_near_usize_max()).unwrap();
    open_everything(dir.path());
    assert!(Checkpoint::open(dir.path()).is_err());
}
