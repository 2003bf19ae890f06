//! Admission by predicted time to first token (issue 32 item 4): a request
//! may carry an SLO on its TTFT (`slo_ttft_ms` in the body, or the
//! `x-slo-ttft-ms` header; `--slo-ttft-ms` is the default). The router
//! predicts the TTFT it would get from the prompt tokens queued at the
//! worker that would prefill it and a measured prefill rate, and answers a
//! request it cannot serve in time with a 429 and `Retry-After` at once,
//! instead of queueing it past its SLO.
//!
//! The rate is learned, not configured: each request that reached its first
//! token contributes (tokens queued before it at dispatch + its own) ÷ its
//! observed time to first token, averaged exponentially. Until one request
//! was measured nothing is refused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use serde_json::{Map, Value};

use crate::http::errors::ApiError;
use crate::router::workers::Worker;

/// Weight of a new sample in the rate's average.
const EWMA: f64 = 0.2;

/// The longest SLO accepted (a day).
const MAX_SLO_MS: u64 = 86_400_000;

/// The header that carries a request's TTFT SLO.
pub const SLO_HEADER: &str = "x-slo-ttft-ms";

/// The learned prefill rate.
#[derive(Debug, Default)]
pub struct Predictor {
    /// Tokens per second of prefill work, once measured.
    rate: Mutex<Option<f64>>,
}

impl Predictor {
    /// The predicted TTFT of a request of `own` prompt tokens behind
    /// `queued` ones; `None` before any measurement.
    pub fn predict(&self, queued: u64, own: u64) -> Option<Duration> {
        let rate = (*self.rate.lock().unwrap_or_else(|e| e.into_inner()))?;
        Some(Duration::from_secs_f64((queued + own) as f64 / rate))
    }

    /// A request whose prefill had `work` tokens to get through reached its
    /// first token after `ttft`.
    pub fn observe(&self, work: u64, ttft: Duration) {
        if work == 0 || ttft.is_zero() {
            return;
        }
        let sample = work as f64 / ttft.as_secs_f64();
        let mut r = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        *r = Some(match *r {
            None => sample,
            Some(old) => old + EWMA * (sample - old),
        });
    }

    /// The rate, tokens per second, once measured.
    pub fn rate(&self) -> Option<f64> {
        *self.rate.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A request's claim on its prefilling worker's queue: its tokens count as
/// queued there until its first token (or its end); then it teaches the
/// predictor how long the work took.
#[derive(Debug)]
pub struct Ticket {
    predictor: Arc<Predictor>,
    worker: Arc<Worker>,
    own: u64,
    work: u64,
    since: Instant,
    done: bool,
}

impl Ticket {
    /// `own` prompt tokens queued on `worker` now.
    pub fn queue(predictor: Arc<Predictor>, worker: Arc<Worker>, own: u64) -> Self {
        let queued = worker.queued_tokens().fetch_add(own, Ordering::Relaxed);
        Ticket {
            predictor,
            worker,
            own,
            work: queued + own,
            since: Instant::now(),
            done: false,
        }
    }

    /// The prompt's prefill ended now: measured (`observe`) when this is
    /// the time to its first token, else only released.
    pub fn prefilled(&mut self, observe: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        release(self.worker.queued_tokens(), self.own);
        if observe {
            self.predictor.observe(self.work, self.since.elapsed());
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            release(self.worker.queued_tokens(), self.own);
        }
    }
}

fn release(queued: &AtomicU64, n: u64) {
    let _ = queued.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
        Some(q.saturating_sub(n))
    });
}

