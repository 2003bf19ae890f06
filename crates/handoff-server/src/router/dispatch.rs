//! The generation routes of the router: read and
//! check the body, pick a pair, give the attempt a fresh room, relay it, and
//! retry — with a fresh room and, where possible, other workers — only when
//! nothing reached the client and the failure says the workers could not take
//! the request (connection error, 502, 503).

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::http::errors::ApiError;
use crate::router::admission;
use crate::router::prefix_index::prompt_blocks;
use crate::router::relay::{
    self, local_body, relay_headers, AttemptGuards, AttemptSpec, Failure, Migration, Pair,
    RelayBody, RelayLimits,
};
use crate::router::timeline::Timeline;
use crate::router::workers::Worker;
use crate::router::RouterState;
use handoff_proto::Role;

/// `POST /generate`.
pub async fn generate(State(state): State<RouterState>, req: Request) -> Response {
    handle(state, "/generate", req).await
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<RouterState>, req: Request) -> Response {
    handle(state, "/v1/completions", req).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<RouterState>, req: Request) -> Response {
    handle(state, "/v1/chat/completions", req).await
}

/// Parse a request body that must be one JSON object.
pub fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "invalid_json",
            "the request body is empty: send a JSON object",
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    let what = match value {
        Value::Object(map) => return Ok(map),
        Value::Array(_) => "an array",
        Value::String(_) => "a string",
        Value::Number(_) => "a number",
        Value::Bool(_) => "a boolean",
        Value::Null => "null",
    };
    Err(ApiError::bad_request(
        "invalid_type",
        format!("the request body must be a JSON object, not {what}"),
    ))
}

