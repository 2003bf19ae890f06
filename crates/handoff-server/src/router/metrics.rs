//! Prometheus metrics of the router, prefix `handoff_router`:
//! requests by route and status, TTFT / ITL / end-to-end latency as the
//! client sees them, the per-request timeline by stage, failures by side and
//! kind, retries, and each worker's requests in flight and health; and
//! SGLang's `sglang:` names for each role's load summed over its workers
//! ([`crate::worker::field_metrics::RouterFieldMetrics`]).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::worker::field_metrics::{RoleLoad, RouterFieldMetrics};

/// Labels of the request counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// Route path (`/v1/chat/completions`).
    pub route: String,
    /// HTTP status sent to the client.
    pub status: String,
}

/// Labels of the retry counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// Route path.
    pub route: String,
}

/// Labels of the migration counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MigrationLabels {
    /// Route path.
    pub route: String,
    /// `ok` (the stream went on on another decode worker), or why not:
    /// `no_decode`, `refused`, `unreachable`, `limit`.
    pub outcome: String,
}

/// Labels of the local-prefill counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalLabels {
    /// Route path.
    pub route: String,
    /// Why the decode worker prefilled itself: `no_prefill` (none
    /// healthy), `migrated` (a continued stream).
    pub reason: String,
}

/// Labels of the failure counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// `prefill` or `decode`.
    pub side: String,
    /// `unreachable`, `timeout`, `status_503`, `stream_broken`, ...
    pub kind: String,
}

/// Labels of per-worker gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    /// The worker's URL.
    pub worker: String,
    /// `prefill` or `decode`.
    pub role: String,
}

/// Labels of the timeline histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `dispatched`, `prefill_done`, `first_token` or `done`.
    pub stage: String,
}

fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 22))
}

