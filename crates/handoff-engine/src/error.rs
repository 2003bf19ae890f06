//! Engine errors: who is to blame, the HTTP status, a stable label.

use std::fmt;
use std::sync::Arc;

pub use handoff_proto::{RejectCode, TransferError};
pub use handoff_transfer::TransportError;

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
    /// The model file could not be loaded (unreadable, malformed, or
    /// asking for something handoff does not implement: the reason names
    /// it).
    #[error("cannot load the model: {0}")]
    Load(String),
    /// The request's grammar failed mid-generation (llguidance reported an
    /// error, or it allowed no token at all).
    #[error("structured output failed: {0}")]
    Grammar(String),
    /// Disaggregated serving: the room failed (prefill rejected it, a peer
    /// died, a deadline passed, the client aborted, the peer reported a
    /// fault). The typed failure as the transfer layer reported it: status,
    /// label and reason are those of the side that saw the failure, so a
    /// prefill's 400 reaches the client as a 400 with the prefill's message
    /// (seed 004), and a failure the peer reported stays the peer's
    /// ([`TransferError::Remote`]). Displays as the reason alone.
    #[error("{}", .0.reason())]
    Transfer(#[from] TransferError),
    /// Disaggregated serving: the transfer endpoint failed outside any room
    /// (connect, handshake, socket, shared memory, shutdown). A
    /// [`TransportError::Room`] is never wrapped here: it becomes
    /// [`EngineError::Transfer`].
    #[error(transparent)]
    Transport(TransportFailure),
}

/// A [`TransportError`] that an [`EngineError`] can carry: shared, so the
/// error stays `Clone` (a stream's error goes to every waiter), and compared
/// by label and message (`io::Error` has no equality).
#[derive(Debug, Clone)]
pub struct TransportFailure(Arc<TransportError>);

impl TransportFailure {
    /// The transport error, to match on.
    pub fn get(&self) -> &TransportError {
        &self.0
    }
}

impl PartialEq for TransportFailure {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.error_type() == other.0.error_type()
                && self.0.to_string() == other.0.to_string())
    }
}

impl Eq for TransportFailure {}

impl fmt::Display for TransportFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for TransportFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl From<TransportError> for EngineError {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::Room(e) => EngineError::Transfer(e),
            other => EngineError::Transport(TransportFailure(Arc::new(other))),
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
            EngineError::Model(_) | EngineError::Load(_) | EngineError::Grammar(_) => 500,
            EngineError::Transfer(e) => e.http_status(),
            EngineError::Transport(t) => t.get().http_status(),
        }
    }

    /// The request field at fault, named as OpenAI's completions API names
    /// it (`prompt`, `max_tokens`), where one field is; the HTTP layer
    /// renames it for its endpoint.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            EngineError::EmptyPrompt | EngineError::TokenOutOfRange { .. } => Some("prompt"),
            EngineError::ContextExceeded {
                prompt_tokens,
                context_length,
                ..
            } if prompt_tokens >= context_length => Some("prompt"),
            EngineError::ContextExceeded { .. } | EngineError::ExceedsKvCapacity { .. } => {
                Some("max_tokens")
            }
            // A peer's refusal names the field its code names.
            EngineError::Transfer(t) => t.reject_code().and_then(RejectCode::param),
            _ => None,
        }
    }

    /// The code a refusal of this request carries to the peer worker, so
    /// both report the same error type and field.
    pub fn reject_code(&self) -> Option<RejectCode> {
        Some(match self {
            EngineError::EmptyPrompt => RejectCode::EmptyPrompt,
            EngineError::TokenOutOfRange { .. } => RejectCode::TokenOutOfRange,
            EngineError::ContextExceeded {
                prompt_tokens,
                context_length,
                ..
            } if prompt_tokens >= context_length => RejectCode::PromptExceedsContext,
            EngineError::ContextExceeded { .. } => RejectCode::OutputExceedsContext,
            EngineError::ExceedsKvCapacity { .. } => RejectCode::ExceedsKvCapacity,
            EngineError::InvalidParams(_) => RejectCode::InvalidRequest,
            EngineError::Transfer(t) => return t.reject_code(),
            _ => return None,
        })
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
            EngineError::Load(_) => "model_load_error",
            EngineError::Grammar(_) => "grammar_error",
            EngineError::Transfer(e) => e.error_type(),
            EngineError::Transport(t) => transport_error_type(t.get()),
        }
    }
}

