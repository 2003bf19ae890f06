//! The worker registry and its health loop: each worker's
//! role, health, last reported load and requests in flight at the router.
//!
//! Health: a worker starts `Unknown`; a good probe (`GET /health` answering
//! 2xx within the probe timeout) makes it `Healthy`; `unhealthy_after`
//! consecutive failed probes make a healthy worker `Unhealthy` (one failed
//! probe for a worker never seen healthy); a request that cannot connect
//! makes it `Unhealthy` at once. Dispatch uses `Healthy` and `Unknown`
//! workers whose circuit breaker ([`crate::router::breaker`]) is not open;
//! readiness needs a `Healthy` decode worker (and a prefill, else it is
//! `degraded`).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use serde_json::{json, Value};

use crate::router::config::{worker_host, RouterConfig, RouterConfigError, DEFAULT_BOOTSTRAP_PORT};
use crate::router::metrics::RouterMetrics;
use handoff_proto::Role;

/// A worker's health as the router knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Not probed yet.
    Unknown,
    /// Passed its last probe.
    Healthy,
    /// Failed its probes (or a request could not reach it).
    Unhealthy,
}

impl Health {
    fn from_u8(v: u8) -> Health {
        match v {
            1 => Health::Healthy,
            2 => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }

    /// `unknown`, `healthy` or `unhealthy`.
    pub fn name(self) -> &'static str {
        match self {
            Health::Unknown => "unknown",
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
        }
    }
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    /// HTTP base URL, without a trailing slash.
    pub url: String,
    /// Its role.
    pub role: Role,
    /// Host part of the URL (the `bootstrap_host` of a prefill worker).
    pub host: String,
    /// Bootstrap port (prefill workers).
    pub bootstrap_port: u16,
    health: AtomicU8,
    failed_probes: AtomicU32,
    reported_load: AtomicU64,
    last_load: Mutex<Value>,
    in_flight: AtomicU64,
    served: AtomicU64,
    /// Prompt tokens of requests it prefills that have not reached their
    /// first token ([`crate::router::admission`]).
    queued: AtomicU64,
    gauge: Gauge,
    breaker: crate::router::breaker::Breaker,
}

impl Worker {
    fn new(
        url: &str,
        role: Role,
        bootstrap_port: u16,
        metrics: &RouterMetrics,
    ) -> Result<Self, RouterConfigError> {
        let host = worker_host(url)?;
        let url = url.trim_end_matches('/').to_string();
        Ok(Worker {
            gauge: metrics.in_flight_gauge(&url, role.name()),
            url,
            role,
            host,
            bootstrap_port,
            health: AtomicU8::new(0),
            failed_probes: AtomicU32::new(0),
            reported_load: AtomicU64::new(0),
            last_load: Mutex::new(Value::Null),
            in_flight: AtomicU64::new(0),
            served: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            breaker: Default::default(),
        })
    }

    /// Its health now.
    pub fn health(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Relaxed))
    }

    /// Whether requests may be sent to it.
    pub fn dispatchable(&self) -> bool {
        self.health() != Health::Unhealthy && self.breaker.allows(std::time::Instant::now())
    }

    /// A request to it failed for a reason of its own (unreachable, broke
    /// off, stalled, a 5xx): counts toward opening its circuit.
    pub fn request_failed(&self) {
        if let Some(backoff) = self
            .breaker
            .failure(std::time::Instant::now(), crate::router::breaker::jitter())
        {
            tracing::warn!(
                worker = %self.url,
                role = self.role.name(),
                backoff_ms = backoff.as_millis() as u64,
                "circuit open: requests keep failing, none sent for the backoff"
            );
        }
    }

    /// Prompt tokens queued on it for prefill (router's view).
    pub fn queued_tokens(&self) -> &AtomicU64 {
        &self.queued
    }

    /// A request to it succeeded: its circuit closes.
    pub fn request_succeeded(&self) {
        self.breaker.success();
    }

    /// Requests in flight at the router plus the load it last reported.
    pub fn load(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed) + self.reported_load.load(Ordering::Relaxed)
    }

    /// Requests of this router in flight on it.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests this router has sent it.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Its last `/get_load` answer (`null` before the first).
    pub fn last_load(&self) -> Value {
        self.last_load
            .lock()
            .map(|v| v.clone())
            .unwrap_or(Value::Null)
    }

    /// A request could not reach it, or it said it is draining: unhealthy
    /// at once (a good probe makes it healthy again).
    pub fn mark_unreachable(&self) {
        self.health.store(2, Ordering::Relaxed);
    }

    /// Record a probe's outcome.
    fn record_probe(&self, ok: bool, unhealthy_after: u32) {
        if ok {
            self.failed_probes.store(0, Ordering::Relaxed);
            self.health.store(1, Ordering::Relaxed);
            return;
        }
        let fails = self.failed_probes.fetch_add(1, Ordering::Relaxed) + 1;
        if self.health() != Health::Healthy || fails >= unhealthy_after.max(1) {
            self.health.store(2, Ordering::Relaxed);
        }
    }

    /// Count a request on it until the guard drops.
    pub fn start_request(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.served.fetch_add(1, Ordering::Relaxed);
        self.gauge.inc();
        InFlightGuard {
            worker: Arc::clone(self),
        }
    }

    /// The `/workers` entry.
    pub fn describe(&self) -> Value {
        let mut v = json!({
            "url": self.url,
            "role": self.role.name(),
            "health": self.health().name(),
            "healthy": self.health() == Health::Healthy,
            "load": self.load(),
            "in_flight": self.in_flight(),
            "served": self.served(),
            "queued_prompt_tokens": self.queued.load(Ordering::Relaxed),
        });
        if let (Value::Object(v), Value::Object(b)) =
            (&mut v, self.breaker.describe(std::time::Instant::now()))
        {
            v.extend(b);
        }
        if self.role == Role::Prefill {
            v["bootstrap_port"] = json!(self.bootstrap_port);
        }
        v
    }
}

