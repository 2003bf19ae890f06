//! Property tests for the room state machines: random event orders (legal
//! or not) keep the room invariants (TESTING.md, "Invariants and where they hold") — states only move forward,
//! terminal states are sticky, events never create or resurrect rooms, decode
//! never releases pages a write may still land in, prefill never says
//! Success before every destination is written nor reports a failure while
//! a write is in flight, and every room ends once time passes its deadlines.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use handoff_proto::error::{AbortOrigin, FailureKind, TransferError};
use handoff_proto::message::{Abort, AbortAck, Destination, Message, Outcome, Status};
use handoff_proto::receiver_room::{ReceiverAction, ReceiverRooms, Source};
use handoff_proto::room::{RoomConfig, RoomState};
use handoff_proto::sender_room::{SenderAction, SenderRooms};
use handoff_proto::timer::{Timer, TimerConfig};
use handoff_proto::{AuxSlot, PageIndex, PeerId, RoomId};
use proptest::prelude::*;

fn config() -> RoomConfig {
    let mut timers = TimerConfig::default();
    // Keep tombstones for the whole run so stickiness is observable.
    timers.set(Timer::UnknownRoomTtl, Duration::from_secs(24 * 3600));
    RoomConfig {
        timers,
        ..RoomConfig::default()
    }
}

fn room(i: u8) -> RoomId {
    RoomId::new(u64::from(i) + 1).unwrap()
}

/// Watches the states of every room and checks monotonicity and stickiness.
#[derive(Default)]
struct StateWatch {
    last: HashMap<RoomId, RoomState>,
}

