//! Schedulers: the colocated engine —
//! continuous batching over one paged KV pool, chunked prefill interleaved
//! with decode, admission by free pages, cancellation by dropping a stream —
//! and the disaggregated prefill and decode engines ([`pd`]), which run the
//! same forward calls with the KV moved between them by `handoff-transfer`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod command;
pub mod config;
pub mod engine;
pub mod error;
pub mod events;
pub mod fair;
mod gbnf;
pub mod grammar;
pub mod handle;
mod model_info;
pub mod pd;
mod prefill_pass;
pub mod request;
mod scheduler;
mod shared;
mod stop;
mod validate;

pub use config::EngineConfig;
pub use engine::Engine;
pub use error::EngineError;
pub use handle::{EngineHandle, LoadSnapshot, ModelInfo, RequestStream};
pub use request::{FinishReason, Finished, GenerateRequest, SamplingParams, StreamEvent, TokenOut};
pub use stop::streamed_text;
