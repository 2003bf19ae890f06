//! Choosing the next token from logits: logit bias, the
//! repetition, frequency and presence penalties, masked tokens, then greedy
//! or temperature, top-k, top-p and min-p, with a per-request seeded RNG so
//! the same seed gives the same output.
//!
//! The controls follow vLLM and SGLang exactly, in their order:
//!
//! - `logit_bias`: `logit[t] += bias[t]` (OpenAI);
//! - repetition penalty `r` over every token seen in the prompt or the
//!   output: `logit = logit > 0 ? logit / r : logit * r` (vLLM
//!   `apply_penalties`, SGLang `BatchedRepetitionPenalizer`; CTRL, Keskar et
//!   al. 2019);
//! - frequency and presence penalties over the output's tokens only:
//!   `logit[t] -= frequency * count[t] + presence * (count[t] > 0)`
//!   (OpenAI's formula, vLLM `apply_penalties`);
//! - tokens a request's grammar does not allow next get `-inf` (structured
//!   output), then masked tokens (end of generation before
//!   `min_new_tokens`), unless the grammar allows nothing else;
//! - then temperature, top-k, top-p over the renormalised top-k, and min-p:
//!   a token is kept only if its probability is at least `min_p` times the
//!   most likely token's (SGLang `top_k_top_p_min_p_sampling_from_probs`).
//!
//! The log-probability reported is the model's own (`log_softmax` of the raw
//! logits), as vLLM reports by default.

use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};

/// Parameters of one request's sampler.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k filter.
    pub top_k: usize,
    /// 1.0 = no nucleus filter.
    pub top_p: f32,
    /// RNG seed.
    pub seed: u64,
    /// 0 = no min-p filter.
    pub min_p: f32,
    /// Logit adjustments before sampling.
    pub penalties: Penalties,
}

impl SamplerConfig {
    /// Temperature, top-k, top-p and seed; no min-p, no penalties.
    pub fn basic(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Self {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
            min_p: 0.0,
            penalties: Penalties::default(),
        }
    }

    /// Whether a draw takes a random number (so a resumed sampler skips one
    /// per token sampled elsewhere).
    pub fn draws(&self) -> bool {
        self.temperature >= MIN_TEMPERATURE && self.top_k != 1
    }
}

/// Logit adjustments of one request (the module's formulas).
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties {
    /// Subtracted once from every token the output holds (0 = off).
    pub presence: f32,
    /// Subtracted per occurrence in the output (0 = off).
    pub frequency: f32,
    /// Divides positive and multiplies negative logits of every token seen
    /// in the prompt or the output (1 = off).
    pub repetition: f32,
    /// Added to the token's logit.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// Whether any adjustment is on.
    pub fn any(&self) -> bool {
        self.presence != 0.0
            || self.frequency != 0.0
            || self.repetition != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// Below this temperature sampling is greedy (dividing logits by a smaller
/// number overflows f32).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// A request's sampler; owns its RNG and what the penalties need of the
/// sequence so far.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: rand::rngs::StdRng,
    /// Tokens of the prompt and output (repetition penalty only).
    seen: HashSet<u32>,
    /// Occurrences of each output token (frequency and presence only).
    counts: HashMap<u32, u32>,
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

/// Most alternatives a request may ask for per position (OpenAI's
/// `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The `n` most likely tokens under `log_softmax(logits)`, most likely
/// first (the lower id first on equal logits), with their log-probabilities
/// computed as [`logprob`] does (the same bits for the same token). Fewer
/// when the vocabulary is smaller; NaN logits are never listed.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let ln_sum = sum.ln() as f32;
    // One pass keeping the best `n` (n ≤ 20: insertion into a short list).
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() || (best.len() == n && v <= best[n - 1].1) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= v);
        best.insert(at, (i as u32, v));
        best.truncate(n);
    }
    best.into_iter()
        .map(|(i, v)| (i, (v - max) - ln_sum))
        .collect()
}

