//! The decode engine: validate before any
//! queue, open the room, reserve pages for prompt + max_new_tokens (waiting
//! in the prealloc queue while the pool is full: decode memory is the
//! backpressure), send the destination to the prefill, wait for the
//! transfer, and commit only on Success with the aux slot carrying this room
//! id (the transfer layer checks it). The request then joins the colocated
//! scheduler's continuous batch with the prefill's first token, and streams
//! exactly the events the colocated engine would.
//!
//! Failures reach the stream as [`EngineError::Transfer`], the typed failure
//! with the status and reason of the side that saw them (a prefill rejection stays a 400 with
//! the prefill's message). Dropping the stream aborts the room through the
//! protocol (seed 000); the transfer layer returns the pages once the
//! prefill's writer drained.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};

use handoff_kv::PrefixCache;
use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;
use handoff_proto::receiver_room::Source;
use handoff_proto::{
    AbortOrigin, AuxSlot, Misbehavior, PeerId, RejectCode, Role, RoomId, TransferError,
};
use handoff_transfer::{AuxData, KvReceiver, ReceiverConfig};

use super::{
    fingerprint, handshake_config, lease_prompt_pages, runtime, Gauge, OnTransferFailure,
    PageQueue, PdConfig, TransportChoice,
};
use crate::command::{Command, Resumed, SeqPages};
use crate::config::EngineConfig;
use crate::engine::load;
use crate::error::EngineError;
use crate::events::EventSender;
use crate::handle::{LoadSnapshot, ModelInfo, RequestStream};
use crate::request::{GenerateRequest, PromptLogprob, StreamEvent};
use crate::shared::Shared;

/// Starts decode engines.
pub struct DecodeEngine;

impl DecodeEngine {
    /// Load the model (KV pool in shared memory), start the decode scheduler
    /// thread and the transfer endpoint.
    pub fn start(config: EngineConfig, pd: PdConfig) -> Result<DecodeHandle, EngineError> {
        let loaded = load(&config, true)?;
        let fp = fingerprint(&loaded, &config)?;
        let region = loaded
            .pool
            .shared_region()
            .cloned()
            .ok_or_else(|| EngineError::Model("the decode KV pool is not shared".into()))?;
        let layout = *loaded.pool.layout();
        let rt = runtime(pd.io_threads, "handoff-decode-io")?;
        let hs = handshake_config(Role::Decode, fp.clone(), &pd);
        let default_kind = match pd.transport_choice {
            TransportChoice::Fixed(k) => k,
            TransportChoice::Auto => handoff_transfer::TransportKind::Tcp,
        };
        let mut rc = ReceiverConfig::new(hs, default_kind);
        rc.rooms = pd.rooms.clone();
        rc.handshake_timeout = pd.handshake_timeout;
        rc.tcp_streams = pd.tcp_streams;
        let receiver = {
            let _enter = rt.enter();
            KvReceiver::start(rc, region, layout)
        };
        let shared = loaded.spawn_scheduler(&config, "handoff-decode", None)?;
        tracing::info!(
            model = %shared.info.model_path,
            transport = %pd.transport_choice,
            page_size = shared.info.page_size,
            kv_pages = config.kv_pages,
            "decode engine started"
        );
        let cache = config
            .prefix_cache
            .then(|| Arc::new(Mutex::new(PrefixCache::new(shared.info.page_size))));
        let pages = PageQueue::new(shared.allocator.clone(), cache);
        Ok(DecodeHandle {
            inner: Arc::new(Inner {
                ctx: Arc::new(Ctx {
                    shared,
                    receiver,
                    pages,
                    pending: AtomicUsize::new(0),
                    next_slot: AtomicU32::new(0),
                    transport: pd.transport_choice,
                    on_failure: pd.on_transfer_failure,
                    local: LocalCounts::default(),
                }),
                fingerprint: fp,
                runtime: Some(rt),
            }),
        })
    }
}

