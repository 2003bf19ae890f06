//! The prefill endpoint, sans-IO: one owner
//! for everything prefill knows about its rooms and its decode peers.
//!
//! [`SenderEndpoint`] owns the room table ([`SenderRooms`]), peer liveness,
//! which connect of each decode endpoint is the newest (a connect that
//! decode cancelled but that completes late here never replaces a newer
//! one), the assembly of multi-stream data links, each room's destinations
//! and whether its writes ended or were cancelled, and each room's event
//! sink. It is generic over the link stream
//! type `S` (the shell's accepted socket), the event sink `W` (the room
//! handle's channel) and the per-room cancel token `C` (the flag the
//! shell's link writers check), so nothing here does I/O: time is passed
//! in, control messages come out of [`SenderEndpoint::poll_transmit`] and
//! everything else the shell must do out of [`SenderEndpoint::poll_event`].
//!
//! Segment building stays with the shell (it owns the KV layout): a
//! [`SenderEndpoint::send`] checks the room and each destination and
//! returns the destinations to write; a destination the shell cannot write
//! is reported with [`SenderEndpoint::handle_write_failed`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::datalink::AuxData;
use crate::error::{Misbehavior, TransferError};
use crate::heartbeat::Liveness;
use crate::ids::{PeerId, RoomId};
use crate::message::{Destination, Message};
use crate::peer_ids::PeerIds;
use crate::room::{RoomConfig, RoomState, RoomStats, Transmit};
use crate::sender_room::{SenderAction, SenderRooms};

/// Decode peers whose newest connect number is kept even with nothing left
/// of them.
const MAX_NEWEST: usize = 4096;

/// What a prefill room's event sink hears (see [`SenderEndpoint::open`]):
/// `Ready` at most once, then its end, once.
#[derive(Debug, Clone, PartialEq)]
pub enum SenderRoomEvent {
    /// Every destination arrived: compute may start.
    Ready,
    /// Every destination has all KV and aux.
    Success,
    /// Failed (the room is released).
    Failed(TransferError),
}

/// What the prefill shell must do, besides sending control messages.
#[derive(Debug)]
pub enum SenderEvent<W, C> {
    /// No more writes for `room` on the data link to `peer`: queue the aux
    /// record (or none, for cancelled writes), then the room's end marker.
    Finish {
        /// The decode peer.
        peer: PeerId,
        /// The room.
        room: RoomId,
        /// The aux slot and data; `None` when the writes were cancelled.
        aux: Option<(u32, AuxData)>,
        /// The room's prompt scores (flat (token, log-probability) pairs),
        /// sent ahead of the aux record; empty without an aux.
        prompt: std::sync::Arc<[(u32, f32)]>,
        /// The room's cancel token.
        cancel: C,
    },
    /// The room's writes are cancelled: raise its cancel token, so queued
    /// segments are skipped.
    Cancel {
        /// The room.
        room: RoomId,
        /// Its cancel token.
        cancel: C,
    },
    /// Drop the I/O handles of `peer`'s control connection `control` and
    /// data link `link` (where the shell's current ones have these ids).
    ClosePeer {
        /// The decode peer.
        peer: PeerId,
        /// Its control connection, if one is to close.
        control: Option<u64>,
        /// Its data link, if one is to close.
        link: Option<u64>,
    },
    /// An event of a room, for its sink.
    Room {
        /// The room's sink.
        sink: W,
        /// What happened.
        event: SenderRoomEvent,
    },
}

/// Why a call of the engine's was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendRefused {
    /// The room is not ready for writes (still waiting for destinations, or
    /// draining).
    #[error("room is {0}, not ready for writes")]
    NotReady(&'static str),
    /// No such live room.
    #[error("unknown room")]
    UnknownRoom,
    /// The room failed before its writes started.
    #[error("room failed before its writes started")]
    FailedBeforeWrites,
    /// The room's writes already ended (finished or cancelled).
    #[error("room already finished or cancelled")]
    Ended,
    /// Layers or pages outside the room or the prefill pool.
    #[error("send of layers {layers:?} pages {pages:?} outside the room or the prefill pool")]
    OutOfRange {
        /// Layers asked for.
        layers: Range<usize>,
        /// Pages asked for.
        pages: Range<usize>,
    },
}

impl From<SendRefused> for TransferError {
    /// A room that failed before its writes is a race with the room's end
    /// (internal); every other refusal is a misuse of this API.
    fn from(e: SendRefused) -> Self {
        match e {
            SendRefused::FailedBeforeWrites => TransferError::Internal {
                reason: e.to_string(),
            },
            other => TransferError::ApiMisuse {
                reason: other.to_string(),
            },
        }
    }
}

