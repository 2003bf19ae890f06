//! One request's run through the engine, as the HTTP handlers see it: submit,
//! read events while recording TTFT / inter-token / end-to-end latency, and
//! either collect the whole answer or hand events to an SSE stream. Dropping a
//! [`Generation`] drops the engine's `RequestStream`, which cancels the request.
//! Each generation is registered under its request id for `/abort_request`
//! ([`crate::worker::aborts`]).

use std::sync::Arc;
use std::time::Instant;

use handoff_engine::handle::RequestStream;
use handoff_engine::pd::PrefillTicket;
use handoff_engine::request::{FinishReason, Finished, GenerateRequest, StreamEvent, TokenOut};
use handoff_model::tokenizer::Tokenizer;

use crate::http::errors::ApiError;
use crate::http::metrics::Metrics;
use crate::state::AppState;
use crate::worker::aborts::{aborted_error, AbortWatch};
use crate::worker::backend::{Bootstrap, Submitted};

/// Where a generation's events come from.
#[derive(Debug)]
enum Source {
    /// An engine's token stream (colocated or decode).
    Stream(RequestStream),
    /// A prefill: one event pair once the KV landed at decode — the first
    /// token, then `Finished` with reason `Length` (the prefill's answer is
    /// the first token; the decode worker streams the rest).
    Prefill {
        ticket: Option<PrefillTicket>,
        tokenizer: Arc<Tokenizer>,
        done: Option<Finished>,
        metrics: Arc<Metrics>,
        /// The request's span: its stages become children.
        trace: opentelemetry::Context,
    },
}

impl Source {
    async fn next(&mut self) -> Option<StreamEvent> {
        match self {
            Source::Stream(s) => s.next().await,
            Source::Prefill {
                ticket,
                tokenizer,
                done,
                metrics,
                trace,
            } => {
                if let Some(t) = ticket.take() {
                    return Some(match t.wait().await {
                        Ok(d) => {
                            metrics.observe_prefill(&d.timings);
                            record_prefill_stages(trace, &d.timings);
                            *done = Some(Finished {
                                reason: FinishReason::Length,
                                prompt_tokens: d.prompt_tokens,
                                completion_tokens: 1,
                                cached_tokens: d.cached_tokens,
                            });
                            let text = tokenizer
                                .token_bytes(d.first_token, false)
                                .map(|b| String::from_utf8_lossy(b).into_owned())
                                .unwrap_or_default();
                            StreamEvent::Token(TokenOut {
                                id: d.first_token,
                                logprob: d.logprob,
                                top: d.top,
                                prompt: Vec::new(),
                                text,
                            })
                        }
                        Err(e) => StreamEvent::Error(e),
                    });
                }
                done.take().map(StreamEvent::Finished)
            }
        }
    }
}

/// A submitted request whose events are being read.
#[derive(Debug)]
pub struct Generation {
    stream: Source,
    metrics: Arc<Metrics>,
    endpoint: &'static str,
    arrived: Instant,
    last_token: Option<Instant>,
    ended: bool,
    abort: AbortWatch,
    stall_timeout: Option<std::time::Duration>,
    /// A step read ahead by [`Generation::started`].
    pending: Option<Step>,
    /// Its span (`prefill.request`, `decode.request` or
    /// `colocated.request`), ended with the generation.
    trace: opentelemetry::Context,
    /// Its spans' names, by the worker's role.
    role: SpanNames,
    /// When its first token came.
    first_at: Option<std::time::SystemTime>,
    /// The span was ended.
    trace_ended: bool,
}

/// The names of a worker's spans.
#[derive(Debug, Clone, Copy)]
struct SpanNames {
    request: &'static str,
    /// Arrival to the first token, then first token to the end (`None` for
    /// a prefill, whose stages come from its timings).
    steps: Option<(&'static str, &'static str)>,
}

impl SpanNames {
    /// For a worker of `mode` (`prefill`, `decode`, SGLang's `null`).
    fn of(mode: &str) -> Self {
        match mode {
            "prefill" => SpanNames {
                request: "prefill.request",
                steps: None,
            },
            "decode" => SpanNames {
                request: "decode.request",
                steps: Some(("decode.first_token", "decode.generate")),
            },
            _ => SpanNames {
                request: "colocated.request",
                steps: Some(("colocated.first_token", "colocated.generate")),
            },
        }
    }
}

