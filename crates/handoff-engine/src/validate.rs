//! Every limit a request must pass before it enters any queue.

use crate::error::EngineError;
use crate::model_info::ModelInfo;
use crate::request::GenerateRequest;

/// Most `logit_bias` entries one request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Every limit a request must pass before it enters any queue (colocated,
/// prefill and decode engines alike): prompt, sampling parameters, context,
/// KV capacity of a pool of `total_pages` pages.
pub(crate) fn validate(
    info: &ModelInfo,
    total_pages: usize,
    req: &GenerateRequest,
) -> Result<(), EngineError> {
    let p = &req.sampling;
    if req.prompt_ids.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if let Some(&id) = req
        .prompt_ids
        .iter()
        .find(|&&id| id as usize >= info.vocab_size)
    {
        return Err(EngineError::TokenOutOfRange {
            id,
            vocab_size: info.vocab_size,
        });
    }
    if p.max_new_tokens == 0 {
        return Err(EngineError::InvalidParams(
            "max_tokens must be at least 1".into(),
        ));
    }
    if let Some(&id) = req
        .output_so_far
        .iter()
        .find(|&&id| id as usize >= info.vocab_size)
    {
        return Err(EngineError::TokenOutOfRange {
            id,
            vocab_size: info.vocab_size,
        });
    }
    if req.output_so_far.len() >= p.max_new_tokens {
        return Err(EngineError::InvalidParams(format!(
            "resume_output_ids: {} tokens were already generated, which leaves nothing to generate under max_tokens {}",
            req.output_so_far.len(),
            p.max_new_tokens
        )));
    }
    if !req.output_so_far.is_empty() && p.prompt_logprobs {
        return Err(EngineError::InvalidParams(
            "resume_output_ids: a continued generation does not score its prompt again (the prompt's log-probabilities came with the first token)".into(),
        ));
    }
    if p.top_logprobs > handoff_model::sampling::MAX_TOP_LOGPROBS {
        return Err(EngineError::InvalidParams(format!(
            "top_logprobs must be at most {}, got {}",
            handoff_model::sampling::MAX_TOP_LOGPROBS,
            p.top_logprobs
        )));
    }
    if !p.temperature.is_finite() || p.temperature < 0.0 {
        return Err(EngineError::InvalidParams(format!(
            "temperature must be a finite number >= 0, got {}",
            p.temperature
        )));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return Err(EngineError::InvalidParams(format!(
            "top_p must be in (0, 1], got {}",
            p.top_p
        )));
    }
    if p.stop.iter().any(|s| s.is_empty()) {
        return Err(EngineError::InvalidParams(
            "stop strings must not be empty".into(),
        ));
    }
    if !(0.0..=1.0).contains(&p.min_p) {
        return Err(EngineError::InvalidParams(format!(
            "min_p must be in [0, 1], got {}",
            p.min_p
        )));
    }
    let pen = &p.penalties;
    for (name, v) in [
        ("presence_penalty", pen.presence),
        ("frequency_penalty", pen.frequency),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(EngineError::InvalidParams(format!(
                "{name} must be in [-2, 2], got {v}"
            )));
        }
    }
    if !(pen.repetition > 0.0 && pen.repetition <= 2.0) {
        return Err(EngineError::InvalidParams(format!(
            "repetition_penalty must be in (0, 2], got {}",
            pen.repetition
        )));
    }
    if pen.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(EngineError::InvalidParams(format!(
            "logit_bias holds {} tokens: at most {MAX_LOGIT_BIAS} are accepted",
            pen.logit_bias.len()
        )));
    }
    if let Some(&(id, b)) = pen
        .logit_bias
        .iter()
        .find(|&&(id, b)| id as usize >= info.vocab_size || !(-100.0..=100.0).contains(&b))
    {
        return Err(EngineError::InvalidParams(format!(
            "logit_bias: token {id} with bias {b}: tokens must be below the vocabulary size {} and biases in [-100, 100]",
            info.vocab_size
        )));
    }
    if p.min_new_tokens > p.max_new_tokens {
        return Err(EngineError::InvalidParams(format!(
            "min_new_tokens ({}) must not exceed max_new_tokens ({})",
            p.min_new_tokens, p.max_new_tokens
        )));
    }
    let total = req.prompt_ids.len().saturating_add(p.max_new_tokens);
    if total > info.context_length {
        return Err(EngineError::ContextExceeded {
            prompt_tokens: req.prompt_ids.len(),
            max_new_tokens: p.max_new_tokens,
            context_length: info.context_length,
        });
    }
    let needed_pages = total.div_ceil(info.page_size);
    if needed_pages > total_pages {
        return Err(EngineError::ExceedsKvCapacity {
            needed_pages,
            total_pages,
        });
    }
    Ok(())
}
