//! Prometheus metrics of the HTTP front end: request counts by
//! endpoint and status, errors by type, TTFT / inter-token / end-to-end
//! latency histograms, token counters, queue depth and KV pages (read from the
//! engine at scrape time). The same exposition carries SGLang's `sglang:`
//! names beside these ([`crate::worker::field_metrics`]).

use crate::worker::backend::TransferSnapshot;
use handoff_engine::handle::LoadSnapshot;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::worker::field_metrics::{FieldLoad, FieldMetrics};

pub use crate::http::exposition::{encode, encode_part, EOF};

/// Labels of the request counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Route path (`/v1/chat/completions`).
    pub endpoint: String,
    /// HTTP status code.
    pub status: String,
}

/// Labels of the error counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Route path.
    pub endpoint: String,
    /// The error's stable `error_type()` label.
    pub error_type: String,
}

/// All metrics of one server.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    running: Gauge,
    waiting: Gauge,
    paused: Gauge,
    pages_free: Gauge,
    pages_used: Gauge,
    pages_cached: Gauge,
    kv_bytes_sent: Counter,
    prefill_passes: Counter,
    prefill_pass_sequences: Counter,
    live_rooms: Gauge,
    local_prefills: Family<LocalLabels, Counter>,
    stalled: Counter,
    prefill_stages: Family<StageLabels, Histogram>,
    field: FieldMetrics,
    page_size: usize,
}

/// Labels of the decode-local prefill counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalLabels {
    /// `asked` (the router sent it to be prefilled here) or `recomputed`
    /// (its KV transfer failed).
    pub reason: &'static str,
}

/// Labels of the prefill stage histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `wait_destination`, `compute` or `transfer_tail`.
    pub stage: &'static str,
}

