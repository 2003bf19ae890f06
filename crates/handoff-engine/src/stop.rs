//! Turning generated tokens into text deltas, with stop strings: text that
//! could still become a stop string is held back until it cannot.

use handoff_model::tokenizer::{take_complete_utf8, Tokenizer};

/// Result of pushing one token.
pub(crate) struct Pushed {
    /// Text safe to send now.
    pub text: String,
    /// The stop string that matched, if any (generation must end).
    pub matched: Option<String>,
}

/// Per-request detokenizer and stop-string matcher.
pub(crate) struct TextTracker {
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    stops: Vec<String>,
}

impl TextTracker {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops,
        }
    }

    /// Add a token's bytes (special tokens add nothing).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Pushed {
        match tok.token_bytes(id, true) {
            Ok(bytes) => self.push_bytes(bytes),
            Err(_) => self.push_bytes(&[]),
        }
    }

    /// Add raw output bytes (a token's piece).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Pushed {
        self.pending.extend_from_slice(bytes);
        let search_from = self.emitted;
        self.text.push_str(&take_complete_utf8(&mut self.pending));
        // A match may start in held-back text, never in emitted text. The
        // earliest match wins, whatever the order of the stop list (the
        // longest one when two start at the same place).
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|at| (at, s)))
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
        if let Some((at, s)) = first {
            let end = search_from + at;
            let out = self.text[self.emitted..end].to_string();
            self.emitted = end;
            return Pushed {
                text: out,
                matched: Some(s.clone()),
            };
        }
        let hold = self.holdback();
        let safe = self.text.len() - hold;
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        Pushed {
            text: out,
            matched: None,
        }
    }

    /// Longest suffix of the text that is a proper prefix of a stop string,
    /// cut at a char boundary.
    fn holdback(&self) -> usize {
        let mut hold = 0;
        for s in &self.stops {
            for len in (1..s.len()).rev() {
                if len <= hold {
                    break;
                }
                if self.text.len() >= len
                    && self.text.is_char_boundary(self.text.len() - len)
                    && s.is_char_boundary(len)
                    && self.text.ends_with(&s[..len])
                {
                    hold = len;
                    break;
                }
            }
        }
        hold.min(self.text.len() - self.emitted)
    }

    /// Release everything held back (generation ended without a stop match).
    pub fn flush(&mut self) -> String {
        let mut out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out.push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.pending)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, Option<String>, String) {
        let mut t = TextTracker::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let r = t.push_bytes(p);
            out.push(r.text);
            if r.matched.is_some() {
                return (out, r.matched, String::new());
            }
        }
        let rest = t.flush();
        (out, None, rest)
    }

    #[test]
    fn text_that_may_become_a_stop_is_held_then_released() {
        let (chunks, matched, rest) = run(&["END"], &[b"ab", b"cE", b"N", b"x", b"y"]);
        assert_eq!(chunks, ["ab", "c", "", "ENx", "y"]);
        assert_eq!(matched, None);
        assert_eq!(rest, "");
        // Held-back text comes out at the end of generation.
        let (chunks, _, rest) = run(&["END"], &[b"ab", b"EN"]);
        assert_eq!(chunks, ["ab", ""]);
        assert_eq!(rest, "EN");
    }

    #[test]
    fn output_ends_right_before_the_stop_across_pieces() {
        let (chunks, matched, _) = run(&["END"], &[b"hello E", b"N", b"D and more"]);
        assert_eq!(chunks, ["hello ", "", ""]);
        assert_eq!(matched.as_deref(), Some("END"));
    }

    #[test]
    fn earliest_match_wins_whatever_the_list_order() {
        let (chunks, matched, _) = run(&["bc", "ab"], &[b"xabc"]);
        assert_eq!(chunks, ["x"]);
        assert_eq!(matched.as_deref(), Some("ab"));
        // Same start: the longer stop.
        let (_, matched, _) = run(&["a", "ab"], &[b"zab"]);
        assert_eq!(matched.as_deref(), Some("ab"));
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let e = "é".as_bytes();
        let (chunks, _, rest) = run(&[], &[&e[..1], &e[1..], b"!"]);
        assert_eq!(chunks, ["", "é", "!"]);
        assert_eq!(rest, "");
        // A stop made of a multi-byte character split across tokens.
        let (chunks, matched, _) = run(&["é"], &[b"a", &e[..1], &e[1..]]);
        assert_eq!(chunks, ["a", "", ""]);
        assert_eq!(matched.as_deref(), Some("é"));
    }
}
