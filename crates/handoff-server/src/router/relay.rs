//! The relay: one attempt sends the body to
//! the prefill and the decode worker at once, holds the client's status line
//! until the first decode byte (or an error) is known, then streams decode's
//! bytes to the client chunk by chunk while the prefill answer drains beside
//! them. Everything lives in the request's future or its response body: when
//! the client goes away both are dropped, and so are both outgoing requests.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};

use crate::http::errors::ApiError;
use crate::router::metrics::RouterMetrics;
use crate::router::rooms::RoomGuard;
use crate::router::timeline::Timeline;
use crate::router::workers::{InFlightGuard, Worker};
use handoff_proto::Role;

type RespFut = Pin<Box<dyn Future<Output = reqwest::Result<reqwest::Response>> + Send>>;
type BodyFut = Pin<Box<dyn Future<Output = reqwest::Result<Bytes>> + Send>>;
type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// The workers of one attempt.
#[derive(Debug, Clone)]
pub struct Pair {
    /// The prefill worker; `None` when the decode worker prefills the
    /// prompt itself (`local_prefill`: no prefill is healthy).
    pub prefill: Option<Arc<Worker>>,
    /// The decode worker.
    pub decode: Arc<Worker>,
    /// How many of the prompt's blocks the router sent this decode worker
    /// before (likely in its prefix cache).
    pub decode_matched: usize,
}

impl Pair {
    /// The worker of one side.
    pub fn side(&self, role: Role) -> Option<&Arc<Worker>> {
        match role {
            Role::Prefill => self.prefill.as_ref(),
            Role::Decode => Some(&self.decode),
        }
    }
}

/// What an attempt holds while it lives: its room and the in-flight counts.
#[derive(Debug)]
pub struct AttemptGuards {
    /// The room, freed on drop.
    pub room: RoomGuard,
    /// Counts the request on the prefill worker (none without one).
    pub prefill: Option<InFlightGuard>,
    /// Counts the request on the decode worker.
    pub decode: InFlightGuard,
}

/// Why an attempt failed before any byte reached the client.
#[derive(Debug)]
pub enum Failure {
    /// Connection refused, reset, or the answer broke off.
    Unreachable {
        /// Which side.
        side: Role,
        /// The worker's URL.
        url: String,
        /// The transport error.
        detail: String,
    },
    /// The worker answered with a non-2xx status (relayed verbatim).
    Status {
        /// Which side.
        side: Role,
        /// The status.
        status: u16,
        /// Its content type.
        content_type: Option<HeaderValue>,
        /// Its body.
        body: Bytes,
    },
    /// The worker took the request and then its answer broke off (after a
    /// 2xx status, or before any status once the request was sent): a
    /// generation may have started, so this is never retried.
    BrokeOff {
        /// Which side.
        side: Role,
        /// The worker's URL.
        url: String,
        /// The transport error.
        detail: String,
    },
    /// A stream's decode sent its status and then nothing for the stall
    /// timeout: a frozen or stuck worker. Not retried (a generation may be
    /// under way); the relay drops it, which cancels it on both workers.
    Stalled {
        /// The decode worker's URL.
        url: String,
        /// The stall timeout, seconds.
        secs: f64,
    },
    /// The request timeout passed.
    Timeout {
        /// The side still awaited.
        side: Role,
        /// The worker's URL.
        url: String,
        /// The timeout, seconds.
        secs: f64,
    },
}

impl Failure {
    /// The side at fault.
    pub fn side(&self) -> Role {
        match self {
            Failure::Unreachable { side, .. }
            | Failure::BrokeOff { side, .. }
            | Failure::Status { side, .. }
            | Failure::Timeout { side, .. } => *side,
            Failure::Stalled { .. } => Role::Decode,
        }
    }

    /// The metrics label of the failure.
    pub fn kind(&self) -> String {
        match self {
            Failure::Unreachable { .. } => "unreachable".to_string(),
            Failure::BrokeOff { .. } => "stream_broken".to_string(),
            Failure::Status { status, .. } => format!("status_{status}"),
            Failure::Timeout { .. } => "timeout".to_string(),
            Failure::Stalled { .. } => "stalled".to_string(),
        }
    }

    /// Safe to send again with a fresh room: nothing was relayed yet and
    /// the worker could not take the request (connection error, 502, 503),
    /// so no generation can have started; or, with `resend_lost`, a decode
    /// broke off before any byte reached the client, taking its generation
    /// down with it (one that stalled is not: it may be frozen, not dead).
    pub fn retryable(&self, resend_lost: bool) -> bool {
        match self {
            Failure::Unreachable { .. } => true,
            Failure::Status { status, .. } => matches!(status, 502 | 503),
            Failure::BrokeOff { side, .. } => resend_lost && *side == Role::Decode,
            Failure::Timeout { .. } | Failure::Stalled { .. } => false,
        }
    }