/// All metrics of one router.
#[derive(Debug)]
pub struct RouterMetrics {
    registry: Registry,
    requests: Family<RouteLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    retries: Family<RetryLabels, Counter>,
    migrations: Family<MigrationLabels, Counter>,
    local_prefills: Family<LocalLabels, Counter>,
    in_flight: Family<WorkerLabels, Gauge>,
    healthy: Family<WorkerLabels, Gauge>,
    stages: Family<StageLabels, Histogram, fn() -> Histogram>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    field: RouterFieldMetrics,
    field_registry: Registry,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RouterMetrics {
    /// A fresh registry with every metric at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("handoff_router");
        let requests = Family::<RouteLabels, Counter>::default();
        let failures = Family::<FailureLabels, Counter>::default();
        let retries = Family::<RetryLabels, Counter>::default();
        let migrations = Family::<MigrationLabels, Counter>::default();
        let local_prefills = Family::<LocalLabels, Counter>::default();
        let in_flight = Family::<WorkerLabels, Gauge>::default();
        let healthy = Family::<WorkerLabels, Gauge>::default();
        let stages = Family::<StageLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            stage_histogram,
        );
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let itl = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let e2e = Histogram::new(exponential_buckets(0.005, 2.0, 18));
        registry.register(
            "requests",
            "Requests by route and the status sent to the client",
            requests.clone(),
        );
        registry.register(
            "worker_failures",
            "Worker failures seen by the router, by side (prefill/decode) and kind",
            failures.clone(),
        );
        registry.register(
            "retries",
            "Requests sent again (fresh room) after a retryable failure, by route",
            retries.clone(),
        );
        registry.register(
            "migrations",
            "Streams whose decode worker died or stalled mid-stream, continued on another (outcome ok) or not (why), by route",
            migrations.clone(),
        );
        registry.register(
            "local_prefills",
            "Requests sent to a decode worker to prefill itself, by route and reason",
            local_prefills.clone(),
        );
        registry.register(
            "worker_in_flight",
            "Requests in flight at the router per worker",
            in_flight.clone(),
        );
        registry.register(
            "worker_healthy",
            "1 when the worker passed its last health checks",
            healthy.clone(),
        );
        registry.register(
            "stage_seconds",
            "Per-request timeline: seconds from arrival to each stage",
            stages.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Arrival to the first decode byte relayed to the client (streams)",
            ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between relayed decode chunks (streams)",
            itl.clone(),
        );
        registry.register(
            "e2e_request_latency_seconds",
            "Arrival to the end of the response",
            e2e.clone(),
        );
        let field = RouterFieldMetrics::default();
        let mut field_registry = Registry::default();
        field.register(&mut field_registry);
        RouterMetrics {
            field,
            field_registry,
            registry,
            requests,
            failures,
            retries,
            migrations,
            local_prefills,
            in_flight,
            healthy,
            stages,
            ttft,
            itl,
            e2e,
        }
    }

    /// Count one answered request.
    pub fn count_request(&self, route: &str, status: u16) {
        self.requests
            .get_or_create(&RouteLabels {
                route: route.to_string(),
                status: status.to_string(),
            })
            .inc();
    }

    /// Count one worker failure.
    pub fn count_failure(&self, side: &str, kind: &str) {
        self.failures
            .get_or_create(&FailureLabels {
                side: side.to_string(),
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Count one mid-stream migration attempt on `route` and its outcome.
    pub fn count_migration(&self, route: &str, outcome: &str) {
        self.migrations
            .get_or_create(&MigrationLabels {
                route: route.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Count one request sent to a decode worker to prefill itself.
    pub fn count_local_prefill(&self, route: &str, reason: &str) {
        self.local_prefills
            .get_or_create(&LocalLabels {
                route: route.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Count one retry of a request on `route`.
    pub fn count_retry(&self, route: &str) {
        self.retries
            .get_or_create(&RetryLabels {
                route: route.to_string(),
            })
            .inc();
    }

    /// The in-flight gauge of a worker.
    pub fn in_flight_gauge(&self, worker: &str, role: &str) -> Gauge {
        self.in_flight
            .get_or_create(&WorkerLabels {
                worker: worker.to_string(),
                role: role.to_string(),
            })
            .clone()
    }

    /// Set a worker's health gauge.
    pub fn set_healthy(&self, worker: &str, role: &str, healthy: bool) {
        self.healthy
            .get_or_create(&WorkerLabels {
                worker: worker.to_string(),
                role: role.to_string(),
            })
            .set(i64::from(healthy));
    }

    /// Record that a request reached `stage` `secs` after arrival.
    pub fn observe_stage(&self, stage: &str, secs: f64) {
        self.stages
            .get_or_create(&StageLabels {
                stage: stage.to_string(),
            })
            .observe(secs);
    }

    /// Record a first relayed token `secs` after arrival.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.observe(secs);
    }

    /// Record a gap of `secs` between relayed chunks.
    pub fn observe_itl(&self, secs: f64) {
        self.itl.observe(secs);
    }

    /// Record a finished request.
    pub fn observe_e2e(&self, secs: f64) {
        self.e2e.observe(secs);
    }

    /// Set SGLang's aggregates of `role` (`prefill` or `decode`) from its
    /// workers' summed load.
    pub fn set_role_load(&self, role: &str, load: &RoleLoad) {
        self.field.set(role, load);
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = crate::http::exposition::encode_part(&self.registry);
        out.push_str(&crate::http::exposition::encode_part(&self.field_registry));
        out.push_str("# EOF\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_every_metric() {
        let m = RouterMetrics::new();
        m.count_request("/generate", 200);
        m.count_failure("decode", "unreachable");
        m.count_retry("/generate");
        m.in_flight_gauge("http://d", "decode").inc();
        m.set_healthy("http://d", "decode", true);
        m.observe_stage("first_token", 0.01);
        m.observe_ttft(0.01);
        let mut decode = RoleLoad::default();
        decode.add(&serde_json::json!([{"num_reqs": 3, "num_waiting_reqs": 1,
            "num_tokens": 64, "max_total_num_tokens": 256, "model_name": "smol",
            "gen_throughput": 10.5, "generation_tokens": 7, "prompt_tokens": 20}]));
        decode.add(&serde_json::json!([{"num_reqs": 1, "num_tokens": 64,
            "max_total_num_tokens": 256, "gen_throughput": 2.0}]));
        m.set_role_load("decode", &decode);
        let text = m.render();
        for needle in [
            "handoff_router_requests_total{route=\"/generate\",status=\"200\"} 1",
            "handoff_router_worker_failures_total{side=\"decode\",kind=\"unreachable\"} 1",
            "handoff_router_retries_total{route=\"/generate\"} 1",
            "handoff_router_worker_in_flight{worker=\"http://d\",role=\"decode\"} 1",
            "handoff_router_worker_healthy{worker=\"http://d\",role=\"decode\"} 1",
            "handoff_router_stage_seconds_count{stage=\"first_token\"} 1",
            "handoff_router_time_to_first_token_seconds_count 1",
            "sglang:num_running_reqs{model_name=\"smol\",role=\"decode\"} 3",
            "sglang:num_queue_reqs{model_name=\"smol\",role=\"decode\"} 1",
            "sglang:num_used_tokens{model_name=\"smol\",role=\"decode\"} 128",
            "sglang:token_usage{model_name=\"smol\",role=\"decode\"} 0.25",
            "sglang:gen_throughput{model_name=\"smol\",role=\"decode\"} 12.5",
            "sglang:generation_tokens_total{model_name=\"smol\",role=\"decode\"} 7",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
    }
}
