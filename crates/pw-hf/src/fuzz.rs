//! Fuzzing on the stable toolchain: property tests that feed random bytes and mutated valid
//! inputs (bytes flipped, set, inserted, deleted, truncated; JSON tokens spliced in; JSON values
//! replaced, removed or added) to the safetensors header reader and the `config.json` parser.
//! Every call must return `Ok` or an error naming the file: proptest runs each case under
//! `catch_unwind`, so a panic fails the test and is shrunk to a small input (the mutators are
//! in `mutate.rs`).
//!
//! `PROPTEST_CASES=100000 cargo test -p pw-hf fuzz` runs deeper; `PROPTEST_RNG_SEED` replays.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::mutate::{apply, apply_json, config, edits, json_edits};
use crate::safetensors_io::{Checkpoint, DType};
use crate::{HfError, ModelConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/pw-models/tests/fixtures")
}

fn read_fixture(rel: &str) -> Vec<u8> {
    let p = fixtures().join(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("fuzz seed {}: {e}", p.display()))
}

// ---------------------------------------------------------------------------------------------
// safetensors

/// A small valid file: every dtype the reader decodes, one it refuses, a scalar, an empty
/// tensor and string metadata.
fn built_safetensors() -> Vec<u8> {
    use safetensors::Dtype as D;
    use safetensors::tensor::TensorView;
    let t: Vec<(&str, D, Vec<usize>, Vec<u8>)> = vec![
        ("a", D::F32, vec![2, 2], (0..16).collect()),
        ("b", D::F16, vec![3], (0..6).collect()),
        ("c", D::BF16, vec![1, 2], (0..4).collect()),
        ("ids", D::I64, vec![2], (0..16).collect()),
        ("w16", D::I16, vec![2], (0..4).collect()),
        ("s", D::F32, vec![], (0..4).collect()),
        ("e", D::F16, vec![0, 4], vec![]),
    ];
    let views: Vec<(String, TensorView)> =
        t.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).unwrap()
}

fn safetensors_seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        vec![
            built_safetensors(),
            read_fixture("mixtral/ref.safetensors"),
            read_fixture("mixtral_f16/model.safetensors"),
        ]
    })
}

/// Eight tensors of 2^61 − 1 bytes end at 2^64 − 8, with no data: safetensors 0.6 adds the
/// header length to that and overflows (a panic with overflow checks) unless refused first.
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

/// Header length + 8 of a seed (where byte edits are focused).
fn header_end(b: &[u8]) -> usize {
    b.get(..8).map_or(b.len(), |n| (u64::from_le_bytes(n.try_into().unwrap()) as usize).saturating_add(8))
}

/// Opens `bytes` as one shard and reads every tensor every way the API offers: each call must
/// return, an error must name the file, and what is returned must agree with the shape.
fn read_everything(bytes: &[u8]) {
    let mut map = memmap2::MmapMut::map_anon(bytes.len()).unwrap();
    map.copy_from_slice(bytes);
    let map = map.make_read_only().unwrap();
    let mut ck = Checkpoint::empty("fuzz".into());
    if let Err(e) = ck.add_shard("fuzz/model.safetensors".into(), map) {
        assert!(matches!(e, HfError::Safetensors { .. }), "{e:?}");
        assert!(e.to_string().contains("fuzz/model.safetensors"), "{e}");
        return;
    }
    let names: Vec<String> = ck.names().map(str::to_string).collect();
    for name in &names {
        let (dtype, shape) = ck.info(name).unwrap();
        let numel: usize = shape.iter().product();
        let (raw_dtype, _, raw) = ck.raw(name).unwrap();
        assert_eq!(raw.len() * 8, numel * raw_dtype.bitsize(), "{name}");
        match ck.read_f32(name) {
            Ok(t) => assert_eq!(t.data.len(), numel, "{name}"),
            Err(e) => {
                assert!(!matches!(dtype, DType::F32 | DType::F16 | DType::BF16), "{name}: {e}");
                assert!(e.to_string().contains(&format!("`{name}`")), "{e}");
            }
        }
        match ck.read_i64(name) {
            Ok((_, v)) => assert_eq!(v.len(), numel, "{name}"),
            Err(e) => assert!(dtype != DType::I64 && e.to_string().contains("fuzz/model.safetensors"), "{e}"),
        }
    }
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    fn fuzz_safetensors_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300), prefix in any::<bool>()) {
        // Half the cases get a length prefix that matches, so the JSON parser sees them.
        let bytes = if prefix {
            let mut b = (bytes.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(&bytes);
            b
        } else {
            bytes
        };
        read_everything(&bytes);
    }

    #[test]
    fn fuzz_safetensors_mutated_files(seed in 0..3usize, edits in edits(), whole in prop::bool::weighted(0.2)) {
        let seeds = safetensors_seeds();
        let s = &seeds[seed];
        let focus = if whole { usize::MAX } else { header_end(s) };
        read_everything(&apply(s, &edits, focus));
    }

    #[test]
    fn fuzz_safetensors_mutated_headers(
        seed in 0..3usize,
        edits in json_edits(),
        data_delta in -9i64..9,
        fix_len in prop::bool::weighted(0.9),
    ) {
        // Valid JSON of valid shape, wrong in its values: the header is rewritten, the data
        // kept (grown or shrunk a little), and the length prefix recomputed.
        let seeds = safetensors_seeds();
        let s = &seeds[seed];
        let end = header_end(s);
        let header: Value = serde_json::from_slice(&s[8..end]).unwrap();
        let text = serde_json::to_vec(&apply_json(&header, &edits)).unwrap();
        let mut data = s[end..].to_vec();
        data.resize((data.len() as i64 + data_delta).max(0) as usize, 0);
        let n = if fix_len { text.len() as u64 } else { (end - 8) as u64 };
        let mut b = n.to_le_bytes().to_vec();
        b.extend_from_slice(&text);
        b.extend_from_slice(&data);
        read_everything(&b);
    }
}