/// Cheap, cloneable handle to a running decode engine. The engine stops
/// when the last handle is dropped.
#[derive(Clone)]
pub struct DecodeHandle {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<Ctx>,
    fingerprint: handoff_proto::handshake::Fingerprint,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.ctx.receiver.shutdown();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// What the request tasks share.
struct Ctx {
    shared: Shared,
    receiver: KvReceiver,
    /// The prealloc queue: requests waiting for pages.
    pages: PageQueue,
    /// Requests between submit and joining the batch.
    pending: AtomicUsize,
    next_slot: AtomicU32,
    transport: TransportChoice,
    /// The default for a failed transfer.
    on_failure: OnTransferFailure,
    local: LocalCounts,
}

/// Requests this decode worker prefilled itself, by why.
#[derive(Debug, Default)]
struct LocalCounts {
    /// Sent to be prefilled here ([`DecodeHandle::submit_local`]).
    asked: AtomicU64,
    /// Their transfer failed and they were prefilled here instead.
    recomputed: AtomicU64,
}

/// How many requests a decode worker prefilled itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LocalPrefills {
    /// Sent to be prefilled here (short prompts, migrated streams).
    pub asked: u64,
    /// Whose KV transfer failed and which were prefilled here instead.
    pub recomputed: u64,
}

impl DecodeHandle {
    /// The loaded model.
    pub fn model(&self) -> &ModelInfo {
        &self.inner.ctx.shared.info
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.ctx.shared.tokenizer
    }

