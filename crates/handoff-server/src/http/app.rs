//! The router: every route of the worker API, the shared state, request
//! counting and the JSON 404/405 answers.

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::worker::backend::Backend;

use crate::http::errors::ApiError;
use crate::http::extract::MAX_BODY_BYTES;
use crate::worker::{abort_api, generate_api, info_api, openai_api, token_api};

pub use crate::state::{AppState, DEFAULT_STALL_TIMEOUT};
pub use crate::worker::request_ids::{new_request_id, request_id, unix_now};

/// The HTTP API around `engine` (an `EngineHandle`, `PrefillHandle`,
/// `DecodeHandle` or [`Backend`]).
pub fn app(engine: impl Into<Backend>) -> Router {
    app_with_state(AppState::new(engine))
}

/// The HTTP API around prepared state (lets callers keep the metrics handle).
pub fn app_with_state(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai_api::chat_completions))
        .route("/v1/completions", post(openai_api::completions))
        .route("/generate", post(generate_api::generate))
        .route("/v1/models", get(info_api::models))
        .route("/health", get(info_api::health))
        .route("/health_generate", get(info_api::health_generate))
        .route("/server_info", get(info_api::server_info))
        .route("/get_server_info", get(info_api::server_info))
        .route("/get_model_info", get(info_api::model_info))
        .route("/model_info", get(info_api::model_info))
        .route(
            "/flush_cache",
            get(info_api::flush_cache).post(info_api::flush_cache),
        )
        .route("/get_load", get(info_api::get_load))
        .route("/metrics", get(info_api::metrics))
        .route("/tokenize", post(token_api::tokenize))
        .route("/detokenize", post(token_api::detokenize))
        .route("/abort_request", post(abort_api::abort_request))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let resp = next.run(req).await;
    state
        .metrics
        .count_request(&endpoint, resp.status().as_u16());
    resp
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        404,
        "not_found",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        405,
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}