/// Counters and gauges of a prefill endpoint.
#[derive(Debug, Clone, Default)]
pub struct SenderStats {
    /// Live rooms (Draining included).
    pub live_rooms: usize,
    /// Peers with an established control connection.
    pub peers_ranks: Vec<PeerId>,
    /// Peers with a data link up.
    pub links: usize,
    /// Peers with a multi-stream link partly accepted.
    pub pending_links: usize,
    /// The room table's counters.
    pub room_stats: RoomStats,
    /// Malformed control frames counted and dropped.
    pub malformed_frames: u64,
    /// Control handshakes refused.
    pub handshakes_failed: u64,
    /// How much later than due the shell woke us, in all.
    pub stalled: Duration,
    /// Rooms whose writes started.
    pub writing_rooms: usize,
    /// Rooms with an event sink (live rooms).
    pub sinks: usize,
}

/// What prefill knows of one decode peer.
#[derive(Debug)]
struct Peer<S> {
    /// The id of its established control connection.
    control: Option<u64>,
    /// Its data link: the shell's id and the decode pool's page count.
    link: Option<(u64, usize)>,
    /// A multi-stream link partly accepted: its nonce and streams so far.
    pending: Option<(u64, Vec<Option<S>>)>,
}

impl<S> Default for Peer<S> {
    fn default() -> Self {
        Self {
            control: None,
            link: None,
            pending: None,
        }
    }
}

impl<S> Peer<S> {
    fn is_empty(&self) -> bool {
        self.control.is_none() && self.link.is_none() && self.pending.is_none()
    }
}

/// What one [`SenderEndpoint::send`] writes to one destination.
#[derive(Debug, Clone)]
pub struct DestWrite {
    /// The decode peer.
    pub peer: PeerId,
    /// Its destination for the room.
    pub destination: Arc<Destination>,
    /// Pages in that peer's pool (from its data link).
    pub dest_pool_pages: usize,
    /// Room pages to write (a sub-range of the call's: those past the
    /// destination's cached prefix).
    pub pages: Range<usize>,
    /// Pages of the cached prefix: room page `i` goes to
    /// `destination.pages[i - skip]`.
    pub skip: usize,
}

/// A room whose writes started.
#[derive(Debug)]
struct Writing<C> {
    destinations: Vec<(PeerId, Arc<Destination>)>,
    cancel: C,
    cancelled: bool,
    ended: bool,
}

/// The prefill endpoint: see the module docs.
#[derive(Debug)]
pub struct SenderEndpoint<S, W, C> {
    rooms: SenderRooms,
    liveness: Liveness,
    peers: HashMap<PeerId, Peer<S>>,
    /// Per decode peer seen, the newest connect number.
    newest: HashMap<PeerId, u64>,
    /// Decode endpoint ids → the peer ids they go by here.
    peer_ids: PeerIds,
    /// Rooms opened but not yet writing: their cancel tokens.
    tokens: HashMap<RoomId, C>,
    writing: HashMap<RoomId, Writing<C>>,
    /// Each live room's event sink (the engine's room handle): it hears
    /// when the room leaves `Bootstrapping`, then how it ended.
    sinks: HashMap<RoomId, W>,
    /// Rooms whose sink has not yet heard that they left `Bootstrapping`.
    awaiting_input: HashSet<RoomId>,
    events: VecDeque<SenderEvent<W, C>>,
    /// Layers of the prefill pool.
    layers: usize,
    /// Tokens per page (a destination's cached prefix is whole pages).
    page_size: usize,
    malformed_frames: u64,
    handshakes_failed: u64,
}

impl<S, W: Clone, C: Clone> SenderEndpoint<S, W, C> {
    /// An endpoint with room limits and timers `config` over a prefill pool
    /// of `layers` layers and `page_size` tokens per page.
    pub fn new(config: RoomConfig, layers: usize, page_size: usize) -> Self {
        Self {
            liveness: Liveness::new(config.timers),
            rooms: SenderRooms::new(config),
            peers: HashMap::new(),
            newest: HashMap::new(),
            peer_ids: PeerIds::default(),
            tokens: HashMap::new(),
            writing: HashMap::new(),
            sinks: HashMap::new(),
            awaiting_input: HashSet::new(),
            events: VecDeque::new(),
            layers,
            page_size: page_size.max(1),
            malformed_frames: 0,
            handshakes_failed: 0,
        }
    }

    // ----- peer identity -----

    /// The peer id of the decode endpoint whose connection's preface named
    /// `endpoint` (assigned before any handshake: kept among a bounded set
    /// of unconfirmed ids until a data link of it authenticates).
    pub fn peer_id(&mut self, endpoint: u64) -> PeerId {
        self.peer_ids.assign(endpoint)
    }

    /// A data link of decode endpoint `endpoint` passed its handshake: its
    /// id is kept (no flood of unauthenticated prefaces evicts it).
    pub fn confirm_peer(&mut self, endpoint: u64) {
        self.peer_ids.confirm(endpoint);
    }

    // ----- what the shell drains -----