    /// The model's chat template, if the GGUF has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.ctx.shared.chat_template.as_ref()
    }

    /// Check a request against every limit without queueing it.
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        self.inner.ctx.shared.validate(req)
    }

    /// Accept the decode half of `room`, whose prefill listens at `prefill`
    /// ([`super::PrefillHandle::bootstrap_addr`]). The stream yields the
    /// first token (sampled by the prefill) and every later one, then
    /// `Finished` — or an `Error` carrying the status and reason of the side
    /// that failed. Dropping the stream aborts the room on both sides.
    ///
    /// A request that fails validation is refused here, before any queue,
    /// and the prefill is told through the protocol (an abort with the same
    /// status and reason) so it does not compute for nothing.
    pub fn submit(
        &self,
        req: GenerateRequest,
        room: RoomId,
        prefill: SocketAddr,
    ) -> Result<RequestStream, EngineError> {
        self.submit_pd(req, room, prefill, None)
    }

    /// [`Self::submit`], with what to do if the transfer fails for this
    /// request (`None`: the engine's [`PdConfig::on_transfer_failure`]).
    /// With [`OnTransferFailure::Recompute`], a transfer that fails for a
    /// reason other than a refusal of the request or the client leaving is
    /// not an error: the prompt is prefilled here and the stream goes on.
    pub fn submit_pd(
        &self,
        req: GenerateRequest,
        room: RoomId,
        prefill: SocketAddr,
        on_failure: Option<OnTransferFailure>,
    ) -> Result<RequestStream, EngineError> {
        let Some(rt) = self.inner.runtime.as_ref() else {
            return Err(EngineError::ShuttingDown);
        };
        let ctx = self.inner.ctx.clone();
        let checked = ctx.shared.validate(&req).and_then(|()| {
            if req.output_so_far.is_empty() {
                Ok(())
            } else {
                Err(EngineError::InvalidParams(
                    "resume_output_ids: a continued generation is prefilled on the decode worker, not sent through a prefill".into(),
                ))
            }
        });
        if let Err(e) = checked {
            self.reject(
                room,
                prefill,
                e.http_status(),
                &e.to_string(),
                e.reject_code(),
            );
            return Err(e);
        }
        let (tx, stream) = crate::events::channel();
        ctx.pending.fetch_add(1, Ordering::AcqRel);
        let on_failure = on_failure.unwrap_or(ctx.on_failure);
        rt.spawn(async move { decode_room(&ctx, req, room, prefill, on_failure, tx).await });
        Ok(stream)
    }

    /// Prefill and decode `req` here, with no prefill worker: a prompt
    /// short or cached enough that a transfer would cost more than it
    /// saves, or a stream migrated from a decode worker that died (its
    /// `output_so_far`). Pages come from the same prealloc queue as PD
    /// requests (reusing the longest cached prefix); the prefill runs in this
    /// worker's batch exactly as in a colocated engine, so the output is
    /// the colocated output.
    pub fn submit_local(&self, req: GenerateRequest) -> Result<RequestStream, EngineError> {
        let Some(rt) = self.inner.runtime.as_ref() else {
            return Err(EngineError::ShuttingDown);
        };
        let ctx = self.inner.ctx.clone();
        ctx.shared.validate(&req)?;
        let (tx, stream) = crate::events::channel();
        ctx.pending.fetch_add(1, Ordering::AcqRel);
        ctx.local.asked.fetch_add(1, Ordering::Relaxed);
        rt.spawn(async move {
            let pending = Gauge(&ctx.pending); // counted up above
            prefill_here(&ctx, req, tx, pending).await
        });
        Ok(stream)
    }

    /// How many requests this worker prefilled itself, and why.
    pub fn local_prefills(&self) -> LocalPrefills {
        let l = &self.inner.ctx.local;
        LocalPrefills {
            asked: l.asked.load(Ordering::Relaxed),
            recomputed: l.recomputed.load(Ordering::Relaxed),
        }
    }

    /// Refuse the decode half of `room` with `http_status` and `reason` (found before
    /// [`Self::submit`] could be called: a malformed field, say): the
    /// prefill at `prefill` is told through the protocol, with the same
    /// status and reason, so it never computes for this room (seed 004).
    /// `code` is the API's name for the refusal, sent on so the prefill
    /// reports the same error type.
    pub fn reject(
        &self,
        room: RoomId,
        prefill: SocketAddr,
        http_status: u16,
        reason: &str,
        code: Option<RejectCode>,
    ) {
        let Some(rt) = self.inner.runtime.as_ref() else {
            return;
        };
        let ctx = self.inner.ctx.clone();
        let error = TransferError::Rejected {
            http_status,
            reason: reason.to_owned(),
            code,
        };
        tracing::debug!(room = room.get(), error = %error, "decode rejected the request");
        rt.spawn(async move {
            if let Ok(peer) = ctx.peer(prefill).await {
                ctx.receiver.refuse(room, sources(peer), error);
            }
        });
    }

    /// Current load: `waiting` counts requests in the prealloc queue or in
    /// transfer; `pages_used` includes pages reserved for transfers and
    /// leaves out cached pages nothing reads.
    pub fn load(&self) -> LoadSnapshot {
        let ctx = &self.inner.ctx;
        let batch = ctx.shared.load();
        ctx.pages.load(
            batch.running,
            batch.waiting + ctx.pending.load(Ordering::Acquire),
            batch.paused,
        )
    }

    /// Empty the prefix cache of every page no request reads; returns how
    /// many pages that freed (0 with the cache off).
    pub fn flush_cache(&self) -> usize {
        self.inner.ctx.pages.flush_cache()
    }

    /// Counters and gauges of the transfer endpoint (live rooms, peers,
    /// links, malformed frames ...). Works from any async runtime.
    pub async fn transfer_stats(&self) -> Result<handoff_transfer::EndpointStats, EngineError> {
        Ok(self.inner.ctx.receiver.stats().await?)
    }

    /// What this worker's transfer handshake says about it (model, weights,
    /// KV geometry and dtype).
    pub fn fingerprint(&self) -> &handoff_proto::handshake::Fingerprint {
        &self.inner.fingerprint
    }

    /// Live rooms of the transfer endpoint (a leak shows here). Blocking:
    /// from async code use [`Self::transfer_stats`].
    pub fn live_rooms(&self) -> usize {
        let endpoint = self.inner.ctx.receiver.clone();
        super::blocking_live_rooms(self.inner.runtime.as_ref(), async move {
            endpoint.stats().await
        })
    }
}

fn sources(peer: PeerId) -> Vec<Source> {
    vec![Source {
        peer,
        required_destinations: 1,
    }]
}

impl Ctx {
    /// The connection to the prefill at `addr` (the receiver connects once,
    /// reuses it, and connects again once it found it dead).
    async fn peer(&self, addr: SocketAddr) -> Result<PeerId, EngineError> {
        let kind = self.transport.for_peer(addr);
        Ok(self.receiver.peer(addr, kind).await?)
    }
}

/// What a room brought: the sequence's pages, the aux data, and the
/// prompt's scores (when the request asked for them).
type Landed = (SeqPages, AuxData, Vec<PromptLogprob>);

