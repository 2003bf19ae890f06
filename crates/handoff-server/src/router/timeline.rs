//! The per-request timeline: seconds from arrival to
//! `dispatched`, `prefill_done`, `first_token` and `done`, recorded as
//! `handoff_router_stage_seconds` and logged as one line when the request
//! ends — however it ends, since the line is written when the timeline drops.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::router::metrics::RouterMetrics;
use handoff_proto::RoomId;

/// One request's timeline; logs and records itself when dropped.
#[derive(Debug)]
pub struct Timeline {
    metrics: Arc<RouterMetrics>,
    route: &'static str,
    arrived: Instant,
    room: Option<RoomId>,
    prefill: String,
    decode: String,
    dispatched: Option<Duration>,
    prefill_done: Option<Duration>,
    first_token: Option<Duration>,
    last_chunk: Option<Instant>,
    stream: bool,
    retries: u32,
    status: u16,
    outcome: &'static str,
    /// The request's claim on its prefilling worker's queue.
    ticket: Option<crate::router::admission::Ticket>,
    /// Its `router.request` span (ended with the timeline).
    trace: opentelemetry::Context,
}

impl Timeline {
    /// A request that arrived at `arrived` on `route`.
    pub fn new(metrics: Arc<RouterMetrics>, route: &'static str, arrived: Instant) -> Self {
        Timeline {
            metrics,
            route,
            arrived,
            room: None,
            prefill: String::new(),
            decode: String::new(),
            dispatched: None,
            prefill_done: None,
            first_token: None,
            last_chunk: None,
            stream: false,
            retries: 0,
            status: 0,
            outcome: "client_gone",
            ticket: None,
            trace: opentelemetry::Context::new(),
        }
    }

    /// Whether the client asked for a stream.
    pub fn set_stream(&mut self, stream: bool) {
        self.stream = stream;
    }

    /// An attempt was sent to this pair in this room (the stage keeps the
    /// first attempt's time; the log names the last pair).
    pub fn dispatched(&mut self, room: RoomId, prefill: &str, decode: &str) {
        if self.dispatched.is_some() {
            self.retries += 1;
        } else {
            self.dispatched = Some(self.arrived.elapsed());
        }
        self.room = Some(room);
        self.prefill = prefill.to_string();
        self.decode = decode.to_string();
    }

    /// The prefill worker's answer completed.
    pub fn prefill_done(&mut self) {
        if self.prefill_done.is_none() {
            self.prefill_done = Some(self.arrived.elapsed());
        }
        if let Some(t) = &mut self.ticket {
            t.prefilled(true);
        }
    }

    /// The request's `router.request` span.
    pub fn set_trace(&mut self, cx: opentelemetry::Context) {
        self.trace = cx;
    }

    /// The request's trace context (its `router.request` span).
    pub fn trace(&self) -> &opentelemetry::Context {
        &self.trace
    }

    /// This attempt's claim on its prefilling worker's queue (replacing an
    /// earlier attempt's).
    pub fn set_ticket(&mut self, ticket: crate::router::admission::Ticket) {
        self.ticket = Some(ticket);
    }

    /// A decode chunk is being relayed to the client now.
    pub fn chunk_relayed(&mut self) {
        let now = Instant::now();
        match self.last_chunk {
            None => {
                let since = now - self.arrived;
                self.first_token = Some(since);
                // A stream's first bytes are its first token; a whole
                // answer's come at its end (only the queue is released).
                let stream = self.stream;
                if let Some(t) = &mut self.ticket {
                    t.prefilled(stream);
                }
                if self.stream {
                    self.metrics.observe_ttft(since.as_secs_f64());
                }
            }
            Some(prev) => {
                if self.stream {
                    self.metrics.observe_itl((now - prev).as_secs_f64());
                }
            }
        }
        self.last_chunk = Some(now);
    }

    /// The status sent to the client.
    pub fn set_status(&mut self, status: u16) {
        self.status = status;
    }

    /// How the request ended (`ok`, `worker_error`, `bad_request`,
    /// `decode_stream_broken`, `timeout`, ...; `client_gone` if never set).
    pub fn finish(&mut self, outcome: &'static str) {
        self.outcome = outcome;
    }
}

fn ms(d: Option<Duration>) -> f64 {
    d.map(|d| d.as_secs_f64() * 1e3).unwrap_or(-1.0)
}

impl Drop for Timeline {
    fn drop(&mut self) {
        let done = self.arrived.elapsed();
        for (stage, at) in [
            ("dispatched", self.dispatched),
            ("prefill_done", self.prefill_done),
            ("first_token", self.first_token),
            ("done", Some(done)),
        ] {
            if let Some(at) = at {
                self.metrics.observe_stage(stage, at.as_secs_f64());
            }
        }
        self.metrics.observe_e2e(done.as_secs_f64());
        crate::http::otel::end(
            &self.trace,
            vec![
                opentelemetry::KeyValue::new("http.status_code", i64::from(self.status)),
                opentelemetry::KeyValue::new("outcome", self.outcome),
                opentelemetry::KeyValue::new("retries", i64::from(self.retries)),
                opentelemetry::KeyValue::new("decode", self.decode.clone()),
                opentelemetry::KeyValue::new("prefill", self.prefill.clone()),
            ],
        );
        tracing::info!(
            room = self.room.map(RoomId::get).unwrap_or(0),
            route = self.route,
            prefill = %self.prefill,
            decode = %self.decode,
            status = self.status,
            outcome = self.outcome,
            stream = self.stream,
            retries = self.retries,
            dispatched_ms = ms(self.dispatched),
            prefill_done_ms = ms(self.prefill_done),
            first_token_ms = ms(self.first_token),
            done_ms = ms(Some(done)),
            "router request"
        );
    }
}
