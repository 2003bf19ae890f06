//! The router's approximate view of which worker holds which prompt prefix
//! (the `cache_aware` policy, as SGLang's router keeps one per worker).
//!
//! A request's key is the JSON text of its prompt field (`messages`,
//! `prompt`, `text` or `input_ids`): a conversation's next turn extends the
//! previous turn's text, so their keys share a prefix. Keys are cut into
//! blocks of [`BLOCK`] bytes, each identified by a hash chained over every
//! block before it; a worker's index is the set of chained hashes of what
//! was routed to it, bounded and forgetting the least recently used first.
//! The match of a request against a worker is the number of its leading
//! blocks the worker's set holds. Approximate by design: the worker may
//! have evicted the pages, and a hash collision may claim a match.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use serde_json::Value;

/// Bytes per block of a key.
pub const BLOCK: usize = 64;

/// Most blocks remembered per worker (about 4 MiB of prompt text).
pub const MAX_BLOCKS: usize = 65_536;

/// The chained block hashes of a request's prompt: element `i` stands for
/// the key's first `(i + 1) * BLOCK` bytes. A partial last block is left out.
pub fn prompt_blocks(body: &serde_json::Map<String, Value>) -> Vec<u64> {
    let Some(v) = ["messages", "prompt", "text", "input_ids"]
        .iter()
        .find_map(|k| body.get(*k))
    else {
        return Vec::new();
    };
    let key = v.to_string();
    let mut h = 0u64;
    key.as_bytes()
        .chunks_exact(BLOCK)
        .map(|b| {
            let mut s = DefaultHasher::new();
            h.hash(&mut s);
            b.hash(&mut s);
            h = s.finish();
            h
        })
        .collect()
}

/// One worker's remembered blocks, least recently used first out.
#[derive(Debug, Default)]
pub struct BlockSet {
    /// Block → the tick it was last routed.
    last: HashMap<u64, u64>,
    /// (tick, block) in the order they were touched; stale entries (whose
    /// tick is older than `last`'s) are skipped when trimming.
    order: VecDeque<(u64, u64)>,
    tick: u64,
}

impl BlockSet {
    /// Leading blocks of `blocks` this worker saw.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.last.contains_key(b))
            .count()
    }

    /// Remember `blocks` as routed here now; forget the least recently used
    /// beyond `cap`.
    pub fn insert(&mut self, blocks: &[u64], cap: usize) {
        self.tick += 1;
        for &b in blocks {
            self.last.insert(b, self.tick);
            self.order.push_back((self.tick, b));
        }
        while self.last.len() > cap {
            let Some((tick, b)) = self.order.pop_front() else {
                break;
            };
            if self.last.get(&b) == Some(&tick) {
                self.last.remove(&b);
            }
        }
        // Stale entries: keep the queue within a small multiple of the set.
        if self.order.len() > 4 * cap.max(1) {
            let last = &self.last;
            self.order.retain(|(t, b)| last.get(b) == Some(t));
        }
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn blocks(v: Value) -> Vec<u64> {
        prompt_blocks(v.as_object().unwrap())
    }

    #[test]
    fn a_next_turn_shares_the_blocks_of_the_previous_one() {
        let sys = "You are a helpful assistant who answers briefly. ".repeat(4);
        let turn1 = json!({"messages": [
            {"role": "system", "content": sys},
            {"role": "user", "content": "What is the capital of France?"}]});
        let turn2 = json!({"messages": [
            {"role": "system", "content": sys},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Spain?"}]});
        let (a, b) = (blocks(turn1), blocks(turn2));
        assert!(a.len() >= 3, "{}", a.len());
        assert!(b.len() > a.len());
        // All of turn 1's whole blocks but the last (its closing `]` moves).
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(shared + 1 >= a.len(), "{shared} of {}", a.len());
        // Token-id prompts too; no prompt field, no blocks.
        let ids: Vec<u32> = (0..100).collect();
        assert!(!blocks(json!({"prompt": ids})).is_empty());
        assert!(blocks(json!({"max_tokens": 3})).is_empty());
        // Another system prompt shares nothing.
        let other = json!({"messages": [{"role": "system", "content": "x".repeat(300)}]});
        assert_ne!(blocks(other)[0], a[0]);
    }

    #[test]
    fn sets_match_leading_blocks_and_forget_the_least_recently_used() {
        let mut s = BlockSet::default();
        s.insert(&[1, 2, 3], 4);
        assert_eq!(s.matched(&[1, 2, 3, 4]), 3);
        assert_eq!(s.matched(&[5, 2, 3]), 0, "leading blocks only");
        s.insert(&[1, 9], 4); // touches 1; adds 9
        assert_eq!(s.len(), 4);
        s.insert(&[7], 4); // over the cap: 2 (oldest untouched) goes
        assert_eq!(s.len(), 4);
        assert_eq!(s.matched(&[1, 2]), 1);
        assert_eq!(s.matched(&[1, 9]), 2);
        assert_eq!(s.matched(&[7]), 1);
    }
}