async fn handle(state: RouterState, route: &'static str, req: Request) -> Response {
    let arrived = Instant::now();
    let mut tl = Timeline::new(Arc::clone(&state.metrics), route, arrived);
    if let Err(e) = crate::http::extract::check_json_content_type(req.headers()) {
        return refuse(&mut tl, e, "bad_request");
    }
    let headers = req.headers().clone();
    tl.set_trace(crate::http::otel::start(
        &crate::http::otel::extract(&headers),
        "router.request",
        opentelemetry::trace::SpanKind::Server,
        crate::http::otel::wall(arrived),
        vec![opentelemetry::KeyValue::new("http.route", route)],
    ));
    let bytes = match crate::http::extract::read_body(req, &()).await {
        Ok(b) => b,
        Err(err) => return refuse(&mut tl, err, "bad_request"),
    };
    let mut body = match parse_object(&bytes) {
        Ok(b) => b,
        Err(e) => return refuse(&mut tl, e, "bad_request"),
    };
    if !body.contains_key("rid") {
        // One id for both workers: the answer's id, and what
        // `/abort_request` takes to end the request on both sides.
        let prefix = match route {
            "/generate" => "gen",
            "/v1/completions" => "cmpl",
            _ => "chatcmpl",
        };
        body.insert(
            "rid".into(),
            json!(crate::worker::request_ids::new_request_id(prefix)),
        );
    }
    let slo = match admission::slo_of(&mut body, &headers, state.config.default_slo_ttft) {
        Ok(s) => s,
        Err(e) => return refuse(&mut tl, e, "bad_request"),
    };
    // The priority against the key's limit; the tenant goes to the workers
    // (the router's key lets it name one), which order their queues by both.
    let class = match crate::http::tenancy::parse_priority(body.get("priority"))
        .and_then(|p| crate::http::tenancy::class_of(p, &headers))
    {
        Ok(c) => c,
        Err(e) => return refuse(&mut tl, e, "bad_request"),
    };
    let tenant = class.tenant.as_deref();
    if class.priority != 0 {
        body.insert("priority".into(), json!(class.priority));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    tl.set_stream(stream);
    // A stream the router can continue elsewhere if its decode dies: each
    // event then names the tokens it carries (`stream_marks`).
    let migratable = stream && state.config.migration_limit > 0 && migratable(route, &body);
    if migratable {
        body.insert("stream_marks".into(), json!(true));
    }
    let timeout = state.config.request_timeout;
    let deadline = arrived + timeout;
    let mut failed: Vec<Arc<Worker>> = Vec::new();
    let mut last: Option<Failure> = None;
    let blocks = prompt_blocks(&body);
    for attempt in 0..=state.config.max_retries {
        // With no worker of a role now (a retry too: nothing reached the
        // client yet), wait for one to come back or register, up to the
        // queue timeout (and the request's deadline).
        let queued_at = std::time::SystemTime::now();
        let picked = state.wait_for_pair(&failed, &blocks, deadline).await;
        crate::http::otel::record(
            tl.trace(),
            "router.queue",
            queued_at,
            std::time::SystemTime::now(),
            vec![opentelemetry::KeyValue::new("attempt", i64::from(attempt))],
        );
        let mut pair = match picked {
            Ok(p) => p,
            Err(_) if last.is_some() => return fail(&mut tl, last.take().expect("checked")),
            Err(role) => {
                let err = ApiError::new(
                    503,
                    "no_healthy_worker",
                    format!("no healthy {} worker is available", role.name()),
                );
                let mut resp = refuse(&mut tl, err, "no_healthy_worker");
                resp.headers_mut().insert(
                    axum::http::header::RETRY_AFTER,
                    axum::http::HeaderValue::from_static("1"),
                );
                return resp;
            }
        };
        if attempt > 0 {
            state.metrics.count_retry(route);
        }
        let tokens = prompt_tokens(route, &body);
        // The part of the prompt the decode worker likely lacks: its share of
        // the prompt's blocks the router never sent there.
        let uncached = tokens.map(|n| uncached_tokens(n, pair.decode_matched, blocks.len()));
        let short = uncached.is_some_and(|n| n < state.config.local_prefill_below);
        let cached = short && tokens.is_some_and(|n| n >= state.config.local_prefill_below);
        // The prefill's queue predicted to hold the prompt up past the limit.
        let busy = |p: &Arc<Worker>| {
            let queued = p.queued_tokens().load(std::sync::atomic::Ordering::Relaxed);
            state
                .config
                .local_prefill_wait
                .zip(state.predictor.predict(queued, 0))
                .is_some_and(|(limit, wait)| wait > limit)
        };
        let local = if cached {
            Some("cached_prompt")
        } else if short {
            Some("short_prompt")
        } else if pair.prefill.as_ref().is_some_and(busy) {
            Some("prefill_busy")
        } else {
            None
        };
        if let Some(why) = local {
            if pair.prefill.take().is_some() {
                // Cheaper prefilled where it is decoded than moved (or
                // than queued behind the prefill's backlog).
                state.metrics.count_local_prefill(route, why);
            }
        }
        // The worker that will prefill it, and the queue it joins there.
        let prefiller = Arc::clone(pair.prefill.as_ref().unwrap_or(&pair.decode));
        let own = tokens.unwrap_or(0) as u64;
        if let (0, Some(slo)) = (attempt, slo) {
            let queued = prefiller
                .queued_tokens()
                .load(std::sync::atomic::Ordering::Relaxed);
            if let Some(predicted) = state.predictor.predict(queued, own).filter(|p| *p > slo) {
                let now = std::time::SystemTime::now();
                crate::http::otel::record(
                    tl.trace(),
                    "router.shed",
                    now,
                    now,
                    vec![
                        opentelemetry::KeyValue::new(
                            "predicted_ttft_ms",
                            predicted.as_millis() as i64,
                        ),
                        opentelemetry::KeyValue::new("slo_ttft_ms", slo.as_millis() as i64),
                    ],
                );
                let mut resp = refuse(&mut tl, admission::shed(predicted, slo), "shed");
                let secs = admission::retry_after(predicted, slo).to_string();
                if let Ok(v) = axum::http::HeaderValue::from_str(&secs) {
                    resp.headers_mut()
                        .insert(axum::http::header::RETRY_AFTER, v);
                }
                return resp;
            }
        }
        tl.set_ticket(admission::Ticket::queue(
            Arc::clone(&state.predictor),
            prefiller,
            own,
        ));
        let guards = AttemptGuards {
            room: state.rooms.allocate(),
            prefill: pair.prefill.as_ref().map(Worker::start_request),
            decode: pair.decode.start_request(),
        };
        let room = guards.room.id();
        match &pair.prefill {
            Some(prefill) => {
                body.remove("local_prefill");
                body.insert("bootstrap_host".into(), json!(prefill.host));
                body.insert("bootstrap_port".into(), json!(prefill.bootstrap_port));
                body.insert("bootstrap_room".into(), json!(room.get()));
                sign_bootstrap(&state, &mut body, room.get(), prefill);
            }
            None => {
                // A short prompt, a busy prefill, or no prefill is
                // healthy: the decode worker prefills itself.
                if local.is_none() {
                    state.metrics.count_local_prefill(route, "no_prefill");
                }
                local_body(&mut body);
            }
        }
        let payload = match serde_json::to_vec(&body) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                let err =
                    ApiError::new(500, "internal_error", format!("re-encoding the body: {e}"));
                return refuse(&mut tl, err, "internal_error");
            }
        };
        let prefill_url = pair.prefill.as_ref().map_or("(decode)", |p| p.url.as_str());
        tl.dispatched(room, prefill_url, &pair.decode.url);
        let now = std::time::SystemTime::now();
        let why = match (&pair.prefill, local) {
            (Some(_), _) => "disaggregated",
            (None, Some(why)) => why,
            (None, None) => "no_prefill",
        };
        crate::http::otel::record(
            tl.trace(),
            "router.decision",
            now,
            now,
            vec![
                opentelemetry::KeyValue::new("prefill", prefill_url.to_string()),
                opentelemetry::KeyValue::new("decode", pair.decode.url.clone()),
                opentelemetry::KeyValue::new("reason", why),
                opentelemetry::KeyValue::new("prompt_tokens", own as i64),
            ],
        );
        let traceparent = crate::http::otel::traceparent(tl.trace());
        let spec = AttemptSpec {
            client: &state.client,
            route,
            pair: &pair,
            body: payload,
            stream,
            deadline,
            timeout_secs: timeout.as_secs_f64(),
            stall: state.config.stall_timeout,
            metrics: &state.metrics,
            traceparent: traceparent.as_deref(),
            tenant,
        };
        match relay::start(spec, &mut tl).await {
            Ok((status, content_type, opened)) => {
                pair.decode.request_succeeded();
                let migration = migratable
                    .then(|| Migration::new(state.clone(), route, &body, tl.trace().clone()))
                    .map(|m| m.for_tenant(tenant));
                let mut relay = RelayBody::new(
                    opened,
                    pair,
                    tl,
                    Arc::clone(&state.metrics),
                    guards,
                    RelayLimits {
                        deadline,
                        timeout_secs: timeout.as_secs_f64(),
                        stall: state.config.stall_timeout,
                    },
                    migration,
                );
                relay.timeline().set_status(status);
                let code = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
                let mut resp = if stream {
                    Response::new(relay.into_body())
                } else {
                    let whole = relay.take_first();
                    relay.timeline().finish("ok");
                    Response::new(Body::from(whole))
                };
                *resp.status_mut() = code;
                relay_headers(&mut resp, content_type, stream);
                return resp;
            }
            Err(f) => {
                let Some(worker) = pair.side(f.side()).cloned() else {
                    return fail(&mut tl, f);
                };
                state.metrics.count_failure(f.side().name(), &f.kind());
                if f.worker_fault() {
                    worker.request_failed();
                }
                if matches!(f, Failure::Unreachable { .. } | Failure::BrokeOff { .. })
                    || f.is_draining()
                {
                    worker.mark_unreachable();
                }
                if !f.retryable(state.config.migration_limit > 0) {
                    return fail(&mut tl, f);
                }
                if matches!(f, Failure::BrokeOff { .. }) {
                    state.metrics.count_migration(route, "restarted");
                }
                tracing::warn!(
                    room = room.get(),
                    worker = %worker.url,
                    side = f.side().name(),
                    kind = %f.kind(),
                    attempt,
                    "attempt failed before any byte was relayed"
                );
                failed.push(worker);
                last = Some(f);
            }
        }
    }
    match last {
        Some(f) => fail(&mut tl, f),
        None => refuse(
            &mut tl,
            ApiError::new(500, "internal_error", "no attempt was made"),
            "internal_error",
        ),
    }
}