/// Dimensions of generated tensors: small, zero, and the sizes at which byte counts overflow.
const DIMS: [u64; 9] = [0, 1, 2, 3, 7, 1 << 32, (1 << 61) - 1, 1 << 62, u64::MAX];

/// The dtypes of safetensors 0.6 by name, and a name it does not know.
const DTYPES: [&str; 20] = [
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
    "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "Q4",
];

/// One generated tensor: dtype, shape (indices into [`DIMS`]) and, for `Some`, offsets taken
/// from [`DIMS`] instead of following on from the previous tensor.
type GenTensor = (usize, Vec<usize>, Option<(usize, usize)>);

/// A header built from tensors whose offsets follow on from each other (sizes from the shapes,
/// wrapping where they overflow), or are arbitrary; data bytes up to the last end, at most 4 KiB.
fn generated_file(tensors: &[GenTensor]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut start = 0u64;
    for (i, (dtype, shape, offsets)) in tensors.iter().enumerate() {
        let shape: Vec<u64> = shape.iter().map(|&d| DIMS[d]).collect();
        let bits = [8u64, 4, 6, 6, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 8][*dtype];
        let size = shape.iter().fold(bits, |a, &d| a.wrapping_mul(d)) / 8;
        let (s, e) = match offsets {
            Some((s, e)) => (DIMS[*s], DIMS[*e]),
            None => (start, start.wrapping_add(size)),
        };
        start = e;
        header.insert(
            format!("t{i}"),
            json!({"dtype": DTYPES[*dtype], "shape": shape, "data_offsets": [s, e]}),
        );
    }
    let text = serde_json::to_vec(&header).unwrap();
    let mut b = (text.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&text);
    b.resize(b.len() + start.min(4096) as usize, 0);
    b
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    fn fuzz_safetensors_generated_headers(
        tensors in prop::collection::vec(
            (0..DTYPES.len(), prop::collection::vec(0..DIMS.len(), 0..3), prop::option::weighted(0.1, (0..DIMS.len(), 0..DIMS.len()))),
            0..12,
        ),
    ) {
        read_everything(&generated_file(&tensors));
    }
}

#[test]
fn fuzz_regression_offsets_near_usize_max() {
    read_everything(&offsets_near_usize_max());
}

// ---------------------------------------------------------------------------------------------
// config.json

const CONFIG_FIXTURES: [&str; 7] =
    ["gemma4", "gemma4_mm", "mixtral", "mixtral_f16", "mixtral_fused", "qwen2_moe", "qwen2_moe_bf16"];

/// The fixtures' config.json files, each checked to parse.
fn config_seeds() -> &'static [String] {
    static SEEDS: OnceLock<Vec<String>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        CONFIG_FIXTURES
            .iter()
            .map(|d| {
                let s = String::from_utf8(read_fixture(&format!("{d}/config.json"))).unwrap();
                ModelConfig::from_json_str(&s, Path::new("config.json"))
                    .unwrap_or_else(|e| panic!("seed {d}: {e}"));
                s
            })
            .collect()
    })
}

/// Parses `text`: must return, and an error must name the file.
fn parse_config(text: &str) {
    if let Err(e) = ModelConfig::from_json_str(text, Path::new("fuzz/config.json")) {
        assert!(e.to_string().contains("fuzz/config.json"), "{e}");
    }
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    fn fuzz_config_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        parse_config(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn fuzz_config_mutated_text(seed in 0..CONFIG_FIXTURES.len(), edits in edits()) {
        let seeds = config_seeds();
        parse_config(&String::from_utf8_lossy(&apply(seeds[seed].as_bytes(), &edits, usize::MAX)));
    }

    #[test]
    fn fuzz_config_mutated_values(seed in 0..CONFIG_FIXTURES.len(), edits in json_edits()) {
        let seeds = config_seeds();
        let doc: Value = serde_json::from_str(&seeds[seed]).unwrap();
        parse_config(&apply_json(&doc, &edits).to_string());
    }
}

proptest! {
    #![proptest_config(config(1000))]

    /// Through the file system: non-UTF-8 bytes and all, `from_dir` returns.
    #[test]
    fn fuzz_config_from_dir(seed in 0..CONFIG_FIXTURES.len(), edits in edits()) {
        let seeds = config_seeds();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), apply(seeds[seed].as_bytes(), &edits, usize::MAX)).unwrap();
        if let Err(e) = ModelConfig::from_dir(dir.path()) {
            assert!(e.to_string().contains("config.json"), "{e}");
        }
    }
}

/// The seeds parse, and the built safetensors seed reads.
#[test]
fn fuzz_seeds_are_valid() {
    assert_eq!(config_seeds().len(), CONFIG_FIXTURES.len());
    for seed in safetensors_seeds() {
        let mut map = memmap2::MmapMut::map_anon(seed.len()).unwrap();
        map.copy_from_slice(seed);
        Checkpoint::empty("seed".into()).add_shard("seed".into(), map.make_read_only().unwrap()).unwrap();
    }
}
