//! What a prefill forward pass takes, shared by the colocated scheduler and
//! the PD prefill worker: the next chunks of the prompts in turn under one
//! token budget, and the counts of passes run.

use std::sync::atomic::{AtomicU64, Ordering};

/// How many tokens each of the first prompts computes in the next pass,
/// given each one's `(tokens left, scores its prompt)` in turn: the first
/// one's next chunk, then, when rows are computed independently
/// (`Llama::prefill_rows_independent`), the next ones' while `budget`
/// lasts. A prompt scoring its prompt (logits of every row) runs alone, as
/// every prompt does when rows are not independent.
pub(crate) fn pack(
    prompts: impl IntoIterator<Item = (usize, bool)>,
    budget: usize,
    rows_independent: bool,
) -> Vec<usize> {
    let mut pack = Vec::new();
    let mut used = 0;
    for (left, scores) in prompts {
        let take = left.min(budget - used);
        let alone = scores || !rows_independent;
        if !pack.is_empty() && (alone || take == 0) {
            break;
        }
        pack.push(take);
        used += take;
        if alone || used == budget {
            break;
        }
    }
    pack
}

/// Prefill forward passes run, and the sequences in them, since start
/// (`handoff_prefill_passes_total`, `handoff_prefill_pass_sequences_total`).
#[derive(Debug, Default)]
pub(crate) struct PassCounts {
    passes: AtomicU64,
    sequences: AtomicU64,
}

impl PassCounts {
    /// Count a pass of `sequences` sequences.
    pub(crate) fn record(&self, sequences: usize) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.sequences
            .fetch_add(sequences as u64, Ordering::Relaxed);
    }

    /// (passes, sequences) so far.
    pub(crate) fn totals(&self) -> (u64, u64) {
        (
            self.passes.load(Ordering::Relaxed),
            self.sequences.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::pack;

    #[test]
    fn prompts_share_the_budget_in_turn() {
        // The first prompt takes what it has left, the next ones the rest.
        assert_eq!(
            pack([(3, false), (2, false), (9, false)], 8, true),
            [3, 2, 3]
        );
        assert_eq!(pack([(10, false), (3, false)], 8, true), [8]);
        // Rows not independent: one prompt a pass.
        assert_eq!(pack([(3, false), (2, false)], 8, false), [3]);
        // A prompt scoring its prompt runs alone, first or not.
        assert_eq!(pack([(3, true), (2, false)], 8, true), [3]);
        assert_eq!(pack([(3, false), (2, true), (1, false)], 8, true), [3]);
        assert!(pack([], 8, true).is_empty());
    }
}
