//! The decode side's room table.
//!
//! A room is opened when the decode worker accepts a request
//! ([`ReceiverRooms::open`]) with the distinct prefill ranks it needs KV from
//! (see [`crate::rank::RankMap::required_prefill_ranks`]). It then expects:
//!
//! 1. `Bootstrapping` — its pages: the shell reserves them (backpressure) and
//!    calls [`ReceiverRooms::handle_pages_reserved`]; a `Destination` goes to
//!    every source rank. From this moment a write may be in flight.
//! 2. `WaitingForInput` → `Transferring` — a `Status` from every source.
//!    Only distinct required ranks count; duplicates and strangers do not.
//! 3. When all succeeded, the aux slot's room id: [`ReceiverAction::CheckAux`],
//!    answered with [`ReceiverRooms::handle_aux_checked`].
//! 4. `Success`: [`ReceiverAction::Commit`] hands the pages to the engine.
//!
//! On any failure the request is failed at once ([`ReceiverAction::FailRequest`]),
//! but the pages are released ([`ReceiverAction::ReleasePages`]) only when no
//! source may still be writing: each one has sent a `Status` or
//! `AbortAck { drained: true }`, or the abort fence passed. Until then the
//! room is `Draining`. A dead peer is failed immediately but its pages wait
//! for the fence too: a hung process may still be writing.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Instant;

use crate::error::{AbortOrigin, Misbehavior, Phase, TransferError};
use crate::ids::{AuxSlot, PageIndex, PeerId, RankId, Role, RoomId};
use crate::message::{Abort, AbortAck, Destination, Message, Outcome, Status};
use crate::rank::{RankError, RankMap};
use crate::room::{Deadlines, Expiring, RoomConfig, RoomState, RoomStats, Tombstone, Transmit};
use crate::timer::Timer;

/// A prefill peer a decode room needs KV from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    /// The prefill peer.
    pub peer: PeerId,
    /// How many decode ranks send that prefill rank a destination for this
    /// room (its `required_destinations`).
    pub required_destinations: u16,
}

impl Source {
    /// The sources decode rank `d` needs under `map`, each with the number of
    /// decode ranks that rank serves (fan-in and fan-out both covered);
    /// `peer_of` names the peer that plays each prefill TP rank.
    pub fn for_decode_rank(
        map: &RankMap,
        d: RankId,
        peer_of: impl Fn(RankId) -> PeerId,
    ) -> Result<Vec<Source>, RankError> {
        map.required_prefill_ranks(d)?
            .into_iter()
            .map(|p| {
                let n = map.destination_ranks(p)?.len();
                Ok(Source {
                    peer: peer_of(p),
                    required_destinations: u16::try_from(n).unwrap_or(u16::MAX),
                })
            })
            .collect()
    }
}

/// What the decode I/O shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum ReceiverAction {
    /// Every source reported success: read the aux slot and call
    /// [`ReceiverRooms::handle_aux_checked`] with the room id it carries.
    CheckAux {
        /// The room.
        room: RoomId,
        /// The slot to read.
        aux_slot: AuxSlot,
    },
    /// Success: the engine now owns these pages and the aux slot (append the
    /// first token and start decoding).
    Commit {
        /// The room.
        room: RoomId,
        /// Pages with the prompt's KV.
        pages: Vec<PageIndex>,
        /// Aux slot with first token / logprob.
        aux_slot: AuxSlot,
    },
    /// The request failed: answer the client with this error now.
    FailRequest {
        /// The room.
        room: RoomId,
        /// Why.
        error: TransferError,
    },
    /// No write can land in these pages any more: return them (and reset
    /// the aux slot) to the pool.
    ReleasePages {
        /// The room.
        room: RoomId,
        /// The pages.
        pages: Vec<PageIndex>,
        /// The aux slot.
        aux_slot: AuxSlot,
        /// True when released because the abort fence passed rather than on
        /// every writer's word (logged and counted).
        fence_expired: bool,
    },
}

fn abort_message(room: RoomId, error: &TransferError) -> Message {
    Message::Abort(Abort {
        room,
        reason: error.reason(),
        http_status: Some(error.http_status()),
        origin: Some(match error {
            TransferError::Aborted { origin, .. } => *origin,
            _ => AbortOrigin::Decode,
        }),
    })
}

/// Pages handed to [`ReceiverRooms::handle_pages_reserved`] that the room
/// does not take (it is gone, or already has pages). Nobody was told about
/// them: the shell frees them immediately.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagesRefused {
    /// The pages.
    pub pages: Vec<PageIndex>,
    /// The aux slot.
    pub aux_slot: AuxSlot,
    /// True when the room is live but already had its pages (a shell bug).
    pub room_live: bool,
}

/// Per-room state, named for what the room expects next.
#[derive(Debug)]
enum Expect {
    /// Bootstrapping: the shell's page reservation.
    Pages,
    /// WaitingForInput (`started == false`) / Transferring: every source's Status.
    Statuses {
        succeeded: BTreeSet<PeerId>,
        started: bool,
    },
    /// Transferring: the aux slot check.
    AuxCheck,
    /// Draining: these sources may still be writing.
    Drain {
        may_write: BTreeSet<PeerId>,
        error: TransferError,
    },
}

#[derive(Debug)]
struct ReceiverRoom {
    expect: Expect,
    sources: Vec<Source>,
    lease: Option<(Vec<PageIndex>, AuxSlot)>,
    deadline: Instant,
}

