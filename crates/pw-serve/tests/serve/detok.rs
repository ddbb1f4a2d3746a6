//! Incremental detokenization with characters split across byte-fallback tokens.

use crate::common;

use pw_serve::IncrementalDetokenizer;

#[test]
fn multibyte_characters_are_never_split() {
    let tok = common::tokenizer();
    let text = "héllo the café € costs 3! 😀 and it is on";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    // The test only means something if some character spans several tokens.
    assert!(ids.windows(2).any(|w| (3..12).contains(&w[0]) && (3..12).contains(&w[1])), "{ids:?}");
    let mut d = IncrementalDetokenizer::new(&[]);
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let piece = d.push(&tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{piece:?} after {id}");
        if piece.is_empty() {
            held += 1;
        }
        out.push_str(&piece);
    }
    out.push_str(&d.flush(&tok).unwrap());
    assert!(held >= 5, "the bytes of é, € and 😀 must be held back: {held}");
    assert_eq!(out, tok.decode(&ids, true).unwrap());
    assert_eq!(out, text);
}

#[test]
fn prompt_context_keeps_the_leading_space() {
    let tok = common::tokenizer();
    let ids = tok.encode("the cat is on", false).unwrap().get_ids().to_vec();
    let (prompt, rest) = ids.split_at(2);
    let mut d = IncrementalDetokenizer::new(prompt);
    let out: String = rest.iter().map(|&i| d.push(&tok, i).unwrap()).collect();
    // Decoding the continuation alone would drop the space Metaspace encodes as `▁`.
    assert!(out.starts_with(' '), "{out:?}");
    assert_eq!(format!("{}{}", tok.decode(prompt, true).unwrap(), out), "the cat is on");
}

#[test]
fn an_incomplete_character_is_flushed_at_the_end() {
    let tok = common::tokenizer();
    let mut d = IncrementalDetokenizer::new(&[]);
    // 0xE2 0x82 (the first two bytes of €) and nothing more.
    assert_eq!(d.push(&tok, 5).unwrap(), "");
    assert_eq!(d.push(&tok, 6).unwrap(), "");
    assert!(d.flush(&tok).unwrap().contains('\u{FFFD}'));
}
