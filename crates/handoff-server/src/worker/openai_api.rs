//! `POST /v1/chat/completions` and `POST /v1/completions`: OpenAI's shapes,
//! whole or streamed as SSE chunks ending with `data: [DONE]`.

use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use handoff_engine::request::{Finished, GenerateRequest, TokenOut};
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::http::extract::JsonBody;
use crate::http::sse::{sse_response_marked, SseSender};
use crate::state::AppState;
use crate::worker::backend::Bootstrap;
use crate::worker::generation::{Generation, Step};
use crate::worker::openai_types::{ChatCompletionRequest, CompletionRequest};
use crate::worker::prompt;

const CHAT_ENDPOINT: &str = "/v1/chat/completions";

/// Output limit of a chat request that gives none. The engine reserves KV
/// pages for the whole limit up front, so "until the context is full" would
/// let one request hold the pool; the limit is also capped by the context and
/// the pool size.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 1024;
const COMPLETIONS_ENDPOINT: &str = "/v1/completions";

/// The usage of sequences whose every `n` in a row answer one prompt:
/// each prompt counted once, every sequence's output.
fn usage_of(finished: &[&Finished], n: usize) -> Value {
    let firsts = finished.iter().step_by(n.max(1));
    let prompt: usize = firsts.clone().map(|f| f.prompt_tokens).sum();
    let cached: usize = firsts.map(|f| f.cached_tokens).sum();
    let completion: usize = finished.iter().map(|f| f.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

/// What differs between the two endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Everything needed to answer after submission.
#[derive(Debug, Clone)]
struct Answer {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    /// Alternatives per position with `logprobs` (0: none).
    top_logprobs: usize,
    /// Completions `echo`: each prompt's ids, returned (as text, and scored
    /// with `logprobs`) ahead of its completions.
    echo: Option<Vec<Vec<u32>>>,
    /// Choices per prompt (choice `i` answers prompt `i / n`).
    n: usize,
    include_usage: bool,
    system_fingerprint: String,
    /// Chat with tools: calls are parsed out of the output.
    tools: Option<crate::worker::tools::Tools>,
}

/// A chat answer's content and tool calls, as the output splits into them.
fn split_calls(tools: &crate::worker::tools::Tools, text: &str) -> (String, Vec<Value>) {
    let mut parser = crate::worker::tools::Parser::new(tools);
    let mut pieces = parser.push(text);
    pieces.extend(parser.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            crate::worker::tools::Piece::Text(t) => content.push_str(&t),
            crate::worker::tools::Piece::Call(c) => calls.push(call_json(&c, None)),
        }
    }
    (content, calls)
}

/// A tool call as `tool_calls` holds it (with `index` in a stream delta).
fn call_json(c: &crate::worker::tools::Call, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": crate::worker::tools::call_id(),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// The `finish_reason` of an answer that made `calls` tool calls.
fn finish_with_calls(f: &Finished, calls: usize) -> &'static str {
    if calls > 0 && f.reason != handoff_engine::FinishReason::Length {
        "tool_calls"
    } else {
        f.reason.openai()
    }
}

impl Answer {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        })
    }

    /// The prompt choice `index` echoes, with `echo`.
    fn echoed(&self, index: usize) -> Option<&Vec<u32>> {
        self.echo
            .as_ref()
            .and_then(|e| e.get(index / self.n.max(1)))
    }

    /// The echoed prompt's text of choice `index` (empty without `echo`).
    fn echo_text(&self, state: &AppState, index: usize) -> String {
        match self.echoed(index) {
            Some(ids) => state
                .engine
                .tokenizer()
                .decode(ids, true)
                .unwrap_or_default(),
            None => String::new(),
        }
    }

    /// The `logprobs` object of `tokens`, whose first token starts at
    /// character `offset` of the answer's text; with the offset after them.
    /// With `echo`, the first token brings the prompt's scores: the prompt's
    /// tokens come first (the first one with a null logprob).
    fn logprobs_of(
        &self,
        state: &AppState,
        tokens: &[TokenOut],
        offset: usize,
        index: usize,
    ) -> (Value, usize) {
        if !self.logprobs {
            return (Value::Null, offset);
        }
        let echoed: Vec<TokenOut>;
        let tokens = match (self.echoed(index), tokens.first()) {
            (Some(ids), Some(first)) if !first.prompt.is_empty() || ids.len() == 1 => {
                let mut all = Vec::with_capacity(ids.len() + tokens.len());
                all.push(TokenOut {
                    id: ids[0],
                    logprob: f32::NAN,
                    top: Vec::new(),
                    prompt: Vec::new(),
                    text: String::new(),
                });
                all.extend(first.prompt.iter().map(|p| TokenOut {
                    id: p.id,
                    logprob: p.logprob,
                    top: p.top.clone(),
                    prompt: Vec::new(),
                    text: String::new(),
                }));
                all.extend(tokens.iter().cloned());
                echoed = all;
                &echoed[..]
            }
            _ => tokens,
        };
        let tok = state.engine.tokenizer();
        let piece = |id: u32| -> (String, Vec<u8>) {
            let bytes = tok
                .token_bytes(id, false)
                .map(<[u8]>::to_vec)
                .unwrap_or_default();
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        let mut offsets = Vec::with_capacity(tokens.len());
        let mut at = offset;
        for t in tokens {
            offsets.push(at);
            at += piece(t.id).0.chars().count();
        }
        let v = match self.kind {
            Kind::Chat => json!({
                "content": tokens.iter().map(|t| {
                    let (text, bytes) = piece(t.id);
                    let top: Vec<Value> = t.top.iter().map(|&(id, lp)| {
                        let (text, bytes) = piece(id);
                        json!({"token": text, "logprob": lp, "bytes": bytes})
                    }).collect();
                    json!({"token": text, "logprob": t.logprob, "bytes": bytes, "top_logprobs": top})
                }).collect::<Vec<_>>()
            }),
            Kind::Completion => json!({
                "tokens": tokens.iter().map(|t| piece(t.id).0).collect::<Vec<_>>(),
                // The echoed prompt's first token has no logprob (null).
                "token_logprobs": tokens.iter().map(|t| (!t.logprob.is_nan()).then_some(t.logprob)).collect::<Vec<_>>(),
                // One object per position, token text to logprob (a text
                // two alternatives share keeps the likelier, as OpenAI's).
                "top_logprobs": if self.top_logprobs == 0 {
                    Value::Null
                } else {
                    tokens.iter().map(|t| {
                        if t.logprob.is_nan() {
                            return Value::Null;
                        }
                        let mut m = serde_json::Map::new();
                        for &(id, lp) in &t.top {
                            m.entry(piece(id).0).or_insert(json!(lp));
                        }
                        Value::Object(m)
                    }).collect()
                },
                "text_offset": offsets,
            }),
        };
        (v, at)
    }

    /// The whole answer: one choice per sequence, in order.
    fn whole(&self, state: &AppState, all: Vec<crate::worker::generation::Collected>) -> Value {
        let choices: Vec<Value> = all
            .iter()
            .enumerate()
            .map(|(index, c)| self.whole_choice(state, c, index))
            .collect();
        let mut body = self.envelope(false, json!(choices));
        let finished: Vec<&Finished> = all.iter().map(|c| &c.finished).collect();
        body["usage"] = usage_of(&finished, self.n);
        body
    }

    fn whole_choice(
        &self,
        state: &AppState,
        c: &crate::worker::generation::Collected,
        index: usize,
    ) -> Value {
        let finish = c.finished.reason.openai();
        let (logprobs, _) = self.logprobs_of(state, &c.tokens, 0, index);
        match (self.kind, &self.tools) {
            (Kind::Chat, Some(tools)) => {
                let (content, calls) = split_calls(tools, &c.text);
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    if content.trim().is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = json!(calls);
                }
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_with_calls(&c.finished, calls.len()),
                })
            }
            (Kind::Chat, None) => json!({
                "index": index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            (Kind::Completion, _) => json!({
                "index": index,
                "text": self.echo_text(state, index) + &c.text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        }
    }

    fn token_chunk(&self, state: &AppState, t: &TokenOut, c: &mut ChoiceStream) -> Value {
        let (logprobs, next) = self.logprobs_of(state, std::slice::from_ref(t), c.offset, c.index);
        c.offset = next;
        let first = std::mem::take(&mut c.first);
        let choice = match self.kind {
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": t.text})
                } else {
                    json!({"content": t.text})
                };
                json!({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": null})
            }
            Kind::Completion => {
                // The echoed prompt rides on the first chunk.
                let text = if first {
                    self.echo_text(state, c.index) + &t.text
                } else {
                    t.text.clone()
                };
                json!({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": null})
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// A chat chunk of choice `index` whose delta is `delta`.
    fn delta_chunk(&self, index: usize, delta: Value, logprobs: Value) -> Value {
        self.envelope(
            true,
            json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null}]),
        )
    }

    fn final_chunk(&self, f: &Finished, c: &ChoiceStream) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": c.index, "delta": {}, "logprobs": null, "finish_reason": finish_with_calls(f, c.calls)})
            }
            Kind::Completion => {
                json!({"index": c.index, "text": "", "logprobs": null, "finish_reason": f.reason.openai()})
            }
        };
        self.envelope(true, json!([choice]))
    }

    fn usage_chunk(&self, finished: &[&Finished]) -> Value {
        let mut body = self.envelope(true, json!([]));
        body["usage"] = usage_of(finished, self.n);
        body
    }

    /// Stream every sequence's chunks as they come, each under its choice's
    /// index; `[DONE]` once all finished.
    /// A continued stream (`resumed`: the output ids another decode worker
    /// streamed; one choice) starts where that one stopped: no role or
    /// echo again, text offsets after the tokens already sent.
    async fn stream(
        self,
        state: AppState,
        gens: Vec<Generation>,
        resumed: Vec<u32>,
        tx: SseSender,
    ) -> Result<(), crate::http::sse::Disconnected> {
        let offset = if resumed.is_empty() {
            0
        } else {
            let sent: Vec<TokenOut> = resumed
                .iter()
                .map(|&id| TokenOut {
                    id,
                    logprob: 0.0,
                    top: Vec::new(),
                    prompt: Vec::new(),
                    text: String::new(),
                })
                .collect();
            self.logprobs_of(&state, &sent, 0, 0).1
        };
        let mut choices: Vec<ChoiceStream> = (0..gens.len())
            .map(|index| ChoiceStream {
                index,
                first: resumed.is_empty(),
                offset,
                // Chat with tools: text streams as content except what may
                // still become a call; each call comes whole in a
                // `tool_calls` delta.
                parser: self.tools.as_ref().map(crate::worker::tools::Parser::new),
                calls: 0,
                finished: None,
            })
            .collect();
        let mut steps = crate::worker::choices::merged(gens);
        while let Some((i, step)) = tx.race(steps.next()).await? {
            let c = &mut choices[i];
            match step {
                Step::Token(t) => {
                    tx.note_token(t.id);
                    if let Some(p) = c.parser.as_mut() {
                        let pieces = p.push(&t.text);
                        let (logprobs, next) =
                            self.logprobs_of(&state, std::slice::from_ref(&t), c.offset, c.index);
                        c.offset = next;
                        self.send_pieces(&tx, pieces, logprobs, c).await?;
                        continue;
                    }
                    if t.text.is_empty() && !self.logprobs && !c.first {
                        continue;
                    }
                    tx.json(&self.token_chunk(&state, &t, c)).await?;
                }
                Step::Finished(f) => {
                    if let Some(p) = c.parser.as_mut() {
                        let rest = p.finish();
                        self.send_pieces(&tx, rest, Value::Null, c).await?;
                    }
                    tx.note_end();
                    tx.json(&self.final_chunk(&f, c)).await?;
                    c.finished = Some(f);
                }
                Step::Error(e) => return tx.error(&e).await,
            }
        }
        if self.include_usage {
            let finished: Vec<&Finished> =
                choices.iter().filter_map(|c| c.finished.as_ref()).collect();
            tx.json(&self.usage_chunk(&finished)).await?;
        }
        tx.done().await
    }

    /// Send a token's pieces (content and whole calls) as chat deltas; its
    /// `logprobs` ride on the first chunk, or on an empty one when the token
    /// added nothing yet.
    async fn send_pieces(
        &self,
        tx: &SseSender,
        pieces: Vec<crate::worker::tools::Piece>,
        mut logprobs: Value,
        c: &mut ChoiceStream,
    ) -> Result<(), crate::http::sse::Disconnected> {
        let role = |first: &mut bool, mut delta: Value| {
            if std::mem::take(first) {
                delta["role"] = json!("assistant");
            }
            delta
        };
        if pieces.is_empty() && (!logprobs.is_null() || c.first) {
            let delta = role(&mut c.first, json!({"content": ""}));
            return tx.json(&self.delta_chunk(c.index, delta, logprobs)).await;
        }
        for p in pieces {
            let delta = match p {
                crate::worker::tools::Piece::Text(t) => json!({"content": t}),
                crate::worker::tools::Piece::Call(call) => {
                    c.calls += 1;
                    json!({"tool_calls": [call_json(&call, Some(c.calls - 1))]})
                }
            };
            let delta = role(&mut c.first, delta);
            tx.json(&self.delta_chunk(c.index, delta, std::mem::take(&mut logprobs)))
                .await?;
        }
        Ok(())
    }
}