impl ReceiverRoom {
    fn state(&self) -> RoomState {
        match self.expect {
            Expect::Pages => RoomState::Bootstrapping,
            Expect::Statuses { started: false, .. } => RoomState::WaitingForInput,
            Expect::Statuses { started: true, .. } | Expect::AuxCheck => RoomState::Transferring,
            Expect::Drain { .. } => RoomState::Draining,
        }
    }

    fn has_source(&self, peer: PeerId) -> bool {
        self.sources.iter().any(|s| s.peer == peer)
    }
}

/// The decode side's rooms. One instance per decode rank; the shell
/// identifies prefill peers by their [`PeerId`].
#[derive(Debug)]
pub struct ReceiverRooms {
    config: RoomConfig,
    rooms: HashMap<RoomId, ReceiverRoom>,
    deadlines: Deadlines,
    closed: Expiring<Tombstone>,
    transmits: VecDeque<Transmit>,
    actions: VecDeque<ReceiverAction>,
    stats: RoomStats,
}

impl ReceiverRooms {
    /// An empty table.
    pub fn new(config: RoomConfig) -> Self {
        let cap = config.max_unknown_rooms;
        Self {
            config,
            rooms: HashMap::new(),
            deadlines: Deadlines::default(),
            closed: Expiring::new(cap),
            transmits: VecDeque::new(),
            actions: VecDeque::new(),
            stats: RoomStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> &RoomStats {
        &self.stats
    }

    /// Live (non-terminal) rooms, Draining included.
    pub fn live_rooms(&self) -> usize {
        self.rooms.len()
    }

    /// Pages held by live rooms (not yet committed or released).
    pub fn leased_pages(&self) -> usize {
        self.rooms
            .values()
            .filter_map(|r| r.lease.as_ref())
            .map(|(p, _)| p.len())
            .sum()
    }

    /// Deadlines in the heap, stale ones included (tests of its bound).
    #[cfg(test)]
    fn pending_deadlines(&self) -> usize {
        self.deadlines.len()
    }

    /// Live rooms in `state` (a gauge for metrics: rooms by state).
    pub fn rooms_in(&self, state: RoomState) -> usize {
        self.rooms.values().filter(|r| r.state() == state).count()
    }

    /// Live state of `room`, or its terminal state while remembered.
    pub fn state(&self, room: RoomId) -> Option<RoomState> {
        self.rooms
            .get(&room)
            .map(ReceiverRoom::state)
            .or_else(|| self.closed.get(room).map(Tombstone::state))
    }

    /// How `room` ended, while remembered.
    pub fn tombstone(&self, room: RoomId) -> Option<&Tombstone> {
        self.closed.get(room)
    }

    /// Next message to send. Call until `None` after every input.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// Next action for the shell. Call until `None` after every input.
    pub fn poll_action(&mut self) -> Option<ReceiverAction> {
        self.actions.pop_front()
    }

    /// Earliest deadline; call [`Self::handle_timeout`] then.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines
            .next()
            .into_iter()
            .chain(self.closed.next_expiry())
            .min()
    }

    /// Accept a request for `room` needing KV from `sources` (distinct,
    /// non-empty). Fails with `DuplicateRoom`, `Capacity`, or `Internal` for
    /// bad sources.
    pub fn open(
        &mut self,
        room: RoomId,
        sources: Vec<Source>,
        now: Instant,
    ) -> Result<(), TransferError> {
        let distinct: BTreeSet<PeerId> = sources.iter().map(|s| s.peer).collect();
        let refused = if sources.is_empty()
            || distinct.len() != sources.len()
            || sources.iter().any(|s| s.required_destinations == 0)
        {
            Some(TransferError::Internal {
                reason: "a room needs distinct sources with at least one destination each".into(),
            })
        } else if self.rooms.contains_key(&room) || self.closed.get(room).is_some() {
            Some(TransferError::DuplicateRoom)
        } else if self.rooms.len() >= self.config.max_live_rooms {
            Some(TransferError::Capacity {
                what: format!("{} live rooms", self.rooms.len()),
            })
        } else {
            None
        };
        if let Some(e) = refused {
            self.stats.open_rejected += 1;
            return Err(e);
        }
        self.stats.opened += 1;
        self.rooms.insert(
            room,
            ReceiverRoom {
                expect: Expect::Pages,
                sources,
                lease: None,
                deadline: now + self.config.timers.get(Timer::Bootstrap),
            },
        );
        let at = now + self.config.timers.get(Timer::Bootstrap);
        self.deadlines.push(at, room);
        Ok(())
    }

    /// The shell reserved `pages` and `aux_slot` for `room`; destinations
    /// are sent. If the room is gone or not waiting for pages, the pages were
    /// never advertised to anyone and come straight back as
    /// `Err(PagesRefused)`: free them at once.
    pub fn handle_pages_reserved(
        &mut self,
        room: RoomId,
        pages: Vec<PageIndex>,
        aux_slot: AuxSlot,
        prefix_tokens: Option<u32>,
        now: Instant,
    ) -> Result<(), PagesRefused> {
        let Some(r) = self
            .rooms
            .get_mut(&room)
            .filter(|r| matches!(r.expect, Expect::Pages))
        else {
            let live = self.rooms.contains_key(&room);
            if live {
                self.stats.violations += 1;
            }
            return Err(PagesRefused {
                pages,
                aux_slot,
                room_live: live,
            });
        };
        for s in &r.sources {
            self.transmits.push_back(Transmit {
                to: s.peer,
                message: Message::Destination(Destination {
                    room,
                    pages: pages.clone(),
                    aux_slot,
                    required_destinations: s.required_destinations,
                    prefix_tokens,
                }),
            });
        }
        r.lease = Some((pages, aux_slot));
        r.expect = Expect::Statuses {
            succeeded: BTreeSet::new(),
            started: false,
        };
        r.deadline = now + self.config.timers.get(Timer::WaitingForInput);
        self.deadlines.push(r.deadline, room);
        Ok(())
    }

    /// The transport saw data for `room` arrive (optional; moves
    /// WaitingForInput to Transferring and its deadline to the transfer one).
    pub fn handle_transfer_progress(&mut self, room: RoomId, now: Instant) {
        let transfer = self.config.timers.get(Timer::Transfer);
        if let Some(r) = self.rooms.get_mut(&room) {
            if let Expect::Statuses { started, .. } = &mut r.expect {
                if !*started {
                    *started = true;
                    r.deadline = now + transfer;
                    self.deadlines.push(r.deadline, room);
                }
            }
        }
    }

    /// A message from prefill rank `from`.
    pub fn handle_message(&mut self, from: PeerId, msg: Message, now: Instant) {
        match msg {
            Message::Status(s) => self.on_status(from, s, now),
            Message::Abort(a) => self.on_abort(from, a, now),
            Message::AbortAck(a) => self.on_abort_ack(from, a, now),
            Message::Heartbeat(_) => {}
            Message::Destination(_) | Message::Register(_) | Message::AuthProof(_) => {
                self.stats.violations += 1;
            }
        }
    }

    fn on_status(&mut self, from: PeerId, s: Status, now: Instant) {
        let room = s.room;
        let Some(r) = self.rooms.get_mut(&room) else {
            self.stats.unknown_room_events += 1;
            return;
        };
        if !r.has_source(from) {
            self.stats.violations += 1;
            return;
        }
        match (&mut r.expect, s.outcome) {
            (Expect::Drain { may_write, .. }, _) => {
                // Any status means that rank stopped writing. Success after
                // failure stays failed.
                may_write.remove(&from);
                if may_write.is_empty() {
                    self.finish(room, false, now);
                }
            }
            (Expect::Statuses { succeeded, started }, Outcome::Success) => {
                if !succeeded.insert(from) {
                    self.stats.duplicates += 1;
                    return;
                }
                if !*started {
                    *started = true;
                    r.deadline = now + self.config.timers.get(Timer::Transfer);
                    self.deadlines.push(r.deadline, room);
                }
                if succeeded.len() == r.sources.len() {
                    r.expect = Expect::AuxCheck;
                    r.deadline = now + self.config.timers.get(Timer::Transfer);
                    self.deadlines.push(r.deadline, room);
                    if let Some((_, aux_slot)) = &r.lease {
                        self.actions.push_back(ReceiverAction::CheckAux {
                            room,
                            aux_slot: *aux_slot,
                        });
                    }
                }
            }
            (
                Expect::Statuses { succeeded, .. },
                Outcome::Failed {
                    kind,
                    reason,
                    http_status,
                    code,
                },
            ) => {
                if succeeded.contains(&from) {
                    // A rank that reported success may not fail afterwards,
                    // but a failure always wins: fail the room.
                    self.stats.violations += 1;
                }
                let status = http_status.unwrap_or_else(|| kind.default_http_status());
                let error = TransferError::from_wire(kind, reason, status, code, Role::Prefill);
                self.fail_room(room, error, Some(from), now);
            }
            (Expect::AuxCheck, Outcome::Success) => self.stats.duplicates += 1,
            (
                Expect::AuxCheck,
                Outcome::Failed {
                    kind,
                    reason,
                    http_status,
                    code,
                },
            ) => {
                self.stats.violations += 1;
                let status = http_status.unwrap_or_else(|| kind.default_http_status());
                let error = TransferError::from_wire(kind, reason, status, code, Role::Prefill);
                self.fail_room(room, error, Some(from), now);
            }
            (Expect::Pages, _) => {
                // No destination was sent yet: nobody may report on it.
                self.stats.violations += 1;
            }
        }
    }

    fn on_abort(&mut self, from: PeerId, a: Abort, now: Instant) {
        let room = a.room;
        // Decode never writes to prefill: its ack is always drained.
        self.transmits.push_back(Transmit {
            to: from,
            message: Message::AbortAck(AbortAck {
                room,
                drained: true,
            }),
        });
        if !self.rooms.get(&room).is_some_and(|r| r.has_source(from)) {
            self.stats.unknown_room_events += 1;
            return;
        }
        let error = TransferError::Aborted {
            origin: a.origin.unwrap_or(AbortOrigin::Prefill),
            reason: a.reason,
            http_status: a.http_status.unwrap_or(503),
        };
        // An Abort from prefill means its writes may still land: `from` stays
        // in the fence.
        self.fail_room(room, error, None, now);
    }

    fn on_abort_ack(&mut self, from: PeerId, a: AbortAck, now: Instant) {
        let room = a.room;
        let Some(r) = self.rooms.get_mut(&room) else {
            self.stats.unknown_room_events += 1;
            return;
        };
        let Expect::Drain { may_write, .. } = &mut r.expect else {
            self.stats.violations += 1;
            return;
        };
        if a.drained {
            may_write.remove(&from);
            if may_write.is_empty() {
                self.finish(room, false, now);
            }
        }
    }

    /// The aux slot of `room` carries room id `found` (raw, as read).
    pub fn handle_aux_checked(&mut self, room: RoomId, found: u64, now: Instant) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        if !matches!(r.expect, Expect::AuxCheck) {
            self.stats.violations += 1;
            return;
        }
        if found != room.get() {
            let error = TransferError::PeerMisbehaved {
                what: Misbehavior::AuxRoomMismatch {
                    found,
                    expected: room.get(),
                },
            };
            self.fail_room(room, error, None, now);
            return;
        }
        let Some(r) = self.rooms.remove(&room) else {
            return;
        };
        self.stats.succeeded += 1;
        if let Some((pages, aux_slot)) = r.lease {
            self.actions.push_back(ReceiverAction::Commit {
                room,
                pages,
                aux_slot,
            });
        }
        self.remember(room, Tombstone::Success, now);
    }

