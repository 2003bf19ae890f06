//! The prefill side: [`KvSender`], a cheap handle
//! around one driver task (TGI's queue shape: commands in, state inside one
//! task, replies on oneshots). The driver is the I/O shell of a
//! [`SenderEndpoint`], which owns the rooms, heartbeats, connect admission
//! and link assembly; the driver holds the sockets' and tasks' handles only.
//!
//! An engine calls [`KvSender::submit`] when it accepts a request and drives
//! the returned [`SenderRoom`]: `ready` (every decode destination arrived:
//! compute may start), then `send` (a range of layers and pages, so
//! layer-by-layer streaming works), `finish` (aux record) and `outcome`.
//! [`KvSender::refuse`] fails a room it never took; its reason and status
//! reach every decode peer. The lower-level `open` / `poll` / `wait` calls
//! remain for tests and the transfer benchmark.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_kv::{KvLayout, PageIndex, ShmRegion};
use handoff_proto::datalink::{
    decode_preface, stream_of, AuxData, SegmentHeader, PREFACE_CONTROL, PREFACE_DATA, PREFACE_LEN,
};
use handoff_proto::handshake::HandshakeConfig;
use handoff_proto::message::Message;
use handoff_proto::rank::PairPlan;
use handoff_proto::room::RoomConfig;
use handoff_proto::sender_endpoint::{SendRefused, SenderEndpoint, SenderEvent};
use handoff_proto::{PeerId, RoomId, TransferError};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::conn::{run_control, CtlEvent, TaskCounter};
use crate::error::TransportError;
use crate::link::{
    accept_link, page_span, span_offset, AcceptedLink, LinkCounters, LinkEvent, LinkJob,
};
use crate::plan::{build_sliced_segments, LinkPlan};
use crate::room_handle::SenderRoom;
use crate::transport::Segment;
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

pub use handoff_proto::sender_endpoint::SenderPoll;

/// Where an answer goes: one reply, or a room's event stream.
enum Reply {
    Once(oneshot::Sender<SenderPoll>),
    Stream(mpsc::UnboundedSender<SenderPoll>),
}

impl Reply {
    fn send(self, poll: SenderPoll) {
        match self {
            Reply::Once(tx) => drop(tx.send(poll)),
            Reply::Stream(tx) => drop(tx.send(poll)),
        }
    }
}

type RoomEvents = mpsc::UnboundedReceiver<SenderPoll>;

enum Cmd {
    Open(RoomId, oneshot::Sender<Result<(), TransferError>>),
    Submit(RoomId, oneshot::Sender<Result<RoomEvents, TransferError>>),
    Fail(RoomId, TransferError),
    Refuse(RoomId, TransferError),
    Send {
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: Arc<[PageIndex]>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Finish(
        RoomId,
        AuxData,
        Arc<[(u32, f32)]>,
        oneshot::Sender<Result<(), TransferError>>,
    ),
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
            endpoint: SenderEndpoint::new(
                config.rooms.clone(),
                layout.geometry.layers,
                layout.geometry.page_size,
            ),
            config,
            layout,
            ctl: HashMap::new(),
            links: HashMap::new(),
            counters,
            tasks: tasks.clone(),
            next_link: 0,
            finishing: None,
        };
        tasks.spawn(driver.run(rx, accept));
        Ok(KvSender { tx, addr, tasks })
    }

    /// Where decode peers connect (the bootstrap address of this peer).
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

    /// Accept a request for `room` and own it: the returned
    /// [`SenderRoom`] says when compute may start and how the room ended,
    /// on one event stream, and fails the room if dropped before its end.
    /// Fails like [`Self::open`]. Cancel-safe: a room opened for a caller
    /// that is gone is failed by the driver.
    pub async fn submit(&self, room: RoomId) -> Result<SenderRoom, TransportError> {
        let events = self.ask(|r| Cmd::Submit(room, r)).await??;
        Ok(SenderRoom::new(self.clone(), room, events))
    }

    /// Fail `room` here (validation rejection, engine error): every decode
    /// destination learns `error`'s reason and status.
    pub fn fail(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Fail(room, error)));
    }

    /// Refuse a request for `room` that never reaches [`Self::submit`] (it
    /// failed validation): the room is opened and failed at once, so every
    /// decode destination learns `error`. A room decode already aborted
    /// stays as it is.
    pub fn refuse(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Refuse(room, error)));
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
        self.finish_scored(room, aux, Arc::from([])).await
    }

    /// [`Self::finish`] with the room's prompt scores (flat (token,
    /// log-probability) pairs), sent ahead of the aux record.
    pub async fn finish_scored(
        &self,
        room: RoomId,
        aux: AuxData,
        prompt: Arc<[(u32, f32)]>,
    ) -> Result<(), TransportError> {
        Ok(self.ask(|r| Cmd::Finish(room, aux, prompt, r)).await??)
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
                        peer,
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
    ids: HashMap<u64, (PeerId, bool)>,
    unconfirmed: std::collections::VecDeque<u64>,
    confirmed: std::collections::VecDeque<u64>,
    next: u32,
}