/// A request in flight on a worker; dropping it ends the count.
#[derive(Debug)]
pub struct InFlightGuard {
    worker: Arc<Worker>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.worker.gauge.dec();
    }
}

/// Every worker of the router: the ones on its command line and, with
/// discovery, the ones registered in etcd, added and removed live.
/// Readers take a snapshot of a role's list (an `Arc`, cheap to clone).
#[derive(Debug)]
pub struct Workers {
    prefill: RwLock<Arc<Vec<Arc<Worker>>>>,
    decode: RwLock<Arc<Vec<Arc<Worker>>>>,
    /// Registrations discovery refused (a different model), for `/workers`.
    refused: Mutex<Vec<Value>>,
}

impl Workers {
    /// The registry of a configuration.
    pub fn new(config: &RouterConfig, metrics: &RouterMetrics) -> Result<Self, RouterConfigError> {
        config.validate()?;
        let prefill = config
            .prefill
            .iter()
            .map(|p| {
                Worker::new(
                    &p.url,
                    Role::Prefill,
                    p.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
                    metrics,
                )
                .map(Arc::new)
            })
            .collect::<Result<_, _>>()?;
        let decode = config
            .decode
            .iter()
            .map(|d| Worker::new(d, Role::Decode, 0, metrics).map(Arc::new))
            .collect::<Result<_, _>>()?;
        Ok(Workers {
            prefill: RwLock::new(Arc::new(prefill)),
            decode: RwLock::new(Arc::new(decode)),
            refused: Mutex::new(Vec::new()),
        })
    }

    fn list(&self, role: Role) -> &RwLock<Arc<Vec<Arc<Worker>>>> {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// The workers of one role now.
    pub fn of(&self, role: Role) -> Arc<Vec<Arc<Worker>>> {
        self.list(role)
            .read()
            .map(|l| Arc::clone(&l))
            .unwrap_or_else(|e| Arc::clone(&e.into_inner()))
    }

    /// Every worker now, prefill first.
    pub fn all(&self) -> Vec<Arc<Worker>> {
        let mut out = self.of(Role::Prefill).to_vec();
        out.extend(self.of(Role::Decode).iter().cloned());
        out
    }

    /// Add a worker of `role` at `url` (discovery); false if one with that
    /// URL is already there.
    pub fn add(
        &self,
        url: &str,
        role: Role,
        bootstrap_port: u16,
        metrics: &RouterMetrics,
    ) -> Result<bool, RouterConfigError> {
        let w = Arc::new(Worker::new(url, role, bootstrap_port, metrics)?);
        let mut l = self.list(role).write().unwrap_or_else(|e| e.into_inner());
        if l.iter().any(|x| x.url == w.url) {
            return Ok(false);
        }
        let mut next = l.to_vec();
        next.push(w);
        *l = Arc::new(next);
        Ok(true)
    }

    /// Remove the worker of `role` at `url` (discovery: its key is gone);
    /// requests already on it finish. Whether it was there.
    pub fn remove(&self, url: &str, role: Role) -> bool {
        let url = url.trim_end_matches('/');
        let mut l = self.list(role).write().unwrap_or_else(|e| e.into_inner());
        let next: Vec<Arc<Worker>> = l.iter().filter(|w| w.url != url).cloned().collect();
        let gone = next.len() != l.len();
        *l = Arc::new(next);
        gone
    }

    /// Record a registration discovery refused, with why.
    pub fn refuse(&self, entry: Value) {
        let mut r = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(key) = entry.get("key") {
            r.retain(|e| e.get("key") != Some(key));
        }
        r.push(entry);
    }

    /// Forget a refused registration whose key is gone.
    pub fn forget_refused(&self, key: &str) {
        let mut r = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|e| e.get("key").and_then(Value::as_str) != Some(key));
    }

