//! SentencePiece-style tokenization of GGUF `llama` vocabularies, the way
//! llama.cpp's `llm_tokenizer_spm_session` does it: start from UTF-8
//! characters, repeatedly merge the adjacent pair whose concatenation is the
//! vocabulary entry with the highest score (leftmost on ties), and write
//! characters that are not in the vocabulary as `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The SentencePiece word-boundary mark that stands for a space.
pub const SPACE_MARK: char = '\u{2581}';

/// A candidate merge of two adjacent symbols.
#[derive(Debug, PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        // Highest score first; on ties the leftmost pair.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A run of bytes of the input in the linked list of symbols.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// The score-driven merger over one vocabulary.
#[derive(Debug)]
pub struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
}

impl Spm {
    /// Build from the vocabulary, its scores and the `<0xXX>` byte tokens.
    pub fn new(tokens: &[String], scores: Vec<f32>, unk: Option<u32>) -> Spm {
        let mut ids = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
                u8::try_from(b)
                    .ok()
                    .filter(u8::is_ascii)
                    .and_then(|c| ids.get(&char::from(c).to_string()).copied())
            });
        }
        Spm {
            ids,
            scores,
            byte_tokens,
            unk,
        }
    }

    fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Append the ids of `text` (spaces already escaped as [`SPACE_MARK`]).
    pub fn tokenize(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        if symbols.is_empty() {
            return;
        }
        let mut queue = BinaryHeap::new();
        let try_add = |queue: &mut BinaryHeap<Bigram>,
                       symbols: &[Symbol],
                       l: Option<usize>,
                       r: Option<usize>| {
            let (Some(l), Some(r)) = (l, r) else { return };
            let (a, b) = (symbols[l], symbols[r]);
            let piece = &text[a.start..b.start + b.len];
            if let Some(&id) = self.ids.get(piece) {
                queue.push(Bigram {
                    score: self.score(id),
                    left: l,
                    right: r,
                    size: piece.len(),
                });
            }
        };
        for i in 1..symbols.len() {
            try_add(&mut queue, &symbols, Some(i - 1), Some(i));
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (symbols[bg.left], symbols[bg.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
                continue;
            }
            symbols[bg.left].len += r.len;
            symbols[bg.right].len = 0;
            symbols[bg.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(bg.left);
            }
            let left = symbols[bg.left];
            try_add(&mut queue, &symbols, left.prev, Some(bg.left));
            try_add(&mut queue, &symbols, Some(bg.left), left.next);
        }
        let mut cur = Some(0);
        while let Some(i) = cur {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        if let Some(id) = self.byte_tokens[b as usize].or(self.unk) {
                            out.push(id);
                        }
                    }
                }
            }
            cur = s.next;
        }
    }
}

/// The byte of a `<0xXX>` token.
pub fn byte_of(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spm(vocab: &[(&str, f32)]) -> (Spm, Vec<String>) {
        let tokens: Vec<String> = vocab.iter().map(|(t, _)| t.to_string()).collect();
        let scores = vocab.iter().map(|(_, s)| *s).collect();
        (Spm::new(&tokens, scores, Some(0)), tokens)
    }

    #[test]
    fn merges_by_score_not_by_order() {
        let (m, tokens) = spm(&[
            ("<unk>", 0.0),
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("ab", -5.0),
            ("bc", -2.0),
            ("abc", -1.5),
        ]);
        let mut out = Vec::new();
        m.tokenize("abc", &mut out);
        // "bc" (score -2) beats "ab" (-5); then "a"+"bc" = "abc" exists.
        let texts: Vec<&str> = out.iter().map(|&i| tokens[i as usize].as_str()).collect();
        assert_eq!(texts, ["abc"]);
        out.clear();
        m.tokenize("cab", &mut out);
        let texts: Vec<&str> = out.iter().map(|&i| tokens[i as usize].as_str()).collect();
        assert_eq!(texts, ["c", "ab"]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let mut vocab: Vec<(String, f32)> = vec![("<unk>".into(), 0.0), ("a".into(), -1.0)];
        for b in 0..=255u8 {
            vocab.push((format!("<0x{b:02X}>"), 0.0));
        }
        let tokens: Vec<String> = vocab.iter().map(|(t, _)| t.clone()).collect();
        let m = Spm::new(&tokens, vocab.iter().map(|(_, s)| *s).collect(), Some(0));
        let mut out = Vec::new();
        m.tokenize("aé", &mut out);
        assert_eq!(out, [1, 2 + 0xC3, 2 + 0xA9]);
        assert_eq!(byte_of("<0xC3>"), Some(0xC3));
        assert_eq!(byte_of("<0xC>"), None);
    }
}
