//! The one error type of the HTTP API: every failure becomes
//! an OpenAI-style body `{"error":{"message","type","code","param"}}` with its
//! real status, both as a plain response and as an SSE error event.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use handoff_engine::error::EngineError;
use handoff_model::chat_template::ChatTemplateError;
use handoff_model::tokenizer::TokenizerError;
use serde::Serialize;

/// Why a request failed, with everything the client is told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// OpenAI error category: `invalid_request_error`, `server_error`, `service_unavailable`.
    pub kind: &'static str,
    /// Stable, specific label (the engine's `error_type()` or a server one), used in metrics.
    pub code: &'static str,
    /// What went wrong and how to fix it.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
}

/// The JSON body of an error.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// The error object.
    pub error: ErrorObject<'a>,
}

/// OpenAI's error object.
#[derive(Debug, Serialize)]
pub struct ErrorObject<'a> {
    /// Human-readable message.
    pub message: &'a str,
    /// Category.
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// Specific label.
    pub code: &'a str,
    /// Field at fault.
    pub param: Option<&'a str>,
}

fn kind_for(status: u16) -> &'static str {
    match status {
        400..=499 => "invalid_request_error",
        503 => "service_unavailable",
        _ => "server_error",
    }
}

impl ApiError {
    /// An error with a status, a specific label and a message.
    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind: kind_for(status),
            code,
            message: message.into(),
            param: None,
        }
    }

    /// 400 for a request field with an invalid value.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        let mut e = ApiError::new(400, "invalid_value", message);
        e.param = Some(param.to_string());
        e
    }

    /// 504 for a request the stall watchdog ended: its error `type` is
    /// `stalled` too, so monitoring that reads types sees it.
    pub fn stalled(message: impl Into<String>) -> Self {
        let mut e = ApiError::new(504, "stalled", message);
        e.kind = "stalled";
        e
    }

    /// 400 for a malformed request.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(400, code, message)
    }

    /// The stable label (same as [`ApiError::code`]).
    pub fn error_type(&self) -> &'static str {
        self.code
    }

    /// HTTP status.
    pub fn http_status(&self) -> u16 {
        self.status
    }

    /// The body as a JSON value (for SSE error events).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self.body()).unwrap_or(serde_json::Value::Null)
    }

    fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                code: self.code,
                param: self.param.as_deref(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::warn!(status = self.status, code = self.code, "{}", self.message);
        } else {
            tracing::debug!(status = self.status, code = self.code, "{}", self.message);
        }
        (status, axum::Json(self.body())).into_response()
    }
}

/// Status and label come from the typed engine error (for a transfer
/// failure, the `TransferError` the side that saw it reported), the message
/// is its `Display`: the same body as a response and as an SSE error event.
impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let mut err = ApiError::new(e.http_status(), e.error_type(), e.to_string());
        err.param = e.param().map(str::to_string);
        err
    }
}

impl ApiError {
    /// Name the field at fault as `endpoint`'s request shape does (the
    /// engine names them as `/v1/completions` does).
    pub fn for_endpoint(mut self, endpoint: &str) -> Self {
        self.param = match (self.param.take().as_deref(), endpoint) {
            (Some("prompt"), "/v1/chat/completions") => Some("messages".into()),
            // `text` or `input_ids`: the engine cannot tell which.
            (Some("prompt"), "/generate") => None,
            (Some("max_tokens"), "/generate") => Some("sampling_params.max_new_tokens".into()),
            (p, _) => p.map(str::to_string),
        };
        self
    }
}

impl From<TokenizerError> for ApiError {
    fn from(e: TokenizerError) -> Self {
        ApiError::new(e.http_status(), e.error_type(), e.to_string())
    }
}

impl From<ChatTemplateError> for ApiError {
    fn from(e: ChatTemplateError) -> Self {
        ApiError::new(e.http_status(), e.error_type(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::invalid_param("n", "n must be 1");
        assert_eq!(
            e.to_json(),
            serde_json::json!({"error": {"message": "n must be 1", "type": "invalid_request_error", "code": "invalid_value", "param": "n"}})
        );
    }

    #[test]
    fn engine_errors_keep_status_and_label() {
        let e: ApiError = EngineError::ContextExceeded {
            prompt_tokens: 10,
            max_new_tokens: 5,
            context_length: 12,
        }
        .into();
        assert_eq!(e.status, 400);
        assert_eq!(e.code, "context_length_exceeded");
        assert!(e.message.contains("context length of 12"));
        let e: ApiError = EngineError::ShuttingDown.into();
        assert_eq!((e.status, e.kind), (503, "service_unavailable"));
    }

    #[test]
    fn transfer_failures_keep_the_typed_status_label_and_reason() {
        use handoff_engine::error::{TransferError, TransportError};
        use handoff_proto::{FailureKind, HandshakeError, Role};
        // A prefill's internal fault, reported over the wire.
        let e: ApiError = EngineError::from(TransferError::from_wire(
            FailureKind::Internal,
            "prefill gave up".into(),
            500,
            None,
            Role::Prefill,
        ))
        .into();
        assert_eq!(
            e.to_json(),
            serde_json::json!({"error": {"message": "prefill gave up", "type": "server_error", "code": "internal", "param": null}})
        );
        // The prefill's rejection keeps its 400 and message.
        let e: ApiError = EngineError::from(TransferError::Rejected {
            http_status: 400,
            reason: "prompt too long".into(),
            code: None,
        })
        .into();
        assert_eq!(
            (e.status, e.kind, e.code, e.message.as_str()),
            (400, "invalid_request_error", "rejected", "prompt too long")
        );
        // A dead peer is a 503 the client may retry.
        let e: ApiError = EngineError::from(TransferError::from_wire(
            FailureKind::PeerDead,
            "data link closed".into(),
            503,
            None,
            Role::Prefill,
        ))
        .into();
        assert_eq!(
            (e.status, e.kind, e.code),
            (503, "service_unavailable", "peer_dead")
        );
        // A handshake that timed out is a timeout, not an incompatibility.
        let e: ApiError = EngineError::from(TransportError::Handshake(HandshakeError::TimedOut(
            std::time::Duration::from_secs(2),
        )))
        .into();
        assert_eq!(
            (e.status, e.kind, e.code),
            (504, "server_error", "handshake_timeout")
        );
    }
}