/// Of a prompt of `tokens` tokens cut into `blocks` blocks, `matched` of
/// which its decode worker was sent before: about how many it lacks.
fn uncached_tokens(tokens: usize, matched: usize, blocks: usize) -> usize {
    if blocks == 0 {
        return tokens;
    }
    let lacking = blocks.saturating_sub(matched.min(blocks));
    (tokens * lacking).div_ceil(blocks)
}

fn refuse(tl: &mut Timeline, err: ApiError, outcome: &'static str) -> Response {
    tl.set_status(err.status);
    tl.finish(outcome);
    err.into_response()
}

fn fail(tl: &mut Timeline, f: Failure) -> Response {
    let outcome = match &f {
        Failure::Timeout { .. } => "timeout",
        Failure::Unreachable { .. } => "worker_unreachable",
        Failure::BrokeOff { .. } => "stream_broken",
        Failure::Status { .. } => "worker_error",
        Failure::Stalled { .. } => "stalled",
    };
    let resp = f.into_response();
    tl.set_status(resp.status().as_u16());
    tl.finish(outcome);
    resp
}

/// Sign the bootstrap fields for the decode worker when the router holds
/// the transfer secret; drop any a client sent
/// otherwise.
fn sign_bootstrap(state: &RouterState, body: &mut Map<String, Value>, room: u64, prefill: &Worker) {
    if let Some(secret) = &state.config.transfer_secret {
        let ts = crate::worker::request_ids::unix_now();
        let claim = handoff_proto::bootstrap_auth::BootstrapClaim {
            room,
            host: &prefill.host,
            port: prefill.bootstrap_port,
            ts,
        };
        let sig = handoff_proto::bootstrap_auth::sign(secret.as_bytes(), &claim);
        body.insert("bootstrap_ts".into(), json!(ts));
        body.insert("bootstrap_sig".into(), json!(sig));
    } else {
        body.remove("bootstrap_ts");
        body.remove("bootstrap_sig");
    }
}

