//! The colocated scheduler loop: one thread
//! owns the model, the KV pool, the prefix cache and every request. Each
//! iteration: take new requests, drop cancelled ones, admit waiting requests
//! whose pages fit (reusing the longest cached prefix, evicting unused cached
//! pages when the pool runs short), run one prefill chunk, run one decode
//! step for the running batch. A request's full prompt pages go to the cache
//! once its prefill ends.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{mpsc as std_mpsc, Arc};

use handoff_kv::{KvPool, PrefixCache, PrefixLock};
use handoff_model::sampling::Sampler;
use handoff_model::tokenizer::Tokenizer;
use handoff_model::{Llama, Phase, SeqChunk};

use crate::command::{Command, Resumed, SeqPages};
use crate::error::EngineError;
use crate::events::{EventSender, NotSent};
use crate::fair::FairOrder;
use crate::grammar::{Allowed, Grammar, GrammarError};
use crate::prefill_pass::{self, pack};
use crate::request::{FinishReason, Finished, GenerateRequest, StreamEvent, TokenOut};
use crate::shared::Counters;
use crate::stop::TextTracker;

/// How long the scheduler waits when every running request is paused on a
/// lagging reader before it looks again (a reader taking tokens does not
/// wake it).
const PAUSED_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// Send `e` to each request; each item is a request's sender, taken out of
/// what it held (its page lease), which is dropped first: a client that sees
/// the end of its stream never sees its pages still held.
fn fail_all(items: impl Iterator<Item = EventSender>, e: &EngineError) {
    for tx in items {
        tx.end(StreamEvent::Error(e.clone()));
    }
}

pub(crate) struct Waiting {
    req: Box<GenerateRequest>,
    tx: EventSender,
}

/// A request holding pages: prefilling, then decoding.
pub(crate) struct Active {
    tx: EventSender,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens to prefill: the prompt, then the output another worker
    /// generated before this one took over (mid-stream migration).
    prefill_len: usize,
    /// Tokens whose K/V are in the pool.
    cached: usize,
    /// Its pages: the cached prefix's (locked), then its own.
    seq: SeqPages,
    sampler: Sampler,
    text: TextTracker,
    max_new: usize,
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    /// Its parameters (the end-of-generation mask before `min_new_tokens`).
    sampling: crate::request::SamplingParams,
    /// The prompt's scores so far (`prompt_logprobs`), sent with the first
    /// token.
    prompt_scores: Vec<crate::request::PromptLogprob>,
}

