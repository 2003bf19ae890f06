//! The prefill side's room table.
//!
//! A room is opened when the prefill worker accepts a request
//! ([`SenderRooms::open`]). It then expects, in order:
//!
//! 1. `Bootstrapping` — every decode destination's `Destination`
//!    (`required_destinations` of them). Destinations that arrive before the
//!    room is opened are parked (capped, expiring) and applied at open.
//! 2. `WaitingForInput` — the forward pass: [`SenderAction::StartCompute`] was
//!    emitted; the shell calls [`SenderRooms::handle_compute_done`].
//! 3. `Transferring` — [`SenderAction::StartWrites`] was emitted; the shell
//!    reports each destination with [`SenderRooms::handle_write_done`] (KV and
//!    aux written) or [`SenderRooms::handle_write_failed`].
//! 4. `Success` once every destination is written: `Status(Success)` to each.
//!
//! Any failure (local rejection, decode abort, timeout, dead peer, write
//! error) fails the room; if writes are in flight it first goes `Draining`
//! ([`SenderAction::CancelWrites`]) and tells the decode side only once the
//! writes stopped, or the abort fence passed. Every destination learns every
//! failure with its reason and status (seed 004, invariant 10). A late
//! success after a recorded failure stays a failure.
//!
//! Drive it like quinn: after any `handle_*`/`open`/`fail`, drain
//! [`SenderRooms::poll_transmit`] and [`SenderRooms::poll_action`], and
//! call [`SenderRooms::handle_timeout`] at [`SenderRooms::poll_timeout`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Instant;

use crate::error::{AbortOrigin, Misbehavior, Phase, TransferError};
use crate::ids::{PeerId, Role, RoomId};
use crate::message::{Abort, AbortAck, Destination, Message, Outcome, Status};
use crate::room::{Deadlines, Expiring, RoomConfig, RoomState, RoomStats, Tombstone, Transmit};
use crate::timer::Timer;

/// What the prefill I/O shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum SenderAction {
    /// Every destination arrived: run the forward pass for `room`.
    StartCompute {
        /// The room.
        room: RoomId,
    },
    /// KV is ready: write it (then aux) to each destination, and report each
    /// with `handle_write_done` / `handle_write_failed`.
    StartWrites {
        /// The room.
        room: RoomId,
        /// Decode rank and its destination, in rank order.
        destinations: Vec<(PeerId, Destination)>,
    },
    /// Stop writing `room` as soon as possible and report every write that
    /// was in flight (done or failed).
    CancelWrites {
        /// The room.
        room: RoomId,
    },
    /// The room is over and nothing is in flight: answer the request and
    /// free the prefill-side KV.
    Finished {
        /// The room.
        room: RoomId,
        /// Its result.
        result: Result<(), TransferError>,
    },
}

/// Per-room state, named for what the room expects next.
#[derive(Debug)]
enum Expect {
    /// Bootstrapping: more destinations.
    Destinations,
    /// WaitingForInput: the forward pass.
    Compute,
    /// Transferring: these destinations' writes.
    Writes { pending: BTreeSet<PeerId> },
    /// Draining: these writes to stop, then tell the decode side.
    Drain {
        in_flight: BTreeSet<PeerId>,
        error: TransferError,
        ack_to: BTreeSet<PeerId>,
    },
}

#[derive(Debug)]
struct SenderRoom {
    expect: Expect,
    required: Option<u16>,
    dests: BTreeMap<PeerId, Destination>,
    deadline: Instant,
}

impl SenderRoom {
    fn state(&self) -> RoomState {
        match self.expect {
            Expect::Destinations => RoomState::Bootstrapping,
            Expect::Compute => RoomState::WaitingForInput,
            Expect::Writes { .. } => RoomState::Transferring,
            Expect::Drain { .. } => RoomState::Draining,
        }
    }
}

/// The prefill side's rooms. One instance per prefill rank; the shell
/// identifies decode peers by their [`PeerId`].
#[derive(Debug)]
pub struct SenderRooms {
    config: RoomConfig,
    rooms: HashMap<RoomId, SenderRoom>,
    deadlines: Deadlines,
    closed: Expiring<Tombstone>,
    parked: Expiring<BTreeMap<PeerId, Destination>>,
    transmits: VecDeque<Transmit>,
    actions: VecDeque<SenderAction>,
    stats: RoomStats,
}

