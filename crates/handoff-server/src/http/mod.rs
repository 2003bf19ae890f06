//! The HTTP layer every server shares: the worker app's routes ([`app`]),
//! the listener and its limits ([`listen`]), API keys and tenants
//! ([`auth`], [`tenancy`]), CORS, JSON bodies ([`extract`]), the error
//! shape ([`errors`]), SSE, drain, Prometheus metrics and OTLP traces.

pub mod app;
pub mod auth;
pub mod cors;
pub mod drain;
pub mod errors;
pub mod exposition;
pub mod extract;
pub mod listen;
pub mod metrics;
pub mod otel;
pub mod sse;
pub mod tenancy;
