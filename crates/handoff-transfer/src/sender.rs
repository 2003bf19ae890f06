//! The prefill side (DESIGN.md §3 step 4, §5): [`KvSender`], a cheap handle
//! around one driver task that owns the [`SenderRooms`] table, heartbeats,
//! and the control and data links of every decode peer (TGI's queue shape:
//! commands in, state inside one task, replies on oneshots).
//!
//! An engine calls [`KvSender::open`] when it accepts a request, waits until
//! [`KvSender::poll`] says `WaitingForInput` (every decode destination
//! arrived: compute may start), then streams KV with [`KvSender::send`] (a
//! range of layers and pages, so layer-by-layer streaming works) and ends
//! with [`KvSender::finish`] (aux record). [`KvSender::fail`] rejects or
//! aborts a room; its reason and status reach every decode peer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_kv::{KvLayout, PageIndex, ShmRegion};
use handoff_proto::handshake::HandshakeConfig;
use handoff_proto::heartbeat::Liveness;
use handoff_proto::message::{Destination, Message};
use handoff_proto::rank::PairPlan;
use handoff_proto::room::{Expiring, RoomConfig, RoomState};
use handoff_proto::sender_room::{SenderAction, SenderRooms};
use handoff_proto::timer::Timer;
use handoff_proto::{RankId, RoomId, TransferError};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::conn::{run_control, CtlEvent, TaskCounter};
use crate::error::TransportError;
use crate::link::{
    accept_link, page_span, span_offset, AcceptedLink, LinkCounters, LinkEvent, LinkJob,
};
use crate::plan::{build_sliced_segments, LinkPlan};
use crate::transport::Segment;
use crate::wire::{
    decode_preface, stream_of, AuxData, SegmentHeader, PREFACE_CONTROL, PREFACE_DATA, PREFACE_LEN,
};
use crate::EndpointStats;

/// Settings of a prefill endpoint.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// Where to listen for decode peers (control and data links).
    pub listen: SocketAddr,
    /// Handshake: role Prefill, fingerprint, optional secret.
    pub handshake: HandshakeConfig,
    /// Room table limits and timers.
    pub rooms: RoomConfig,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Largest coalesced segment in bytes.
    pub max_segment_bytes: usize,
}

impl SenderConfig {
    /// Defaults for `handshake` on 127.0.0.1, any port.
    pub fn new(handshake: HandshakeConfig) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            handshake,
            rooms: RoomConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            max_segment_bytes: 4 << 20,
        }
    }
}

/// What [`KvSender::poll`] says about a room.
#[derive(Debug, Clone, PartialEq)]
pub enum SenderPoll {
    /// Live, in this state (`WaitingForInput`: compute may start).
    Pending(RoomState),
    /// Every destination has all KV and aux.
    Success,
    /// Failed (reported once; the room is released).
    Failed(TransferError),
    /// Not known (never opened, or its outcome was already polled).
    Unknown,
}

enum Cmd {
    Open(RoomId, oneshot::Sender<Result<(), TransferError>>),
    Fail(RoomId, TransferError),
    Send {
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: Arc<[PageIndex]>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Finish(RoomId, AuxData, oneshot::Sender<Result<(), TransferError>>),
    Poll(RoomId, oneshot::Sender<SenderPoll>),
    Wait(RoomId, oneshot::Sender<SenderPoll>),
    WaitInput(RoomId, oneshot::Sender<SenderPoll>),
    Stats(oneshot::Sender<EndpointStats>),
    Shutdown,
}

enum Ev {
    Cmd(Cmd),
    /// A control connection's event, with decode's connect number.
    Ctl(CtlEvent, u64),
    Link(LinkEvent),
    /// A data link stream, with decode's connect number.
    Accepted(Box<AcceptedLink>, u64),
}

/// Handle to a prefill transfer endpoint. Cheap to clone.
#[derive(Clone)]
pub struct KvSender {
    tx: mpsc::UnboundedSender<Ev>,
    addr: SocketAddr,
    tasks: TaskCounter,
}

impl std::fmt::Debug for KvSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSender")
            .field("addr", &self.addr)
            .finish()
    }
}