    /// A failure of the worker itself (unreachable, broke off, stalled,
    /// timed out, a 5xx other than `draining`), for its circuit breaker; a
    /// refusal of the request (4xx) is not.
    pub fn worker_fault(&self) -> bool {
        match self {
            Failure::Status { status, .. } => *status >= 500 && !self.is_draining(),
            _ => true,
        }
    }

    /// The worker refused because it is shutting down (503 `draining`):
    /// it takes nothing more, so the router stops picking it at once.
    pub fn is_draining(&self) -> bool {
        matches!(self, Failure::Status { status: 503, body, .. } if crate::http::drain::is_draining_body(body))
    }

    /// The client's answer: the worker's own status and body, 502 for an
    /// unreachable worker, 504 for a timeout.
    pub fn into_response(self) -> Response {
        match self {
            Failure::Unreachable { side, url, detail } => ApiError::new(
                502,
                "worker_unreachable",
                format!("{} worker {url} is unreachable: {detail}", side.name()),
            )
            .into_response(),
            Failure::BrokeOff { side, url, detail } => ApiError::new(
                502,
                if side == Role::Decode {
                    "decode_stream_broken"
                } else {
                    "prefill_stream_broken"
                },
                format!("{} worker {url} broke off its answer: {detail}", side.name()),
            )
            .into_response(),
            Failure::Timeout { side, url, secs } => ApiError::new(
                504,
                "request_timeout",
                format!(
                    "the request timed out after {secs} s waiting for {} worker {url}",
                    side.name()
                ),
            )
            .into_response(),
            Failure::Stalled { url, secs } => ApiError::stalled(format!(
                "decode worker {url} sent no token for {secs:.1} s: the request was ended on both workers"
            ))
            .into_response(),
            Failure::Status {
                status,
                content_type,
                body,
                ..
            } => {
                let mut resp = Response::new(Body::from(body));
                *resp.status_mut() =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                if let Some(ct) = content_type {
                    resp.headers_mut().insert(CONTENT_TYPE, ct);
                }
                resp
            }
        }
    }
}

