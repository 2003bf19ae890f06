//! The prefill engine: validate before any
//! queue (a rejection fails the room through the protocol, so decode learns
//! the status and reason at once — seed 004), wait until decode's
//! destination arrived (the handshake gates compute), lease source pages,
//! run the chunked prefill exactly as the colocated engine does, sample the
//! first token, then the aux record (first token, logprob; the transport
//! adds the room id), then wait for the room's status. KV pages are written
//! into decode's pages while the prefill computes, layer by layer: as soon
//! as a layer's K/V of every token of a page is computed (the model reports
//! each layer's K/V written, before that layer's attention), that layer of
//! the page goes while the later layers compute.
//! A decode-side abort (seed 000) cancels the writes, stops the compute at
//! the next chunk and releases the pages once nothing reads them.
//!
//! One compute thread owns the model and the pool and prefills every job
//! that arrived, a chunk of one job per step, the jobs taking turns (a short
//! prompt never waits for a long one to finish). Each request is driven by a
//! task on the engine's I/O runtime.
//!
//! The prefix cache: a request reuses the pages of the longest cached
//! prefix of its prompt (whole pages), computes only the rest, and sends the
//! cached pages to decode right away (all layers) while the rest computes.
//! Once computed, its full prompt pages join the cache; the request keeps
//! them locked until its room ends, so nothing evicts a page a transfer may
//! still read.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use handoff_kv::{KvPool, PageIndex, PageLease, PrefixCache};
use handoff_model::chat_template::ChatTemplate;
use handoff_model::sampling::{Sampler, SamplerConfig};
use handoff_model::tokenizer::Tokenizer;
use handoff_model::{Llama, SeqChunk};
use handoff_proto::{RejectCode, Role, RoomId, TransferError};
use handoff_transfer::{AuxData, KvSender, SenderConfig, SenderRoom, TransportError};
use tokio::sync::oneshot;

use super::{
    fingerprint, handshake_config, lease_prompt_pages, runtime, Gauge, PageQueue, PdConfig,
};
use crate::config::EngineConfig;
use crate::engine::{load, Loaded};
use crate::error::EngineError;
use crate::handle::{LoadSnapshot, ModelInfo};
use crate::prefill_pass::{pack, PassCounts};
use crate::request::{GenerateRequest, PromptLogprob};
use crate::validate::validate;

/// A prefill that completed: decode holds the prompt's KV and the first token.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDone {
    /// The first generated token.
    pub first_token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The first position's most likely tokens (as many as the request's
    /// `top_logprobs`).
    pub top: Vec<(u32, f32)>,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Where the time went.
    pub timings: PrefillTimings,
}

/// A prefill request's stages.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefillTimings {
    /// From accepting the room until decode's destination arrived (decode
    /// reserving its pages).
    pub wait_destination: Duration,
    /// From then until the first token was sampled: source pages, the
    /// compute queue and the chunked forward (KV pages stream meanwhile).
    pub compute: Duration,
    /// From the first token until decode confirmed the room: the KV not
    /// hidden behind compute, the aux record and the status.
    pub transfer_tail: Duration,
}

/// The outcome of one prefill request. Dropping it does not cancel the
/// request: decode owns cancellation (it aborts the room).
#[derive(Debug)]
pub struct PrefillTicket {
    rx: oneshot::Receiver<Result<PrefillDone, EngineError>>,
}

impl PrefillTicket {
    /// Wait until the room succeeded (KV and aux landed at decode) or failed.
    pub async fn wait(self) -> Result<PrefillDone, EngineError> {
        self.rx.await.unwrap_or(Err(EngineError::ShuttingDown))
    }

    /// Blocking variant of [`PrefillTicket::wait`] for non-async callers.
    pub fn blocking_wait(self) -> Result<PrefillDone, EngineError> {
        self.rx
            .blocking_recv()
            .unwrap_or(Err(EngineError::ShuttingDown))
    }
}

/// Starts prefill engines.
pub struct PrefillEngine;

