//! The router's own read-only routes: `/health`, `/readiness`, `/workers`,
//! `/get_load` and `/metrics` (the routes answered by workers are in
//! [`crate::router::forward`]).

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::router::RouterState;
use handoff_proto::Role;

/// `GET /health`: the router is up.
pub async fn health() -> &'static str {
    ""
}

/// `GET /readiness`: 200 `ready` when at least one prefill and one decode
/// worker are healthy, 200 `degraded` with decode workers only (they
/// prefill every prompt themselves), else 503 naming what is missing.
pub async fn readiness(State(state): State<RouterState>) -> Response {
    let (p, d) = (
        state.workers.healthy(Role::Prefill),
        state.workers.healthy(Role::Decode),
    );
    if p > 0 && d > 0 {
        return Json(json!({"status": "ready", "healthy_prefill": p, "healthy_decode": d}))
            .into_response();
    }
    if d > 0 {
        // The decode workers prefill every prompt themselves meanwhile.
        return Json(json!({
            "status": "degraded",
            "healthy_prefill": 0,
            "healthy_decode": d,
            "detail": "no prefill worker is healthy: decode workers prefill every prompt themselves",
        }))
        .into_response();
    }
    let missing = if p == 0 {
        "no prefill and no decode worker is healthy"
    } else {
        "no decode worker is healthy"
    };
    ApiError::new(503, "not_ready", missing).into_response()
}

/// `GET /workers`: every worker with its role, health, load and counts,
/// then the registrations discovery refused (`"health": "refused"` and the
/// reason).
pub async fn workers(State(state): State<RouterState>) -> Json<Value> {
    let mut all: Vec<Value> = state.workers.all().iter().map(|w| w.describe()).collect();
    all.extend(state.workers.refused());
    Json(Value::Array(all))
}

/// `GET /get_load`: each worker's last `/get_load` answer, labelled.
pub async fn get_load(State(state): State<RouterState>) -> Json<Value> {
    Json(Value::Array(
        state
            .workers
            .all()
            .iter()
            .map(|w| {
                json!({
                    "url": w.url,
                    "role": w.role.name(),
                    "health": w.health().name(),
                    "in_flight": w.in_flight(),
                    "load": w.last_load(),
                })
            })
            .collect(),
    ))
}

/// `GET /metrics`: the router's Prometheus exposition.
pub async fn metrics(State(state): State<RouterState>) -> Response {
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}
