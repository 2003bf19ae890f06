//! The decode side: [`KvReceiver`], a
//! cheap handle around one driver task, the I/O shell of a
//! [`ReceiverEndpoint`], which owns the rooms, the page leases of live rooms,
//! the aux records, heartbeats and what is known of every prefill peer; the
//! driver holds the sockets' and tasks' handles only.
//!
//! An engine calls [`KvReceiver::connect`] once per prefill peer (address
//! from bootstrap), [`KvReceiver::submit`] when it accepts a request, and
//! drives the returned [`ReceiverRoom`]: `reserve` once it holds the pages
//! (backpressure: a room may wait in `Bootstrapping` for them), then
//! `landed` for the lease and aux, or the failure as the side that saw it
//! reported. Dropping the room aborts it; [`KvReceiver::refuse`] aborts a
//! room never submitted. The pages of an aborted room return to the pool
//! only after every prefill writer drained or the abort fence passed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use handoff_kv::{KvLayout, PageLease, ShmRegion};
use handoff_proto::datalink::{
    encode_preface, stream_of, TcpStreamSetup, MAX_TCP_STREAMS, PREFACE_CONTROL,
};
use handoff_proto::handshake::{Capabilities, HandshakeConfig};
use handoff_proto::message::Message;
use handoff_proto::receiver_endpoint::{ReceiverEndpoint, ReceiverEvent, TpPosition};
use handoff_proto::receiver_room::Source;
use handoff_proto::room::RoomConfig;
use handoff_proto::{AuxSlot, PageIndex, PeerId, RoomId, TransferError};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::conn::{run_control, CtlEvent, TaskCounter};
use crate::error::TransportError;
use crate::link::{
    connect_link_stream, LinkCounters, LinkReader, ReaderCmd, ReaderEvent, SourcePool,
};
use crate::plan::LinkPlan;
use crate::room_handle::ReceiverRoom;
use crate::transport::TransportKind;
use crate::EndpointStats;

/// Settings of a decode endpoint.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// Handshake: role Decode, fingerprint, optional secret.
    pub handshake: HandshakeConfig,
    /// Room table limits and timers.
    pub rooms: RoomConfig,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Transport of new links.
    pub transport: TransportKind,
    /// TCP streams per data link (`1..=16`; shm links have one). Rooms are
    /// spread over the streams by id, so concurrent rooms travel in
    /// parallel; one room always uses one stream.
    pub tcp_streams: u8,
}

impl ReceiverConfig {
    /// Defaults for `handshake` over `transport`.
    pub fn new(handshake: HandshakeConfig, transport: TransportKind) -> Self {
        Self {
            handshake,
            rooms: RoomConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            transport,
            tcp_streams: 1,
        }
    }
}

/// What [`KvReceiver::poll`] says about a room: pending, committed (the
/// lease and aux come back), failed, or unknown.
pub type ReceiverPoll = handoff_proto::receiver_endpoint::ReceiverPoll<PageLease>;

/// A room's outcome goes here. `keep` says whether an outcome whose
/// receiver is gone is kept for [`KvReceiver::poll`] (a `wait` caller may
/// poll later) or dropped (a [`ReceiverRoom`] owner is gone for good: its
/// lease goes back at once).
struct Waiter {
    tx: oneshot::Sender<ReceiverPoll>,
    keep: bool,
}

type Outcome = oneshot::Receiver<ReceiverPoll>;

/// Prompt scores that arrived with a room's aux record, until the room's
/// owner takes them ([`crate::ReceiverRoom::take_prompt_scores`]) or the
/// room ends without them being taken.
pub(crate) type PromptBoard = Arc<std::sync::Mutex<HashMap<RoomId, Vec<(u32, f32)>>>>;