    /// Registrations discovery refused.
    pub fn refused(&self) -> Vec<Value> {
        self.refused.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// How many workers of `role` passed their last probe.
    pub fn healthy(&self, role: Role) -> usize {
        self.of(role)
            .iter()
            .filter(|w| w.health() == Health::Healthy)
            .count()
    }

    /// At least one healthy worker of each role.
    pub fn ready(&self) -> bool {
        let healthy = |ws: &[Arc<Worker>]| ws.iter().any(|w| w.health() == Health::Healthy);
        healthy(&self.of(Role::Prefill)) && healthy(&self.of(Role::Decode))
    }

    /// Probe every worker once, concurrently.
    pub async fn probe_all(
        &self,
        client: &reqwest::Client,
        timeout: Duration,
        unhealthy_after: u32,
        metrics: &RouterMetrics,
    ) {
        let all = self.all();
        let probes = all.iter().map(|w| async move {
            let ok = probe_health(client, w, timeout).await;
            if ok {
                if let Some(load) = probe_load(client, w, timeout).await {
                    w.reported_load.store(total_reqs(&load), Ordering::Relaxed);
                    if let Ok(mut l) = w.last_load.lock() {
                        *l = load;
                    }
                }
            }
            let was = w.health();
            w.record_probe(ok, unhealthy_after);
            let now = w.health();
            if was != now {
                tracing::info!(worker = %w.url, role = w.role.name(), "worker is {}", now.name());
            }
            metrics.set_healthy(&w.url, w.role.name(), now == Health::Healthy);
        });
        futures_util::future::join_all(probes).await;
        for role in [Role::Prefill, Role::Decode] {
            let mut sum = crate::worker::field_metrics::RoleLoad::default();
            for w in self
                .of(role)
                .iter()
                .filter(|w| w.health() == Health::Healthy)
            {
                sum.add(&w.last_load());
            }
            if sum.model_name.is_empty() {
                // No healthy worker: the gauges drop to zero under the name
                // the role's workers last reported.
                let mut any = crate::worker::field_metrics::RoleLoad::default();
                self.of(role).iter().for_each(|w| any.add(&w.last_load()));
                sum.model_name = any.model_name;
            }
            if !sum.model_name.is_empty() {
                metrics.set_role_load(role.name(), &sum);
            }
        }
    }
}

async fn probe_health(client: &reqwest::Client, w: &Worker, timeout: Duration) -> bool {
    let req = client.get(format!("{}/health", w.url)).timeout(timeout);
    matches!(req.send().await, Ok(r) if r.status().is_success())
}

async fn probe_load(client: &reqwest::Client, w: &Worker, timeout: Duration) -> Option<Value> {
    let resp = client
        .get(format!("{}/get_load", w.url))
        .timeout(timeout)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json::<Value>().await.ok()
}

/// Sum of `num_reqs` over the ranks of a `/get_load` answer (an array of
/// `{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}`, or one such object).
pub fn total_reqs(load: &Value) -> u64 {
    let one = |v: &Value| v.get("num_reqs").and_then(Value::as_u64).unwrap_or(0);
    match load {
        Value::Array(ranks) => ranks.iter().map(one).sum(),
        v => one(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Worker {
        Worker::new(
            "http://127.0.0.1:1/",
            Role::Decode,
            0,
            &RouterMetrics::new(),
        )
        .unwrap()
    }

    #[test]
    fn health_transitions() {
        let w = worker();
        assert_eq!(w.url, "http://127.0.0.1:1");
        assert_eq!(w.health(), Health::Unknown);
        assert!(w.dispatchable());
        w.record_probe(false, 2);
        assert_eq!(
            w.health(),
            Health::Unhealthy,
            "never seen healthy: one failure"
        );
        w.record_probe(true, 2);
        assert_eq!(w.health(), Health::Healthy);
        w.record_probe(false, 2);
        assert_eq!(w.health(), Health::Healthy, "one failure is tolerated");
        w.record_probe(false, 2);
        assert_eq!(w.health(), Health::Unhealthy);
        w.record_probe(true, 2);
        w.mark_unreachable();
        assert!(!w.dispatchable());
    }

    #[test]
    fn in_flight_guard_counts() {
        let w = Arc::new(worker());
        let g = w.start_request();
        assert_eq!((w.in_flight(), w.served(), w.load()), (1, 1, 1));
        drop(g);
        assert_eq!((w.in_flight(), w.served()), (0, 1));
    }

    #[test]
    fn load_sums_ranks() {
        let v = json!([{"dp_rank":0,"num_reqs":3},{"dp_rank":1,"num_reqs":4}]);
        assert_eq!(total_reqs(&v), 7);
        assert_eq!(total_reqs(&json!({"num_reqs": 2})), 2);
        assert_eq!(total_reqs(&Value::Null), 0);
    }
}
