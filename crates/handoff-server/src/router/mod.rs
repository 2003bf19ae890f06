//! handoff's PD router: pairs a prefill and a
//! decode worker per request, sends both the same body with
//! `bootstrap_host` / `bootstrap_port` / `bootstrap_room`, relays decode's
//! answer as soon as it arrives, keeps the workers' health and load, and
//! exports its own metrics.
//!
//! [`router_app`] builds the HTTP app (run it on any listener, e.g. in tests);
//! [`run_router`] serves it until a shutdown future resolves.

pub mod admin;
pub mod admission;
pub mod breaker;
pub mod config;
pub mod discovery;
pub mod dispatch;
pub mod forward;
pub mod info;
pub mod metrics;
pub mod policy;
pub mod prefix_index;
pub mod relay;
pub mod rooms;
pub mod timeline;
pub mod workers;

use std::future::Future;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

pub use config::{PrefillSpec, RouterConfig, RouterConfigError, DEFAULT_BOOTSTRAP_PORT};
pub use metrics::RouterMetrics;
pub use policy::{Policy, PolicyKind};
pub use workers::{Health, Worker, Workers};

use rooms::Rooms;

/// Largest request body the router accepts (bytes): the workers' limit, so
/// that a body the router takes is never refused behind it for its size.
pub const ROUTER_MAX_BODY_BYTES: usize = crate::http::extract::MAX_BODY_BYTES;

/// Why the router cannot start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] RouterConfigError),
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    Client(String),
    /// Serving failed.
    #[error("serving HTTP: {0}")]
    Io(#[from] std::io::Error),
}

/// What every router handler shares.
#[derive(Debug)]
pub struct RouterInner {
    config: RouterConfig,
    workers: Workers,
    prefill_policy: Policy,
    decode_policy: Policy,
    rooms: Arc<Rooms>,
    metrics: Arc<RouterMetrics>,
    client: reqwest::Client,
    predictor: Arc<admission::Predictor>,
}

/// The router's shared state (cheap to clone).
#[derive(Debug, Clone)]
pub struct RouterState(Arc<RouterInner>);

impl std::ops::Deref for RouterState {
    type Target = RouterInner;

    fn deref(&self) -> &RouterInner {
        &self.0
    }
}

impl RouterState {
    /// State for a configuration (checks it).
    pub fn new(config: RouterConfig) -> Result<Self, RouterError> {
        let metrics = Arc::new(RouterMetrics::new());
        let workers = Workers::new(&config, &metrics)?;
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(k) = &config.api_key {
            headers.insert(reqwest::header::AUTHORIZATION, k.bearer());
        }
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .connect_timeout(config.connect_timeout)
            // Let go of an idle connection before a worker closes it (its
            // header timeout, 30 s by default), so no request is sent on a
            // connection being closed.
            .pool_idle_timeout(std::time::Duration::from_secs(5))
            .no_proxy()
            .build()
            .map_err(|e| RouterError::Client(e.to_string()))?;
        Ok(RouterState(Arc::new(RouterInner {
            prefill_policy: Policy::new(config.prefill_policy),
            decode_policy: Policy::new(config.decode_policy),
            workers,
            rooms: Arc::new(Rooms::default()),
            metrics,
            client,
            config,
            predictor: Default::default(),
        })))
    }

    /// Probe every worker once now.
    pub async fn probe_now(&self) {
        self.workers
            .probe_all(
                &self.client,
                self.config.health_timeout,
                self.config.unhealthy_after,
                &self.metrics,
            )
            .await;
    }
}

/// Control of a running router app: its state and its health loop, which
/// stops when the handle drops.
#[derive(Debug)]
pub struct RouterHandle {
    state: RouterState,
    health_task: Option<tokio::task::JoinHandle<()>>,
    discovery_task: Option<tokio::task::JoinHandle<()>>,
}

impl RouterHandle {
    /// Probe every worker once now (the health loop keeps running).
    pub async fn probe_now(&self) {
        self.state.probe_now().await
    }

    /// At least one healthy prefill and one healthy decode worker.
    pub fn ready(&self) -> bool {
        self.state.workers.ready()
    }

    /// The workers.
    pub fn workers(&self) -> &Workers {
        &self.state.workers
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Arc<RouterMetrics> {
        &self.state.metrics
    }

    /// Bootstrap rooms live now (one per request in flight).
    pub fn live_rooms(&self) -> usize {
        self.state.rooms.live()
    }

    /// A handle that adds and removes workers while the router serves.
    pub fn control(&self) -> RouterControl {
        RouterControl(self.state.clone())
    }
}

/// Adds and removes workers of a running router (`handoff serve` replacing
/// a replica); cheap to clone.
#[derive(Debug, Clone)]
pub struct RouterControl(RouterState);

impl RouterControl {
    /// Send requests to the worker at `url` too (probed by the health loop
    /// like the others); false if it is there already.
    pub fn add_worker(
        &self,
        url: &str,
        role: handoff_proto::Role,
        bootstrap_port: u16,
    ) -> Result<bool, RouterConfigError> {
        self.0
            .workers
            .add(url, role, bootstrap_port, &self.0.metrics)
    }