/// A transport error with its causes, one line.
fn chain(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

/// A request to `w` failed with `e` before a status: retryable only if it
/// failed to connect (the worker never saw the request).
fn send_failed(w: &Worker, e: &reqwest::Error) -> Failure {
    if e.is_connect() {
        unreachable(w, e)
    } else {
        broke_off(w, e)
    }
}

fn broke_off(w: &Worker, e: &reqwest::Error) -> Failure {
    Failure::BrokeOff {
        side: w.role,
        url: w.url.clone(),
        detail: chain(e),
    }
}

fn unreachable(w: &Worker, e: &reqwest::Error) -> Failure {
    Failure::Unreachable {
        side: w.role,
        url: w.url.clone(),
        detail: chain(e),
    }
}

/// The prefill half of an attempt, polled beside the decode half.
enum PrefillLeg {
    /// Waiting for the status line.
    Sending(RespFut),
    /// Non-2xx: reading the error body.
    Rejecting {
        status: u16,
        content_type: Option<HeaderValue>,
        body: BodyFut,
    },
    /// 2xx: reading (and ignoring) the body.
    Draining(ByteStream),
    /// Finished, failed, or given up.
    Done,
}

enum PrefillEvent {
    Progress,
    Done,
    Failed(Failure),
}

impl PrefillLeg {
    fn active(&self) -> bool {
        !matches!(self, PrefillLeg::Done)
    }

    /// Advance the prefill answer by one step. Cancel-safe: every pending
    /// future lives in `self`. Without a prefill worker the leg is `Done`.
    async fn step(&mut self, worker: Option<&Arc<Worker>>) -> PrefillEvent {
        let Some(worker) = worker else {
            return std::future::pending().await;
        };
        match self {
            PrefillLeg::Sending(fut) => {
                let r = fut.as_mut().await;
                match r {
                    Ok(resp) if resp.status().is_success() => {
                        *self = PrefillLeg::Draining(Box::pin(resp.bytes_stream()));
                        PrefillEvent::Progress
                    }
                    Ok(resp) => {
                        *self = PrefillLeg::Rejecting {
                            status: resp.status().as_u16(),
                            content_type: resp.headers().get(CONTENT_TYPE).cloned(),
                            body: Box::pin(resp.bytes()),
                        };
                        PrefillEvent::Progress
                    }
                    Err(e) => {
                        *self = PrefillLeg::Done;
                        PrefillEvent::Failed(unreachable(worker, &e))
                    }
                }
            }
            PrefillLeg::Rejecting { body, .. } => {
                let r = body.as_mut().await;
                let PrefillLeg::Rejecting {
                    status,
                    content_type,
                    ..
                } = std::mem::replace(self, PrefillLeg::Done)
                else {
                    return PrefillEvent::Done;
                };
                match r {
                    Ok(body) => PrefillEvent::Failed(Failure::Status {
                        side: Role::Prefill,
                        status,
                        content_type,
                        body,
                    }),
                    Err(e) => PrefillEvent::Failed(unreachable(worker, &e)),
                }
            }
            PrefillLeg::Draining(stream) => match stream.next().await {
                Some(Ok(_)) => PrefillEvent::Progress,
                Some(Err(e)) => {
                    // Prefill accepted and answered 2xx: its KV may be on
                    // decode, whose generation may have started.
                    *self = PrefillLeg::Done;
                    PrefillEvent::Failed(broke_off(worker, &e))
                }
                None => {
                    *self = PrefillLeg::Done;
                    PrefillEvent::Done
                }
            },
            PrefillLeg::Done => std::future::pending().await,
        }
    }
}

/// What one attempt needs.
pub struct AttemptSpec<'a> {
    /// The HTTP client.
    pub client: &'a reqwest::Client,
    /// The route (`/generate`), appended to each worker's URL.
    pub route: &'static str,
    /// The workers.
    pub pair: &'a Pair,
    /// The JSON body with the bootstrap fields.
    pub body: Bytes,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// When the request times out.
    pub deadline: Instant,
    /// The request timeout, for messages.
    pub timeout_secs: f64,
    /// The stall watchdog: longest wait for a stream's first bytes once
    /// decode answered its status.
    pub stall: Option<std::time::Duration>,
    /// Counts a prefill that fails beside a decode that carries on.
    pub metrics: &'a RouterMetrics,
    /// The `traceparent` the workers' spans hang under.
    pub traceparent: Option<&'a str>,
    /// The tenant the request is served for ([`crate::http::tenancy`]).
    pub tenant: Option<&'a str>,
}

/// Send the attempt to both workers at once and wait until decode's first
/// byte (streams) or whole answer is known, or the attempt fails.
pub async fn start(
    spec: AttemptSpec<'_>,
    tl: &mut Timeline,
) -> Result<(u16, Option<HeaderValue>, Opened), Failure> {
    let AttemptSpec {
        client,
        route,
        pair,
        body,
        stream,
        deadline,
        timeout_secs,
        stall,
        metrics,
        traceparent,
        tenant,
    } = spec;
    let send = |w: &Worker| -> RespFut {
        let mut req = client
            .post(format!("{}{route}", w.url))
            .header(CONTENT_TYPE, "application/json");
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        if let Some(t) = tenant {
            req = req.header(crate::http::tenancy::TENANT_HEADER, t);
        }
        Box::pin(req.body(body.clone()).send())
    };
    let mut decode_fut = send(&pair.decode);
    let mut prefill = match &pair.prefill {
        Some(p) => PrefillLeg::Sending(send(p)),
        None => PrefillLeg::Done,
    };
    let timeout = |w: &Worker| Failure::Timeout {
        side: w.role,
        url: w.url.clone(),
        secs: timeout_secs,
    };
    let sleep = tokio::time::sleep_until(deadline.into());
    tokio::pin!(sleep);

    // Decode's status line, watching the prefill answer.
    let resp = loop {
        tokio::select! {
            r = decode_fut.as_mut() => match r {
                Ok(r) => break r,
                Err(e) => return Err(send_failed(&pair.decode, &e)),
            },
            ev = prefill.step(pair.prefill.as_ref()), if prefill.active() => on_prefill(ev, tl, metrics, pair.prefill.as_ref())?,
            _ = &mut sleep => return Err(timeout(&pair.decode)),
        }
    };
    let status = resp.status().as_u16();
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    if !resp.status().is_success() {
        return match tokio::time::timeout_at(deadline.into(), resp.bytes()).await {
            Ok(Ok(body)) => Err(Failure::Status {
                side: Role::Decode,
                status,
                content_type,
                body,
            }),
            Ok(Err(e)) => Err(unreachable(&pair.decode, &e)),
            Err(_) => Err(timeout(&pair.decode)),
        };
    }

    // Decode's first byte (streams) or whole body, still watching prefill.
    // A stream waits at most the stall timeout for it (a whole answer comes
    // at the end of the generation, so only the request timeout bounds it).
    let mut rest: ByteStream = Box::pin(resp.bytes_stream());
    let mut whole: Vec<u8> = Vec::new();
    let stall = stall.filter(|_| stream);
    let stalled = tokio::time::sleep(stall.unwrap_or_default());
    tokio::pin!(stalled);
    loop {
        tokio::select! {
            c = rest.next() => match c {
                Some(Ok(b)) if b.is_empty() => {}
                Some(Ok(b)) => {
                    if whole.is_empty() {
                        tl.chunk_relayed();
                    }
                    if stream {
                        return Ok((status, content_type, Opened { first: b, rest, prefill }));
                    }
                    whole.extend_from_slice(&b);
                }
                Some(Err(e)) => return Err(broke_off(&pair.decode, &e)),
                None => {
                    return Ok((status, content_type, Opened {
                        first: Bytes::from(whole),
                        rest: Box::pin(futures_util::stream::empty()),
                        prefill,
                    }));
                }
            },
            ev = prefill.step(pair.prefill.as_ref()), if prefill.active() => on_prefill(ev, tl, metrics, pair.prefill.as_ref())?,
            _ = &mut stalled, if stall.is_some() => return Err(Failure::Stalled {
                url: pair.decode.url.clone(),
                secs: stall.unwrap_or_default().as_secs_f64(),
            }),
            _ = &mut sleep => return Err(timeout(&pair.decode)),
        }
    }
}

