//! `POST /generate`: SGLang's native request and response shapes
//! (`text` or `input_ids`, `sampling_params`, `stream`; `text`,
//! `output_ids`, `meta_info`). Streaming sends cumulative objects, as SGLang
//! does, then `data: [DONE]`. The PD fields `bootstrap_host`,
//! `bootstrap_port` and `bootstrap_room` pair a prefill and a decode worker
//! (a colocated worker checks and ignores them).

use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use handoff_engine::request::GenerateRequest;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::http::extract::JsonBody;
use crate::http::sse::{sse_response_marked, Disconnected, SseSender};
use crate::state::AppState;
use crate::worker::fields::Endpoint;
use crate::worker::generation::{sglang_finish_reason, Generation, Step};
use crate::worker::pd_fields::PdFields;
use crate::worker::prompt;
use crate::worker::sampling_fields::{Limits, SamplingFields};

const ENDPOINT: &str = "/generate";

/// SGLang's default `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// `text`: one string (a list is a batch, which is not supported).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string")]
pub enum TextInput {
    /// One prompt.
    One(String),
    /// A batch.
    Batch(Vec<String>),
}

/// `input_ids`: one list of ids (a list of lists is a batch).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a list of token ids")]
pub enum IdsInput {
    /// One prompt.
    One(Vec<u32>),
    /// A batch.
    Batch(Vec<Vec<u32>>),
}

/// `sampling_params`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerateSampling {
    /// Output limit (default 128).
    #[serde(default)]
    pub max_new_tokens: Option<i64>,
    /// RNG seed (SGLang's name).
    #[serde(default)]
    pub sampling_seed: Option<i64>,
    /// Choices (1 to 16; [`crate::worker::choices`]).
    #[serde(default)]
    pub n: Option<i64>,
    /// Minimum output before any end of generation.
    #[serde(default)]
    pub min_new_tokens: Option<i64>,
    /// The sampling fields every API shares.
    #[serde(flatten)]
    pub shared: SamplingFields,
    /// Every other field: refused or accepted by [`crate::worker::fields::check`].
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// `POST /generate` body.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerateBody {
    /// Prompt text.
    #[serde(default)]
    pub text: Option<TextInput>,
    /// Prompt token ids.
    #[serde(default)]
    pub input_ids: Option<IdsInput>,
    /// Sampling parameters.
    #[serde(default)]
    pub sampling_params: Option<GenerateSampling>,
    /// Stream cumulative results as SSE.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Request id chosen by the client.
    #[serde(default)]
    pub rid: Option<String>,
    /// Add `output_token_logprobs` (`[logprob, id, null]` per token) to `meta_info`.
    #[serde(default)]
    pub return_logprob: Option<bool>,
    /// With `return_logprob`, also `output_top_logprobs`: this many most
    /// likely tokens per position (`[logprob, id, null]` each).
    #[serde(default)]
    pub top_logprobs_num: Option<i64>,
    /// With `return_logprob`, also `input_token_logprobs` (and, with
    /// `top_logprobs_num`, `input_top_logprobs`) from this prompt position
    /// on; -1 (SGLang's default): none.
    #[serde(default)]
    pub logprob_start_len: Option<i64>,
    /// With `return_logprob`, each `[logprob, id, text]` entry carries the
    /// token's text (null otherwise).
    #[serde(default)]
    pub return_text_in_logprobs: Option<bool>,
    /// Larger is served sooner (SGLang's `priority`); at most the API
    /// key's limit ([`crate::http::tenancy`]).
    #[serde(default)]
    pub priority: Option<Value>,
    /// The PD fields (set by the router).
    #[serde(flatten)]
    pub pd: PdFields,
    /// Every other field: refused or accepted by [`crate::worker::fields::check`].
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// The prompts of a body: one, or a batch (a list of texts or id lists).
fn prompts(state: &AppState, body: &GenerateBody) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    let size = |n: usize, field: &str| {
        if n == 0 || n > crate::worker::choices::MAX_CHOICES {
            return Err(ApiError::invalid_param(
                field,
                format!(
                    "a batch holds 1 to {} prompts, got {n}",
                    crate::worker::choices::MAX_CHOICES
                ),
            ));
        }
        Ok(())
    };
    match (&body.text, &body.input_ids) {
        (None, Some(IdsInput::Batch(b))) => {
            size(b.len(), "input_ids")?;
            let ids = b
                .iter()
                .enumerate()
                .map(|(i, ids)| {
                    prompt::id_prompt(&state.engine, ids.clone(), &format!("input_ids[{i}]"))
                })
                .collect::<Result<_, _>>()?;
            Ok((ids, true))
        }
        (Some(TextInput::Batch(b)), None) => {
            size(b.len(), "text")?;
            let ids = b
                .iter()
                .map(|t| prompt::text_prompt(&state.engine, t))
                .collect::<Result<_, _>>()?;
            Ok((ids, true))
        }
        _ => Ok((vec![prompt_ids(state, body)?], false)),
    }
}

