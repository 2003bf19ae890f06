//! The decode driver task: the I/O shell around [`ReceiverEndpoint`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use handoff_kv::{KvLayout, PageLease, ShmRegion};
use handoff_proto::datalink::stream_of;
use handoff_proto::message::Message;
use handoff_proto::receiver_endpoint::{ReceiverEndpoint, ReceiverEvent};
use handoff_proto::{PageIndex, PeerId, RoomId};
use tokio::sync::{mpsc, oneshot};

use super::commands::{Cmd, Ev, NewLink, Waiter};
use super::config::ReceiverConfig;
use crate::conn::{CtlEvent, TaskCounter};
use crate::link::{LinkCounters, LinkReader, ReaderCmd, ReaderEvent};
use crate::stats::EndpointStats;

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
pub(super) struct Driver {
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
}

fn now() -> std::time::Instant {
    std::time::Instant::now()
}

impl Driver {
    /// The driver of an endpoint set up by `config`, for the decode pool
    /// `pool` laid out as `layout`; `self_tx` reaches its own event queue.
    pub(super) fn new(
        config: &ReceiverConfig,
        tasks: TaskCounter,
        pool: Arc<ShmRegion>,
        layout: KvLayout,
        self_tx: mpsc::WeakUnboundedSender<Ev>,
    ) -> Self {
        Self {
            endpoint: ReceiverEndpoint::new(
                config.rooms.clone(),
                config.handshake.fingerprint.clone(),
                config.handshake_timeout,
            ),
            ctl: HashMap::new(),
            links: HashMap::new(),
            control_waiters: HashMap::new(),
            counters: Arc::new(LinkCounters::default()),
            tasks,
            pool,
            layout,
            next_link: 0,
            self_tx,
        }
    }

    pub(super) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Ev>) {
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
            } => self.endpoint.handle_aux(room, written_room, aux, prompt),
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
            Cmd::Submit(room, sources, reply) => {
                let (tx, rx) = oneshot::channel();
                let r = self.endpoint.open(room, sources, tx, t).map(|()| rx);
                let opened = r.is_ok();
                if reply.send(r.map_err(Into::into)).is_err() && opened {
                    self.endpoint.abort(room, crate::error::client_gone(), t);
                }
            }
            Cmd::Refuse(room, sources, error) => {
                // A room known here (live or ended) stays as it is.
                // Nobody hears its end: the sink's receiver is dropped here.
                let (sink, _) = oneshot::channel();
                if self.endpoint.state(room).is_none()
                    && self.endpoint.open(room, sources, sink, t).is_ok()
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
                    stalled_reads: self.counters.stalled_reads.load(Ordering::Relaxed),
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
                ReceiverEvent::Released { .. } => {}
                ReceiverEvent::Outcome {
                    room,
                    waiter,
                    outcome,
                } => outcomes.push((room, waiter, outcome)),
            }
        }
        while let Some(tr) = self.endpoint.poll_transmit(t) {
            if let Some(tx) = self.ctl.get(&tr.to) {
                let _ = tx.send(tr.message);
            }
        }
        // Outcomes last (see the sender's `flush`).
        // An outcome whose room handle is gone is dropped with the
        // channel (a lease in it returns its pages).
        for (_, waiter, outcome) in outcomes {
            let _ = waiter.send(outcome);
        }
    }
}
