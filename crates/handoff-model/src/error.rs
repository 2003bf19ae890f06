//! Errors of model loading and execution.

/// What went wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The file could not be opened or read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not a GGUF file candle can parse.
    #[error("invalid GGUF file {path}: {reason}")]
    InvalidGguf {
        /// The path given.
        path: String,
        /// What the parser said.
        reason: String,
    },
    /// The GGUF's `general.architecture` is not one handoff runs.
    #[error("unsupported model architecture {0:?}: handoff runs llama, mistral, qwen2, qwen3 and gemma3")]
    UnsupportedArchitecture(String),
    /// The file asks for something handoff does not implement (a metadata
    /// key, a tensor, a rope scaling type, experts): refused rather than
    /// ignored, since ignoring it would change the model's output.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A required metadata key or tensor is missing or has the wrong type/shape.
    #[error("malformed model: {0}")]
    Malformed(String),
    /// The forward pass failed.
    #[error("forward pass failed: {0}")]
    Forward(String),
    /// The KV pool refused an operation.
    #[error(transparent)]
    Kv(#[from] handoff_kv::KvError),
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Forward(e.to_string())
    }
}
