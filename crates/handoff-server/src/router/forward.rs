//! The worker API on the router's public port (issue 17 item 7): routes
//! answered by one worker (`/v1/models`, `/get_model_info`, `/server_info`,
//! `/tokenize`, `/detokenize`: every worker serves the same model), routes
//! every worker must hear (`/flush_cache`, `/abort_request`), and
//! `/health_generate`, which generates one token through a prefill and a
//! decode worker as a client request would.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use std::sync::Arc;

use crate::router::workers::{Health, Worker};
use crate::router::RouterState;
use handoff_proto::Role;

/// A healthy decode worker (else a dispatchable one): it answers the routes
/// any worker can answer.
fn answering_worker(state: &RouterState) -> Result<Arc<Worker>, ApiError> {
    let decode = state.workers.of(Role::Decode);
    decode
        .iter()
        .find(|w| w.health() == Health::Healthy)
        .or_else(|| decode.iter().find(|w| w.dispatchable()))
        .cloned()
        .ok_or_else(|| {
            ApiError::new(
                503,
                "no_healthy_worker",
                "no healthy decode worker is available",
            )
        })
}

/// Send `req` to one worker's `path` and answer with its status, content
/// type and body.
async fn relay_one(
    state: &RouterState,
    path: &str,
    req: reqwest::RequestBuilder,
    worker: &Worker,
) -> Response {
    let resp = match req.timeout(state.config.request_timeout).send().await {
        Ok(r) => r,
        Err(e) => {
            return ApiError::new(
                502,
                "worker_unreachable",
                format!("decode worker {} is unreachable: {e}", worker.url),
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
                "decode worker {} broke off its {path} answer: {e}",
                worker.url
            ),
        )
        .into_response(),
    }
}

/// A GET route answered by one decode worker.
async fn forward_get(state: RouterState, path: &'static str) -> Response {
    let w = match answering_worker(&state) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req = state.client.get(format!("{}{path}", w.url));
    relay_one(&state, path, req, &w).await
}

/// A JSON POST route answered by one decode worker: the body is checked to
/// be JSON and sent on as it came.
async fn forward_post(state: RouterState, path: &'static str, req: Request) -> Response {
    let body = match read_json_body(req).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let w = match answering_worker(&state) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req = state
        .client
        .post(format!("{}{path}", w.url))
        .header(CONTENT_TYPE, "application/json")
        .body(body);
    relay_one(&state, path, req, &w).await
}

async fn read_json_body(req: Request) -> Result<Bytes, ApiError> {
    crate::http::extract::check_json_content_type(req.headers())?;
    crate::http::extract::read_body(req, &()).await
}

/// `GET /v1/models`.
pub async fn models(State(state): State<RouterState>) -> Response {
    forward_get(state, "/v1/models").await
}

/// `GET /get_model_info` (and `/model_info`).
pub async fn model_info(State(state): State<RouterState>) -> Response {
    forward_get(state, "/get_model_info").await
}

/// `GET /server_info` (and `/get_server_info`): a decode worker's answer,
/// with the router's own workers under `router`.
pub async fn server_info(State(state): State<RouterState>) -> Response {
    let resp = forward_get(state.clone(), "/server_info").await;
    if !resp.status().is_success() {
        return resp;
    }
    let bytes =
        match axum::body::to_bytes(resp.into_body(), crate::http::extract::MAX_BODY_BYTES).await {
            Ok(b) => b,
            Err(e) => {
                return ApiError::new(
                    502,
                    "worker_unreachable",
                    format!("reading /server_info: {e}"),
                )
                .into_response()
            }
        };
    let mut info: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return ApiError::new(
                502,
                "worker_bad_answer",
                format!("a decode worker's /server_info is not JSON: {e}"),
            )
            .into_response()
        }
    };
    let count = |role| state.workers.of(role).len();
    let healthy = |role| state.workers.healthy(role);
    info["router"] = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "prefill_workers": count(Role::Prefill),
        "decode_workers": count(Role::Decode),
        "healthy_prefill_workers": healthy(Role::Prefill),
        "healthy_decode_workers": healthy(Role::Decode),
    });
    Json(info).into_response()
}

/// `POST /tokenize`.
pub async fn tokenize(State(state): State<RouterState>, req: Request) -> Response {
    forward_post(state, "/tokenize", req).await
}