impl PrefillEngine {
    /// Load the model (KV pool in shared memory), start the compute thread
    /// and the transfer endpoint listening at `pd.listen`.
    pub fn start(config: EngineConfig, pd: PdConfig) -> Result<PrefillHandle, EngineError> {
        let loaded = load(&config, true)?;
        let fp = fingerprint(&loaded, &config)?;
        let Loaded {
            model,
            tokenizer,
            chat_template,
            pool,
            info,
            threads,
            ..
        } = loaded;
        let region = pool
            .shared_region()
            .cloned()
            .ok_or_else(|| EngineError::Model("the prefill KV pool is not shared".into()))?;
        let layout = *pool.layout();
        let rt = runtime(pd.io_threads, "handoff-prefill-io")?;
        let mut sc = SenderConfig::new(handshake_config(Role::Prefill, fp.clone(), &pd));
        sc.listen = pd.listen;
        sc.rooms = pd.rooms.clone();
        sc.handshake_timeout = pd.handshake_timeout;
        // Not `block_on`: the caller may itself be inside a runtime.
        let (tx, rx) = std_mpsc::channel();
        rt.spawn(async move {
            let _ = tx.send(KvSender::start(sc, region, layout).await);
        });
        let sender = rx.recv().map_err(|_| EngineError::ShuttingDown)??;
        let (jobs, jobs_rx) = std_mpsc::channel();
        let cache = config
            .prefix_cache
            .then(|| Arc::new(std::sync::Mutex::new(PrefixCache::new(info.page_size))));
        let ctx = Arc::new(Ctx {
            sender,
            jobs,
            layers: layout.geometry.layers,
            page_size: info.page_size,
            pages: PageQueue::new(pool.allocator().clone(), cache),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            eog: tokenizer.eog_ids().to_vec(),
            passes: Arc::default(),
        });
        let compute = Compute {
            rows_independent: model.prefill_rows_independent(),
            model,
            pool,
            threads,
            prefill_chunk: config.prefill_chunk,
            passes: ctx.passes.clone(),
            order: Default::default(),
        };
        std::thread::Builder::new()
            .name("handoff-prefill".into())
            .spawn(move || compute.run(jobs_rx))
            .map_err(|e| EngineError::Model(format!("cannot start the prefill thread: {e}")))?;
        tracing::info!(
            model = %info.model_path,
            bootstrap = %ctx.sender.local_addr(),
            page_size = info.page_size,
            kv_pages = config.kv_pages,
            "prefill engine started"
        );
        Ok(PrefillHandle {
            inner: Arc::new(Inner {
                ctx,
                fingerprint: fp,
                info,
                tokenizer,
                chat_template,
                runtime: Some(rt),
            }),
        })
    }
}

/// Cheap, cloneable handle to a running prefill engine. The engine stops
/// when the last handle is dropped.
#[derive(Clone)]
pub struct PrefillHandle {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<Ctx>,
    fingerprint: handoff_proto::handshake::Fingerprint,
    info: ModelInfo,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.ctx.sender.shutdown();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl PrefillHandle {
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

    /// Where decode engines connect (give it to [`super::DecodeHandle::submit`]).
    pub fn bootstrap_addr(&self) -> SocketAddr {
        self.inner.ctx.sender.local_addr()
    }

    /// Check a request against every limit without queueing it.
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if !req.output_so_far.is_empty() {
            return Err(EngineError::InvalidParams(
                "resume_output_ids: a continued generation is prefilled on the decode worker, not on a prefill worker".into(),
            ));
        }
        validate(
            &self.inner.info,
            self.inner.ctx.pages.allocator.stats().total,
            req,
        )
    }