impl SenderRooms {
    /// An empty table.
    pub fn new(config: RoomConfig) -> Self {
        let cap = config.max_unknown_rooms;
        Self {
            config,
            rooms: HashMap::new(),
            deadlines: Deadlines::default(),
            closed: Expiring::new(cap),
            parked: Expiring::new(cap),
            transmits: VecDeque::new(),
            actions: VecDeque::new(),
            stats: RoomStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> &RoomStats {
        &self.stats
    }

    /// Live (non-terminal) rooms.
    pub fn live_rooms(&self) -> usize {
        self.rooms.len()
    }

    /// Parked destinations for rooms not yet opened.
    pub fn parked_rooms(&self) -> usize {
        self.parked.len()
    }

    /// Live rooms in `state` (a gauge for metrics: rooms by state).
    pub fn rooms_in(&self, state: RoomState) -> usize {
        self.rooms.values().filter(|r| r.state() == state).count()
    }

    /// Live state of `room`, or its terminal state while remembered.
    pub fn state(&self, room: RoomId) -> Option<RoomState> {
        self.rooms
            .get(&room)
            .map(SenderRoom::state)
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
    pub fn poll_action(&mut self) -> Option<SenderAction> {
        self.actions.pop_front()
    }

    /// Earliest deadline; call [`Self::handle_timeout`] then.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines
            .next()
            .into_iter()
            .chain(self.closed.next_expiry())
            .chain(self.parked.next_expiry())
            .min()
    }

    fn ttl(&self, now: Instant) -> Instant {
        now + self.config.timers.get(Timer::UnknownRoomTtl)
    }

    /// Accept a new request for `room`. Fails with `DuplicateRoom` when the
    /// id is live or recently used, with the abort when decode already
    /// aborted it, or with `Capacity`.
    pub fn open(&mut self, room: RoomId, now: Instant) -> Result<(), TransferError> {
        let refused = if self.rooms.contains_key(&room) {
            Some(TransferError::DuplicateRoom)
        } else if let Some(t) = self.closed.get(room) {
            Some(match t {
                Tombstone::AbortedBeforeOpen { error } => error.clone(),
                _ => TransferError::DuplicateRoom,
            })
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
            SenderRoom {
                expect: Expect::Destinations,
                required: None,
                dests: BTreeMap::new(),
                deadline: now + self.config.timers.get(Timer::Bootstrap),
            },
        );
        let at = now + self.config.timers.get(Timer::Bootstrap);
        self.deadlines.push(at, room);
        if let Some(parked) = self.parked.remove(room) {
            for (from, d) in parked {
                self.on_destination(from, d, now);
            }
        }
        Ok(())
    }

    /// A message from decode rank `from`.
    pub fn handle_message(&mut self, from: PeerId, msg: Message, now: Instant) {
        match msg {
            Message::Destination(d) => self.on_destination(from, d, now),
            Message::Abort(a) => self.on_abort(from, a, now),
            Message::Heartbeat(_) => {}
            // Decode never sends these to prefill for a room.
            Message::Status(_)
            | Message::AbortAck(_)
            | Message::Register(_)
            | Message::AuthProof(_) => {
                self.stats.violations += 1;
            }
        }
    }

    fn on_destination(&mut self, from: PeerId, d: Destination, now: Instant) {
        let room = d.room;
        let Some(r) = self.rooms.get_mut(&room) else {
            self.stats.unknown_room_events += 1;
            match self.closed.get(room) {
                Some(Tombstone::Failed { error, drained }) => {
                    // The request failed here before decode showed up: tell
                    // it. If the fence expired with writes possibly in
                    // flight, an Abort keeps decode's pages fenced.
                    let (error, drained) = (error.clone(), *drained);
                    if drained {
                        self.push_status_failed(from, room, &error);
                    } else {
                        self.push_abort(from, room, &error);
                    }
                }
                Some(_) => {}
                None => {
                    let ttl = self.ttl(now);
                    let mut set = self.parked.remove(room).unwrap_or_default();
                    set.entry(from).or_insert(d);
                    self.parked.insert(room, set, ttl);
                }
            }
            return;
        };
        if r.dests.contains_key(&from) {
            self.stats.duplicates += 1;
            return;
        }
        let bad = match r.required {
            Some(n) if n != d.required_destinations => Some(Misbehavior::DestinationCountChanged {
                peer: from,
                said: d.required_destinations,
                earlier: n,
            }),
            _ if !matches!(r.expect, Expect::Destinations) => {
                Some(Misbehavior::DestinationAfterAll {
                    peer: from,
                    arrived: r.dests.len(),
                })
            }
            _ => None,
        };
        if let Some(what) = bad {
            self.stats.violations += 1;
            if matches!(r.expect, Expect::Drain { .. }) {
                return;
            }
            self.fail_room(room, TransferError::PeerMisbehaved { what }, None, now);
            return;
        }
        r.required = Some(d.required_destinations);
        r.dests.insert(from, d);
        if r.dests.len() >= usize::from(r.required.unwrap_or(1)) {
            r.expect = Expect::Compute;
            r.deadline = now + self.config.timers.get(Timer::WaitingForInput);
            self.deadlines.push(r.deadline, room);
            self.actions.push_back(SenderAction::StartCompute { room });
        }
    }

    fn on_abort(&mut self, from: PeerId, a: Abort, now: Instant) {
        let room = a.room;
        let error = TransferError::Aborted {
            origin: a.origin.unwrap_or(AbortOrigin::Decode),
            reason: a.reason,
            http_status: a.http_status.unwrap_or(503),
        };
        if !self.rooms.contains_key(&room) {
            self.stats.unknown_room_events += 1;
            self.parked.remove(room);
            let drained = match self.closed.get(room) {
                Some(Tombstone::Failed { drained, .. }) => *drained,
                Some(_) => true,
                None => {
                    let ttl = self.ttl(now);
                    self.closed
                        .insert(room, Tombstone::AbortedBeforeOpen { error }, ttl);
                    true
                }
            };
            self.transmits.push_back(Transmit {
                to: from,
                message: Message::AbortAck(AbortAck { room, drained }),
            });
            return;
        }
        self.fail_room(room, error, Some(from), now);
    }

    /// The forward pass for `room` finished; its KV can be written.
    pub fn handle_compute_done(&mut self, room: RoomId, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if !matches!(r.expect, Expect::Compute) {
            self.stats.violations += 1;
            return;
        }
        let pending: BTreeSet<PeerId> = r.dests.keys().copied().collect();
        let destinations = r.dests.iter().map(|(k, v)| (*k, v.clone())).collect();
        r.expect = Expect::Writes { pending };
        r.deadline = now + self.config.timers.get(Timer::Transfer);
        self.deadlines.push(r.deadline, room);
        self.actions
            .push_back(SenderAction::StartWrites { room, destinations });
    }

    /// KV and aux of `room` are fully written to decode rank `dest`.
    pub fn handle_write_done(&mut self, room: RoomId, dest: PeerId, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        match &mut r.expect {
            Expect::Writes { pending } => {
                if !pending.remove(&dest) {
                    self.stats.duplicates += 1;
                    return;
                }
                if pending.is_empty() {
                    self.succeed(room, now);
                }
            }
            Expect::Drain { in_flight, .. } => {
                // A late success after a recorded failure stays a failure.
                in_flight.remove(&dest);
                if in_flight.is_empty() {
                    self.finish_drain(room, true, now);
                }
            }
            _ => self.stats.violations += 1,
        }
    }

    /// Writing `room` to `dest` failed (or was cancelled).
    pub fn handle_write_failed(
        &mut self,
        room: RoomId,
        dest: PeerId,
        error: TransferError,
        now: Instant,
    ) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        match &mut r.expect {
            Expect::Writes { pending } => {
                pending.remove(&dest);
                self.fail_room(room, error, None, now);
            }
            Expect::Drain { in_flight, .. } => {
                in_flight.remove(&dest);
                if in_flight.is_empty() {
                    self.finish_drain(room, true, now);
                }
            }
            _ => self.stats.violations += 1,
        }
    }

    /// Fail `room` locally (validation rejection, engine error, shutdown).
    /// Unknown rooms are ignored.
    pub fn fail(&mut self, room: RoomId, error: TransferError, now: Instant) {
        if self.rooms.contains_key(&room) {
            self.fail_room(room, error, None, now);
        }
    }

    /// Decode peer `peer` is dead: fail every room it is a destination of.
    pub fn handle_peer_dead(&mut self, peer: PeerId, now: Instant) {
        let mut hit: Vec<RoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| {
                r.dests.contains_key(&peer) && !matches!(r.expect, Expect::Drain { .. })
            })
            .map(|(id, _)| *id)
            .collect();
        hit.sort();
        for room in hit {
            let error = TransferError::PeerDead {
                peer,
                detail: "decode peer stopped answering".into(),
            };
            self.fail_room(room, error, None, now);
        }
    }

