//! Request, sampling parameters and the events a request's stream yields.

use std::time::Instant;

pub use handoff_model::sampling::Penalties;
use handoff_model::sampling::SamplerConfig;

use crate::error::EngineError;

/// How the next token is chosen and when generation stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0.0 means greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables the filter.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set whose mass reaches `top_p`; 1.0 disables it.
    pub top_p: f32,
    /// Seed of the request's own RNG: same seed, same prompt, same output.
    /// `None` draws a seed at random.
    pub seed: Option<u64>,
    /// Maximum number of tokens to generate (at least 1).
    pub max_new_tokens: usize,
    /// Generation stops when the decoded output contains one of these; the
    /// text returned ends before the match.
    pub stop: Vec<String>,
    /// Generation stops when one of these token ids is sampled.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// Keep only tokens at least this share of the most likely one's
    /// probability; 0 disables it.
    pub min_p: f32,
    /// Bias, repetition, frequency and presence penalties
    /// ([`handoff_model::sampling`] has the formulas).
    pub penalties: Penalties,
    /// No end of generation (end-of-sequence, stop ids, stop strings)
    /// before this many tokens: end-of-generation tokens are masked.
    pub min_new_tokens: usize,
    /// Special tokens add no text to the output (default true).
    pub skip_special_tokens: bool,
    /// With special tokens in the text, a space separates each from its
    /// neighbours (default true; vLLM's and HF's slow detokenizer rule).
    pub spaces_between_special_tokens: bool,
    /// With each token, the log-probabilities of this many most likely
    /// tokens at its position (0: none; at most
    /// [`handoff_model::sampling::MAX_TOP_LOGPROBS`]).
    pub top_logprobs: usize,
    /// Score the prompt: with the first token, the log-probability of each
    /// prompt token after the ones before it (and `top_logprobs`
    /// alternatives at each position). The whole prompt is computed (no
    /// prefix-cache hit), since a cached prefix has no logits.
    pub prompt_logprobs: bool,
    /// What the output must match (structured output): its compiled
    /// grammar, which masks every token sampled and tracks the output.
    pub grammar: Option<crate::grammar::Grammar>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_new_tokens: 128,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_p: 0.0,
            penalties: Penalties::default(),
            min_new_tokens: 0,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            top_logprobs: 0,
            prompt_logprobs: false,
            grammar: None,
        }
    }
}

impl SamplingParams {
    /// The sampler of a request with these parameters and `seed`.
    pub fn sampler(&self, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed,
            min_p: self.min_p,
            penalties: self.penalties.clone(),
        }
    }

    /// Tokens the sampler may not pick after `generated` output tokens:
    /// every end of generation while fewer than `min_new_tokens` came.
    pub fn masked(&self, generated: usize, eog: &[u32]) -> Vec<u32> {
        if generated >= self.min_new_tokens {
            return Vec::new();
        }
        let mut m = self.stop_token_ids.clone();
        if !self.ignore_eos {
            m.extend_from_slice(eog);
        }
        m
    }
}

/// One generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids (chat template already applied, BOS included if the model wants one).
    pub prompt_ids: Vec<u32>,
    /// Sampling and stopping rules.
    pub sampling: SamplingParams,
    /// When the request reached the server (for TTFT accounting).
    pub arrived: Instant,
    /// Output tokens another worker already generated and streamed to the
    /// client (mid-stream migration): this engine computes their K/V with
    /// the prompt's, replays them through the sampler's RNG and penalties,
    /// the grammar and the stop-string matcher, and generates from the next
    /// one on. They count toward `max_new_tokens`; empty for a new request.
    pub output_so_far: Vec<u32>,
    /// Its priority and tenant: the order it waits in ([`crate::fair`]).
    pub class: crate::fair::Class,
}

impl GenerateRequest {
    /// A new request (nothing generated yet) arriving now.
    pub fn new(prompt_ids: Vec<u32>, sampling: SamplingParams) -> Self {
        Self {
            prompt_ids,
            sampling,
            arrived: Instant::now(),
            output_so_far: Vec::new(),
            class: crate::fair::Class::default(),
        }
    }
}

