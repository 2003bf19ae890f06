//! The field's metric names: SGLang's `sglang:` counters,
//! gauges and histograms with their `model_name` label, next to handoff's
//! own `handoff_*` metrics, so dashboards built for SGLang
//! (`docs/references/production_metrics.md`, its Grafana dashboard) show a
//! handoff deployment. A worker records into one [`FieldMetrics`]; the
//! router fills one from its workers' reported load.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// SGLang's label on every metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    /// The served model name.
    pub model_name: String,
}

/// The label set of a router's aggregate, per worker role.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    /// The served model name.
    pub model_name: String,
    /// `prefill` or `decode`.
    pub role: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// SGLang's TTFT buckets (seconds).
const TTFT_BUCKETS: [f64; 20] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0,
];
/// SGLang's time-per-output-token buckets (seconds).
const TPOT_BUCKETS: [f64; 20] = [
    0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0,
];
/// SGLang's end-to-end latency buckets (seconds).
const E2E_BUCKETS: [f64; 16] = [
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
];

fn family<M: Default + Clone + prometheus_client::metrics::TypedMetric>(
    registry: &mut Registry,
    name: &str,
    help: &str,
) -> Family<ModelLabels, M>
where
    Family<ModelLabels, M>: prometheus_client::registry::Metric,
{
    let f = Family::<ModelLabels, M>::default();
    registry.register(name, help, f.clone());
    f
}

/// Makes each label set's histogram with SGLang's buckets.
#[derive(Debug, Clone, Copy)]
pub struct Buckets(&'static [f64]);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

type HistogramFamily = Family<ModelLabels, Histogram, Buckets>;

fn histogram(
    registry: &mut Registry,
    name: &str,
    help: &str,
    buckets: &'static [f64],
) -> HistogramFamily {
    let f = Family::new_with_constructor(Buckets(buckets));
    registry.register(name, help, f.clone());
    f
}

/// What a worker's engine holds now, for the gauges.
#[derive(Debug, Clone, Copy, Default)]
pub struct FieldLoad {
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Tokens of KV in use.
    pub used_tokens: usize,
    /// Tokens of KV the pool holds.
    pub total_tokens: usize,
}

/// SGLang-named metrics of one worker.
pub struct FieldMetrics {
    registry: Registry,
    labels: ModelLabels,
    prompt_tokens: Family<ModelLabels, Counter>,
    generation_tokens: Family<ModelLabels, Counter>,
    cached_tokens: Family<ModelLabels, Counter>,
    ttft: HistogramFamily,
    tpot: HistogramFamily,
    itl: HistogramFamily,
    e2e: HistogramFamily,
    running: Family<ModelLabels, Gauge>,
    queued: Family<ModelLabels, Gauge>,
    used_tokens: Family<ModelLabels, Gauge>,
    max_tokens: Family<ModelLabels, Gauge>,
    token_usage: Family<ModelLabels, FloatGauge>,
    cache_hit_rate: Family<ModelLabels, FloatGauge>,
    gen_throughput: Family<ModelLabels, FloatGauge>,
    /// (when, generated tokens) at the last throughput sample.
    last_sample: Mutex<(Instant, u64)>,
}

impl std::fmt::Debug for FieldMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FieldMetrics")
            .field("model_name", &self.labels.model_name)
            .finish_non_exhaustive()
    }
}

/// Throughput is averaged over at least this long between samples.
const THROUGHPUT_WINDOW_SECS: f64 = 1.0;

impl FieldMetrics {
    /// Every metric at zero, labelled with `model_name`.
    pub fn new(model_name: &str) -> Self {
        let mut r = Registry::default();
        let prompt_tokens = family(
            &mut r,
            "sglang:prompt_tokens",
            "Number of prefill tokens processed.",
        );
        let generation_tokens = family(
            &mut r,
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
        );
        let cached_tokens = family(
            &mut r,
            "sglang:cached_tokens",
            "Number of prompt tokens whose KV came from the prefix cache.",
        );
        let ttft = histogram(
            &mut r,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &TTFT_BUCKETS,
        );
        let tpot = histogram(
            &mut r,
            "sglang:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &TPOT_BUCKETS,
        );
        let itl = histogram(
            &mut r,
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &TPOT_BUCKETS,
        );
        let e2e = histogram(
            &mut r,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            &E2E_BUCKETS,
        );
        let running = family(
            &mut r,
            "sglang:num_running_reqs",
            "The number of running requests",
        );
        let queued = family(
            &mut r,
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue",
        );
        let used_tokens = family(
            &mut r,
            "sglang:num_used_tokens",
            "The number of used tokens",
        );
        let max_tokens = family(
            &mut r,
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens",
        );
        let token_usage = family(&mut r, "sglang:token_usage", "The token usage");
        let cache_hit_rate = family(&mut r, "sglang:cache_hit_rate", "The cache hit rate");
        let gen_throughput = family(
            &mut r,
            "sglang:gen_throughput",
            "The generate throughput (token/s)",
        );
        FieldMetrics {
            registry: r,
            labels: ModelLabels {
                model_name: model_name.to_string(),
            },
            prompt_tokens,
            generation_tokens,
            cached_tokens,
            ttft,
            tpot,
            itl,
            e2e,
            running,
            queued,
            used_tokens,
            max_tokens,
            token_usage,
            cache_hit_rate,
            gen_throughput,
            last_sample: Mutex::new((Instant::now(), 0)),
        }
    }

