//! The prefill driver task: the I/O shell around [`SenderEndpoint`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use handoff_kv::KvLayout;
use handoff_proto::datalink::stream_of;
use handoff_proto::message::Message;
use handoff_proto::sender_endpoint::{SenderEndpoint, SenderEvent};
use handoff_proto::{PeerId, RoomId};
use tokio::sync::mpsc;

use super::commands::{Cmd, Ev, Reply};
use super::config::SenderConfig;
use crate::conn::{CtlEvent, TaskCounter};
use crate::link::{AcceptedLink, LinkCounters, LinkEvent, LinkJob};
use crate::plan::LinkPlan;
use crate::stats::EndpointStats;

mod send;

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
pub(super) struct Driver {
    config: SenderConfig,
    layout: KvLayout,
    endpoint: SenderEndpoint<AcceptedLink, Reply, Arc<AtomicBool>>,
    ctl: HashMap<PeerId, (u64, mpsc::UnboundedSender<Message>)>,
    links: HashMap<PeerId, Link>,
    counters: Arc<LinkCounters>,
    tasks: TaskCounter,
    next_link: u64,
}

fn now() -> std::time::Instant {
    std::time::Instant::now()
}

impl Driver {
    /// The driver of an endpoint set up by `config` for a pool laid out as
    /// `layout`.
    pub(super) fn new(
        config: SenderConfig,
        layout: KvLayout,
        counters: Arc<LinkCounters>,
        tasks: TaskCounter,
    ) -> Self {
        Self {
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
            tasks,
            next_link: 0,
        }
    }

    pub(super) async fn run(
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
                Ev::Accepted(l, endpoint, connect) => {
                    self.endpoint.confirm_peer(endpoint);
                    self.accepted(*l, connect, &self_tx)
                }
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
            Cmd::Submit(room, reply) => {
                let cancel = Arc::new(AtomicBool::new(false));
                let (tx, rx) = mpsc::unbounded_channel();
                let r = self.endpoint.open(room, cancel, tx, t).map(|()| rx);
                let opened = r.is_ok();
                if reply.send(r).is_err() && opened {
                    self.endpoint.fail(room, crate::error::prefill_dropped(), t);
                }
            }
            Cmd::Fail(room, error) => self.endpoint.fail(room, error, t),
            Cmd::Refuse(room, error) => {
                // A room known here (live or ended) stays as it is.
                // Nobody hears its end: the sink's receiver is dropped here.
                let cancel = Arc::new(AtomicBool::new(false));
                let (sink, _) = mpsc::unbounded_channel();
                if self.endpoint.state(room).is_none()
                    && self.endpoint.open(room, cancel, sink, t).is_ok()
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
                let r = self
                    .endpoint
                    .finish(room, aux, prompt, t)
                    .map_err(Into::into);
                // The writers get the room's end before the caller hears back
                // (waking the caller first delays the writer).
                self.flush();
                let _ = reply.send(r);
            }
            Cmd::PeerId(endpoint, reply) => {
                let _ = reply.send(self.endpoint.peer_id(endpoint));
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
                    malformed_frames: s.malformed_frames
                        + self.counters.malformed_frames.load(Ordering::Relaxed),
                    rejected_segments: self.counters.rejected_segments.load(Ordering::Relaxed),
                    handshakes_failed: s.handshakes_failed
                        + self.counters.handshakes_failed.load(Ordering::Relaxed),
                    tasks: 0,
                    stalled: s.stalled,
                    kv_bytes_sent: self.counters.kv_bytes_sent.load(Ordering::Relaxed),
                    stalled_reads: 0,
                });
            }
            Cmd::Shutdown => {}
        }
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
                    prompt,
                    cancel,
                } => {
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
                SenderEvent::Room { sink, event } => answers.push((sink, event)),
            }
        }
        let t = now();
        while let Some(tr) = self.endpoint.poll_transmit(t) {
            if let Some((_, tx)) = self.ctl.get(&tr.to) {
                let _ = tx.send(tr.message);
            }
        }
        for (sink, event) in answers {
            let _ = sink.send(event);
        }
    }
}