/// Where one choice's stream stands.
struct ChoiceStream {
    index: usize,
    /// No chunk sent yet (the first carries the role, or the echo).
    first: bool,
    /// Text offset of the next token (completions logprobs).
    offset: usize,
    parser: Option<crate::worker::tools::Parser>,
    /// Tool calls sent.
    calls: usize,
    finished: Option<Finished>,
}

/// What a handler prepared before submitting.
struct Prepared {
    answer: Answer,
    /// One request per prompt.
    reqs: Vec<GenerateRequest>,
    stream: bool,
    /// Choices returned.
    n: usize,
    /// Sequences run (`best_of`, at least `n`).
    runs: usize,
}

async fn run(
    state: AppState,
    pd: Bootstrap,
    prepared: Result<Prepared, ApiError>,
    endpoint: &'static str,
) -> Result<Response, ApiError> {
    let Prepared {
        answer,
        reqs,
        stream,
        n,
        runs,
    } = match prepared {
        Ok(p) => p,
        Err(e) => {
            // Refused before the engine saw it: the PD peer learns now.
            state.engine.reject(&pd, &e).await;
            return Err(e);
        }
    };
    let resumed = pd.handover.resume.clone();
    if !resumed.is_empty() {
        let why = if !stream {
            Some("it continues a stream: send stream true")
        } else if runs > 1 || reqs.len() > 1 {
            Some("a continued stream has one choice: n, best_of and prompt lists must be 1")
        } else if answer.tools.is_some() {
            Some("a stream with tools is not continued (its tool-call parser state is not carried)")
        } else if answer.echo.is_some() {
            Some("a stream with echo is not continued")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(ApiError::invalid_param(
                "resume_output_ids",
                format!("resume_output_ids: {why}"),
            ));
        }
    }
    let per_prompt =
        crate::worker::choices::submit_prompts(&state, reqs, runs, endpoint, &pd, &answer.id)
            .await?;
    if stream {
        let gens = per_prompt.into_iter().flatten().collect();
        return Ok(sse_response_marked(pd.handover.marks, move |tx| {
            answer.stream(state, gens, resumed, tx)
        }));
    }
    let mut all = Vec::new();
    for gens in per_prompt {
        let mut answers = crate::worker::choices::collect(gens).await?;
        if runs > n {
            answers = crate::worker::choices::best(answers, n);
        }
        all.extend(answers);
    }
    Ok(Json(answer.whole(&state, all)).into_response())
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(req): JsonBody<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut pd = req.pd.bootstrap()?;
    pd.handover.from_headers(&headers, req.priority.as_ref())?;
    state.check_bootstrap(&mut pd)?;
    let st = state.clone();
    let prepared = prompt::off_runtime(move || prepare_chat(&st, req, arrived)).await;
    run(state, pd, prepared, CHAT_ENDPOINT).await
}