enum Cmd {
    Open(
        RoomId,
        Vec<Source>,
        oneshot::Sender<Result<(), TransferError>>,
    ),
    Submit(
        RoomId,
        Vec<Source>,
        oneshot::Sender<Result<Outcome, TransferError>>,
    ),
    Refuse(RoomId, Vec<Source>, TransferError),
    Reserve {
        room: RoomId,
        lease: PageLease,
        aux_slot: AuxSlot,
        prefix_tokens: u32,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Abort(RoomId, TransferError),
    Poll(RoomId, oneshot::Sender<ReceiverPoll>),
    Wait(RoomId, oneshot::Sender<ReceiverPoll>),
    AddLink(PeerId, NewLink),
    Connected(PeerId, oneshot::Sender<bool>),
    Capabilities(PeerId, oneshot::Sender<Option<Capabilities>>),
    /// Answer once `peer`'s control connection is up.
    AwaitControl(PeerId, oneshot::Sender<()>),
    Abandon(PeerId),
    Stats(oneshot::Sender<EndpointStats>),
    Shutdown,
}

enum Ev {
    Cmd(Cmd),
    Ctl(CtlEvent),
    Reader(PeerId, u64, ReaderEvent),
}

/// Handle to a decode transfer endpoint. Cheap to clone.
#[derive(Clone)]
pub struct KvReceiver {
    tx: mpsc::UnboundedSender<Ev>,
    config: ReceiverConfig,
    layout: KvLayout,
    tasks: TaskCounter,
    conn_ids: Arc<std::sync::atomic::AtomicU64>,
    next_peer: Arc<std::sync::atomic::AtomicU32>,
    endpoint: u64,
    pub(crate) prompts: PromptBoard,
}

impl std::fmt::Debug for KvReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvReceiver")
            .field("transport", &self.config.transport)
            .finish()
    }
}

impl KvReceiver {
    /// Start the endpoint for the decode pool `pool` laid out as `layout`
    /// (its pages are leased from the pool's allocator by the engine).
    pub fn start(config: ReceiverConfig, pool: Arc<ShmRegion>, layout: KvLayout) -> KvReceiver {
        let (tx, rx) = mpsc::unbounded_channel();
        let tasks = TaskCounter::default();
        let prompts = PromptBoard::default();
        let counters = Arc::new(LinkCounters::default());
        let driver = Driver {
            endpoint: ReceiverEndpoint::new(
                config.rooms.clone(),
                config.handshake.fingerprint.clone(),
                config.handshake_timeout,
            ),
            ctl: HashMap::new(),
            links: HashMap::new(),
            control_waiters: HashMap::new(),
            counters,
            tasks: tasks.clone(),
            pool,
            layout,
            next_link: 0,
            self_tx: tx.downgrade(),
            prompts: prompts.clone(),
        };
        tasks.spawn(driver.run(rx));
        KvReceiver {
            tx,
            config,
            layout,
            tasks,
            conn_ids: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            next_peer: Arc::new(std::sync::atomic::AtomicU32::new(0)),
            endpoint: rand::random(),
            prompts,
        }
    }

