//! Paged attention (DESIGN.md §6): queries of new tokens against every key of
//! their sequence, read from the sequence's pages in the KV pool. Two paths:
//! one-token decode reads the pages in place; multi-token prefill gathers a
//! sequence's keys once and uses batched GEMMs. Both are exact softmax
//! attention with a causal mask; they differ only in summation order.

use candle_core::{Device, Tensor};
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
}

impl AttnShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
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

/// Scratch of one decode task: scores, and the f32 view of an f16 block.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    block: Vec<f32>,
}

/// Attention for one token of one sequence, one query head, reading keys and
/// values in place (an f16 pool's run of a page is converted once into
/// scratch). `q` is the head's query; writes `[head_dim]` into `out`.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    pool: &KvPool,
    layer: usize,
    seq: &SeqAttn<'_>,
    kvh: usize,
    q: &[f32],
    scale: f32,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let Scratch { scores, block } = scratch;
    let g = *pool.geometry();
    let pos = seq.start;
    let len = pos + 1;
    scores.clear();
    let base = pool.layout().slot_offset(kvh, 0);
    let mut left = len;
    for &page in seq.pages {
        if left == 0 {
            break;
        }
        let n = left.min(g.page_size);
        let kb = pool
            .block(layer, page, KvPart::K)
            .slice(base..base + n * g.head_dim)
            .to_f32(block);
        let from = scores.len();
        dots(q, kb, scores);
        for s in &mut scores[from..] {
            *s *= scale;
        }
        left -= n;
    }
    softmax(scores);
    out.fill(0.0);
    let mut i = 0;
    for &page in seq.pages {
        if i == len {
            break;
        }
        let n = (len - i).min(g.page_size);
        let vb = pool
            .block(layer, page, KvPart::V)
            .slice(base..base + n * g.head_dim)
            .to_f32(block);
        axpy_rows(out, &scores[i..i + n], vb);
        i += n;
    }
}

/// Decode path: each sequence has exactly one new token. `q` is
/// `[seqs][heads*head_dim]`; returns the same shape. One task per
/// (sequence, KV head) computes that KV head's group of query heads, which
/// read the same keys and values.
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
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0.0f32; seqs.len() * width];
    out.par_chunks_mut(group * d).enumerate().for_each_init(
        Scratch::default,
        |scratch, (idx, o)| {
            let (s, kvh) = (idx / shape.kv_heads, idx % shape.kv_heads);
            let seq = &seqs[s];
            for (g, o) in o.chunks_exact_mut(d).enumerate() {
                let h = kvh * group + g;
                let qh = &q[s * width + h * d..s * width + (h + 1) * d];
                attend_one(pool, layer, seq, kvh, qh, scale, scratch, o);
            }
        },
    );
    out
}

/// Prefill path for one sequence with `seq.n` new tokens: `q` is
/// `[n][heads*head_dim]`; returns the same shape.
pub fn attend_prefill(
    pool: &KvPool,
    layer: usize,
    seq: &SeqAttn<'_>,
    q: &[f32],
    shape: AttnShape,
) -> Result<Vec<f32>, ModelError> {
    let (d, n, group) = (shape.head_dim, seq.n, shape.group());
    let len = seq.start + n;
    let width = shape.heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    let rows = group * n;
    // Queries grouped by KV head: [kv_heads][group * n][d], row = g * n + t.
    let mut qg = vec![0.0f32; shape.kv_heads * rows * d];
    for t in 0..n {
        for h in 0..shape.heads {
            let (kvh, g) = (h / group, h % group);
            let dst = (kvh * rows + g * n + t) * d;
            for j in 0..d {
                qg[dst + j] = q[t * width + h * d + j] * scale;
            }
        }
    }
    let mut k = Vec::with_capacity(shape.kv_heads * len * d);
    let mut v = Vec::with_capacity(shape.kv_heads * len * d);
    for kvh in 0..shape.kv_heads {
        pool.gather_head(layer, seq.pages, KvPart::K, kvh, len, &mut k);
        pool.gather_head(layer, seq.pages, KvPart::V, kvh, len, &mut v);
    }
    let dev = Device::Cpu;
    let qt = Tensor::from_vec(qg, (shape.kv_heads, rows, d), &dev)?;
    let kt = Tensor::from_vec(k, (shape.kv_heads, len, d), &dev)?;
    let vt = Tensor::from_vec(v, (shape.kv_heads, len, d), &dev)?;
    let mut scores = qt.matmul(&kt.t()?)?.flatten_all()?.to_vec1::<f32>()?;
    scores.par_chunks_mut(len).enumerate().for_each(|(r, row)| {
        let t = (r % rows) % n;
        let visible = seq.start + t + 1;
        row[visible..].fill(f32::NEG_INFINITY);
        softmax(row);
    });
    let p = Tensor::from_vec(scores, (shape.kv_heads, rows, len), &dev)?;
    let o = p.matmul(&vt)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0.0f32; n * width];
    for kvh in 0..shape.kv_heads {
        for g in 0..group {
            let h = kvh * group + g;
            for t in 0..n {
                let src = (kvh * rows + g * n + t) * d;
                out[t * width + h * d..t * width + (h + 1) * d].copy_from_slice(&o[src..src + d]);
            }
        }
    }
    Ok(out)
}