impl KvSender {
    /// Bind the listener and start the endpoint. `pool` is the prefill KV
    /// pool's shared region, laid out as `layout`.
    pub async fn start(
        config: SenderConfig,
        pool: Arc<ShmRegion>,
        layout: KvLayout,
    ) -> Result<KvSender, TransportError> {
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(TransportError::io("bind"))?;
        let addr = listener.local_addr().map_err(TransportError::io("bind"))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let tasks = TaskCounter::default();
        let counters = Arc::new(LinkCounters::default());
        let accept = tasks.spawn(accept_loop(
            listener,
            config.clone(),
            pool,
            layout,
            tx.downgrade(),
            tasks.clone(),
            counters.clone(),
        ));
        let driver = Driver {
            outcomes: Expiring::new(config.rooms.max_live_rooms),
            rooms: SenderRooms::new(config.rooms.clone()),
            liveness: Liveness::new(config.rooms.timers),
            config,
            layout,
            ctl: HashMap::new(),
            links: HashMap::new(),
            pending_links: HashMap::new(),
            io: HashMap::new(),
            waiters: HashMap::new(),
            input_waiters: HashMap::new(),
            counters,
            tasks: tasks.clone(),
            next_link: 0,
            newest: HashMap::new(),
        };
        tasks.spawn(driver.run(rx, accept));
        Ok(KvSender { tx, addr, tasks })
    }

    /// Where decode peers connect (the bootstrap address of this rank).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn ask<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, TransportError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Ev::Cmd(f(tx)))
            .map_err(|_| TransportError::Shutdown)?;
        rx.await.map_err(|_| TransportError::Shutdown)
    }

    /// Accept a request for `room`. Fails for a duplicate live room id, a
    /// room decode already aborted, or capacity.
    pub async fn open(&self, room: RoomId) -> Result<(), TransportError> {
        Ok(self.ask(|r| Cmd::Open(room, r)).await??)
    }

    /// Fail `room` here (validation rejection, engine error): every decode
    /// destination learns `error`'s reason and status.
    pub fn fail(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Fail(room, error)));
    }

    /// Write `layers` × room pages `pages` (indices into the room's page
    /// list) from source pages `src` (the room's prefill pages, in token
    /// order). The first call marks compute done. Returns once queued.
    pub async fn send(
        &self,
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: Arc<[PageIndex]>,
    ) -> Result<(), TransportError> {
        Ok(self
            .ask(|reply| Cmd::Send {
                room,
                layers,
                pages,
                src,
                reply,
            })
            .await??)
    }

    /// Every `send` of `room` is queued: write the aux record and end the
    /// room on every link. Success is reported once decode acknowledged.
    pub async fn finish(&self, room: RoomId, aux: AuxData) -> Result<(), TransportError> {
        Ok(self.ask(|r| Cmd::Finish(room, aux, r)).await??)
    }

    /// The room's state or outcome (an outcome is reported once).
    pub async fn poll(&self, room: RoomId) -> Result<SenderPoll, TransportError> {
        self.ask(|r| Cmd::Poll(room, r)).await
    }

    /// Wait until `room` ends and return its outcome (taken, like `poll`).
    /// Returns `Unknown` at once for a room that is neither live nor ended.
    pub async fn wait(&self, room: RoomId) -> Result<SenderPoll, TransportError> {
        self.ask(|r| Cmd::Wait(room, r)).await
    }

    /// Wait until `room` leaves `Bootstrapping`: every destination arrived
    /// (`Pending(WaitingForInput)`: compute may start) or the room ended
    /// (`Unknown`: its outcome is left for [`Self::poll`] / [`Self::wait`]).
    pub async fn wait_input(&self, room: RoomId) -> Result<SenderPoll, TransportError> {
        self.ask(|r| Cmd::WaitInput(room, r)).await
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

    /// Stop: close every connection and task.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Shutdown));
    }
}

