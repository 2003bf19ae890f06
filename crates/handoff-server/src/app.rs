//! The router: every route of the worker API, the shared state, request
//! counting and the JSON 404/405 answers.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::aborts::Aborts;
use crate::backend::{Backend, Bootstrap};
use crate::trust::BootstrapTrust;

use crate::errors::ApiError;
use crate::extract::MAX_BODY_BYTES;
use crate::metrics::Metrics;
use crate::{aborts, generate_api, info_api, openai_api, token_api};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The engine: colocated, or one side of a PD pair.
    pub engine: Backend,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Server start, seconds since the Unix epoch.
    pub started_unix: u64,
    /// The requests in flight by id, for `/abort_request`.
    pub aborts: Arc<Aborts>,
    /// OpenAI's `system_fingerprint`: this build serving this model.
    pub system_fingerprint: String,
    /// A generation that waits this long for its next token is ended
    /// (`stalled`) and cancelled; `None`: never.
    pub stall_timeout: Option<std::time::Duration>,
    /// The prefill endpoints a decode worker dials ([`crate::trust`]):
    /// none until the embedder says which.
    pub bootstrap_trust: BootstrapTrust,
    /// Compiles requests' structured-output grammars over the model's
    /// vocabulary.
    pub grammars: Arc<handoff_engine::grammar::Grammars>,
}

/// How long a generation may wait for its next token by default
/// (`--stream-stall-timeout-secs`): longer than any prompt's prefill or
/// queueing on a healthy worker, far shorter than the 300 s that users of
/// other systems find their streams hanging for.
pub const DEFAULT_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("model", &self.engine.model())
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// State around a running engine.
    pub fn new(engine: impl Into<Backend>) -> Self {
        let engine = engine.into();
        let model = engine.model();
        let metrics = Arc::new(Metrics::new(&model.served_name, model.page_size));
        let started_unix = unix_now();
        let system_fingerprint = fingerprint(engine.model());
        let grammars = Arc::new(handoff_engine::grammar::Grammars::new(
            engine.tokenizer().clone(),
        ));
        AppState {
            engine,
            metrics,
            started_unix,
            aborts: Arc::new(Aborts::default()),
            system_fingerprint,
            stall_timeout: Some(DEFAULT_STALL_TIMEOUT),
            bootstrap_trust: BootstrapTrust::default(),
            grammars,
        }
    }

    /// The same state trusting `trust`'s prefill endpoints.
    pub fn with_bootstrap_trust(mut self, trust: BootstrapTrust) -> Self {
        self.bootstrap_trust = trust;
        self
    }

    /// Check a request's PD fields before any other work: the ones this
    /// worker's role needs are there, and (decode) the prefill endpoint
    /// they name is one this worker may dial. Marks `b` trusted.
    pub fn check_bootstrap(&self, b: &mut Bootstrap) -> Result<(), ApiError> {
        self.engine.check_bootstrap(b)?;
        // A decode worker prefilling itself dials no one: nothing to vouch for.
        if self.engine.mode() == "decode" && !b.handover.local {
            self.bootstrap_trust.check(b, unix_now())?;
        }
        b.trusted = true;
        Ok(())
    }

    /// The same state with another stall timeout (`None`: no watchdog).
    pub fn with_stall_timeout(mut self, t: Option<std::time::Duration>) -> Self {
        self.stall_timeout = t;
        self
    }

    /// The model name reported in responses.
    pub fn served_name(&self) -> String {
        self.engine.model().served_name.clone()
    }
}

/// A fresh request id like `chatcmpl-8c1f0e5a9b3d47e2a6f01c9d`: `prefix`,
/// a dash and 96 random bits in hex, so ids from different workers (and
/// restarts) do not collide.
pub fn new_request_id(prefix: &str) -> String {
    let bits: u128 = rand::random::<u128>() >> 32;
    format!("{prefix}-{bits:024x}")
}

/// A request's id: the `rid` its sender chose, checked (a router gives both
/// PD workers the same one, so `/abort_request` reaches both), else a fresh
/// one.
pub fn request_id(rid: Option<&String>, prefix: &str) -> Result<String, ApiError> {
    match rid {
        Some(rid) => {
            crate::aborts::check_rid(rid, "rid")?;
            Ok(rid.clone())
        }
        None => Ok(new_request_id(prefix)),
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `fp_` and 40 bits of a hash of handoff's version and the served model
/// (name, file, architecture, context, page size): equal across the
/// workers of one deployment, different when either changes.
fn fingerprint(model: &handoff_engine::handle::ModelInfo) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    env!("CARGO_PKG_VERSION").hash(&mut h);
    model.served_name.hash(&mut h);
    model.model_path.hash(&mut h);
    model.architecture.hash(&mut h);
    model.context_length.hash(&mut h);
    model.page_size.hash(&mut h);
    format!("fp_{:010x}", h.finish() >> 24)
}

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
        .route("/abort_request", post(aborts::abort_request))
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