/// The prefill's stages, back to back and ending now, as child spans.
fn record_prefill_stages(trace: &opentelemetry::Context, t: &handoff_engine::pd::PrefillTimings) {
    let end = std::time::SystemTime::now();
    let mut at = end - (t.wait_destination + t.compute + t.transfer_tail);
    for (name, d) in [
        ("prefill.wait_destination", t.wait_destination),
        ("prefill.compute", t.compute),
        ("prefill.transfer_tail", t.transfer_tail),
    ] {
        crate::http::otel::record(trace, name, at, at + d, Vec::new());
        at += d;
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.trace_ended {
            crate::http::otel::end(
                &self.trace,
                vec![opentelemetry::KeyValue::new("outcome", "cancelled")],
            );
        }
    }
}

/// What a whole (non-streamed) generation produced.
#[derive(Debug, Clone)]
pub struct Collected {
    /// Every token, in order.
    pub tokens: Vec<TokenOut>,
    /// The output text (concatenated token texts).
    pub text: String,
    /// How it ended.
    pub finished: Finished,
}

/// One step of a generation as the handlers consume it.
#[derive(Debug)]
pub enum Step {
    /// A token.
    Token(TokenOut),
    /// The normal end.
    Finished(Finished),
    /// A failure; nothing follows.
    Error(ApiError),
}

impl Generation {
    /// Validate and submit `req` (with its PD fields `pd`) under the request
    /// id `rid`; errors are the engine's, as HTTP errors.
    pub async fn submit(
        state: &AppState,
        req: GenerateRequest,
        endpoint: &'static str,
        pd: &Bootstrap,
        rid: &str,
    ) -> Result<Generation, ApiError> {
        // Registered before submission: an abort that arrives while the
        // request is being admitted still reaches it.
        let abort = state.aborts.register(rid);
        let arrived = req.arrived;
        let role = SpanNames::of(state.engine.mode());
        let trace = crate::http::otel::start(
            &crate::http::otel::parent_of(pd.handover.traceparent.as_deref()),
            role.request,
            opentelemetry::trace::SpanKind::Server,
            crate::http::otel::wall(arrived),
            vec![
                opentelemetry::KeyValue::new("request_id", rid.to_string()),
                opentelemetry::KeyValue::new("endpoint", endpoint),
                opentelemetry::KeyValue::new("prompt_tokens", req.prompt_ids.len() as i64),
                opentelemetry::KeyValue::new("local_prefill", pd.handover.local),
                opentelemetry::KeyValue::new("resumed_tokens", pd.handover.resume.len() as i64),
            ],
        );
        let stream = match state.engine.submit(req, pd).await {
            Ok(Submitted::Stream(s)) => Source::Stream(s),
            Ok(Submitted::Prefill(ticket)) => Source::Prefill {
                ticket: Some(ticket),
                tokenizer: state.engine.tokenizer().clone(),
                done: None,
                metrics: state.metrics.clone(),
                trace: trace.clone(),
            },
            Err(e) => {
                state.metrics.count_error(endpoint, e.code);
                crate::http::otel::end(
                    &trace,
                    vec![opentelemetry::KeyValue::new("error", e.code.to_string())],
                );
                return Err(e.for_endpoint(endpoint));
            }
        };
        Ok(Generation {
            stream,
            metrics: state.metrics.clone(),
            endpoint,
            arrived,
            last_token: None,
            ended: false,
            abort,
            stall_timeout: state.stall_timeout,
            pending: None,
            trace,
            role,
            first_at: None,
            trace_ended: false,
        })
    }

    /// When the request arrived.
    pub fn arrived(&self) -> Instant {
        self.arrived
    }

    fn end_trace(&mut self, attrs: Vec<opentelemetry::KeyValue>) {
        if !std::mem::replace(&mut self.trace_ended, true) {
            crate::http::otel::end(&self.trace, attrs);
        }
    }