fn prompt_ids(state: &AppState, body: &GenerateBody) -> Result<Vec<u32>, ApiError> {
    match (&body.text, &body.input_ids) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "invalid_value",
            "give either `text` or `input_ids`, not both",
        )),
        (None, None) => Err(ApiError::bad_request(
            "invalid_value",
            "the request needs a prompt: `text` or `input_ids`",
        )),
        (Some(TextInput::One(t)), None) => prompt::text_prompt(&state.engine, t),
        (None, Some(IdsInput::One(ids))) => {
            prompt::id_prompt(&state.engine, ids.clone(), "input_ids")
        }
        // Batches are read by `prompts`, which never passes one here.
        _ => Err(ApiError::bad_request(
            "invalid_value",
            "a batch of prompts is a list of texts or of id lists",
        )),
    }
}

/// `POST /generate`.
pub async fn generate(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody<GenerateBody>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut pd = body.pd.bootstrap()?;
    pd.handover.from_headers(&headers, body.priority.as_ref())?;
    state.check_bootstrap(&mut pd)?;
    let (stream_it, body_wants_logprobs) = (
        body.stream.unwrap_or(false),
        body.return_logprob.unwrap_or(false),
    );
    let top_wanted = body.top_logprobs_num.is_some_and(|n| n > 0);
    let texts =
        (body.return_text_in_logprobs == Some(true)).then(|| state.engine.tokenizer().clone());
    let input_from = body
        .logprob_start_len
        .filter(|&n| n >= 0 && body.return_logprob == Some(true))
        .map(|n| n as usize);
    let st = state.clone();
    let prepared = prompt::off_runtime(move || prepare(&st, &body, arrived)).await;
    let Prepared {
        mut reqs,
        rid,
        n,
        batch,
    } = match prepared {
        Ok(x) => x,
        Err(e) => {
            // Refused before the engine saw it: the PD peer learns now.
            state.engine.reject(&pd, &e).await;
            return Err(e);
        }
    };
    let resumed = pd.handover.resume.clone();
    if !resumed.is_empty() && (!stream_it || body_wants_logprobs) {
        let why = if stream_it {
            "a stream with return_logprob is not continued (its cumulative log-probabilities are not carried)"
        } else {
            "it continues a stream: send stream true"
        };
        return Err(ApiError::invalid_param(
            "resume_output_ids",
            format!("resume_output_ids: {why}"),
        ));
    }
    if stream_it {
        let req = reqs.remove(0);
        let prompt_tokens = req.prompt_ids.len();
        let prompt_ids = req.prompt_ids.clone();
        // A continued stream's cumulative text starts with what the client has.
        let sent = handoff_engine::streamed_text(state.engine.tokenizer(), &req.sampling, &resumed);
        let gen = Generation::submit(&state, req, ENDPOINT, &pd, &rid).await?;
        return Ok(sse_response_marked(pd.handover.marks, move |tx| {
            let scored = ScoredStream {
                texts: texts.clone(),
                logprobs: body_wants_logprobs,
                top_wanted,
                input_from,
                prompt_ids,
            };
            stream(gen, tx, rid, prompt_tokens, scored, (resumed, sent))
        }));
    }
    let prompt_ids: Vec<Vec<u32>> = reqs.iter().map(|r| r.prompt_ids.clone()).collect();
    let submitted =
        crate::worker::choices::submit_prompts(&state, reqs, n, ENDPOINT, &pd, &rid).await?;
    let mut bodies: Vec<Value> = Vec::new();
    for (p, gens) in submitted.into_iter().enumerate() {
        let shape = Whole {
            texts: texts.as_deref(),
            rid: &rid,
            arrived,
            logprobs: body_wants_logprobs,
            top_wanted,
            input_from,
            prompt_ids: &prompt_ids[p],
        };
        for c in crate::worker::choices::collect(gens).await? {
            bodies.push(shape.body(&c));
        }
    }
    // SGLang's shape: one object, or a list of them (a batch, or `n` > 1).
    if bodies.len() == 1 && !batch {
        return Ok(Json(bodies.remove(0)).into_response());
    }
    for (i, b) in bodies.iter_mut().enumerate() {
        b["index"] = json!(i);
    }
    Ok(Json(Value::Array(bodies)).into_response())
}

