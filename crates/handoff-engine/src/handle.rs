//! The engine's public handle: submit requests, read their streams, read load.
//! The scheduler thread owns all engine state; this handle only sends it
//! commands (TGI's queue pattern).

use std::sync::Arc;

use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;
use tokio::sync::{mpsc, oneshot};

use crate::error::EngineError;
use crate::request::{GenerateRequest, StreamEvent};

/// What the server needs to know about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Name served in `/v1/models` and `served_model_name`.
    pub served_name: String,
    /// Path of the GGUF file.
    pub model_path: String,
    /// Maximum tokens of prompt + output for one request.
    pub context_length: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// KV page size in tokens.
    pub page_size: usize,
    /// The GGUF's `general.architecture` (llama, mistral, qwen2, qwen3,
    /// gemma3).
    pub architecture: String,
    /// The file's recommended sampling (`general.sampling.*`).
    pub sampling_defaults: handoff_model::SamplingDefaults,
    /// Bytes of weights the model reads, in the phase formats.
    pub weight_bytes: usize,
    /// Of `weight_bytes`, those read in place from a mapped file (the GGUF
    /// under `native`, the Q8_0 weight cache): one copy per host in the
    /// page cache, shared by every process mapping the file; the rest is
    /// this process's own.
    pub weight_bytes_mapped: usize,
    /// What became of the Q8_0 weight cache at load (`off`, `mapped from
    /// PATH`, `written to PATH and mapped`, `unavailable (why)`).
    pub weight_cache: String,
    /// Bytes of its KV pool (allocated whole at start).
    pub kv_bytes: usize,
    /// Element type of the KV pool (`f16`, `f32`).
    pub kv_dtype: &'static str,
}

/// A point-in-time view of the engine's load (for `/get_load`, `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadSnapshot {
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting for admission (KV pages or batch slots).
    pub waiting: usize,
    /// Running requests paused because their reader lags a full
    /// [`STREAM_BUFFER`](crate::events::STREAM_BUFFER) behind.
    pub paused: usize,
    /// Pages in the KV pool.
    pub pages_total: usize,
    /// Pages held for requests (running, queued for a transfer, or read
    /// by one from the prefix cache); cached pages no request reads are
    /// free to evict and not counted.
    pub pages_used: usize,
    /// Pages the prefix cache holds (some of them also in `pages_used`).
    pub pages_cached: usize,
    /// Prefill forward passes run since start (a colocated engine or a
    /// prefill worker; 0 on a decode worker).
    pub prefill_passes: u64,
    /// Sequences in those passes, all together (several per pass when
    /// prompts are batched).
    pub prefill_pass_sequences: u64,
}

/// Cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) inner: Arc<crate::engine::Shared>,
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
            .send(crate::scheduler::Command::FlushCache(tx))
            .map_err(|_| EngineError::ShuttingDown)?;
        rx.await.map_err(|_| EngineError::ShuttingDown)
    }
}

/// The events of one request: its tokens, then one `Finished` or `Error`.
/// Drop it to cancel the request. A reader that falls
/// [`STREAM_BUFFER`](crate::events::STREAM_BUFFER) tokens behind pauses the
/// request's generation until it catches up.
#[derive(Debug)]
pub struct RequestStream {
    tokens: mpsc::Receiver<StreamEvent>,
    last: Option<oneshot::Receiver<StreamEvent>>,
}

impl RequestStream {
    pub(crate) fn new(
        tokens: mpsc::Receiver<StreamEvent>,
        last: oneshot::Receiver<StreamEvent>,
    ) -> Self {
        Self {
            tokens,
            last: Some(last),
        }
    }

    /// Next event; `None` after `Finished`/`Error` has been yielded (or
    /// when the engine dropped the request without a last event).
    pub async fn next(&mut self) -> Option<StreamEvent> {
        if let Some(ev) = self.tokens.recv().await {
            return Some(ev);
        }
        self.last.take()?.await.ok()
    }

    /// Blocking variant of [`RequestStream::next`] for non-async callers (tests, benches).
    pub fn blocking_next(&mut self) -> Option<StreamEvent> {
        if let Some(ev) = self.tokens.blocking_recv() {
            return Some(ev);
        }
        self.last.take()?.blocking_recv().ok()
    }
}
