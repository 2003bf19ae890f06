//! The decode endpoint, sans-IO: one
//! owner for everything decode knows about its rooms and its prefill peers.
//!
//! [`ReceiverEndpoint`] owns the room table ([`ReceiverRooms`]), peer
//! liveness, which peers have a control connection and a data link, the
//! page lease of every room between its reservation and its end, the aux
//! records that arrived and each room's event sink. It is generic over the
//! lease type `L` (the shell's RAII page lease) and the sink `W` (the room
//! handle's channel), so nothing
//! here does I/O: time is passed in, and what the shell must do comes out
//! of [`ReceiverEndpoint::poll_transmit`] (control messages) and
//! [`ReceiverEndpoint::poll_event`] (link registrations, peers to close,
//! outcomes for sinks), in the spirit of quinn-proto's `Endpoint`.
//!
//! A shell calls `handle_*` for what its sockets and tasks report, the
//! request methods ([`open`](ReceiverEndpoint::open),
//! [`reserve`](ReceiverEndpoint::reserve), [`abort`](ReceiverEndpoint::abort),
//! ...) for what the engine asks, and
//! [`handle_timeout`](ReceiverEndpoint::handle_timeout) at
//! [`poll_timeout`](ReceiverEndpoint::poll_timeout); after each call it
//! drains `poll_event` first, then `poll_transmit` (so a link reader learns
//! a room before its destination leaves).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::datalink::AuxData;
use crate::error::{FailureKind, TransferError};
use crate::handshake::{Capabilities, Fingerprint};
use crate::heartbeat::Liveness;
use crate::ids::{AuxSlot, PageIndex, PeerId, RankId, RoomId};
use crate::landing::LandedAux;
use crate::message::{Message, Outcome, Status};
use crate::rank::{RankError, RankMap};
use crate::receiver_room::{ReceiverAction, ReceiverRooms, Source};
use crate::room::{RoomConfig, RoomState, RoomStats, Transmit};

/// A peer's place in its TP group (from its handshake fingerprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpPosition {
    /// TP rank.
    pub rank: u32,
    /// TP size.
    pub size: u32,
}

impl TpPosition {
    /// The position `fp` announces.
    pub fn of(fp: &Fingerprint) -> Self {
        Self {
            rank: fp.tp_rank,
            size: fp.tp_size,
        }
    }
}

/// Why a room's sources cannot serve this decode rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourcesError {
    /// A room needs at least one source.
    #[error("a room needs at least one source")]
    None,
    /// Sources of prefill TP groups of different sizes.
    #[error("sources from prefill TP groups of different sizes: {0:?}")]
    MixedGroups(Vec<u32>),
    /// The TP sizes cannot be mapped onto each other.
    #[error("rank mapping: {0}")]
    Rank(#[from] RankError),
    /// Some prefill rank whose heads this decode rank needs is missing.
    #[error("decode TP rank {decode_rank} of {decode_size} needs KV from prefill TP ranks {required:?} of {prefill_size}; the room's sources lack {missing:?}")]
    Missing {
        /// Our TP rank.
        decode_rank: u32,
        /// Our TP size.
        decode_size: u32,
        /// The prefill TP ranks we need heads from.
        required: Vec<u32>,
        /// The prefill group's TP size.
        prefill_size: u32,
        /// Those not among the sources.
        missing: Vec<u32>,
    },
}

/// Whether prefill peers at `sources` can serve a room of the decode rank
/// whose fingerprint is `decode`: they must come from one TP group and
/// cover every prefill rank it needs heads from
/// ([`RankMap::required_prefill_ranks`]), or the room could commit with
/// some heads never written.
pub fn check_room_sources(
    decode: &Fingerprint,
    sources: &[TpPosition],
) -> Result<(), SourcesError> {
    let Some(first) = sources.first() else {
        return Err(SourcesError::None);
    };
    if sources.iter().any(|t| t.size != first.size) {
        return Err(SourcesError::MixedGroups(
            sources.iter().map(|t| t.size).collect(),
        ));
    }
    let required = RankMap::new(decode.kv_heads, first.size, decode.tp_size)
        .and_then(|m| m.required_prefill_ranks(RankId(decode.tp_rank)))?;
    let missing: Vec<u32> = required
        .iter()
        .map(|r| r.0)
        .filter(|r| !sources.iter().any(|t| t.rank == *r))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(SourcesError::Missing {
            decode_rank: decode.tp_rank,
            decode_size: decode.tp_size,
            required: required.iter().map(|r| r.0).collect(),
            prefill_size: first.size,
            missing,
        })
    }
}