/// `POST /detokenize`.
pub async fn detokenize(State(state): State<RouterState>, req: Request) -> Response {
    forward_post(state, "/detokenize", req).await
}

/// Send the same request to every worker; each answer as
/// `{"url", "role", "status", "message" | "answer"}` (a JSON answer is
/// kept as JSON), and whether all of them answered 200.
async fn fan_out(state: &RouterState, path: &str, body: Option<Bytes>) -> (bool, Vec<Value>) {
    let all = state.workers.all();
    let calls = all.iter().map(|w| {
        let client = state.client.clone();
        let timeout = state.config.health_timeout;
        let (url, role) = (w.url.clone(), w.role.name());
        let body = body.clone();
        async move {
            let mut req = client.post(format!("{url}{path}")).timeout(timeout);
            if let Some(b) = body {
                req = req.header(CONTENT_TYPE, "application/json").body(b);
            }
            let mut reply = json!({"url": url, "role": role});
            match req.send().await {
                Ok(r) => {
                    reply["status"] = json!(r.status().as_u16());
                    let text = r.text().await.unwrap_or_default();
                    match serde_json::from_str::<Value>(&text) {
                        Ok(v) if v.is_object() => reply["answer"] = v,
                        _ => reply["message"] = json!(text.trim()),
                    }
                }
                Err(e) => {
                    reply["status"] = json!(502);
                    reply["message"] = json!(format!("unreachable: {e}"));
                }
            }
            reply
        }
    });
    let replies: Vec<Value> = futures_util::future::join_all(calls).await;
    let ok = replies.iter().all(|r| r["status"] == 200);
    (ok, replies)
}

/// `POST`/`GET /flush_cache`: every worker empties its prefix cache; the
/// answer lists each worker's reply (200 when all of them flushed, 502
/// naming those that could not).
pub async fn flush_cache(State(state): State<RouterState>) -> Response {
    let (ok, replies) = fan_out(&state, "/flush_cache", None).await;
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    (status, Json(json!({ "workers": replies }))).into_response()
}

/// `POST /abort_request` (`{"rid"}` or `{"abort_all": true}`): every worker
/// aborts the requests it holds under that id (the router gives a request's
/// prefill and decode the same `rid`, so both sides end it). 200 with the
/// total aborted and each worker's answer; 502 when a worker could not be
/// asked; a worker's 400 (a malformed body) is the answer's status.
pub async fn abort_request(State(state): State<RouterState>, req: Request) -> Response {
    let body = match read_json_body(req).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let (ok, replies) = fan_out(&state, "/abort_request", Some(body)).await;
    let aborted: u64 = replies
        .iter()
        .filter_map(|r| r["answer"]["aborted"].as_u64())
        .sum();
    if !ok {
        if let Some(refused) = replies.iter().find(|r| r["status"] == 400) {
            let answer = refused["answer"].clone();
            return (StatusCode::BAD_REQUEST, Json(answer)).into_response();
        }
    }
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    (
        status,
        Json(json!({ "aborted": aborted, "workers": replies })),
    )
        .into_response()
}

/// `GET /health_generate`: one token generated through a prefill and a
/// decode worker, as `/generate` would (same pairing, rooms and retries).
/// 200 with an empty body when it came back, else 503 with the reason.
pub async fn health_generate(State(state): State<RouterState>) -> Response {
    let body = json!({
        "text": "Hi",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": true},
        "rid": crate::worker::request_ids::new_request_id("health"),
    });
    let req = Request::builder()
        .method("POST")
        .uri("/generate")
        .header(CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()));
    let req = match req {
        Ok(r) => r,
        Err(e) => {
            return ApiError::new(500, "internal_error", format!("building the probe: {e}"))
                .into_response()
        }
    };
    let resp = crate::router::dispatch::generate(State(state), req).await;
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), crate::http::extract::MAX_BODY_BYTES)
        .await
        .unwrap_or_default();
    let answer: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if status.is_success()
        && answer["output_ids"]
            .as_array()
            .is_some_and(|a| a.len() == 1)
    {
        return "".into_response();
    }
    let why = answer["error"]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    ApiError::new(
        503,
        "unhealthy",
        format!("health generation through a prefill and a decode worker failed ({status}): {why}"),
    )
    .into_response()
}
