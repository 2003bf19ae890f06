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
    /// Too many requests are already waiting; try again later.
    #[error("server overloaded: {waiting} requests are already waiting (limit {limit})")]
    Overloaded {
        /// Requests waiting when this one arrived.
        waiting: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The engine is shutting down or its thread is gone.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The forward pass failed.
    #[error("model execution failed: {0}")]
    Model(String),
    /// Disaggregated serving: the KV transfer or the peer worker failed the
    /// request (prefill rejected it, a peer died, a deadline passed, the
    /// client aborted). Status, kind and reason are exactly as the side that
    /// saw the failure reported them, so a prefill's 400 reaches the client
    /// as a 400 with the prefill's message (seed 004).
    #[error("{reason}")]
    Transfer {
        /// HTTP status as reported by the side that failed.
        status: u16,
        /// The transfer layer's failure kind (`rejected`, `peer_dead`,
        /// `timeout`, `aborted` ...).
        kind: String,
        /// The human reason, as the peer sent it.
        reason: String,
    },
}

impl From<handoff_proto::TransferError> for EngineError {
    fn from(e: handoff_proto::TransferError) -> Self {
        EngineError::Transfer {
            status: e.http_status(),
            kind: e.error_type().to_string(),
            reason: e.reason(),
        }
    }
}

impl From<handoff_transfer::TransportError> for EngineError {
    fn from(e: handoff_transfer::TransportError) -> Self {
        match e {
            handoff_transfer::TransportError::Room(e) => e.into(),
            other => EngineError::Transfer {
                status: other.http_status(),
                kind: other.error_type().to_string(),
                reason: other.to_string(),
            },
        }
    }
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
            EngineError::ShuttingDown | EngineError::Overloaded { .. } => 503,
            EngineError::Model(_) => 500,
            EngineError::Transfer { status, .. } => *status,
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
            EngineError::Overloaded { .. } => "overloaded",
            EngineError::Model(_) => "model_error",
            EngineError::Transfer { kind, .. } => handoff_proto::FailureKind::ALL
                .iter()
                .map(|k| k.name())
                .find(|n| *n == kind.as_str())
                .unwrap_or("transfer_error"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_proto::{AbortOrigin, FailureKind, Role, TransferError};

    #[test]
    fn transfer_failures_keep_status_kind_and_reason() {
        let rejected = TransferError::Rejected {
            http_status: 400,
            reason: "prompt too long".into(),
        };
        let e = EngineError::from(rejected);
        assert_eq!(e.http_status(), 400);
        assert_eq!(e.error_type(), "rejected");
        assert_eq!(e.to_string(), "prompt too long");
        // A failure the peer reported keeps the peer's kind and status.
        let remote = TransferError::Remote {
            kind: FailureKind::Timeout,
            reason: "timed out in transferring".into(),
            http_status: 504,
            peer: Role::Prefill,
        };
        let e = EngineError::from(remote);
        assert_eq!((e.http_status(), e.error_type()), (504, "timeout"));
        let aborted = TransferError::Aborted {
            origin: AbortOrigin::Client,
            reason: "gone".into(),
            http_status: 499,
        };
        assert_eq!(EngineError::from(aborted).http_status(), 499);
        // An unknown kind string still has a stable label.
        let odd = EngineError::Transfer {
            status: 502,
            kind: "something new".into(),
            reason: "?".into(),
        };
        assert_eq!(odd.error_type(), "transfer_error");
        // Transport-level errors map through their own status and label.
        let e = EngineError::from(handoff_transfer::TransportError::Shutdown);
        assert_eq!((e.http_status(), e.error_type()), (503, "transfer_error"));
    }
}