/// The client-facing label of an endpoint failure: the ones that blame the
/// peer keep their label (`peer_incompatible`, `handshake_timeout`,
/// `peer_misbehaved`); this side's own transport faults (I/O, shared memory,
/// bootstrap, configuration, shutdown) are `transfer_error` —
/// [`TransportError::error_type`] has the finer label for logs.
fn transport_error_type(e: &TransportError) -> &'static str {
    match e {
        TransportError::Handshake(h) => h.error_type(),
        TransportError::PeerMisbehaved(_) => "peer_misbehaved",
        TransportError::LinkSetup(r) if r.blames_peer() => "peer_misbehaved",
        TransportError::Room(e) => e.error_type(),
        _ => "transfer_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_proto::{AbortOrigin, FailureKind, Role, TransferError};

    /// Every refusal the engine makes travels with a code that names the
    /// same type and field, and a peer that receives it reports exactly
    /// what this side would have.
    #[test]
    fn a_refusal_crosses_to_the_peer_with_its_type_and_field() {
        let refusals = [
            EngineError::EmptyPrompt,
            EngineError::TokenOutOfRange {
                id: 70000,
                vocab_size: 49152,
            },
            EngineError::ContextExceeded {
                prompt_tokens: 40,
                max_new_tokens: 4,
                context_length: 32,
            },
            EngineError::ContextExceeded {
                prompt_tokens: 20,
                max_new_tokens: 40,
                context_length: 32,
            },
            EngineError::ExceedsKvCapacity {
                needed_pages: 9,
                total_pages: 8,
            },
            EngineError::InvalidParams("top_p must be in (0, 1]".into()),
        ];
        let mut codes = std::collections::HashSet::new();
        for e in refusals {
            let code = e
                .reject_code()
                .unwrap_or_else(|| panic!("{e:?} has no code"));
            codes.insert(code);
            let relayed = EngineError::from(TransferError::from_wire(
                FailureKind::Rejected,
                e.to_string(),
                e.http_status(),
                Some(code),
                Role::Prefill,
            ));
            assert_eq!(relayed.error_type(), e.error_type(), "{e:?}");
            assert_eq!(relayed.param(), e.param(), "{e:?}");
            assert_eq!(relayed.http_status(), e.http_status(), "{e:?}");
            assert_eq!(relayed.reject_code(), Some(code), "relayed on unchanged");
        }
        assert_eq!(
            codes.len(),
            RejectCode::ALL.len(),
            "every code is used once"
        );
        // A peer without the capability: plain `rejected`, no field.
        let old = EngineError::from(TransferError::from_wire(
            FailureKind::Rejected,
            "x".into(),
            400,
            None,
            Role::Prefill,
        ));
        assert_eq!((old.error_type(), old.param()), ("rejected", None));
        assert_eq!(EngineError::ShuttingDown.reject_code(), None);
    }

    #[test]
    fn transfer_failures_keep_status_kind_and_reason() {
        let rejected = TransferError::Rejected {
            http_status: 400,
            reason: "prompt too long".into(),
            code: None,
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
        // A transport fault of this side (no blame on the peer) still has a
        // stable label.
        let odd = EngineError::from(handoff_transfer::TransportError::Bootstrap("?".into()));
        assert_eq!(odd.error_type(), "transfer_error");
        // Transport-level errors map through their own status and label.
        let e = EngineError::from(handoff_transfer::TransportError::Shutdown);
        assert_eq!((e.http_status(), e.error_type()), (503, "transfer_error"));
    }

    #[test]
    fn a_peers_internal_failure_stays_the_peers() {
        // Prefill reported an internal fault in a Status(Failed): decode's
        // engine sees the peer's failure, attributed to the prefill.
        let wire = TransferError::from_wire(
            FailureKind::Internal,
            "prefill gave up".into(),
            500,
            None,
            Role::Prefill,
        );
        let e = EngineError::from(handoff_transfer::TransportError::Room(wire));
        assert!(
            matches!(
                &e,
                EngineError::Transfer(TransferError::Remote {
                    kind: FailureKind::Internal,
                    peer: Role::Prefill,
                    http_status: 500,
                    reason,
                }) if reason == "prefill gave up"
            ),
            "{e:?}"
        );
        assert_eq!((e.http_status(), e.error_type()), (500, "internal"));
        assert_eq!(e.to_string(), "prefill gave up");
        // Misuse of our own API has its own label.
        let misuse = EngineError::from(TransferError::ApiMisuse {
            reason: "no sources".into(),
        });
        assert_eq!(
            (misuse.http_status(), misuse.error_type()),
            (500, "api_misuse")
        );
    }

    #[test]
    fn transport_failures_keep_their_type() {
        use handoff_proto::HandshakeError;
        let timeout = std::time::Duration::from_secs(2);
        let e = EngineError::from(TransportError::Handshake(HandshakeError::TimedOut(timeout)));
        assert!(
            matches!(
                &e,
                EngineError::Transport(t)
                    if matches!(t.get(), TransportError::Handshake(HandshakeError::TimedOut(d)) if *d == timeout)
            ),
            "{e:?}"
        );
        assert_eq!(
            (e.http_status(), e.error_type()),
            (504, "handshake_timeout")
        );
        assert_eq!(
            e.to_string(),
            "handshake failed: handshake did not complete within 2s"
        );
        // Clones compare equal; a different transport error does not.
        assert_eq!(e.clone(), e);
        assert_ne!(e, EngineError::from(TransportError::Shutdown));
        let e = EngineError::from(TransportError::Handshake(HandshakeError::AuthFailed));
        assert_eq!(
            (e.http_status(), e.error_type()),
            (500, "peer_incompatible")
        );
        let e = EngineError::from(TransportError::PeerMisbehaved("bad record".into()));
        assert_eq!((e.http_status(), e.error_type()), (500, "peer_misbehaved"));
    }
}
