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
///
/// Each push costs time linear in the text not yet emitted (new text plus
/// at most the longest stop string held back), whatever the number of stop
/// strings: matches are found by one Aho-Corasick automaton over all of
/// them, and the held-back suffix by binary search in the sorted list.
pub(crate) struct TextTracker {
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    stops: Stops,
    /// Special tokens add no text.
    skip_special: bool,
    /// Special tokens in the text are set apart by spaces.
    spaces_between_special: bool,
    /// Whether the last token pushed was special (`None` before the first).
    last_special: Option<bool>,
}

/// The stop strings of one request, ready for matching.
struct Stops {
    /// Leftmost-longest automaton (`None` without stop strings).
    matcher: Option<aho_corasick::AhoCorasick>,
    /// The strings, sorted, for the prefix search of the holdback.
    sorted: Vec<String>,
    /// Bytes of the longest string.
    longest: usize,
}

impl Stops {
    fn new(mut stops: Vec<String>) -> Self {
        stops.retain(|s| !s.is_empty());
        stops.sort();
        stops.dedup();
        // Leftmost-longest: the earliest match wins, the longest one when two
        // start at the same place, whatever the order of the list.
        let matcher = (!stops.is_empty()).then(|| {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&stops)
                .expect("stop strings are bounded by the request limits")
        });
        Self {
            matcher,
            longest: stops.iter().map(String::len).max().unwrap_or(0),
            sorted: stops,
        }
    }

    /// Whether `s` begins some stop string.
    fn starts_one(&self, s: &str) -> bool {
        let at = self.sorted.partition_point(|x| x.as_str() < s);
        self.sorted.get(at).is_some_and(|x| x.starts_with(s))
    }
}

impl TextTracker {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops: Stops::new(stops),
            skip_special: true,
            spaces_between_special: true,
            last_special: None,
        }
    }

    /// The tracker of a request with these parameters.
    pub fn for_params(p: &crate::request::SamplingParams) -> Self {
        Self {
            skip_special: p.skip_special_tokens,
            spaces_between_special: p.spaces_between_special_tokens,
            ..Self::new(p.stop.clone())
        }
    }

    /// Add a token's text. Special tokens add none, unless
    /// `skip_special_tokens` is off; then, with
    /// `spaces_between_special_tokens`, a space separates each special token
    /// from the text or special token before it, as vLLM joins the pieces
    /// between added tokens with " " (`detokenizer_utils.py`
    /// `_convert_tokens_to_string_with_added_encoders`). Stop strings are
    /// looked for only when `armed` (from `min_new_tokens` on): text pushed
    /// unarmed is emitted at once and no match starts in it.
    pub fn push(&mut self, tok: &Tokenizer, id: u32, armed: bool) -> Pushed {
        let special = tok.is_special(id);
        let bytes = tok.token_bytes(id, self.skip_special).unwrap_or(&[]);
        let shown = !self.skip_special || !special;
        let mut owned;
        let mut piece = bytes;
        if shown && !self.skip_special && self.spaces_between_special {
            if let Some(last) = self.last_special {
                if special || last {
                    owned = Vec::with_capacity(bytes.len() + 1);
                    owned.push(b' ');
                    owned.extend_from_slice(bytes);
                    piece = &owned;
                }
            }
        }
        if shown {
            self.last_special = Some(special);
        }
        if armed {
            self.push_bytes(piece)
        } else {
            self.pending.extend_from_slice(piece);
            self.text.push_str(&take_complete_utf8(&mut self.pending));
            let out = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            Pushed {
                text: out,
                matched: None,
            }
        }
    }

    /// Add raw output bytes (a token's piece).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Pushed {
        self.pending.extend_from_slice(bytes);
        let search_from = self.emitted;
        self.text.push_str(&take_complete_utf8(&mut self.pending));
        // A match may start in held-back text, never in emitted text.
        let first = self
            .stops
            .matcher
            .as_ref()
            .and_then(|m| m.find(&self.text[search_from..]));
        if let Some(m) = first {
            let end = search_from + m.start();
            let out = self.text[self.emitted..end].to_string();
            self.emitted = end;
            return Pushed {
                text: out,
                matched: Some(self.stops.sorted[m.pattern().as_usize()].clone()),
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

    /// Longest suffix of the unemitted text that is a proper prefix of a
    /// stop string, cut at a char boundary. Only suffixes shorter than the
    /// longest stop can qualify, and the text holds no whole stop (it was
    /// searched first), so every candidate is a proper prefix if a prefix.
    fn holdback(&self) -> usize {
        let unemitted = self.text.len() - self.emitted;
        let most = unemitted.min(self.stops.longest.saturating_sub(1));
        let from = self.text.len() - most;
        (from..self.text.len())
            .filter(|&at| self.text.is_char_boundary(at))
            .find(|&at| self.stops.starts_one(&self.text[at..]))
            .map_or(0, |at| self.text.len() - at)
    }

    /// Release everything held back (generation ended without a stop match).
    pub fn flush(&mut self) -> String {
        let mut out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out.push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.pending)));
        out
    }
}