    async fn ask<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, TransportError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Ev::Cmd(f(tx)))
            .map_err(|_| TransportError::Shutdown)?;
        rx.await.map_err(|_| TransportError::Shutdown)
    }

    /// Connect to the prefill peer listening at `addr`: a control
    /// connection and a data link, both authenticated by the handshake.
    /// Returns the peer id this endpoint gives that prefill peer (use it in
    /// [`Source::peer`] of the rooms it serves) once both are up; a
    /// version, fingerprint or secret mismatch fails here, not at the first
    /// request.
    ///
    /// Cancel-safe: dropped before it returns, it leaves no control
    /// connection, data link or task behind. Prefill keeps one connection
    /// per decode endpoint, so connecting again to the same prefill
    /// replaces the earlier connection (its peer stops working).
    pub async fn connect(&self, addr: SocketAddr) -> Result<PeerId, TransportError> {
        self.connect_with(addr, self.config.transport).await
    }

    /// [`Self::connect`] with the data link over `transport` instead of the
    /// configured default.
    pub async fn connect_with(
        &self,
        addr: SocketAddr,
        transport: TransportKind,
    ) -> Result<PeerId, TransportError> {
        // This connect's number, before anything is sent: prefill keeps the
        // connections of the newest connect of this endpoint, so one
        // cancelled here but completed late there replaces nothing newer.
        let id = self.conn_ids.fetch_add(1, Ordering::Relaxed) + 1;
        // An address that never answers costs the handshake deadline, not
        // the OS's SYN timeout.
        let timeout = self.config.handshake_timeout;
        let mut s = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer from {addr} within {timeout:?}"),
                ))
            })
            .map_err(TransportError::io("control connect"))?;
        s.write_all(&encode_preface(PREFACE_CONTROL, self.endpoint, id))
            .await
            .map_err(TransportError::io("control preface"))?;
        // Our own id for this prefill endpoint (two prefill workers of the
        // same TP rank are different peers).
        let peer = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let tx = self.tx.downgrade();
        let send = move |e: CtlEvent| match tx.upgrade() {
            Some(tx) => tx.send(Ev::Ctl(e)).map_err(|_| ()),
            None => Err(()),
        };
        self.tasks.spawn(run_control(
            s,
            self.config.handshake.clone(),
            self.config.handshake_timeout,
            id,
            peer,
            self.tasks.clone(),
            send,
        ));
        // From here on, leaving early (an error, or the caller dropping
        // this future) abandons the peer: its control connection and any
        // data link go.
        let mut abandon = AbandonOnDrop {
            tx: self.tx.clone(),
            peer,
            armed: true,
        };
        let count = match transport {
            TransportKind::Shm => 1,
            TransportKind::Tcp => self.config.tcp_streams.clamp(1, MAX_TCP_STREAMS),
        };
        // Every stream connects at once: prefill confirms a link's streams
        // only when all of them are there.
        let nonce: u64 = rand::random();
        let pending: Vec<_> = (0..count)
            .map(|index| {
                let (endpoint, config) = (self.endpoint, self.config.handshake.clone());
                let timeout = self.config.handshake_timeout;
                let num_pages = self.layout.num_pages;
                let setup = TcpStreamSetup {
                    nonce,
                    index,
                    count,
                };
                self.tasks.spawn(async move {
                    connect_link_stream(
                        addr, endpoint, id, config, timeout, transport, num_pages, setup,
                    )
                    .await
                })
            })
            .collect();
        // Stream connects still running when this future is dropped stop.
        let mut pending = AbortOnDrop(pending);
        let mut sockets = Vec::with_capacity(pending.0.len());
        let mut prefill = None;
        let mut source = None;
        let mut failed = None;
        for p in &mut pending.0 {
            match p.await {
                Ok(Ok(l)) => {
                    sockets.push(l.stream);
                    source = source.or(l.source);
                    prefill = Some(l.fingerprint);
                }
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(_) => failed = failed.or(Some(TransportError::Shutdown)),
            }
        }
        // What this prefill peer writes into our pool: whole spans with
        // equal TP sizes, its head slices otherwise.
        let link = match (failed, prefill) {
            (Some(e), _) => Err(e),
            (None, None) => Err(TransportError::Shutdown),
            (None, Some(prefill)) => LinkPlan::new(
                &prefill,
                &self.config.handshake.fingerprint,
                false,
                self.layout.geometry.kv_heads,
            )
            .map(|plan| NewLink {
                kind: transport,
                sockets,
                plan,
                tp: TpPosition::of(&prefill),
                source,
            })
            .map_err(TransportError::Config),
        };
        // Do not keep a control connection without its data link: an error
        // here returns with `abandon` armed.
        let link = link?;
        self.tx
            .send(Ev::Cmd(Cmd::AddLink(peer, link)))
            .map_err(|_| TransportError::Shutdown)?;
        // The control handshake runs concurrently; the driver answers once
        // it is up.
        let up = self.ask(|r| Cmd::AwaitControl(peer, r));
        match tokio::time::timeout(self.config.handshake_timeout, up).await {
            Ok(Ok(())) => {
                abandon.armed = false;
                Ok(peer)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransportError::Handshake(
                handoff_proto::HandshakeError::TimedOut(self.config.handshake_timeout),
            )),
        }
    }

    /// Whether the prefill peer `peer` (from [`Self::connect`]) still has
    /// its control connection and data link up.
    pub async fn is_connected(&self, peer: PeerId) -> Result<bool, TransportError> {
        self.ask(|r| Cmd::Connected(peer, r)).await
    }

    /// Accept a request for `room` needing KV from `sources`. Their TP
    /// peers must cover every prefill peer this decode peer needs heads from
    /// ([`handoff_proto::rank::RankMap::required_prefill_ranks`]; one source with equal TP
    /// sizes), so the room cannot succeed with part of its heads missing.
    pub async fn open(&self, room: RoomId, sources: Vec<Source>) -> Result<(), TransportError> {
        Ok(self.ask(|r| Cmd::Open(room, sources, r)).await??)
    }

    /// Accept a request for `room` needing KV from `sources` (as
    /// [`Self::open`]) and own it: the returned [`ReceiverRoom`] reserves
    /// its pages and yields how it ended (the pages and aux, or the failure),
    /// and aborts the room if dropped before its end. Cancel-safe: a room
    /// opened for a caller that is gone is aborted by the driver.
    pub async fn submit(
        &self,
        room: RoomId,
        sources: Vec<Source>,
    ) -> Result<ReceiverRoom, TransportError> {
        let outcome = self.ask(|r| Cmd::Submit(room, sources, r)).await??;
        Ok(ReceiverRoom::new(self.clone(), room, outcome))
    }

    /// Refuse a request for `room` that never reaches [`Self::submit`] (it
    /// failed validation, or its client left before): the room is opened and
    /// aborted with `error` at once, so every source learns it. A room that
    /// exists already stays as it is.
    pub fn refuse(&self, room: RoomId, sources: Vec<Source>, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Refuse(room, sources, error)));
    }

    /// Pages for `room` are reserved (`lease`, in token order) with aux slot
    /// `aux_slot`: destinations go to every source. `prefix_tokens` (whole
    /// pages, 0 for none) are the prompt's leading tokens decode already
    /// holds: `lease` starts at the page after them and the sources send
    /// only what follows (delta transfer; refused unless every source's
    /// connection negotiated it, see [`Self::delta_capable`]). On error the
    /// lease is dropped (the pages were never advertised).
    pub async fn reserve(
        &self,
        room: RoomId,
        lease: PageLease,
        aux_slot: AuxSlot,
        prefix_tokens: u32,
    ) -> Result<(), TransportError> {
        Ok(self
            .ask(|reply| Cmd::Reserve {
                room,
                lease,
                aux_slot,
                prefix_tokens,
                reply,
            })
            .await??)
    }

    /// Whether `peer`'s control connection negotiated delta transfer
    /// (`DESTINATION_PREFIX`): a room it serves may then reserve past a
    /// cached prefix. `false` while it has no connection.
    pub async fn delta_capable(&self, peer: PeerId) -> Result<bool, TransportError> {
        let caps = self.ask(|r| Cmd::Capabilities(peer, r)).await?;
        Ok(caps.is_some_and(|c| c.contains(Capabilities::DESTINATION_PREFIX)))
    }

    /// Whether `peer`'s control connection negotiated `AUX_TOP`: its
    /// prefill sends the first position's most likely tokens for a room
    /// that asks. `false` while it has no connection.
    pub async fn aux_top_capable(&self, peer: PeerId) -> Result<bool, TransportError> {
        let caps = self.ask(|r| Cmd::Capabilities(peer, r)).await?;
        Ok(caps.is_some_and(|c| c.contains(Capabilities::AUX_TOP)))
    }

    /// Abort `room` (client gone, validation, shutdown): it fails now, every
    /// source is told, pages wait for the writers to drain.
    pub fn abort(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Abort(room, error)));
    }

    /// The room's state or outcome (an outcome is reported once).
    pub async fn poll(&self, room: RoomId) -> Result<ReceiverPoll, TransportError> {
        self.ask(|r| Cmd::Poll(room, r)).await
    }

    /// Wait until `room` commits or fails and return the outcome (taken,
    /// like `poll`). Returns `Unknown` at once for an unknown room.
    pub async fn wait(&self, room: RoomId) -> Result<ReceiverPoll, TransportError> {
        self.ask(|r| Cmd::Wait(room, r)).await
    }

    /// Counters and gauges.
    pub async fn stats(&self) -> Result<EndpointStats, TransportError> {
        let mut s = self.ask(Cmd::Stats).await?;
        s.tasks = self.tasks.live();
        Ok(s)
    }

    /// Live tasks of this endpoint (zero after shutdown completes).
    pub fn live_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// Stop: close every connection and task; leases held for live rooms are
    /// dropped (their pages return once link readers stopped).
    pub fn shutdown(&self) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Shutdown));
    }
}