/// The state after [`start`]: the first decode bytes (the whole body when
/// not streaming), the rest of decode's body and the prefill answer.
pub struct Opened {
    first: Bytes,
    rest: ByteStream,
    prefill: PrefillLeg,
}

/// A prefill that could not be reached or broke off its answer fails the
/// attempt no more: its decode learns it through the transfer protocol and
/// (by default) prefills the prompt itself. A prefill's HTTP refusal (a
/// 400, a 503 while draining) still ends the attempt: decode is refused the
/// same way, or the attempt is sent again.
fn on_prefill(
    ev: PrefillEvent,
    tl: &mut Timeline,
    metrics: &RouterMetrics,
    worker: Option<&Arc<Worker>>,
) -> Result<(), Failure> {
    match ev {
        PrefillEvent::Progress => Ok(()),
        PrefillEvent::Done => {
            tl.prefill_done();
            if let Some(w) = worker {
                w.request_succeeded();
            }
            Ok(())
        }
        PrefillEvent::Failed(f @ (Failure::Unreachable { .. } | Failure::BrokeOff { .. })) => {
            metrics.count_failure("prefill", &f.kind());
            tracing::warn!("prefill failed; its decode worker carries the request: {f:?}");
            if let Some(w) = worker {
                prefill_failed(w, &f);
            }
            Ok(())
        }
        PrefillEvent::Failed(f) => Err(f),
    }
}

/// What a failed prefill answer tells its worker's health and circuit
/// breaker: unreachable or broken off, it is marked unreachable; a fault of
/// the worker (not a refusal of the request) counts against its circuit.
fn prefill_failed(w: &Worker, f: &Failure) {
    if matches!(f, Failure::Unreachable { .. } | Failure::BrokeOff { .. }) {
        w.mark_unreachable();
    }
    if f.worker_fault() {
        w.request_failed();
    }
}

/// The streaming response body: decode's chunks as they arrive, the prefill
/// answer drained beside them, a JSON SSE error event if decode breaks off or
/// the request times out — unless the stream can be continued on another
/// decode worker ([`Migration`]).
pub struct RelayBody {
    pending: Option<Bytes>,
    rest: ByteStream,
    prefill: PrefillLeg,
    pair: Pair,
    timeline: Timeline,
    metrics: Arc<RouterMetrics>,
    guards: AttemptGuards,
    limits: RelayLimits,
    migration: Option<Migration>,
    ends_clean: bool,
    finished: bool,
}

/// What bounds a relayed stream in time.
#[derive(Debug, Clone, Copy)]
pub struct RelayLimits {
    /// The request's deadline (arrival plus the request timeout).
    pub deadline: Instant,
    /// The request timeout, seconds (for messages).
    pub timeout_secs: f64,
    /// The stall watchdog: longest wait for decode's next bytes.
    pub stall: Option<std::time::Duration>,
}