impl Sampler {
    /// A sampler with its own RNG seeded from `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Self {
        Self {
            rng: rand::rngs::StdRng::seed_from_u64(cfg.seed),
            cfg,
            seen: HashSet::new(),
            counts: HashMap::new(),
        }
    }

    /// A sampler for a sequence whose prompt is `prompt` (the repetition
    /// penalty counts its tokens as seen).
    pub fn for_prompt(cfg: SamplerConfig, prompt: &[u32]) -> Self {
        let mut s = Self::new(cfg);
        if s.cfg.penalties.repetition != 1.0 {
            s.seen.extend(prompt.iter().copied());
        }
        s
    }

    /// Record a token appended to the output (sampled here or elsewhere).
    pub fn accept(&mut self, id: u32) {
        let p = &self.cfg.penalties;
        if p.repetition != 1.0 {
            self.seen.insert(id);
        }
        if p.presence != 0.0 || p.frequency != 0.0 {
            *self.counts.entry(id).or_insert(0) += 1;
        }
    }

    /// Skip the random draw a token sampled elsewhere took (a prefill worker
    /// drew the first token from the same seed).
    pub fn skip_draw(&mut self) {
        if self.cfg.draws() {
            let _: f64 = self.rng.random();
        }
    }

    /// Pick the next token; returns it with its log-probability under the
    /// model (before every adjustment and filter).
    pub fn sample(&mut self, logits: &[f32]) -> (u32, f32) {
        self.sample_masked(logits, &[])
    }

    /// [`Self::sample`] with `masked` tokens never picked (end-of-generation
    /// tokens before `min_new_tokens`).
    pub fn sample_masked(&mut self, logits: &[f32], masked: &[u32]) -> (u32, f32) {
        self.sample_allowed(logits, masked, None)
    }

    /// [`Self::sample_masked`] where, with `allowed`, only the tokens whose
    /// bit is set may be picked (bit `i % 32` of word `i / 32` is token
    /// `i`: a grammar's mask). The grammar comes first: when it allows
    /// nothing but `masked` tokens (a whole JSON value before
    /// `min_new_tokens`), those stay allowed.
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        masked: &[u32],
        allowed: Option<&[u32]>,
    ) -> (u32, f32) {
        let adjusted;
        let used = if self.cfg.penalties.any() || !masked.is_empty() || allowed.is_some() {
            adjusted = self.adjust(logits, masked, allowed);
            &adjusted[..]
        } else {
            logits
        };
        // Temperatures this small would overflow `logit / t`: they mean greedy.
        let id = if self.cfg.draws() {
            self.sample_filtered(used)
        } else {
            argmax(used)
        };
        (id as u32, logprob(logits, id))
    }

    /// The logits after bias, penalties and masks (the module's formulas).
    fn adjust(&self, logits: &[f32], masked: &[u32], allowed: Option<&[u32]>) -> Vec<f32> {
        let mut l = logits.to_vec();
        if let Some(words) = allowed {
            for (i, v) in l.iter_mut().enumerate() {
                let bit = words.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
                if !bit {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        let p = &self.cfg.penalties;
        for &(id, bias) in &p.logit_bias {
            if let Some(v) = l.get_mut(id as usize) {
                *v += bias;
            }
        }
        if p.repetition != 1.0 {
            for &id in &self.seen {
                if let Some(v) = l.get_mut(id as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition
                    } else {
                        *v * p.repetition
                    };
                }
            }
        }
        for (&id, &n) in &self.counts {
            if let Some(v) = l.get_mut(id as usize) {
                *v -= p.frequency * n as f32 + p.presence;
            }
        }
        let grammar_needs_masked = allowed.is_some()
            && !l
                .iter()
                .enumerate()
                .any(|(i, v)| *v > f32::NEG_INFINITY && !masked.contains(&(i as u32)));
        if !grammar_needs_masked {
            for &id in masked {
                if let Some(v) = l.get_mut(id as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        l
    }

    fn sample_filtered(&mut self, logits: &[f32]) -> usize {
        let t = self.cfg.temperature;
        let mut cand: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| **v > f32::NEG_INFINITY)
            .map(|(i, &v)| (i, v / t))
            .collect();
        if cand.is_empty() {
            // Every token masked: nothing better to do than the model's pick.
            return argmax(logits);
        }
        if self.cfg.top_k > 0 && self.cfg.top_k < cand.len() {
            cand.select_nth_unstable_by(self.cfg.top_k - 1, descending);
            cand.truncate(self.cfg.top_k);
        }
        // Only a prefix of the candidates in descending order is ever read
        // (top-p, min-p and the draw stop early): it is sorted as far as
        // read, not the whole vocabulary (a full sort of 49k candidates
        // cost ~5 ms a token on SmolLM2).
        let mut order = Prefix::new(cand);
        let max = order.get(0).1;
        let weight = |v: f32| ((v - max) as f64).exp();
        let total: f64 = order.all().iter().map(|&(_, v)| weight(v)).sum();
        let mut keep = order.len();
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            for i in 0..order.len() {
                acc += weight(order.get(i).1) / total;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if self.cfg.min_p > 0.0 {
            // Relative to the most likely token (first), which every filter
            // keeps.
            let floor = self.cfg.min_p as f64;
            let within = (0..keep)
                .take_while(|&i| weight(order.get(i).1) >= floor)
                .count();
            keep = within.max(1);
        }
        let kept: f64 = if keep == order.len() {
            total
        } else {
            (0..keep).map(|i| weight(order.get(i).1)).sum()
        };
        let r: f64 = self.rng.random();
        let mut acc = 0.0;
        for i in 0..keep {
            let (id, v) = order.get(i);
            acc += weight(v) / kept;
            if r < acc {
                return id;
            }
        }
        order.get(keep - 1).0
    }
}

/// Highest first; ties by index so the order is deterministic.
fn descending(a: &(usize, f32), b: &(usize, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Candidates whose descending order is established only as far as read:
/// `items[..sorted]` is sorted and comes before every later item.
struct Prefix {
    items: Vec<(usize, f32)>,
    sorted: usize,
}

impl Prefix {
    fn new(items: Vec<(usize, f32)>) -> Self {
        Self { items, sorted: 0 }
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    /// Every candidate, in no particular order.
    fn all(&self) -> &[(usize, f32)] {
        &self.items
    }

    /// The `i`-th candidate in descending order.
    fn get(&mut self, i: usize) -> (usize, f32) {
        if i >= self.sorted {
            // Sort the next stretch, at least doubling what is sorted.
            let end = (i + 1).max(2 * self.sorted).max(64).min(self.items.len());
            let rest = &mut self.items[self.sorted..];
            if end - self.sorted < rest.len() {
                rest.select_nth_unstable_by(end - self.sorted - 1, descending);
            }
            self.items[self.sorted..end].sort_unstable_by(descending);
            self.sorted = end;
        }
        self.items[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplerConfig {
        SamplerConfig::basic(temperature, top_k, top_p, seed)
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
    fn top_logprobs_are_the_most_likely_in_order_with_logprob_bits() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, f32::NAN, 0.5, 2.5];
        let top = top_logprobs(&logits, 4);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 6, 0], "equal logits: lower id first; NaN never");
        let clean = [1.0f32, 3.0, -2.0, 3.0, 0.5, 2.5];
        let top = top_logprobs(&clean, 3);
        for &(id, lp) in &top {
            assert_eq!(lp.to_bits(), logprob(&clean, id as usize).to_bits());
        }
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert_eq!(top_logprobs(&clean, 0), vec![]);
        assert_eq!(top_logprobs(&clean, 50).len(), clean.len());
        let total: f32 = top_logprobs(&clean, 50).iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
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

    fn with(p: Penalties) -> SamplerConfig {
        SamplerConfig {
            penalties: p,
            ..cfg(0.0, 0, 1.0, 1)
        }
    }

    /// Each formula of the module doc, value by value.
    #[test]
    fn penalties_follow_the_formulas() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, 1.0];
        // Repetition 2 over the prompt [0, 1] and the output [2]:
        // positive logits halve, negative ones double; 3 and 4 unseen.
        let mut s = Sampler::for_prompt(
            with(Penalties {
                repetition: 2.0,
                ..Penalties::default()
            }),
            &[0, 1],
        );
        s.accept(2);
        assert_eq!(
            s.adjust(&logits, &[], None),
            vec![1.0, -2.0, 0.25, 3.0, 1.0]
        );
        // Frequency 0.5 and presence 0.25 over the output only: token 3
        // twice, token 4 once; the prompt does not count.
        let mut s = Sampler::for_prompt(
            with(Penalties {
                frequency: 0.5,
                presence: 0.25,
                ..Penalties::default()
            }),
            &[0, 1, 2],
        );
        for id in [3, 4, 3] {
            s.accept(id);
        }
        assert_eq!(
            s.adjust(&logits, &[], None),
            vec![2.0, -1.0, 0.5, 3.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]
        );
        // Bias, then a mask.
        let s = Sampler::new(with(Penalties {
            logit_bias: vec![(1, 10.0), (4, -0.5)],
            ..Penalties::default()
        }));
        let got = s.adjust(&logits, &[0], None);
        assert_eq!(got[1..], [9.0, 0.5, 3.0, 0.5]);
        assert_eq!(got[0], f32::NEG_INFINITY);
        // Greedy picks through them: the bias makes token 1 the best, the
        // mask keeps token 1 out.
        let mut s = Sampler::new(with(Penalties {
            logit_bias: vec![(1, 10.0)],
            ..Penalties::default()
        }));
        assert_eq!(s.sample(&logits).0, 1);
        assert_eq!(s.sample_masked(&logits, &[1]).0, 3);
        // The reported log-probability is the model's own.
        assert_eq!(s.sample(&logits).1, logprob(&logits, 1));
        // Off, nothing is copied or changed.
        assert!(!Penalties::default().any());
    }

    /// Each penalty on its own counts as on, is recorded by `accept`, and
    /// moves the pick (mutation testing found every check made only with
    /// penalties combined).
    #[test]
    fn each_penalty_alone_is_on_and_moves_the_pick() {
        let logits = [3.0f32, 2.9, 0.0];
        for p in [
            Penalties {
                presence: 1.0,
                ..Penalties::default()
            },
            Penalties {
                frequency: 1.0,
                ..Penalties::default()
            },
            Penalties {
                repetition: 2.0,
                ..Penalties::default()
            },
            Penalties {
                logit_bias: vec![(0, -1.0)],
                ..Penalties::default()
            },
        ] {
            assert!(p.any(), "{p:?}");
            let mut s = Sampler::new(with(p.clone()));
            assert_eq!(
                s.sample(&logits).0,
                if p.logit_bias.is_empty() { 0 } else { 1 }
            );
            s.accept(0);
            assert_eq!(s.sample(&logits).0, 1, "{p:?}: token 0 is penalised");
        }
        // A mask alone (no penalty) is applied too.
        let mut plain = Sampler::new(with(Penalties::default()));
        assert_eq!(plain.sample_masked(&logits, &[0]).0, 1);
        // Drawing with every token masked falls back to the first of them,
        // never to an arithmetic accident over infinities.
        let mut drawn = Sampler::new(cfg(1.0, 0, 1.0, 5));
        for _ in 0..20 {
            assert_eq!(drawn.sample_masked(&logits, &[0, 1, 2]).0, 0);
        }
    }

    #[test]
    fn min_p_keeps_tokens_at_least_that_share_of_the_best() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps those >= 0.125.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(SamplerConfig {
            min_p: 0.25,
            ..cfg(1.0, 0, 1.0, 77)
        });
        let mut count = [0usize; 4];
        const N: usize = 30_000;
        for _ in 0..N {
            count[s.sample(&logits).0 as usize] += 1;
        }
        assert_eq!(count[3], 0, "{count:?}");
        for (i, want) in [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95].iter().enumerate() {
            let got = count[i] as f64 / N as f64;
            assert!((got - want).abs() < 0.015, "token {i}: {got} vs {want}");
        }
    }

    #[test]
    fn a_resumed_sampler_skips_exactly_the_draws_taken_elsewhere() {
        let logits: Vec<f32> = (0..20).map(|i| (i as f32 * 0.7).cos()).collect();
        for c in [
            cfg(0.8, 0, 1.0, 5),
            cfg(0.0, 0, 1.0, 5),
            cfg(1e-7, 0, 1.0, 5),
            cfg(1.0, 1, 1.0, 5),
        ] {
            let mut whole = Sampler::new(c.clone());
            let first = whole.sample(&logits).0;
            let rest: Vec<u32> = (0..10).map(|_| whole.sample(&logits).0).collect();
            let mut resumed = Sampler::new(c.clone());
            resumed.accept(first);
            resumed.skip_draw();
            let again: Vec<u32> = (0..10).map(|_| resumed.sample(&logits).0).collect();
            assert_eq!(rest, again, "{c:?}");
        }
    }

    #[test]
    fn only_allowed_tokens_are_picked_and_the_grammar_wins_over_min_tokens() {
        // Token 3 is by far the most likely; the mask allows 1 and 4
        // (bits 1 and 4 of word 0).
        let logits = [0.0, 1.0, 0.5, 9.0, 0.8];
        let allowed = [0b10010u32];
        let mut greedy = Sampler::new(cfg(0.0, 0, 1.0, 1));
        let (id, lp) = greedy.sample_allowed(&logits, &[], Some(&allowed));
        // The logprob reported is the model's own.
        assert_eq!((id, lp.to_bits()), (1, logprob(&logits, 1).to_bits()));
        let mut hot = Sampler::new(cfg(5.0, 0, 1.0, 2));
        for _ in 0..200 {
            let id = hot.sample_allowed(&logits, &[], Some(&allowed)).0;
            assert!(id == 1 || id == 4, "{id}");
        }
        // A masked (end-of-generation) token stays out while the grammar
        // allows something else...
        assert_eq!(greedy.sample_allowed(&logits, &[1], Some(&allowed)).0, 4);
        // ...and is picked when the grammar allows nothing else.
        assert_eq!(greedy.sample_allowed(&logits, &[1, 4], Some(&allowed)).0, 1);
        assert_eq!(greedy.sample_allowed(&logits, &[1], Some(&[0b10])).0, 1);
    }

    /// The sampler as it was (every candidate sorted, probabilities
    /// normalized twice), the reference for the partial sort.
    fn full_sort_pick(cfg: &SamplerConfig, logits: &[f32], r: f64) -> usize {
        let t = cfg.temperature;
        let mut cand: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i, v / t))
            .collect();
        cand.sort_unstable_by(descending);
        if cfg.top_k > 0 && cfg.top_k < cand.len() {
            cand.truncate(cfg.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&(_, v)| ((v - max) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    acc += p;
                    acc >= cfg.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        if cfg.min_p > 0.0 {
            let floor = probs[0] * cfg.min_p as f64;
            let keep = probs.iter().take_while(|&&p| p >= floor).count();
            probs.truncate(keep.max(1));
        }
        let total: f64 = probs.iter().sum();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p / total;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }

    #[test]
    fn the_partial_sort_picks_what_a_full_sort_picks() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut differ = 0;
        for case in 0..3000u64 {
            let n = [5, 300, 5000][case as usize % 3];
            let logits: Vec<f32> = (0..n).map(|_| rng.random_range(-12.0f32..12.0)).collect();
            let mut c = cfg(
                [0.3, 0.8, 1.5][(case / 3) as usize % 3],
                [0, 0, 40][(case / 9) as usize % 3],
                [1.0, 0.9, 0.5][(case / 27) as usize % 3],
                case,
            );
            c.min_p = [0.0, 0.0, 0.05][(case / 81) as usize % 3];
            let mut s = Sampler::new(c.clone());
            let got = s.sample(&logits).0 as usize;
            // The same draw the sampler took.
            let r: f64 = rand::rngs::StdRng::seed_from_u64(case).random();
            if got != full_sort_pick(&c, &logits, r) {
                differ += 1;
            }
        }
        // (The totals are summed in another order, which could round a
        // boundary the other way; none of these cases does.)
        assert_eq!(differ, 0, "{differ} of 3000 picks differ");
    }
}
