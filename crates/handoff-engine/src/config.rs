//! Engine configuration.

use std::path::PathBuf;

use handoff_kv::KvDtype;
use handoff_model::PhaseFormats;

/// How to load the model and size the engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// GGUF file.
    pub model_path: PathBuf,
    /// Compute threads for the forward pass.
    pub threads: usize,
    /// KV page size in tokens.
    pub page_size: usize,
    /// Pages in the KV pool.
    pub kv_pages: usize,
    /// Element type of stored K and V (f16 halves the pool and the bytes on
    /// the wire; the arithmetic is f32 either way).
    pub kv_dtype: KvDtype,
    /// Most requests in the running batch.
    pub max_batch: usize,
    /// Most requests waiting for admission; beyond it a request is refused
    /// with 503 (overloaded) instead of queueing without bound.
    pub max_waiting: usize,
    /// Most prompt tokens one prefill step computes (longer prompts are chunked
    /// so running requests keep decoding in between).
    pub prefill_chunk: usize,
    /// Context limit per request; defaults to (and may not exceed) the model's.
    pub max_context: Option<usize>,
    /// Name served in the API; defaults to the file stem.
    pub served_name: Option<String>,
    /// Weight formats per phase.
    pub formats: PhaseFormats,
    /// Reuse the KV of cached prompt prefixes (the radix cache); off with
    /// `--disable-radix-cache`.
    pub prefix_cache: bool,
    /// Directory of the Q8_0 weight cache (`Llama::load_cached`): the
    /// converted weights are written there once and mapped by every
    /// process of the host. `None`: each process converts its own.
    pub weight_cache: Option<PathBuf>,
}

impl EngineConfig {
    /// Defaults for a model path: 2 threads, 16-token pages, 2048 f16 pages,
    /// batch 32, chunk 256.
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            threads: 2,
            page_size: 16,
            kv_pages: 2048,
            kv_dtype: KvDtype::F16,
            max_batch: 32,
            max_waiting: 4096,
            prefill_chunk: 256,
            max_context: None,
            served_name: None,
            formats: PhaseFormats::default(),
            prefix_cache: true,
            weight_cache: None,
        }
    }
}