/// How a decode room ended, as its event sink hears it (see
/// [`ReceiverEndpoint::open`]).
#[derive(Debug)]
pub enum ReceiverOutcome<L> {
    /// Committed: the pages hold the prompt's KV; the engine owns them now.
    Success {
        /// The pages, back to the engine.
        lease: L,
        /// The aux slot's data (first token, logprob).
        aux: AuxData,
        /// The prompt scores that came with the aux record (flat (token,
        /// log-probability) pairs; empty unless asked for).
        prompt: Vec<(u32, f32)>,
    },
    /// Failed. Pages return to the pool on their own once no writer may
    /// still be writing.
    Failed(TransferError),
}

/// What the shell must do, besides sending control messages.
#[derive(Debug)]
pub enum ReceiverEvent<L, W> {
    /// Let the data link of `peer` write `room`: its `pages` (sorted) and
    /// `aux_slot`. The shell hands the link reader a writer guard of the
    /// room's lease ([`ReceiverEndpoint::lease`]); if the room has no lease
    /// any more, it skips this.
    RegisterWrites {
        /// The prefill peer.
        peer: PeerId,
        /// The room.
        room: RoomId,
        /// Its pages, sorted.
        pages: Vec<u32>,
        /// Its aux slot.
        aux_slot: u32,
    },
    /// The data link of `peer` stops accepting writes for `room` (and drops
    /// the room's writer guard).
    ForgetWrites {
        /// The prefill peer.
        peer: PeerId,
        /// The room.
        room: RoomId,
        /// The writer never confirmed it stopped (the abort fence expired): a
        /// transport whose writer copies into the pages itself (shm) must
        /// keep them until it knows.
        may_write: bool,
    },
    /// Close `peer`'s control connection and data link (closed, dead,
    /// abandoned): drop their I/O handles.
    ClosePeer {
        /// The prefill peer.
        peer: PeerId,
    },
    /// A failed room's pages went back (its lease was dropped): every writer
    /// drained, or the abort fence passed (`fence_expired`: a writer never
    /// confirmed; worth a warning).
    Released {
        /// The room.
        room: RoomId,
        /// Released at the fence rather than on the writers' word.
        fence_expired: bool,
    },
    /// The outcome a waiter of [`ReceiverEndpoint::wait`] waits for. If the
    /// waiter is gone, hand the outcome back with
    /// [`ReceiverEndpoint::unclaimed`].
    Outcome {
        /// The room.
        room: RoomId,
        /// The waiter's token.
        waiter: W,
        /// What happened.
        outcome: ReceiverOutcome<L>,
    },
}

