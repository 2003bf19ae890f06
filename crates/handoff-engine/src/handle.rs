//! The engine's public handle: submit requests, read their streams, read load.
//! The scheduler thread owns all engine state; this handle only sends it
//! commands (TGI's queue pattern).

use std::sync::Arc;

use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;

use crate::error::EngineError;
use crate::request::GenerateRequest;
use crate::shared::Shared;

pub use crate::events::RequestStream;
pub use crate::model_info::{LoadSnapshot, ModelInfo};

/// Cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) inner: Arc<Shared>,
}

impl EngineHandle {
    /// The loaded model.
    pub fn model(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    /// The model's chat template, if the GGUF has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    /// Check a request against every limit without queueing it. `submit`
    /// calls this too; use it alone to reject before doing other work.
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        self.inner.validate(req)
    }

    /// Validate and enqueue a request. The returned stream yields its tokens;
    /// dropping the stream cancels the request and frees its pages at the
    /// engine's next step.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, EngineError> {
        self.inner.validate(&req)?;
        let (tx, stream) = crate::events::channel();
        self.inner.submit(req, tx)?;
        Ok(stream)
    }

    /// Current load.
    pub fn load(&self) -> LoadSnapshot {
        self.inner.load()
    }

    /// Empty the prefix cache of every page no request reads; returns how
    /// many pages that freed (0 with the cache off).
    pub async fn flush_cache(&self) -> Result<usize, EngineError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.inner
            .commands
            .send(crate::command::Command::FlushCache(tx))
            .map_err(|_| EngineError::ShuttingDown)?;
        rx.await.map_err(|_| EngineError::ShuttingDown)
    }
}