    /// Abort `room` locally (client gone, router, validation, shutdown):
    /// the request fails now, every source is told, pages wait for drain.
    pub fn abort(&mut self, room: RoomId, error: TransferError, now: Instant) {
        if self.rooms.contains_key(&room) {
            self.fail_room(room, error, None, now);
        } else {
            self.stats.unknown_room_events += 1;
        }
    }

    /// Prefill peer `peer` is dead: fail every room it is a source of.
    pub fn handle_peer_dead(&mut self, peer: PeerId, now: Instant) {
        let mut hit: Vec<RoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.has_source(peer) && !matches!(r.expect, Expect::Drain { .. }))
            .map(|(id, _)| *id)
            .collect();
        hit.sort();
        for room in hit {
            let error = TransferError::PeerDead {
                peer,
                detail: "prefill peer stopped answering".into(),
            };
            self.fail_room(room, error, None, now);
        }
    }

    /// Fire every deadline at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.closed.expire(now);
        let due = self.deadlines.pop_due(now);
        for room in due {
            let Some(r) = self.rooms.get(&room).filter(|r| r.deadline <= now) else {
                continue;
            };
            let (phase, timer) = match r.expect {
                Expect::Pages => (Phase::Bootstrapping, Timer::Bootstrap),
                Expect::Statuses { started: false, .. } => {
                    (Phase::WaitingForInput, Timer::WaitingForInput)
                }
                Expect::Statuses { started: true, .. } | Expect::AuxCheck => {
                    (Phase::Transferring, Timer::Transfer)
                }
                Expect::Drain { .. } => {
                    self.stats.fence_expired += 1;
                    self.finish(room, true, now);
                    continue;
                }
            };
            let after = self.config.timers.get(timer);
            self.fail_room(room, TransferError::Timeout { phase, after }, None, now);
        }
        if self.deadlines.len() > 4 * self.rooms.len() + 1024 {
            self.deadlines
                .rebuild(self.rooms.iter().map(|(id, r)| (r.deadline, *id)));
        }
    }

    fn remember(&mut self, room: RoomId, t: Tombstone, now: Instant) {
        let expires = now + self.config.timers.get(Timer::UnknownRoomTtl);
        self.closed.insert(room, t, expires);
    }

    /// Fail a live room. `stopped` is a source known to have stopped writing
    /// (it reported `Status(Failed)`).
    fn fail_room(
        &mut self,
        room: RoomId,
        error: TransferError,
        stopped: Option<PeerId>,
        now: Instant,
    ) {
        let fence = self.config.timers.get(Timer::AbortAckFence);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        // Before pages are reserved no write can exist, but the sources
        // must still hear the abort: a prefill waiting for this room's
        // destination would otherwise wait for its bootstrap deadline.
        if matches!(r.expect, Expect::Pages) {
            for s in &r.sources {
                if Some(s.peer) != stopped {
                    self.transmits.push_back(Transmit {
                        to: s.peer,
                        message: abort_message(room, &error),
                    });
                }
            }
        }
        let may_write: BTreeSet<PeerId> = match &r.expect {
            Expect::Drain { .. } => return,
            Expect::Pages | Expect::AuxCheck => BTreeSet::new(),
            Expect::Statuses { succeeded, .. } => r
                .sources
                .iter()
                .map(|s| s.peer)
                .filter(|k| !succeeded.contains(k) && Some(*k) != stopped)
                .collect(),
        };
        for to in &may_write {
            self.transmits.push_back(Transmit {
                to: *to,
                message: abort_message(room, &error),
            });
        }
        self.actions.push_back(ReceiverAction::FailRequest {
            room,
            error: error.clone(),
        });
        self.stats.failed += 1;
        let empty = may_write.is_empty();
        r.expect = Expect::Drain { may_write, error };
        r.deadline = now + fence;
        self.deadlines.push(r.deadline, room);
        if empty {
            self.finish(room, false, now);
        }
    }

    /// Close a draining room and release its pages.
    fn finish(&mut self, room: RoomId, fence_expired: bool, now: Instant) {
        let Some(r) = self.rooms.remove(&room) else {
            return;
        };
        if let Some((pages, aux_slot)) = r.lease {
            self.actions.push_back(ReceiverAction::ReleasePages {
                room,
                pages,
                aux_slot,
                fence_expired,
            });
        }
        let error = match r.expect {
            Expect::Drain { error, .. } => error,
            _ => TransferError::Internal {
                reason: "room closed outside Draining".into(),
            },
        };
        self.remember(
            room,
            Tombstone::Failed {
                error,
                drained: !fence_expired,
            },
            now,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FailureKind;
    use std::time::Duration;

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    fn sources(ranks: &[u32]) -> Vec<Source> {
        ranks
            .iter()
            .map(|r| Source {
                peer: PeerId(*r),
                required_destinations: 1,
            })
            .collect()
    }

    fn pages() -> Vec<PageIndex> {
        vec![PageIndex(7), PageIndex(3)]
    }

    fn drain(t: &mut ReceiverRooms) -> (Vec<Transmit>, Vec<ReceiverAction>) {
        (
            std::iter::from_fn(|| t.poll_transmit()).collect(),
            std::iter::from_fn(|| t.poll_action()).collect(),
        )
    }

    fn status(r: RoomId, outcome: Outcome) -> Message {
        Message::Status(Status { room: r, outcome })
    }

    fn ack(r: RoomId, drained: bool) -> Message {
        Message::AbortAck(AbortAck { room: r, drained })
    }

    fn release(r: RoomId, fence_expired: bool) -> ReceiverAction {
        ReceiverAction::ReleasePages {
            room: r,
            pages: pages(),
            aux_slot: AuxSlot(4),
            fence_expired,
        }
    }

    /// A room with sources `ranks`, pages reserved, destinations drained.
    fn reserved(t: &mut ReceiverRooms, r: RoomId, ranks: &[u32], now: Instant) {
        t.open(r, sources(ranks), now).unwrap();
        t.handle_pages_reserved(r, pages(), AuxSlot(4), None, now)
            .unwrap();
        let (tx, _) = drain(t);
        assert_eq!(tx.len(), ranks.len());
    }

    #[test]
    fn success_needs_every_distinct_source_then_the_aux_check() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(1);
        t.open(r, sources(&[0, 1]), t0).unwrap();
        assert_eq!(t.state(r), Some(RoomState::Bootstrapping));
        t.handle_pages_reserved(r, pages(), AuxSlot(4), Some(16), t0)
            .unwrap();
        let (tx, _) = drain(&mut t);
        assert_eq!(tx.iter().map(|x| x.to.0).collect::<Vec<_>>(), vec![0, 1]);
        let Message::Destination(d) = &tx[1].message else {
            panic!()
        };
        assert_eq!(
            (d.pages.clone(), d.aux_slot, d.prefix_tokens),
            (pages(), AuxSlot(4), Some(16))
        );
        assert_eq!(t.state(r), Some(RoomState::WaitingForInput));
        t.handle_message(PeerId(0), status(r, Outcome::Success), t0);
        assert_eq!(t.state(r), Some(RoomState::Transferring));
        t.handle_message(PeerId(0), status(r, Outcome::Success), t0);
        t.handle_message(PeerId(9), status(r, Outcome::Success), t0);
        assert_eq!(
            drain(&mut t).1,
            vec![],
            "a duplicate and a stranger do not complete the room"
        );
        assert_eq!((t.stats().duplicates, t.stats().violations), (1, 1));
        t.handle_message(PeerId(1), status(r, Outcome::Success), t0);
        assert_eq!(
            drain(&mut t).1,
            vec![ReceiverAction::CheckAux {
                room: r,
                aux_slot: AuxSlot(4)
            }]
        );
        t.handle_aux_checked(r, 1, t0);
        assert_eq!(
            drain(&mut t).1,
            vec![ReceiverAction::Commit {
                room: r,
                pages: pages(),
                aux_slot: AuxSlot(4)
            }]
        );
        assert_eq!((t.live_rooms(), t.leased_pages()), (0, 0));
        assert_eq!(t.state(r), Some(RoomState::Success));
    }

    #[test]
    fn aux_slot_with_another_room_fails_with_500() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(2);
        reserved(&mut t, r, &[0], t0);
        t.handle_message(PeerId(0), status(r, Outcome::Success), t0);
        drain(&mut t);
        t.handle_aux_checked(r, 99, t0);
        let (_, acts) = drain(&mut t);
        let ReceiverAction::FailRequest { error, .. } = &acts[0] else {
            panic!("{acts:?}")
        };
        assert_eq!(
            (error.error_type(), error.http_status()),
            ("peer_misbehaved", 500)
        );
        assert_eq!(error.to_string(), "peer misbehaved: aux slot carries room 0x0000000000000063, expected 0x0000000000000002");
        assert_eq!(acts[1], release(r, false));
    }

    #[test]
    fn prefill_rejection_keeps_reason_and_status_and_fences_other_sources() {
        // Seed 004 on the decode side, with two sources.
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(3);
        reserved(&mut t, r, &[0, 1], t0);
        let failed = Outcome::Failed {
            kind: FailureKind::Rejected,
            reason: "prompt too long".into(),
            http_status: Some(400),
            code: None,
        };
        t.handle_message(PeerId(0), status(r, failed), t0);
        let (tx, acts) = drain(&mut t);
        assert_eq!(
            acts,
            vec![ReceiverAction::FailRequest {
                room: r,
                error: TransferError::Rejected {
                    http_status: 400,
                    reason: "prompt too long".into(),
                    code: None,
                }
            }]
        );
        assert_eq!(tx.len(), 1);
        assert_eq!(
            tx[0].to,
            PeerId(1),
            "only the source that may still write is aborted"
        );
        let Message::Abort(a) = &tx[0].message else {
            panic!()
        };
        assert_eq!(
            (a.http_status, a.reason.as_str()),
            (Some(400), "prompt too long")
        );
        assert_eq!(t.state(r), Some(RoomState::Draining));
        assert_eq!(t.leased_pages(), 2);
        // A late success after the failure stays failed.
        t.handle_message(PeerId(1), status(r, Outcome::Success), t0);
        assert_eq!(drain(&mut t).1, vec![release(r, false)]);
        assert_eq!(t.state(r), Some(RoomState::Failed));
    }

    #[test]
    fn local_abort_releases_only_after_every_drained_ack_or_the_fence() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let (a, b) = (room(4), room(5));
        reserved(&mut t, a, &[0, 1], t0);
        reserved(&mut t, b, &[0], t0);
        let client = TransferError::Aborted {
            origin: AbortOrigin::Client,
            reason: "client went away".into(),
            http_status: 499,
        };
        t.abort(a, client.clone(), t0);
        t.abort(b, client.clone(), t0);
        let (tx, acts) = drain(&mut t);
        assert_eq!(tx.len(), 3);
        assert!(tx.iter().all(|x| matches!(&x.message, Message::Abort(m) if m.origin == Some(AbortOrigin::Client) && m.http_status == Some(499))));
        assert_eq!(
            acts,
            vec![
                ReceiverAction::FailRequest {
                    room: a,
                    error: client.clone()
                },
                ReceiverAction::FailRequest {
                    room: b,
                    error: client
                }
            ]
        );
        t.handle_message(PeerId(0), ack(a, true), t0);
        t.handle_message(PeerId(1), ack(a, false), t0);
        t.handle_message(PeerId(0), ack(b, true), t0);
        assert_eq!(
            drain(&mut t).1,
            vec![ReceiverAction::ReleasePages {
                room: b,
                pages: pages(),
                aux_slot: AuxSlot(4),
                fence_expired: false
            }]
        );
        assert_eq!(
            t.state(a),
            Some(RoomState::Draining),
            "rank 1 is not drained"
        );
        t.handle_timeout(t0 + Duration::from_millis(4999));
        assert_eq!(drain(&mut t).1, vec![]);
        t.handle_timeout(t0 + Duration::from_secs(5));
        assert_eq!(drain(&mut t).1, vec![release(a, true)]);
        assert_eq!(
            (t.live_rooms(), t.leased_pages(), t.stats().fence_expired),
            (0, 0, 1)
        );
    }

    #[test]
    fn abort_before_pages_needs_no_fence_and_late_pages_come_back() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(6);
        t.open(r, sources(&[0]), t0).unwrap();
        t.abort(
            r,
            TransferError::Aborted {
                origin: AbortOrigin::Router,
                reason: "x".into(),
                http_status: 503,
            },
            t0,
        );
        let (tx, acts) = drain(&mut t);
        assert_eq!(
            tx.len(),
            1,
            "the source hears of it even before any destination"
        );
        assert!(matches!(&tx[0].message, Message::Abort(a) if a.http_status == Some(503)));
        assert!(matches!(
            acts.as_slice(),
            [ReceiverAction::FailRequest { .. }]
        ));
        assert_eq!(t.live_rooms(), 0, "no fence: nothing could be written");
        let refused = t
            .handle_pages_reserved(r, pages(), AuxSlot(4), None, t0)
            .unwrap_err();
        assert_eq!(
            refused,
            PagesRefused {
                pages: pages(),
                aux_slot: AuxSlot(4),
                room_live: false
            }
        );
        assert_eq!(drain(&mut t), (vec![], vec![]));
        assert_eq!(t.live_rooms(), 0);
    }

    #[test]
    fn unknown_rooms_are_never_created() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(7);
        t.handle_message(PeerId(0), status(r, Outcome::Success), t0);
        t.handle_message(PeerId(0), ack(r, true), t0);
        t.handle_message(
            PeerId(0),
            Message::Abort(Abort {
                room: r,
                reason: "x".into(),
                http_status: None,
                origin: None,
            }),
            t0,
        );
        let (tx, acts) = drain(&mut t);
        assert_eq!(
            tx,
            vec![Transmit {
                to: PeerId(0),
                message: ack(r, true)
            }]
        );
        assert!(acts.is_empty());
        assert_eq!(
            (t.live_rooms(), t.state(r), t.stats().unknown_room_events),
            (0, None, 3)
        );
    }

    #[test]
    fn dead_prefill_fails_now_but_fences_its_pages() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(8);
        reserved(&mut t, r, &[0], t0);
        t.handle_peer_dead(PeerId(0), t0);
        let (_, acts) = drain(&mut t);
        let [ReceiverAction::FailRequest { error, .. }] = acts.as_slice() else {
            panic!("{acts:?}")
        };
        assert_eq!(
            (error.error_type(), error.http_status()),
            ("peer_dead", 503)
        );
        assert_eq!(t.leased_pages(), 2);
        t.handle_timeout(t0 + Duration::from_secs(5));
        assert_eq!(drain(&mut t).1, vec![release(r, true)]);
    }

    #[test]
    fn waiting_timeout_aborts_sources_with_504() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(9);
        reserved(&mut t, r, &[0], t0);
        t.handle_timeout(t0 + Duration::from_secs(30));
        let (tx, acts) = drain(&mut t);
        let [ReceiverAction::FailRequest { error, .. }] = acts.as_slice() else {
            panic!("{acts:?}")
        };
        assert_eq!((error.error_type(), error.http_status()), ("timeout", 504));
        assert_eq!(
            error.to_string(),
            "timed out in waiting_for_input after 30.0 s"
        );
        assert!(matches!(&tx[0].message, Message::Abort(a) if a.http_status == Some(504)));
    }

    #[test]
    fn a_superseded_deadline_does_not_fire() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(12);
        reserved(&mut t, r, &[0, 1], t0);
        let t1 = t0 + Duration::from_secs(1);
        t.handle_message(PeerId(0), status(r, Outcome::Success), t1);
        // The waiting deadline (t0 + 30 s) is stale: the transfer one is t1 + 30 s.
        t.handle_timeout(t0 + Duration::from_secs(30));
        assert_eq!(t.state(r), Some(RoomState::Transferring));
        assert_eq!(drain(&mut t), (vec![], vec![]));
        t.handle_timeout(t1 + Duration::from_secs(30));
        assert_eq!(t.state(r), Some(RoomState::Draining));
    }

    #[test]
    fn sources_follow_the_rank_map() {
        let four_to_two = RankMap::new(8, 4, 2).unwrap();
        assert_eq!(
            Source::for_decode_rank(&four_to_two, RankId(1), |r| PeerId(r.0 + 10)).unwrap(),
            vec![
                Source {
                    peer: PeerId(12),
                    required_destinations: 1
                },
                Source {
                    peer: PeerId(13),
                    required_destinations: 1
                }
            ]
        );
        let two_to_four = RankMap::new(8, 2, 4).unwrap();
        assert_eq!(
            Source::for_decode_rank(&two_to_four, RankId(3), |r| PeerId(r.0 + 10)).unwrap(),
            vec![Source {
                peer: PeerId(11),
                required_destinations: 2
            }]
        );
        assert!(Source::for_decode_rank(&two_to_four, RankId(4), |r| PeerId(r.0)).is_err());
    }

    #[test]
    fn duplicate_and_bad_opens_are_refused() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        t.open(room(10), sources(&[0]), t0).unwrap();
        assert_eq!(
            t.open(room(10), sources(&[0]), t0),
            Err(TransferError::DuplicateRoom)
        );
        assert_eq!(
            t.open(room(11), sources(&[0, 0]), t0)
                .unwrap_err()
                .error_type(),
            "internal"
        );
        assert_eq!(
            t.open(room(11), vec![], t0).unwrap_err().error_type(),
            "internal"
        );
        assert_eq!(t.live_rooms(), 1);
    }

    fn failed(kind: FailureKind) -> Outcome {
        Outcome::Failed {
            kind,
            reason: "x".into(),
            http_status: None,
            code: None,
        }
    }

    fn client() -> TransferError {
        TransferError::Aborted {
            origin: AbortOrigin::Client,
            reason: "client went away".into(),
            http_status: 499,
        }
    }

    /// Each counter of [`RoomStats`] moves by exactly one for each event it
    /// counts (metrics read them; a counter stuck at 0 would hide faults).
    #[test]
    fn every_counter_counts_each_event_once() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let counts = |t: &ReceiverRooms| {
            let s = t.stats();
            (
                s.opened,
                s.open_rejected,
                s.succeeded,
                s.failed,
                s.violations,
                s.duplicates,
            )
        };
        let (a, b, c) = (room(31), room(32), room(33));
        t.open(a, sources(&[0]), t0).unwrap();
        assert_eq!(counts(&t), (1, 0, 0, 0, 0, 0));
        assert!(t.open(a, sources(&[0]), t0).is_err());
        assert_eq!(counts(&t), (1, 1, 0, 0, 0, 0));
        // A status before any destination was sent breaks the protocol.
        t.handle_message(PeerId(0), status(a, Outcome::Success), t0);
        assert_eq!(counts(&t), (1, 1, 0, 0, 1, 0));
        t.handle_pages_reserved(a, pages(), AuxSlot(4), None, t0)
            .unwrap();
        // Pages reserved twice for a live room; a prefill-only message.
        assert!(t
            .handle_pages_reserved(a, pages(), AuxSlot(4), None, t0)
            .is_err());
        assert_eq!(counts(&t), (1, 1, 0, 0, 2, 0));
        let dest = Message::Destination(Destination {
            room: a,
            pages: pages(),
            aux_slot: AuxSlot(4),
            required_destinations: 1,
            prefix_tokens: None,
        });
        t.handle_message(PeerId(0), dest, t0);
        assert_eq!(counts(&t), (1, 1, 0, 0, 3, 0));
        // An aux check for a room not at that step.
        t.handle_aux_checked(a, a.get(), t0);
        assert_eq!(counts(&t), (1, 1, 0, 0, 4, 0));
        t.handle_message(PeerId(0), status(a, Outcome::Success), t0);
        // A second success while the aux is checked is a duplicate.
        t.handle_message(PeerId(0), status(a, Outcome::Success), t0);
        assert_eq!(counts(&t), (1, 1, 0, 0, 4, 1));
        t.handle_aux_checked(a, a.get(), t0);
        assert_eq!(counts(&t), (1, 1, 1, 0, 4, 1));
        // A source that failed after its success, in the aux check.
        drain(&mut t);
        reserved(&mut t, b, &[0], t0);
        t.handle_message(PeerId(0), status(b, Outcome::Success), t0);
        t.handle_message(PeerId(0), status(b, failed(FailureKind::Internal)), t0);
        assert_eq!(counts(&t), (2, 1, 1, 1, 5, 1));
        // Success then failure from the same source while others still write.
        drain(&mut t);
        reserved(&mut t, c, &[0, 1], t0);
        t.handle_message(PeerId(0), status(c, Outcome::Success), t0);
        t.handle_message(PeerId(0), status(c, failed(FailureKind::Internal)), t0);
        assert_eq!(counts(&t), (3, 1, 1, 2, 6, 1));
        // An abort ack for a room that is not draining.
        let d = room(34);
        drain(&mut t);
        reserved(&mut t, d, &[0], t0);
        t.handle_message(PeerId(0), ack(d, true), t0);
        assert_eq!(counts(&t), (4, 1, 1, 2, 7, 1));
    }

    #[test]
    fn rooms_by_state_and_tombstones_tell_where_each_room_is() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let (a, b, c) = (room(41), room(42), room(43));
        t.open(a, sources(&[0]), t0).unwrap();
        reserved(&mut t, b, &[0], t0);
        reserved(&mut t, c, &[0, 1], t0);
        t.handle_transfer_progress(c, t0);
        let by_state = |t: &ReceiverRooms| {
            [
                RoomState::Bootstrapping,
                RoomState::WaitingForInput,
                RoomState::Transferring,
                RoomState::Draining,
            ]
            .map(|s| t.rooms_in(s))
        };
        assert_eq!(by_state(&t), [1, 1, 1, 0]);
        // b: aborted, drained by its writer's ack: remembered as drained.
        t.abort(b, client(), t0);
        assert_eq!(by_state(&t), [1, 0, 1, 1]);
        t.handle_message(PeerId(0), ack(b, true), t0);
        assert_eq!(
            t.tombstone(b),
            Some(&Tombstone::Failed {
                error: client(),
                drained: true
            })
        );
        // c: aborted, never acknowledged: released at the fence, remembered
        // as possibly written.
        t.abort(c, client(), t0);
        t.handle_timeout(t0 + Duration::from_secs(6));
        assert_eq!(
            t.tombstone(c),
            Some(&Tombstone::Failed {
                error: client(),
                drained: false
            })
        );
        assert_eq!(by_state(&t), [1, 0, 0, 0]);
        assert_eq!(t.tombstone(a), None, "a live room has no tombstone");
    }

    #[test]
    fn transfer_progress_moves_the_deadline_to_the_transfer_timer() {
        let t0 = Instant::now();
        let timers = crate::timer::TimerConfig {
            waiting_for_input: Duration::from_secs(3),
            transfer: Duration::from_secs(10),
            ..Default::default()
        };
        let mut t = ReceiverRooms::new(RoomConfig {
            timers,
            ..RoomConfig::default()
        });
        let (moving, idle) = (room(51), room(52));
        reserved(&mut t, moving, &[0], t0);
        reserved(&mut t, idle, &[0], t0);
        t.handle_transfer_progress(moving, t0 + Duration::from_secs(1));
        assert_eq!(t.state(moving), Some(RoomState::Transferring));
        let timed_out = |t: &mut ReceiverRooms| -> Vec<(RoomId, Phase)> {
            drain(t)
                .1
                .into_iter()
                .filter_map(|a| match a {
                    ReceiverAction::FailRequest {
                        room,
                        error: TransferError::Timeout { phase, .. },
                    } => Some((room, phase)),
                    _ => None,
                })
                .collect()
        };
        // Past the waiting deadline: only the idle room times out.
        t.handle_timeout(t0 + Duration::from_millis(3500));
        assert_eq!(timed_out(&mut t), vec![(idle, Phase::WaitingForInput)]);
        assert_eq!(t.state(moving), Some(RoomState::Transferring));
        // Progress again changes nothing: the transfer deadline stands.
        t.handle_transfer_progress(moving, t0 + Duration::from_secs(9));
        t.handle_timeout(t0 + Duration::from_millis(10_500));
        assert_eq!(timed_out(&mut t), vec![]);
        assert_eq!(t.state(moving), Some(RoomState::Transferring));
        t.handle_timeout(t0 + Duration::from_millis(11_500));
        assert_eq!(timed_out(&mut t), vec![(moving, Phase::Transferring)]);
    }

    #[test]
    fn the_aux_check_waits_its_own_transfer_deadline() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let r = room(61);
        reserved(&mut t, r, &[0], t0);
        let later = t0 + Duration::from_secs(20);
        t.handle_message(PeerId(0), status(r, Outcome::Success), later);
        // Before its transfer deadline (30 s after the last status).
        t.handle_timeout(later + Duration::from_secs(29));
        assert_eq!(t.state(r), Some(RoomState::Transferring));
        t.handle_timeout(later + Duration::from_secs(31));
        assert_eq!(t.state(r), Some(RoomState::Failed));
    }

    #[test]
    fn a_dead_peer_fails_only_the_rooms_it_feeds() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let (fed, other) = (room(71), room(72));
        reserved(&mut t, fed, &[0], t0);
        reserved(&mut t, other, &[1], t0);
        t.handle_peer_dead(PeerId(0), t0);
        assert_eq!(t.state(fed), Some(RoomState::Draining));
        assert_eq!(t.state(other), Some(RoomState::WaitingForInput));
    }

    /// Thousands of finished rooms leave stale deadlines behind; compacting
    /// them keeps a live room's own deadline (its room record's, which every
    /// phase change sets), so the live room is not timed out early.
    #[test]
    fn compacting_stale_deadlines_keeps_live_ones() {
        let t0 = Instant::now();
        let mut t = ReceiverRooms::new(RoomConfig::default());
        let live = room(1);
        t.open(live, sources(&[0]), t0).unwrap();
        for n in 2..1400 {
            t.open(room(n), sources(&[1]), t0).unwrap();
        }
        t.handle_peer_dead(PeerId(1), t0);
        assert!(t.pending_deadlines() > 1400);
        t.handle_timeout(t0 + Duration::from_secs(6));
        // Compacted: the heap holds what the live rooms need, not 1400.
        assert!(
            t.pending_deadlines() <= 4 + 1024,
            "{}",
            t.pending_deadlines()
        );
        t.handle_timeout(t0 + Duration::from_secs(7));
        assert_eq!(t.state(live), Some(RoomState::Bootstrapping));
        t.handle_timeout(t0 + Duration::from_secs(31));
        assert_eq!(t.state(live), Some(RoomState::Failed));
    }
}