fn prepare_chat(
    state: &AppState,
    mut req: ChatCompletionRequest,
    arrived: Instant,
) -> Result<Prepared, ApiError> {
    let tools = crate::worker::tools::Tools::take(&mut req.extra)?;
    let mut grammar = crate::worker::structured::take(
        crate::worker::fields::Endpoint::Chat,
        &mut req.extra,
        &state.grammars,
    )?;
    // `required` or a named function: the output is calls whose arguments
    // follow the functions' schemas.
    if let Some(spec) = tools
        .as_ref()
        .and_then(crate::worker::tools::Tools::grammar)
    {
        if grammar.is_some() {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice asks for a tool call, which cannot be combined with another output constraint (response_format, json_schema, regex, ebnf, guided_*)",
            ));
        }
        grammar = Some(state.grammars.compile(spec).map_err(|e| {
            ApiError::invalid_param(
                "tools",
                format!("the tools' parameters cannot be used: {e}"),
            )
        })?);
    }
    crate::worker::fields::check(crate::worker::fields::Endpoint::Chat, &req.extra)?;
    let (n, runs) = crate::worker::choices::count(req.n, "n", None, 1)?;
    let top_logprobs = crate::worker::params::top_logprobs("top_logprobs", req.top_logprobs)?;
    if top_logprobs > 0 && req.logprobs != Some(true) {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let prompt_ids = prompt::chat_prompt(&state.engine, &req.messages, tools.as_ref())?;
    let info = state.engine.model();
    let pool_tokens = state.engine.load().pages_total * info.page_size;
    let default_max = DEFAULT_CHAT_MAX_TOKENS
        .min(info.context_length.saturating_sub(prompt_ids.len()))
        .min(pool_tokens.saturating_sub(prompt_ids.len()));
    let mut sampling = req.sampling()?.into_params(
        default_max,
        &crate::worker::params::Defaults::of_backend(&state.engine),
    )?;
    sampling.top_logprobs = top_logprobs;
    sampling.grammar = grammar;
    crate::worker::params::check_token_ids(&sampling, info.vocab_size)?;
    let answer = Answer {
        kind: Kind::Chat,
        id: crate::worker::request_ids::request_id(req.rid.as_ref(), "chatcmpl")?,
        created: crate::worker::request_ids::unix_now(),
        model: state.served_name(),
        system_fingerprint: state.system_fingerprint.clone(),
        logprobs: req.logprobs.unwrap_or(false),
        top_logprobs,
        echo: None,
        n,
        tools,
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    };
    Ok(Prepared {
        answer,
        reqs: vec![GenerateRequest {
            prompt_ids,
            sampling,
            arrived,
            output_so_far: Vec::new(),
            class: Default::default(),
        }],
        stream: req.stream.unwrap_or(false),
        n,
        runs,
    })
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut pd = req.pd.bootstrap()?;
    pd.handover.from_headers(&headers, req.priority.as_ref())?;
    state.check_bootstrap(&mut pd)?;
    let st = state.clone();
    let prepared = prompt::off_runtime(move || prepare_completion(&st, req, arrived)).await;
    run(state, pd, prepared, COMPLETIONS_ENDPOINT).await
}

