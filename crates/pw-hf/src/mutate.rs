//! Input mutators of the fuzz tests, shared by pw-hf and pw-format (which includes this file
//! with `#[path]`, so both crates mutate alike): byte edits (flip, set, insert, delete,
//! truncate, splice a JSON token) and JSON edits (replace a node by an odd value, remove it, add
//! a key, duplicate an array element).

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Value, json};

/// `cases` per property unless `PROPTEST_CASES` says otherwise; no regression files written
/// into the source tree (a failure becomes a plain unit test instead).
pub fn config(cases: u32) -> Config {
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = cases;
    }
    c.failure_persistence = None;
    c
}

/// Fragments that reach deeper than random bytes: JSON syntax, extreme numbers, dtype and
/// field names, path and Unicode oddities.
const TOKENS: &[&str] = &[
    "0",
    "-1",
    "1.5",
    "-0",
    "1e999",
    "1e-400",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "2305843009213693951",
    "null",
    "true",
    "[]",
    "{}",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "\"",
    "\\",
    "\\u0000",
    "\\ud800",
    "\u{fffd}",
    "\"I16\"",
    "\"F32\"",
    "\"BF16\"",
    "\"F4\"",
    "\"dtype\"",
    "\"shape\"",
    "\"data_offsets\"",
    "\"__metadata__\"",
    "\"model_type\"",
    "\"text_config\"",
    "\"num_hidden_layers\"",
    "\"layer_types\"",
    "\"rope_parameters\"",
    "../",
    "/",
];

/// One byte-level change; positions are reduced modulo the input's length when applied.
#[derive(Debug, Clone)]
pub enum Edit {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
    Truncate { at: usize },
    Token { at: usize, token: usize, replace: bool },
}

pub fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 0..8u8).prop_map(|(at, bit)| Edit::Flip { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Set { at, byte }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
        (any::<usize>(), 1..16usize).prop_map(|(at, len)| Edit::Delete { at, len }),
        any::<usize>().prop_map(|at| Edit::Truncate { at }),
        (any::<usize>(), 0..TOKENS.len(), any::<bool>()).prop_map(|(at, token, replace)| Edit::Token {
            at,
            token,
            replace
        }),
    ];
    prop::collection::vec(edit, 1..8)
}

/// `seed` with `edits` applied, their positions drawn from the first `focus` bytes.
pub fn apply(seed: &[u8], edits: &[Edit], focus: usize) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let pos = |at: usize, b: &Vec<u8>| at % (b.len().min(focus) + 1);
        match e {
            Edit::Flip { at, bit } if !b.is_empty() => {
                let i = pos(*at, &b).min(b.len() - 1);
                b[i] ^= 1 << bit;
            }
            Edit::Set { at, byte } if !b.is_empty() => {
                let i = pos(*at, &b).min(b.len() - 1);
                b[i] = *byte;
            }
            Edit::Insert { at, bytes } => {
                let i = pos(*at, &b);
                b.splice(i..i, bytes.iter().copied());
            }
            Edit::Delete { at, len } => {
                let i = pos(*at, &b);
                b.drain(i..(i + len).min(b.len()));
            }
            Edit::Truncate { at } => b.truncate(at % (b.len() + 1)),
            Edit::Token { at, token, replace } => {
                let t = TOKENS[*token].as_bytes();
                let i = pos(*at, &b);
                let end = if *replace { (i + t.len()).min(b.len()) } else { i };
                b.splice(i..end, t.iter().copied());
            }
            _ => {}
        }
    }
    b
}

/// Values a mutated JSON field takes: wrong types, zero, negative, huge, fractional,
/// path-like strings, empty and nested containers.
fn pool(i: usize) -> Value {
    let values = [
        json!(0),
        json!(1),
        json!(-1),
        json!(2),
        json!(3),
        json!(8),
        json!(9),
        json!(4096),
        json!(4097),
        json!(1u64 << 40),
        json!((1u64 << 61) - 1),
        json!(u64::MAX),
        json!(-1.5),
        json!(0.5),
        json!(1e300),
        json!(null),
        json!(true),
        json!(""),
        json!("x"),
        json!("../../etc/passwd"),
        json!("/etc/passwd"),
        json!("I16"),
        json!("default"),
        json!("proportional"),
        json!("sliding_attention"),
        json!([]),
        json!({}),
        json!([0, 1, 2]),
        json!([0, u64::MAX]),
        json!(["sliding_attention", "full_attention"]),
        json!({"rope_type": "proportional", "partial_rotary_factor": 0.25}),
    ];
    values[i % values.len()].clone()
}