/// Longest a migrating stream waits for a decode worker to take it over
/// (one restarting, say) when the router's queue timeout is shorter.
pub const MIGRATION_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Mid-stream migration: what continuing a stream on another decode worker
/// needs. The decode worker marks each event with the ids of the tokens it
/// carries (`stream_marks`); the router takes the marks out and keeps the
/// ids. When the decode dies or stalls, another decode worker (or the same
/// one restarted) is sent the request with `resume_output_ids` and
/// `local_prefill`: it prefills the prompt and those tokens, replays the
/// sampler, grammar and stop strings over them, and streams what follows,
/// so the client's stream goes on where it stopped.
pub struct Migration {
    state: crate::router::RouterState,
    route: &'static str,
    body: serde_json::Map<String, serde_json::Value>,
    /// Output ids whose events went to the client.
    ids: Vec<u32>,
    /// The event that ends the generation went to the client.
    ended: bool,
    /// `data: [DONE]` went to the client.
    done_sent: bool,
    /// A data event came without a mark (a worker that does not mark its
    /// stream): what the client has is unknown, so it is not continued.
    unmarked: bool,
    /// Continuations so far.
    count: u32,
    /// Decode workers that failed this stream.
    failed: Vec<Arc<Worker>>,
    /// Bytes of an event not yet complete.
    partial: Vec<u8>,
    /// The request's trace context.
    trace: opentelemetry::Context,
    /// The tenant it is served for.
    tenant: Option<String>,
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Migration")
            .field("route", &self.route)
            .field("ids", &self.ids.len())
            .field("ended", &self.ended)
            .field("count", &self.count)
            .finish()
    }
}

/// The comment line that marks an event (`sse::mark_comment`, as axum
/// writes a comment).
const MARK_PREFIX: &[u8] = b": handoff ";

impl Migration {
    /// For a stream of `route` whose body (with `stream_marks`) is `body`.
    pub fn new(
        state: crate::router::RouterState,
        route: &'static str,
        body: &serde_json::Map<String, serde_json::Value>,
        trace: opentelemetry::Context,
    ) -> Self {
        Migration {
            trace,
            state,
            route,
            body: body.clone(),
            ids: Vec::new(),
            ended: false,
            done_sent: false,
            unmarked: false,
            count: 0,
            failed: Vec::new(),
            partial: Vec::new(),
            tenant: None,
        }
    }

    /// Continued for `tenant`, as the request was first sent.
    pub fn for_tenant(mut self, tenant: Option<&str>) -> Self {
        self.tenant = tenant.map(str::to_string);
        self
    }

    /// The whole events in what arrived so far, their marks read and taken
    /// out; an incomplete event waits for its end.
    fn strip(&mut self, chunk: &[u8]) -> Bytes {
        self.partial.extend_from_slice(chunk);
        let Some(cut) = self.partial.windows(2).rposition(|w| w == b"\n\n") else {
            return Bytes::new();
        };
        let whole: Vec<u8> = self.partial.drain(..cut + 2).collect();
        let mut out = Vec::with_capacity(whole.len());
        let mut marked = false;
        for line in whole.split_inclusive(|&b| b == b'\n') {
            if let Some(mark) = line.strip_prefix(MARK_PREFIX) {
                self.read_mark(mark);
                marked = true;
                continue;
            }
            if line.starts_with(b"data: [DONE]") {
                self.done_sent = true;
            } else if line.starts_with(b"data:") && !marked {
                self.unmarked = true;
            }
            if line == b"\n" {
                marked = false;
            }
            out.extend_from_slice(line);
        }
        Bytes::from(out)
    }

    /// `ids=3,17[ end]`.
    fn read_mark(&mut self, mark: &[u8]) {
        let text = String::from_utf8_lossy(mark);
        for word in text.split_whitespace() {
            if word == "end" {
                self.ended = true;
            } else if let Some(list) = word.strip_prefix("ids=") {
                self.ids
                    .extend(list.split(',').filter_map(|x| x.parse::<u32>().ok()));
            }
        }
    }
}

/// Ends a span when dropped.
struct EndSpan(opentelemetry::Context);

impl Drop for EndSpan {
    fn drop(&mut self) {
        crate::http::otel::end(&self.0, Vec::new());
    }
}

/// How a decode stream's next step went.
enum FromDecode {
    /// Bytes.
    Bytes(Bytes),
    /// The stream ended.
    End,
    /// It broke off, stalled or timed out: the error event, and whether
    /// another decode worker may continue it (not after a timeout).
    Broken(ApiError, bool),
}

