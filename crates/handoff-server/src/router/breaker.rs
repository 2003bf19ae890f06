//! A circuit breaker per worker (issue 32 item 5): health probes say
//! whether a worker answers `/health`; the breaker says whether its
//! *requests* keep failing. After [`FAILURES_TO_OPEN`] failed requests in a
//! row the circuit opens and the router sends the worker nothing for a
//! backoff that doubles at each reopening (from [`BASE_BACKOFF`] up to
//! [`MAX_BACKOFF`]), times a jitter in 0.5..1.5 so that routers (and
//! workers) do not all retry at once. Past the backoff the circuit is half
//! open: requests go again, and the first result decides — a success closes
//! it (and forgets the backoff), a failure opens it again for twice as long.
//!
//! Time is passed in, so the state machine is tested without sleeping.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Failed requests in a row that open the circuit.
pub const FAILURES_TO_OPEN: u32 = 3;
/// The first open period (before jitter).
pub const BASE_BACKOFF: Duration = Duration::from_secs(1);
/// The longest open period (before jitter).
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Where a circuit stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Circuit {
    /// Requests flow.
    Closed,
    /// No request until the backoff ends.
    Open,
    /// The backoff ended: requests flow, and the next result decides.
    HalfOpen,
}

impl Circuit {
    /// `closed`, `open` or `half_open`.
    pub fn name(self) -> &'static str {
        match self {
            Circuit::Closed => "closed",
            Circuit::Open => "open",
            Circuit::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Failed requests since the last success.
    failures: u32,
    /// Times opened since the last success (the backoff's exponent).
    opened: u32,
    /// Open until then.
    until: Option<Instant>,
    /// Its last open period, for `/workers`.
    backoff: Duration,
}

/// One worker's breaker.
#[derive(Debug, Default)]
pub struct Breaker {
    state: Mutex<State>,
}

impl Breaker {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the circuit stands at `now`.
    pub fn circuit(&self, now: Instant) -> Circuit {
        match self.lock().until {
            None => Circuit::Closed,
            Some(t) if now < t => Circuit::Open,
            Some(_) => Circuit::HalfOpen,
        }
    }

    /// Whether a request may go at `now` (closed or half open).
    pub fn allows(&self, now: Instant) -> bool {
        self.circuit(now) != Circuit::Open
    }

    /// A request succeeded: the circuit closes and forgets its backoff.
    pub fn success(&self) {
        let mut s = self.lock();
        *s = State::default();
    }

    /// A request failed at `now`; `jitter` in 0.5..1.5 scales a new open
    /// period. Returns the open period when this failure opened the circuit.
    pub fn failure(&self, now: Instant, jitter: f64) -> Option<Duration> {
        let mut s = self.lock();
        s.failures = s.failures.saturating_add(1);
        let half_open = s.until.is_some_and(|t| now >= t);
        let open = s.until.is_some_and(|t| now < t);
        if open || (!half_open && s.failures < FAILURES_TO_OPEN) {
            return None;
        }
        let doubled = BASE_BACKOFF.saturating_mul(1u32 << s.opened.min(16));
        let backoff = doubled.min(MAX_BACKOFF).mul_f64(jitter.clamp(0.5, 1.5));
        s.opened = s.opened.saturating_add(1);
        s.until = Some(now + backoff);
        s.backoff = backoff;
        Some(backoff)
    }

    /// Its `/workers` fields at `now`.
    pub fn describe(&self, now: Instant) -> Value {
        let circuit = self.circuit(now);
        let s = self.lock();
        let mut v = json!({
            "circuit": circuit.name(),
            "consecutive_failures": s.failures,
        });
        if let Some(t) = s.until {
            v["circuit_open_for_ms"] = json!(t.saturating_duration_since(now).as_millis() as u64);
            v["circuit_backoff_ms"] = json!(s.backoff.as_millis() as u64);
        }
        v
    }
}

/// A jitter factor in 0.5..1.5.
pub fn jitter() -> f64 {
    0.5 + rand::random::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_three_failures_and_backs_off_doubling_with_jitter() {
        let b = Breaker::default();
        let t0 = Instant::now();
        assert_eq!(b.failure(t0, 1.0), None);
        assert_eq!(b.failure(t0, 1.0), None);
        assert!(b.allows(t0), "two failures keep it closed");
        assert_eq!(b.failure(t0, 1.0), Some(Duration::from_secs(1)));
        assert_eq!(b.circuit(t0), Circuit::Open);
        assert!(!b.allows(t0 + Duration::from_millis(999)));
        // Past the backoff: half open, one failure reopens it for twice as
        // long (jitter 1.5: 3 s).
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.circuit(t1), Circuit::HalfOpen);
        assert!(b.allows(t1));
        assert_eq!(b.failure(t1, 1.5), Some(Duration::from_secs(3)));
        assert!(!b.allows(t1 + Duration::from_millis(2999)));
        // Failures while open change nothing.
        assert_eq!(b.failure(t1, 1.0), None);
        let t2 = t1 + Duration::from_secs(3);
        assert_eq!(
            b.failure(t2, 0.5),
            Some(Duration::from_secs(2)),
            "4 s × 0.5"
        );
        // The backoff stops at 30 s.
        let mut t = t2;
        for _ in 0..10 {
            t += Duration::from_secs(60);
            b.failure(t, 1.0);
        }
        assert_eq!(b.describe(t)["circuit_backoff_ms"], 30_000);
        // A success closes it and forgets everything.
        b.success();
        assert_eq!(b.circuit(t), Circuit::Closed);
        assert_eq!(b.describe(t)["consecutive_failures"], 0);
        assert_eq!(b.failure(t, 1.0), None, "three failures again to open");
    }

    #[test]
    fn jitter_stays_in_its_band() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.5..1.5).contains(&j), "{j}");
        }
    }
}