/// Why [`ReceiverEndpoint::open`] or [`ReceiverEndpoint::reserve`] refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RefusedRoom {
    /// The room table refused it (duplicate live room, capacity ...).
    #[error(transparent)]
    Room(#[from] TransferError),
    /// The sources cannot serve this decode peer.
    #[error(transparent)]
    Sources(#[from] SourcesError),
    /// The room is not waiting for its pages.
    #[error("room {0} is not waiting for pages")]
    NotWaitingForPages(u64),
    /// A cached prefix was offered to a source whose connection did not
    /// negotiate delta transfer (`DESTINATION_PREFIX`).
    #[error("{peer} did not negotiate delta transfer: reserve the whole prompt")]
    PrefixUnsupported {
        /// The source.
        peer: PeerId,
    },
}

impl From<RefusedRoom> for TransferError {
    /// The room table's refusal as it is; sources that cannot serve this
    /// peer, or pages for a room not waiting for them, are a misuse of this
    /// API (a room that failed meanwhile reports its own failure through its
    /// outcome).
    fn from(e: RefusedRoom) -> Self {
        match e {
            RefusedRoom::Room(e) => e,
            other => TransferError::ApiMisuse {
                reason: other.to_string(),
            },
        }
    }
}

/// Counters and gauges of a decode endpoint.
#[derive(Debug, Clone, Default)]
pub struct ReceiverStats {
    /// Live rooms (Draining included).
    pub live_rooms: usize,
    /// Peers with an established control connection.
    pub peers_ranks: Vec<PeerId>,
    /// Peers with a data link up.
    pub links: usize,
    /// The room table's counters.
    pub room_stats: RoomStats,
    /// Malformed control frames counted and dropped.
    pub malformed_frames: u64,
    /// Handshakes refused.
    pub handshakes_failed: u64,
    /// How much later than due the shell woke us, in all.
    pub stalled: Duration,
    /// Rooms holding a lease.
    pub leased_rooms: usize,
    /// Waiters registered.
    pub waiters: usize,
}

/// What decode knows of one prefill peer.
#[derive(Debug, Default)]
struct Peer {
    /// The id of its established control connection.
    control: Option<u64>,
    /// What that connection's handshake negotiated.
    capabilities: Capabilities,
    /// Its data link: the shell's id for it and the peer's TP position.
    link: Option<(u64, TpPosition)>,
    /// The prefill reported a room failed because its end of our
    /// connection died: whatever still looks live here, the peer must be
    /// connected again.
    stale: bool,
}

/// A room's lease and the peers whose links may write it.
#[derive(Debug)]
struct Held<L> {
    lease: L,
    registered: Vec<PeerId>,
}

/// The decode endpoint: see the module docs.
#[derive(Debug)]
pub struct ReceiverEndpoint<L, W> {
    rooms: ReceiverRooms,
    liveness: Liveness,
    peers: HashMap<PeerId, Peer>,
    /// Peers whose connect was given up before their control connection
    /// came up, until that handshake must have ended (twice its timeout):
    /// one that still comes up is refused.
    abandoned: HashMap<PeerId, Instant>,
    abandoned_ttl: Duration,
    /// Sources of rooms still waiting for their pages.
    sources: HashMap<RoomId, Vec<PeerId>>,
    held: HashMap<RoomId, Held<L>>,
    /// Aux records that arrived: the room id written in the slot, the data.
    /// Each room's aux record as it arrived.
    aux: HashMap<RoomId, LandedAux>,
    /// Each live room's event sink (the engine's room handle): it hears
    /// how the room ended; nothing else answers for the room.
    waiters: HashMap<RoomId, W>,
    events: VecDeque<ReceiverEvent<L, W>>,
    /// Our handshake fingerprint (model KV heads, our TP rank and size).
    fingerprint: Fingerprint,
    malformed_frames: u64,
    handshakes_failed: u64,
}

impl<L, W> ReceiverEndpoint<L, W> {
    /// An endpoint with room limits and timers `config`, whose handshake
    /// fingerprint is `fingerprint` and whose handshakes take at most
    /// `handshake_timeout`.
    pub fn new(config: RoomConfig, fingerprint: Fingerprint, handshake_timeout: Duration) -> Self {
        Self {
            liveness: Liveness::new(config.timers),
            rooms: ReceiverRooms::new(config),
            peers: HashMap::new(),
            abandoned: HashMap::new(),
            abandoned_ttl: 2 * handshake_timeout,
            sources: HashMap::new(),
            held: HashMap::new(),
            aux: HashMap::new(),
            waiters: HashMap::new(),
            events: VecDeque::new(),
            fingerprint,
            malformed_frames: 0,
            handshakes_failed: 0,
        }
    }

    // ----- what the shell drains -----

    /// The next control message to send. Call after every other call, once
    /// [`Self::poll_event`] is drained.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        self.rooms
            .poll_transmit()
            .or_else(|| self.liveness.poll_transmit(now))
    }

    /// The next thing the shell must do (see [`ReceiverEvent`]). Call after
    /// every other call, until `None`.
    pub fn poll_event(&mut self) -> Option<ReceiverEvent<L, W>> {
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

    /// Deadlines that passed: rooms fail, silent peers are declared dead
    /// (their rooms fail; their pages wait for the fence).
    /// Returns the peers declared dead.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<PeerId> {
        self.rooms.handle_timeout(now);
        let dead = self.liveness.handle_timeout(now);
        for &peer in &dead {
            self.peers.remove(&peer);
            self.events.push_back(ReceiverEvent::ClosePeer { peer });
            self.rooms.handle_peer_dead(peer, now);
        }
        self.drive(now);
        dead
    }

    // ----- what the sockets report -----

    /// `peer`'s control connection `conn` finished its handshake, which
    /// negotiated `capabilities`. Returns whether to keep it: not for a peer
    /// whose connect was abandoned (the shell then drops the connection).
    pub fn handle_control_up(
        &mut self,
        peer: PeerId,
        conn: u64,
        capabilities: Capabilities,
        now: Instant,
    ) -> bool {
        if self
            .abandoned
            .remove(&peer)
            .is_some_and(|until| until > now)
        {
            return false;
        }
        let p = self.peers.entry(peer).or_default();
        p.control = Some(conn);
        p.capabilities = capabilities;
        self.liveness.add_peer(peer, now);
        true
    }

    /// What `peer`'s current control connection negotiated (`None` while
    /// it has none).
    pub fn capabilities(&self, peer: PeerId) -> Option<Capabilities> {
        self.peers
            .get(&peer)
            .filter(|p| p.control.is_some())
            .map(|p| p.capabilities)
    }

    /// A control message from `peer`.
    pub fn handle_message(&mut self, peer: PeerId, msg: crate::message::Message, now: Instant) {
        self.liveness.handle_seen(peer, now);
        let peer_dead = matches!(
            &msg,
            Message::Status(Status {
                outcome: Outcome::Failed {
                    kind: FailureKind::PeerDead,
                    ..
                },
                ..
            })
        );
        if let Some(p) = self.peers.get_mut(&peer).filter(|_| peer_dead) {
            p.stale = true;
        }
        self.rooms.handle_message(peer, msg, now);
        self.drive(now);
    }

    /// A malformed control frame was dropped.
    pub fn handle_malformed(&mut self) {
        self.malformed_frames += 1;
    }

    /// A handshake was refused.
    pub fn handle_handshake_failed(&mut self) {
        self.handshakes_failed += 1;
    }

    /// Control connection `conn` of `peer` closed. If it is the peer's
    /// current one, the peer is gone: its data link closes too (a link
    /// without its control connection serves no room) and its rooms fail.
    pub fn handle_control_closed(&mut self, peer: PeerId, conn: u64, now: Instant) {
        let current = self
            .peers
            .get(&peer)
            .is_some_and(|p| p.control == Some(conn));
        if current {
            self.peers.remove(&peer);
            self.liveness.remove_peer(peer);
            self.events.push_back(ReceiverEvent::ClosePeer { peer });
            self.rooms.handle_peer_dead(peer, now);
            self.drive(now);
        }
    }

    /// `peer`'s data link `link` (the shell's id) is up; the peer sits at
    /// `tp` in its TP group.
    pub fn handle_link_up(&mut self, peer: PeerId, link: u64, tp: TpPosition) {
        self.peers.entry(peer).or_default().link = Some((link, tp));
    }

    /// Data link `link` of `peer` closed. If it is the peer's current one,
    /// the rooms it serves fail (their pages wait for the fence).
    pub fn handle_link_closed(&mut self, peer: PeerId, link: u64, now: Instant) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.link.is_some_and(|(id, _)| id == link) {
            p.link = None;
            self.rooms.handle_peer_dead(peer, now);
            self.drive(now);
        }
    }

    /// The aux record of `room` arrived on a link, with the room id written
    /// in the slot and the prompt scores sent ahead of it. Kept only for a
    /// room that holds pages; they reach the engine with the room's
    /// success ([`ReceiverOutcome::Success`]), or go with the room.
    pub fn handle_aux(
        &mut self,
        room: RoomId,
        written_room: u64,
        aux: AuxData,
        prompt: Vec<(u32, f32)>,
    ) {
        if self.held.contains_key(&room) {
            self.aux.insert(
                room,
                LandedAux {
                    written_room,
                    aux,
                    prompt,
                },
            );
        }
    }

    /// The shell gave up connecting to `peer` (an error, or the connect was
    /// cancelled): whatever came up of it goes, and a control connection
    /// that comes up later is refused.
    pub fn abandon(&mut self, peer: PeerId, now: Instant) {
        let had_control = self
            .peers
            .remove(&peer)
            .is_some_and(|p| p.control.is_some());
        if !had_control {
            let ttl = self.abandoned_ttl;
            self.abandoned.retain(|_, until| *until > now);
            self.abandoned.insert(peer, now + ttl);
        }
        self.liveness.remove_peer(peer);
        self.events.push_back(ReceiverEvent::ClosePeer { peer });
    }

    // ----- what the engine asks -----

    /// The state of live `room` (or of its tombstone, once ended).
    pub fn state(&self, room: RoomId) -> Option<RoomState> {
        self.rooms.state(room)
    }

    /// Whether `peer` has both its control connection and data link up,
    /// and has not reported its end of them dead: otherwise the shell
    /// connects again before a room may use the prefill.
    pub fn is_connected(&self, peer: PeerId) -> bool {
        self.peers
            .get(&peer)
            .is_some_and(|p| p.control.is_some() && p.link.is_some() && !p.stale)
    }

    /// Whether `peer` has an established control connection.
    pub fn has_control(&self, peer: PeerId) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.control.is_some())
    }

    /// Accept a request for `room` needing KV from `sources`, with its own
    /// event sink `sink`: it comes back in a [`ReceiverEvent::Outcome`]
    /// when the room commits or fails. Refused when
    /// a source is not connected (the room could only end at its bootstrap
    /// deadline), when the sources cannot serve this decode peer, or by the
    /// room table (duplicate live room, capacity).
    pub fn open(
        &mut self,
        room: RoomId,
        sources: Vec<Source>,
        sink: W,
        now: Instant,
    ) -> Result<(), RefusedRoom> {
        let ranks: Vec<PeerId> = sources.iter().map(|s| s.peer).collect();
        if let Some(&dead) = ranks.iter().find(|r| !self.is_connected(**r)) {
            return Err(RefusedRoom::Room(TransferError::PeerDead {
                peer: dead,
                detail:
                    "no live connection to this prefill peer (it closed or died); reconnect first"
                        .into(),
            }));
        }
        let tps: Vec<TpPosition> = ranks
            .iter()
            .filter_map(|r| self.peers.get(r).and_then(|p| p.link).map(|(_, tp)| tp))
            .collect();
        check_room_sources(&self.fingerprint, &tps)?;
        self.rooms.open(room, sources, now)?;
        self.sources.insert(room, ranks);
        self.waiters.insert(room, sink);
        Ok(())
    }

    /// `room`'s pages are reserved: `lease`, holding `pages` in token
    /// order, with aux slot `aux_slot` (and `prefix_tokens` leading tokens
    /// decode already holds, which prefill need not send). Every source's
    /// link learns the room (events) before its destination is sent.
    /// Refused (the lease is dropped: its pages were never advertised) when
    /// the room is not waiting for pages.
    pub fn reserve(
        &mut self,
        room: RoomId,
        lease: L,
        pages: Vec<PageIndex>,
        aux_slot: AuxSlot,
        prefix_tokens: Option<u32>,
        now: Instant,
    ) -> Result<(), RefusedRoom> {
        if self.rooms.state(room) != Some(RoomState::Bootstrapping) {
            return Err(RefusedRoom::NotWaitingForPages(room.get()));
        }
        if prefix_tokens.is_some_and(|t| t > 0) {
            // Without the capability the prefix would not reach the peer,
            // which would then write the whole prompt from our first page.
            let lacking = self.sources.get(&room).into_iter().flatten().find(|r| {
                !self.peers.get(r).is_some_and(|p| {
                    p.control.is_some() && p.capabilities.contains(Capabilities::DESTINATION_PREFIX)
                })
            });
            if let Some(&peer) = lacking {
                return Err(RefusedRoom::PrefixUnsupported { peer });
            }
        }
        let sources = self.sources.remove(&room).unwrap_or_default();
        let mut sorted: Vec<u32> = pages.iter().map(|p| p.0).collect();
        sorted.sort_unstable();
        let registered: Vec<PeerId> = sources
            .into_iter()
            .filter(|r| self.peers.get(r).is_some_and(|p| p.link.is_some()))
            .collect();
        for &peer in &registered {
            self.events.push_back(ReceiverEvent::RegisterWrites {
                peer,
                room,
                pages: sorted.clone(),
                aux_slot: aux_slot.0,
            });
        }
        // The lease is held before the events are drained, so the shell
        // finds it when it registers the room with the links.
        self.held.insert(room, Held { lease, registered });
        match self
            .rooms
            .handle_pages_reserved(room, pages, aux_slot, prefix_tokens, now)
        {
            Ok(()) => {
                self.drive(now);
                Ok(())
            }
            Err(_) => {
                self.release(room, false);
                Err(RefusedRoom::NotWaitingForPages(room.get()))
            }
        }
    }

    /// The lease of `room` while it is held for a transfer (for the writer
    /// guards the shell gives link readers).
    pub fn lease(&self, room: RoomId) -> Option<&L> {
        self.held.get(&room).map(|h| &h.lease)
    }

    /// Abort `room` (client gone, validation, shutdown): it fails now, every
    /// source is told, its pages wait for the writers to drain.
    pub fn abort(&mut self, room: RoomId, error: TransferError, now: Instant) {
        self.rooms.abort(room, error, now);
        self.drive(now);
    }

    /// Counters and gauges.
    pub fn stats(&self) -> ReceiverStats {
        ReceiverStats {
            live_rooms: self.rooms.live_rooms(),
            peers_ranks: self
                .peers
                .iter()
                .filter(|(_, p)| p.control.is_some())
                .map(|(r, _)| *r)
                .collect(),
            links: self.peers.values().filter(|p| p.link.is_some()).count(),
            room_stats: self.rooms.stats().clone(),
            malformed_frames: self.malformed_frames,
            handshakes_failed: self.handshakes_failed,
            stalled: self.liveness.stalled(),
            leased_rooms: self.held.len(),
            waiters: self.waiters.len(),
        }
    }

    /// Stop: forget every peer, room, lease (dropped: their pages return
    /// once no link reader holds a writer guard) and outcome.
    pub fn shutdown(&mut self) {
        self.peers.clear();
        self.held.clear();
        self.aux.clear();
        self.sources.clear();
        self.waiters.clear();
        self.events.clear();
    }

    // ----- inside -----

    /// Carry out what the room table decided, until it has nothing more.
    fn drive(&mut self, now: Instant) {
        while let Some(a) = self.rooms.poll_action() {
            match a {
                ReceiverAction::CheckAux { room, .. } => {
                    let found = self.aux.get(&room).map_or(0, |l| l.written_room);
                    self.rooms.handle_aux_checked(room, found, now);
                }
                ReceiverAction::Commit { room, .. } => {
                    let landed = self.aux.remove(&room).map(|l| (l.aux, l.prompt));
                    if let Some(lease) = self.release(room, false) {
                        let (aux, prompt) = landed.unwrap_or((
                            AuxData {
                                first_token: 0,
                                logprob: 0.0,
                                top: crate::datalink::TopLogprobs::NONE,
                            },
                            Vec::new(),
                        ));
                        self.outcome(room, ReceiverOutcome::Success { lease, aux, prompt });
                    }
                }
                ReceiverAction::FailRequest { room, error } => {
                    self.sources.remove(&room);
                    self.outcome(room, ReceiverOutcome::Failed(error));
                }
                ReceiverAction::ReleasePages {
                    room,
                    fence_expired,
                    ..
                } => {
                    self.aux.remove(&room);
                    drop(self.release(room, fence_expired));
                    self.events.push_back(ReceiverEvent::Released {
                        room,
                        fence_expired,
                    });
                }
            }
        }
    }

    /// Take `room`'s lease back from its links (`may_write`: a writer may
    /// not have stopped).
    fn release(&mut self, room: RoomId, may_write: bool) -> Option<L> {
        let held = self.held.remove(&room)?;
        for peer in held.registered {
            self.events.push_back(ReceiverEvent::ForgetWrites {
                peer,
                room,
                may_write,
            });
        }
        Some(held.lease)
    }

    /// `room` ended: its sink hears how. Without one (the shell is
    /// stopping) the outcome is dropped, and a lease in it with it.
    fn outcome(&mut self, room: RoomId, outcome: ReceiverOutcome<L>) {
        if let Some(waiter) = self.waiters.remove(&room) {
            self.events.push_back(ReceiverEvent::Outcome {
                room,
                waiter,
                outcome,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Message, Outcome, Status};

    fn fp(kv_heads: u32, tp_rank: u32, tp_size: u32) -> Fingerprint {
        let mut f = crate::fuzz::sample_fingerprint();
        (f.kv_heads, f.tp_rank, f.tp_size) = (kv_heads, tp_rank, tp_size);
        f
    }

    #[test]
    fn room_sources_must_cover_every_required_prefill_rank() {
        let at = |rank, size| TpPosition { rank, size };
        // Equal TP: the one matching peer suffices.
        assert_eq!(check_room_sources(&fp(4, 0, 1), &[at(0, 1)]), Ok(()));
        // Fan-in 2 -> 1: both prefill ranks, in any order.
        assert_eq!(
            check_room_sources(&fp(4, 0, 1), &[at(1, 2), at(0, 2)]),
            Ok(())
        );
        let e = check_room_sources(&fp(4, 0, 1), &[at(0, 2)]).unwrap_err();
        assert!(e.to_string().ends_with("lack [1]"), "{e}");
        // 4 -> 2: decode rank 1 needs prefill ranks 2 and 3 only.
        assert_eq!(
            check_room_sources(&fp(4, 1, 2), &[at(2, 4), at(3, 4)]),
            Ok(())
        );
        let e = check_room_sources(&fp(4, 1, 2), &[at(0, 4), at(1, 4)]).unwrap_err();
        assert!(e.to_string().ends_with("lack [2, 3]"), "{e}");
        // Fan-out 1 -> 2: the single prefill peer serves both decode ranks.
        assert_eq!(check_room_sources(&fp(4, 1, 2), &[at(0, 1)]), Ok(()));
        // Mixed groups and no sources are refused; so is an impossible TP.
        assert_eq!(
            check_room_sources(&fp(4, 0, 1), &[at(0, 2), at(1, 4)]),
            Err(SourcesError::MixedGroups(vec![2, 4]))
        );
        assert_eq!(
            check_room_sources(&fp(4, 0, 1), &[]),
            Err(SourcesError::None)
        );
        assert!(matches!(
            check_room_sources(&fp(4, 0, 1), &[at(0, 3)]),
            Err(SourcesError::Rank(_))
        ));
        assert_eq!(TpPosition::of(&fp(4, 1, 2)), at(1, 2));
    }

    /// A lease that counts itself: dropped leases show in `live`.
    #[derive(Debug)]
    struct Lease(std::rc::Rc<std::cell::Cell<usize>>);

    impl Drop for Lease {
        fn drop(&mut self) {
            self.0.set(self.0.get() - 1);
        }
    }

    struct Fixture {
        ep: ReceiverEndpoint<Lease, u32>,
        live: std::rc::Rc<std::cell::Cell<usize>>,
        now: Instant,
    }

    const P: PeerId = PeerId(0);

    impl Fixture {
        fn new() -> Self {
            let now = Instant::now();
            let mut ep =
                ReceiverEndpoint::new(RoomConfig::default(), fp(4, 0, 1), Duration::from_secs(5));
            assert!(ep.handle_control_up(P, 1, Capabilities::ALL, now));
            ep.handle_link_up(P, 1, TpPosition { rank: 0, size: 1 });
            Self {
                ep,
                live: Default::default(),
                now,
            }
        }

        fn lease(&self) -> Lease {
            self.live.set(self.live.get() + 1);
            Lease(self.live.clone())
        }

        fn open_and_reserve(&mut self, room: RoomId, pages: &[u32]) {
            let sources = vec![Source {
                peer: P,
                required_destinations: 1,
            }];
            // The room's sink: its number.
            self.ep
                .open(room, sources, room.get() as u32, self.now)
                .unwrap();
            let lease = self.lease();
            let pages = pages.iter().map(|p| PageIndex(*p)).collect();
            self.ep
                .reserve(room, lease, pages, AuxSlot(3), None, self.now)
                .unwrap();
        }

        /// The aux record (carrying `written_room`) and prefill's success
        /// arrive for `room`.
        fn land(&mut self, room: RoomId, written_room: u64, first_token: u32) {
            let aux = AuxData {
                first_token,
                logprob: -0.25,
                top: crate::datalink::TopLogprobs::NONE,
            };
            self.ep
                .handle_aux(room, written_room, aux, vec![(first_token, -0.5)]);
            let status = Status {
                room,
                outcome: Outcome::Success,
            };
            self.ep.handle_message(P, Message::Status(status), self.now);
        }

        fn events(&mut self) -> Vec<ReceiverEvent<Lease, u32>> {
            std::iter::from_fn(|| self.ep.poll_event()).collect()
        }

        /// The one outcome among the events, heard by `room`'s sink.
        fn outcome(&mut self, room: RoomId) -> ReceiverOutcome<Lease> {
            let mut outcomes: Vec<_> = self
                .events()
                .into_iter()
                .filter_map(|e| match e {
                    ReceiverEvent::Outcome {
                        room: r,
                        waiter,
                        outcome,
                    } => {
                        assert_eq!((r, waiter), (room, room.get() as u32));
                        Some(outcome)
                    }
                    _ => None,
                })
                .collect();
            assert_eq!(outcomes.len(), 1, "one outcome");
            outcomes.pop().unwrap()
        }

        fn transmits(&mut self) -> Vec<Transmit> {
            std::iter::from_fn(|| self.ep.poll_transmit(self.now)).collect()
        }
    }

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    #[test]
    fn a_room_registers_with_its_link_before_its_destination_and_commits_with_its_aux() {
        let mut f = Fixture::new();
        let r = room(9);
        f.open_and_reserve(r, &[7, 2]);
        let ev = f.events();
        assert!(
            matches!(&ev[..], [ReceiverEvent::RegisterWrites { peer, room, pages, aux_slot: 3 }]
                if *peer == P && *room == r && pages == &vec![2, 7]),
            "{ev:?}"
        );
        assert!(f.ep.lease(r).is_some(), "the shell finds the lease");
        let tx: Vec<Transmit> = f
            .transmits()
            .into_iter()
            .filter(|t| !matches!(t.message, Message::Heartbeat(_)))
            .collect();
        assert!(
            matches!(&tx[..], [Transmit { to, message: Message::Destination(d) }] if *to == P && d.room == r),
            "{tx:?}"
        );
        assert!(f.events().is_empty(), "a live room's sink waits");
        f.land(r, r.get(), 5);
        let ev = f.events();
        match &ev[..] {
            [ReceiverEvent::ForgetWrites {
                peer,
                room,
                may_write: false,
            }, ReceiverEvent::Outcome {
                room: o,
                waiter: 9,
                outcome: ReceiverOutcome::Success { aux, prompt, .. },
            }] => {
                assert_eq!((*peer, *room, *o), (P, r, r));
                // The prompt scores ride with the aux record to the outcome.
                assert_eq!(prompt, &[(5, -0.5)]);
                assert_eq!(aux.first_token, 5);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.live.get(), 1, "the engine owns the lease now");
        let s = f.ep.stats();
        assert_eq!((s.live_rooms, s.leased_rooms, s.waiters), (0, 0, 0));
        drop(ev);
        assert_eq!(f.live.get(), 0);
    }

    #[test]
    fn a_wrong_room_in_the_aux_slot_fails_the_room_and_its_pages_come_back() {
        let mut f = Fixture::new();
        let r = room(9);
        f.open_and_reserve(r, &[1]);
        f.events();
        f.land(r, 12345, 5);
        match f.outcome(r) {
            ReceiverOutcome::Failed(e) => {
                assert!(matches!(e, TransferError::PeerMisbehaved { .. }), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.live.get(), 0, "the writer finished: pages are free");
        assert!(f.events().is_empty(), "one outcome");
    }

    #[test]
    fn an_abort_keeps_the_pages_until_the_writer_drained_or_the_fence() {
        let mut f = Fixture::new();
        let r = room(4);
        f.open_and_reserve(r, &[1, 2]);
        f.events();
        f.transmits();
        f.ep.abort(
            r,
            TransferError::Aborted {
                origin: crate::AbortOrigin::Client,
                reason: "gone".into(),
                http_status: 499,
            },
            f.now,
        );
        assert!(matches!(f.outcome(r), ReceiverOutcome::Failed(_)));
        assert_eq!(f.live.get(), 1, "a write may be in flight");
        assert!(f
            .transmits()
            .iter()
            .any(|t| matches!(t.message, Message::Abort(_))));
        // Nothing from the writer: the fence passes.
        let fence = f.ep.poll_timeout().unwrap();
        f.ep.handle_timeout(fence + Duration::from_secs(60));
        assert_eq!(f.live.get(), 0, "pages back at the fence");
        assert!(matches!(
            &f.events()[..],
            [
                ReceiverEvent::ForgetWrites { .. },
                ReceiverEvent::Released {
                    fence_expired: true,
                    ..
                }
            ]
        ));
        assert_eq!(f.ep.stats().leased_rooms, 0);
    }

    #[test]
    fn a_prefill_reporting_its_end_dead_must_be_connected_again() {
        let mut f = Fixture::new();
        let r = room(6);
        f.open_and_reserve(r, &[1]);
        f.events();
        // Another failure kind from the peer leaves its connection in use.
        let failed = |kind| {
            Message::Status(Status {
                room: r,
                outcome: Outcome::Failed {
                    kind,
                    reason: "x".into(),
                    http_status: Some(503),
                    code: None,
                },
            })
        };
        f.ep.handle_message(P, failed(FailureKind::Timeout), f.now);
        assert!(f.ep.is_connected(P));
        f.ep.handle_message(P, failed(FailureKind::PeerDead), f.now);
        assert!(!f.ep.is_connected(P), "a new room must reconnect first");
        assert!(
            f.ep.has_control(P),
            "the connection itself is not closed here"
        );
    }

    #[test]
    fn a_closed_control_connection_fails_its_rooms_and_closes_the_peer() {
        let mut f = Fixture::new();
        let r = room(5);
        f.open_and_reserve(r, &[1]);
        f.events();
        // An older connection of the same peer closing changes nothing.
        f.ep.handle_control_closed(P, 99, f.now);
        assert!(f.ep.is_connected(P));
        f.ep.handle_control_closed(P, 1, f.now);
        let ev = f.events();
        assert!(matches!(ev[0], ReceiverEvent::ClosePeer { peer } if peer == P));
        assert!(
            ev.iter().any(|e| matches!(
                e,
                ReceiverEvent::Outcome {
                    waiter: 5,
                    outcome: ReceiverOutcome::Failed(TransferError::PeerDead { .. }),
                    ..
                }
            )),
            "{ev:?}"
        );
        assert!(!f.ep.is_connected(P));
        assert_eq!(f.live.get(), 1, "a dead peer's pages wait for the fence");
        // A room for a peer that is gone is refused at once.
        let e =
            f.ep.open(
                room(6),
                vec![Source {
                    peer: P,
                    required_destinations: 1,
                }],
                6,
                f.now,
            )
            .unwrap_err();
        assert!(
            matches!(e, RefusedRoom::Room(TransferError::PeerDead { .. })),
            "{e}"
        );
    }

    #[test]
    fn a_cached_prefix_goes_only_to_sources_that_negotiated_delta_transfer() {
        let sources = || {
            vec![Source {
                peer: P,
                required_destinations: 1,
            }]
        };
        let reserve = |f: &mut Fixture, r: RoomId, prefix| {
            f.ep.open(r, sources(), 0, f.now).unwrap();
            let lease = f.lease();
            f.ep.reserve(r, lease, vec![PageIndex(4)], AuxSlot(1), prefix, f.now)
        };
        let mut f = Fixture::new();
        reserve(&mut f, room(30), Some(16)).unwrap();
        // The same peer reconnected without the capability.
        assert!(f.ep.handle_control_up(
            P,
            2,
            Capabilities::ALL.without(Capabilities::DESTINATION_PREFIX),
            f.now
        ));
        let e = reserve(&mut f, room(31), Some(16)).unwrap_err();
        assert_eq!(e, RefusedRoom::PrefixUnsupported { peer: P });
        assert_eq!(f.live.get(), 1, "the refused lease was dropped");
        // A whole transfer still works.
        reserve(&mut f, room(32), Some(0)).unwrap();
        reserve(&mut f, room(33), None).unwrap();
    }

    #[test]
    fn an_abandoned_connect_is_refused_when_it_comes_up_late_once() {
        let now = Instant::now();
        let mut ep: ReceiverEndpoint<Lease, u32> =
            ReceiverEndpoint::new(RoomConfig::default(), fp(4, 0, 1), Duration::from_secs(5));
        for r in 0..100 {
            ep.abandon(PeerId(r), now);
        }
        assert!(!ep.handle_control_up(
            PeerId(7),
            1,
            Capabilities::ALL,
            now + Duration::from_secs(5)
        ));
        assert!(ep.handle_control_up(
            PeerId(7),
            2,
            Capabilities::ALL,
            now + Duration::from_secs(5)
        ));
        // Past twice the handshake timeout, it is forgotten.
        assert!(ep.handle_control_up(
            PeerId(8),
            3,
            Capabilities::ALL,
            now + Duration::from_secs(11)
        ));
        // The next abandon forgets the expired ones.
        ep.abandon(PeerId(500), now + Duration::from_secs(11));
        assert_eq!(ep.abandoned.len(), 1);
        // A connected peer that is abandoned is simply closed.
        ep.abandon(PeerId(7), now + Duration::from_secs(11));
        assert!(!ep.has_control(PeerId(7)));
        assert_eq!(ep.abandoned.len(), 1);
    }
}
