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
        if let Ok(bytes) = tok.token_bytes(id, true) {
            self.pending.extend_from_slice(bytes);
        }
        let search_from = self.emitted;
        self.text.push_str(&take_complete_utf8(&mut self.pending));
        for s in &self.stops {
            // A match may start in held-back text, never in emitted text.
            if let Some(at) = self.text[search_from..].find(s.as_str()) {
                let end = search_from + at;
                let out = self.text[self.emitted..end].to_string();
                self.emitted = end;
                return Pushed {
                    text: out,
                    matched: Some(s.clone()),
                };
            }
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