/// Why a request stopped generating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced EOS or a stop token id.
    Eos {
        /// The token that ended generation.
        token: u32,
    },
    /// A stop string matched.
    StopString {
        /// The stop string that matched.
        matched: String,
    },
    /// `max_new_tokens` was reached, or the context is full.
    Length,
    /// The output is a whole sentence of the request's grammar and nothing
    /// may follow it (a JSON value's closing brace).
    GrammarComplete,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string: `"stop"` or `"length"`.
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::Eos { .. }
            | FinishReason::StopString { .. }
            | FinishReason::GrammarComplete => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One generated token as it leaves the engine.
#[derive(Debug, Clone)]
pub struct TokenOut {
    /// Token id.
    pub id: u32,
    /// Natural log of the token's probability under the sampling distribution
    /// before temperature/top-k/top-p (the model's own log-softmax).
    pub logprob: f32,
    /// The most likely tokens at this position with their log-probabilities
    /// (as `logprob`), most likely first: `top_logprobs` of them, or none.
    pub top: Vec<(u32, f32)>,
    /// On the first token of a request with `prompt_logprobs`: one entry per
    /// prompt token after the first. Empty otherwise.
    pub prompt: Vec<PromptLogprob>,
    /// Text this token adds to the output (may be empty while a multi-byte
    /// character or a possible stop string is incomplete; held-back text is
    /// released by a later token or dropped if a stop string matches).
    pub text: String,
}

/// A prompt token scored by the model: its log-probability after the
/// tokens before it, and the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    /// The prompt token.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at its position (`top_logprobs` of them).
    pub top: Vec<(u32, f32)>,
}

impl PromptLogprob {
    /// The wire form of a prompt's scores: per scored token its own
    /// (token, log-probability) pair, then exactly `top` alternatives
    /// (padded with `(u32::MAX, -inf)` where the vocabulary had fewer).
    pub fn flatten(scores: &[PromptLogprob], top: usize) -> Vec<(u32, f32)> {
        let mut out = Vec::with_capacity(scores.len() * (1 + top));
        for s in scores {
            out.push((s.id, s.logprob));
            out.extend(s.top.iter().copied().take(top));
            out.extend(std::iter::repeat_n(
                (u32::MAX, f32::NEG_INFINITY),
                top.saturating_sub(s.top.len()),
            ));
        }
        out
    }

    /// Back from [`Self::flatten`], checked against the prompt it scores:
    /// one entry per token of `prompt[1..]`, each naming that token.
    pub fn unflatten(
        flat: &[(u32, f32)],
        prompt: &[u32],
        top: usize,
    ) -> Result<Vec<PromptLogprob>, String> {
        let want = prompt.len().saturating_sub(1) * (1 + top);
        if flat.len() != want {
            return Err(format!(
                "prompt scores of {} pairs for a prompt of {} tokens with {top} alternatives ({want} expected)",
                flat.len(),
                prompt.len()
            ));
        }
        flat.chunks(1 + top)
            .zip(&prompt[1..])
            .map(|(c, &token)| {
                let (id, logprob) = c[0];
                if id != token {
                    return Err(format!(
                        "prompt scores name token {id} where the prompt has {token}"
                    ));
                }
                let top = c[1..].iter().copied().filter(|p| p.0 != u32::MAX).collect();
                Ok(PromptLogprob { id, logprob, top })
            })
            .collect()
    }

    /// Score every token of `tokens[1..]` that the rows of `logits` predict:
    /// row `r` holds the logits after token `start + r`, and predicts token
    /// `start + r + 1` (rows past the prompt's end score nothing).
    pub fn score(
        tokens: &[u32],
        start: usize,
        logits: &[Vec<f32>],
        top: usize,
        out: &mut Vec<PromptLogprob>,
    ) {
        for (r, l) in logits.iter().enumerate() {
            let Some(&id) = tokens.get(start + r + 1) else {
                break;
            };
            out.push(PromptLogprob {
                id,
                logprob: handoff_model::sampling::logprob(l, id as usize),
                top: handoff_model::sampling::top_logprobs(l, top),
            });
        }
    }
}

/// The end of a request that completed normally.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Why it stopped.
    pub reason: FinishReason,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (including a final EOS/stop token).
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (not computed).
    pub cached_tokens: usize,
}

/// What a request's stream yields, in order: zero or more `Token`, then exactly
/// one `Finished` or `Error`.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    /// A generated token.
    Token(TokenOut),
    /// Generation ended normally.
    Finished(Finished),
    /// Generation failed; nothing follows.
    Error(EngineError),
}