impl Active {
    /// Its sender; the rest (its pages) is dropped here.
    fn into_sender(self) -> EventSender {
        self.tx
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn prefilling(&self) -> bool {
        self.cached < self.prefill_len
    }

    /// A request starting in `seq` (its cached prefix's K/V already there).
    /// Output generated elsewhere before (`output_so_far`) is replayed as
    /// [`Scheduler::emit_token`] would have taken it: the sampler's draw and
    /// penalties, the grammar, the text (which the client already has); a
    /// token that would have ended the generation is refused.
    fn start(
        req: GenerateRequest,
        tx: EventSender,
        seq: SeqPages,
        tokenizer: &Tokenizer,
    ) -> Result<Active, (EventSender, EngineError)> {
        let s = &req.sampling;
        let seed = s.seed.unwrap_or_else(rand::random);
        let mut a = Active {
            prompt_len: req.prompt_ids.len(),
            prefill_len: req.prompt_ids.len(),
            cached: seq.prefix_tokens,
            seq,
            sampler: Sampler::for_prompt(s.sampler(seed), &req.prompt_ids),
            text: TextTracker::for_params(s),
            max_new: s.max_new_tokens,
            stop_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
            sampling: req.sampling,
            tokens: req.prompt_ids,
            tx,
            prompt_scores: Vec::new(),
        };
        let eos = tokenizer.eog_ids();
        for (i, &id) in req.output_so_far.iter().enumerate() {
            a.tokens.push(id);
            a.sampler.skip_draw();
            a.sampler.accept(id);
            let refuse = |why: String| {
                EngineError::InvalidParams(format!("resume_output_ids[{i}] (token {id}) {why}"))
            };
            if let Some(g) = &mut a.sampling.grammar {
                if let Err(e) = g.accept(id) {
                    return Err((a.tx, refuse(format!("does not fit the grammar: {}", e.0))));
                }
                if g.finished() {
                    return Err((
                        a.tx,
                        refuse("completes the grammar: nothing is left to generate".into()),
                    ));
                }
            }
            let may_end = a.generated() >= a.sampling.min_new_tokens;
            if may_end && ((!a.ignore_eos && eos.contains(&id)) || a.stop_ids.contains(&id)) {
                return Err((a.tx, refuse("ends the generation".into())));
            }
            if let Some(m) = a.text.push(tokenizer, id, may_end).matched {
                return Err((a.tx, refuse(format!("completes the stop string {m:?}"))));
            }
        }
        a.prefill_len = a.tokens.len();
        Ok(a)
    }
}

pub(crate) struct Scheduler {
    pub model: Arc<Llama>,
    pub pool: KvPool,
    pub tokenizer: Arc<Tokenizer>,
    pub counters: Arc<Counters>,
    pub threads: rayon::ThreadPool,
    pub max_batch: usize,
    pub prefill_chunk: usize,
    /// Whether several requests may share a prefill pass
    /// (`Llama::prefill_rows_independent`, read once at start).
    pub rows_independent: bool,
    pub waiting: VecDeque<Waiting>,
    pub active: Vec<Active>,
    /// Requests prefilled elsewhere, waiting for a batch slot (their pages
    /// are already held, so they go before `waiting`).
    pub resumed: VecDeque<Resumed>,
    /// Which waiting or resumed request goes next ([`crate::fair`]).
    pub order: FairOrder,
    /// The prefix cache (`None` when disabled).
    pub cache: Option<PrefixCache>,
}

impl Scheduler {
    pub fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        let mut pending = None;
        loop {
            let idle = self.active.is_empty() && self.waiting.is_empty() && self.resumed.is_empty();
            let first = if pending.is_some() {
                pending.take()
            } else if idle {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => break,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                match cmd {
                    Command::Submit(req, tx) => self.waiting.push_back(Waiting { req, tx }),
                    Command::Resume(r) => self.resumed.push_back(*r),
                    Command::Prefill(req, pages, tx) => self.start_prefilled(*req, pages, tx),
                    Command::FlushCache(reply) => {
                        let freed = self.cache.as_mut().map_or(0, PrefixCache::flush);
                        tracing::info!(pages = freed, "prefix cache flushed");
                        self.publish_cache();
                        let _ = reply.send(freed);
                    }
                }
            }
            self.drop_cancelled();
            while self.active.len() < self.max_batch {
                let Some(i) = self.order.next(self.resumed.iter().map(|r| &r.req.class)) else {
                    break;
                };
                let Some(r) = self.resumed.remove(i) else {
                    break;
                };
                let work = r.req.prompt_ids.len() + r.req.sampling.max_new_tokens;
                self.order.charge(&r.req.class, work);
                self.resume(r);
            }
            self.admit();
            self.publish();
            let ran = match self.step() {
                Ok(ran) => ran,
                Err(e) => {
                    tracing::error!(error = %e, "forward pass failed; failing the running batch");
                    fail_all(self.active.drain(..).map(Active::into_sender), &e);
                    true
                }
            };
            self.publish();
            if !ran {
                // Every running request is paused on a lagging reader: wait
                // for a command, or a while for readers to catch up.
                match rx.recv_timeout(PAUSED_POLL) {
                    Ok(c) => pending = Some(c),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
        }
        let e = EngineError::ShuttingDown;
        fail_all(self.waiting.drain(..).map(|w| w.tx), &e);
        fail_all(self.resumed.drain(..).map(Resumed::into_sender), &e);
        fail_all(self.active.drain(..).map(Active::into_sender), &e);
        self.publish();
    }

    /// The cache's counts, published before anyone can see their effect (a
    /// finished request's stream end, a flush's reply): `pages_used` leaves
    /// out the cached pages no request reads.
    fn publish_cache(&self) {
        if let Some(c) = &self.cache {
            let s = c.stats();
            self.counters.cache_pages.store(s.pages, Ordering::Release);
            self.counters
                .cache_evictable
                .store(s.evictable, Ordering::Release);
        }
    }

    fn publish(&self) {
        self.publish_cache();
        self.counters
            .running
            .store(self.active.len(), Ordering::Release);
        self.counters
            .waiting
            .store(self.waiting.len() + self.resumed.len(), Ordering::Release);
        let paused = self
            .active
            .iter()
            .filter(|a| !a.prefilling() && !a.tx.has_room())
            .count();
        self.counters.paused.store(paused, Ordering::Release);
    }

    /// A client that went away frees its pages here (dropping the lease).
    fn drop_cancelled(&mut self) {
        let before = self.active.len() + self.waiting.len() + self.resumed.len();
        self.waiting.retain(|w| !w.tx.is_closed());
        self.resumed.retain(|r| !r.tx.is_closed());
        self.active.retain(|a| !a.tx.is_closed());
        let dropped = before - self.active.len() - self.waiting.len() - self.resumed.len();
        if dropped > 0 {
            tracing::debug!(dropped, "cancelled requests released");
        }
    }

    /// Admit waiting requests in their order ([`crate::fair`]: priority,
    /// then a fair share between tenants, then arrival) while pages and
    /// batch slots last; the next in that order waits for pages rather than
    /// letting a smaller request past it. Pages for prompt + max_new_tokens are reserved up front (less
    /// the cached prefix it reuses), so a running request never runs out of
    /// pages mid-generation. Cached pages no request reads are evicted, least
    /// recently used first, when the free ones do not suffice.
    fn admit(&mut self) {
        let page_size = self.pool.geometry().page_size;
        while self.active.len() < self.max_batch {
            let Some(i) = self.order.next(self.waiting.iter().map(|w| &w.req.class)) else {
                break;
            };
            let w = &self.waiting[i];
            // A scored prompt is computed whole: a cached prefix has no
            // logits.
            let prefix = match &mut self.cache {
                Some(c) if !w.req.sampling.prompt_logprobs => c.lookup(&w.req.prompt_ids),
                _ => PrefixLock::default(),
            };
            let total =
                (w.req.prompt_ids.len() + w.req.sampling.max_new_tokens).div_ceil(page_size);
            let need = total - prefix.pages().len();
            let allocator = self.pool.allocator();
            let leased = match &mut self.cache {
                Some(c) => c.lease(allocator, need),
                None => allocator.lease(need),
            };
            let Ok(lease) = leased else { break };
            let Some(w) = self.waiting.remove(i) else {
                break;
            };
            let work = w.req.prompt_ids.len() + w.req.sampling.max_new_tokens;
            self.order.charge(&w.req.class, work);
            let seq = SeqPages::new(prefix, lease, page_size);
            match Active::start(*w.req, w.tx, seq, &self.tokenizer) {
                Ok(a) => self.active.push(a),
                Err((tx, e)) => tx.end(StreamEvent::Error(e)),
            }
        }
    }

    /// A request whose pages were reserved outside (a decode worker
    /// prefilling here) joins the batch at once: the decode engine's
    /// prealloc queue already bounded how many hold pages.
    fn start_prefilled(&mut self, req: GenerateRequest, seq: SeqPages, tx: EventSender) {
        match Active::start(req, tx, seq, &self.tokenizer) {
            Ok(a) => self.active.push(a),
            Err((tx, e)) => tx.end(StreamEvent::Error(e)),
        }
    }

    /// Join a request prefilled elsewhere to the batch and emit its first
    /// token exactly as if it had been sampled here. Its pages are already
    /// reserved: it waits only for a batch slot.
    fn resume(&mut self, r: Resumed) {
        let s = &r.req.sampling;
        let mut sampler = Sampler::for_prompt(s.sampler(r.seed), &r.req.prompt_ids);
        // The prefill drew the first token from the same seed: advance the
        // RNG past that draw (one draw per non-greedy sample).
        sampler.skip_draw();
        self.active.push(Active {
            prompt_len: r.req.prompt_ids.len(),
            prefill_len: r.req.prompt_ids.len(),
            cached: r.req.prompt_ids.len(),
            seq: r.pages,
            sampler,
            text: TextTracker::for_params(s),
            max_new: s.max_new_tokens,
            stop_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
            sampling: r.req.sampling.clone(),
            tokens: r.req.prompt_ids,
            tx: r.tx,
            prompt_scores: r.prompt_scores,
        });
        let i = self.active.len() - 1;
        if let Some(last) = self.emit_token(i, r.first.0, r.first.1, r.first_top) {
            self.finish(i, last);
        }
    }

    /// One prefill pass and one decode step; whether it ran anything.
    fn step(&mut self) -> Result<bool, EngineError> {
        let model = self.model.clone();
        let ran = self.prefill_pass(&model)?;
        // One decode step for every request past prefill whose reader has
        // room for its next token; the others are paused until it catches up.
        let idx: Vec<usize> = (0..self.active.len())
            .filter(|&i| !self.active[i].prefilling() && self.active[i].tx.has_room())
            .collect();
        if idx.is_empty() {
            return Ok(ran);
        }
        // The grammar masks of this step depend only on the tokens so far:
        // they compute beside the forward pass (a task the pool's idle
        // thread takes), off the step's critical path.
        let mut grammars: Vec<(usize, Grammar)> = idx
            .iter()
            .filter_map(|&i| self.active[i].sampling.grammar.take().map(|g| (i, g)))
            .collect();
        let chunks: Vec<SeqChunk<'_>> = idx
            .iter()
            .map(|&i| {
                let a = &self.active[i];
                let pos = a.tokens.len() - 1;
                SeqChunk {
                    tokens: &a.tokens[pos..],
                    start_pos: pos,
                    pages: &a.seq.pages,
                }
            })
            .collect();
        let pool = &mut self.pool;
        let forward = || model.forward(pool, &chunks, Phase::Decode);
        // No grammar this step (the usual case): no task beside the pass.
        let (logits, mut masks) = if grammars.is_empty() {
            (self.threads.install(forward), Vec::new())
        } else {
            self.threads.install(|| {
                rayon::join(forward, || {
                    grammars
                        .iter_mut()
                        .map(|(_, g)| Some(g.allowed()))
                        .collect::<Vec<_>>()
                })
            })
        };
        drop(chunks);
        let mut mask_of = vec![None; self.active.len()];
        for ((i, g), m) in grammars.into_iter().zip(masks.iter_mut()) {
            self.active[i].sampling.grammar = Some(g);
            mask_of[i] = m.take();
        }
        let logits = logits.map_err(|e| EngineError::Model(e.to_string()))?;
        let mut finished = Vec::new();
        for (k, &i) in idx.iter().enumerate() {
            if let Some(last) = self.emit(i, &logits[k], mask_of[i].take()) {
                finished.push((i, last));
            }
        }
        for (i, last) in finished.into_iter().rev() {
            self.finish(i, last);
        }
        Ok(true)
    }

    /// One prefill pass: the next chunks of the requests still prefilling,
    /// oldest first, up to `prefill_chunk` tokens together. Several
    /// requests share the pass only when the model computes each row on
    /// its own (`Llama::prefill_rows_independent`, the default `q8_0-rows`
    /// format), so a request's KV and logits are the same bits whatever
    /// shares its pass; otherwise, and for a request scoring its prompt
    /// (logits of every row), a pass holds one request's chunk. Whether it
    /// ran anything.
    fn prefill_pass(&mut self, model: &Llama) -> Result<bool, EngineError> {
        // (request, end of its chunk), in index order.
        let prefilling: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].prefilling())
            .collect();
        let takes = pack(
            prefilling.iter().map(|&i| {
                let a = &self.active[i];
                (a.prefill_len - a.cached, a.sampling.prompt_logprobs)
            }),
            self.prefill_chunk,
            self.rows_independent,
        );
        let pack: Vec<(usize, usize)> = prefilling
            .iter()
            .zip(takes)
            .map(|(&i, take)| (i, self.active[i].cached + take))
            .collect();
        if pack.is_empty() {
            return Ok(false);
        }
        let chunks: Vec<SeqChunk<'_>> = pack
            .iter()
            .map(|&(i, end)| {
                let a = &self.active[i];
                SeqChunk {
                    tokens: &a.tokens[a.cached..end],
                    start_pos: a.cached,
                    pages: &a.seq.pages,
                }
            })
            .collect();
        let every_row = pack.len() == 1 && self.active[pack[0].0].sampling.prompt_logprobs;
        let results = prefill_pass::run(
            model,
            &mut self.pool,
            &self.threads,
            &self.counters.prefill,
            &chunks,
            every_row,
            &mut |_, _| {},
        );
        // Highest index first: finishing a request moves the last one into
        // its place, never one still to handle here.
        for (&(i, end), result) in pack.iter().zip(results).rev() {
            let logits = match result {
                Ok(l) => l,
                Err(e) => {
                    // Only the chunk at fault fails (`prefill_pass::run`).
                    self.finish(i, Some(StreamEvent::Error(e)));
                    continue;
                }
            };
            let a = &mut self.active[i];
            if every_row {
                crate::request::PromptLogprob::score(
                    &a.tokens[..a.prompt_len],
                    a.cached,
                    &logits,
                    a.sampling.top_logprobs,
                    &mut a.prompt_scores,
                );
            }
            let last = logits.last();
            a.cached = end;
            if a.prefilling() {
                continue;
            }
            // The whole prompt's KV is in: its full pages join the cache
            // (this request keeps reading them, locked).
            if let Some(c) = &mut self.cache {
                c.insert(
                    &a.tokens[..a.prompt_len],
                    &a.seq.pages,
                    &mut a.seq.lease,
                    &mut a.seq.prefix,
                );
            }
            if let Some(l) = last {
                if let Some(done) = self.emit(i, l, None) {
                    self.finish(i, done);
                }
            }
        }
        Ok(true)
    }