/// Most ids kept for endpoints that never completed a handshake.
const MAX_UNCONFIRMED: usize = 4096;
/// Most ids kept for endpoints that did.
const MAX_CONFIRMED: usize = 65_536;

impl PeerIds {
    fn assign(&self, endpoint: u64) -> PeerId {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *g;
        if let Some((r, _)) = t.ids.get(&endpoint) {
            return *r;
        }
        let r = PeerId(t.next);
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

/// The I/O handles of one data link to a decode peer: one writer per
/// stream.
struct Link {
    id: u64,
    streams: Vec<mpsc::UnboundedSender<LinkJob>>,
    /// Whole spans, or the head slices this decode peer takes from us.
    plan: LinkPlan,
}

impl Link {
    /// The writer of the stream that carries `room`.
    fn tx(&self, room: RoomId) -> &mpsc::UnboundedSender<LinkJob> {
        &self.streams[stream_of(room, self.streams.len())]
    }
}

/// The prefill driver: the I/O shell around [`SenderEndpoint`], which owns
/// every decision; this only holds the sockets' and tasks' handles.
/// A room's prompt scores: flat (token, log-probability) pairs.
type Scores = Arc<[(u32, f32)]>;

struct Driver {
    config: SenderConfig,
    layout: KvLayout,
    endpoint: SenderEndpoint<AcceptedLink, Reply, Arc<AtomicBool>>,
    ctl: HashMap<PeerId, (u64, mpsc::UnboundedSender<Message>)>,
    links: HashMap<PeerId, Link>,
    counters: Arc<LinkCounters>,
    tasks: TaskCounter,
    next_link: u64,
    /// The prompt scores of the room being finished, for its aux-bearing
    /// finish job.
    finishing: Option<(RoomId, Scores)>,
}

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
            let sleep = wakeup.until(self.endpoint.poll_timeout());
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                ev = self_rx.recv() => ev,
                _ = sleep => {
                    for dead in self.endpoint.handle_timeout(now()) {
                        tracing::warn!(peer = dead.0, "decode peer missed heartbeats");
                    }
                    self.flush();
                    continue;
                }
            };
            let Some(ev) = ev else { break };
            match ev {
                Ev::Cmd(Cmd::Shutdown) => break,
                Ev::Cmd(c) => self.command(c),
                Ev::Ctl(e, connect) => self.control(e, connect),
                Ev::Link(e) => self.link_event(e),
                Ev::Accepted(l, connect) => self.accepted(*l, connect, &self_tx),
            }
            self.flush();
        }
        accept.abort();
        self.endpoint.shutdown();
        self.flush();
        self.ctl.clear();
        self.links.clear();
    }

    /// A data link stream was accepted: the link starts once the endpoint
    /// has all its streams (a stream of a connect older than the newest is
    /// dropped, closing its socket).
    fn accepted(&mut self, l: AcceptedLink, connect: u64, self_tx: &mpsc::UnboundedSender<Ev>) {
        let (peer, st) = (l.peer, l.stream);
        let Some(streams) = self.endpoint.handle_link_stream(
            peer,
            connect,
            (st.nonce, st.index, st.count),
            l,
            now(),
        ) else {
            return;
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
            peer,
            Link {
                id,
                streams: txs,
                plan,
            },
        );
        self.endpoint.handle_link_up(peer, id, dest_pages);
    }

    fn control(&mut self, e: CtlEvent, connect: u64) {
        let t = now();
        match e {
            CtlEvent::Established { conn, peer, tx, .. } => {
                if self.endpoint.handle_control_up(peer, conn, connect, t) {
                    self.ctl.insert(peer, (conn, tx));
                }
                // else: a cancelled connect's control connection, completed
                // late: dropping `tx` closes it.
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

    fn link_event(&mut self, e: LinkEvent) {
        let t = now();
        match e {
            LinkEvent::Acked { peer, ack, .. } => {
                self.endpoint.handle_ack(peer, ack.room, ack.ok, t)
            }
            LinkEvent::Closed { peer, link, reason } => {
                self.endpoint.handle_link_closed(peer, link, &reason, t)
            }
        }
    }

    fn command(&mut self, c: Cmd) {
        let t = now();
        match c {
            Cmd::Open(room, reply) => {
                let cancel = Arc::new(AtomicBool::new(false));
                let _ = reply.send(self.endpoint.open(room, cancel, t));
            }
            Cmd::Submit(room, reply) => {
                let cancel = Arc::new(AtomicBool::new(false));
                let r = self.endpoint.open(room, cancel, t).map(|()| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    self.endpoint.wait_input(room, Reply::Stream(tx.clone()));
                    self.endpoint.wait(room, Reply::Stream(tx));
                    rx
                });
                let opened = r.is_ok();
                if reply.send(r).is_err() && opened {
                    self.endpoint.fail(room, SenderRoom::gone(), t);
                }
            }
            Cmd::Fail(room, error) => self.endpoint.fail(room, error, t),
            Cmd::Refuse(room, error) => {
                // A room known here (live or ended) stays as it is.
                let cancel = Arc::new(AtomicBool::new(false));
                if self.endpoint.state(room).is_none()
                    && self.endpoint.open(room, cancel, t).is_ok()
                {
                    self.endpoint.fail(room, error, t);
                }
            }
            Cmd::Send {
                room,
                layers,
                pages,
                src,
                reply,
            } => {
                let _ = reply.send(self.send(room, layers, pages, &src));
            }
            Cmd::Finish(room, aux, prompt, reply) => {
                // The endpoint emits the room's finish jobs at once: the
                // one that carries the aux takes the prompt scores.
                self.finishing = Some((room, prompt));
                let r = self.endpoint.finish(room, aux, t).map_err(Into::into);
                // The writers get the room's end before the caller hears back
                // (waking the caller first delays the writer).
                self.flush();
                self.finishing = None;
                let _ = reply.send(r);
            }
            Cmd::Poll(room, reply) => {
                let _ = reply.send(self.endpoint.poll(room));
            }
            Cmd::WaitInput(room, reply) => self.endpoint.wait_input(room, Reply::Once(reply)),
            Cmd::Wait(room, reply) => self.endpoint.wait(room, Reply::Once(reply)),
            Cmd::Stats(reply) => {
                let s = self.endpoint.stats();
                let _ = reply.send(EndpointStats {
                    live_rooms: s.live_rooms,
                    peers: s.peers_ranks.len(),
                    peers_ranks: s.peers_ranks,
                    links: self.links.len(),
                    link_streams: self.links.values().map(|l| l.streams.len()).sum(),
                    room_stats: s.room_stats,
                    malformed_frames: s.malformed_frames
                        + self.counters.malformed_frames.load(Ordering::Relaxed),
                    rejected_segments: self.counters.rejected_segments.load(Ordering::Relaxed),
                    handshakes_failed: s.handshakes_failed
                        + self.counters.handshakes_failed.load(Ordering::Relaxed),
                    tasks: 0,
                    stalled: s.stalled,
                    kv_bytes_sent: self.counters.kv_bytes_sent.load(Ordering::Relaxed),
                });
            }
            Cmd::Shutdown => {}
        }
    }

    /// Check the source pages, let the endpoint check the room and its
    /// destinations, then queue each destination's segments on its link.
    fn send(
        &mut self,
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: &[PageIndex],
    ) -> Result<(), TransferError> {
        // Only the pages this call sends are checked: a room streamed in
        // many calls costs O(pages sent), not O(room) per call.
        let sent = src.get(pages.clone());
        if sent.is_none_or(|s| s.iter().any(|p| p.0 as usize >= self.layout.num_pages)) {
            return Err(SendRefused::OutOfRange { layers, pages }.into());
        }
        let (dests, cancel) = self
            .endpoint
            .send(room, layers.clone(), pages.clone(), now())?;
        let span = page_span(&self.layout);
        let max_run = (self.config.max_segment_bytes / span).max(1);
        for w in dests {
            let (peer, d, dest_pages) = (w.peer, w.destination, w.dest_pool_pages);
            let Some(link) = self.links.get(&peer) else {
                continue; // the endpoint knows of no link either
            };
            // Room page `i` goes to destination page `i - skip`.
            let (src, pages) = (&src[w.skip..], w.pages.start - w.skip..w.pages.end - w.skip);
            let segs = match &link.plan.pair {
                PairPlan::Whole => build_segments(
                    room,
                    &self.layout,
                    dest_pages,
                    layers.clone(),
                    pages,
                    src,
                    &d.pages,
                    max_run,
                ),
                PairPlan::Sliced(slices) => match build_sliced_segments(
                    room,
                    slices,
                    &self.layout,
                    link.plan.decode_heads,
                    dest_pages,
                    layers.clone(),
                    pages,
                    src,
                    &d.pages,
                ) {
                    Ok(segs) => segs,
                    Err(e) => {
                        let err = TransferError::Internal {
                            reason: format!("head-sliced segments: {e}"),
                        };
                        self.endpoint.handle_write_failed(room, peer, err, now());
                        continue;
                    }
                },
            };
            let bytes: usize = segs.iter().map(|s| s.src.len()).sum();
            self.counters
                .kv_bytes_sent
                .fetch_add(bytes as u64, Ordering::Relaxed);
            let _ = link.tx(room).send(LinkJob::Segments {
                room,
                segs,
                cancel: cancel.clone(),
            });
        }
        Ok(())
    }

    /// Do what the endpoint decided, send its control messages, then answer
    /// waiters (last, as before the endpoint existed: a task woken last
    /// runs first on tokio's worker, and the waiter is the one a latency
    /// counts on).
    fn flush(&mut self) {
        let mut answers = Vec::new();
        while let Some(e) = self.endpoint.poll_event() {
            match e {
                SenderEvent::Finish {
                    peer,
                    room,
                    aux,
                    cancel,
                } => {
                    let prompt = match (&aux, &self.finishing) {
                        (Some(_), Some((r, p))) if *r == room => p.clone(),
                        _ => Arc::from([]),
                    };
                    if let Some(l) = self.links.get(&peer) {
                        let _ = l.tx(room).send(LinkJob::Finish {
                            room,
                            aux,
                            prompt,
                            cancel,
                        });
                    }
                }
                SenderEvent::Cancel { cancel, .. } => cancel.store(true, Ordering::Release),
                SenderEvent::ClosePeer {
                    peer,
                    control,
                    link,
                } => {
                    // Dropping the handles closes the sockets: the writers
                    // finish the job in hand and stop.
                    if control.is_some() && self.ctl.get(&peer).map(|(c, _)| *c) == control {
                        self.ctl.remove(&peer);
                    }
                    if link.is_some() && self.links.get(&peer).map(|l| l.id) == link {
                        self.links.remove(&peer);
                    }
                }
                SenderEvent::Answer { waiter, poll } => answers.push((waiter, poll)),
            }
        }
        let t = now();
        while let Some(tr) = self.endpoint.poll_transmit(t) {
            if let Some((_, tx)) = self.ctl.get(&tr.to) {
                let _ = tx.send(tr.message);
            }
        }
        for (waiter, poll) in answers {
            waiter.send(poll);
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
                src_pages: s0 as u32..(s0 + n) as u32,
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
