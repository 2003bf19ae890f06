//! Request shapes of the OpenAI API (`/v1/chat/completions`,
//! `/v1/completions`). Fields we read are type-checked by serde and
//! range-checked in [`crate::worker::params`]; every other field is collected in
//! `extra` and refused by [`crate::worker::fields::check`] when a spec defines it and
//! handoff does not implement it (fields no spec defines are ignored, as
//! OpenAI clients send many).

use serde::Deserialize;

use crate::http::errors::ApiError;
use crate::worker::params::RawSampling;
use crate::worker::pd_fields::PdFields;
use crate::worker::sampling_fields::{Limits, SamplingFields};

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A message's `content`: a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of content parts")]
pub enum ContentInput {
    /// Plain text.
    Text(String),
    /// Content parts; only `{"type":"text","text":...}` is supported.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type (`text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// One message of `messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageInput {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message content: required, except on an assistant message that
    /// carries `tool_calls`.
    #[serde(default)]
    pub content: Option<ContentInput>,
    /// An assistant message's tool calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallInput>>,
    /// A tool message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A past tool call in an assistant message.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallInput {
    /// The call's id.
    #[serde(default)]
    pub id: Option<String>,
    /// The function called.
    pub function: ToolCallFunction,
}

/// The function of a past tool call.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallFunction {
    /// Its name.
    pub name: String,
    /// Its arguments, as JSON text.
    #[serde(default)]
    pub arguments: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model name (any value is accepted; the server serves one model).
    #[serde(default)]
    pub model: Option<String>,
    /// The request id (SGLang's field): the response's `id`, and the name
    /// `/abort_request` takes.
    #[serde(default)]
    pub rid: Option<String>,
    /// The conversation.
    pub messages: Vec<MessageInput>,
    /// Output limit (deprecated name).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Output limit.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Stream the answer as SSE.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Number of choices (1 to 16; [`crate::worker::choices`]).
    #[serde(default)]
    pub n: Option<i64>,
    /// Return the chosen tokens' log-probabilities.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per position.
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Minimum output before any end of generation (SGLang, vLLM).
    #[serde(default)]
    pub min_tokens: Option<i64>,
    /// The sampling fields every API shares.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// The PD fields (set by the router).
    #[serde(flatten)]
    pub pd: PdFields,
    /// Every other field: refused or accepted by [`crate::worker::fields::check`].
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// Larger is served sooner (SGLang's `priority`); at most the API
    /// key's limit ([`crate::http::tenancy`]).
    #[serde(default)]
    pub priority: Option<serde_json::Value>,
}

impl ChatCompletionRequest {
    /// The sampling fields, typed (a 400 names a field of the wrong type).
    pub fn sampling(&self) -> Result<RawSampling, ApiError> {
        let (field, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", Some(n)),
            (None, n) => ("max_tokens", n),
        };
        self.sampling.raw(
            "",
            Limits {
                max_tokens_field: field,
                max_tokens: max,
                min_tokens_field: "min_tokens",
                min_tokens: self.min_tokens,
            },
        )
    }
}

/// `prompt` of `/v1/completions`: text, a list of one text, token ids, or a
/// list of one token-id list.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids, or a list of token-id lists"
)]
pub enum PromptInput {
    /// One text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// Several texts (a choice set each).
    Texts(Vec<String>),
    /// Several token-id lists (a choice set each).
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name (any value is accepted).
    #[serde(default)]
    pub model: Option<String>,
    /// The request id (SGLang's field): the response's `id`, and the name
    /// `/abort_request` takes.
    #[serde(default)]
    pub rid: Option<String>,
    /// The prompt.
    pub prompt: PromptInput,
    /// Output limit (default 16, as OpenAI).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Stream the answer as SSE.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Number of choices (1 to 16; [`crate::worker::choices`]).
    #[serde(default)]
    pub n: Option<i64>,
    /// Only 1 is supported.
    #[serde(default)]
    pub best_of: Option<i64>,
    /// Log-probabilities: 0 returns the chosen tokens' only.
    #[serde(default)]
    pub logprobs: Option<i64>,
    /// Echo the prompt (not supported).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Suffix (not supported).
    #[serde(default)]
    pub suffix: Option<String>,
    /// Minimum output before any end of generation (SGLang, vLLM).
    #[serde(default)]
    pub min_tokens: Option<i64>,
    /// The sampling fields every API shares.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// The PD fields (set by the router).
    #[serde(flatten)]
    pub pd: PdFields,
    /// Every other field: refused or accepted by [`crate::worker::fields::check`].
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// Larger is served sooner (SGLang's `priority`); at most the API
    /// key's limit ([`crate::http::tenancy`]).
    #[serde(default)]
    pub priority: Option<serde_json::Value>,
}

impl CompletionRequest {
    /// The sampling fields, typed (a 400 names a field of the wrong type).
    pub fn sampling(&self) -> Result<RawSampling, ApiError> {
        self.sampling.raw(
            "",
            Limits {
                max_tokens_field: "max_tokens",
                max_tokens: self.max_tokens,
                min_tokens_field: "min_tokens",
                min_tokens: self.min_tokens,
            },
        )
    }
}