fn prepare_completion(
    state: &AppState,
    mut req: CompletionRequest,
    arrived: Instant,
) -> Result<Prepared, ApiError> {
    let grammar = crate::worker::structured::take(
        crate::worker::fields::Endpoint::Completions,
        &mut req.extra,
        &state.grammars,
    )?;
    crate::worker::fields::check(crate::worker::fields::Endpoint::Completions, &req.extra)?;
    let prompts = prompt::completion_prompts(&state.engine, req.prompt.clone())?;
    let (n, runs) = crate::worker::choices::count(req.n, "n", req.best_of, prompts.len())?;
    if runs > n && req.stream == Some(true) {
        return Err(ApiError::invalid_param(
            "best_of",
            "best_of picks among whole answers: it cannot be streamed",
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    // `logprobs: N`: the chosen tokens' log-probabilities and the N most
    // likely at each position.
    let logprobs = req.logprobs.is_some();
    let top_logprobs = crate::worker::params::top_logprobs("logprobs", req.logprobs)?;
    let echo = req.echo == Some(true);
    let mut sampling = req.sampling()?.into_params(
        16,
        &crate::worker::params::Defaults::of_backend(&state.engine),
    )?;
    sampling.top_logprobs = top_logprobs;
    sampling.grammar = grammar;
    // Echo with logprobs scores the prompt too.
    sampling.prompt_logprobs = echo && logprobs;
    crate::worker::params::check_token_ids(&sampling, state.engine.model().vocab_size)?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let answer = Answer {
        kind: Kind::Completion,
        id: crate::worker::request_ids::request_id(req.rid.as_ref(), "cmpl")?,
        created: crate::worker::request_ids::unix_now(),
        model: state.served_name(),
        system_fingerprint: state.system_fingerprint.clone(),
        logprobs,
        top_logprobs,
        echo: echo.then(|| prompts.clone()),
        n,
        tools: None,
        include_usage,
    };
    Ok(Prepared {
        answer,
        reqs: crate::worker::choices::requests(prompts, &sampling, arrived),
        stream,
        n,
        runs,
    })
}
