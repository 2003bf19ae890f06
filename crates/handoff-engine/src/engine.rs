//! Starting the engine: load the model, build the KV pool, spawn the
//! scheduler thread that owns them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};

use handoff_kv::{KvPool, PageAllocator, PrefixCache};

use crate::prefill_pass::PassCounts;
use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;
use handoff_model::{CacheOutcome, Llama};

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::events::EventSender;
use crate::handle::{EngineHandle, LoadSnapshot, ModelInfo};
use crate::request::GenerateRequest;
use crate::scheduler::{Command, Scheduler};

/// State shared between the handle and the scheduler thread. Only counters
/// and immutable data live here; the scheduler owns everything else.
pub(crate) struct Shared {
    pub info: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub commands: std_mpsc::Sender<Command>,
    pub allocator: PageAllocator,
    pub counters: Arc<Counters>,
    /// Refuse new requests once this many wait (`EngineConfig::max_waiting`).
    pub max_waiting: usize,
}

/// Load counters the scheduler publishes after every step.
#[derive(Default)]
pub(crate) struct Counters {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Running requests whose reader lags a full buffer behind.
    pub paused: AtomicUsize,
    /// Pages the prefix cache holds, and of those the evictable ones.
    pub cache_pages: AtomicUsize,
    pub cache_evictable: AtomicUsize,
    /// Prefill passes run, and the sequences in them, since start.
    pub prefill: PassCounts,
}

impl Shared {
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        validate(&self.info, self.allocator.stats().total, req)
    }

    pub fn submit(&self, req: GenerateRequest, tx: EventSender) -> Result<(), EngineError> {
        // The count is the scheduler's last published one, so a burst within
        // one step may overshoot the limit by that burst: a bound, not a quota.
        let waiting = self.counters.waiting.load(Ordering::Acquire);
        if waiting >= self.max_waiting {
            return Err(EngineError::Overloaded {
                waiting,
                limit: self.max_waiting,
            });
        }
        self.commands
            .send(Command::Submit(Box::new(req), tx))
            .map_err(|_| EngineError::ShuttingDown)
    }

    pub fn load(&self) -> LoadSnapshot {
        let pages = self.allocator.stats();
        let evictable = self.counters.cache_evictable.load(Ordering::Acquire);
        let (prefill_passes, prefill_pass_sequences) = self.counters.prefill.totals();
        LoadSnapshot {
            running: self.counters.running.load(Ordering::Acquire),
            waiting: self.counters.waiting.load(Ordering::Acquire),
            paused: self.counters.paused.load(Ordering::Acquire),
            pages_total: pages.total,
            pages_used: pages.leased.saturating_sub(evictable),
            pages_cached: self.counters.cache_pages.load(Ordering::Acquire),
            prefill_passes,
            prefill_pass_sequences,
        }
    }
}

/// Most `logit_bias` entries one request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Every limit a request must pass before it enters any queue (colocated,
/// prefill and decode engines alike): prompt, sampling parameters, context,
/// KV capacity of a pool of `total_pages` pages.
pub(crate) fn validate(
    info: &ModelInfo,
    total_pages: usize,
    req: &GenerateRequest,
) -> Result<(), EngineError> {
    let p = &req.sampling;
    if req.prompt_ids.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if let Some(&id) = req
        .prompt_ids
        .iter()
        .find(|&&id| id as usize >= info.vocab_size)
    {
        return Err(EngineError::TokenOutOfRange {
            id,
            vocab_size: info.vocab_size,
        });
    }
    if p.max_new_tokens == 0 {
        return Err(EngineError::InvalidParams(
            "max_tokens must be at least 1".into(),
        ));
    }
    if let Some(&id) = req
        .output_so_far
        .iter()
        .find(|&&id| id as usize >= info.vocab_size)
    {
        return Err(EngineError::TokenOutOfRange {
            id,
            vocab_size: info.vocab_size,
        });
    }
    if req.output_so_far.len() >= p.max_new_tokens {
        return Err(EngineError::InvalidParams(format!(
            "resume_output_ids: {} tokens were already generated, which leaves nothing to generate under max_tokens {}",
            req.output_so_far.len(),
            p.max_new_tokens
        )));
    }
    if !req.output_so_far.is_empty() && p.prompt_logprobs {
        return Err(EngineError::InvalidParams(
            "resume_output_ids: a continued generation does not score its prompt again (the prompt's log-probabilities came with the first token)".into(),
        ));
    }
    if p.top_logprobs > handoff_model::sampling::MAX_TOP_LOGPROBS {
        return Err(EngineError::InvalidParams(format!(
            "top_logprobs must be at most {}, got {}",
            handoff_model::sampling::MAX_TOP_LOGPROBS,
            p.top_logprobs
        )));
    }
    if !p.temperature.is_finite() || p.temperature < 0.0 {
        return Err(EngineError::InvalidParams(format!(
            "temperature must be a finite number >= 0, got {}",
            p.temperature
        )));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return Err(EngineError::InvalidParams(format!(
            "top_p must be in (0, 1], got {}",
            p.top_p
        )));
    }
    if p.stop.iter().any(|s| s.is_empty()) {
        return Err(EngineError::InvalidParams(
            "stop strings must not be empty".into(),
        ));
    }
    if !(0.0..=1.0).contains(&p.min_p) {
        return Err(EngineError::InvalidParams(format!(
            "min_p must be in [0, 1], got {}",
            p.min_p
        )));
    }
    let pen = &p.penalties;
    for (name, v) in [
        ("presence_penalty", pen.presence),
        ("frequency_penalty", pen.frequency),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(EngineError::InvalidParams(format!(
                "{name} must be in [-2, 2], got {v}"
            )));
        }
    }
    if !(pen.repetition > 0.0 && pen.repetition <= 2.0) {
        return Err(EngineError::InvalidParams(format!(
            "repetition_penalty must be in (0, 2], got {}",
            pen.repetition
        )));
    }
    if pen.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(EngineError::InvalidParams(format!(
            "logit_bias holds {} tokens: at most {MAX_LOGIT_BIAS} are accepted",
            pen.logit_bias.len()
        )));
    }
    if let Some(&(id, b)) = pen
        .logit_bias
        .iter()
        .find(|&&(id, b)| id as usize >= info.vocab_size || !(-100.0..=100.0).contains(&b))
    {
        return Err(EngineError::InvalidParams(format!(
            "logit_bias: token {id} with bias {b}: tokens must be below the vocabulary size {} and biases in [-100, 100]",
            info.vocab_size
        )));
    }
    if p.min_new_tokens > p.max_new_tokens {
        return Err(EngineError::InvalidParams(format!(
            "min_new_tokens ({}) must not exceed max_new_tokens ({})",
            p.min_new_tokens, p.max_new_tokens
        )));
    }
    let total = req.prompt_ids.len().saturating_add(p.max_new_tokens);
    if total > info.context_length {
        return Err(EngineError::ContextExceeded {
            prompt_tokens: req.prompt_ids.len(),
            max_new_tokens: p.max_new_tokens,
            context_length: info.context_length,
        });
    }
    let needed_pages = total.div_ceil(info.page_size);
    if needed_pages > total_pages {
        return Err(EngineError::ExceedsKvCapacity {
            needed_pages,
            total_pages,
        });
    }
    Ok(())
}

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