/// How a migration went.
enum Migrated {
    /// Another decode worker streams on.
    Continued,
    /// Nothing to continue: the generation had ended.
    Ended,
}

impl RelayBody {
    /// Wrap a started stream.
    pub fn new(
        started: Opened,
        pair: Pair,
        timeline: Timeline,
        metrics: Arc<RouterMetrics>,
        guards: AttemptGuards,
        limits: RelayLimits,
        mut migration: Option<Migration>,
    ) -> Self {
        let first = match &mut migration {
            Some(m) => m.strip(&started.first),
            None => started.first,
        };
        RelayBody {
            limits,
            pending: Some(first),
            rest: started.rest,
            prefill: started.prefill,
            pair,
            timeline,
            metrics,
            guards,
            migration,
            ends_clean: true,
            finished: false,
        }
    }

    /// The first bytes (the whole body when not streaming).
    pub fn take_first(&mut self) -> Bytes {
        self.pending.take().unwrap_or_default()
    }

    /// The timeline, to set the status and outcome.
    pub fn timeline(&mut self) -> &mut Timeline {
        &mut self.timeline
    }

    /// The response body.
    pub fn into_body(self) -> Body {
        let stream = futures_util::stream::unfold(self, |mut r| async move {
            r.next_chunk().await.map(|b| (Ok::<_, Infallible>(b), r))
        });
        Body::from_stream(stream)
    }

    fn relayed(&mut self, b: Bytes) -> Bytes {
        self.ends_clean = b.ends_with(b"\n\n");
        b
    }

    fn error_event_of(&mut self, e: ApiError) -> Bytes {
        self.finished = true;
        self.timeline.finish(e.code);
        let json = e.to_json();
        let sep = if self.ends_clean { "" } else { "\n\n" };
        Bytes::from(format!("{sep}data: {json}\n\n"))
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        if let Some(first) = self.pending.take().filter(|b| !b.is_empty()) {
            // Its arrival was recorded by `start`.
            return Some(self.relayed(first));
        }
        loop {
            if self.finished {
                return None;
            }
            let (err, continuable) = match self.next_from_decode().await {
                FromDecode::Bytes(b) => {
                    let b = match &mut self.migration {
                        Some(m) => m.strip(&b),
                        None => b,
                    };
                    if b.is_empty() {
                        continue;
                    }
                    return Some(self.relayed(b));
                }
                FromDecode::End
                    if self
                        .migration
                        .as_ref()
                        .is_none_or(|m| m.ended || m.unmarked) =>
                {
                    self.finished = true;
                    self.timeline.finish("ok");
                    return None;
                }
                FromDecode::End => (
                    ApiError::new(
                        502,
                        "decode_stream_broken",
                        format!(
                            "decode worker {} ended the stream before the generation ended",
                            self.pair.decode.url
                        ),
                    ),
                    true,
                ),
                FromDecode::Broken(e, continuable) => (e, continuable),
            };
            self.pair.decode.request_failed();
            if !continuable || self.migration.as_ref().is_none_or(|m| m.unmarked) {
                return Some(self.error_event_of(err));
            }
            match self.migrate(&err.message).await {
                Ok(Migrated::Continued) => {}
                Ok(Migrated::Ended) => {
                    // The decode died after the generation's last event:
                    // end the stream as it would have.
                    self.finished = true;
                    self.timeline.finish("ok");
                    let done_sent = self.migration.as_ref().is_some_and(|m| m.done_sent);
                    return (!done_sent)
                        .then(|| self.relayed(Bytes::from_static(b"data: [DONE]\n\n")));
                }
                Err(e) => return Some(self.error_event_of(e)),
            }
        }
    }

