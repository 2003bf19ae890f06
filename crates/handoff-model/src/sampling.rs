//! Choosing the next token from logits (DESIGN.md §6): greedy, temperature,
//! top-k, top-p, with a per-request seeded RNG so the same seed gives the
//! same output.

use rand::{Rng, SeedableRng};

/// Parameters of one request's sampler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k filter.
    pub top_k: usize,
    /// 1.0 = no nucleus filter.
    pub top_p: f32,
    /// RNG seed.
    pub seed: u64,
}

/// Below this temperature sampling is greedy (dividing logits by a smaller
/// number overflows f32).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// A request's sampler; owns its RNG.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: rand::rngs::StdRng,
}

/// Index of the largest value (the first one on ties, as llama.cpp's greedy sampler).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// `log_softmax(logits)[i]`.
pub fn logprob(logits: &[f32], i: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (logits[i] - max) - sum.ln() as f32
}

impl Sampler {
    /// A sampler with its own RNG seeded from `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Self {
        Self {
            cfg,
            rng: rand::rngs::StdRng::seed_from_u64(cfg.seed),
        }
    }

    /// Pick the next token; returns it with its log-probability under the
    /// model (before temperature and filters).
    pub fn sample(&mut self, logits: &[f32]) -> (u32, f32) {
        // Temperatures this small would overflow `logit / t`: they mean greedy.
        let id = if self.cfg.temperature < MIN_TEMPERATURE || self.cfg.top_k == 1 {
            argmax(logits)
        } else {
            self.sample_filtered(logits)
        };
        (id as u32, logprob(logits, id))
    }

    fn sample_filtered(&mut self, logits: &[f32]) -> usize {
        let t = self.cfg.temperature;
        let mut cand: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i, v / t))
            .collect();
        // Highest first; ties by index so the order is deterministic.
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.cfg.top_k > 0 && self.cfg.top_k < cand.len() {
            cand.truncate(self.cfg.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&(_, v)| ((v - max) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        for p in probs.iter_mut() {
            *p /= total;
        }
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            for p in probs.iter_mut() {
                *p /= total;
            }
        }
        let r: f64 = self.rng.random();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::new(cfg(0.0, 0, 1.0, 1));
        let (id, lp) = s.sample(&[0.1, 2.0, 2.0, -1.0]);
        assert_eq!(id, 1);
        assert!(lp < 0.0 && lp > -1.0);
    }

    #[test]
    fn same_seed_same_draws_and_filters_hold() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let draw = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0, 1.0, seed));
            (0..40).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        // top-k 3: only the three best ever come out.
        let mut best: Vec<usize> = (0..50).collect();
        best.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let mut s = Sampler::new(cfg(2.0, 3, 1.0, 9));
        for _ in 0..200 {
            assert!(best[..3].contains(&(s.sample(&logits).0 as usize)));
        }
        // top-p tiny: only the argmax.
        let mut s = Sampler::new(cfg(1.0, 0, 1e-6, 9));
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).0 as usize, best[0]);
        }
    }

    #[test]
    fn tiny_temperatures_are_greedy() {
        let logits = [0.5f32, 3.0, -2.0, 2.9];
        for t in [1e-40f32, 1e-7, 0.0] {
            let mut s = Sampler::new(cfg(t, 0, 1.0, 3));
            assert_eq!(s.sample(&logits).0, 1, "temperature {t}");
        }
    }

    #[test]
    fn logprobs_are_normalised() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f32 = (0..3).map(|i| logprob(&logits, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        // log_softmax exactly: 3 - ln(e + e^2 + e^3).
        let want = 3.0 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((logprob(&logits, 2) as f64 - want).abs() < 1e-6);
        // Shifting every logit changes nothing, even far from zero.
        let far = [1001.0f32, 1002.0, 1003.0];
        assert!((logprob(&far, 2) as f64 - want).abs() < 1e-4);
    }

    #[test]
    fn argmax_finds_the_largest_wherever_it_is() {
        assert_eq!(argmax(&[5.0, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[0.0, 1.0, 3.0]), 2);
        assert_eq!(argmax(&[-3.0, -1.0, -2.0]), 1);
        assert_eq!(argmax(&[7.0, 7.0]), 0);
    }

    /// The distribution a sampler should draw from, computed independently:
    /// softmax(logits / t) in f64, keep the `k` most likely (0 = all),
    /// renormalise, keep the shortest head whose mass reaches `p`,
    /// renormalise (the order vLLM and SGLang apply them).
    fn reference(logits: &[f32], t: f32, k: usize, p: f32) -> Vec<f64> {
        let scaled: Vec<f64> = logits.iter().map(|&v| v as f64 / t as f64).collect();
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
        if k > 0 {
            order.truncate(k);
        }
        let weight = |i: usize| (scaled[i] - max).exp();
        let total: f64 = order.iter().map(|&i| weight(i)).sum();
        let mut kept = Vec::new();
        let mut acc = 0.0;
        for &i in &order {
            kept.push(i);
            acc += weight(i) / total;
            if acc >= p as f64 {
                break;
            }
        }
        let total: f64 = kept.iter().map(|&i| weight(i)).sum();
        let mut probs = vec![0.0; logits.len()];
        for i in kept {
            probs[i] = weight(i) / total;
        }
        probs
    }

    /// Draw 40 000 tokens and compare each token's frequency with the
    /// reference probability (6 standard deviations: 0.015).
    #[test]
    fn draws_follow_temperature_top_k_and_top_p() {
        let small = [2.0f32, 1.0, 0.5, -1.0, 0.0];
        // Logits this large overflow `exp` unless the maximum is subtracted.
        let large = [400.0f32, 399.5, 399.0, 398.0];
        let cases: [(&[f32], f32, usize, f32); 6] = [
            (&small, 0.7, 0, 1.0),
            (&small, 1.5, 0, 1.0),
            (&small, 1.0, 3, 1.0),
            (&small, 1.3, 0, 0.75),
            (&small, 1.0, 4, 0.9),
            (&large, 1.0, 0, 1.0),
        ];
        const N: usize = 40_000;
        for (n, &(logits, t, k, p)) in cases.iter().enumerate() {
            let want = reference(logits, t, k, p);
            let mut s = Sampler::new(cfg(t, k, p, 1000 + n as u64));
            let mut count = vec![0usize; logits.len()];
            for _ in 0..N {
                count[s.sample(logits).0 as usize] += 1;
            }
            for (i, (&c, &w)) in count.iter().zip(&want).enumerate() {
                let got = c as f64 / N as f64;
                assert!(
                    (got - w).abs() < 0.015,
                    "t={t} k={k} p={p}: token {i} drawn {got:.4}, expected {w:.4} ({count:?} vs {want:?})"
                );
                if w == 0.0 {
                    assert_eq!(c, 0, "t={t} k={k} p={p}: token {i} is filtered out");
                }
            }
        }
    }
}
