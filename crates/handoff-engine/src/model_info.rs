//! What the server reads about the loaded model and the engine's load.

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