/// How a whole `/generate` answer is shaped.
struct Whole<'a> {
    /// `return_text_in_logprobs`: the tokenizer that spells the entries.
    texts: Option<&'a handoff_model::tokenizer::Tokenizer>,
    rid: &'a str,
    arrived: Instant,
    logprobs: bool,
    top_wanted: bool,
    input_from: Option<usize>,
    prompt_ids: &'a [u32],
}

impl Whole<'_> {
    fn body(&self, c: &crate::worker::generation::Collected) -> Value {
        let ids: Vec<u32> = c.tokens.iter().map(|t| t.id).collect();
        let mut body = json!({
            "text": c.text,
            "output_ids": ids,
            "meta_info": {
                "id": self.rid,
                "finish_reason": sglang_finish_reason(&c.finished.reason, c.finished.completion_tokens),
                "prompt_tokens": c.finished.prompt_tokens,
                "completion_tokens": c.finished.completion_tokens,
                "cached_tokens": c.finished.cached_tokens,
                "e2e_latency": self.arrived.elapsed().as_secs_f64(),
            },
        });
        if self.logprobs {
            body["meta_info"]["output_token_logprobs"] = c
                .tokens
                .iter()
                .map(|t| json!([t.logprob, t.id, null]))
                .collect();
            if self.top_wanted {
                body["meta_info"]["output_top_logprobs"] = c.tokens.iter().map(top_entry).collect();
            }
            if let (Some(start), Some(first)) = (self.input_from, c.tokens.first()) {
                let (lps, tops) = input_logprobs(self.prompt_ids, first, start);
                body["meta_info"]["input_token_logprobs"] = lps;
                if self.top_wanted {
                    body["meta_info"]["input_top_logprobs"] = tops;
                }
            }
            if let Some(tok) = self.texts {
                spell_logprobs(&mut body, tok);
            }
        }
        body
    }
}