/// The text a request's stream sent with its first output tokens `ids`
/// (stop strings held back as the engine holds them): where a continuation
/// of that stream (`output_so_far`) picks up.
pub fn streamed_text(
    tok: &Tokenizer,
    params: &crate::request::SamplingParams,
    ids: &[u32],
) -> String {
    let mut t = TextTracker::for_params(params);
    let mut out = String::new();
    for (i, &id) in ids.iter().enumerate() {
        out.push_str(&t.push(tok, id, i + 1 >= params.min_new_tokens).text);
    }
    out
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

    /// The straightforward matcher (every stop string searched and
    /// suffix-compared per push), kept as the reference the automaton must
    /// agree with.
    fn reference(stops: &[String], pieces: &[Vec<u8>]) -> (Vec<String>, Option<String>, String) {
        let (mut text, mut emitted, mut out) = (String::new(), 0usize, Vec::new());
        for p in pieces {
            text.push_str(std::str::from_utf8(p).unwrap());
            let first = stops
                .iter()
                .filter_map(|s| text[emitted..].find(s.as_str()).map(|at| (at, s)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
            if let Some((at, s)) = first {
                out.push(text[emitted..emitted + at].to_string());
                return (out, Some(s.clone()), String::new());
            }
            let t = &text;
            let hold = stops
                .iter()
                .flat_map(|s| (1..s.len()).filter(move |&l| t.ends_with(&s[..l])))
                .max()
                .unwrap_or(0)
                .min(text.len() - emitted);
            out.push(text[emitted..text.len() - hold].to_string());
            emitted = text.len() - hold;
        }
        let rest = text[emitted..].to_string();
        (out, None, rest)
    }

    #[test]
    fn the_automaton_agrees_with_the_reference_matcher() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let word = |rng: &mut rand::rngs::StdRng, max: usize| -> String {
            let n = rng.random_range(1..=max);
            (0..n)
                .map(|_| ['a', 'b', 'c'][rng.random_range(0..3)])
                .collect()
        };
        for _ in 0..3000 {
            let stops: Vec<String> = (0..rng.random_range(0..5))
                .map(|_| word(&mut rng, 4))
                .collect();
            let pieces: Vec<Vec<u8>> = (0..rng.random_range(1..8))
                .map(|_| word(&mut rng, 3).into_bytes())
                .collect();
            let refs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
            let want = reference(&stops, &pieces);
            let strs: Vec<&str> = stops.iter().map(String::as_str).collect();
            assert_eq!(run(&strs, &refs), want, "stops {stops:?} pieces {pieces:?}");
        }
    }

    #[test]
    fn many_stop_strings_cost_no_more_per_token_than_a_few() {
        // 100k stop strings: a push scans the new text once, not each string.
        let many: Vec<String> = (0..100_000).map(|i| format!("stop-{i:06}!")).collect();
        let mut t = TextTracker::new(many);
        let started = std::time::Instant::now();
        for _ in 0..2000 {
            assert_eq!(t.push_bytes(b"word ").matched, None);
        }
        let r = t.push_bytes(b"stop-099999!");
        assert_eq!(r.matched.as_deref(), Some("stop-099999!"));
        // The old matcher took ~25 ms a push here (50 s in all); this is
        // microseconds a push. 5 s allows a loaded 2-core box 1000x slack.
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    /// The tiny test vocabulary: control tokens 0-2, byte `b` is `3 + b`.
    fn tiny() -> Tokenizer {
        Tokenizer::from_metadata(&handoff_model::tiny::tiny_vocab_metadata()).unwrap()
    }

    fn pushed(t: &mut TextTracker, tok: &Tokenizer, ids: &[u32], armed: bool) -> String {
        ids.iter().map(|&id| t.push(tok, id, armed).text).collect()
    }

    #[test]
    fn special_tokens_are_shown_only_when_asked_and_spaced_as_vllm_does() {
        let tok = tiny();
        let b = |c: u8| 3 + c as u32;
        // "hi", <|im_end|>, <|im_start|>, "yo"
        let ids = [b(b'h'), b(b'i'), 2, 1, b(b'y'), b(b'o')];
        let mut p = crate::request::SamplingParams::default();
        let mut t = TextTracker::for_params(&p);
        assert_eq!(pushed(&mut t, &tok, &ids, true), "hiyo");
        p.skip_special_tokens = false;
        let mut t = TextTracker::for_params(&p);
        assert_eq!(
            pushed(&mut t, &tok, &ids, true),
            "hi <|im_end|> <|im_start|> yo"
        );
        p.spaces_between_special_tokens = false;
        let mut t = TextTracker::for_params(&p);
        assert_eq!(
            pushed(&mut t, &tok, &ids, true),
            "hi<|im_end|><|im_start|>yo"
        );
    }

    #[test]
    fn no_stop_string_matches_before_the_tracker_is_armed() {
        let tok = tiny();
        let b = |c: u8| 3 + c as u32;
        let mut t = TextTracker::new(vec!["ab".into()]);
        // Unarmed: "ab" passes through, emitted at once.
        let first = t.push(&tok, b(b'a'), false);
        assert_eq!((first.text.as_str(), first.matched.is_none()), ("a", true));
        let r = t.push(&tok, b(b'b'), false);
        assert_eq!((r.text.as_str(), r.matched.is_none()), ("b", true));
        // Armed: a new "ab" ends it, and the text before it is emitted.
        assert_eq!(t.push(&tok, b(b'x'), true).text, "x");
        assert_eq!(t.push(&tok, b(b'a'), true).text, "");
        let r = t.push(&tok, b(b'b'), true);
        assert_eq!((r.text.as_str(), r.matched.as_deref()), ("", Some("ab")));
    }
}
