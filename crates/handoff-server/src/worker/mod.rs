//! A worker's API over its engine: the OpenAI ([`openai_api`]) and SGLang
//! ([`generate_api`]) generation endpoints, their request types and checks
//! ([`openai_types`], [`sampling_fields`], [`pd_fields`], [`params`],
//! [`fields`]), prompts, choices, structured output and tools, the
//! bootstrap trust check ([`trust`]), aborts, tokens and server info, and
//! the [`backend`] (colocated, prefill or decode engine) they drive.

pub mod abort_api;
pub mod aborts;
pub mod backend;
pub mod choices;
pub mod field_metrics;
pub mod fields;
pub mod generate_api;
pub mod generation;
pub mod info_api;
pub mod openai_api;
pub mod openai_types;
pub mod params;
pub mod pd_fields;
pub mod prompt;
pub mod request_ids;
pub mod sampling_fields;
pub mod structured;
pub mod token_api;
pub mod tools;
pub mod trust;