    /// The next step, or `None` once a `Finished`/`Error` step was returned.
    pub async fn next(&mut self) -> Option<Step> {
        if let Some(step) = self.pending.take() {
            return Some(step);
        }
        if self.ended {
            return None;
        }
        let event = tokio::select! {
            biased;
            () = self.abort.aborted() => {
                self.ended = true;
                let e = aborted_error(self.abort.rid());
                self.metrics.count_error(self.endpoint, e.code);
                return Some(Step::Error(e));
            }
            event = next_within(&mut self.stream, self.stall_timeout) => match event {
                Some(e) => e,
                None => {
                    self.ended = true;
                    self.metrics.count_stalled();
                    let e = stalled_error(self.stall_timeout.unwrap_or_default());
                    self.metrics.count_error(self.endpoint, e.code);
                    tracing::warn!(rid = self.abort.rid(), "{}", e.message);
                    return Some(Step::Error(e));
                }
            },
        };
        let step = match event {
            Some(StreamEvent::Token(t)) => {
                let now = Instant::now();
                match self.last_token {
                    None => self
                        .metrics
                        .observe_ttft(now.duration_since(self.arrived).as_secs_f64()),
                    Some(prev) => self
                        .metrics
                        .observe_itl(now.duration_since(prev).as_secs_f64()),
                }
                self.last_token = Some(now);
                self.metrics.count_generated();
                if let (None, Some((name, _))) = (self.first_at, self.role.steps) {
                    let wall = std::time::SystemTime::now();
                    crate::http::otel::record(
                        &self.trace,
                        name,
                        crate::http::otel::wall(self.arrived),
                        wall,
                        Vec::new(),
                    );
                    self.first_at = Some(wall);
                }
                Step::Token(t)
            }
            Some(StreamEvent::Finished(f)) => {
                self.metrics.observe_finished(
                    self.arrived.elapsed().as_secs_f64(),
                    f.prompt_tokens,
                    f.cached_tokens,
                );
                self.ended = true;
                if let (Some(first), Some((_, name))) = (self.first_at, self.role.steps) {
                    crate::http::otel::record(
                        &self.trace,
                        name,
                        first,
                        std::time::SystemTime::now(),
                        Vec::new(),
                    );
                }
                self.end_trace(vec![
                    opentelemetry::KeyValue::new("completion_tokens", f.completion_tokens as i64),
                    opentelemetry::KeyValue::new("finish_reason", f.reason.openai()),
                ]);
                Step::Finished(f)
            }
            Some(StreamEvent::Error(e)) => {
                self.metrics.count_error(self.endpoint, e.error_type());
                self.ended = true;
                self.end_trace(vec![opentelemetry::KeyValue::new(
                    "error",
                    e.error_type().to_string(),
                )]);
                // A refusal relayed from the PD peer names the field as the
                // engine does (`prompt`): name it as this endpoint does.
                Step::Error(ApiError::from(e).for_endpoint(self.endpoint))
            }
            None => {
                self.ended = true;
                let e = ApiError::new(
                    500,
                    "engine_dropped_request",
                    "the engine ended the request without a result",
                );
                self.metrics.count_error(self.endpoint, e.code);
                Step::Error(e)
            }
        };
        Some(step)
    }

    /// Wait for the first step (the first token: the prompt's KV is then
    /// computed, and in the prefix cache) without consuming it; the error
    /// when that step is one.
    pub async fn started(&mut self) -> Result<(), ApiError> {
        if self.pending.is_none() {
            self.pending = self.next().await;
        }
        match &self.pending {
            Some(Step::Error(e)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Read every event and return the whole answer.
    pub async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut tokens = Vec::new();
        let mut text = String::new();
        while let Some(step) = self.next().await {
            match step {
                Step::Token(t) => {
                    text.push_str(&t.text);
                    tokens.push(t);
                }
                Step::Finished(finished) => {
                    return Ok(Collected {
                        tokens,
                        text,
                        finished,
                    })
                }
                Step::Error(e) => return Err(e),
            }
        }
        Err(ApiError::new(
            500,
            "engine_dropped_request",
            "the engine ended the request without a result",
        ))
    }
}

/// The source's next event, or `None` if none came within `stall`.
async fn next_within(
    source: &mut Source,
    stall: Option<std::time::Duration>,
) -> Option<Option<StreamEvent>> {
    match stall {
        Some(t) => tokio::time::timeout(t, source.next()).await.ok(),
        None => Some(source.next().await),
    }
}

/// The error a generation ends with when the stall watchdog fires: the
/// error event's `type` is `stalled`, so monitoring sees it.
fn stalled_error(after: std::time::Duration) -> ApiError {
    ApiError::stalled(format!(
        "no token came for {:.1} s: the request was ended and its KV pages freed",
        after.as_secs_f64()
    ))
}

/// SGLang's `finish_reason` object: `{"type":"stop","matched":...}` or
/// `{"type":"length","length":N}`.
pub fn sglang_finish_reason(reason: &FinishReason, completion_tokens: usize) -> serde_json::Value {
    match reason {
        FinishReason::Eos { token } => serde_json::json!({"type": "stop", "matched": token}),
        FinishReason::StopString { matched } => {
            serde_json::json!({"type": "stop", "matched": matched})
        }
        FinishReason::Length => serde_json::json!({"type": "length", "length": completion_tokens}),
        FinishReason::GrammarComplete => serde_json::json!({"type": "stop", "matched": null}),
    }
}