    /// Send no new request to the worker at `url` (those on it finish);
    /// whether it was there.
    pub fn remove_worker(&self, url: &str, role: handoff_proto::Role) -> bool {
        self.0.workers.remove(url, role)
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        for t in [self.health_task.take(), self.discovery_task.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
        }
    }
}

/// The router's HTTP app and its handle. Starts the health loop (first probe
/// at once, then every `health_interval`; none when the interval is zero) on
/// the current tokio runtime, so call it from inside one. The loop stops
/// when the handle drops.
pub fn router_app(config: RouterConfig) -> Result<(Router, RouterHandle), RouterError> {
    let state = RouterState::new(config)?;
    let interval = state.config.health_interval;
    let health_task = (!interval.is_zero()).then(|| {
        let state = state.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                state.probe_now().await;
            }
        })
    });
    let discovery_task = state
        .config
        .discovery
        .clone()
        .map(|ep| tokio::spawn(discovery::run(state.clone(), ep)));
    let app = Router::new()
        .route("/generate", post(dispatch::generate))
        .route("/v1/completions", post(dispatch::completions))
        .route("/v1/chat/completions", post(dispatch::chat_completions))
        .route("/health", get(info::health))
        .route("/readiness", get(info::readiness))
        .route("/v1/models", get(forward::models))
        .route("/get_model_info", get(forward::model_info))
        .route("/model_info", get(forward::model_info))
        .route("/server_info", get(forward::server_info))
        .route("/get_server_info", get(forward::server_info))
        .route("/tokenize", post(forward::tokenize))
        .route("/detokenize", post(forward::detokenize))
        .route("/health_generate", get(forward::health_generate))
        .route("/abort_request", post(forward::abort_request))
        .route("/get_load", get(info::get_load))
        .route(
            "/flush_cache",
            get(forward::flush_cache).post(forward::flush_cache),
        )
        .route("/workers", get(info::workers))
        .route(
            "/admin/restart",
            get(admin::restart_status).post(admin::restart),
        )
        .route("/metrics", get(info::metrics))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .method_not_allowed_fallback(dispatch::method_not_allowed)
        .fallback(dispatch::not_found)
        .layer(DefaultBodyLimit::max(ROUTER_MAX_BODY_BYTES))
        .with_state(state.clone());
    Ok((
        app,
        RouterHandle {
            state,
            health_task,
            discovery_task,
        },
    ))
}

/// Serve the router on `listener` until `shutdown` resolves (then drain:
/// in-flight requests finish). Probes every worker once before accepting.
pub async fn run_router<F>(
    listener: tokio::net::TcpListener,
    config: RouterConfig,
    shutdown: F,
) -> Result<(), RouterError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let limits = config.http;
    let (app, handle) = build_router(config)?;
    serve_router(listener, app, handle, limits, shutdown).await
}

/// [`router_app`] behind the API key and CORS of its configuration: what
/// [`run_router`] serves. Keep [`RouterHandle::control`] to change the
/// workers while it serves.
pub fn build_router(config: RouterConfig) -> Result<(Router, RouterHandle), RouterError> {
    let origins = config.allow_origins.clone();
    let key = config.api_key.clone();
    let (app, handle) = router_app(config)?;
    let app = crate::http::auth::require_api_key(app, key);
    Ok((crate::http::cors::allow_origins(app, &origins), handle))
}

/// Serve what [`build_router`] built on `listener` until `shutdown`
/// resolves (then drain: in-flight requests finish). Probes every worker
/// once before accepting.
pub async fn serve_router<F>(
    listener: tokio::net::TcpListener,
    app: Router,
    handle: RouterHandle,
    limits: crate::http::listen::HttpLimits,
    shutdown: F,
) -> Result<(), RouterError>
where
    F: Future<Output = ()> + Send + 'static,
{
    handle.probe_now().await;
    if !handle.ready() {
        tracing::warn!(
            "router starts without a healthy prefill and decode worker; /readiness is 503"
        );
    }
    crate::http::listen::serve(listener, app, limits, shutdown).await?;
    drop(handle);
    Ok(())
}

async fn count_requests(State(state): State<RouterState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let resp = next.run(req).await;
    state.metrics.count_request(&route, resp.status().as_u16());
    resp
}
