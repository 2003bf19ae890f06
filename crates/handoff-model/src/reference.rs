//! An unpaged reference forward: the whole sequence at once, K/V in plain
//! contiguous vectors, textbook attention (with the sliding window as a
//! plain mask). Tests compare the paged forward against it (same weights,
//! same phase format); the projections, norms and FFN are the paged
//! forward's own (`Llama::qkv`, `Llama::finish_block`).

use crate::error::ModelError;
use crate::linear::Phase;
use crate::model::Llama;
use crate::ops::{dot, softmax};

impl Llama {
    /// Logits at every position of `tokens` (`[len][vocab]`), computed
    /// without the KV pool.
    pub fn reference_logits(
        &self,
        tokens: &[u32],
        phase: Phase,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.config;
        let (d, n) = (cfg.head_dim, tokens.len());
        let (qw, kvw) = (cfg.q_width(), cfg.kv_width());
        let group = cfg.heads / cfg.kv_heads;
        let mut hidden = self.embed_tokens(tokens.iter());
        for b in &self.blocks {
            let (mut q, mut k, v) = self.qkv(b, &hidden, n, phase)?;
            let rope = self.rope_of(b);
            for t in 0..n {
                rope.apply(&mut q[t * qw..(t + 1) * qw], d, t);
                rope.apply(&mut k[t * kvw..(t + 1) * kvw], d, t);
            }
            let shape = self.attn_shape(b);
            let mut attn = vec![0.0f32; n * qw];
            for t in 0..n {
                // Positions a sliding-window layer masks out.
                let first = shape.first(t + 1);
                for head in 0..cfg.heads {
                    let kvh = head / group;
                    let qh = &q[t * qw + head * d..t * qw + (head + 1) * d];
                    let mut scores: Vec<f32> = (first..=t)
                        .map(|s| {
                            dot(qh, &k[s * kvw + kvh * d..s * kvw + (kvh + 1) * d]) * shape.scale
                        })
                        .collect();
                    softmax(&mut scores);
                    let out = &mut attn[t * qw + head * d..t * qw + (head + 1) * d];
                    for (i, p) in scores.iter().enumerate() {
                        let s = first + i;
                        for j in 0..d {
                            out[j] += p * v[s * kvw + kvh * d + j];
                        }
                    }
                }
            }
            self.finish_block(b, &mut hidden, &attn, n, phase)?;
        }
        self.logits(&hidden, n, phase)
    }
}