/// The engine request and the response id of a `/generate` body.
fn prepare(state: &AppState, body: &GenerateBody, arrived: Instant) -> Result<Prepared, ApiError> {
    crate::worker::fields::check(Endpoint::Generate, &body.extra)?;
    let mut sp = body.sampling_params.clone().unwrap_or_default();
    let grammar =
        crate::worker::structured::take(Endpoint::SamplingParams, &mut sp.extra, &state.grammars)?;
    crate::worker::fields::check(Endpoint::SamplingParams, &sp.extra)?;
    let (prompts, batch) = prompts(state, body)?;
    let (n, _) = crate::worker::choices::count(sp.n, "sampling_params.n", None, prompts.len())?;
    if (n > 1 || batch) && body.stream == Some(true) {
        return Err(ApiError::invalid_param(
            match (batch, body.input_ids.is_some()) {
                (true, true) => "input_ids",
                (true, false) => "text",
                _ => "sampling_params.n",
            },
            "a batch or sampling_params.n > 1 is answered whole on /generate: send stream false (or stream several choices from /v1/completions)",
        ));
    }
    let mut raw = sp.shared.raw(
        "sampling_params.",
        Limits {
            max_tokens_field: "max_new_tokens",
            max_tokens: sp.max_new_tokens,
            min_tokens_field: "sampling_params.min_new_tokens",
            min_tokens: sp.min_new_tokens,
        },
    )?;
    raw.seed = raw.seed.or(sp.sampling_seed);
    let mut sampling = raw.into_params(
        DEFAULT_MAX_NEW_TOKENS,
        &crate::worker::params::Defaults::of_backend(&state.engine),
    )?;
    sampling.grammar = grammar;
    sampling.top_logprobs =
        crate::worker::params::top_logprobs("top_logprobs_num", body.top_logprobs_num)?;
    if sampling.top_logprobs > 0 && body.return_logprob != Some(true) {
        return Err(ApiError::invalid_param(
            "top_logprobs_num",
            "top_logprobs_num needs return_logprob: true",
        ));
    }
    crate::worker::params::check_token_ids(&sampling, state.engine.model().vocab_size)?;
    let shortest = prompts.iter().map(Vec::len).min().unwrap_or(0);
    match body.logprob_start_len {
        None | Some(-1) => {}
        Some(n) if body.return_logprob != Some(true) => {
            return Err(ApiError::invalid_param(
                "logprob_start_len",
                format!("logprob_start_len {n} needs return_logprob: true"),
            ))
        }
        Some(n) if n >= 0 && (n as u64) < shortest as u64 => {
            sampling.prompt_logprobs = true;
        }
        Some(n) => {
            return Err(ApiError::invalid_param(
                "logprob_start_len",
                format!(
                    "logprob_start_len must be -1 or a prompt position (0 to {}), got {n}",
                    shortest.saturating_sub(1)
                ),
            ))
        }
    }
    let rid = crate::worker::request_ids::request_id(body.rid.as_ref(), "gen")?;
    Ok(Prepared {
        reqs: crate::worker::choices::requests(prompts, &sampling, arrived),
        rid,
        n,
        batch,
    })
}

/// A `/generate` body, ready to submit.
struct Prepared {
    /// One request per prompt.
    reqs: Vec<GenerateRequest>,
    rid: String,
    /// Sequences per prompt.
    n: usize,
    /// The prompts came as a list (the answer is a list).
    batch: bool,
}

/// Streams cumulative objects, as SGLang does; with `return_logprob`, each
/// carries `output_token_logprobs` so far.
async fn stream(
    mut gen: Generation,
    tx: SseSender,
    rid: String,
    prompt_tokens: usize,
    scored: ScoredStream,
    (resumed, sent): (Vec<u32>, String),
) -> Result<(), Disconnected> {
    let ScoredStream {
        texts,
        logprobs,
        top_wanted,
        input_from,
        prompt_ids,
    } = scored;
    let mut text = sent;
    let mut ids: Vec<u32> = resumed;
    let mut lps: Vec<Value> = Vec::new();
    let mut tops: Vec<Value> = Vec::new();
    // The prompt's scores, from the first token on.
    let mut input: Option<(Value, Value)> = None;
    while let Some(step) = tx.race(gen.next()).await? {
        match step {
            Step::Token(t) => {
                tx.note_token(t.id);
                text.push_str(&t.text);
                ids.push(t.id);
                let mut chunk = json!({
                    "text": text,
                    "output_ids": ids,
                    "meta_info": {
                        "id": rid,
                        "finish_reason": null,
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": ids.len(),
                        "cached_tokens": 0,
                    },
                });
                if logprobs {
                    lps.push(json!([t.logprob, t.id, null]));
                    chunk["meta_info"]["output_token_logprobs"] = Value::Array(lps.clone());
                    if top_wanted {
                        tops.push(top_entry(&t));
                        chunk["meta_info"]["output_top_logprobs"] = Value::Array(tops.clone());
                    }
                    if let (Some(start), None) = (input_from, &input) {
                        input = Some(input_logprobs(&prompt_ids, &t, start));
                    }
                    add_input(&mut chunk, &input, top_wanted);
                    if let Some(tok) = &texts {
                        spell_logprobs(&mut chunk, tok);
                    }
                }
                tx.json(&chunk).await?;
            }
            Step::Finished(f) => {
                let mut chunk = json!({
                    "text": text,
                    "output_ids": ids,
                    "meta_info": {
                        "id": rid,
                        "finish_reason": sglang_finish_reason(&f.reason, f.completion_tokens),
                        "prompt_tokens": f.prompt_tokens,
                        "completion_tokens": f.completion_tokens,
                        "cached_tokens": f.cached_tokens,
                        "e2e_latency": gen.arrived().elapsed().as_secs_f64(),
                    },
                });
                if logprobs {
                    chunk["meta_info"]["output_token_logprobs"] = Value::Array(lps);
                    if top_wanted {
                        chunk["meta_info"]["output_top_logprobs"] = Value::Array(tops);
                    }
                    add_input(&mut chunk, &input, top_wanted);
                    if let Some(tok) = &texts {
                        spell_logprobs(&mut chunk, tok);
                    }
                }
                tx.note_end();
                tx.json(&chunk).await?;
                return tx.done().await;
            }
            Step::Error(e) => return tx.error(&e).await,
        }
    }
    Ok(())
}