/// The prompt's length in tokens for the per-request PD decision: exact for
/// token ids, about 4 characters a token for text (a chat message adds a
/// few tokens of template); `None` for a list of prompts.
pub(crate) fn prompt_tokens(route: &str, body: &Map<String, Value>) -> Option<usize> {
    let text = |s: &str| s.chars().count().div_ceil(4);
    let one = |v: &Value| -> Option<usize> {
        match v {
            Value::String(s) => Some(text(s)),
            Value::Array(a) if a.iter().all(Value::is_u64) => Some(a.len()),
            _ => None,
        }
    };
    match route {
        "/v1/chat/completions" => {
            let msgs = body.get("messages")?.as_array()?;
            let mut n = 0;
            for m in msgs {
                n += 4 + match m.get("content") {
                    Some(Value::String(s)) => text(s),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .map(text)
                        .sum(),
                    _ => 0,
                };
            }
            Some(n)
        }
        "/v1/completions" => one(body.get("prompt")?),
        _ => body
            .get("input_ids")
            .or_else(|| body.get("text"))
            .and_then(one),
    }
}

/// Whether a stream of `route` with `body` can be continued on another
/// decode worker from the tokens already streamed: one choice, and nothing
/// whose state is not carried by the token ids (a tool-call parser, an
/// echoed prompt, `/generate`'s cumulative log-probabilities).
fn migratable(route: &str, body: &Map<String, Value>) -> bool {
    let one = |k: &str| {
        body.get(k)
            .is_none_or(|v| v.is_null() || v.as_u64() == Some(1))
    };
    let off = |k: &str| {
        body.get(k)
            .is_none_or(|v| v.is_null() || v == &json!(false))
    };
    match route {
        "/generate" => {
            let sp = body.get("sampling_params");
            let n_one = sp
                .and_then(|p| p.get("n"))
                .is_none_or(|v| v.is_null() || v.as_u64() == Some(1));
            n_one
                && off("return_logprob")
                && !body.get("text").is_some_and(Value::is_array)
                && !body
                    .get("input_ids")
                    .and_then(Value::as_array)
                    .is_some_and(|a| a.first().is_some_and(Value::is_array))
        }
        "/v1/completions" => {
            one("n")
                && one("best_of")
                && off("echo")
                && !body
                    .get("prompt")
                    .and_then(Value::as_array)
                    .is_some_and(|a| a.first().is_some_and(|p| p.is_string() || p.is_array()))
        }
        _ => one("n") && body.get("tools").is_none_or(Value::is_null),
    }
}

