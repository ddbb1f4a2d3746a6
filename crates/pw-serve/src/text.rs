//! Token ids to streamed text: incremental detokenization and stop strings.

use tokenizers::Tokenizer;

use crate::ServeError;

/// How many prompt tokens seed the detokenizer's context: enough for decoders that strip or
/// merge across token boundaries (a leading `▁`, byte-fallback pieces), few enough to stay cheap.
const PROMPT_CONTEXT: usize = 5;

/// Turns generated token ids into text deltas one token at a time.
///
/// A character may span several tokens (byte-level BPE, byte fallback); decoding each token
/// alone would print U+FFFD halves. Like vLLM and TGI, this decodes a short window twice,
/// `tokens[prefix..read]` and `tokens[prefix..]`, and emits the difference only once it no
/// longer ends in an incomplete character. Decoding a window (not single tokens) also keeps
/// the spaces decoders such as Metaspace drop at the start of a string.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl IncrementalDetokenizer {
    /// A detokenizer whose context is the tail of the prompt (no text is emitted for it).
    pub fn new(prompt: &[u32]) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        Self { tokens: tail.to_vec(), prefix: 0, read: tail.len() }
    }

    fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String, ServeError> {
        tok.decode(ids, true).map_err(|e| ServeError::Tokenizer(format!("decoding {ids:?}: {e}")))
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, ServeError> {
        self.tokens.push(id);
        let before = Self::decode(tok, &self.tokens[self.prefix..self.read])?;
        let after = Self::decode(tok, &self.tokens[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let delta = match after.strip_prefix(before.as_str()) {
                Some(d) => d.to_string(),
                // A decoder rewrote the earlier text; emit what is new by position.
                None => after.get(before.len()..).unwrap_or_default().to_string(),
            };
            self.prefix = self.read;
            self.read = self.tokens.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text of tokens still held back (an incomplete character at the end), replacement
    /// characters included; call once when the sequence ends.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, ServeError> {
        if self.read == self.tokens.len() {
            return Ok(String::new());
        }
        let before = Self::decode(tok, &self.tokens[self.prefix..self.read])?;
        let after = Self::decode(tok, &self.tokens[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.tokens.len();
        Ok(match after.strip_prefix(before.as_str()) {
            Some(d) => d.to_string(),
            None => after.get(before.len()..).unwrap_or_default().to_string(),
        })
    }
}

/// Cuts generated text at the first stop string, holding back a tail that may still grow into
/// one so a streamed client never sees part of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopText {
    stops: Vec<String>,
    text: String,
    sent: usize,
}

/// What [`StopText::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that may be sent now.
    pub emit: String,
    /// A stop string was reached: the text before it has been emitted, the sequence ends.
    pub stopped: bool,
}

impl StopText {
    /// Watches for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            sent: 0,
        }
    }

    /// Appends decoded text; returns what can be sent and whether a stop string was hit.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        let start = self.text.len();
        self.text.push_str(delta);
        // A stop string ending in the new text starts at most `longest - 1` bytes before it.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = start.saturating_sub(longest.saturating_sub(1)).max(self.sent);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit =
            self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p)).min();
        if let Some(at) = hit {
            let emit = self.text[self.sent..at].to_string();
            self.sent = at;
            self.text.truncate(at);
            return StopOutcome { emit, stopped: true };
        }
        // Hold back the longest tail that is a proper prefix of a stop string.
        let mut keep = self.text.len();
        for s in &self.stops {
            for (i, _) in self.text[self.sent..].char_indices() {
                let at = self.sent + i;
                if at < keep && s.starts_with(&self.text[at..]) {
                    keep = at;
                    break;
                }
            }
        }
        let emit = self.text[self.sent..keep].to_string();
        self.sent = keep;
        StopOutcome { emit, stopped: false }
    }

    /// Text held back so far (sent when the sequence ends for another reason).
    pub fn finish(&mut self) -> String {
        let rest = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        rest
    }

    /// All text accepted so far (without any stop string).
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_across_deltas_is_held_then_cut() {
        let mut s = StopText::new(&["END".to_string()]);
        assert_eq!(s.push("abc E"), StopOutcome { emit: "abc ".into(), stopped: false });
        assert_eq!(s.push("N"), StopOutcome { emit: String::new(), stopped: false });
        assert_eq!(s.push("Dxyz"), StopOutcome { emit: String::new(), stopped: true });
        assert_eq!(s.text(), "abc ");
    }

    #[test]
    fn false_start_is_released() {
        let mut s = StopText::new(&["END".to_string(), "ü!".to_string()]);
        assert_eq!(s.push("xE").emit, "x");
        assert_eq!(s.push("Nx").emit, "ENx");
        assert_eq!(s.push("ü").emit, "");
        assert_eq!(s.finish(), "ü");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut s = StopText::new(&["cd".to_string(), "b".to_string()]);
        assert_eq!(s.push("abcd"), StopOutcome { emit: "a".into(), stopped: true });
    }

    #[test]
    fn no_stops_passes_everything() {
        let mut s = StopText::new(&[String::new()]);
        assert_eq!(s.push("hello").emit, "hello");
        assert_eq!(s.finish(), "");
    }
}