    /// Fire every deadline at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.closed.expire(now);
        self.parked.expire(now);
        let due = self.deadlines.pop_due(now);
        for room in due {
            let Some(r) = self.rooms.get(&room).filter(|r| r.deadline <= now) else {
                continue;
            };
            let (phase, timer) = match r.expect {
                Expect::Destinations => (Phase::Bootstrapping, Timer::Bootstrap),
                Expect::Compute => (Phase::WaitingForInput, Timer::WaitingForInput),
                Expect::Writes { .. } => (Phase::Transferring, Timer::Transfer),
                Expect::Drain { .. } => {
                    self.stats.fence_expired += 1;
                    self.finish_drain(room, false, now);
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

    fn succeed(&mut self, room: RoomId, now: Instant) {
        let Some(r) = self.rooms.remove(&room) else {
            return;
        };
        for to in r.dests.keys() {
            self.transmits.push_back(Transmit {
                to: *to,
                message: Message::Status(Status {
                    room,
                    outcome: Outcome::Success,
                }),
            });
        }
        self.stats.succeeded += 1;
        self.actions.push_back(SenderAction::Finished {
            room,
            result: Ok(()),
        });
        self.remember(room, Tombstone::Success, now);
    }

    fn remember(&mut self, room: RoomId, t: Tombstone, now: Instant) {
        let expires = self.ttl(now);
        self.closed.insert(room, t, expires);
    }

    fn push_abort(&mut self, to: PeerId, room: RoomId, error: &TransferError) {
        self.transmits.push_back(Transmit {
            to,
            message: Message::Abort(Abort {
                room,
                reason: error.reason(),
                http_status: Some(error.http_status()),
                origin: Some(AbortOrigin::of_role(Role::Prefill)),
            }),
        });
    }

    fn push_status_failed(&mut self, to: PeerId, room: RoomId, error: &TransferError) {
        self.transmits.push_back(Transmit {
            to,
            message: Message::Status(Status {
                room,
                outcome: Outcome::Failed {
                    kind: error.kind(),
                    reason: error.reason(),
                    http_status: Some(error.http_status()),
                    code: error.reject_code(),
                },
            }),
        });
    }

    /// Record a failure. `aborter` is the decode rank whose abort caused it
    /// (it gets an `AbortAck`, the others a `Status(Failed)`).
    fn fail_room(
        &mut self,
        room: RoomId,
        error: TransferError,
        aborter: Option<PeerId>,
        now: Instant,
    ) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        match &mut r.expect {
            Expect::Drain { ack_to, .. } => {
                // Already failing: remember who else wants an ack.
                if let Some(a) = aborter {
                    ack_to.insert(a);
                }
            }
            Expect::Writes { pending } if !pending.is_empty() => {
                let in_flight = std::mem::take(pending);
                r.expect = Expect::Drain {
                    in_flight,
                    error,
                    ack_to: aborter.into_iter().collect(),
                };
                r.deadline = now + self.config.timers.get(Timer::AbortAckFence);
                self.deadlines.push(r.deadline, room);
                self.actions.push_back(SenderAction::CancelWrites { room });
            }
            _ => {
                r.expect = Expect::Drain {
                    in_flight: BTreeSet::new(),
                    error,
                    ack_to: aborter.into_iter().collect(),
                };
                self.finish_drain(room, true, now);
            }
        }
    }

    /// Close a draining room: `drained` says whether every write stopped.
    fn finish_drain(&mut self, room: RoomId, drained: bool, now: Instant) {
        let Some(r) = self.rooms.remove(&room) else {
            return;
        };
        let Expect::Drain { error, ack_to, .. } = r.expect else {
            self.rooms.insert(room, r);
            return;
        };
        for to in &ack_to {
            self.transmits.push_back(Transmit {
                to: *to,
                message: Message::AbortAck(AbortAck { room, drained }),
            });
        }
        for to in r.dests.keys().filter(|k| !ack_to.contains(k)) {
            if drained {
                self.push_status_failed(*to, room, &error);
            } else {
                // Writes may still land: an Abort (not a Status) tells decode
                // to keep its pages fenced.
                self.push_abort(*to, room, &error);
            }
        }
        self.stats.failed += 1;
        self.actions.push_back(SenderAction::Finished {
            room,
            result: Err(error.clone()),
        });
        self.remember(room, Tombstone::Failed { error, drained }, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FailureKind;
    use crate::ids::{AuxSlot, PageIndex};
    use std::time::Duration;

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    fn dest(r: RoomId, required: u16) -> Message {
        Message::Destination(Destination {
            room: r,
            pages: vec![PageIndex(1), PageIndex(2)],
            aux_slot: AuxSlot(0),
            required_destinations: required,
            prefix_tokens: None,
        })
    }

    fn abort(r: RoomId) -> Message {
        Message::Abort(Abort {
            room: r,
            reason: "client disconnected".into(),
            http_status: Some(499),
            origin: Some(AbortOrigin::Client),
        })
    }

    fn drain(t: &mut SenderRooms) -> (Vec<Transmit>, Vec<SenderAction>) {
        (
            std::iter::from_fn(|| t.poll_transmit()).collect(),
            std::iter::from_fn(|| t.poll_action()).collect(),
        )
    }

    fn status(to: u32, r: RoomId, outcome: Outcome) -> Transmit {
        Transmit {
            to: PeerId(to),
            message: Message::Status(Status { room: r, outcome }),
        }
    }

    #[test]
    fn two_destinations_gate_compute_and_both_get_success() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(1);
        t.open(r, t0).unwrap();
        t.handle_message(PeerId(0), dest(r, 2), t0);
        assert_eq!(
            drain(&mut t),
            (vec![], vec![]),
            "one of two destinations: no compute yet"
        );
        assert_eq!(t.state(r), Some(RoomState::Bootstrapping));
        t.handle_message(PeerId(0), dest(r, 2), t0);
        assert_eq!(t.stats().duplicates, 1);
        t.handle_message(PeerId(1), dest(r, 2), t0);
        assert_eq!(
            drain(&mut t).1,
            vec![SenderAction::StartCompute { room: r }]
        );
        assert_eq!(t.state(r), Some(RoomState::WaitingForInput));
        t.handle_compute_done(r, t0);
        let (_, acts) = drain(&mut t);
        let [SenderAction::StartWrites { destinations, .. }] = acts.as_slice() else {
            panic!("{acts:?}")
        };
        assert_eq!(
            destinations.iter().map(|(k, _)| k.0).collect::<Vec<_>>(),
            vec![0, 1]
        );
        t.handle_write_done(r, PeerId(0), t0);
        assert_eq!(drain(&mut t), (vec![], vec![]));
        t.handle_write_done(r, PeerId(1), t0);
        let (tx, acts) = drain(&mut t);
        assert_eq!(
            tx,
            vec![
                status(0, r, Outcome::Success),
                status(1, r, Outcome::Success)
            ]
        );
        assert_eq!(
            acts,
            vec![SenderAction::Finished {
                room: r,
                result: Ok(())
            }]
        );
        assert_eq!(t.state(r), Some(RoomState::Success));
        assert_eq!(t.live_rooms(), 0);
    }

    #[test]
    fn early_destination_is_parked_not_a_room() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(2);
        t.handle_message(PeerId(0), dest(r, 1), t0);
        assert_eq!(t.live_rooms(), 0);
        assert_eq!(t.parked_rooms(), 1);
        assert_eq!(t.state(r), None);
        t.open(r, t0).unwrap();
        assert_eq!(
            drain(&mut t).1,
            vec![SenderAction::StartCompute { room: r }]
        );
        assert_eq!(t.parked_rooms(), 0);
    }

    #[test]
    fn parked_destinations_are_capped_and_expire() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig {
            max_unknown_rooms: 2,
            ..RoomConfig::default()
        });
        for n in 1..=3 {
            t.handle_message(PeerId(0), dest(room(n), 1), t0);
        }
        assert_eq!(t.parked_rooms(), 2);
        t.handle_timeout(t0 + Duration::from_secs(61));
        assert_eq!(t.parked_rooms(), 0);
        t.open(room(3), t0 + Duration::from_secs(61)).unwrap();
        assert_eq!(
            drain(&mut t).1,
            vec![],
            "expired destination is not applied"
        );
    }

