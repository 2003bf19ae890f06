//! Paged attention: queries of new tokens against every key of
//! their sequence, read from the sequence's pages in the KV pool. Two paths:
//! one-token decode reads the pages in place; multi-token prefill runs the
//! same per-token attention for every new token, in parallel, so a token's
//! result never depends on the tokens computed with it. Exact softmax
//! attention with a causal mask.

use handoff_kv::{KvPart, KvPool, PageIndex};
use rayon::prelude::*;

use crate::error::ModelError;
use crate::ops::{axpy_rows, dots, softmax};

/// Shape of attention for one model.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Scale of the query·key product (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a token sees itself and the `window - 1` positions
    /// before it (llama.cpp's standard SWA); `None` sees every position.
    pub window: Option<usize>,
}

impl AttnShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// First position that a token at position `len - 1` attends to.
    pub(crate) fn first(&self, len: usize) -> usize {
        self.window.map_or(0, |w| len.saturating_sub(w))
    }
}

/// One sequence's new tokens in a forward step.
pub struct SeqAttn<'a> {
    /// Pages of the sequence, in order.
    pub pages: &'a [PageIndex],
    /// Position of the first new token.
    pub start: usize,
    /// Number of new tokens.
    pub n: usize,
}

/// One KV head's keys and values of positions `first..len` as f32, in
/// position order (`[len - first][head_dim]` each).
#[derive(Default)]
struct HeadKv {
    first: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl HeadKv {
    /// Read (converting an f16 pool's elements) positions `first..len` of
    /// KV head `kvh` from the sequence's pages.
    fn load(
        &mut self,
        pool: &KvPool,
        layer: usize,
        pages: &[PageIndex],
        kvh: usize,
        first: usize,
        len: usize,
    ) {
        let g = *pool.geometry();
        self.first = first;
        self.k.clear();
        self.v.clear();
        let mut pos = first;
        while pos < len {
            let (page, slot) = (pos / g.page_size, pos % g.page_size);
            let n = (len - pos).min(g.page_size - slot);
            let base = pool.layout().slot_offset(kvh, slot);
            let span = base..base + n * g.head_dim;
            pool.block(layer, pages[page], KvPart::K)
                .slice(span.clone())
                .extend_f32(&mut self.k);
            pool.block(layer, pages[page], KvPart::V)
                .slice(span)
                .extend_f32(&mut self.v);
            pos += n;
        }
    }

    /// Keys or values of positions `from..from + n`.
    fn rows<'a>(&self, x: &'a [f32], from: usize, n: usize, d: usize) -> &'a [f32] {
        &x[(from - self.first) * d..(from - self.first + n) * d]
    }
}

/// Attention for the token at position `len - 1`, one query head `q`,
/// against positions `first..len` of `kv`; writes `[head_dim]` into
/// `out`. Scores and values are taken a page (`page_size` positions) at a
/// time, as the pages lie in the pool.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    kv: &HeadKv,
    first: usize,
    len: usize,
    page_size: usize,
    q: &[f32],
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let d = q.len();
    // Page-aligned stretches of `first..len`.
    let stretches = || {
        let mut from = first;
        std::iter::from_fn(move || {
            (from < len).then(|| {
                let n = (len - from).min(page_size - from % page_size);
                from += n;
                (from - n, n)
            })
        })
    };
    scores.clear();
    for (from, n) in stretches() {
        let at = scores.len();
        dots(q, kv.rows(&kv.k, from, n, d), scores);
        for s in &mut scores[at..] {
            *s *= scale;
        }
    }
    softmax(scores);
    out.fill(0.0);
    for (from, n) in stretches() {
        axpy_rows(
            out,
            &scores[from - first..from - first + n],
            kv.rows(&kv.v, from, n, d),
        );
    }
}

