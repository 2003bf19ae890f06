//! handoff-server: the HTTP worker API — OpenAI chat and
//! completions, SGLang's `/generate`, health, load, server info and
//! Prometheus metrics — around a running engine; and the PD router in front
//! of prefill and decode workers ([`router`]).
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod abort_api;
pub mod aborts;
pub mod app;
pub mod auth;
pub mod backend;
pub mod choices;
pub mod cors;
pub mod discovery;
pub mod drain;
pub mod errors;
pub mod exposition;
pub mod extract;
pub mod field_metrics;
pub mod fields;
pub mod generate_api;
pub mod generation;
pub mod info_api;
pub mod listen;
pub mod metrics;
pub mod openai_api;
pub mod openai_types;
pub mod otel;
pub mod params;
pub mod pd_fields;
pub mod prompt;
pub mod request_ids;
pub mod router;
pub mod sampling_fields;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tenancy;
pub mod token_api;
pub mod tools;
pub mod trust;

pub use app::{app, app_with_state, AppState};
pub use backend::{Backend, Bootstrap};
pub use errors::ApiError;
pub use listen::{serve, HttpLimits};
pub use router::{router_app, run_router, RouterConfig, RouterHandle};