/// One request, from submit until it joins the batch (or fails).
async fn decode_room(
    ctx: &Arc<Ctx>,
    req: GenerateRequest,
    room: RoomId,
    prefill: SocketAddr,
    on_failure: OnTransferFailure,
    tx: EventSender,
) {
    let pending = Gauge(&ctx.pending); // counted up in `submit`
    let outcome = tokio::select! {
        r = transfer(ctx, &req, room, prefill) => Some(r),
        _ = tx.closed() => None,
    };
    let (landed, aux, prompt_scores) = match outcome {
        None => {
            // The client went away. A room this request owned was aborted
            // when `transfer` dropped its handle (or by the endpoint, for a
            // submit cut short); pages come back once the prefill's writer
            // drained. A room it never opened (it was still connecting) is
            // refused now, so the prefill learns too.
            drop(pending);
            if let Ok(peer) = ctx.peer(prefill).await {
                let gone = TransferError::Aborted {
                    origin: AbortOrigin::Client,
                    reason: "the client went away".into(),
                    http_status: 499,
                };
                ctx.receiver.refuse(room, sources(peer), gone);
            }
            tracing::debug!(room = room.get(), "decode request cancelled before joining");
            return;
        }
        Some(Err(e)) if on_failure == OnTransferFailure::Recompute && recomputable(&e) => {
            tracing::warn!(
                room = room.get(),
                prefill = %prefill,
                error = %e,
                "KV transfer failed: prefilling the prompt here"
            );
            ctx.local.recomputed.fetch_add(1, Ordering::Relaxed);
            return prefill_here(ctx, req, tx, pending).await;
        }
        Some(Err(e)) => {
            tracing::debug!(room = room.get(), error = %e, "decode room failed");
            drop(pending);
            tx.end(StreamEvent::Error(e));
            return;
        }
        Some(Ok(x)) => x,
    };
    if aux.first_token as usize >= ctx.shared.info.vocab_size {
        drop(landed);
        drop(pending);
        let e = EngineError::from(TransferError::PeerMisbehaved {
            what: Misbehavior::TokenOutsideVocabulary {
                token: aux.first_token,
                vocab: ctx.shared.info.vocab_size,
            },
        });
        tx.end(StreamEvent::Error(e));
        return;
    }
    let seed = req.sampling.seed.unwrap_or_else(rand::random);
    let resumed = Resumed {
        req,
        tx,
        pages: landed,
        first: (aux.first_token, aux.logprob),
        first_top: aux.top.as_slice().to_vec(),
        prompt_scores,
        seed,
    };
    drop(pending);
    if let Err(std_mpsc::SendError(Command::Resume(r))) =
        ctx.shared.commands.send(Command::Resume(Box::new(resumed)))
    {
        r.into_sender()
            .end(StreamEvent::Error(EngineError::ShuttingDown));
    }
}

/// Reserve pages for `req` (after the longest cached prefix of its prompt,
/// leaving at least its last token to compute) and hand it to the
/// scheduler to prefill here.
async fn prefill_here(ctx: &Ctx, req: GenerateRequest, tx: EventSender, pending: Gauge<'_>) {
    let page_size = ctx.shared.info.page_size;
    let prompt = &req.prompt_ids;
    let total = (prompt.len() + req.sampling.max_new_tokens).div_ceil(page_size);
    let matchable = if req.sampling.prompt_logprobs {
        0
    } else {
        prompt.len() - 1
    };
    let leased = tokio::select! {
        l = lease_prompt_pages(&ctx.pages, &req, matchable, total) => l,
        _ = tx.closed() => return,
    };
    let (prefix, lease) = leased;
    let seq = SeqPages::new(prefix, lease, page_size);
    drop(pending);
    if let Err(std_mpsc::SendError(Command::Prefill(_, _, tx))) = ctx
        .shared
        .commands
        .send(Command::Prefill(Box::new(req), seq, tx))
    {
        tx.end(StreamEvent::Error(EngineError::ShuttingDown));
    }
}

