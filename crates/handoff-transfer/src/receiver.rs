//! The decode side (DESIGN.md §3 steps 3 and 5, §5): [`KvReceiver`], a
//! cheap handle around one driver task that owns the [`ReceiverRooms`]
//! table, the page leases of live rooms, the aux records, heartbeats and the
//! links to every prefill rank.
//!
//! An engine calls [`KvReceiver::connect`] once per prefill rank (address
//! from bootstrap), [`KvReceiver::open`] when it accepts a request,
//! [`KvReceiver::reserve`] once it holds the pages (backpressure: a room may
//! wait in `Bootstrapping` for them), and [`KvReceiver::poll`] until the
//! room succeeds (the lease and aux come back) or fails (reason and status
//! as the side that saw it reported). [`KvReceiver::abort`] aborts anywhere;
//! the pages of an aborted room return to the pool only after every prefill
//! writer drained or the abort fence passed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use handoff_kv::{KvLayout, PageLease, ShmRegion};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig};
use handoff_proto::heartbeat::Liveness;
use handoff_proto::message::Message;
use handoff_proto::receiver_room::{ReceiverAction, ReceiverRooms, Source};
use handoff_proto::room::{Expiring, RoomConfig, RoomState};
use handoff_proto::timer::Timer;
use handoff_proto::{AuxSlot, PageIndex, RankId, RoomId, TransferError};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::conn::{run_control, CtlEvent, TaskCounter};
use crate::error::TransportError;
use crate::link::{connect_link_stream, LinkCounters, LinkReader, ReaderCmd, ReaderEvent};
use crate::plan::{check_room_sources, LinkPlan, TpPosition};
use crate::transport::TransportKind;
use crate::wire::{
    encode_preface, stream_of, AuxData, TcpStreamSetup, MAX_TCP_STREAMS, PREFACE_CONTROL,
};
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

/// What [`KvReceiver::poll`] says about a room.
#[derive(Debug)]
pub enum ReceiverPoll {
    /// Live, in this state.
    Pending(RoomState),
    /// Committed: the pages hold the prompt's KV; the engine owns them now.
    Success {
        /// The pages, back to the engine.
        lease: PageLease,
        /// The aux slot's data (first token, logprob).
        aux: AuxData,
    },
    /// Failed (reported once). Pages return to the pool on their own once
    /// no writer may still be writing.
    Failed(TransferError),
    /// Not known (never opened, or its outcome was already polled).
    Unknown,
}

enum Cmd {
    Open(
        RoomId,
        Vec<Source>,
        oneshot::Sender<Result<(), TransferError>>,
    ),
    Reserve(
        RoomId,
        PageLease,
        AuxSlot,
        oneshot::Sender<Result<(), TransferError>>,
    ),
    Abort(RoomId, TransferError),
    Poll(RoomId, oneshot::Sender<ReceiverPoll>),
    Wait(RoomId, oneshot::Sender<ReceiverPoll>),
    AddLink(RankId, NewLink),
    Connected(RankId, oneshot::Sender<bool>),
    Abandon(RankId),
    Stats(oneshot::Sender<EndpointStats>),
    Shutdown,
}

enum Ev {
    Cmd(Cmd),
    Ctl(CtlEvent),
    Reader(RankId, u64, ReaderEvent),
}