    /// Remove request `i`, returning its pages, then send its last event: a
    /// client that sees the end of its stream never sees its pages still held.
    fn finish(&mut self, i: usize, last: Option<StreamEvent>) {
        let tx = self.active.swap_remove(i).into_sender();
        self.publish_cache();
        if let Some(ev) = last {
            tx.end(ev);
        }
    }

    /// Sample the next token of request `i` and send it (`mask`: its
    /// grammar's mask when computed already). Returns `Some` when the
    /// request is finished, with the final event to send once its pages are
    /// released (`None` inside when the client is gone).
    fn emit(
        &mut self,
        i: usize,
        logits: &[f32],
        mask: Option<Result<Allowed, GrammarError>>,
    ) -> Option<Option<StreamEvent>> {
        let a = &mut self.active[i];
        let masked = a.sampling.masked(a.generated(), self.tokenizer.eog_ids());
        let mask = mask.or_else(|| a.sampling.grammar.as_mut().map(Grammar::allowed));
        let (id, logprob) = match prefill_pass::sample(&mut a.sampler, logits, &masked, mask) {
            Ok(t) => t,
            Err(e) => return Some(Some(StreamEvent::Error(e))),
        };
        let top = handoff_model::sampling::top_logprobs(logits, a.sampling.top_logprobs);
        self.emit_token(i, id, logprob, top)
    }