/// One JSON-level change at the `node`-th node (children before their parent) of a document.
#[derive(Debug, Clone)]
pub struct JsonEdit {
    node: usize,
    action: u8,
    value: usize,
    key: usize,
}

pub fn json_edits() -> impl Strategy<Value = Vec<JsonEdit>> {
    let e = (any::<usize>(), 0..4u8, any::<usize>(), any::<usize>())
        .prop_map(|(node, action, value, key)| JsonEdit { node, action, value, key });
    prop::collection::vec(e, 1..5)
}

/// JSON pointers of every node of `v`, children before their parent, and every object key met.
fn nodes(v: &Value, at: String, out: &mut Vec<String>, keys: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                keys.push(k.clone());
                nodes(c, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out, keys);
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                nodes(c, format!("{at}/{i}"), out, keys);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// `doc` with `edits` applied: replace a node by a [`pool`] value, remove it, add a key seen
/// elsewhere in the document to an object, or duplicate an array element.
pub fn apply_json(doc: &Value, edits: &[JsonEdit]) -> Value {
    let mut doc = doc.clone();
    for e in edits {
        let (mut ptrs, mut keys) = (Vec::new(), Vec::new());
        nodes(&doc, String::new(), &mut ptrs, &mut keys);
        let ptr = ptrs[e.node % ptrs.len()].clone();
        match e.action {
            0 => *doc.pointer_mut(&ptr).expect("a node") = pool(e.value),
            1 => {
                let Some((parent, last)) = ptr.rsplit_once('/') else { continue };
                let last = last.replace("~1", "/").replace("~0", "~");
                match doc.pointer_mut(parent) {
                    Some(Value::Object(m)) => {
                        m.remove(&last);
                    }
                    Some(Value::Array(a)) => {
                        a.remove(last.parse::<usize>().expect("an index"));
                    }
                    _ => {}
                }
            }
            2 => {
                if let (Some(Value::Object(m)), false) = (doc.pointer_mut(&ptr), keys.is_empty()) {
                    m.insert(keys[e.key % keys.len()].clone(), pool(e.value));
                }
            }
            _ => {
                if let Some(Value::Array(a)) = doc.pointer_mut(&ptr)
                    && !a.is_empty()
                {
                    let c = a[e.key % a.len()].clone();
                    a.push(c);
                }
            }
        }
    }
    doc
}

/// Byte and JSON edits do what they say: a fuzzer whose mutations were no-ops would test
/// nothing.
#[test]
fn fuzz_mutators_change_their_input() {
    let seed = br#"{"a":[1,2],"b":{"c":"d"}}"#;
    let out = apply(
        seed,
        &[Edit::Token { at: 1, token: 0, replace: false }, Edit::Truncate { at: 10 }],
        usize::MAX,
    );
    assert_eq!(out, br#"{0"a":[1,2"#);
    let doc: Value = serde_json::from_slice(seed).unwrap();
    let e = |node, action, value, key| JsonEdit { node, action, value, key };
    // Children before their parent: /a/0, /a/1, /a, /b/c, /b, "" (root).
    assert_eq!(apply_json(&doc, &[e(0, 0, 2, 0)]), json!({"a":[-1,2],"b":{"c":"d"}}));
    assert_eq!(apply_json(&doc, &[e(2, 1, 0, 0)]), json!({"b":{"c":"d"}}));
    assert_eq!(apply_json(&doc, &[e(4, 2, 17, 0)]), json!({"a":[1,2],"b":{"a":"", "c":"d"}}));
    assert_eq!(apply_json(&doc, &[e(2, 3, 0, 1)]), json!({"a":[1,2,2],"b":{"c":"d"}}));
}
