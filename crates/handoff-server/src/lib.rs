//! handoff-server: the HTTP worker API — OpenAI chat and
//! completions, SGLang's `/generate`, health, load, server info and
//! Prometheus metrics — around a running engine; and the PD router in front
//! of prefill and decode workers ([`router`]).
//!
//! The modules, bottom up: [`state`] (`AppState`, what every handler
//! shares); [`http`] (the HTTP layer: the app, listener, auth, CORS, body
//! extraction, errors, SSE, drain, metrics, tracing export); [`worker`]
//! (a worker's API: the request types, their checks, generation and its
//! answers); [`router`] (the PD router) and [`discovery`] (etcd).
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod discovery;
pub mod http;
pub mod router;
pub mod state;
pub mod worker;

pub use http::app::{app, app_with_state};
pub use http::errors::ApiError;
pub use http::listen::{serve, HttpLimits};
pub use router::{router_app, run_router, RouterConfig, RouterHandle};
pub use state::AppState;
pub use worker::backend::{Backend, Bootstrap};