    #[test]
    fn abort_while_writing_drains_before_anyone_is_told() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(3);
        t.open(r, t0).unwrap();
        t.handle_message(PeerId(0), dest(r, 2), t0);
        t.handle_message(PeerId(1), dest(r, 2), t0);
        t.handle_compute_done(r, t0);
        drain(&mut t);
        t.handle_message(PeerId(0), abort(r), t0);
        assert_eq!(
            drain(&mut t),
            (vec![], vec![SenderAction::CancelWrites { room: r }])
        );
        assert_eq!(t.state(r), Some(RoomState::Draining));
        // A late success on a cancelled write does not make the room succeed.
        t.handle_write_done(r, PeerId(0), t0);
        t.handle_write_failed(
            r,
            PeerId(1),
            TransferError::Internal {
                reason: "cancelled".into(),
            },
            t0,
        );
        let (tx, acts) = drain(&mut t);
        assert_eq!(
            tx,
            vec![
                Transmit {
                    to: PeerId(0),
                    message: Message::AbortAck(AbortAck {
                        room: r,
                        drained: true
                    })
                },
                status(
                    1,
                    r,
                    Outcome::Failed {
                        kind: FailureKind::Aborted,
                        reason: "client disconnected".into(),
                        http_status: Some(499),
                        code: None
                    }
                ),
            ]
        );
        let [SenderAction::Finished { result: Err(e), .. }] = acts.as_slice() else {
            panic!("{acts:?}")
        };
        assert_eq!((e.error_type(), e.http_status()), ("aborted", 499));
        assert_eq!(t.state(r), Some(RoomState::Failed));
    }

    #[test]
    fn abort_for_unknown_room_is_acked_and_blocks_a_later_open() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(4);
        t.handle_message(PeerId(2), abort(r), t0);
        let (tx, acts) = drain(&mut t);
        assert_eq!(
            tx,
            vec![Transmit {
                to: PeerId(2),
                message: Message::AbortAck(AbortAck {
                    room: r,
                    drained: true
                })
            }]
        );
        assert!(acts.is_empty());
        assert_eq!(t.live_rooms(), 0);
        let err = t.open(r, t0).unwrap_err();
        assert_eq!((err.error_type(), err.http_status()), ("aborted", 499));
    }

    #[test]
    fn rejection_reaches_a_decode_that_shows_up_later() {
        // Seed 004: prefill rejects with 400 before decode's destination.
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(5);
        t.open(r, t0).unwrap();
        t.fail(
            r,
            TransferError::Rejected {
                http_status: 400,
                reason: "prompt too long".into(),
                code: None,
            },
            t0,
        );
        let (tx, acts) = drain(&mut t);
        assert!(tx.is_empty());
        assert_eq!(
            acts,
            vec![SenderAction::Finished {
                room: r,
                result: Err(TransferError::Rejected {
                    http_status: 400,
                    reason: "prompt too long".into(),
                    code: None,
                })
            }]
        );
        t.handle_message(PeerId(0), dest(r, 1), t0);
        let (tx, _) = drain(&mut t);
        assert_eq!(
            tx,
            vec![status(
                0,
                r,
                Outcome::Failed {
                    kind: FailureKind::Rejected,
                    reason: "prompt too long".into(),
                    http_status: Some(400),
                    code: None
                }
            )]
        );
        assert_eq!(
            t.live_rooms(),
            0,
            "the late destination did not resurrect the room"
        );
        assert_eq!(t.parked_rooms(), 0);
    }

    #[test]
    fn duplicate_and_reused_room_ids_are_refused() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig {
            max_live_rooms: 1,
            ..RoomConfig::default()
        });
        t.open(room(6), t0).unwrap();
        assert_eq!(t.open(room(6), t0), Err(TransferError::DuplicateRoom));
        assert_eq!(t.open(room(7), t0).unwrap_err().error_type(), "capacity");
        t.fail(room(6), TransferError::Internal { reason: "x".into() }, t0);
        assert_eq!(t.open(room(6), t0), Err(TransferError::DuplicateRoom));
        assert_eq!(t.stats().open_rejected, 3);
    }

    #[test]
    fn each_phase_times_out_with_its_name() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        t.open(room(8), t0).unwrap();
        t.open(room(9), t0).unwrap();
        t.handle_message(PeerId(0), dest(room(9), 1), t0);
        assert_eq!(t.poll_timeout(), Some(t0 + Duration::from_secs(30)));
        t.handle_timeout(t0 + Duration::from_secs(30));
        let (_, acts) = drain(&mut t);
        let phases: Vec<String> = acts
            .iter()
            .filter_map(|a| match a {
                SenderAction::Finished { result: Err(e), .. } => Some(e.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(
            phases,
            vec![
                "timed out in bootstrapping after 30.0 s",
                "timed out in waiting_for_input after 30.0 s"
            ]
        );
    }

    #[test]
    fn fence_expiry_tells_decode_writes_may_still_land() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(10);
        t.open(r, t0).unwrap();
        t.handle_message(PeerId(0), dest(r, 2), t0);
        t.handle_message(PeerId(1), dest(r, 2), t0);
        t.handle_compute_done(r, t0);
        t.handle_message(PeerId(0), abort(r), t0);
        drain(&mut t);
        t.handle_timeout(t0 + Duration::from_secs(5));
        let (tx, _) = drain(&mut t);
        assert_eq!(
            tx[0],
            Transmit {
                to: PeerId(0),
                message: Message::AbortAck(AbortAck {
                    room: r,
                    drained: false
                })
            }
        );
        assert!(matches!(
            &tx[1],
            Transmit {
                to: PeerId(1),
                message: Message::Abort(_)
            }
        ));
        assert_eq!(t.stats().fence_expired, 1);
        // A repeated abort is answered from the tombstone, still not drained.
        t.handle_message(PeerId(0), abort(r), t0 + Duration::from_secs(6));
        assert_eq!(
            drain(&mut t).0,
            vec![Transmit {
                to: PeerId(0),
                message: Message::AbortAck(AbortAck {
                    room: r,
                    drained: false
                })
            }]
        );
    }

    #[test]
    fn changing_destination_count_is_misbehaviour() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(11);
        t.open(r, t0).unwrap();
        t.handle_message(PeerId(0), dest(r, 2), t0);
        t.handle_message(PeerId(1), dest(r, 3), t0);
        let (tx, acts) = drain(&mut t);
        let [SenderAction::Finished { result: Err(e), .. }] = acts.as_slice() else {
            panic!("{acts:?}")
        };
        assert_eq!(e.error_type(), "peer_misbehaved");
        assert_eq!(tx.len(), 1, "the known destination is told");
    }

    #[test]
    fn dead_decode_fails_its_rooms_only() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        t.open(room(12), t0).unwrap();
        t.open(room(13), t0).unwrap();
        t.handle_message(PeerId(0), dest(room(12), 1), t0);
        t.handle_message(PeerId(1), dest(room(13), 1), t0);
        drain(&mut t);
        t.handle_peer_dead(PeerId(0), t0);
        assert_eq!(t.state(room(12)), Some(RoomState::Failed));
        assert_eq!(t.state(room(13)), Some(RoomState::WaitingForInput));
        let (_, acts) = drain(&mut t);
        let [SenderAction::Finished { result: Err(e), .. }] = acts.as_slice() else {
            panic!("{acts:?}")
        };
        assert_eq!((e.error_type(), e.http_status()), ("peer_dead", 503));
    }

    /// Each counter of [`RoomStats`] moves by exactly one for each event it
    /// counts.
    #[test]
    fn every_counter_counts_each_event_once() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let counts = |t: &SenderRooms| {
            let s = t.stats();
            (
                s.opened,
                s.open_rejected,
                s.succeeded,
                s.violations,
                s.duplicates,
                s.unknown_room_events,
            )
        };
        let (a, b) = (room(31), room(32));
        t.open(a, t0).unwrap();
        assert_eq!(counts(&t), (1, 0, 0, 0, 0, 0));
        assert!(t.open(a, t0).is_err());
        assert_eq!(counts(&t), (1, 1, 0, 0, 0, 0));
        // Decode never sends a status to prefill.
        let st = Message::Status(Status {
            room: a,
            outcome: Outcome::Success,
        });
        t.handle_message(PeerId(0), st, t0);
        assert_eq!(counts(&t), (1, 1, 0, 1, 0, 0));
        // Compute done before any destination; a write done and a write
        // failed before any write started.
        t.handle_compute_done(a, t0);
        t.handle_write_done(a, PeerId(0), t0);
        let err = TransferError::Internal { reason: "x".into() };
        t.handle_write_failed(a, PeerId(0), err, t0);
        assert_eq!(counts(&t), (1, 1, 0, 4, 0, 0));
        // A destination for a room not open here yet.
        t.handle_message(PeerId(0), dest(room(99), 1), t0);
        assert_eq!(counts(&t), (1, 1, 0, 4, 0, 1));
        t.handle_message(PeerId(0), dest(a, 1), t0);
        t.handle_compute_done(a, t0);
        t.handle_write_done(a, PeerId(0), t0);
        assert_eq!(counts(&t), (1, 1, 1, 4, 0, 1));
        // A write reported done twice is a duplicate.
        t.open(b, t0).unwrap();
        t.handle_message(PeerId(0), dest(b, 2), t0);
        t.handle_message(PeerId(1), dest(b, 2), t0);
        t.handle_compute_done(b, t0);
        t.handle_write_done(b, PeerId(0), t0);
        t.handle_write_done(b, PeerId(0), t0);
        assert_eq!(counts(&t), (2, 1, 1, 4, 1, 1));
        // A destination after all of them arrived breaks the protocol.
        t.handle_message(PeerId(2), dest(b, 2), t0);
        assert_eq!(counts(&t), (2, 1, 1, 5, 1, 1));
    }

    #[test]
    fn rooms_by_state_and_tombstones_tell_where_each_room_is() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let (a, b, c) = (room(41), room(42), room(43));
        for r in [a, b, c] {
            t.open(r, t0).unwrap();
        }
        t.handle_message(PeerId(0), dest(b, 1), t0);
        t.handle_message(PeerId(0), dest(c, 1), t0);
        t.handle_compute_done(c, t0);
        let by_state = |t: &SenderRooms| {
            [
                RoomState::Bootstrapping,
                RoomState::WaitingForInput,
                RoomState::Transferring,
            ]
            .map(|s| t.rooms_in(s))
        };
        assert_eq!(by_state(&t), [1, 1, 1]);
        t.handle_write_done(c, PeerId(0), t0);
        assert_eq!(t.tombstone(c), Some(&Tombstone::Success));
        assert_eq!(by_state(&t), [1, 1, 0]);
        assert_eq!(t.tombstone(a), None, "a live room has no tombstone");
    }

    #[test]
    fn each_phase_has_its_own_deadline_from_its_start() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let r = room(51);
        t.open(r, t0).unwrap();
        let later = t0 + Duration::from_secs(20);
        t.handle_message(PeerId(0), dest(r, 1), later);
        // The compute deadline counts from the destination, not the open.
        t.handle_timeout(later + Duration::from_secs(29));
        assert_eq!(t.state(r), Some(RoomState::WaitingForInput));
        t.handle_timeout(later + Duration::from_secs(31));
        assert_ne!(t.state(r), Some(RoomState::WaitingForInput));
    }

    /// Compacting stale deadlines keeps a live room's own (see the decode
    /// side's test of the same name).
    #[test]
    fn compacting_stale_deadlines_keeps_live_ones() {
        let t0 = Instant::now();
        let mut t = SenderRooms::new(RoomConfig::default());
        let live = room(1);
        t.open(live, t0).unwrap();
        for n in 2..1400 {
            t.open(room(n), t0).unwrap();
            t.fail(room(n), TransferError::Internal { reason: "x".into() }, t0);
        }
        t.handle_timeout(t0 + Duration::from_secs(6));
        t.handle_timeout(t0 + Duration::from_secs(7));
        assert_eq!(t.state(live), Some(RoomState::Bootstrapping));
        t.handle_timeout(t0 + Duration::from_secs(31));
        assert_ne!(t.state(live), Some(RoomState::Bootstrapping));
    }
}