    /// The next bytes from decode, watching the prefill answer, the stall
    /// watchdog and the deadline.
    async fn next_from_decode(&mut self) -> FromDecode {
        let sleep = tokio::time::sleep_until(self.limits.deadline.into());
        tokio::pin!(sleep);
        // The stall watchdog: this long for the next byte from decode.
        let stall = self.limits.stall;
        let stall_at = stall
            .map(|s| tokio::time::Instant::now() + s)
            .unwrap_or_else(|| self.limits.deadline.into());
        let stalled = tokio::time::sleep_until(stall_at);
        tokio::pin!(stalled);
        loop {
            tokio::select! {
                c = self.rest.next() => match c {
                    Some(Ok(b)) if b.is_empty() => {}
                    Some(Ok(b)) => {
                        self.timeline.chunk_relayed();
                        return FromDecode::Bytes(b);
                    }
                    Some(Err(e)) => {
                        self.metrics.count_failure("decode", "stream_broken");
                        let msg = format!(
                            "the stream from decode worker {} broke off: {}",
                            self.pair.decode.url,
                            chain(&e)
                        );
                        tracing::warn!("{msg}");
                        return FromDecode::Broken(ApiError::new(502, "decode_stream_broken", msg), true);
                    }
                    None => return FromDecode::End,
                },
                ev = self.prefill.step(self.pair.prefill.as_ref()), if self.prefill.active() => match ev {
                    PrefillEvent::Progress => {}
                    PrefillEvent::Done => {
                        self.timeline.prefill_done();
                        if let Some(w) = &self.pair.prefill {
                            w.request_succeeded();
                        }
                    }
                    PrefillEvent::Failed(f) => {
                        // Decode learns of it through the transfer protocol
                        // and its stream carries the error; the prefill's
                        // circuit breaker learns of it here.
                        self.metrics.count_failure("prefill", &f.kind());
                        tracing::debug!("prefill failed after decode bytes were relayed: {f:?}");
                        if let Some(w) = &self.pair.prefill {
                            prefill_failed(w, &f);
                        }
                    }
                },
                _ = &mut stalled, if stall.is_some() => {
                    self.metrics.count_failure("decode", "stalled");
                    let msg = format!(
                        "decode worker {} sent nothing for {:.1} s",
                        self.pair.decode.url,
                        stall.unwrap_or_default().as_secs_f64()
                    );
                    tracing::warn!("{msg}");
                    return FromDecode::Broken(ApiError::stalled(msg), true);
                }
                _ = &mut sleep => {
                    self.metrics.count_failure("decode", "timeout");
                    let msg = format!(
                        "the request timed out after {} s while streaming from decode worker {}",
                        self.limits.timeout_secs, self.pair.decode.url
                    );
                    return FromDecode::Broken(ApiError::new(504, "request_timeout", msg), false);
                }
            }
        }
    }

    /// Continue the stream on another decode worker (the same one once
    /// restarted, when it is the only one), after `why` ended it here.
    async fn migrate(&mut self, why: &str) -> Result<Migrated, ApiError> {
        let Some(m) = self.migration.as_mut() else {
            return Err(ApiError::new(502, "decode_stream_broken", why.to_string()));
        };
        if m.ended {
            return Ok(Migrated::Ended);
        }
        let route = m.route;
        if max_tokens_asked(route, &m.body).is_some_and(|limit| m.ids.len() >= limit) {
            // Every token the request asked for reached the client; only
            // the event that ends the generation went down with the decode.
            // A continuation would have nothing to generate (a decode
            // refuses it): end the stream here, as it would have ended.
            m.state.metrics.count_migration(route, "ended");
            return Ok(Migrated::Ended);
        }
        let old = Arc::clone(&self.pair.decode);
        old.mark_unreachable();
        m.failed.push(old);
        let cfg = &m.state.config;
        let wait = cfg.queue_timeout.max(MIGRATION_WAIT);
        let broken =
            |detail: String| ApiError::new(502, "decode_stream_broken", format!("{why}; {detail}"));
        loop {
            if m.count >= cfg.migration_limit {
                m.state.metrics.count_migration(route, "limit");
                return Err(broken(format!(
                    "the stream was continued {} times already (--migration-limit)",
                    m.count
                )));
            }
            m.count += 1;
            let Some(decode) = m
                .state
                .wait_for_decode(&m.failed, wait, self.limits.deadline)
                .await
            else {
                m.state.metrics.count_migration(route, "no_decode");
                return Err(broken(format!(
                    "no decode worker could continue it within {:.0} s",
                    wait.as_secs_f64()
                )));
            };
            let mut body = m.body.clone();
            local_body(&mut body);
            if !m.ids.is_empty() {
                body.insert("resume_output_ids".into(), serde_json::json!(m.ids));
            }
            let payload = serde_json::to_vec(&body).unwrap_or_default();
            let span = crate::http::otel::start(
                &m.trace,
                "router.migration",
                opentelemetry::trace::SpanKind::Internal,
                std::time::SystemTime::now(),
                vec![
                    opentelemetry::KeyValue::new("from", self.pair.decode.url.clone()),
                    opentelemetry::KeyValue::new("to", decode.url.clone()),
                    opentelemetry::KeyValue::new("tokens_streamed", m.ids.len() as i64),
                    opentelemetry::KeyValue::new("why", why.to_string()),
                ],
            );
            let mut req = m
                .state
                .client
                .post(format!("{}{route}", decode.url))
                .header(CONTENT_TYPE, "application/json");
            if let Some(tp) = crate::http::otel::traceparent(&span) {
                req = req.header("traceparent", tp);
            }
            if let Some(t) = &m.tenant {
                req = req.header(crate::http::tenancy::TENANT_HEADER, t);
            }
            let sent = req.body(payload).send();
            // The span covers the hand-over: until the new decode answered.
            let _end = EndSpan(span);
            let resp = match tokio::time::timeout_at(self.limits.deadline.into(), sent).await {
                Err(_) => {
                    return Err(ApiError::new(
                        504,
                        "request_timeout",
                        format!(
                            "{why}; the request timed out while another decode worker took it over"
                        ),
                    ))
                }
                Ok(Err(e)) => {
                    decode.request_failed();
                    m.state.metrics.count_migration(route, "unreachable");
                    tracing::warn!(worker = %decode.url, "migration target unreachable: {}", chain(&e));
                    decode.mark_unreachable();
                    m.failed.push(decode);
                    continue;
                }
                Ok(Ok(r)) => r,
            };
            let status = resp.status().as_u16();
            if !resp.status().is_success() {
                let text = resp.text().await.unwrap_or_default();
                if status >= 500 {
                    decode.request_failed();
                }
                m.state.metrics.count_migration(route, "refused");
                if matches!(status, 502 | 503) {
                    m.failed.push(decode);
                    continue;
                }
                return Err(broken(format!(
                    "decode worker {} refused to continue it with status {status}: {text}",
                    decode.url
                )));
            }
            decode.request_succeeded();
            m.state.metrics.count_migration(route, "ok");
            m.state.metrics.count_local_prefill(route, "migrated");
            tracing::warn!(
                from = %self.pair.decode.url,
                to = %decode.url,
                tokens = m.ids.len(),
                "stream continued on another decode worker: {why}"
            );
            self.rest = Box::pin(resp.bytes_stream());
            self.guards.decode = decode.start_request();
            self.pair.decode = decode;
            self.pair.prefill = None;
            self.prefill = PrefillLeg::Done;
            return Ok(Migrated::Continued);
        }
    }
}

