//! What the engine's handles send its scheduler thread.

use handoff_kv::{PageIndex, PageLease, PrefixLock};

use crate::events::EventSender;
use crate::request::GenerateRequest;

/// What the handle sends the scheduler.
pub(crate) enum Command {
    /// A validated request and where its events go.
    Submit(Box<GenerateRequest>, EventSender),
    /// Disaggregated decode: a request whose prompt KV already sits in its
    /// pages (written by a prefill worker) joins the running batch with the
    /// first token the prefill sampled.
    Resume(Box<Resumed>),
    /// Empty the prefix cache of pages no request reads; answer how many.
    FlushCache(tokio::sync::oneshot::Sender<usize>),
    /// Disaggregated decode prefilling here (a short prompt, a failed
    /// transfer, a migrated stream): a validated request whose pages are
    /// already reserved (with the cached prefix they reuse); it prefills in
    /// this scheduler exactly as a colocated request would.
    Prefill(Box<GenerateRequest>, SeqPages, EventSender),
}

/// A sequence's pages: a locked cached prefix, then its own. Fields drop
/// in order: the lock before the lease, so a request waiting for pages is
/// woken by the lease's return and then finds the cached pages evictable
/// too.
pub(crate) struct SeqPages {
    /// Every page in order (page `i` holds tokens `i*page_size..`).
    pub pages: Vec<PageIndex>,
    /// The cached pages it reads, kept from eviction.
    pub prefix: PrefixLock,
    /// Its own pages (those handed to the prefix cache left it).
    pub lease: PageLease,
    /// Prompt tokens whose K/V came from the cache.
    pub prefix_tokens: usize,
}

impl SeqPages {
    /// `prefix`'s pages, then `lease`'s; the prompt tokens `prefix` covers.
    pub fn new(prefix: PrefixLock, lease: PageLease, page_size: usize) -> Self {
        Self {
            pages: prefix.followed_by(&lease),
            prefix_tokens: prefix.tokens(page_size),
            prefix,
            lease,
        }
    }
}

impl Resumed {
    /// Its sender; the rest (its pages) is dropped here.
    pub fn into_sender(self) -> EventSender {
        self.tx
    }
}

/// A request prefilled elsewhere, ready to decode.
pub(crate) struct Resumed {
    pub req: GenerateRequest,
    pub tx: EventSender,
    /// Pages for prompt + max_new_tokens; the prompt's KV is in them.
    pub pages: SeqPages,
    /// The first token and its logprob, as the prefill sampled them.
    pub first: (u32, f32),
    /// The first position's most likely tokens, as the prefill computed
    /// them (`top_logprobs` of them, or none).
    pub first_top: Vec<(u32, f32)>,
    /// The prompt's scores, as the prefill computed them (`prompt_logprobs`).
    pub prompt_scores: Vec<crate::request::PromptLogprob>,
    /// Seed of the request's sampler (the prefill used the same one).
    pub seed: u64,
}