/// Decode path: each sequence has exactly one new token. `q` is
/// `[seqs][heads*head_dim]`; returns the same shape. One task per
/// (sequence, KV head) reads that KV head's keys and values once and
/// computes its group of query heads.
pub fn attend_decode(
    pool: &KvPool,
    layer: usize,
    seqs: &[SeqAttn<'_>],
    q: &[f32],
    shape: AttnShape,
) -> Vec<f32> {
    let d = shape.head_dim;
    let group = shape.group();
    let width = shape.heads * d;
    let page_size = pool.geometry().page_size;
    let mut out = vec![0.0f32; seqs.len() * width];
    out.par_chunks_mut(group * d).enumerate().for_each_init(
        || (HeadKv::default(), Vec::new()),
        |(kv, scores), (idx, o)| {
            let (s, kvh) = (idx / shape.kv_heads, idx % shape.kv_heads);
            let seq = &seqs[s];
            let len = seq.start + 1;
            let first = shape.first(len);
            kv.load(pool, layer, seq.pages, kvh, first, len);
            for (g, o) in o.chunks_exact_mut(d).enumerate() {
                let h = kvh * group + g;
                let qh = &q[s * width + h * d..s * width + (h + 1) * d];
                attend_one(kv, first, len, page_size, qh, shape.scale, scores, o);
            }
        },
    );
    out
}

/// Prefill path for one sequence with `seq.n` new tokens: `q` is
/// `[n][heads*head_dim]`; returns the same shape. Each new token attends
/// exactly as a decode step at its position would (`attend_one`), one task
/// per (token, KV head): a token's result depends only on its query and the
/// keys and values before it, never on how many tokens were computed with
/// it. So a prompt computed whole, in other chunks, or after a prefix-cache
/// hit gives the same bits (batched GEMMs over the chunk, used before, sum
/// in an order that depends on the chunk's length, and that moved greedy
/// near-ties: a cached prompt answered differently). Each KV head's keys
/// and values are read (converted from f16) once for all the tokens.
pub fn attend_prefill(
    pool: &KvPool,
    layer: usize,
    seq: &SeqAttn<'_>,
    q: &[f32],
    shape: AttnShape,
) -> Result<Vec<f32>, ModelError> {
    let (d, n, group) = (shape.head_dim, seq.n, shape.group());
    let width = shape.heads * d;
    let page_size = pool.geometry().page_size;
    let end = seq.start + n;
    let lowest = shape.first(seq.start + 1);
    let heads: Vec<HeadKv> = (0..shape.kv_heads)
        .into_par_iter()
        .map(|kvh| {
            let mut kv = HeadKv::default();
            kv.load(pool, layer, seq.pages, kvh, lowest, end);
            kv
        })
        .collect();
    let mut out = vec![0.0f32; n * width];
    out.par_chunks_mut(group * d)
        .enumerate()
        .for_each_init(Vec::new, |scores, (idx, o)| {
            let (t, kvh) = (idx / shape.kv_heads, idx % shape.kv_heads);
            let len = seq.start + t + 1;
            let first = shape.first(len);
            for (g, o) in o.chunks_exact_mut(d).enumerate() {
                let h = kvh * group + g;
                let qh = &q[t * width + h * d..t * width + (h + 1) * d];
                attend_one(
                    &heads[kvh],
                    first,
                    len,
                    page_size,
                    qh,
                    shape.scale,
                    scores,
                    o,
                );
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_kv::{KvDtype, KvGeometry};

    /// Every token of a prefill attends bit for bit as a decode step at its
    /// position would, and a chunk that starts later (after a prefix-cache
    /// hit) gives its tokens the same bits as the whole prompt did. With
    /// the batched GEMMs this module used before, both differ in the last
    /// bits, which is what moved SmolLM2's greedy output after a cache hit.
    #[test]
    fn prefill_tokens_match_decode_steps_and_later_chunks_bit_for_bit() {
        for window in [None, Some(5)] {
            check_prefill_equals_decode(window);
        }
    }

    fn check_prefill_equals_decode(window: Option<usize>) {
        let shape = AttnShape {
            heads: 6,
            kv_heads: 2,
            head_dim: 16,
            scale: 0.25,
            window,
        };
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let g = KvGeometry {
                layers: 1,
                kv_heads: shape.kv_heads,
                head_dim: shape.head_dim,
                page_size: 4,
                dtype,
            };
            let mut pool = KvPool::new(g, 16).unwrap();
            let pages: Vec<PageIndex> = [5, 1, 9, 3, 12, 7].map(PageIndex).to_vec();
            let n = 23;
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            };
            let kvw = shape.kv_heads * shape.head_dim;
            for pos in 0..n {
                let k: Vec<f32> = (0..kvw).map(|_| rnd()).collect();
                let v: Vec<f32> = (0..kvw).map(|_| rnd()).collect();
                pool.write_token(0, &pages, pos, &k, &v).unwrap();
            }
            let width = shape.heads * shape.head_dim;
            let q: Vec<f32> = (0..n * width).map(|_| 4.0 * rnd()).collect();
            let whole = SeqAttn {
                pages: &pages,
                start: 0,
                n,
            };
            let all = attend_prefill(&pool, 0, &whole, &q, shape).unwrap();
            for t in 0..n {
                let step = SeqAttn {
                    pages: &pages,
                    start: t,
                    n: 1,
                };
                let d = attend_decode(&pool, 0, &[step], &q[t * width..(t + 1) * width], shape);
                assert_eq!(
                    d.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                    all[t * width..(t + 1) * width]
                        .iter()
                        .map(|f| f.to_bits())
                        .collect::<Vec<_>>(),
                    "{dtype:?} token {t}"
                );
            }
            for from in [1, 4, 16, 22] {
                let tail = SeqAttn {
                    pages: &pages,
                    start: from,
                    n: n - from,
                };
                let part = attend_prefill(&pool, 0, &tail, &q[from * width..], shape).unwrap();
                assert!(
                    part.iter()
                        .zip(&all[from * width..])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?} chunk from {from}"
                );
            }
        }
    }
}