/// Headers of a relayed answer.
pub fn relay_headers(resp: &mut Response, content_type: Option<HeaderValue>, stream: bool) {
    if let Some(ct) = content_type {
        resp.headers_mut().insert(CONTENT_TYPE, ct);
    }
    if stream {
        resp.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
}

/// The output limit a request of `route` names in `body`, if it names one
/// (the worker's default applies otherwise, which the router does not know).
fn max_tokens_asked(
    route: &str,
    body: &serde_json::Map<String, serde_json::Value>,
) -> Option<usize> {
    let field = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_u64()).map(|n| n as usize);
    match route {
        "/v1/chat/completions" => {
            field(body.get("max_completion_tokens")).or(field(body.get("max_tokens")))
        }
        "/v1/completions" => field(body.get("max_tokens")),
        "/generate" => field(
            body.get("sampling_params")
                .and_then(|p| p.get("max_new_tokens")),
        ),
        _ => None,
    }
}

/// `body` for a decode worker prefilling itself: no bootstrap fields.
pub(crate) fn local_body(body: &mut serde_json::Map<String, serde_json::Value>) {
    for k in [
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_ts",
        "bootstrap_sig",
    ] {
        body.remove(k);
    }
    body.insert("local_prefill".into(), serde_json::json!(true));
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::max_tokens_asked;

    /// The limit a migration compares the streamed tokens with: the one the
    /// request names for its route, none when it names none.
    #[test]
    fn the_output_limit_is_the_one_the_request_names() {
        let body = |v: serde_json::Value| v.as_object().unwrap().clone();
        let chat = "/v1/chat/completions";
        assert_eq!(
            max_tokens_asked(chat, &body(json!({"max_tokens": 8}))),
            Some(8)
        );
        assert_eq!(
            max_tokens_asked(
                chat,
                &body(json!({"max_tokens": 8, "max_completion_tokens": 5}))
            ),
            Some(5)
        );
        assert_eq!(
            max_tokens_asked("/v1/completions", &body(json!({"max_tokens": 3}))),
            Some(3)
        );
        assert_eq!(
            max_tokens_asked(
                "/generate",
                &body(json!({"sampling_params": {"max_new_tokens": 4}}))
            ),
            Some(4)
        );
        assert_eq!(
            max_tokens_asked(chat, &body(json!({}))),
            None,
            "the worker's default"
        );
        assert_eq!(
            max_tokens_asked("/generate", &body(json!({"max_tokens": 4}))),
            None
        );
    }
}
