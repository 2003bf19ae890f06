//! The prefill pass and the sampling step, one of each for the colocated
//! scheduler and the PD prefill worker: what a pass takes (the next chunks
//! of the prompts in turn under one token budget), running it with one rule
//! for a chunk at fault (only it fails), the counts of passes run, and
//! drawing a token under the sampler's masks and a grammar.

use std::sync::atomic::{AtomicU64, Ordering};

use handoff_kv::KvPool;
use handoff_model::sampling::Sampler;
use handoff_model::{Llama, Phase, SeqChunk};

use crate::error::EngineError;
use crate::grammar::{Allowed, GrammarError};

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

/// Logits of one chunk of a pass: its last row's, or every row's when the
/// pass scores its one prompt.
pub(crate) type ChunkLogits = Result<Vec<Vec<f32>>, EngineError>;

/// Run one prefill forward pass over `chunks` on `threads`, counting it in
/// `passes`; `on_layer(chunks, layer)` once a layer's K/V of those chunks is
/// in the pool. `every_row`: the pass holds one prompt that scores itself.
///
/// A pass that fails is run again one chunk at a time, so only the chunk at
/// fault fails and the others of the pass go on intact (the forward checks
/// every chunk before it computes anything, and a chunk computed again
/// writes the same K/V).
pub(crate) fn run(
    model: &Llama,
    pool: &mut KvPool,
    threads: &rayon::ThreadPool,
    passes: &PassCounts,
    chunks: &[SeqChunk<'_>],
    every_row: bool,
    on_layer: &mut (dyn FnMut(std::ops::Range<usize>, usize) + Send),
) -> Vec<ChunkLogits> {
    passes.record(chunks.len());
    let out = threads.install(|| {
        model.forward_rows(
            pool,
            chunks,
            Phase::Prefill,
            &mut |layer| on_layer(0..chunks.len(), layer),
            every_row,
        )
    });
    match out {
        Ok(rows) if every_row => vec![Ok(rows)],
        Ok(rows) => rows.into_iter().map(|r| Ok(vec![r])).collect(),
        Err(_) if chunks.len() > 1 => (0..chunks.len())
            .flat_map(|i| {
                let one = std::slice::from_ref(&chunks[i]);
                let mut shifted = |_: std::ops::Range<usize>, layer| on_layer(i..i + 1, layer);
                run(model, pool, threads, passes, one, false, &mut shifted)
            })
            .collect(),
        Err(e) => vec![Err(EngineError::Model(e.to_string()))],
    }
}

/// Draw the next token from `logits`: never one of `masked`, and one the
/// grammar's `mask` allows (computed beside the pass, or `None` without a
/// grammar). A grammar that fails, or allows nothing the sampler can draw,
/// fails the request.
pub(crate) fn sample(
    sampler: &mut Sampler,
    logits: &[f32],
    masked: &[u32],
    mask: Option<Result<Allowed, GrammarError>>,
) -> Result<(u32, f32), EngineError> {
    let allowed = mask.transpose().map_err(|e| EngineError::Grammar(e.0))?;
    let (id, logprob) =
        sampler.sample_allowed(logits, masked, allowed.as_ref().map(Allowed::words));
    if allowed.as_ref().is_some_and(|m| !m.contains(id)) {
        return Err(EngineError::Grammar(
            "the grammar allows no token here".into(),
        ));
    }
    Ok((id, logprob))
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
    use super::*;
    use handoff_kv::KvDtype;
    use handoff_model::PhaseFormats;

    #[test]
    fn only_the_chunk_at_fault_fails_and_the_others_get_their_own_logits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        handoff_model::tiny::write_tiny_gguf(&path, 5).unwrap();
        let (model, _) = Llama::load(&path, PhaseFormats::default()).unwrap();
        assert!(model.prefill_rows_independent());
        let mut pool = KvPool::new(model.kv_geometry(4, KvDtype::F16), 32).unwrap();
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let passes = PassCounts::default();
        let leases: Vec<_> = (0..3).map(|_| pool.allocator().lease(4).unwrap()).collect();
        let good = [5u32, 9, 11, 40, 7];
        let bad = [5u32, 9, 1_000_000];
        let chunk = |tokens, pages| SeqChunk {
            tokens,
            start_pos: 0,
            pages,
        };
        // Alone first: the logits a good chunk must get whatever shares its
        // pass.
        let solo = [chunk(&good[..], leases[2].pages())];
        let alone = run(
            &model,
            &mut pool,
            &threads,
            &passes,
            &solo,
            false,
            &mut |_, _| {},
        );
        let alone = alone.into_iter().next().unwrap().unwrap();
        let mut layers = Vec::new();
        let both = [
            chunk(&good[..], leases[0].pages()),
            chunk(&bad[..], leases[1].pages()),
        ];
        let out = run(
            &model,
            &mut pool,
            &threads,
            &passes,
            &both,
            false,
            &mut |range, layer| layers.push((range, layer)),
        );
        assert_eq!(out.len(), 2);
        let first = out[0].as_ref().expect("the good chunk is computed");
        assert_eq!(first, &alone, "the same bits as alone");
        match &out[1] {
            Err(EngineError::Model(m)) => {
                assert!(m.contains("token id 1000000 out of range"), "{m}")
            }
            other => panic!("the bad chunk: {other:?}"),
        }
        // The shared pass, then the good chunk alone, then the bad one alone
        // (which fails before any layer).
        assert_eq!(passes.totals(), (4, 1 + 2 + 1 + 1));
        assert!(layers.iter().all(|(r, _)| *r == (0..1)), "{layers:?}");
    }

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