    /// Append token `id` to request `i` and send it; see [`Self::emit`].
    fn emit_token(
        &mut self,
        i: usize,
        id: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    ) -> Option<Option<StreamEvent>> {
        let eos = self.tokenizer.eog_ids().to_vec();
        let a = &mut self.active[i];
        a.tokens.push(id);
        a.sampler.accept(id);
        let mut grammar_done = false;
        if let Some(g) = &mut a.sampling.grammar {
            // A token sampled elsewhere (a prefill's first) was masked by the
            // same grammar there; one that does not fit ends the request.
            if let Err(e) = g.accept(id) {
                return Some(Some(StreamEvent::Error(EngineError::Grammar(e.0))));
            }
            grammar_done = g.finished();
        }
        // Nothing ends generation before `min_new_tokens` (the sampler
        // masks end-of-generation tokens; a token sampled elsewhere, a
        // prefill's first, was masked there).
        let may_end = a.generated() >= a.sampling.min_new_tokens;
        let is_eos = may_end && ((!a.ignore_eos && eos.contains(&id)) || a.stop_ids.contains(&id));
        let pushed = if is_eos {
            None
        } else {
            Some(a.text.push(&self.tokenizer, id, may_end))
        };
        let mut reason = None;
        let mut text = String::new();
        match pushed {
            None => reason = Some(FinishReason::Eos { token: id }),
            Some(p) => {
                text = p.text;
                if let Some(m) = p.matched {
                    reason = Some(FinishReason::StopString { matched: m });
                }
            }
        }
        if reason.is_none() && grammar_done {
            reason = Some(FinishReason::GrammarComplete);
        }
        if reason.is_none() && a.generated() >= a.max_new {
            reason = Some(FinishReason::Length);
        }
        if matches!(
            reason,
            Some(FinishReason::Eos { .. })
                | Some(FinishReason::Length)
                | Some(FinishReason::GrammarComplete)
        ) {
            text.push_str(&a.text.flush());
        }
        let sent = a.tx.token(TokenOut {
            id,
            logprob,
            top,
            prompt: std::mem::take(&mut a.prompt_scores),
            text,
        });
        if sent == Err(NotSent::Full) {
            // Steps skip a request without room, so this is a bug: fail the
            // request rather than lose a token.
            tracing::error!("a token found its request's buffer full");
            return Some(Some(StreamEvent::Error(EngineError::Model(
                "internal error: a token found its stream's buffer full".into(),
            ))));
        }
        match reason {
            Some(reason) => Some(Some(StreamEvent::Finished(Finished {
                reason,
                prompt_tokens: a.prompt_len,
                completion_tokens: a.generated(),
                cached_tokens: a.seq.prefix_tokens,
            }))),
            None if sent.is_err() => Some(None),
            None => None,
        }
    }
}