/// The request's TTFT SLO: the body's `slo_ttft_ms` (taken out: workers do
/// not know it), else the header, else `default`.
pub fn slo_of(
    body: &mut Map<String, Value>,
    headers: &HeaderMap,
    default: Option<Duration>,
) -> Result<Option<Duration>, ApiError> {
    let bad = |field: &str, got: String| {
        ApiError::invalid_param(
            field,
            format!(
                "{field} must be an integer number of milliseconds in 1..={MAX_SLO_MS}, got {got}"
            ),
        )
    };
    if let Some(v) = body.remove("slo_ttft_ms") {
        return match v.as_u64() {
            Some(ms) if (1..=MAX_SLO_MS).contains(&ms) => Ok(Some(Duration::from_millis(ms))),
            _ => Err(bad("slo_ttft_ms", v.to_string())),
        };
    }
    if let Some(h) = headers.get(SLO_HEADER) {
        let text = String::from_utf8_lossy(h.as_bytes()).to_string();
        return match text.trim().parse::<u64>() {
            Ok(ms) if (1..=MAX_SLO_MS).contains(&ms) => Ok(Some(Duration::from_millis(ms))),
            _ => Err(bad(SLO_HEADER, format!("{text:?}"))),
        };
    }
    Ok(default)
}

/// The 429 of a request whose predicted TTFT exceeds its SLO.
pub fn shed(predicted: Duration, slo: Duration) -> ApiError {
    ApiError::new(
        429,
        "slo_unreachable",
        format!(
            "the predicted time to first token, {} ms, exceeds this request's SLO of {} ms: retry later",
            predicted.as_millis(),
            slo.as_millis()
        ),
    )
}

/// Seconds to wait before retrying: about how much later the queue would
/// let the SLO be met, at least 1.
pub fn retry_after(predicted: Duration, slo: Duration) -> u64 {
    predicted.saturating_sub(slo).as_secs_f64().ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_learned_and_predicts_linearly() {
        let p = Predictor::default();
        assert_eq!(
            p.predict(100, 10),
            None,
            "nothing refused before a measurement"
        );
        p.observe(1000, Duration::from_millis(500));
        assert_eq!(p.rate(), Some(2000.0));
        assert_eq!(p.predict(990, 10), Some(Duration::from_millis(500)));
        p.observe(1000, Duration::from_millis(1000));
        // 2000 + 0.2 × (1000 − 2000)
        assert_eq!(p.rate(), Some(1800.0));
        p.observe(0, Duration::from_millis(10));
        assert_eq!(p.rate(), Some(1800.0), "an empty sample is ignored");
    }

    #[test]
    fn slos_come_from_the_body_then_the_header_then_the_default() {
        let mut h = HeaderMap::new();
        let default = Some(Duration::from_millis(7));
        let mut body = serde_json::json!({"slo_ttft_ms": 250, "x": 1})
            .as_object()
            .unwrap()
            .clone();
        h.insert(SLO_HEADER, "900".parse().unwrap());
        assert_eq!(
            slo_of(&mut body, &h, default).unwrap(),
            Some(Duration::from_millis(250))
        );
        assert!(!body.contains_key("slo_ttft_ms"), "taken out of the body");
        assert_eq!(
            slo_of(&mut body, &h, default).unwrap(),
            Some(Duration::from_millis(900))
        );
        assert_eq!(
            slo_of(&mut body, &HeaderMap::new(), default).unwrap(),
            default
        );
        let mut bad = serde_json::json!({"slo_ttft_ms": 0})
            .as_object()
            .unwrap()
            .clone();
        let e = slo_of(&mut bad, &h, None).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message.contains("slo_ttft_ms must be an integer"),
            "{}",
            e.message
        );
        h.insert(SLO_HEADER, "soon".parse().unwrap());
        let e = slo_of(&mut Map::new(), &h, None).unwrap_err();
        assert!(e.message.contains("x-slo-ttft-ms"), "{}", e.message);
    }

    #[test]
    fn retry_after_is_the_excess_rounded_up_and_at_least_a_second() {
        let ms = Duration::from_millis;
        assert_eq!(retry_after(ms(1200), ms(1000)), 1);
        assert_eq!(retry_after(ms(3500), ms(1000)), 3);
        assert_eq!(retry_after(ms(900), ms(1000)), 1);
    }
}