impl StateWatch {
    fn observe(
        &mut self,
        r: RoomId,
        now: Option<RoomState>,
        opened: bool,
    ) -> Result<(), TestCaseError> {
        match (self.last.get(&r).copied(), now) {
            (Some(prev), Some(cur)) => {
                prop_assert!(
                    cur.order() >= prev.order(),
                    "{:?}: {:?} -> {:?}",
                    r,
                    prev,
                    cur
                );
                if prev.is_terminal() {
                    prop_assert_eq!(cur, prev, "terminal state changed");
                }
            }
            (Some(prev), None) => prop_assert!(false, "{:?} vanished from {:?}", r, prev),
            (None, Some(cur)) => {
                prop_assert!(
                    opened || cur == RoomState::Failed,
                    "{:?} appeared as {:?} without open",
                    r,
                    cur
                );
            }
            (None, None) => {}
        }
        if let Some(cur) = now {
            self.last.insert(r, cur);
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum RxEvent {
    Open(u8, u8),
    Reserve(u8),
    Progress(u8),
    Success(u8, u32),
    Failed(u8, u32),
    PrefillAbort(u8, u32),
    Ack(u8, u32, bool),
    LocalAbort(u8),
    Aux(u8, bool),
    Dead(u32),
    Advance(u64),
}

fn rx_event() -> impl Strategy<Value = RxEvent> {
    let r = 0u8..4;
    let k = 0u32..3;
    prop_oneof![
        1 => (r.clone(), 1u8..=3).prop_map(|(a, b)| RxEvent::Open(a, b)),
        1 => r.clone().prop_map(RxEvent::Reserve),
        1 => r.clone().prop_map(RxEvent::Progress),
        3 => (r.clone(), k.clone()).prop_map(|(a, b)| RxEvent::Success(a, b)),
        1 => (r.clone(), k.clone()).prop_map(|(a, b)| RxEvent::Failed(a, b)),
        1 => (r.clone(), k.clone()).prop_map(|(a, b)| RxEvent::PrefillAbort(a, b)),
        2 => (r.clone(), k.clone(), any::<bool>()).prop_map(|(a, b, c)| RxEvent::Ack(a, b, c)),
        1 => r.clone().prop_map(RxEvent::LocalAbort),
        1 => (r, any::<bool>()).prop_map(|(a, b)| RxEvent::Aux(a, b)),
        1 => k.prop_map(RxEvent::Dead),
        1 => (0u64..12).prop_map(RxEvent::Advance),
    ]
}

/// The decode table driven by a harness playing every prefill rank.
struct RxHarness {
    t: ReceiverRooms,
    now: Instant,
    watch: StateWatch,
    opened: BTreeSet<RoomId>,
    /// (room, prefill rank) that got a Destination and has not said it stopped.
    may_write: BTreeSet<(RoomId, PeerId)>,
    succeeded: BTreeMap<RoomId, BTreeSet<PeerId>>,
    sources: BTreeMap<RoomId, Vec<PeerId>>,
    reserved: BTreeMap<RoomId, Vec<PageIndex>>,
    ended: BTreeMap<RoomId, &'static str>,
    released: BTreeSet<RoomId>,
}

impl RxHarness {
    fn new() -> Self {
        Self {
            t: ReceiverRooms::new(config()),
            now: Instant::now(),
            watch: StateWatch::default(),
            opened: BTreeSet::new(),
            may_write: BTreeSet::new(),
            succeeded: BTreeMap::new(),
            sources: BTreeMap::new(),
            reserved: BTreeMap::new(),
            ended: BTreeMap::new(),
            released: BTreeSet::new(),
        }
    }

    fn deliver(&mut self, from: u32, m: Message) {
        let from = PeerId(from);
        if let Some(r) = m.room() {
            let stops = matches!(
                &m,
                Message::Status(_) | Message::AbortAck(AbortAck { drained: true, .. })
            );
            if stops {
                self.may_write.remove(&(r, from));
            }
            if let Message::Status(Status {
                outcome: Outcome::Success,
                ..
            }) = &m
            {
                self.succeeded.entry(r).or_default().insert(from);
            }
        }
        let now = self.now;
        self.t.handle_message(from, m, now);
    }

    fn apply(&mut self, e: RxEvent) -> Result<(), TestCaseError> {
        let now = self.now;
        match e {
            RxEvent::Open(i, n) => {
                let srcs: Vec<Source> = (0..u32::from(n))
                    .map(|k| Source {
                        peer: PeerId(k),
                        required_destinations: 1,
                    })
                    .collect();
                let r = room(i);
                let res = self.t.open(r, srcs, now);
                let was_known = self.opened.contains(&r);
                prop_assert_eq!(
                    res.is_ok(),
                    !was_known,
                    "open of a known room id must fail: {:?}",
                    res
                );
                if res.is_ok() {
                    self.opened.insert(r);
                    self.sources
                        .insert(r, (0..u32::from(n)).map(PeerId).collect());
                }
            }
            RxEvent::Reserve(i) => {
                let pages: Vec<PageIndex> =
                    (0..3).map(|p| PageIndex(u32::from(i) * 10 + p)).collect();
                let accepted = self
                    .t
                    .handle_pages_reserved(room(i), pages.clone(), AuxSlot(u32::from(i)), None, now)
                    .is_ok();
                if accepted {
                    prop_assert!(
                        self.reserved.insert(room(i), pages).is_none(),
                        "pages taken twice"
                    );
                }
            }
            RxEvent::Progress(i) => self.t.handle_transfer_progress(room(i), now),
            RxEvent::Success(i, k) => self.deliver(
                k,
                Message::Status(Status {
                    room: room(i),
                    outcome: Outcome::Success,
                }),
            ),
            RxEvent::Failed(i, k) => self.deliver(
                k,
                Message::Status(Status {
                    room: room(i),
                    outcome: Outcome::Failed {
                        kind: FailureKind::Rejected,
                        reason: "bad".into(),
                        http_status: Some(400),
                        code: None,
                    },
                }),
            ),
            RxEvent::PrefillAbort(i, k) => self.deliver(
                k,
                Message::Abort(Abort {
                    room: room(i),
                    reason: "fence".into(),
                    http_status: None,
                    origin: Some(AbortOrigin::Prefill),
                }),
            ),
            RxEvent::Ack(i, k, drained) => self.deliver(
                k,
                Message::AbortAck(AbortAck {
                    room: room(i),
                    drained,
                }),
            ),
            RxEvent::LocalAbort(i) => self.t.abort(
                room(i),
                TransferError::Aborted {
                    origin: AbortOrigin::Client,
                    reason: "gone".into(),
                    http_status: 499,
                },
                now,
            ),
            RxEvent::Aux(i, ok) => {
                self.t
                    .handle_aux_checked(room(i), if ok { room(i).get() } else { 12345 }, now)
            }
            RxEvent::Dead(k) => self.t.handle_peer_dead(PeerId(k), now),
            RxEvent::Advance(s) => {
                self.now += Duration::from_secs(s);
                let now = self.now;
                self.t.handle_timeout(now);
            }
        }
        self.drain()
    }

    fn drain(&mut self) -> Result<(), TestCaseError> {
        while let Some(tx) = self.t.poll_transmit() {
            if let Message::Destination(Destination { room: r, .. }) = tx.message {
                self.may_write.insert((r, tx.to));
            }
        }
        while let Some(a) = self.t.poll_action() {
            match a {
                ReceiverAction::CheckAux { .. } => {}
                ReceiverAction::Commit { room: r, pages, .. } => {
                    let need: BTreeSet<PeerId> = self.sources[&r].iter().copied().collect();
                    let got = self.succeeded.get(&r).cloned().unwrap_or_default();
                    prop_assert!(
                        need.is_subset(&got),
                        "commit of {:?} without success from every source",
                        r
                    );
                    prop_assert!(
                        self.ended.insert(r, "commit").is_none(),
                        "second outcome for {:?}",
                        r
                    );
                    prop_assert_eq!(Some(&pages), self.reserved.get(&r));
                }
                ReceiverAction::FailRequest { room: r, .. } => {
                    prop_assert!(
                        self.ended.insert(r, "fail").is_none(),
                        "second outcome for {:?}",
                        r
                    );
                }
                ReceiverAction::ReleasePages {
                    room: r,
                    fence_expired,
                    ..
                } => {
                    if !fence_expired {
                        let writing: Vec<_> =
                            self.may_write.iter().filter(|(rr, _)| *rr == r).collect();
                        prop_assert!(
                            writing.is_empty(),
                            "pages of {:?} released while {:?} may write",
                            r,
                            writing
                        );
                    }
                    prop_assert_eq!(
                        self.ended.get(&r),
                        Some(&"fail"),
                        "pages of {:?} released without a failure",
                        r
                    );
                    prop_assert!(
                        self.t.state(r).is_some_and(|s| s.is_terminal()),
                        "pages of a live room released"
                    );
                    prop_assert!(self.released.insert(r), "double release of {:?}", r);
                    self.may_write.retain(|(rr, _)| *rr != r);
                }
            }
        }
        for i in 0..4 {
            let r = room(i);
            let s = self.t.state(r);
            self.watch.observe(r, s, self.opened.contains(&r))?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum TxEvent {
    Open(u8),
    Dest(u8, u32, u16),
    Abort(u8, u32),
    ComputeDone(u8),
    WriteDone(u8, u32),
    WriteFailed(u8, u32),
    LocalFail(u8),
    Dead(u32),
    Advance(u64),
}

fn tx_event() -> impl Strategy<Value = TxEvent> {
    let r = 0u8..4;
    let k = 0u32..3;
    prop_oneof![
        1 => r.clone().prop_map(TxEvent::Open),
        3 => (r.clone(), k.clone(), 1u16..=2).prop_map(|(a, b, c)| TxEvent::Dest(a, b, c)),
        1 => (r.clone(), k.clone()).prop_map(|(a, b)| TxEvent::Abort(a, b)),
        2 => r.clone().prop_map(TxEvent::ComputeDone),
        3 => (r.clone(), k.clone()).prop_map(|(a, b)| TxEvent::WriteDone(a, b)),
        1 => (r.clone(), k.clone()).prop_map(|(a, b)| TxEvent::WriteFailed(a, b)),
        1 => r.prop_map(TxEvent::LocalFail),
        1 => k.prop_map(TxEvent::Dead),
        1 => (0u64..12).prop_map(TxEvent::Advance),
    ]
}

/// The prefill table driven by a harness playing every decode rank and the
/// prefill's own transport.
struct TxHarness {
    t: SenderRooms,
    now: Instant,
    watch: StateWatch,
    opened: BTreeSet<RoomId>,
    in_flight: BTreeSet<(RoomId, PeerId)>,
    written: BTreeMap<RoomId, BTreeSet<PeerId>>,
    write_targets: BTreeMap<RoomId, BTreeSet<PeerId>>,
    finished: BTreeSet<RoomId>,
}

impl TxHarness {
    fn apply(&mut self, e: TxEvent) -> Result<(), TestCaseError> {
        let now = self.now;
        match e {
            TxEvent::Open(i) => {
                let r = room(i);
                if self.t.open(r, now).is_ok() {
                    prop_assert!(self.opened.insert(r), "{:?} opened twice", r);
                }
            }
            TxEvent::Dest(i, k, n) => self.t.handle_message(
                PeerId(k),
                Message::Destination(Destination {
                    room: room(i),
                    pages: vec![PageIndex(1)],
                    aux_slot: AuxSlot(0),
                    required_destinations: n,
                    prefix_tokens: None,
                }),
                now,
            ),
            TxEvent::Abort(i, k) => self.t.handle_message(
                PeerId(k),
                Message::Abort(Abort {
                    room: room(i),
                    reason: "client".into(),
                    http_status: Some(499),
                    origin: Some(AbortOrigin::Client),
                }),
                now,
            ),
            TxEvent::ComputeDone(i) => self.t.handle_compute_done(room(i), now),
            TxEvent::WriteDone(i, k) => {
                let r = room(i);
                if self.in_flight.remove(&(r, PeerId(k))) {
                    self.written.entry(r).or_default().insert(PeerId(k));
                }
                self.t.handle_write_done(r, PeerId(k), now);
            }
            TxEvent::WriteFailed(i, k) => {
                self.in_flight.remove(&(room(i), PeerId(k)));
                self.t.handle_write_failed(
                    room(i),
                    PeerId(k),
                    TransferError::Internal {
                        reason: "io".into(),
                    },
                    now,
                );
            }
            TxEvent::LocalFail(i) => self.t.fail(
                room(i),
                TransferError::Rejected {
                    http_status: 400,
                    reason: "too long".into(),
                    code: None,
                },
                now,
            ),
            TxEvent::Dead(k) => self.t.handle_peer_dead(PeerId(k), now),
            TxEvent::Advance(s) => {
                self.now += Duration::from_secs(s);
                let now = self.now;
                self.t.handle_timeout(now);
            }
        }
        self.drain()
    }

    fn drain(&mut self) -> Result<(), TestCaseError> {
        while let Some(a) = self.t.poll_action() {
            match a {
                SenderAction::StartCompute { room: r } => prop_assert!(self.opened.contains(&r)),
                SenderAction::StartWrites {
                    room: r,
                    destinations,
                } => {
                    for (k, _) in destinations {
                        self.in_flight.insert((r, k));
                        self.write_targets.entry(r).or_default().insert(k);
                    }
                }
                SenderAction::CancelWrites { .. } => {}
                SenderAction::Finished { room: r, result } => {
                    prop_assert!(self.finished.insert(r), "{:?} finished twice", r);
                    if result.is_ok() {
                        prop_assert_eq!(
                            self.write_targets.get(&r),
                            self.written.get(&r),
                            "success before every destination was written"
                        );
                    }
                }
            }
        }
        while let Some(tx) = self.t.poll_transmit() {
            let r = tx.message.room();
            let claims_stopped = matches!(
                &tx.message,
                Message::Status(_) | Message::AbortAck(AbortAck { drained: true, .. })
            );
            if let (Some(r), true) = (r, claims_stopped) {
                let writing: Vec<_> = self.in_flight.iter().filter(|(rr, _)| *rr == r).collect();
                prop_assert!(
                    writing.is_empty(),
                    "{:?} claims stopped while {:?} in flight",
                    tx.message,
                    writing
                );
            }
            if let Message::Status(Status {
                room: r,
                outcome: Outcome::Success,
            }) = &tx.message
            {
                prop_assert_eq!(self.t.state(*r), Some(RoomState::Success));
            }
        }
        for i in 0..4 {
            let r = room(i);
            let s = self.t.state(r);
            self.watch.observe(r, s, self.opened.contains(&r))?;
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn decode_table_keeps_its_invariants(events in prop::collection::vec(rx_event(), 1..80)) {
        let mut h = RxHarness::new();
        for e in events {
            h.apply(e)?;
        }
        // Every deadline eventually fires: nothing stays live or leased.
        for _ in 0..6 {
            h.apply(RxEvent::Advance(31))?;
        }
        prop_assert_eq!(h.t.live_rooms(), 0);
        prop_assert_eq!(h.t.leased_pages(), 0);
        for r in &h.opened {
            prop_assert!(h.ended.contains_key(r), "{:?} never got an outcome", r);
        }
    }

    #[test]
    fn prefill_table_keeps_its_invariants(events in prop::collection::vec(tx_event(), 1..80)) {
        let mut h = TxHarness {
            t: SenderRooms::new(config()),
            now: Instant::now(),
            watch: StateWatch::default(),
            opened: BTreeSet::new(),
            in_flight: BTreeSet::new(),
            written: BTreeMap::new(),
            write_targets: BTreeMap::new(),
            finished: BTreeSet::new(),
        };
        for e in events {
            h.apply(e)?;
        }
        for _ in 0..6 {
            h.apply(TxEvent::Advance(31))?;
        }
        prop_assert_eq!(h.t.live_rooms(), 0);
        prop_assert_eq!(&h.finished, &h.opened, "every opened room finished exactly once");
    }
}