/// Handle to a decode transfer endpoint. Cheap to clone.
#[derive(Clone)]
pub struct KvReceiver {
    tx: mpsc::UnboundedSender<Ev>,
    config: ReceiverConfig,
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    tasks: TaskCounter,
    conn_ids: Arc<std::sync::atomic::AtomicU64>,
    next_peer: Arc<std::sync::atomic::AtomicU32>,
    endpoint: u64,
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
        let counters = Arc::new(LinkCounters::default());
        let driver = Driver {
            rooms: ReceiverRooms::new(config.rooms.clone()),
            liveness: Liveness::new(config.rooms.timers),
            ctl: HashMap::new(),
            links: HashMap::new(),
            leases: HashMap::new(),
            aux: HashMap::new(),
            outcomes: Expiring::new(config.rooms.max_live_rooms),
            ttl: config.rooms.timers.get(Timer::UnknownRoomTtl),
            abandoned: Abandoned::new(2 * config.handshake_timeout),
            sources: HashMap::new(),
            waiters: HashMap::new(),
            counters,
            tasks: tasks.clone(),
            pool: pool.clone(),
            layout,
            fingerprint: config.handshake.fingerprint.clone(),
            next_link: 0,
            self_tx: tx.downgrade(),
        };
        tasks.spawn(driver.run(rx));
        KvReceiver {
            tx,
            config,
            pool,
            layout,
            tasks,
            conn_ids: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            next_peer: Arc::new(std::sync::atomic::AtomicU32::new(0)),
            endpoint: rand::random(),
        }
    }

    async fn ask<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, TransportError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Ev::Cmd(f(tx)))
            .map_err(|_| TransportError::Shutdown)?;
        rx.await.map_err(|_| TransportError::Shutdown)
    }

    /// Connect to the prefill rank listening at `addr`: a control
    /// connection and a data link, both authenticated by the handshake.
    /// Returns the peer id this endpoint gives that prefill rank (use it in
    /// [`Source::rank`] of the rooms it serves) once both are up; a
    /// version, fingerprint or secret mismatch fails here, not at the first
    /// request.
    ///
    /// Cancel-safe: dropped before it returns, it leaves no control
    /// connection, data link or task behind. Prefill keeps one connection
    /// per decode endpoint, so connecting again to the same prefill
    /// replaces the earlier connection (its rank stops working).
    pub async fn connect(&self, addr: SocketAddr) -> Result<RankId, TransportError> {
        self.connect_with(addr, self.config.transport).await
    }

    /// [`Self::connect`] with the data link over `transport` instead of the
    /// configured default.
    pub async fn connect_with(
        &self,
        addr: SocketAddr,
        transport: TransportKind,
    ) -> Result<RankId, TransportError> {
        // This connect's number, before anything is sent: prefill keeps the
        // connections of the newest connect of this endpoint, so one
        // cancelled here but completed late there replaces nothing newer.
        let id = self.conn_ids.fetch_add(1, Ordering::Relaxed) + 1;
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(TransportError::io("control connect"))?;
        s.write_all(&encode_preface(PREFACE_CONTROL, self.endpoint, id))
            .await
            .map_err(TransportError::io("control preface"))?;
        // Our own id for this prefill endpoint (two prefill workers of the
        // same TP rank are different peers).
        let rank = RankId(self.next_peer.fetch_add(1, Ordering::Relaxed));
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
            Some(rank),
            self.tasks.clone(),
            send,
        ));
        // From here on, leaving early (an error, or the caller dropping
        // this future) abandons the rank: its control connection and any
        // data link go.
        let mut abandon = AbandonOnDrop {
            tx: self.tx.clone(),
            rank,
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
                let (timeout, pool) = (self.config.handshake_timeout, self.pool.clone());
                let num_pages = self.layout.num_pages;
                let setup = TcpStreamSetup {
                    nonce,
                    index,
                    count,
                };
                self.tasks.spawn(async move {
                    connect_link_stream(
                        addr, endpoint, id, config, timeout, transport, &pool, num_pages, setup,
                    )
                    .await
                })
            })
            .collect();
        // Stream connects still running when this future is dropped stop.
        let mut pending = AbortOnDrop(pending);
        let mut sockets = Vec::with_capacity(pending.0.len());
        let mut prefill = None;
        let mut failed = None;
        for p in &mut pending.0 {
            match p.await {
                Ok(Ok((stream, fp))) => {
                    sockets.push(stream);
                    prefill = Some(fp);
                }
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(_) => failed = failed.or(Some(TransportError::Shutdown)),
            }
        }
        // What this prefill rank writes into our pool: whole spans with
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
            })
            .map_err(TransportError::Config),
        };
        // Do not keep a control connection without its data link: an error
        // here returns with `abandon` armed.
        let link = link?;
        self.tx
            .send(Ev::Cmd(Cmd::AddLink(rank, link)))
            .map_err(|_| TransportError::Shutdown)?;
        // The control handshake runs concurrently; wait for it.
        let deadline = tokio::time::Instant::now() + self.config.handshake_timeout;
        loop {
            if self.ask(Cmd::Stats).await?.peers_ranks.contains(&rank) {
                abandon.armed = false;
                return Ok(rank);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(TransportError::Handshake(
                    handoff_proto::HandshakeError::TimedOut(self.config.handshake_timeout),
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Whether the prefill rank `rank` (from [`Self::connect`]) still has
    /// its control connection and data link up.
    pub async fn is_connected(&self, rank: RankId) -> Result<bool, TransportError> {
        self.ask(|r| Cmd::Connected(rank, r)).await
    }

    /// Accept a request for `room` needing KV from `sources`. Their TP
    /// ranks must cover every prefill rank this decode rank needs heads from
    /// ([`RankMap::required_prefill_ranks`]; one source with equal TP
    /// sizes), so the room cannot succeed with part of its heads missing.
    pub async fn open(&self, room: RoomId, sources: Vec<Source>) -> Result<(), TransportError> {
        Ok(self.ask(|r| Cmd::Open(room, sources, r)).await??)
    }

    /// Pages for `room` are reserved (`lease`, in token order) with aux slot
    /// `aux_slot`: destinations go to every source. On error the lease is
    /// dropped (the pages were never advertised).
    pub async fn reserve(
        &self,
        room: RoomId,
        lease: PageLease,
        aux_slot: AuxSlot,
    ) -> Result<(), TransportError> {
        Ok(self
            .ask(|r| Cmd::Reserve(room, lease, aux_slot, r))
            .await??)
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

/// Sends `Abandon(rank)` to the driver when dropped armed: a connect that
/// failed or was cancelled leaves no control connection or link behind.
struct AbandonOnDrop {
    tx: mpsc::UnboundedSender<Ev>,
    rank: RankId,
    armed: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Ev::Cmd(Cmd::Abandon(self.rank)));
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

/// Ranks abandoned before their control handshake finished, each kept
/// until that handshake must have ended one way or the other (`ttl`, twice
/// the handshake timeout): one that still comes up within it is dropped,
/// and one that fails or times out leaves nothing behind for long.
#[derive(Debug)]
struct Abandoned {
    until: HashMap<RankId, std::time::Instant>,
    ttl: Duration,
}

impl Abandoned {
    fn new(ttl: Duration) -> Self {
        Self {
            until: HashMap::new(),
            ttl,
        }
    }

    /// Remember `rank` (and forget those whose handshake has ended).
    fn insert(&mut self, rank: RankId, now: std::time::Instant) {
        self.until.retain(|_, until| *until > now);
        self.until.insert(rank, now + self.ttl);
    }

    /// Whether `rank` was abandoned (and still remembered); forgets it.
    fn take(&mut self, rank: RankId, now: std::time::Instant) -> bool {
        self.until.remove(&rank).is_some_and(|until| until > now)
    }
}

/// A data link whose streams connected, for the driver to start.
struct NewLink {
    kind: TransportKind,
    sockets: Vec<TcpStream>,
    plan: LinkPlan,
    tp: TpPosition,
}

/// One data link to a prefill rank: one reader per stream.
struct Link {
    id: u64,
    streams: Vec<mpsc::UnboundedSender<ReaderCmd>>,
    /// The prefill peer's TP rank and size (from its handshake).
    tp: TpPosition,
}

impl Link {
    /// The reader of the stream that carries `room` (only it may write it).
    fn tx(&self, room: RoomId) -> &mpsc::UnboundedSender<ReaderCmd> {
        &self.streams[stream_of(room, self.streams.len())]
    }
}

struct Driver {
    rooms: ReceiverRooms,
    liveness: Liveness,
    ctl: HashMap<RankId, (u64, mpsc::UnboundedSender<Message>)>,
    links: HashMap<RankId, Link>,
    leases: HashMap<RoomId, (PageLease, Vec<RankId>)>,
    aux: HashMap<RoomId, (u64, AuxData)>,
    /// Outcomes not yet polled; they expire with the unknown-room TTL (a
    /// lease in an expired success goes back to the pool).
    outcomes: Expiring<ReceiverPoll>,
    ttl: Duration,
    /// Sources of rooms still waiting for their pages.
    sources: HashMap<RoomId, Vec<RankId>>,
    /// Peers whose `connect` failed or was cancelled before their control
    /// connection was up: it is dropped if it still comes up.
    abandoned: Abandoned,
    waiters: HashMap<RoomId, oneshot::Sender<ReceiverPoll>>,
    counters: Arc<LinkCounters>,
    tasks: TaskCounter,
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    /// Our handshake fingerprint (model KV heads, our TP rank and size).
    fingerprint: Fingerprint,
    next_link: u64,
    self_tx: mpsc::WeakUnboundedSender<Ev>,
}

fn now() -> std::time::Instant {
    std::time::Instant::now()
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Ev>) {
        let mut wakeup = crate::wakeup::Wakeup::new();
        loop {
            let deadline = self
                .rooms
                .poll_timeout()
                .into_iter()
                .chain(self.liveness.poll_timeout())
                .chain(self.outcomes.next_expiry())
                .min();
            let sleep = wakeup.until(deadline);
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = sleep => {
                    let t = now();
                    self.rooms.handle_timeout(t);
                    self.outcomes.expire(t);
                    for dead in self.liveness.handle_timeout(t) {
                        tracing::warn!(rank = dead.0, "prefill peer missed heartbeats");
                        self.ctl.remove(&dead);
                        // Its link's reader stops at its next step (the
                        // writer guards it holds keep their pages until
                        // then); the rooms' leases stay held until their
                        // fence, as for any dead peer.
                        self.links.remove(&dead);
                        self.rooms.handle_peer_dead(dead, t);
                    }
                    self.pump();
                    continue;
                }
            };
            let Some(ev) = ev else { break };
            match ev {
                Ev::Cmd(Cmd::Shutdown) => break,
                Ev::Cmd(c) => self.command(c),
                Ev::Ctl(e) => self.control(e),
                Ev::Reader(rank, id, e) => self.reader_event(rank, id, e),
            }
            self.pump();
        }
        self.ctl.clear();
        self.links.clear();
        self.leases.clear();
        self.outcomes = Expiring::new(0);
    }

    fn control(&mut self, e: CtlEvent) {
        let t = now();
        match e {
            CtlEvent::Established { conn, rank, tx } => {
                if self.abandoned.take(rank, t) {
                    return; // dropping `tx` closes the connection
                }
                self.ctl.insert(rank, (conn, tx));
                self.liveness.add_peer(rank, t);
            }
            CtlEvent::Message { rank, msg, .. } => {
                self.liveness.handle_seen(rank, t);
                self.rooms.handle_message(rank, msg, t);
            }
            CtlEvent::Malformed { .. } => {
                self.counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
            }
            CtlEvent::HandshakeFailed { .. } => {
                self.counters
                    .handshakes_failed
                    .fetch_add(1, Ordering::Relaxed);
            }
            CtlEvent::Closed { conn, rank } => {
                if let Some(rank) = rank {
                    if self.ctl.get(&rank).is_some_and(|(c, _)| *c == conn) {
                        self.ctl.remove(&rank);
                        self.liveness.remove_peer(rank);
                        // Its data link goes too (dropping the reader closes
                        // the sockets, and prefill drops its side): a link
                        // without its control connection serves no room.
                        self.links.remove(&rank);
                        self.rooms.handle_peer_dead(rank, t);
                    }
                }
            }
        }
    }

    fn reader_event(&mut self, rank: RankId, id: u64, e: ReaderEvent) {
        match e {
            ReaderEvent::Aux {
                room,
                written_room,
                aux,
            } => {
                if self.leases.contains_key(&room) {
                    self.aux.insert(room, (written_room, aux));
                }
            }
            ReaderEvent::Closed { reason } => {
                if self.links.get(&rank).is_some_and(|l| l.id == id) {
                    tracing::warn!(rank = rank.0, %reason, "data link closed");
                    self.links.remove(&rank);
                    self.rooms.handle_peer_dead(rank, now());
                }
            }
        }
    }

    /// Both the control connection and the data link of `rank` are up.
    fn connected(&self, rank: RankId) -> bool {
        self.ctl.contains_key(&rank) && self.links.contains_key(&rank)
    }

    /// Why `ranks` (connected peers) cannot serve a room of this decode
    /// rank ([`check_room_sources`]).
    fn check_sources(&self, ranks: &[RankId]) -> Result<(), String> {
        let tps: Vec<TpPosition> = ranks
            .iter()
            .filter_map(|r| self.links.get(r).map(|l| l.tp))
            .collect();
        check_room_sources(&self.fingerprint, &tps)
    }

    fn add_link(&mut self, rank: RankId, link: NewLink) {
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
            );
            let weak = self.self_tx.clone();
            self.tasks.spawn(reader.run(rx, move |e| {
                weak.upgrade()
                    .is_some_and(|tx| tx.send(Ev::Reader(rank, id, e)).is_ok())
            }));
            streams.push(tx);
        }
        self.links.insert(
            rank,
            Link {
                id,
                streams,
                tp: link.tp,
            },
        );
    }

    fn command(&mut self, c: Cmd) {
        let t = now();
        match c {
            Cmd::Open(room, sources, reply) => {
                let ranks: Vec<RankId> = sources.iter().map(|s| s.rank).collect();
                // A room whose source is not connected (its control
                // connection or data link is gone) could only end at its
                // bootstrap deadline: refuse it now.
                if let Some(&dead) = ranks.iter().find(|r| !self.connected(**r)) {
                    let _ = reply.send(Err(TransferError::PeerDead {
                        rank: dead,
                        detail: "no live connection to this prefill rank (it closed or died); reconnect first".into(),
                    }));
                    return;
                }
                if let Err(reason) = self.check_sources(&ranks) {
                    let _ = reply.send(Err(TransferError::Internal { reason }));
                    return;
                }
                let r = self.rooms.open(room, sources, t);
                if r.is_ok() {
                    self.sources.insert(room, ranks);
                }
                let _ = reply.send(r);
            }
            Cmd::Reserve(room, lease, aux_slot, reply) => {
                let _ = reply.send(self.reserve(room, lease, aux_slot));
            }
            Cmd::Abort(room, error) => self.rooms.abort(room, error, t),
            Cmd::Poll(room, reply) => {
                // A failure is reported at once, even while the room's pages
                // still wait for writers to drain (Draining).
                let p = match (self.outcomes.remove(room), self.rooms.state(room)) {
                    (Some(o), _) => o,
                    (None, Some(s)) if !s.is_terminal() => ReceiverPoll::Pending(s),
                    (None, _) => ReceiverPoll::Unknown,
                };
                let _ = reply.send(p);
            }
            Cmd::Wait(room, reply) => match self.outcomes.remove(room) {
                Some(o) => {
                    let _ = reply.send(o);
                }
                None if self.rooms.state(room).is_some_and(|s| !s.is_terminal()) => {
                    self.waiters.insert(room, reply);
                }
                None => {
                    let _ = reply.send(ReceiverPoll::Unknown);
                }
            },
            Cmd::AddLink(rank, link) => self.add_link(rank, link),
            Cmd::Connected(rank, reply) => {
                let _ = reply.send(self.connected(rank));
            }
            Cmd::Abandon(rank) => {
                if self.ctl.remove(&rank).is_none() {
                    self.abandoned.insert(rank, now());
                }
                self.liveness.remove_peer(rank);
                self.links.remove(&rank);
            }
            Cmd::Stats(reply) => {
                let _ = reply.send(EndpointStats {
                    live_rooms: self.rooms.live_rooms(),
                    peers: self.ctl.len(),
                    peers_ranks: self.ctl.keys().copied().collect(),
                    links: self.links.len(),
                    link_streams: self.links.values().map(|l| l.streams.len()).sum(),
                    room_stats: self.rooms.stats().clone(),
                    malformed_frames: self.counters.malformed_frames.load(Ordering::Relaxed),
                    rejected_segments: self.counters.rejected_segments.load(Ordering::Relaxed),
                    handshakes_failed: self.counters.handshakes_failed.load(Ordering::Relaxed),
                    tasks: 0,
                    stalled: self.liveness.stalled(),
                });
            }
            Cmd::Shutdown => {}
        }
    }

    fn reserve(
        &mut self,
        room: RoomId,
        lease: PageLease,
        aux_slot: AuxSlot,
    ) -> Result<(), TransferError> {
        let pages: Vec<PageIndex> = lease.pages().iter().map(|p| PageIndex(p.0)).collect();
        if self.rooms.state(room) != Some(RoomState::Bootstrapping) {
            return Err(TransferError::Internal {
                reason: "room is not waiting for pages".into(),
            });
        }
        // Register the room with its sources' links (only they may write it)
        // before its destination leaves: a write can only follow it.
        let sources: Vec<RankId> = self.sources.remove(&room).unwrap_or_default();
        let mut sorted: Vec<u32> = pages.iter().map(|p| p.0).collect();
        sorted.sort_unstable();
        let mut registered = Vec::new();
        for rank in sources {
            if let Some(l) = self.links.get(&rank) {
                let _ = l.tx(room).send(ReaderCmd::Register {
                    room,
                    pages: sorted.clone(),
                    aux_slot: aux_slot.0,
                    guard: lease.writer_guard(),
                });
                registered.push(rank);
            }
        }
        match self
            .rooms
            .handle_pages_reserved(room, pages, aux_slot, None, now())
        {
            Ok(()) => {
                self.leases.insert(room, (lease, registered));
                Ok(())
            }
            Err(_) => {
                self.forget(room, &registered);
                Err(TransferError::Internal {
                    reason: "room refused its pages".into(),
                })
            }
        }
    }

    fn outcome(&mut self, room: RoomId, o: ReceiverPoll) {
        match self.waiters.remove(&room) {
            Some(w) => {
                if let Err(o) = w.send(o) {
                    self.outcomes.insert(room, o, now() + self.ttl);
                }
            }
            None => {
                self.outcomes.insert(room, o, now() + self.ttl);
            }
        }
    }

    fn forget(&mut self, room: RoomId, ranks: &[RankId]) {
        for rank in ranks {
            if let Some(l) = self.links.get(rank) {
                let _ = l.tx(room).send(ReaderCmd::Forget { room });
            }
        }
    }

    fn pump(&mut self) {
        loop {
            let mut busy = false;
            while let Some(t) = self.rooms.poll_transmit() {
                busy = true;
                if let Some((_, tx)) = self.ctl.get(&t.to) {
                    let _ = tx.send(t.message);
                }
            }
            while let Some(t) = self.liveness.poll_transmit(now()) {
                if let Some((_, tx)) = self.ctl.get(&t.to) {
                    let _ = tx.send(t.message);
                }
            }
            while let Some(a) = self.rooms.poll_action() {
                busy = true;
                self.action(a);
            }
            if !busy {
                break;
            }
        }
    }

    fn action(&mut self, a: ReceiverAction) {
        let t = now();
        match a {
            ReceiverAction::CheckAux { room, .. } => {
                let found = self.aux.get(&room).map_or(0, |(w, _)| *w);
                self.rooms.handle_aux_checked(room, found, t);
            }
            ReceiverAction::Commit { room, .. } => {
                let aux = self.aux.remove(&room).map(|(_, a)| a);
                if let Some((lease, ranks)) = self.leases.remove(&room) {
                    self.forget(room, &ranks);
                    let aux = aux.unwrap_or(AuxData {
                        first_token: 0,
                        logprob: 0.0,
                    });
                    self.outcome(room, ReceiverPoll::Success { lease, aux });
                }
            }
            ReceiverAction::FailRequest { room, error } => {
                self.sources.remove(&room);
                self.outcome(room, ReceiverPoll::Failed(error));
            }
            ReceiverAction::ReleasePages {
                room,
                fence_expired,
                ..
            } => {
                if fence_expired {
                    tracing::warn!(room = room.get(), "abort fence expired; pages released");
                }
                self.aux.remove(&room);
                if let Some((lease, ranks)) = self.leases.remove(&room) {
                    self.forget(room, &ranks);
                    drop(lease);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abandoned_ranks_are_forgotten_once_their_handshake_has_ended() {
        let t0 = std::time::Instant::now();
        let ttl = Duration::from_secs(10);
        let mut a = Abandoned::new(ttl);
        for r in 0..100 {
            a.insert(RankId(r), t0);
        }
        // Within the TTL: a rank that comes up late is recognised, once.
        assert!(a.take(RankId(7), t0 + ttl / 2));
        assert!(!a.take(RankId(7), t0 + ttl / 2));
        assert_eq!(a.until.len(), 99);
        // Past it, the next abandon forgets all of them.
        a.insert(RankId(500), t0 + ttl + Duration::from_millis(1));
        assert_eq!(a.until.len(), 1);
        assert!(!a.take(RankId(8), t0 + ttl + Duration::from_millis(1)));
        assert!(a.take(RankId(500), t0 + ttl + Duration::from_millis(2)));
    }
}
