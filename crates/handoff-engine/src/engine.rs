//! Starting the engine: load the model, build the KV pool, spawn the
//! scheduler thread that owns them.

use std::sync::{mpsc as std_mpsc, Arc};

use handoff_kv::{KvPool, PrefixCache};

use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;
use handoff_model::{CacheOutcome, Llama};

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::handle::EngineHandle;
use crate::model_info::ModelInfo;
use crate::shared::{Counters, Shared};

use crate::scheduler::Scheduler;
pub use crate::validate::MAX_LOGIT_BIAS;

/// A loaded model with its tokenizer, KV pool and compute threads: what
/// every engine (colocated, prefill, decode) starts from.
pub(crate) struct Loaded {
    pub model: Arc<Llama>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub pool: KvPool,
    pub info: ModelInfo,
    pub threads: rayon::ThreadPool,
}

impl Loaded {
    /// Move the model and pool into a scheduler thread named `name`; return
    /// the state the handle shares with it.
    pub(crate) fn spawn_scheduler(
        self,
        config: &EngineConfig,
        name: &str,
        cache: Option<PrefixCache>,
    ) -> Result<Shared, EngineError> {
        let (tx, rx) = std_mpsc::channel();
        let shared = Shared {
            info: self.info,
            tokenizer: self.tokenizer,
            chat_template: self.chat_template,
            commands: tx,
            allocator: self.pool.allocator().clone(),
            counters: Arc::new(Counters::default()),
            max_waiting: config.max_waiting,
        };
        let scheduler = Scheduler {
            rows_independent: self.model.prefill_rows_independent(),
            model: self.model,
            pool: self.pool,
            tokenizer: shared.tokenizer.clone(),
            counters: shared.counters.clone(),
            threads: self.threads,
            max_batch: config.max_batch,
            prefill_chunk: config.prefill_chunk,
            waiting: Default::default(),
            active: Vec::new(),
            resumed: Default::default(),
            order: Default::default(),
            cache,
        };
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || scheduler.run(rx))
            .map_err(|e| EngineError::Model(format!("cannot start the {name} thread: {e}")))?;
        Ok(shared)
    }
}

/// Check `config`, load the model, build the KV pool (in shared memory when
/// `shared_pool`, as the transfer layer needs) and the compute threads.
pub(crate) fn load(config: &EngineConfig, shared_pool: bool) -> Result<Loaded, EngineError> {
    if config.threads == 0
        || config.page_size == 0
        || config.kv_pages == 0
        || config.max_batch == 0
        || config.prefill_chunk == 0
    {
        return Err(EngineError::InvalidParams(
            "threads, page size, KV pages, max batch and prefill chunk must all be at least 1"
                .into(),
        ));
    }
    let (model, content, cache) = Llama::load_cached(
        &config.model_path,
        config.formats,
        config.weight_cache.as_deref(),
    )
    .map_err(|e| EngineError::Load(e.to_string()))?;
    match &cache {
        CacheOutcome::Unavailable(_) => {
            tracing::warn!("weight cache {cache}: this process holds its own converted weights")
        }
        CacheOutcome::Off => {}
        _ => tracing::info!("weight cache {cache}"),
    }
    let tokenizer = Tokenizer::from_gguf(&content).map_err(|e| EngineError::Load(e.to_string()))?;
    let chat_template =
        ChatTemplate::from_gguf(&content).map_err(|e| EngineError::Load(e.to_string()))?;
    let model_ctx = model.config().context_length;
    let context_length = match config.max_context {
        Some(c) if c == 0 || c > model_ctx => {
            return Err(EngineError::InvalidParams(format!(
                "context length must be in 1..={model_ctx} (the model's), got {c}"
            )))
        }
        Some(c) => c,
        None => model_ctx,
    };
    let geometry = model.kv_geometry(config.page_size, config.kv_dtype);
    let pool = if shared_pool {
        KvPool::new_shared(geometry, config.kv_pages).map(|(p, _)| p)
    } else {
        KvPool::new(geometry, config.kv_pages)
    }
    .map_err(|e| EngineError::InvalidParams(e.to_string()))?;
    let served_name = config.served_name.clone().unwrap_or_else(|| {
        config
            .model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let info = ModelInfo {
        served_name,
        model_path: config.model_path.display().to_string(),
        context_length,
        vocab_size: model.config().vocab_size,
        page_size: config.page_size,
        architecture: model.config().architecture.clone(),
        sampling_defaults: model.config().sampling,
        weight_bytes: model.weight_bytes(),
        weight_bytes_mapped: model.mapped_weight_bytes(),
        weight_cache: cache.to_string(),
        kv_bytes: geometry.page_bytes() * config.kv_pages,
        kv_dtype: geometry.dtype.name(),
    };
    tracing::info!(
        weights_mib = info.weight_bytes >> 20,
        of_which_mapped_mib = info.weight_bytes_mapped >> 20,
        kv_mib = info.kv_bytes >> 20,
        kv_pages = config.kv_pages,
        kv_dtype = info.kv_dtype,
        "memory: the weights (those mapped from the file are shared by every process mapping it) and this process's KV pool"
    );
    let threads = rayon::ThreadPoolBuilder::new()
        .num_threads(config.threads)
        .thread_name(|i| format!("handoff-compute-{i}"))
        .build()
        .map_err(|e| EngineError::Model(format!("cannot start compute threads: {e}")))?;
    Ok(Loaded {
        model: Arc::new(model),
        tokenizer: Arc::new(tokenizer),
        chat_template,
        pool,
        info,
        threads,
    })
}

/// The colocated engine.
pub struct Engine;

impl Engine {
    /// Load the model and start the scheduler thread. Returns once the model
    /// is loaded and the engine accepts requests.
    pub fn start(config: EngineConfig) -> Result<EngineHandle, EngineError> {
        let cache = config
            .prefix_cache
            .then(|| PrefixCache::new(config.page_size));
        let shared =
            Arc::new(load(&config, false)?.spawn_scheduler(&config, "handoff-scheduler", cache)?);
        tracing::info!(
            model = %shared.info.model_path,
            context = shared.info.context_length,
            page_size = shared.info.page_size,
            kv_pages = config.kv_pages,
            formats = ?config.formats,
            prefix_cache = config.prefix_cache,
            "engine started"
        );
        Ok(EngineHandle { inner: shared })
    }
}