impl RouterState {
    /// A prefill and a decode worker by the policies, avoiding `failed`
    /// where another dispatchable worker exists; `Err(role)` when a role has
    /// no dispatchable worker.
    pub(crate) fn pick_pair(&self, failed: &[Arc<Worker>], blocks: &[u64]) -> Result<Pair, Role> {
        let (decode, decode_matched) = self.pick_matched(Role::Decode, failed, blocks)?;
        // With no prefill to take it, the decode worker prefills itself.
        let prefill = self.pick(Role::Prefill, failed, blocks).ok();
        Ok(Pair {
            prefill,
            decode,
            decode_matched,
        })
    }

    /// A decode worker other than those in `failed` where one is
    /// dispatchable (else any dispatchable one: a single decode worker
    /// restarted), waiting for one up to `wait` and no later than
    /// `deadline`.
    pub(crate) async fn wait_for_decode(
        &self,
        failed: &[Arc<Worker>],
        wait: std::time::Duration,
        deadline: Instant,
    ) -> Option<Arc<Worker>> {
        let until = deadline.min(Instant::now() + wait);
        loop {
            if let Ok(w) = self.pick(Role::Decode, failed, &[]) {
                return Some(w);
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// [`Self::pick_pair`], waiting (when a role has no dispatchable worker)
    /// up to the queue timeout, and no later than `deadline`, for one to
    /// register or come back healthy.
    async fn wait_for_pair(
        &self,
        failed: &[Arc<Worker>],
        blocks: &[u64],
        deadline: Instant,
    ) -> Result<Pair, Role> {
        let until = deadline.min(Instant::now() + self.config.queue_timeout);
        loop {
            match self.pick_pair(failed, blocks) {
                Ok(p) => return Ok(p),
                Err(role) if Instant::now() >= until => return Err(role),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }

    fn pick(
        &self,
        role: Role,
        failed: &[Arc<Worker>],
        blocks: &[u64],
    ) -> Result<Arc<Worker>, Role> {
        self.pick_matched(role, failed, blocks).map(|(w, _)| w)
    }

    /// [`Self::pick`], and how many of `blocks` the router had sent the
    /// chosen worker before.
    fn pick_matched(
        &self,
        role: Role,
        failed: &[Arc<Worker>],
        blocks: &[u64],
    ) -> Result<(Arc<Worker>, usize), Role> {
        let all = self.workers.of(role);
        let usable: Vec<&Arc<Worker>> = all.iter().filter(|w| w.dispatchable()).collect();
        let fresh: Vec<&Arc<Worker>> = usable
            .iter()
            .copied()
            .filter(|w| !failed.iter().any(|f| Arc::ptr_eq(f, w)))
            .collect();
        let candidates = if fresh.is_empty() { usable } else { fresh };
        let loads: Vec<u64> = candidates.iter().map(|w| w.load()).collect();
        let policy = match role {
            Role::Prefill => &self.prefill_policy,
            Role::Decode => &self.decode_policy,
        };
        let urls: Vec<&str> = candidates.iter().map(|w| w.url.as_str()).collect();
        policy
            .pick_matched(&urls, &loads, blocks)
            .and_then(|(i, matched)| candidates.get(i).map(|w| (Arc::clone(w), matched)))
            .ok_or(role)
    }
}

/// The response of a route the router does not have.
pub async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        404,
        "not_found",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
}

/// The response of a method a route does not take.
pub async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        405,
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_must_be_objects() {
        assert!(parse_object(br#"{"a":1}"#).is_ok());
        let e = parse_object(b"[1,2]").unwrap_err();
        assert_eq!((e.status, e.code), (400, "invalid_type"));
        assert_eq!(
            e.message,
            "the request body must be a JSON object, not an array"
        );
        let e = parse_object(b"{\"a\":").unwrap_err();
        assert_eq!(e.code, "invalid_json");
        assert!(
            e.message
                .starts_with("the request body is not valid JSON: EOF"),
            "{}",
            e.message
        );
        let e = parse_object(b"  ").unwrap_err();
        assert!(e.message.contains("empty"));
    }
}