impl Metrics {
    /// A fresh registry with every metric at zero, for a worker serving
    /// `model_name` over pages of `page_size` tokens (SGLang's gauges count
    /// tokens).
    pub fn new(model_name: &str, page_size: usize) -> Self {
        let mut registry = Registry::with_prefix("handoff");
        let requests = Family::<RequestLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let itl = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let e2e = Histogram::new(exponential_buckets(0.005, 2.0, 18));
        let prompt_tokens = Counter::default();
        let generation_tokens = Counter::default();
        let running = Gauge::default();
        let waiting = Gauge::default();
        let paused = Gauge::default();
        let pages_free = Gauge::default();
        let pages_used = Gauge::default();
        let pages_cached = Gauge::default();
        let kv_bytes_sent = Counter::default();
        let live_rooms = Gauge::default();
        let stalled = Counter::default();
        registry.register(
            "http_requests",
            "HTTP requests by endpoint and status",
            requests.clone(),
        );
        registry.register(
            "request_errors",
            "Failed requests by endpoint and error type (including errors sent mid-stream)",
            errors.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            itl.clone(),
        );
        registry.register(
            "e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            e2e.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of completed requests",
            prompt_tokens.clone(),
        );
        registry.register(
            "generation_tokens",
            "Tokens generated",
            generation_tokens.clone(),
        );
        registry.register(
            "num_requests_running",
            "Requests in the running batch",
            running.clone(),
        );
        registry.register(
            "num_requests_waiting",
            "Requests waiting for admission",
            waiting.clone(),
        );
        registry.register(
            "num_requests_paused",
            "Running requests not stepped because their client lags a full stream buffer behind",
            paused.clone(),
        );
        registry.register("kv_pages_free", "Free KV pages", pages_free.clone());
        registry.register(
            "kv_pages_used",
            "KV pages leased to requests",
            pages_used.clone(),
        );
        registry.register(
            "kv_pages_cached",
            "KV pages held by the prefix cache (reused by requests sharing a prefix)",
            pages_cached.clone(),
        );
        registry.register(
            "kv_transfer_bytes",
            "Prefill worker: KV bytes sent to decode workers (delta transfer sends only the pages a decode lacks)",
            kv_bytes_sent.clone(),
        );
        let prefill_passes = Counter::default();
        registry.register(
            "prefill_passes",
            "Prefill forward passes run (colocated engine or prefill worker)",
            prefill_passes.clone(),
        );
        let prefill_pass_sequences = Counter::default();
        registry.register(
            "prefill_pass_sequences",
            "Sequences in the prefill forward passes, all together (over prefill_passes: prompts batched per pass)",
            prefill_pass_sequences.clone(),
        );
        registry.register(
            "transfer_live_rooms",
            "PD worker: rooms its transfer endpoint holds (0 once idle: anything else is a leak)",
            live_rooms.clone(),
        );
        let local_prefills = Family::<LocalLabels, Counter>::default();
        registry.register(
            "local_prefills",
            "Decode worker: requests it prefilled itself: asked (no prefill worker, a migrated stream) or recomputed (the KV transfer failed)",
            local_prefills.clone(),
        );
        registry.register(
            "requests_stalled",
            "Requests ended by the stall watchdog: no token for --stream-stall-timeout-secs",
            stalled.clone(),
        );
        let prefill_stages = Family::<StageLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0001, 2.0, 20))
        });
        registry.register(
            "prefill_stage_seconds",
            "Prefill worker: time per stage of a request (wait_destination: until decode reserved its pages; compute: the forward, KV streaming meanwhile; transfer_tail: KV not hidden behind compute, aux and status)",
            prefill_stages.clone(),
        );
        Metrics {
            field: FieldMetrics::new(model_name),
            page_size: page_size.max(1),
            pages_cached,
            kv_bytes_sent,
            prefill_passes,
            prefill_pass_sequences,
            live_rooms,
            local_prefills,
            stalled,
            prefill_stages,
            registry,
            requests,
            errors,
            ttft,
            itl,
            e2e,
            prompt_tokens,
            generation_tokens,
            running,
            waiting,
            paused,
            pages_free,
            pages_used,
        }
    }

    /// Count one answered HTTP request.
    pub fn count_request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.to_string(),
                status: status.to_string(),
            })
            .inc();
    }

    /// Count one failed request.
    pub fn count_error(&self, endpoint: &str, error_type: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                endpoint: endpoint.to_string(),
                error_type: error_type.to_string(),
            })
            .inc();
    }

    /// Count a request the stall watchdog ended.
    pub fn count_stalled(&self) {
        self.stalled.inc();
    }

    /// Record a first token `secs` after arrival.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.observe(secs);
        self.field.observe_ttft(secs);
    }

    /// Record a gap of `secs` between two tokens.
    pub fn observe_itl(&self, secs: f64) {
        self.itl.observe(secs);
        self.field.observe_itl(secs);
    }

    /// Record a generated token.
    pub fn count_generated(&self) {
        self.generation_tokens.inc();
        self.field.count_generated();
    }

    /// Record a finished request: its latency, prompt tokens and how many
    /// of them came from the prefix cache.
    pub fn observe_finished(&self, e2e_secs: f64, prompt_tokens: usize, cached_tokens: usize) {
        self.e2e.observe(e2e_secs);
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.field
            .observe_finished(e2e_secs, prompt_tokens, cached_tokens);
    }

    /// SGLang's view of the engine's load now (tokens, not pages).
    pub fn field_load(&self, load: &LoadSnapshot) -> FieldLoad {
        FieldLoad {
            running: load.running,
            waiting: load.waiting,
            used_tokens: load.pages_used * self.page_size,
            total_tokens: load.pages_total * self.page_size,
        }
    }

    /// The SGLang-named metrics (for `/get_load`'s totals).
    pub fn field(&self) -> &FieldMetrics {
        &self.field
    }

    /// Record a completed prefill's stages.
    pub fn observe_prefill(&self, t: &handoff_engine::pd::PrefillTimings) {
        for (stage, d) in [
            ("wait_destination", t.wait_destination),
            ("compute", t.compute),
            ("transfer_tail", t.transfer_tail),
        ] {
            self.prefill_stages
                .get_or_create(&StageLabels { stage })
                .observe(d.as_secs_f64());
        }
    }

    /// The text exposition, with the engine's load as of now and what its
    /// transfer endpoint reports (KV bytes sent so far, a total that only
    /// grows, and live rooms).
    pub fn render(&self, load: &LoadSnapshot, transfer: TransferSnapshot) -> String {
        let as_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.pages_cached.set(as_i64(load.pages_cached));
        // The endpoint keeps the total; concurrent scrapes both set it.
        self.kv_bytes_sent
            .inner()
            .fetch_max(transfer.kv_bytes_sent, std::sync::atomic::Ordering::Relaxed);
        for (counter, total) in [
            (&self.prefill_passes, load.prefill_passes),
            (&self.prefill_pass_sequences, load.prefill_pass_sequences),
        ] {
            counter
                .inner()
                .fetch_max(total, std::sync::atomic::Ordering::Relaxed);
        }
        self.live_rooms.set(as_i64(transfer.live_rooms));
        for (reason, total) in [
            ("asked", transfer.local_prefills.asked),
            ("recomputed", transfer.local_prefills.recomputed),
        ] {
            if total > 0 {
                self.local_prefills
                    .get_or_create(&LocalLabels { reason })
                    .inner()
                    .fetch_max(total, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.running.set(as_i64(load.running));
        self.waiting.set(as_i64(load.waiting));
        self.paused.set(as_i64(load.paused));
        self.pages_used.set(as_i64(load.pages_used));
        self.pages_free
            .set(as_i64(load.pages_total.saturating_sub(load.pages_used)));
        let mut out = encode_part(&self.registry);
        out.push_str(&self.field.render(self.field_load(load)));
        out.push_str(EOF);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_every_metric() {
        let m = Metrics::new("smol", 16);
        m.count_request("/generate", 200);
        m.count_error("/generate", "context_length_exceeded");
        m.observe_ttft(0.01);
        let text = m.render(
            &LoadSnapshot {
                running: 2,
                waiting: 1,
                paused: 1,
                pages_total: 10,
                pages_used: 3,
                pages_cached: 4,
                prefill_passes: 6,
                prefill_pass_sequences: 9,
            },
            TransferSnapshot {
                kv_bytes_sent: 4096,
                live_rooms: 5,
                local_prefills: handoff_engine::pd::LocalPrefills {
                    asked: 2,
                    recomputed: 1,
                },
            },
        );
        for needle in [
            "handoff_local_prefills_total{reason=\"asked\"} 2",
            "handoff_local_prefills_total{reason=\"recomputed\"} 1",
            "handoff_http_requests_total{endpoint=\"/generate\",status=\"200\"} 1",
            "handoff_request_errors_total{endpoint=\"/generate\",error_type=\"context_length_exceeded\"} 1",
            "handoff_time_to_first_token_seconds_count 1",
            "handoff_num_requests_running 2",
            "handoff_num_requests_waiting 1",
            "handoff_num_requests_paused 1",
            "handoff_kv_pages_free 7",
            "handoff_kv_pages_used 3",
            "handoff_kv_pages_cached 4",
            "handoff_kv_transfer_bytes_total 4096",
            "handoff_prefill_passes_total 6",
            "handoff_prefill_pass_sequences_total 9",
            "handoff_transfer_live_rooms 5",
            // SGLang's names, in tokens, labelled with the model.
            "sglang:num_running_reqs{model_name=\"smol\"} 2",
            "sglang:num_queue_reqs{model_name=\"smol\"} 1",
            "sglang:num_used_tokens{model_name=\"smol\"} 48",
            "sglang:max_total_num_tokens{model_name=\"smol\"} 160",
            "sglang:time_to_first_token_seconds_count{model_name=\"smol\"} 1",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        // One exposition: a single EOF line, at the end.
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
