//! Engine errors: who is to blame, the HTTP status, a stable label.

/// Why the engine refused or failed a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The prompt has no tokens.
    #[error("the prompt is empty: at least one token is required")]
    EmptyPrompt,
    /// Prompt plus requested output does not fit the model's context.
    #[error("prompt of {prompt_tokens} tokens plus max_tokens {max_new_tokens} exceeds the context length of {context_length} tokens")]
    ContextExceeded {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Requested output tokens.
        max_new_tokens: usize,
        /// The model's (or server's) context limit.
        context_length: usize,
    },
    /// The request can never fit in the KV pool, even when it is empty.
    #[error("request needs {needed_pages} KV pages but the pool holds only {total_pages}")]
    ExceedsKvCapacity {
        /// Pages the request needs at its longest.
        needed_pages: usize,
        /// Pages in the whole pool.
        total_pages: usize,
    },
    /// A sampling parameter is out of range.
    #[error("invalid parameter: {0}")]
    InvalidParams(String),
    /// A prompt token id is not in the vocabulary.
    #[error("token id {id} is out of range for a vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// The engine is shutting down or its thread is gone.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The forward pass failed.
    #[error("model execution failed: {0}")]
    Model(String),
}

impl EngineError {
    /// HTTP status a client should see for this error.
    pub fn http_status(&self) -> u16 {
        match self {
            EngineError::EmptyPrompt
            | EngineError::ContextExceeded { .. }
            | EngineError::ExceedsKvCapacity { .. }
            | EngineError::InvalidParams(_)
            | EngineError::TokenOutOfRange { .. } => 400,
            EngineError::ShuttingDown => 503,
            EngineError::Model(_) => 500,
        }
    }

    /// Stable label for metrics, error bodies and SSE error events.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::EmptyPrompt => "empty_prompt",
            EngineError::ContextExceeded { .. } => "context_length_exceeded",
            EngineError::ExceedsKvCapacity { .. } => "kv_capacity_exceeded",
            EngineError::InvalidParams(_) => "invalid_request_error",
            EngineError::TokenOutOfRange { .. } => "invalid_token_id",
            EngineError::ShuttingDown => "shutting_down",
            EngineError::Model(_) => "model_error",
        }
    }
}
