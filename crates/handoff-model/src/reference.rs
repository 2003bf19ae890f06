//! An unpaged reference forward: the whole sequence at once, K/V in plain
//! contiguous vectors, textbook attention. Tests compare the paged forward
//! against it (same weights, same phase format).

use crate::error::ModelError;
use crate::linear::Phase;
use crate::model::{silu_mul_stacked, split_qkv, Llama};
use crate::ops::{add_assign, add_bias, dot, rms_norm, softmax};

impl Llama {
    /// Logits at every position of `tokens` (`[len][vocab]`), computed
    /// without the KV pool.
    pub fn reference_logits(
        &self,
        tokens: &[u32],
        phase: Phase,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.config;
        let (h, d, n) = (cfg.hidden, cfg.head_dim, tokens.len());
        let kvw = cfg.kv_heads * d;
        let group = cfg.heads / cfg.kv_heads;
        let mut hidden = Vec::with_capacity(n * h);
        for &t in tokens {
            hidden.extend_from_slice(&self.embed[t as usize * h..(t as usize + 1) * h]);
        }
        for b in &self.blocks {
            let xn = rms_norm(&hidden, &b.attn_norm, cfg.rms_eps);
            let (mut q, mut k, mut v) = split_qkv(&b.wqkv.forward(&xn, n, phase)?, h, kvw);
            for (x, bias) in [(&mut q, &b.bq), (&mut k, &b.bk), (&mut v, &b.bv)] {
                if let Some(bias) = bias {
                    add_bias(x, bias);
                }
            }
            for t in 0..n {
                self.rope.apply(&mut q[t * h..(t + 1) * h], d, t);
                self.rope.apply(&mut k[t * kvw..(t + 1) * kvw], d, t);
            }
            let mut attn = vec![0.0f32; n * h];
            let scale = 1.0 / (d as f32).sqrt();
            for t in 0..n {
                for head in 0..cfg.heads {
                    let kvh = head / group;
                    let qh = &q[t * h + head * d..t * h + (head + 1) * d];
                    let mut scores: Vec<f32> = (0..=t)
                        .map(|s| dot(qh, &k[s * kvw + kvh * d..s * kvw + (kvh + 1) * d]) * scale)
                        .collect();
                    softmax(&mut scores);
                    let out = &mut attn[t * h + head * d..t * h + (head + 1) * d];
                    for (s, p) in scores.iter().enumerate() {
                        for j in 0..d {
                            out[j] += p * v[s * kvw + kvh * d + j];
                        }
                    }
                }
            }
            let o = b.wo.forward(&attn, n, phase)?;
            add_assign(&mut hidden, &o);
            let xn = rms_norm(&hidden, &b.ffn_norm, cfg.rms_eps);
            let act = silu_mul_stacked(&b.w_gate_up.forward(&xn, n, phase)?, cfg.ffn_hidden);
            add_assign(&mut hidden, &b.w_down.forward(&act, n, phase)?);
        }
        let last = rms_norm(&hidden, &self.norm, cfg.rms_eps);
        let logits = self.lm_head.forward(&last, n, phase)?;
        Ok(logits
            .chunks_exact(self.lm_head.out_dim())
            .map(|c| c.to_vec())
            .collect())
    }
}