    /// Accept the prefill half of `room`. A request that fails validation is
    /// refused here, before any queue, and the room is failed through the
    /// protocol with the same status and reason, so decode releases its pages
    /// and reports the original error at once (seed 004).
    pub fn submit(&self, req: GenerateRequest, room: RoomId) -> Result<PrefillTicket, EngineError> {
        let Some(rt) = self.inner.runtime.as_ref() else {
            return Err(EngineError::ShuttingDown);
        };
        let ctx = self.inner.ctx.clone();
        if let Err(e) = self.validate(&req) {
            self.reject(room, e.http_status(), &e.to_string(), e.reject_code());
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        ctx.waiting.fetch_add(1, Ordering::AcqRel);
        rt.spawn(async move {
            let r = prefill_room(&ctx, req, room).await;
            if let Err(e) = &r {
                tracing::debug!(room = room.get(), error = %e, "prefill room failed");
            }
            let _ = tx.send(r);
        });
        Ok(PrefillTicket { rx })
    }

    /// Refuse the prefill half of `room` with `http_status` and `reason` (found before
    /// [`Self::submit`] could be called: a malformed field, say): the room
    /// is failed through the protocol with the same status and reason, so
    /// decode releases its pages and reports the original error (seed 004).
    /// `code` is the API's name for the refusal, sent on so decode reports
    /// the same error type.
    pub fn reject(&self, room: RoomId, http_status: u16, reason: &str, code: Option<RejectCode>) {
        let error = TransferError::Rejected {
            http_status,
            reason: reason.to_owned(),
            code,
        };
        tracing::debug!(room = room.get(), error = %error, "prefill rejected the request");
        let ctx = &self.inner.ctx;
        // A room decode already aborted stays as it is: nothing to tell.
        ctx.sender.refuse(room, error);
    }

    /// Current load: `running` is requests computing or transferring,
    /// `waiting` those waiting for decode's destination or for pages.
    pub fn load(&self) -> LoadSnapshot {
        let ctx = &self.inner.ctx;
        let (prefill_passes, prefill_pass_sequences) = ctx.passes.totals();
        LoadSnapshot {
            prefill_passes,
            prefill_pass_sequences,
            ..ctx.pages.load(
                ctx.running.load(Ordering::Acquire),
                ctx.waiting.load(Ordering::Acquire),
                0,
            )
        }
    }

    /// Empty the prefix cache of every page no room reads; returns how many
    /// pages that freed (0 with the cache off).
    pub fn flush_cache(&self) -> usize {
        self.inner.ctx.pages.flush_cache()
    }

    /// Counters and gauges of the transfer endpoint (live rooms, peers,
    /// links, malformed frames ...). Works from any async runtime.
    pub async fn transfer_stats(&self) -> Result<handoff_transfer::EndpointStats, EngineError> {
        Ok(self.inner.ctx.sender.stats().await?)
    }

    /// What this worker's transfer handshake says about it (model, weights,
    /// KV geometry and dtype).
    pub fn fingerprint(&self) -> &handoff_proto::handshake::Fingerprint {
        &self.inner.fingerprint
    }

    /// Live rooms of the transfer endpoint (a leak shows here). Blocking:
    /// from async code use [`Self::transfer_stats`].
    pub fn live_rooms(&self) -> usize {
        let endpoint = self.inner.ctx.sender.clone();
        super::blocking_live_rooms(self.inner.runtime.as_ref(), async move {
            endpoint.stats().await
        })
    }
}

/// What the request tasks share.
struct Ctx {
    sender: KvSender,
    jobs: std_mpsc::Sender<Job>,
    layers: usize,
    page_size: usize,
    /// Requests waiting for source pages.
    pages: PageQueue,
    running: AtomicUsize,
    waiting: AtomicUsize,
    /// The model's end-of-generation tokens (masked before `min_new_tokens`).
    eog: Vec<u32>,
    passes: Arc<PassCounts>,
}

/// One request, from open to the room's outcome. The request task owns the
/// room ([`handoff_transfer::SenderRoom`]): every event of it (destinations arrived, the end)
/// comes on the room's own channel, and a task that stops early (engine
/// shutdown) fails the room by dropping it, so decode never waits for a
/// timeout. Every page it leases is released only once nothing may still
/// read it.
async fn prefill_room(
    ctx: &Ctx,
    req: GenerateRequest,
    room: RoomId,
) -> Result<PrefillDone, EngineError> {
    let waiting = Gauge(&ctx.waiting); // counted up in `submit`
    let opened = std::time::Instant::now();
    let mut handle = ctx.sender.submit(room).await?;
    // The handshake gates compute: every destination must have arrived.
    handle.ready().await?;
    tracing::debug!(room = room.get(), "destination arrived");
    let destination = std::time::Instant::now();
    // The cached prefix, locked for as long as this room may read it, and
    // pages for the rest.
    let total = req.prompt_ids.len().div_ceil(ctx.page_size);
    // A scored prompt is computed whole: a cached prefix has no logits.
    let matchable = if req.sampling.prompt_logprobs {
        0
    } else {
        req.prompt_ids.len() - 1
    };
    let (mut prefix, mut lease) = tokio::select! {
        l = lease_prompt_pages(&ctx.pages, &req, matchable, total) => l,
        end = handle.outcome() => return Err(end.err().map_or_else(before_compute, Into::into)),
    };
    let cached_tokens = prefix.tokens(ctx.page_size);
    drop(waiting);
    let _running = Gauge::enter(&ctx.running);
    let s = &req.sampling;
    let cancel = Arc::new(AtomicBool::new(false));
    let (reply, mut done) = oneshot::channel();
    let (progress_tx, mut progress) = tokio::sync::mpsc::unbounded_channel();
    let src: Arc<[PageIndex]> = prefix.followed_by(&lease).into();
    // The cached pages hold every layer already: they go first, while the
    // rest computes.
    let cached_pages = prefix.pages().len();
    let mut queued: Result<(), TransportError> = Ok(());
    if cached_pages > 0 {
        queued = handle
            .send(0..ctx.layers, 0..cached_pages, src.clone())
            .await;
    }
    ctx.jobs
        .send(Job {
            tokens: req.prompt_ids.clone(),
            start: cached_tokens,
            pages: src.clone(),
            lease,
            sampler: s.sampler(s.seed.unwrap_or_else(rand::random)),
            masked: s.masked(0, &ctx.eog),
            grammar: s.grammar.clone(),
            top_logprobs: s.top_logprobs,
            prompt_logprobs: s.prompt_logprobs,
            class: req.class.clone(),
            cancel: cancel.clone(),
            progress: progress_tx,
            reply,
        })
        .map_err(|_| EngineError::ShuttingDown)?;
    // Stream each page layer by layer: as soon as a layer's K/V of every
    // token of the page is computed (it never changes afterwards), while the
    // later layers and chunks compute.
    let mut stream = LayerStream {
        sent: cached_pages,
        layers_sent: 0,
        layers: ctx.layers,
        page_size: ctx.page_size,
        prompt_len: req.prompt_ids.len(),
    };
    let computed = loop {
        tokio::select! {
            biased;
            Some((end, layer)) = progress.recv(), if queued.is_ok() => {
                queued = stream.advance(&handle, &src, end, layer).await;
            }
            r = &mut done => break Ok(r),
            end = handle.outcome() => break Err(end.err().map_or_else(before_compute, Into::into)),
        }
    };
    // The compute is over: what it reported and we did not read yet.
    if matches!(computed, Ok(Ok(_))) {
        while let (true, Ok((end, layer))) = (queued.is_ok(), progress.try_recv()) {
            queued = stream.advance(&handle, &src, end, layer).await;
        }
    }
    let sent = stream.sent;
    let (result, returned) = match computed {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => return Err(EngineError::ShuttingDown),
        Err(e) => {
            // Decode aborted (or a timer fired). The room reported its end
            // only once no write was in flight; stop the compute at the next
            // chunk and release the pages once it let go of them.
            cancel.store(true, Ordering::Release);
            drop(done.await);
            return Err(e);
        }
    };
    let (first_token, logprob, top, prompt_scores) = match result.and_then(|t| {
        t.ok_or_else(|| EngineError::Model("prefill cancelled without a failure".into()))
    }) {
        Ok(t) => t,
        Err(e) => {
            handle.fail(TransferError::Internal {
                reason: e.to_string(),
            });
            // Pages streamed so far may still be in flight: drain first.
            let _ = handle.outcome().await;
            drop(returned);
            return Err(e);
        }
    };
    lease = returned;
    // The prompt's full pages join the cache (still locked by this room,
    // which the transfer may be reading).
    ctx.pages
        .cache_prompt(&req.prompt_ids, &src, &mut lease, &mut prefix);
    tracing::debug!(room = room.get(), first_token, "prefill computed");
    let computed_at = std::time::Instant::now();
    // The remaining pages, then the aux record; then the room's status.
    if queued.is_ok() && sent < src.len() {
        queued = handle
            .send(0..ctx.layers, sent..src.len(), src.clone())
            .await;
    }
    if queued.is_ok() {
        let aux = AuxData {
            first_token,
            logprob,
            top: handoff_proto::datalink::TopLogprobs::from_slice(&top),
        };
        let scores = PromptLogprob::flatten(&prompt_scores, req.sampling.top_logprobs);
        queued = handle.finish_scored(aux, scores.into()).await;
    }
    // The outcome comes once nothing is in flight: then the pages may go.
    let end = handle.outcome().await.map_err(EngineError::from);
    tracing::debug!(room = room.get(), ok = end.is_ok(), "prefill room ended");
    // The lock first: a request woken by the lease's return then finds
    // the cached pages evictable too.
    drop(prefix);
    drop(lease);
    if let Err(e) = &queued {
        // The room's own failure explains a refused write best.
        tracing::debug!(room = room.get(), error = %e, "a KV write was refused");
    }
    let timings = PrefillTimings {
        wait_destination: destination - opened,
        compute: computed_at - destination,
        transfer_tail: computed_at.elapsed(),
    };
    tracing::info!(
        room = room.get(),
        prompt_tokens = req.prompt_ids.len(),
        cached_tokens,
        ok = end.is_ok(),
        wait_destination_ms = ms(timings.wait_destination),
        compute_ms = ms(timings.compute),
        transfer_tail_ms = ms(timings.transfer_tail),
        "prefill room done"
    );
    end.map(|()| PrefillDone {
        first_token,
        logprob,
        top,
        prompt_tokens: req.prompt_ids.len(),
        cached_tokens,
        timings,
    })
}

/// Which K/V of the prompt's pages went to decode so far.
struct LayerStream {
    /// Pages sent with every layer.
    sent: usize,
    /// Layers sent of the pages the current chunk completes.
    layers_sent: usize,
    layers: usize,
    page_size: usize,
    prompt_len: usize,
}

impl LayerStream {
    /// Layer `layer` of every token before `end` is computed: send that
    /// layer (and any earlier one not sent yet) of the pages it completes.
    async fn advance(
        &mut self,
        room: &SenderRoom,
        src: &Arc<[PageIndex]>,
        end: usize,
        layer: usize,
    ) -> Result<(), TransportError> {
        let upto = if end >= self.prompt_len {
            src.len()
        } else {
            (end / self.page_size).min(src.len())
        };
        let mut r = Ok(());
        if upto > self.sent && layer + 1 > self.layers_sent {
            r = room
                .send(self.layers_sent..layer + 1, self.sent..upto, src.clone())
                .await;
            self.layers_sent = layer + 1;
        }
        if layer + 1 == self.layers {
            self.sent = self.sent.max(upto);
            self.layers_sent = 0;
        }
        r
    }
}

/// Milliseconds, for log fields.
pub(crate) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// A room that "succeeded" before its KV was computed: the peer broke the
/// protocol.
fn before_compute() -> EngineError {
    EngineError::from(TransferError::Internal {
        reason: "the room ended before its KV was computed".into(),
    })
}

type JobResult = (Result<Option<FirstToken>, EngineError>, PageLease);

/// One prompt to prefill from position `start` (the cached prefix before
/// it is in the pool already) into `pages`, the sequence's pages: the
/// cached prefix's, then `lease`'s.
struct Job {
    tokens: Vec<u32>,
    start: usize,
    pages: Arc<[PageIndex]>,
    lease: PageLease,
    sampler: SamplerConfig,
    /// Tokens the first token may not be (end of generation before
    /// `min_new_tokens`).
    masked: Vec<u32>,
    /// The request's grammar, at the start of the output: the first token
    /// obeys it as decode's later ones do.
    grammar: Option<crate::grammar::Grammar>,
    /// How many of the first position's most likely tokens to report.
    top_logprobs: usize,
    /// Score the prompt (every row's logits).
    prompt_logprobs: bool,
    /// Its request's priority and tenant: the order its chunks get a pass
    /// in.
    class: crate::fair::Class,
    /// Set when the room failed: stop at the next chunk.
    cancel: Arc<AtomicBool>,
    /// (chunk end, layer): that layer's K/V of every token before the
    /// chunk end is in the pool.
    progress: tokio::sync::mpsc::UnboundedSender<(usize, usize)>,
    /// The first token (None when cancelled) and the pages back.
    reply: oneshot::Sender<JobResult>,
}

/// The compute thread: owns the model and the pool.
struct Compute {
    model: Arc<Llama>,
    pool: KvPool,
    threads: rayon::ThreadPool,
    /// Tokens per forward pass, all jobs together.
    prefill_chunk: usize,
    /// Whether several jobs may share a pass (the model's prefill rows are
    /// computed independently).
    rows_independent: bool,
    passes: Arc<PassCounts>,
    /// Each tenant's share of the compute ([`crate::fair`]).
    order: crate::fair::FairOrder,
}

// The wire carries as many alternatives as a request may ask for.
const _: () =
    assert!(handoff_model::sampling::MAX_TOP_LOGPROBS == handoff_proto::datalink::MAX_TOP_LOGPROBS);

/// A sampled first token, its log-probability, the position's most likely
/// tokens, and the prompt's scores (when asked).
type FirstToken = (u32, f32, Vec<(u32, f32)>, Vec<PromptLogprob>);

/// A job the compute thread is prefilling: tokens before `cached` are in
/// the pool.
struct Running {
    job: Job,
    cached: usize,
    /// The prompt's scores so far (`prompt_logprobs`).
    scores: Vec<PromptLogprob>,
}

impl Compute {
    /// Prefill every job that arrived, interleaved: a higher priority
    /// first, then the tenant owed the most compute (each pass's tokens are
    /// charged to their tenants, [`crate::fair`]), round robin within a
    /// tenant: each
    /// forward pass takes the next chunks of the running jobs in turn, up
    /// to `prefill_chunk` tokens in all, so a short prompt waits for at
    /// most one pass, never for a long prompt's whole prefill.
    ///
    /// Several jobs share a pass only when the model's prefill rows are
    /// computed independently (the `q8_0-rows` format, the default): then a
    /// request's KV is the same bits whatever else runs beside it and
    /// however its prompt is cut into chunks. Another format (the f32 GEMM)
    /// sums rows in an order that depends on the pass, so there a pass
    /// holds one job's chunk, `prefill_chunk` tokens from the end of its
    /// cached prefix, as the colocated engine cuts it. A job that scores
    /// its prompt (`prompt_logprobs`: logits of every row) runs alone.
    fn run(mut self, jobs: std_mpsc::Receiver<Job>) {
        // Served from the front; a job with more to do goes to the back.
        let mut running: VecDeque<Running> = VecDeque::new();
        loop {
            if running.is_empty() {
                match jobs.recv() {
                    Ok(job) => running.push_back(Running::new(job)),
                    Err(_) => return,
                }
            }
            running.extend(jobs.try_iter().map(Running::new));
            // A cancelled job stops here, between passes.
            for r in std::mem::take(&mut running) {
                if r.job.cancel.load(Ordering::Acquire) {
                    let _ = r.job.reply.send((Ok(None), r.job.lease));
                } else {
                    running.push_back(r);
                }
            }
            if running.is_empty() {
                continue;
            }
            // Higher priority first, then the tenant owed the most compute
            // ([`crate::fair`]); round robin within a tenant (the sort is
            // stable).
            let order = &self.order;
            running.make_contiguous().sort_by_cached_key(|r| {
                (
                    std::cmp::Reverse(r.job.class.priority),
                    order.tag(&r.job.class.tenant),
                )
            });
            let pack = pack(
                running
                    .iter()
                    .map(|r| (r.job.tokens.len() - r.cached, r.job.prompt_logprobs)),
                self.prefill_chunk,
                self.rows_independent,
            );
            let mut served: Vec<Running> = running.drain(..pack.len()).collect();
            for (r, &tokens) in served.iter().zip(&pack) {
                self.order.charge(&r.job.class, tokens);
            }
            let results = self.pass(&mut served, &pack);
            for (r, result) in served.into_iter().zip(results) {
                match result {
                    Ok(None) => running.push_back(r),
                    done => {
                        let _ = r.job.reply.send((done, r.job.lease));
                    }
                }
            }
        }
    }