    /// Record a first token `secs` after arrival.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.get_or_create(&self.labels).observe(secs);
    }

    /// Record a gap of `secs` between two tokens.
    pub fn observe_itl(&self, secs: f64) {
        self.itl.get_or_create(&self.labels).observe(secs);
        self.tpot.get_or_create(&self.labels).observe(secs);
    }

    /// Record a generated token.
    pub fn count_generated(&self) {
        self.generation_tokens.get_or_create(&self.labels).inc();
    }

    /// Record a finished request: its latency, prompt and cached tokens.
    pub fn observe_finished(&self, e2e_secs: f64, prompt_tokens: usize, cached_tokens: usize) {
        self.e2e.get_or_create(&self.labels).observe(e2e_secs);
        self.prompt_tokens
            .get_or_create(&self.labels)
            .inc_by(prompt_tokens as u64);
        self.cached_tokens
            .get_or_create(&self.labels)
            .inc_by(cached_tokens as u64);
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> u64 {
        self.generation_tokens.get_or_create(&self.labels).get()
    }

    /// Prompt tokens of finished requests so far.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens.get_or_create(&self.labels).get()
    }

    /// Generated tokens per second since the previous sample (taken at least
    /// [`THROUGHPUT_WINDOW_SECS`] ago; the last value otherwise).
    pub fn throughput(&self) -> f64 {
        let gauge = self.gen_throughput.get_or_create(&self.labels).clone();
        let now = Instant::now();
        let count = self.generated();
        let Ok(mut last) = self.last_sample.lock() else {
            return gauge.get();
        };
        let secs = now.duration_since(last.0).as_secs_f64();
        if secs >= THROUGHPUT_WINDOW_SECS {
            gauge.set(count.saturating_sub(last.1) as f64 / secs);
            *last = (now, count);
        }
        gauge.get()
    }

    /// Set the gauges from the engine's load, then encode (without the EOF
    /// line: the caller ends the whole exposition).
    pub fn render(&self, load: FieldLoad) -> String {
        let l = &self.labels;
        let as_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.running.get_or_create(l).set(as_i64(load.running));
        self.queued.get_or_create(l).set(as_i64(load.waiting));
        self.used_tokens
            .get_or_create(l)
            .set(as_i64(load.used_tokens));
        self.max_tokens
            .get_or_create(l)
            .set(as_i64(load.total_tokens));
        self.token_usage
            .get_or_create(l)
            .set(load.used_tokens as f64 / load.total_tokens.max(1) as f64);
        let prompt = self.prompt_tokens();
        let cached = self.cached_tokens.get_or_create(l).get();
        self.cache_hit_rate
            .get_or_create(l)
            .set(cached as f64 / prompt.max(1) as f64);
        self.throughput();
        crate::http::exposition::encode_part(&self.registry)
    }
}

/// SGLang-named aggregates at the router: each role's running and waiting
/// requests, token usage and throughput, summed over its workers' last
/// reported load (`/get_load`, probed every health interval).
#[derive(Debug, Default)]
pub struct RouterFieldMetrics {
    running: Family<RoleLabels, Gauge>,
    queued: Family<RoleLabels, Gauge>,
    used_tokens: Family<RoleLabels, Gauge>,
    token_usage: Family<RoleLabels, FloatGauge>,
    gen_throughput: Family<RoleLabels, FloatGauge>,
    generation_tokens: Family<RoleLabels, Counter>,
    prompt_tokens: Family<RoleLabels, Counter>,
}

impl RoleLoad {
    /// Add one worker's `/get_load` answer (an array of ranks, or one rank).
    pub fn add(&mut self, load: &serde_json::Value) {
        let ranks = match load {
            serde_json::Value::Array(a) => a.iter().collect::<Vec<_>>(),
            v => vec![v],
        };
        for r in ranks {
            let n = |k: &str| r.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
            let reqs = n("num_reqs");
            let waiting = n("num_waiting_reqs");
            self.running += reqs.saturating_sub(waiting);
            self.waiting += waiting;
            self.used_tokens += n("num_tokens");
            self.total_tokens += n("max_total_num_tokens");
            self.generation_tokens += n("generation_tokens");
            self.prompt_tokens += n("prompt_tokens");
            self.gen_throughput += r
                .get("gen_throughput")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0);
            if self.model_name.is_empty() {
                if let Some(m) = r.get("model_name").and_then(serde_json::Value::as_str) {
                    self.model_name = m.to_string();
                }
            }
        }
    }
}

