//! The model (DESIGN.md §2 `handoff-model`): GGUF loading, a Llama-family
//! forward over a paged KV pool, tokenizer and chat template, sampling.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod attention;
pub mod chat_template;
pub mod config;
pub mod error;
pub mod linear;
pub mod model;
pub mod ops;
pub mod q8_matmul;
pub mod reference;
pub mod rope;
pub mod sampling;
#[cfg(any(test, feature = "testing"))]
pub mod tiny;
pub mod tokenizer;

pub use config::LlamaConfig;
pub use error::ModelError;
pub use linear::{Phase, PhaseFormats, WeightFormat};
pub use model::{Llama, SeqChunk};