    /// One forward pass over `take[i]` tokens of each of `served`, its
    /// progress reported per layer to each job. Returns each job's first
    /// token once its prompt is complete (`None` before).
    fn pass(
        &mut self,
        served: &mut [Running],
        take: &[usize],
    ) -> Vec<Result<Option<FirstToken>, EngineError>> {
        let model = self.model.clone();
        let ends: Vec<usize> = served.iter().zip(take).map(|(r, t)| r.cached + t).collect();
        let chunks: Vec<SeqChunk<'_>> = served
            .iter()
            .zip(&ends)
            .map(|(r, &end)| SeqChunk {
                tokens: &r.job.tokens[r.cached..end],
                start_pos: r.cached,
                pages: &r.job.pages,
            })
            .collect();
        let every_row = served.len() == 1 && served[0].job.prompt_logprobs;
        let progress: Vec<_> = served.iter().map(|r| &r.job.progress).collect();
        let results = crate::prefill_pass::run(
            &model,
            &mut self.pool,
            &self.threads,
            &self.passes,
            &chunks,
            every_row,
            &mut |range, layer| {
                for i in range {
                    let _ = progress[i].send((ends[i], layer));
                }
            },
        );
        served
            .iter_mut()
            .zip(ends)
            .zip(results)
            .map(|((r, end), logits)| {
                let logits = logits?;
                if every_row {
                    PromptLogprob::score(
                        &r.job.tokens,
                        r.cached,
                        &logits,
                        r.job.top_logprobs,
                        &mut r.scores,
                    );
                }
                r.cached = end;
                r.first_token(logits.last().map(Vec::as_slice))
            })
            .collect()
    }
}

impl Running {
    /// The first token if the prompt is complete (`logits`: its last
    /// row's), `None` if more of it is to compute.
    fn first_token(&mut self, logits: Option<&[f32]>) -> Result<Option<FirstToken>, EngineError> {
        if self.cached < self.job.tokens.len() {
            return Ok(None);
        }
        let logits =
            logits.ok_or_else(|| EngineError::Model("prefill produced no logits".into()))?;
        let mut sampler = Sampler::for_prompt(self.job.sampler.clone(), &self.job.tokens);
        let mask = self
            .job
            .grammar
            .as_mut()
            .map(crate::grammar::Grammar::allowed);
        let (id, logprob) =
            crate::prefill_pass::sample(&mut sampler, logits, &self.job.masked, mask)?;
        let top = handoff_model::sampling::top_logprobs(logits, self.job.top_logprobs);
        Ok(Some((id, logprob, top, std::mem::take(&mut self.scores))))
    }

    fn new(job: Job) -> Self {
        let cached = job.start;
        Running {
            job,
            cached,
            scores: Vec::new(),
        }
    }
}