    /// The next control message to send. Call after every other call.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        self.rooms
            .poll_transmit()
            .or_else(|| self.liveness.poll_transmit(now))
    }

    /// The next thing the shell must do (see [`SenderEvent`]). Call after
    /// every other call, until `None`.
    pub fn poll_event(&mut self) -> Option<SenderEvent<W, C>> {
        self.events.pop_front()
    }

    /// When to call [`Self::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.rooms
            .poll_timeout()
            .into_iter()
            .chain(self.liveness.poll_timeout())
            .min()
    }

    /// Deadlines that passed: rooms fail, silent peers are
    /// declared dead (their connections go, their rooms fail).
    /// Returns the peers declared dead.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<PeerId> {
        self.rooms.handle_timeout(now);
        let dead = self.liveness.handle_timeout(now);
        for &peer in &dead {
            self.drop_peer(peer, now);
        }
        self.drive(now);
        dead
    }

    // ----- what the sockets report -----

    /// Whether a connection of decode's connect `connect` may join what
    /// `peer` has. Not when a newer connect of that endpoint was seen (a
    /// connect cancelled on decode, completing late here). A newer connect
    /// replaces the older one: its control connection and data link go and
    /// its rooms fail, so no peer is left with the control connection of
    /// one connect and the data link of another.
    fn admit(&mut self, peer: PeerId, connect: u64, now: Instant) -> bool {
        match self.newest.get(&peer) {
            Some(&newest) if newest > connect => return false,
            Some(&newest) if newest == connect => return true,
            _ => {}
        }
        if self.peers.get(&peer).is_some_and(|p| !p.is_empty()) {
            self.drop_peer(peer, now);
        }
        // After dropping the older connect: its bound on `newest` must not
        // forget this peer's newest connect.
        self.newest.insert(peer, connect);
        true
    }

    /// `peer`'s control connection `conn`, of decode's connect `connect`,
    /// finished its handshake. Returns whether to keep it (not for an older
    /// connect than the newest seen).
    pub fn handle_control_up(
        &mut self,
        peer: PeerId,
        conn: u64,
        connect: u64,
        now: Instant,
    ) -> bool {
        if !self.admit(peer, connect, now) {
            return false;
        }
        self.peers.entry(peer).or_default().control = Some(conn);
        self.liveness.add_peer(peer, now);
        self.drive(now);
        true
    }

    /// A control message from `peer`.
    pub fn handle_message(&mut self, peer: PeerId, msg: Message, now: Instant) {
        self.liveness.handle_seen(peer, now);
        self.rooms.handle_message(peer, msg, now);
        self.drive(now);
    }

    /// A malformed control frame was dropped.
    pub fn handle_malformed(&mut self) {
        self.malformed_frames += 1;
    }

    /// A control handshake was refused.
    pub fn handle_handshake_failed(&mut self) {
        self.handshakes_failed += 1;
    }

    /// Control connection `conn` of `peer` closed. If it is the peer's
    /// current one, the peer is gone: its data link goes too and its rooms
    /// fail.
    pub fn handle_control_closed(&mut self, peer: PeerId, conn: u64, now: Instant) {
        if self
            .peers
            .get(&peer)
            .is_some_and(|p| p.control == Some(conn))
        {
            self.drop_peer(peer, now);
            self.drive(now);
        }
    }

    /// Stream `index` of `count` of a data link (`nonce`, decode's connect
    /// `connect`) from `peer` was accepted. Returns the link's streams, in
    /// index order, once all of them are here (at once for one stream);
    /// `None` while more are expected or when the connect is older than the
    /// newest seen (the stream is dropped). A new nonce means decode started
    /// the link over: the older attempt's streams are dropped.
    pub fn handle_link_stream(
        &mut self,
        peer: PeerId,
        connect: u64,
        (nonce, index, count): (u64, u8, u8),
        stream: S,
        now: Instant,
    ) -> Option<Vec<S>> {
        if !self.admit(peer, connect, now) {
            return None;
        }
        self.drive(now);
        if count <= 1 {
            return Some(vec![stream]);
        }
        let peer = self.peers.entry(peer).or_default();
        let (n, streams) = peer.pending.get_or_insert_with(|| (nonce, Vec::new()));
        if *n != nonce || streams.len() != usize::from(count) {
            *n = nonce;
            *streams = (0..count).map(|_| None).collect();
        }
        *streams.get_mut(usize::from(index))? = Some(stream);
        if streams.iter().any(Option::is_none) {
            return None;
        }
        peer.pending
            .take()
            .map(|(_, s)| s.into_iter().flatten().collect())
    }

    /// `peer`'s data link `link` (the shell's id) is up; the decode pool
    /// has `dest_pages` pages.
    pub fn handle_link_up(&mut self, peer: PeerId, link: u64, dest_pages: usize) {
        self.peers.entry(peer).or_default().link = Some((link, dest_pages));
    }

    /// Data link `link` of `peer` closed. If it is the peer's current one,
    /// every room writing to it fails (peer dead).
    pub fn handle_link_closed(&mut self, peer: PeerId, link: u64, reason: &str, now: Instant) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.link.is_none_or(|(id, _)| id != link) {
            return;
        }
        p.link = None;
        self.events.push_back(SenderEvent::ClosePeer {
            peer,
            control: None,
            link: Some(link),
        });
        let hit: Vec<RoomId> = self
            .writing
            .iter()
            .filter(|(_, w)| w.destinations.iter().any(|(r, _)| *r == peer))
            .map(|(room, _)| *room)
            .collect();
        for room in hit {
            let err = TransferError::PeerDead {
                peer,
                detail: format!("data link closed: {reason}"),
            };
            self.rooms.handle_write_failed(room, peer, err, now);
        }
        self.bound_newest();
        self.drive(now);
    }

    /// Decode acknowledged everything of `room` on `peer`'s link up to its
    /// end marker (`ok`: no segment was rejected).
    pub fn handle_ack(&mut self, peer: PeerId, room: RoomId, ok: bool, now: Instant) {
        let Some(w) = self.writing.get(&room) else {
            return;
        };
        if w.cancelled {
            let err = TransferError::Internal {
                reason: "writes cancelled".into(),
            };
            self.rooms.handle_write_failed(room, peer, err, now);
        } else if ok {
            self.rooms.handle_write_done(room, peer, now);
        } else {
            let err = TransferError::PeerMisbehaved {
                what: Misbehavior::WritesRejected,
            };
            self.rooms.handle_write_failed(room, peer, err, now);
        }
        self.drive(now);
    }

    /// The shell could not write `room` to `peer` (e.g. it could not build
    /// the segments): that destination fails.
    pub fn handle_write_failed(
        &mut self,
        room: RoomId,
        peer: PeerId,
        error: TransferError,
        now: Instant,
    ) {
        self.rooms.handle_write_failed(room, peer, error, now);
        self.drive(now);
    }

    // ----- what the engine asks -----

    /// Accept a request for `room`, whose writes will carry `cancel`, with
    /// its own event sink `sink`: it comes back in a
    /// [`SenderEvent::Answer`] with `Pending(WaitingForInput)` once every
    /// destination arrived (compute may start), then with `Success` or
    /// `Failed` (the room's end); nothing else answers for the room. Fails
    /// for a duplicate live room id, a room decode already aborted, or
    /// capacity.
    pub fn open(
        &mut self,
        room: RoomId,
        cancel: C,
        sink: W,
        now: Instant,
    ) -> Result<(), TransferError> {
        self.rooms.open(room, now)?;
        self.tokens.insert(room, cancel);
        self.sinks.insert(room, sink);
        self.awaiting_input.insert(room);
        self.drive(now);
        Ok(())
    }

    /// Fail `room` here (validation rejection, engine error): every decode
    /// destination learns `error`'s reason and status.
    pub fn fail(&mut self, room: RoomId, error: TransferError, now: Instant) {
        self.rooms.fail(room, error, now);
        self.drive(now);
    }

    /// Write `layers` × room pages `pages` of `room` (the first call marks
    /// compute done). Room page `i` holds the prompt's tokens
    /// `i*page_size..(i+1)*page_size`. Returns, per destination, what to
    /// write there with the room's cancel token: a destination that holds a
    /// cached prefix (delta transfer) gets only the pages past it, mapped
    /// onto its page list, and none at all when the prefix covers them.
    /// Destinations that cannot be written (no data link, a prefix not on a
    /// page boundary, too few pages, a page outside the decode pool) fail
    /// here. The caller checked its own (source) pages.
    pub fn send(
        &mut self,
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        now: Instant,
    ) -> Result<(Vec<DestWrite>, C), SendRefused> {
        self.start_writes(room, now)?;
        let Some(w) = self.writing.get(&room) else {
            return Err(SendRefused::FailedBeforeWrites);
        };
        if w.ended {
            return Err(SendRefused::Ended);
        }
        if layers.start > layers.end || layers.end > self.layers || pages.start > pages.end {
            return Err(SendRefused::OutOfRange { layers, pages });
        }
        let mut out = Vec::with_capacity(w.destinations.len());
        let mut failed: Vec<(PeerId, TransferError)> = Vec::new();
        let misbehaved = |what| TransferError::PeerMisbehaved { what };
        for (peer, d) in &w.destinations {
            let Some((_, dest_pages)) = self.peers.get(peer).and_then(|p| p.link) else {
                failed.push((
                    *peer,
                    TransferError::PeerDead {
                        peer: *peer,
                        detail: "no data link to this decode peer".into(),
                    },
                ));
                continue;
            };
            let prefix = d.prefix_tokens.unwrap_or(0);
            if prefix as usize % self.page_size != 0 {
                failed.push((
                    *peer,
                    misbehaved(Misbehavior::PrefixNotPageAligned {
                        tokens: prefix,
                        page_size: self.page_size,
                    }),
                ));
                continue;
            }
            let skip = prefix as usize / self.page_size;
            let start = pages.start.max(skip);
            if start >= pages.end {
                continue; // decode holds all of these pages already
            }
            let (first, end) = (start - skip, pages.end - skip);
            if end > d.pages.len() {
                failed.push((
                    *peer,
                    misbehaved(Misbehavior::DestinationTooShort {
                        has: d.pages.len(),
                        sends: end,
                    }),
                ));
                continue;
            }
            // Every destination page written is checked against the decode
            // pool before anything is written.
            if let Some(bad) = d.pages[first..end]
                .iter()
                .find(|p| p.0 as usize >= dest_pages)
            {
                failed.push((
                    *peer,
                    misbehaved(Misbehavior::PageOutsidePool {
                        page: bad.0,
                        pool_pages: dest_pages,
                    }),
                ));
                continue;
            }
            out.push(DestWrite {
                peer: *peer,
                destination: d.clone(),
                dest_pool_pages: dest_pages,
                pages: start..pages.end,
                skip,
            });
        }
        let cancel = w.cancel.clone();
        for (peer, e) in failed {
            self.rooms.handle_write_failed(room, peer, e, now);
        }
        self.drive(now);
        Ok((out, cancel))
    }

    /// Every `send` of `room` is queued: each destination gets the prompt
    /// scores (`prompt`, flat pairs; empty for none), the aux record and
    /// the room's end ([`SenderEvent::Finish`] events). Success is reported
    /// once decode acknowledged.
    pub fn finish(
        &mut self,
        room: RoomId,
        aux: AuxData,
        prompt: std::sync::Arc<[(u32, f32)]>,
        now: Instant,
    ) -> Result<(), SendRefused> {
        self.start_writes(room, now)?;
        if let Some(w) = self.writing.get_mut(&room) {
            if !w.ended {
                w.ended = true;
                for (peer, d) in &w.destinations {
                    if self.peers.get(peer).is_some_and(|p| p.link.is_some()) {
                        self.events.push_back(SenderEvent::Finish {
                            peer: *peer,
                            room,
                            aux: Some((d.aux_slot.0, aux)),
                            prompt: prompt.clone(),
                            cancel: w.cancel.clone(),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The state of live `room` (or of its tombstone, once ended).
    pub fn state(&self, room: RoomId) -> Option<RoomState> {
        self.rooms.state(room)
    }

    /// Counters and gauges.
    pub fn stats(&self) -> SenderStats {
        SenderStats {
            live_rooms: self.rooms.live_rooms(),
            peers_ranks: self
                .peers
                .iter()
                .filter(|(_, p)| p.control.is_some())
                .map(|(r, _)| *r)
                .collect(),
            links: self.peers.values().filter(|p| p.link.is_some()).count(),
            pending_links: self.peers.values().filter(|p| p.pending.is_some()).count(),
            room_stats: self.rooms.stats().clone(),
            malformed_frames: self.malformed_frames,
            handshakes_failed: self.handshakes_failed,
            stalled: self.liveness.stalled(),
            writing_rooms: self.writing.len(),
            sinks: self.sinks.len(),
        }
    }

    /// Stop: forget every peer (pending streams are dropped) and waiter;
    /// every room's writes are cancelled ([`SenderEvent::Cancel`]).
    pub fn shutdown(&mut self) {
        self.peers.clear();
        self.sinks.clear();
        self.awaiting_input.clear();
        self.events.clear();
        for (room, w) in self.writing.drain() {
            self.events.push_back(SenderEvent::Cancel {
                room,
                cancel: w.cancel,
            });
        }
        self.tokens.clear();
    }

    // ----- inside -----

    /// Move `room` to Transferring (compute done) if it is not yet.
    fn start_writes(&mut self, room: RoomId, now: Instant) -> Result<(), SendRefused> {
        if !self.writing.contains_key(&room) {
            match self.rooms.state(room) {
                Some(RoomState::WaitingForInput) => {
                    self.rooms.handle_compute_done(room, now);
                    self.drive(now);
                }
                Some(s) => return Err(SendRefused::NotReady(s.name())),
                None => return Err(SendRefused::UnknownRoom),
            }
        }
        if self.writing.contains_key(&room) {
            Ok(())
        } else {
            Err(SendRefused::FailedBeforeWrites)
        }
    }

    /// Forget `peer`'s control connection, link and pending streams (its
    /// rooms fail as the peer is dead).
    fn drop_peer(&mut self, peer: PeerId, now: Instant) {
        if let Some(p) = self.peers.remove(&peer) {
            self.events.push_back(SenderEvent::ClosePeer {
                peer,
                control: p.control,
                link: p.link.map(|(id, _)| id),
            });
        }
        self.liveness.remove_peer(peer);
        self.rooms.handle_peer_dead(peer, now);
        self.bound_newest();
    }

    /// Keep `newest` bounded: past [`MAX_NEWEST`] entries, forget those of
    /// ranks with nothing left (a late connection of a forgotten peer is
    /// then admitted, and closes when decode drops it).
    fn bound_newest(&mut self) {
        if self.newest.len() > MAX_NEWEST {
            let peers = &self.peers;
            self.newest
                .retain(|r, _| peers.get(r).is_some_and(|p| !p.is_empty()));
        }
    }

    /// Carry out what the room table decided, until it has nothing more;
    /// then answer input waiters whose room left `Bootstrapping`.
    fn drive(&mut self, now: Instant) {
        while let Some(a) = self.rooms.poll_action() {
            match a {
                SenderAction::StartCompute { .. } => {}
                SenderAction::StartWrites { room, destinations } => {
                    if let Some(cancel) = self.tokens.remove(&room) {
                        self.writing.insert(
                            room,
                            Writing {
                                destinations: destinations
                                    .into_iter()
                                    .map(|(r, d)| (r, Arc::new(d)))
                                    .collect(),
                                cancel,
                                cancelled: false,
                                ended: false,
                            },
                        );
                    }
                }
                SenderAction::CancelWrites { room } => self.cancel_writes(room, now),
                SenderAction::Finished { room, result } => {
                    self.writing.remove(&room);
                    self.tokens.remove(&room);
                    self.awaiting_input.remove(&room);
                    if let Some(sink) = self.sinks.remove(&room) {
                        let event = match result {
                            Ok(()) => SenderRoomEvent::Success,
                            Err(e) => SenderRoomEvent::Failed(e),
                        };
                        self.events.push_back(SenderEvent::Room { sink, event });
                    }
                }
            }
        }
        if !self.awaiting_input.is_empty() {
            let rooms = &self.rooms;
            let ready: Vec<RoomId> = self
                .awaiting_input
                .iter()
                .copied()
                .filter(|&room| {
                    rooms
                        .state(room)
                        .is_some_and(|s| s != RoomState::Bootstrapping && !s.is_terminal())
                })
                .collect();
            for room in ready {
                self.awaiting_input.remove(&room);
                if let Some(sink) = self.sinks.get(&room).cloned() {
                    self.events.push_back(SenderEvent::Room {
                        sink,
                        event: SenderRoomEvent::Ready,
                    });
                }
            }
        }
    }

    /// Cancel `room`'s writes: raise its token; a room whose end was already
    /// queued will be acked, one without gets a cancelled end now; a
    /// destination without a link fails at once.
    fn cancel_writes(&mut self, room: RoomId, now: Instant) {
        let Some(w) = self.writing.get_mut(&room) else {
            return;
        };
        w.cancelled = true;
        self.events.push_back(SenderEvent::Cancel {
            room,
            cancel: w.cancel.clone(),
        });
        let mut orphans = Vec::new();
        for (peer, _) in &w.destinations {
            match self.peers.get(peer).and_then(|p| p.link) {
                Some(_) if !w.ended => self.events.push_back(SenderEvent::Finish {
                    peer: *peer,
                    room,
                    aux: None,
                    prompt: std::sync::Arc::from([]),
                    cancel: w.cancel.clone(),
                }),
                Some(_) => {}
                None => orphans.push(*peer),
            }
        }
        w.ended = true;
        for peer in orphans {
            let err = TransferError::PeerDead {
                peer,
                detail: "no data link".into(),
            };
            self.rooms.handle_write_failed(room, peer, err, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{AuxSlot, PageIndex};
    use crate::message::{Abort, Outcome, Status};

    type Ep = SenderEndpoint<&'static str, u32, u8>;

    const D: PeerId = PeerId(3);

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    fn connected(now: Instant) -> Ep {
        let mut ep = Ep::new(RoomConfig::default(), 2, 4);
        assert!(ep.handle_control_up(D, 10, 1, now));
        assert_eq!(
            ep.handle_link_stream(D, 1, (7, 0, 1), "s0", now),
            Some(vec!["s0"])
        );
        ep.handle_link_up(D, 20, 8);
        ep
    }

    fn destination(r: RoomId, pages: &[u32]) -> Message {
        Message::Destination(Destination {
            room: r,
            pages: pages.iter().map(|p| PageIndex(*p)).collect(),
            aux_slot: AuxSlot(5),
            required_destinations: 1,
            prefix_tokens: None,
        })
    }

    fn events(ep: &mut Ep) -> Vec<SenderEvent<u32, u8>> {
        std::iter::from_fn(|| ep.poll_event()).collect()
    }

    /// The room's end, from the answers among `events` (a room ends once).
    fn end(events: &mut impl Events) -> SenderRoomEvent {
        let ends: Vec<SenderRoomEvent> = events
            .take_all()
            .into_iter()
            .filter_map(|e| match e {
                SenderEvent::Room { event, .. }
                    if matches!(event, SenderRoomEvent::Success | SenderRoomEvent::Failed(_)) =>
                {
                    Some(event)
                }
                _ => None,
            })
            .collect();
        assert_eq!(ends.len(), 1, "one end: {ends:?}");
        ends.into_iter().next().unwrap()
    }

    /// Where [`end`] reads events from: the endpoint or events taken.
    trait Events {
        fn take_all(&mut self) -> Vec<SenderEvent<u32, u8>>;
    }

    impl Events for Ep {
        fn take_all(&mut self) -> Vec<SenderEvent<u32, u8>> {
            events(self)
        }
    }

    impl Events for std::vec::IntoIter<SenderEvent<u32, u8>> {
        fn take_all(&mut self) -> Vec<SenderEvent<u32, u8>> {
            self.collect()
        }
    }

    #[test]
    fn a_room_waits_for_its_destination_then_writes_and_succeeds_on_the_ack() {
        let now = Instant::now();
        let mut ep = connected(now);
        let r = room(9);
        ep.open(r, 1, 100, now).unwrap();
        assert!(events(&mut ep).is_empty(), "bootstrapping: nobody answered");
        assert_eq!(
            ep.send(r, 0..1, 0..1, now).unwrap_err(),
            SendRefused::NotReady("bootstrapping")
        );
        ep.handle_message(D, destination(r, &[4, 5]), now);
        assert!(matches!(
            &events(&mut ep)[..],
            [SenderEvent::Room {
                sink: 100,
                event: SenderRoomEvent::Ready
            }]
        ));
        let (dests, cancel) = ep.send(r, 0..2, 0..2, now).unwrap();
        assert_eq!(cancel, 1);
        assert_eq!(dests.len(), 1);
        assert_eq!((dests[0].peer, dests[0].dest_pool_pages), (D, 8));
        assert_eq!((dests[0].pages.clone(), dests[0].skip), (0..2, 0));
        assert_eq!(ep.state(r), Some(RoomState::Transferring));
        ep.finish(
            r,
            AuxData {
                first_token: 7,
                logprob: -1.0,
                top: crate::datalink::TopLogprobs::NONE,
            },
            std::sync::Arc::from([(3, -0.5)]),
            now,
        )
        .unwrap();
        assert!(matches!(
            &events(&mut ep)[..],
            [SenderEvent::Finish { peer, aux: Some((5, a)), prompt, cancel: 1, .. }]
                if *peer == D && a.first_token == 7 && prompt[..] == [(3, -0.5)]
        ));
        assert_eq!(ep.send(r, 0..1, 0..1, now).unwrap_err(), SendRefused::Ended);
        ep.handle_ack(D, r, true, now);
        assert!(matches!(
            &events(&mut ep)[..],
            [SenderEvent::Room {
                sink: 100,
                event: SenderRoomEvent::Success
            }]
        ));
        let tx: Vec<Transmit> = std::iter::from_fn(|| ep.poll_transmit(now)).collect();
        assert!(tx.iter().any(|t| matches!(
            &t.message,
            Message::Status(Status {
                outcome: Outcome::Success,
                ..
            })
        )));
        let s = ep.stats();
        assert_eq!((s.live_rooms, s.writing_rooms, s.sinks), (0, 0, 0));
        assert!(ep.tokens.is_empty());
    }

    fn destination_after(r: RoomId, pages: &[u32], prefix_tokens: u32) -> Message {
        match destination(r, pages) {
            Message::Destination(d) => Message::Destination(Destination {
                prefix_tokens: Some(prefix_tokens),
                ..d
            }),
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_destination_with_a_cached_prefix_gets_only_the_pages_past_it() {
        let now = Instant::now();
        let mut ep = connected(now); // 4 tokens per page
        let r = room(21);
        ep.open(r, 1, 1, now).unwrap();
        // Decode holds the first 2 pages (8 tokens); its list starts at
        // room page 2.
        ep.handle_message(D, destination_after(r, &[6, 7, 3], 8), now);
        let (dests, _) = ep.send(r, 0..2, 0..2, now).unwrap();
        assert!(dests.is_empty(), "pages decode holds are not written");
        let (dests, _) = ep.send(r, 0..2, 1..4, now).unwrap();
        assert_eq!(dests.len(), 1);
        assert_eq!((dests[0].pages.clone(), dests[0].skip), (2..4, 2));
        assert_eq!(ep.state(r), Some(RoomState::Transferring));
        // Past the destination's list: too short, counted from its start.
        let (dests, _) = ep.send(r, 0..1, 4..6, now).unwrap();
        assert!(dests.is_empty());
        match end(&mut ep) {
            SenderRoomEvent::Failed(TransferError::PeerMisbehaved { what }) => {
                assert_eq!(what, Misbehavior::DestinationTooShort { has: 3, sends: 4 })
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_prefix_off_the_page_boundary_fails_the_room() {
        let now = Instant::now();
        let mut ep = connected(now);
        let r = room(22);
        ep.open(r, 1, 1, now).unwrap();
        ep.handle_message(D, destination_after(r, &[6, 7], 6), now);
        let (dests, _) = ep.send(r, 0..1, 0..2, now).unwrap();
        assert!(dests.is_empty());
        match end(&mut ep) {
            SenderRoomEvent::Failed(TransferError::PeerMisbehaved { what }) => {
                assert_eq!(
                    what,
                    Misbehavior::PrefixNotPageAligned {
                        tokens: 6,
                        page_size: 4
                    }
                );
                assert!(what
                    .to_string()
                    .contains("not a whole number of 4-token pages"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn destinations_outside_the_decode_pool_fail_before_anything_is_written() {
        let now = Instant::now();
        let mut ep = connected(now);
        let r = room(2);
        ep.open(r, 1, 1, now).unwrap();
        ep.handle_message(D, destination(r, &[1, 8]), now); // pool has 8 pages
        let (dests, _) = ep.send(r, 0..1, 0..2, now).unwrap();
        assert!(dests.is_empty(), "nothing to write");
        match end(&mut ep) {
            SenderRoomEvent::Failed(TransferError::PeerMisbehaved { what }) => {
                assert_eq!(
                    what,
                    Misbehavior::PageOutsidePool {
                        page: 8,
                        pool_pages: 8
                    }
                );
                assert!(
                    what.to_string()
                        .contains("outside the decode pool of 8 pages"),
                    "{what}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            ep.send(room(77), 0..1, 0..1, now).unwrap_err(),
            SendRefused::UnknownRoom
        );
    }

    #[test]
    fn a_decode_abort_cancels_the_writes_and_the_room_fails_once_they_stopped() {
        let now = Instant::now();
        let mut ep = connected(now);
        let r = room(4);
        ep.open(r, 9, 1, now).unwrap();
        ep.handle_message(D, destination(r, &[1]), now);
        ep.send(r, 0..2, 0..1, now).unwrap();
        events(&mut ep);
        ep.handle_message(
            D,
            Message::Abort(Abort {
                room: r,
                reason: "client gone".into(),
                http_status: Some(499),
                origin: None,
            }),
            now,
        );
        let ev = events(&mut ep);
        assert!(
            matches!(
                &ev[..],
                [
                    SenderEvent::Cancel { cancel: 9, .. },
                    SenderEvent::Finish { aux: None, .. }
                ]
            ),
            "{ev:?}"
        );
        assert_eq!(ep.state(r), Some(RoomState::Draining));
        // The writer's ack of the cancelled end: the room fails, once.
        ep.handle_ack(D, r, true, now);
        assert!(matches!(
            &events(&mut ep)[..],
            [SenderEvent::Room {
                sink: 1,
                event: SenderRoomEvent::Failed(_)
            }]
        ));
    }

    #[test]
    fn a_newer_connect_replaces_an_older_one_and_a_late_older_one_is_refused() {
        let now = Instant::now();
        let mut ep = Ep::new(RoomConfig::default(), 2, 4);
        assert!(ep.handle_control_up(D, 1, 5, now));
        ep.handle_link_up(D, 11, 8);
        let r = room(6);
        ep.open(r, 0, 1, now).unwrap();
        ep.handle_message(D, destination(r, &[1]), now);
        // Connect 3, cancelled on decode, completes late: refused.
        assert!(!ep.handle_control_up(D, 2, 3, now));
        assert_eq!(ep.handle_link_stream(D, 3, (1, 0, 1), "late", now), None);
        assert_eq!(ep.stats().peers_ranks, vec![D]);
        // Connect 6 replaces 5: its connection and link close, its room fails.
        assert!(ep.handle_control_up(D, 3, 6, now));
        let ev = events(&mut ep);
        assert!(
            ev.iter().any(|e| matches!(
                e,
                SenderEvent::ClosePeer {
                    control: Some(1),
                    link: Some(11),
                    ..
                }
            )),
            "{ev:?}"
        );
        assert!(matches!(
            end(&mut ev.into_iter()),
            SenderRoomEvent::Failed(TransferError::PeerDead { .. })
        ));
        assert_eq!(ep.stats().links, 0, "connect 6 has no link yet");
        assert!(ep.stats().peers_ranks.contains(&D));
    }

    #[test]
    fn a_multi_stream_link_starts_once_all_its_streams_are_here() {
        let now = Instant::now();
        let mut ep = Ep::new(RoomConfig::default(), 2, 4);
        assert_eq!(ep.handle_link_stream(D, 1, (7, 1, 3), "b", now), None);
        // A new nonce starts over.
        assert_eq!(ep.handle_link_stream(D, 1, (8, 0, 3), "x", now), None);
        assert_eq!(ep.handle_link_stream(D, 1, (8, 2, 3), "z", now), None);
        assert_eq!(ep.stats().pending_links, 1);
        assert_eq!(
            ep.handle_link_stream(D, 1, (8, 1, 3), "y", now),
            Some(vec!["x", "y", "z"])
        );
        assert_eq!(ep.stats().pending_links, 0);
        // An index outside the count is dropped.
        assert_eq!(ep.handle_link_stream(D, 1, (9, 5, 2), "bad", now), None);
    }

    #[test]
    fn newest_connects_are_bounded_but_live_peers_keep_theirs() {
        let now = Instant::now();
        let mut ep = Ep::new(RoomConfig::default(), 2, 4);
        assert!(ep.handle_control_up(D, 1, 5, now));
        for r in 100..(100 + MAX_NEWEST as u32 + 10) {
            assert!(ep.handle_control_up(PeerId(r), 1, 1, now));
            ep.handle_control_closed(PeerId(r), 1, now);
        }
        assert!(ep.newest.len() <= MAX_NEWEST + 1, "{}", ep.newest.len());
        assert!(!ep.handle_control_up(D, 2, 4, now), "D's newest is kept");
        // Fill the table with ranks that have nothing left, then replace D's
        // connect: the bound runs while D is empty, yet D's new connect is
        // remembered and an older one stays refused.
        for r in 10_000..(10_000 + MAX_NEWEST as u32) {
            ep.newest.insert(PeerId(r), 1);
        }
        assert!(ep.handle_control_up(D, 3, 6, now));
        assert_eq!(ep.newest.get(&D), Some(&6));
        assert!(
            !ep.handle_control_up(D, 4, 5, now),
            "the replaced connect stays refused"
        );
    }
}
