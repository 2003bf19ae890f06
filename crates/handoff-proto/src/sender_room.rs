//! The prefill side's room table (DESIGN.md §3 steps 3–4, §4).
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

use crate::error::{AbortOrigin, Phase, TransferError};
use crate::ids::{RankId, Role, RoomId};
use crate::message::{Abort, AbortAck, Destination, Message, Outcome, Status};
use crate::room::{Expiring, RoomConfig, RoomState, RoomStats, Tombstone, Transmit};
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
        destinations: Vec<(RankId, Destination)>,
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
    Writes { pending: BTreeSet<RankId> },
    /// Draining: these writes to stop, then tell the decode side.
    Drain {
        in_flight: BTreeSet<RankId>,
        error: TransferError,
        ack_to: BTreeSet<RankId>,
    },
}

#[derive(Debug)]
struct SenderRoom {
    expect: Expect,
    required: Option<u16>,
    dests: BTreeMap<RankId, Destination>,
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
/// identifies decode peers by their [`RankId`].
#[derive(Debug)]
pub struct SenderRooms {
    config: RoomConfig,
    rooms: HashMap<RoomId, SenderRoom>,
    closed: Expiring<Tombstone>,
    parked: Expiring<BTreeMap<RankId, Destination>>,
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
        self.rooms
            .values()
            .map(|r| r.deadline)
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
        if let Some(parked) = self.parked.remove(room) {
            for (from, d) in parked {
                self.on_destination(from, d, now);
            }
        }
        Ok(())
    }

    /// A message from decode rank `from`.
    pub fn handle_message(&mut self, from: RankId, msg: Message, now: Instant) {
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

    fn on_destination(&mut self, from: RankId, d: Destination, now: Instant) {
        let room = d.room;
        let Some(r) = self.rooms.get_mut(&room) else {
            self.stats.unknown_room_events += 1;
            match self.closed.get(room) {
                Some(Tombstone::Failed { error, .. }) => {
                    // The request failed here before decode showed up: tell it.
                    let error = error.clone();
                    self.push_status_failed(from, room, &error);
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
            Some(n) if n != d.required_destinations => Some(format!(
                "rank {} says {} destinations, an earlier destination said {n}",
                from.0, d.required_destinations
            )),
            _ if !matches!(r.expect, Expect::Destinations) => Some(format!(
                "destination from rank {} after all {} arrived",
                from.0,
                r.dests.len()
            )),
            _ => None,
        };
        if let Some(detail) = bad {
            self.stats.violations += 1;
            if matches!(r.expect, Expect::Drain { .. }) {
                return;
            }
            self.fail_room(room, TransferError::PeerMisbehaved { detail }, None, now);
            return;
        }
        r.required = Some(d.required_destinations);
        r.dests.insert(from, d);
        if r.dests.len() >= usize::from(r.required.unwrap_or(1)) {
            r.expect = Expect::Compute;
            r.deadline = now + self.config.timers.get(Timer::WaitingForInput);
            self.actions.push_back(SenderAction::StartCompute { room });
        }
    }

    fn on_abort(&mut self, from: RankId, a: Abort, now: Instant) {
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
        let pending: BTreeSet<RankId> = r.dests.keys().copied().collect();
        let destinations = r.dests.iter().map(|(k, v)| (*k, v.clone())).collect();
        r.expect = Expect::Writes { pending };
        r.deadline = now + self.config.timers.get(Timer::Transfer);
        self.actions
            .push_back(SenderAction::StartWrites { room, destinations });
    }

    /// KV and aux of `room` are fully written to decode rank `dest`.
    pub fn handle_write_done(&mut self, room: RoomId, dest: RankId, now: Instant) {
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
        dest: RankId,
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

    /// Decode rank `rank` is dead: fail every room it is a destination of.
    pub fn handle_peer_dead(&mut self, rank: RankId, now: Instant) {
        let mut hit: Vec<RoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| {
                r.dests.contains_key(&rank) && !matches!(r.expect, Expect::Drain { .. })
            })
            .map(|(id, _)| *id)
            .collect();
        hit.sort();
        for room in hit {
            let error = TransferError::PeerDead {
                rank,
                detail: "decode peer stopped answering".into(),
            };
            self.fail_room(room, error, None, now);
        }
    }

    /// Fire every deadline at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.closed.expire(now);
        self.parked.expire(now);
        let mut due: Vec<RoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        due.sort();
        for room in due {
            let Some(r) = self.rooms.get(&room) else {
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

    fn push_status_failed(&mut self, to: RankId, room: RoomId, error: &TransferError) {
        self.transmits.push_back(Transmit {
            to,
            message: Message::Status(Status {
                room,
                outcome: Outcome::Failed {
                    kind: error.kind(),
                    reason: error.reason(),
                    http_status: Some(error.http_status()),
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
        aborter: Option<RankId>,
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
                self.transmits.push_back(Transmit {
                    to: *to,
                    message: Message::Abort(Abort {
                        room,
                        reason: error.reason(),
                        http_status: Some(error.http_status()),
                        origin: Some(AbortOrigin::of_role(Role::Prefill)),
                    }),
                });
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