async fn accept_loop(
    listener: TcpListener,
    config: SenderConfig,
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    tx: mpsc::WeakUnboundedSender<Ev>,
    tasks: TaskCounter,
    counters: Arc<LinkCounters>,
) {
    let mut conn_id = 0u64;
    let peers = Arc::new(PeerIds::default());
    loop {
        let Ok((mut stream, _addr)) = listener.accept().await else {
            continue;
        };
        let Some(tx) = tx.upgrade() else { return };
        conn_id += 1;
        let id = conn_id;
        let config = config.clone();
        let pool = pool.clone();
        let counters = counters.clone();
        let t2 = tasks.clone();
        let peers = peers.clone();
        tasks.spawn(async move {
            let mut preface = [0u8; PREFACE_LEN];
            let got =
                tokio::time::timeout(config.handshake_timeout, stream.read_exact(&mut preface))
                    .await;
            if !matches!(got, Ok(Ok(_))) {
                counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let (kind, endpoint_id, connect) = decode_preface(&preface);
            let peer = peers.assign(endpoint_id);
            match kind {
                PREFACE_CONTROL => {
                    let send = move |e: CtlEvent| tx.send(Ev::Ctl(e, connect)).map_err(|_| ());
                    run_control(
                        stream,
                        config.handshake.clone(),
                        config.handshake_timeout,
                        id,
                        Some(peer),
                        t2,
                        send,
                    )
                    .await;
                }
                PREFACE_DATA => {
                    match accept_link(
                        stream,
                        peer,
                        config.handshake.clone(),
                        config.handshake_timeout,
                        pool,
                        &layout,
                    )
                    .await
                    {
                        Ok(link) => {
                            peers.confirm(endpoint_id);
                            let _ = tx.send(Ev::Accepted(Box::new(link), connect));
                        }
                        Err(e) => {
                            counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "data link refused");
                        }
                    }
                }
                _ => {
                    counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
}

/// Decode endpoint id → the peer id the room table knows it by. An id is
/// assigned when a connection's preface arrives, before its handshake, so
/// unauthenticated connections can create ids: those stay *unconfirmed* and
/// at most [`MAX_UNCONFIRMED`] of them are kept (oldest forgotten first).
/// An id is *confirmed* once a data link of that endpoint passed its
/// handshake; confirmed ids are never evicted by unconfirmed churn, so a
/// flood of bogus prefaces cannot take a live decode's id away (a
/// reconnecting decode whose id was forgotten simply gets a new one).
#[derive(Default)]
struct PeerIds {
    inner: std::sync::Mutex<PeerIdTable>,
}

#[derive(Default)]
struct PeerIdTable {
    ids: HashMap<u64, (RankId, bool)>,
    unconfirmed: std::collections::VecDeque<u64>,
    confirmed: std::collections::VecDeque<u64>,
    next: u32,
}

/// Most ids kept for endpoints that never completed a handshake.
const MAX_UNCONFIRMED: usize = 4096;
/// Most ids kept for endpoints that did.
const MAX_CONFIRMED: usize = 65_536;

impl PeerIds {
    fn assign(&self, endpoint: u64) -> RankId {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *g;
        if let Some((r, _)) = t.ids.get(&endpoint) {
            return *r;
        }
        let r = RankId(t.next);
        t.next = t.next.wrapping_add(1);
        t.ids.insert(endpoint, (r, false));
        t.unconfirmed.push_back(endpoint);
        while t.unconfirmed.len() > MAX_UNCONFIRMED {
            if let Some(old) = t.unconfirmed.pop_front() {
                if matches!(t.ids.get(&old), Some((_, false))) {
                    t.ids.remove(&old);
                }
            }
        }
        r
    }

    /// `endpoint` passed a handshake: keep its id.
    fn confirm(&self, endpoint: u64) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *g;
        let Some(entry) = t.ids.get_mut(&endpoint) else {
            return;
        };
        if entry.1 {
            return;
        }
        entry.1 = true;
        t.unconfirmed.retain(|e| *e != endpoint);
        t.confirmed.push_back(endpoint);
        while t.confirmed.len() > MAX_CONFIRMED {
            if let Some(old) = t.confirmed.pop_front() {
                t.ids.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod peer_id_tests {
    use super::*;

    #[test]
    fn a_flood_of_unauthenticated_prefaces_keeps_a_confirmed_id() {
        let ids = PeerIds::default();
        let live = ids.assign(7);
        ids.confirm(7);
        for e in 1000..(1000 + 3 * MAX_UNCONFIRMED as u64) {
            ids.assign(e);
        }
        assert_eq!(ids.assign(7), live, "the live decode kept its id");
        let t = ids.inner.lock().unwrap();
        assert!(
            t.ids.len() <= MAX_UNCONFIRMED + 1,
            "{} ids kept",
            t.ids.len()
        );
    }

    #[test]
    fn unconfirmed_ids_are_forgotten_oldest_first() {
        let ids = PeerIds::default();
        let first = ids.assign(1);
        for e in 2..=(MAX_UNCONFIRMED as u64 + 1) {
            ids.assign(e);
        }
        assert_ne!(
            ids.assign(1),
            first,
            "the oldest unconfirmed id was forgotten"
        );
    }
}

/// One data link to a decode rank: one writer per stream.
struct Link {
    id: u64,
    streams: Vec<mpsc::UnboundedSender<LinkJob>>,
    dest_pages: usize,
    /// Whole spans, or the head slices this decode rank takes from us.
    plan: LinkPlan,
}

impl Link {
    /// The writer of the stream that carries `room`.
    fn tx(&self, room: RoomId) -> &mpsc::UnboundedSender<LinkJob> {
        &self.streams[stream_of(room, self.streams.len())]
    }
}

/// Streams of a multi-stream TCP link accepted so far (the link starts
/// once all of them are here).
struct PendingLink {
    nonce: u64,
    streams: Vec<Option<AcceptedLink>>,
}

struct RoomIo {
    dests: Vec<(RankId, Destination)>,
    cancel: Arc<AtomicBool>,
    ended: bool,
}

struct Driver {
    config: SenderConfig,
    layout: KvLayout,
    rooms: SenderRooms,
    liveness: Liveness,
    ctl: HashMap<RankId, (u64, mpsc::UnboundedSender<Message>)>,
    links: HashMap<RankId, Link>,
    /// At most one partly accepted multi-stream link per decode rank.
    pending_links: HashMap<RankId, PendingLink>,
    io: HashMap<RoomId, RoomIo>,
    /// Outcomes not yet polled; they expire with the unknown-room TTL.
    outcomes: Expiring<Result<(), TransferError>>,
    waiters: HashMap<RoomId, Vec<oneshot::Sender<SenderPoll>>>,
    /// Waiting for their room to leave `Bootstrapping`.
    input_waiters: HashMap<RoomId, Vec<oneshot::Sender<SenderPoll>>>,
    counters: Arc<LinkCounters>,
    tasks: TaskCounter,
    next_link: u64,
    /// Per decode rank with a connection, the newest connect number seen
    /// ([`crate::wire::CONNECT_SEQ_LEN`]).
    newest: HashMap<RankId, u64>,
}

/// Decode ranks whose newest connect number the driver keeps even with
/// nothing left of them.
const MAX_NEWEST: usize = 4096;

fn now() -> std::time::Instant {
    std::time::Instant::now()
}

impl Driver {
    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Ev>,
        accept: tokio::task::JoinHandle<()>,
    ) {
        // The driver keeps a sender to itself for link tasks.
        let (self_tx, mut self_rx) = mpsc::unbounded_channel::<Ev>();
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
                ev = self_rx.recv() => ev,
                _ = sleep => {
                    self.on_timeout();
                    self.pump();
                    self.wake_input_waiters();
                    continue;
                }
            };
            let Some(ev) = ev else { break };
            match ev {
                Ev::Cmd(Cmd::Shutdown) => break,
                Ev::Cmd(c) => self.command(c),
                Ev::Ctl(e, connect) => self.control(e, connect),
                Ev::Link(e) => self.link_event(e),
                Ev::Accepted(l, connect) => {
                    if self.admit(l.rank, connect, now()) {
                        self.accepted(*l, &self_tx);
                    }
                    // else: a cancelled connect's stream, completed late;
                    // dropping it closes its socket.
                }
            }
            self.pump();
            self.wake_input_waiters();
        }
        accept.abort();
        self.ctl.clear();
        self.links.clear();
        self.pending_links.clear();
        for (_, io) in self.io.drain() {
            io.cancel.store(true, Ordering::Release);
        }
    }

    /// The state `wait_input` reports for `room`, or `None` while it is
    /// still bootstrapping.
    fn input_state(&self, room: RoomId) -> Option<SenderPoll> {
        match self.rooms.state(room) {
            Some(RoomState::Bootstrapping) => None,
            Some(s) if !s.is_terminal() => Some(SenderPoll::Pending(s)),
            _ => Some(SenderPoll::Unknown),
        }
    }

    fn wake_input_waiters(&mut self) {
        if self.input_waiters.is_empty() {
            return;
        }
        let ready: Vec<(RoomId, SenderPoll)> = self
            .input_waiters
            .keys()
            .filter_map(|&room| self.input_state(room).map(|p| (room, p)))
            .collect();
        for (room, p) in ready {
            for w in self.input_waiters.remove(&room).unwrap_or_default() {
                let _ = w.send(p.clone());
            }
        }
    }

    fn on_timeout(&mut self) {
        let t = now();
        self.rooms.handle_timeout(t);
        self.outcomes.expire(t);
        for dead in self.liveness.handle_timeout(t) {
            tracing::warn!(rank = dead.0, "decode peer missed heartbeats");
            self.ctl.remove(&dead);
            self.pending_links.remove(&dead);
            // Its writers finish the job in hand and stop; the rooms fail
            // as the peer is dead.
            self.links.remove(&dead);
            self.rooms.handle_peer_dead(dead, t);
            self.bound_newest();
        }
    }

    fn accepted(&mut self, l: AcceptedLink, self_tx: &mpsc::UnboundedSender<Ev>) {
        let rank = l.rank;
        let st = l.stream;
        let streams = if st.count <= 1 {
            vec![l]
        } else {
            // A new nonce means decode started the link over: the streams
            // of the older attempt are dropped (their sockets close).
            let p = self
                .pending_links
                .entry(rank)
                .or_insert_with(|| PendingLink {
                    nonce: st.nonce,
                    streams: Vec::new(),
                });
            if p.nonce != st.nonce || p.streams.len() != usize::from(st.count) {
                p.nonce = st.nonce;
                p.streams = (0..st.count).map(|_| None).collect();
            }
            p.streams[usize::from(st.index)] = Some(l);
            if p.streams.iter().any(Option::is_none) {
                return;
            }
            let Some(p) = self.pending_links.remove(&rank) else {
                return;
            };
            p.streams.into_iter().flatten().collect()
        };
        self.next_link += 1;
        let id = self.next_link;
        let dest_pages = streams[0].dest_pages;
        let plan = streams[0].plan.clone();
        let txs = streams
            .into_iter()
            .map(|l| {
                let weak = self_tx.downgrade();
                l.spawn(id, &self.tasks, move |e| {
                    weak.upgrade()
                        .is_some_and(|tx| tx.send(Ev::Link(e)).is_ok())
                })
            })
            .collect();
        self.links.insert(
            rank,
            Link {
                id,
                streams: txs,
                dest_pages,
                plan,
            },
        );
    }

    /// Whether a connection of decode's connect `connect` may join what
    /// `rank` has. Not when a newer connect of that endpoint was seen (a
    /// connect cancelled on decode, completing late here). A newer connect
    /// replaces the older one: its control connection and data link go
    /// (their sockets close, so decode drops that rank) and its rooms fail,
    /// so no rank is left with the control connection of one connect and
    /// the data link of another.
    fn admit(&mut self, rank: RankId, connect: u64, t: std::time::Instant) -> bool {
        match self.newest.get(&rank) {
            Some(&newest) if newest > connect => return false,
            Some(&newest) if newest == connect => return true,
            _ => {}
        }
        self.newest.insert(rank, connect);
        let ctl = self.ctl.remove(&rank).is_some();
        let link = self.links.remove(&rank).is_some();
        let pending = self.pending_links.remove(&rank).is_some();
        if ctl || link || pending {
            self.liveness.remove_peer(rank);
            self.rooms.handle_peer_dead(rank, t);
        }
        true
    }

    /// Keep [`Self::newest`] bounded: past [`MAX_NEWEST`] entries, forget
    /// those of ranks with nothing left (a late connection of a forgotten
    /// rank is then admitted, and closes when decode drops it).
    fn bound_newest(&mut self) {
        if self.newest.len() > MAX_NEWEST {
            let (ctl, links, pending) = (&self.ctl, &self.links, &self.pending_links);
            self.newest.retain(|r, _| {
                ctl.contains_key(r) || links.contains_key(r) || pending.contains_key(r)
            });
        }
    }

    fn control(&mut self, e: CtlEvent, connect: u64) {
        let t = now();
        match e {
            CtlEvent::Established { conn, rank, tx } => {
                if !self.admit(rank, connect, t) {
                    // A cancelled connect's control connection, completed
                    // late: dropping `tx` closes it.
                    return;
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
                        self.pending_links.remove(&rank);
                        self.links.remove(&rank);
                        self.liveness.remove_peer(rank);
                        self.rooms.handle_peer_dead(rank, t);
                        self.bound_newest();
                    }
                }
            }
        }
    }

    fn link_event(&mut self, e: LinkEvent) {
        let t = now();
        match e {
            LinkEvent::Acked { rank, ack, .. } => {
                let Some(io) = self.io.get(&ack.room) else {
                    return;
                };
                if io.cancel.load(Ordering::Acquire) {
                    let err = TransferError::Internal {
                        reason: "writes cancelled".into(),
                    };
                    self.rooms.handle_write_failed(ack.room, rank, err, t);
                } else if ack.ok {
                    self.rooms.handle_write_done(ack.room, rank, t);
                } else {
                    let err = TransferError::PeerMisbehaved {
                        detail: "decode rejected part of the room's writes".into(),
                    };
                    self.rooms.handle_write_failed(ack.room, rank, err, t);
                }
            }
            LinkEvent::Closed { rank, link, reason } => {
                if self.links.get(&rank).is_some_and(|l| l.id == link) {
                    self.links.remove(&rank);
                    let hit: Vec<RoomId> = self
                        .io
                        .iter()
                        .filter(|(_, io)| io.dests.iter().any(|(r, _)| *r == rank))
                        .map(|(room, _)| *room)
                        .collect();
                    for room in hit {
                        let err = TransferError::PeerDead {
                            rank,
                            detail: format!("data link closed: {reason}"),
                        };
                        self.rooms.handle_write_failed(room, rank, err, t);
                    }
                    self.bound_newest();
                }
            }
        }
    }

    fn command(&mut self, c: Cmd) {
        let t = now();
        match c {
            Cmd::Open(room, reply) => {
                let _ = reply.send(self.rooms.open(room, t));
            }
            Cmd::Fail(room, error) => self.rooms.fail(room, error, t),
            Cmd::Send {
                room,
                layers,
                pages,
                src,
                reply,
            } => {
                let _ = reply.send(self.send(room, layers, pages, &src));
            }
            Cmd::Finish(room, aux, reply) => {
                let r = self.start_writes(room).map(|()| {
                    if let Some(io) = self.io.get_mut(&room) {
                        if !io.ended {
                            io.ended = true;
                            for (rank, d) in &io.dests {
                                if let Some(l) = self.links.get(rank) {
                                    let _ = l.tx(room).send(LinkJob::Finish {
                                        room,
                                        aux: Some((d.aux_slot.0, aux)),
                                        cancel: io.cancel.clone(),
                                    });
                                }
                            }
                        }
                    }
                });
                let _ = reply.send(r);
            }
            Cmd::Poll(room, reply) => {
                let p = match self.rooms.state(room) {
                    Some(s) if !s.is_terminal() => SenderPoll::Pending(s),
                    _ => match self.outcomes.remove(room) {
                        Some(Ok(())) => SenderPoll::Success,
                        Some(Err(e)) => SenderPoll::Failed(e),
                        None => SenderPoll::Unknown,
                    },
                };
                let _ = reply.send(p);
            }
            Cmd::WaitInput(room, reply) => match self.input_state(room) {
                Some(p) => {
                    let _ = reply.send(p);
                }
                None => self.input_waiters.entry(room).or_default().push(reply),
            },
            Cmd::Wait(room, reply) => match self.outcomes.remove(room) {
                Some(Ok(())) => {
                    let _ = reply.send(SenderPoll::Success);
                }
                Some(Err(e)) => {
                    let _ = reply.send(SenderPoll::Failed(e));
                }
                None if self.rooms.state(room).is_some_and(|s| !s.is_terminal()) => {
                    self.waiters.entry(room).or_default().push(reply);
                }
                None => {
                    let _ = reply.send(SenderPoll::Unknown);
                }
            },
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

    /// Move the room to Transferring (compute done) if it is not yet.
    fn start_writes(&mut self, room: RoomId) -> Result<(), TransferError> {
        if !self.io.contains_key(&room) {
            match self.rooms.state(room) {
                Some(RoomState::WaitingForInput) => {
                    self.rooms.handle_compute_done(room, now());
                    self.pump();
                }
                Some(s) => {
                    return Err(TransferError::Internal {
                        reason: format!("room is {}, not ready for writes", s.name()),
                    })
                }
                None => {
                    return Err(TransferError::Internal {
                        reason: "unknown room".into(),
                    })
                }
            }
        }
        if self.io.contains_key(&room) {
            Ok(())
        } else {
            Err(TransferError::Internal {
                reason: "room failed before its writes started".into(),
            })
        }
    }

    fn send(
        &mut self,
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: &[PageIndex],
    ) -> Result<(), TransferError> {
        self.start_writes(room)?;
        let Some(io) = self.io.get(&room) else {
            return Err(TransferError::Internal {
                reason: "room failed".into(),
            });
        };
        if io.ended {
            return Err(TransferError::Internal {
                reason: "room already finished or cancelled".into(),
            });
        }
        // Only the pages this call sends are checked: a room streamed in
        // many calls costs O(pages sent), not O(room) per call.
        let sent = src.get(pages.clone());
        if layers.start > layers.end
            || layers.end > self.layout.geometry.layers
            || sent.is_none_or(|s| s.iter().any(|p| p.0 as usize >= self.layout.num_pages))
        {
            return Err(TransferError::Internal {
                reason: format!(
                    "send of layers {layers:?} pages {pages:?} outside the room or the prefill pool"
                ),
            });
        }
        let span = page_span(&self.layout);
        let max_run = (self.config.max_segment_bytes / span).max(1);
        let mut failed: Vec<(RankId, TransferError)> = Vec::new();
        for (rank, d) in &io.dests {
            let Some(link) = self.links.get(rank) else {
                failed.push((
                    *rank,
                    TransferError::PeerDead {
                        rank: *rank,
                        detail: "no data link to this decode rank".into(),
                    },
                ));
                continue;
            };
            if pages.end > d.pages.len() {
                failed.push((
                    *rank,
                    TransferError::PeerMisbehaved {
                        detail: format!(
                            "destination has {} pages, the room sends {}",
                            d.pages.len(),
                            pages.end
                        ),
                    },
                ));
                continue;
            }
            // Every destination page written is checked against the decode
            // pool before anything is written.
            if let Some(bad) = d.pages[pages.clone()]
                .iter()
                .find(|p| p.0 as usize >= link.dest_pages)
            {
                failed.push((
                    *rank,
                    TransferError::PeerMisbehaved {
                        detail: format!(
                            "destination page {} is outside the decode pool of {} pages",
                            bad.0, link.dest_pages
                        ),
                    },
                ));
                continue;
            }
            let segs = match &link.plan.pair {
                PairPlan::Whole => build_segments(
                    room,
                    &self.layout,
                    link.dest_pages,
                    layers.clone(),
                    pages.clone(),
                    src,
                    &d.pages,
                    max_run,
                ),
                PairPlan::Sliced(slices) => match build_sliced_segments(
                    room,
                    slices,
                    &self.layout,
                    link.plan.decode_heads,
                    link.dest_pages,
                    layers.clone(),
                    pages.clone(),
                    src,
                    &d.pages,
                ) {
                    Ok(segs) => segs,
                    Err(e) => {
                        failed.push((
                            *rank,
                            TransferError::Internal {
                                reason: format!("head-sliced segments: {e}"),
                            },
                        ));
                        continue;
                    }
                },
            };
            let _ = link.tx(room).send(LinkJob::Segments {
                room,
                segs,
                cancel: io.cancel.clone(),
            });
        }
        let t = now();
        for (rank, e) in failed {
            self.rooms.handle_write_failed(room, rank, e, t);
        }
        Ok(())
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

    fn action(&mut self, a: SenderAction) {
        match a {
            SenderAction::StartCompute { .. } => {}
            SenderAction::StartWrites { room, destinations } => {
                self.io.insert(
                    room,
                    RoomIo {
                        dests: destinations,
                        cancel: Arc::new(AtomicBool::new(false)),
                        ended: false,
                    },
                );
            }
            SenderAction::CancelWrites { room } => {
                let t = now();
                let mut orphans = Vec::new();
                if let Some(io) = self.io.get_mut(&room) {
                    io.cancel.store(true, Ordering::Release);
                    // A room whose end was already queued will be acked; a
                    // room without one gets a cancelled end now.
                    for (rank, _) in &io.dests {
                        match self.links.get(rank) {
                            Some(l) if !io.ended => {
                                let _ = l.tx(room).send(LinkJob::Finish {
                                    room,
                                    aux: None,
                                    cancel: io.cancel.clone(),
                                });
                            }
                            Some(_) => {}
                            None => orphans.push(*rank),
                        }
                    }
                    io.ended = true;
                }
                for rank in orphans {
                    let err = TransferError::PeerDead {
                        rank,
                        detail: "no data link".into(),
                    };
                    self.rooms.handle_write_failed(room, rank, err, t);
                }
            }
            SenderAction::Finished { room, result } => {
                self.io.remove(&room);
                match self.waiters.remove(&room) {
                    Some(waiters) => {
                        let p = match result {
                            Ok(()) => SenderPoll::Success,
                            Err(e) => SenderPoll::Failed(e),
                        };
                        for w in waiters {
                            let _ = w.send(p.clone());
                        }
                    }
                    None => {
                        let ttl = now() + self.config.rooms.timers.get(Timer::UnknownRoomTtl);
                        self.outcomes.insert(room, result, ttl);
                    }
                }
            }
        }
    }
}

/// Coalesce (layer, page) spans into runs contiguous on both sides.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build_segments(
    room: RoomId,
    layout: &KvLayout,
    dest_pages: usize,
    layers: Range<usize>,
    pages: Range<usize>,
    src: &[PageIndex],
    dst: &[handoff_proto::PageIndex],
    max_run: usize,
) -> Vec<Segment> {
    let span = page_span(layout);
    let mut out = Vec::new();
    for layer in layers {
        let mut i = pages.start;
        while i < pages.end {
            let (s0, d0) = (src[i].0 as usize, dst[i].0 as usize);
            let mut n = 1;
            while i + n < pages.end
                && n < max_run
                && src[i + n].0 as usize == s0 + n
                && dst[i + n].0 as usize == d0 + n
            {
                n += 1;
            }
            let s = span_offset(layout, layout.num_pages, layer, s0);
            let d = span_offset(layout, dest_pages, layer, d0);
            out.push(Segment {
                header: SegmentHeader {
                    room,
                    layer: layer as u32,
                    dst_page: d0 as u32,
                    n_pages: n as u32,
                    heads: None,
                },
                src: s..s + n * span,
                dst: d..d + n * span,
            });
            i += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_kv::{KvDtype, KvGeometry};

    fn layout(pages: usize) -> KvLayout {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 1,
            head_dim: 2,
            page_size: 2,
            dtype: KvDtype::F32,
        };
        match KvLayout::new(g, pages) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    fn dst(p: &[u32]) -> Vec<handoff_proto::PageIndex> {
        p.iter().map(|x| handoff_proto::PageIndex(*x)).collect()
    }

    #[test]
    fn runs_contiguous_on_both_sides_coalesce_per_layer() {
        let l = layout(16);
        let span = page_span(&l);
        let room = RoomId::new(5).unwrap();
        let src: Vec<PageIndex> = [3, 4, 5, 9, 10].into_iter().map(PageIndex).collect();
        // Destination breaks the second run: 7, 8 | 2, 3 | 12.
        let d = dst(&[6, 7, 8, 2, 3]);
        let segs = build_segments(room, &l, 32, 0..2, 0..5, &src, &d, 64);
        let shape: Vec<(u32, u32, u32)> = segs
            .iter()
            .map(|s| (s.header.layer, s.header.dst_page, s.header.n_pages))
            .collect();
        assert_eq!(
            shape,
            vec![(0, 6, 3), (0, 2, 2), (1, 6, 3), (1, 2, 2)],
            "runs split where either side breaks"
        );
        // Byte ranges follow each pool's own page count.
        assert_eq!(
            segs[0].src,
            span_offset(&l, 16, 0, 3)..span_offset(&l, 16, 0, 3) + 3 * span
        );
        assert_eq!(
            segs[2].dst,
            span_offset(&l, 32, 1, 6)..span_offset(&l, 32, 1, 6) + 3 * span
        );
        // A run limit splits long runs; a page range sends only its pages.
        let capped = build_segments(room, &l, 32, 0..1, 0..3, &src, &d, 2);
        assert_eq!(
            capped.iter().map(|s| s.header.n_pages).collect::<Vec<_>>(),
            vec![2, 1]
        );
        let tail = build_segments(room, &l, 32, 1..2, 3..5, &src, &d, 64);
        assert_eq!(tail.len(), 1);
        assert_eq!((tail[0].header.dst_page, tail[0].header.n_pages), (2, 2));
    }
}