/// One role's sums over its workers' reports.
#[derive(Debug, Clone, Default)]
pub struct RoleLoad {
    /// The served model name the workers report.
    pub model_name: String,
    /// Running requests.
    pub running: u64,
    /// Waiting requests.
    pub waiting: u64,
    /// KV tokens in use.
    pub used_tokens: u64,
    /// KV tokens of the pools.
    pub total_tokens: u64,
    /// Generated tokens per second.
    pub gen_throughput: f64,
    /// Tokens generated so far.
    pub generation_tokens: u64,
    /// Prompt tokens of finished requests so far.
    pub prompt_tokens: u64,
}

impl RouterFieldMetrics {
    /// Register the aggregates in `registry` (which must have no prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "sglang:num_running_reqs",
            "The number of running requests, summed over the workers of a role",
            self.running.clone(),
        );
        registry.register(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue, summed over the workers of a role",
            self.queued.clone(),
        );
        registry.register(
            "sglang:num_used_tokens",
            "The number of used tokens, summed over the workers of a role",
            self.used_tokens.clone(),
        );
        registry.register(
            "sglang:token_usage",
            "The token usage of a role's pools together",
            self.token_usage.clone(),
        );
        registry.register(
            "sglang:gen_throughput",
            "The generate throughput (token/s), summed over the workers of a role",
            self.gen_throughput.clone(),
        );
        registry.register(
            "sglang:generation_tokens",
            "Number of generation tokens processed, summed over the workers of a role",
            self.generation_tokens.clone(),
        );
        registry.register(
            "sglang:prompt_tokens",
            "Number of prefill tokens processed, summed over the workers of a role",
            self.prompt_tokens.clone(),
        );
    }

    /// Set the aggregates of `role`.
    pub fn set(&self, role: &str, load: &RoleLoad) {
        let l = RoleLabels {
            model_name: load.model_name.clone(),
            role: role.to_string(),
        };
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.running.get_or_create(&l).set(as_i64(load.running));
        self.queued.get_or_create(&l).set(as_i64(load.waiting));
        self.used_tokens
            .get_or_create(&l)
            .set(as_i64(load.used_tokens));
        self.token_usage
            .get_or_create(&l)
            .set(load.used_tokens as f64 / load.total_tokens.max(1) as f64);
        self.gen_throughput
            .get_or_create(&l)
            .set(load.gen_throughput);
        // A sum of the workers' counters: it only grows while they live.
        let grow = |c: &Counter, v: u64| {
            c.inner().fetch_max(v, std::sync::atomic::Ordering::Relaxed);
        };
        grow(
            &self.generation_tokens.get_or_create(&l),
            load.generation_tokens,
        );
        grow(&self.prompt_tokens.get_or_create(&l), load.prompt_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_names_carry_the_model_label() {
        let m = FieldMetrics::new("smol");
        m.observe_ttft(0.03);
        m.observe_itl(0.01);
        m.count_generated();
        m.count_generated();
        m.observe_finished(0.2, 40, 16);
        let text = m.render(FieldLoad {
            running: 2,
            waiting: 3,
            used_tokens: 48,
            total_tokens: 192,
        });
        for needle in [
            "sglang:prompt_tokens_total{model_name=\"smol\"} 40",
            "sglang:generation_tokens_total{model_name=\"smol\"} 2",
            "sglang:cached_tokens_total{model_name=\"smol\"} 16",
            "sglang:time_to_first_token_seconds_count{model_name=\"smol\"} 1",
            "sglang:time_to_first_token_seconds_bucket{le=\"0.04\",model_name=\"smol\"} 1",
            "sglang:time_per_output_token_seconds_count{model_name=\"smol\"} 1",
            "sglang:inter_token_latency_seconds_count{model_name=\"smol\"} 1",
            "sglang:e2e_request_latency_seconds_count{model_name=\"smol\"} 1",
            "sglang:num_running_reqs{model_name=\"smol\"} 2",
            "sglang:num_queue_reqs{model_name=\"smol\"} 3",
            "sglang:num_used_tokens{model_name=\"smol\"} 48",
            "sglang:max_total_num_tokens{model_name=\"smol\"} 192",
            "sglang:token_usage{model_name=\"smol\"} 0.25",
            "sglang:cache_hit_rate{model_name=\"smol\"} 0.4",
            "sglang:gen_throughput{model_name=\"smol\"} 0",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }

    #[test]
    fn throughput_is_tokens_over_the_window() {
        let m = FieldMetrics::new("smol");
        if let Ok(mut last) = m.last_sample.lock() {
            last.0 = Instant::now() - std::time::Duration::from_secs(4);
        }
        for _ in 0..100 {
            m.count_generated();
        }
        let t = m.throughput();
        // 100 tokens over a little more than 4 s.
        assert!((20.0..=25.0).contains(&t), "{t}");
        // Asked again at once: the window is too short, the value stays.
        m.count_generated();
        assert_eq!(m.throughput(), t);
    }
}