/// Sends `Abandon(peer)` to the driver when dropped armed: a connect that
/// failed or was cancelled leaves no control connection or link behind.
struct AbandonOnDrop {
    tx: mpsc::UnboundedSender<Ev>,
    peer: PeerId,
    armed: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Ev::Cmd(Cmd::Abandon(self.peer)));
        }
    }
}

/// Aborts the tasks when dropped (a no-op for those that finished).
struct AbortOnDrop<T>(Vec<tokio::task::JoinHandle<T>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// A data link whose streams connected, for the driver to start.
struct NewLink {
    kind: TransportKind,
    sockets: Vec<TcpStream>,
    plan: LinkPlan,
    tp: TpPosition,
    /// Over shm, the prefill's pool this link pulls from.
    source: Option<Arc<SourcePool>>,
}

/// The I/O handles of one data link to a prefill peer: one reader per
/// stream.
struct Link {
    id: u64,
    streams: Vec<mpsc::UnboundedSender<ReaderCmd>>,
}

impl Link {
    /// The reader of the stream that carries `room` (only it may write it).
    fn tx(&self, room: RoomId) -> &mpsc::UnboundedSender<ReaderCmd> {
        &self.streams[stream_of(room, self.streams.len())]
    }
}

/// The decode driver: the I/O shell around [`ReceiverEndpoint`], which owns
/// every decision; this only holds the sockets' and tasks' handles.
struct Driver {
    endpoint: ReceiverEndpoint<PageLease, Waiter>,
    ctl: HashMap<PeerId, mpsc::UnboundedSender<Message>>,
    links: HashMap<PeerId, Link>,
    /// `connect` calls waiting for their control connection to come up.
    control_waiters: HashMap<PeerId, Vec<oneshot::Sender<()>>>,
    counters: Arc<LinkCounters>,
    tasks: TaskCounter,
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    next_link: u64,
    self_tx: mpsc::WeakUnboundedSender<Ev>,
    prompts: PromptBoard,
}

/// The board, even after a panic elsewhere (it holds plain data).
pub(crate) fn lock_board(
    b: &PromptBoard,
) -> std::sync::MutexGuard<'_, HashMap<RoomId, Vec<(u32, f32)>>> {
    b.lock().unwrap_or_else(|e| e.into_inner())
}