/// What a streamed `/generate` reports beside the text.
struct ScoredStream {
    /// `return_text_in_logprobs`: the tokenizer that spells the entries.
    texts: Option<std::sync::Arc<handoff_model::tokenizer::Tokenizer>>,
    logprobs: bool,
    top_wanted: bool,
    /// `logprob_start_len`, when the prompt is scored.
    input_from: Option<usize>,
    prompt_ids: Vec<u32>,
}

/// SGLang's `input_token_logprobs` (`[logprob, id, null]`, the first
/// prompt token's logprob null) and `input_top_logprobs` (null for the
/// first) from prompt position `start`, from the scores `first` (the first
/// generated token) brought.
fn input_logprobs(
    prompt: &[u32],
    first: &handoff_engine::request::TokenOut,
    start: usize,
) -> (Value, Value) {
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    for (p, &id) in prompt.iter().enumerate().skip(start) {
        match p.checked_sub(1).and_then(|i| first.prompt.get(i)) {
            Some(s) => {
                lps.push(json!([s.logprob, id, null]));
                tops.push(s.top.iter().map(|&(t, lp)| json!([lp, t, null])).collect());
            }
            None => {
                lps.push(json!([null, id, null]));
                tops.push(Value::Null);
            }
        }
    }
    (Value::Array(lps), Value::Array(tops))
}

/// `return_text_in_logprobs`: put each `[logprob, id, null]` entry's token
/// text in its third slot, in every list of `body`'s `meta_info`.
fn spell_logprobs(body: &mut Value, tok: &handoff_model::tokenizer::Tokenizer) {
    fn spell(entry: &mut Value, tok: &handoff_model::tokenizer::Tokenizer) {
        match entry {
            Value::Array(a) if a.len() == 3 && a[1].is_u64() => {
                let id = a[1].as_u64().unwrap_or(0) as u32;
                let bytes = tok.token_bytes(id, false).unwrap_or_default();
                a[2] = json!(String::from_utf8_lossy(bytes));
            }
            Value::Array(a) => a.iter_mut().for_each(|e| spell(e, tok)),
            _ => {}
        }
    }
    for key in [
        "output_token_logprobs",
        "output_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
    ] {
        if let Some(v) = body["meta_info"].get_mut(key) {
            spell(v, tok);
        }
    }
}

fn add_input(chunk: &mut Value, input: &Option<(Value, Value)>, top_wanted: bool) {
    if let Some((lps, tops)) = input {
        chunk["meta_info"]["input_token_logprobs"] = lps.clone();
        if top_wanted {
            chunk["meta_info"]["input_top_logprobs"] = tops.clone();
        }
    }
}

/// SGLang's `output_top_logprobs` entry of one position: `[logprob, id,
/// null]` per alternative, most likely first.
fn top_entry(t: &handoff_engine::request::TokenOut) -> Value {
    t.top
        .iter()
        .map(|&(id, lp)| json!([lp, id, null]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::backend::bounded_integer;

    #[test]
    fn bootstrap_room_bounds() {
        let max = i64::MAX as u64;
        assert_eq!(
            bounded_integer("bootstrap_room", &json!(9223372036854775807u64), max).unwrap(),
            max
        );
        for bad in [
            json!(-1),
            json!(1.5),
            json!("7"),
            json!(9223372036854775808u64),
        ] {
            let e = bounded_integer("bootstrap_room", &bad, max).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains(
                    "bootstrap_room must be an integer between 0 and 9223372036854775807"
                ),
                "{}",
                e.message
            );
        }
    }
}
