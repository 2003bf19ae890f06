//! State shared between the engine's handles and its scheduler thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};

use handoff_kv::PageAllocator;
use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;

use crate::command::Command;
use crate::error::EngineError;
use crate::events::EventSender;
use crate::model_info::{LoadSnapshot, ModelInfo};
use crate::prefill_pass::PassCounts;
use crate::request::GenerateRequest;
use crate::validate::validate;

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