/// Whether a failed transfer may be made good by prefilling here: the
/// prefill (or the way to it) failed, not the request (a refusal with a
/// 4xx, an API misuse) and not the client or router (an abort they sent).
fn recomputable(e: &EngineError) -> bool {
    match e {
        EngineError::Transfer(t) => match t {
            TransferError::Rejected { http_status, .. } => *http_status >= 500,
            TransferError::Aborted { origin, .. } => {
                !matches!(origin, AbortOrigin::Client | AbortOrigin::Router)
            }
            TransferError::Remote { http_status, .. } => {
                *http_status >= 500 || matches!(http_status, 408 | 429)
            }
            TransferError::ApiMisuse { .. } => false,
            _ => true,
        },
        EngineError::Transport(_) => true,
        _ => false,
    }
}

/// Open, reserve, send the destination, wait for the KV: the sequence's
/// pages and the aux data, or the failure as the side that saw it reported.
async fn transfer(
    ctx: &Arc<Ctx>,
    req: &GenerateRequest,
    room: RoomId,
    prefill: SocketAddr,
) -> Result<Landed, EngineError> {
    let peer = ctx.peer(prefill).await?;
    joined(ctx, room, peer, req).await
}

/// [`transfer`] once connected to the prefill as peer `peer`. The request
/// owns its room (a [`handoff_transfer::ReceiverRoom`]): dropped before the
/// KV landed (the client left), the room is aborted on both sides.
///
/// Delta transfer: when the prefill negotiated it, the longest cached prefix
/// of the prompt (whole pages, possibly all of them) stays here, locked, and
/// only the pages after it are reserved and named to the prefill, which
/// sends only those. The cached pages are never in the destination, so no
/// write can reach them. Once the KV landed, the prompt's full pages join
/// the cache.
async fn joined(
    ctx: &Ctx,
    room: RoomId,
    peer: PeerId,
    req: &GenerateRequest,
) -> Result<Landed, EngineError> {
    let t_open = std::time::Instant::now();
    let mut handle = ctx.receiver.submit(room, sources(peer)).await?;
    let page_size = ctx.shared.info.page_size;
    let prompt = &req.prompt_ids;
    let total = (prompt.len() + req.sampling.max_new_tokens).div_ceil(page_size);
    let scored = req.sampling.top_logprobs > 0 || req.sampling.prompt_logprobs;
    if scored && !ctx.receiver.aux_top_capable(peer).await? {
        let what = if req.sampling.prompt_logprobs {
            "prompt_logprobs: the prefill worker of this request is of an older handoff that does not send prompt scores"
        } else {
            "top_logprobs: the prefill worker of this request is of an older handoff that does not send the first token's alternatives"
        };
        return Err(EngineError::InvalidParams(format!(
            "{what}; upgrade it, or ask without them"
        )));
    }
    let delta = ctx.pages.cache.is_some() && ctx.receiver.delta_capable(peer).await?;
    let matchable = if delta { prompt.len() } else { 0 };
    let (prefix, lease) = lease_prompt_pages(&ctx.pages, req, matchable, total).await;
    let prefix_tokens = prefix.tokens(page_size);
    tracing::debug!(
        room = room.get(),
        pages = lease.len(),
        cached_pages = prefix.pages().len(),
        "decode pages reserved"
    );
    let t_reserved = std::time::Instant::now();
    let slot = AuxSlot(ctx.next_slot.fetch_add(1, Ordering::Relaxed));
    handle.reserve(lease, slot, prefix_tokens as u32).await?;
    let (lease, aux) = handle.landed().await?;
    let prompt_scores = if req.sampling.prompt_logprobs {
        let flat = handle.take_prompt_scores();
        PromptLogprob::unflatten(&flat, prompt, req.sampling.top_logprobs).map_err(|reason| {
            EngineError::from(TransferError::Internal {
                reason: format!("the prefill's {reason}"),
            })
        })?
    } else {
        Vec::new()
    };
    let mut seq = SeqPages::new(prefix, lease, page_size);
    ctx.pages
        .cache_prompt(prompt, &seq.pages, &mut seq.lease, &mut seq.prefix);
    tracing::info!(
        room = room.get(),
        prompt_tokens = prompt.len(),
        cached_tokens = prefix_tokens,
        pages = seq.pages.len(),
        reserve_ms = super::prefill::ms(t_reserved - t_open),
        kv_wait_ms = super::prefill::ms(t_reserved.elapsed()),
        first_token = aux.first_token,
        "decode room: KV landed"
    );
    Ok((seq, aux, prompt_scores))
}