fn now() -> std::time::Instant {
    std::time::Instant::now()
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Ev>) {
        let mut wakeup = crate::wakeup::Wakeup::new();
        loop {
            let sleep = wakeup.until(self.endpoint.poll_timeout());
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = sleep => {
                    for dead in self.endpoint.handle_timeout(now()) {
                        tracing::warn!(peer = dead.0, "prefill peer missed heartbeats");
                    }
                    self.flush();
                    continue;
                }
            };
            let Some(ev) = ev else { break };
            match ev {
                Ev::Cmd(Cmd::Shutdown) => break,
                Ev::Cmd(c) => self.command(c),
                Ev::Ctl(e) => self.control(e),
                Ev::Reader(peer, id, e) => self.reader_event(peer, id, e),
            }
            self.flush();
        }
        self.ctl.clear();
        self.links.clear();
        self.endpoint.shutdown();
    }

    fn control(&mut self, e: CtlEvent) {
        let t = now();
        match e {
            CtlEvent::Established {
                conn,
                peer,
                capabilities,
                tx,
            } => {
                if self.endpoint.handle_control_up(peer, conn, capabilities, t) {
                    self.ctl.insert(peer, tx);
                    for w in self.control_waiters.remove(&peer).unwrap_or_default() {
                        let _ = w.send(());
                    }
                }
                // else: an abandoned connect's; dropping `tx` closes it.
            }
            CtlEvent::Message { peer, msg, .. } => self.endpoint.handle_message(peer, msg, t),
            CtlEvent::Malformed { .. } => self.endpoint.handle_malformed(),
            CtlEvent::HandshakeFailed { .. } => self.endpoint.handle_handshake_failed(),
            CtlEvent::Closed { conn, peer } => {
                if let Some(peer) = peer {
                    self.endpoint.handle_control_closed(peer, conn, t);
                }
            }
        }
    }

    fn reader_event(&mut self, peer: PeerId, id: u64, e: ReaderEvent) {
        match e {
            ReaderEvent::Aux {
                room,
                written_room,
                aux,
                prompt,
            } => {
                if !prompt.is_empty() {
                    lock_board(&self.prompts).insert(room, prompt);
                }
                self.endpoint.handle_aux(room, written_room, aux)
            }
            ReaderEvent::Closed { reason } => {
                if self.links.get(&peer).is_some_and(|l| l.id == id) {
                    tracing::warn!(peer = peer.0, %reason, "data link closed");
                    // The reader is gone already: dropping its handle is all.
                    self.links.remove(&peer);
                }
                self.endpoint.handle_link_closed(peer, id, now());
            }
        }
    }

    fn add_link(&mut self, peer: PeerId, link: NewLink) {
        self.next_link += 1;
        let id = self.next_link;
        let mut streams = Vec::with_capacity(link.sockets.len());
        for stream in link.sockets {
            let (tx, rx) = mpsc::unbounded_channel();
            let reader = LinkReader::new(
                stream,
                link.kind,
                self.pool.clone(),
                self.layout,
                link.plan.clone(),
                self.counters.clone(),
            )
            .with_source(link.source.clone());
            let weak = self.self_tx.clone();
            self.tasks.spawn(reader.run(rx, move |e| {
                weak.upgrade()
                    .is_some_and(|tx| tx.send(Ev::Reader(peer, id, e)).is_ok())
            }));
            streams.push(tx);
        }
        self.links.insert(peer, Link { id, streams });
        self.endpoint.handle_link_up(peer, id, link.tp);
    }

    fn command(&mut self, c: Cmd) {
        let t = now();
        match c {
            Cmd::Open(room, sources, reply) => {
                let _ = reply.send(self.endpoint.open(room, sources, t).map_err(Into::into));
            }
            Cmd::Reserve {
                room,
                lease,
                aux_slot,
                prefix_tokens,
                reply,
            } => {
                let pages = lease.pages().iter().map(|p| PageIndex(p.0)).collect();
                let prefix = Some(prefix_tokens).filter(|&t| t > 0);
                let r = self
                    .endpoint
                    .reserve(room, lease, pages, aux_slot, prefix, t);
                // The link readers learn the room and its destination leaves
                // before the caller hears back.
                self.flush();
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::Abort(room, error) => self.endpoint.abort(room, error, t),
            Cmd::Poll(room, reply) => {
                let _ = reply.send(self.endpoint.poll(room));
            }
            Cmd::Wait(room, tx) => self.endpoint.wait(room, Waiter { tx, keep: true }),
            Cmd::Submit(room, sources, reply) => {
                let r = self.endpoint.open(room, sources, t).map(|()| {
                    let (tx, rx) = oneshot::channel();
                    self.endpoint.wait(room, Waiter { tx, keep: false });
                    rx
                });
                let opened = r.is_ok();
                if reply.send(r.map_err(Into::into)).is_err() && opened {
                    self.endpoint.abort(room, ReceiverRoom::gone(), t);
                }
            }
            Cmd::Refuse(room, sources, error) => {
                // A room known here (live or ended) stays as it is.
                if self.endpoint.state(room).is_none()
                    && self.endpoint.open(room, sources, t).is_ok()
                {
                    self.endpoint.abort(room, error, t);
                }
            }
            Cmd::AddLink(peer, link) => self.add_link(peer, link),
            Cmd::Connected(peer, reply) => {
                let _ = reply.send(self.endpoint.is_connected(peer));
            }
            Cmd::Capabilities(peer, reply) => {
                let _ = reply.send(self.endpoint.capabilities(peer));
            }
            Cmd::AwaitControl(peer, reply) => {
                if self.endpoint.has_control(peer) {
                    let _ = reply.send(());
                } else {
                    self.control_waiters.entry(peer).or_default().push(reply);
                }
            }
            Cmd::Abandon(peer) => {
                self.control_waiters.remove(&peer);
                self.endpoint.abandon(peer, t);
            }
            Cmd::Stats(reply) => {
                let s = self.endpoint.stats();
                let _ = reply.send(EndpointStats {
                    live_rooms: s.live_rooms,
                    peers: s.peers_ranks.len(),
                    peers_ranks: s.peers_ranks,
                    links: self.links.len(),
                    link_streams: self.links.values().map(|l| l.streams.len()).sum(),
                    room_stats: s.room_stats,
                    malformed_frames: s.malformed_frames,
                    rejected_segments: self.counters.rejected_segments.load(Ordering::Relaxed),
                    handshakes_failed: s.handshakes_failed,
                    tasks: 0,
                    stalled: s.stalled,
                    kv_bytes_sent: 0,
                });
            }
            Cmd::Shutdown => {}
        }
    }

    /// Do what the endpoint decided: link registrations and peers to close
    /// first (a link reader learns a room before its destination leaves),
    /// then control messages, then outcomes.
    fn flush(&mut self) {
        let t = now();
        let mut outcomes = Vec::new();
        while let Some(e) = self.endpoint.poll_event() {
            match e {
                ReceiverEvent::RegisterWrites {
                    peer,
                    room,
                    pages,
                    aux_slot,
                } => {
                    let (Some(l), Some(lease)) = (self.links.get(&peer), self.endpoint.lease(room))
                    else {
                        continue;
                    };
                    let _ = l.tx(room).send(ReaderCmd::Register {
                        room,
                        pages,
                        aux_slot,
                        guard: lease.writer_guard(),
                    });
                }
                ReceiverEvent::ForgetWrites { peer, room, .. } => {
                    // The link reader is the only writer of the room's
                    // pages on every transport: once it has this command
                    // nothing lands, however long the prefill stalls.
                    if let Some(l) = self.links.get(&peer) {
                        let _ = l.tx(room).send(ReaderCmd::Forget { room });
                    }
                }
                ReceiverEvent::ClosePeer { peer } => {
                    // Dropping the handles closes the control connection and
                    // stops the link's readers at their next step (the writer
                    // guards they hold keep their pages until then).
                    self.ctl.remove(&peer);
                    self.links.remove(&peer);
                }
                ReceiverEvent::Released {
                    room,
                    fence_expired: true,
                } => {
                    tracing::warn!(room = room.get(), "abort fence expired; pages released");
                }
                ReceiverEvent::Released { room, .. } => {
                    lock_board(&self.prompts).remove(&room);
                }
                ReceiverEvent::Outcome {
                    room,
                    waiter,
                    outcome,
                } => {
                    if !matches!(outcome, ReceiverPoll::Success { .. }) {
                        lock_board(&self.prompts).remove(&room);
                    }
                    outcomes.push((room, waiter, outcome))
                }
            }
        }
        while let Some(tr) = self.endpoint.poll_transmit(t) {
            if let Some(tx) = self.ctl.get(&tr.to) {
                let _ = tx.send(tr.message);
            }
        }
        // Outcomes last (see the sender's `flush`).
        for (room, waiter, outcome) in outcomes {
            if let Err(outcome) = waiter.tx.send(outcome) {
                if waiter.keep {
                    self.endpoint.unclaimed(room, outcome, t);
                }
            }
        }
    }
}
