//! The router's own read-only routes: `/health`, `/readiness`, `/workers`,
//! `/get_load`, `/metrics`, and `/v1/models` forwarded from a decode worker.

use axum::body::Body;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::router::workers::Health;
use crate::router::RouterState;
use handoff_proto::Role;

/// `GET /health`: the router is up.
pub async fn health() -> &'static str {
    ""
}

/// `GET /readiness`: 200 when at least one prefill and one decode worker
/// are healthy, else 503 naming what is missing.
pub async fn readiness(State(state): State<RouterState>) -> Response {
    let count = |role| {
        state
            .workers
            .of(role)
            .iter()
            .filter(|w| w.health() == Health::Healthy)
            .count()
    };
    let (p, d) = (count(Role::Prefill), count(Role::Decode));
    if p > 0 && d > 0 {
        return Json(json!({"status": "ready", "healthy_prefill": p, "healthy_decode": d}))
            .into_response();
    }
    let missing = match (p, d) {
        (0, 0) => "no prefill and no decode worker is healthy",
        (0, _) => "no prefill worker is healthy",
        _ => "no decode worker is healthy",
    };
    ApiError::new(503, "not_ready", missing).into_response()
}

/// `GET /workers`: every worker with its role, health, load and counts.
pub async fn workers(State(state): State<RouterState>) -> Json<Value> {
    Json(Value::Array(
        state.workers.all().map(|w| w.describe()).collect(),
    ))
}

/// `GET /get_load`: each worker's last `/get_load` answer, labelled.
pub async fn get_load(State(state): State<RouterState>) -> Json<Value> {
    Json(Value::Array(
        state
            .workers
            .all()
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

/// `POST`/`GET /flush_cache`: every worker empties its prefix cache; the
/// answer lists each worker's reply (200 when all of them flushed, 502
/// naming those that could not).
pub async fn flush_cache(State(state): State<RouterState>) -> Response {
    let calls = state.workers.all().map(|w| {
        let client = state.client.clone();
        let timeout = state.config.health_timeout;
        let (url, role) = (w.url.clone(), w.role.name());
        async move {
            let r = client
                .post(format!("{url}/flush_cache"))
                .timeout(timeout)
                .send()
                .await;
            let (status, message) = match r {
                Ok(r) => {
                    let s = r.status().as_u16();
                    (s, r.text().await.unwrap_or_default().trim().to_string())
                }
                Err(e) => (502, format!("unreachable: {e}")),
            };
            json!({"url": url, "role": role, "status": status, "message": message})
        }
    });
    let replies: Vec<Value> = futures_util::future::join_all(calls).await;
    let ok = replies.iter().all(|r| r["status"] == 200);
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    (status, Json(json!({ "workers": replies }))).into_response()
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

/// `GET /v1/models`: forwarded from the first healthy (else dispatchable)
/// decode worker.
pub async fn models(State(state): State<RouterState>) -> Response {
    let decode = state.workers.of(Role::Decode);
    let worker = decode
        .iter()
        .find(|w| w.health() == Health::Healthy)
        .or_else(|| decode.iter().find(|w| w.dispatchable()));
    let Some(w) = worker else {
        return ApiError::new(
            503,
            "no_healthy_worker",
            "no healthy decode worker is available",
        )
        .into_response();
    };
    let url = format!("{}/v1/models", w.url);
    let answer = state
        .client
        .get(&url)
        .timeout(state.config.health_timeout)
        .send()
        .await;
    let resp = match answer {
        Ok(r) => r,
        Err(e) => {
            return ApiError::new(
                502,
                "worker_unreachable",
                format!("decode worker {} is unreachable: {e}", w.url),
            )
            .into_response()
        }
    };
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ct = resp.headers().get(CONTENT_TYPE).cloned();
    match resp.bytes().await {
        Ok(body) => {
            let mut out = Response::new(Body::from(body));
            *out.status_mut() = status;
            if let Some(ct) = ct {
                out.headers_mut().insert(CONTENT_TYPE, ct);
            }
            out
        }
        Err(e) => ApiError::new(
            502,
            "worker_unreachable",
            format!(
                "decode worker {} broke off its /v1/models answer: {e}",
                w.url
            ),
        )
        .into_response(),
    }
}
