//! A worker's drain gate (issue 15 item 4). When a worker is told to stop it
//! first leaves discovery, then closes this gate: from then on it answers
//! every request that would start work (`/generate`, the OpenAI routes,
//! `/health_generate`) and every health check (`/health`, `/readiness`) with
//! a 503 `draining` and `Connection: close`, while the requests it already
//! has run to their end. A router that still picks it (its view is a moment
//! old) gets an answer that says nothing started, so it retries the request
//! on another replica with a fresh room, and it marks the worker unhealthy
//! at once. The listener itself closes only after [`DRAIN_LINGER`], when no
//! router sends here any more; closing it at once would race a router's
//! request on a kept-alive connection, which then breaks off with no way to
//! tell whether the worker started it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::header::{CONNECTION, RETRY_AFTER};
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::http::errors::ApiError;

/// How long a draining worker keeps answering (503 to new work) before it
/// stops accepting connections.
pub const DRAIN_LINGER: Duration = Duration::from_secs(1);

/// The error code of a draining worker's refusals.
pub const DRAINING_CODE: &str = "draining";

/// Paths a draining worker refuses: those that start work and those that
/// say whether to send it work.
const GATED: &[&str] = &[
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/readiness",
    "/health_generate",
];

/// Open until [`DrainGate::close`]; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct DrainGate(Arc<AtomicBool>);

impl DrainGate {
    /// An open gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuse new work from now on.
    pub fn close(&self) {
        if !self.0.swap(true, Ordering::SeqCst) {
            tracing::info!(
                "draining: new requests are refused (503 draining); in-flight ones finish"
            );
        }
    }

    /// Whether the gate is closed.
    pub fn draining(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Wrap `app` so that it refuses gated paths once the gate is closed.
    pub fn guard(&self, app: Router) -> Router {
        app.layer(middleware::from_fn_with_state(self.clone(), gate))
    }
}

/// The refusal of a draining worker.
pub fn draining_response() -> Response {
    let mut resp = ApiError::new(
        503,
        DRAINING_CODE,
        "this worker is shutting down: send the request to another worker",
    )
    .into_response();
    let h = resp.headers_mut();
    h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
    h.insert(CONNECTION, HeaderValue::from_static("close"));
    resp
}

async fn gate(
    axum::extract::State(gate): axum::extract::State<DrainGate>,
    req: Request,
    next: Next,
) -> Response {
    if gate.draining() && GATED.contains(&req.uri().path()) {
        return draining_response();
    }
    next.run(req).await
}

/// Whether an error body is a draining worker's refusal.
pub fn is_draining_body(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(|c| c == DRAINING_CODE))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::{get, post};
    use tower_service::Service;

    async fn call(app: &mut Router, method: &str, path: &str) -> (u16, Option<String>, Vec<u8>) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let resp = app.call(req).await.unwrap();
        let status = resp.status().as_u16();
        let conn = resp
            .headers()
            .get(CONNECTION)
            .map(|v| v.to_str().unwrap().to_string());
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, conn, body.to_vec())
    }

    #[tokio::test]
    async fn a_closed_gate_refuses_new_work_and_health_only() {
        let gate = DrainGate::new();
        let mut app = gate.guard(
            Router::new()
                .route("/generate", post(|| async { "generated" }))
                .route("/health", get(|| async { "ok" }))
                .route("/metrics", get(|| async { "m" })),
        );
        assert_eq!(call(&mut app, "POST", "/generate").await.0, 200);
        gate.close();
        assert!(gate.draining());
        for (m, p) in [("POST", "/generate"), ("GET", "/health")] {
            let (status, conn, body) = call(&mut app, m, p).await;
            assert_eq!(status, 503, "{p}");
            assert_eq!(conn.as_deref(), Some("close"));
            assert!(
                is_draining_body(&body),
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
        let (status, _, body) = call(&mut app, "GET", "/metrics").await;
        assert_eq!((status, body.as_slice()), (200, b"m".as_slice()));
        assert!(!is_draining_body(br#"{"error":{"code":"queue_full"}}"#));
        assert!(!is_draining_body(b"not json"));
    }
}
