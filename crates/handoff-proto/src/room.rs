//! What both room tables share: the
//! reported [`RoomState`], the table configuration, outgoing messages, and
//! the capped, expiring memory of rooms that are closed or unknown.
//!
//! A room lives in a table only while it is not terminal. When it ends it
//! leaves a [`Tombstone`] for [`crate::timer::Timer::UnknownRoomTtl`] so that late
//! events can be answered (an abort is acknowledged, a late destination for
//! a failed room learns the failure) without ever re-creating the room.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Instant;

use crate::error::TransferError;
use crate::ids::{PeerId, RoomId};
use crate::message::Message;
use crate::timer::TimerConfig;

/// The state of a room as reported to metrics and tests. Ordered: a room's
/// state only ever moves to a greater [`RoomState::order`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RoomState {
    /// Opened; waiting for the other side to show up (prefill: destinations;
    /// decode: its own page reservation).
    Bootstrapping,
    /// Handshake done; waiting for input (prefill: compute; decode: the
    /// writes to start).
    WaitingForInput,
    /// KV is moving.
    Transferring,
    /// Failed, but a write may still be in flight: resources stay fenced.
    Draining,
    /// Done, everything written and verified.
    Success,
    /// Failed; nothing in flight any more.
    Failed,
}

impl RoomState {
    /// Position in the monotonic order (terminal states share the top).
    pub const fn order(self) -> u8 {
        match self {
            RoomState::Bootstrapping => 0,
            RoomState::WaitingForInput => 1,
            RoomState::Transferring => 2,
            RoomState::Draining => 3,
            RoomState::Success | RoomState::Failed => 4,
        }
    }

    /// Success or Failed.
    pub const fn is_terminal(self) -> bool {
        matches!(self, RoomState::Success | RoomState::Failed)
    }

    /// Stable snake-case name (metrics label).
    pub const fn name(self) -> &'static str {
        match self {
            RoomState::Bootstrapping => "bootstrapping",
            RoomState::WaitingForInput => "waiting_for_input",
            RoomState::Transferring => "transferring",
            RoomState::Draining => "draining",
            RoomState::Success => "success",
            RoomState::Failed => "failed",
        }
    }
}

/// Limits and timers of a room table.
#[derive(Debug, Clone, PartialEq)]
pub struct RoomConfig {
    /// Deadlines.
    pub timers: TimerConfig,
    /// Most live rooms; more is a [`TransferError::Capacity`] at open.
    pub max_live_rooms: usize,
    /// Most remembered unknown or closed rooms (tombstones, parked
    /// destinations); the oldest is forgotten first.
    pub max_unknown_rooms: usize,
}

impl Default for RoomConfig {
    fn default() -> Self {
        Self {
            timers: TimerConfig::default(),
            max_live_rooms: 65_536,
            max_unknown_rooms: 4096,
        }
    }
}

/// A message to send to the peer of rank `to` (prefill ranks from decode,
/// decode ranks from prefill).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Destination peer rank.
    pub to: PeerId,
    /// The message.
    pub message: Message,
}

/// How a room ended, remembered for late events.
#[derive(Debug, Clone, PartialEq)]
pub enum Tombstone {
    /// The room succeeded.
    Success,
    /// The room failed. `drained` is false only when the abort fence expired
    /// with writes possibly still in flight.
    Failed {
        /// The failure.
        error: TransferError,
        /// Whether every write had stopped.
        drained: bool,
    },
    /// The peer aborted a room this side never opened; opening it later fails
    /// with this error.
    AbortedBeforeOpen {
        /// The abort as an error.
        error: TransferError,
    },
}

impl Tombstone {
    /// The terminal state it stands for.
    pub fn state(&self) -> RoomState {
        match self {
            Tombstone::Success => RoomState::Success,
            Tombstone::Failed { .. } | Tombstone::AbortedBeforeOpen { .. } => RoomState::Failed,
        }
    }
}

/// Capped, expiring map from room to something (tombstones, parked
/// messages). Insertion order is expiry order because the TTL is fixed.
///
/// Every operation is O(1) amortised: a removed or replaced entry leaves
/// its place in the order queue behind (it no longer matches the map's
/// sequence number) and is skipped when it reaches the front; the queue is
/// compacted once it holds more than twice the live entries.
#[derive(Debug)]
pub struct Expiring<T> {
    map: HashMap<RoomId, (Instant, u64, T)>,
    order: VecDeque<(Instant, RoomId, u64)>,
    next_seq: u64,
    cap: usize,
    /// Entries forgotten because the cap was reached.
    pub evicted: u64,
}

impl<T> Expiring<T> {
    /// An empty map holding at most `cap` entries.
    pub fn new(cap: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            next_seq: 0,
            cap,
            evicted: 0,
        }
    }

    /// Whether the order entry `(room, seq)` is still the room's entry.
    fn is_live(&self, room: RoomId, seq: u64) -> bool {
        self.map.get(&room).is_some_and(|(_, s, _)| *s == seq)
    }

    /// Drop stale entries at the front of the order (so the front is live)
    /// and compact the queue when stale entries dominate it.
    fn tidy(&mut self) {
        while let Some(&(_, room, seq)) = self.order.front() {
            if self.is_live(room, seq) {
                break;
            }
            self.order.pop_front();
        }
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(_, r, s)| map.get(r).is_some_and(|(_, live, _)| live == s));
        }
    }

    /// Insert or replace `room`'s entry, expiring at `expires`.
    pub fn insert(&mut self, room: RoomId, value: T, expires: Instant) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.map.insert(room, (expires, seq, value));
        self.order.push_back((expires, room, seq));
        while self.map.len() > self.cap {
            let Some((_, oldest, seq)) = self.order.pop_front() else {
                break;
            };
            if self.is_live(oldest, seq) {
                self.map.remove(&oldest);
                self.evicted += 1;
            }
        }
        self.tidy();
    }

    /// The entry for `room`.
    pub fn get(&self, room: RoomId) -> Option<&T> {
        self.map.get(&room).map(|(_, _, v)| v)
    }

    /// Mutable entry for `room`.
    pub fn get_mut(&mut self, room: RoomId) -> Option<&mut T> {
        self.map.get_mut(&room).map(|(_, _, v)| v)
    }

    /// Remove and return `room`'s entry.
    pub fn remove(&mut self, room: RoomId) -> Option<T> {
        let (_, _, v) = self.map.remove(&room)?;
        self.tidy();
        Some(v)
    }

    /// Drop every entry that expired at or before `now`.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&(at, room, seq)) = self.order.front() {
            if at > now {
                break;
            }
            self.order.pop_front();
            if self.is_live(room, seq) {
                self.map.remove(&room);
            }
        }
        self.tidy();
    }

    /// Earliest expiry.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.order.front().map(|(at, _, _)| *at)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Room deadlines as a min-heap. Entries are never updated in place: a new
/// deadline is pushed and the old entry goes stale; the table checks each
/// popped room's real deadline. `next` may therefore be early (a spurious
/// wake-up, harmless), never late.
#[derive(Debug, Default)]
pub struct Deadlines {
    heap: BinaryHeap<Reverse<(Instant, RoomId)>>,
}

impl Deadlines {
    /// Record that `room` must be looked at by `at`.
    pub fn push(&mut self, at: Instant, room: RoomId) {
        self.heap.push(Reverse((at, room)));
    }

    /// Earliest recorded deadline.
    pub fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Rooms with an entry at or before `now`, sorted, without duplicates.
    pub fn pop_due(&mut self, now: Instant) -> Vec<RoomId> {
        let mut due = Vec::new();
        while let Some(Reverse((at, room))) = self.heap.peek().copied() {
            if at > now {
                break;
            }
            self.heap.pop();
            due.push(room);
        }
        due.sort();
        due.dedup();
        due
    }

    /// Entries held (live and stale).
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Replace every entry by `live` (drops stale entries).
    pub fn rebuild(&mut self, live: impl Iterator<Item = (Instant, RoomId)>) {
        self.heap = live.map(Reverse).collect();
    }
}

/// Counters shared by both tables, for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoomStats {
    /// Rooms opened.
    pub opened: u64,
    /// Rooms that ended in Success.
    pub succeeded: u64,
    /// Rooms that ended in Failed.
    pub failed: u64,
    /// Opens refused (duplicate, zero capacity, already aborted).
    pub open_rejected: u64,
    /// Duplicate messages ignored (same destination, same status twice).
    pub duplicates: u64,
    /// Messages for rooms this side does not know (answered or parked, never
    /// creating a room).
    pub unknown_room_events: u64,
    /// Messages that break the protocol for a known room (counted; the room
    /// may be failed as peer-misbehaved).
    pub violations: u64,
    /// Abort fences that expired with a write possibly in flight.
    pub fence_expired: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn r(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    #[test]
    fn expiring_caps_and_expires() {
        let t0 = Instant::now();
        let mut m = Expiring::new(2);
        m.insert(r(1), "a", t0 + Duration::from_secs(1));
        m.insert(r(2), "b", t0 + Duration::from_secs(2));
        m.insert(r(3), "c", t0 + Duration::from_secs(3));
        assert_eq!(m.len(), 2);
        assert_eq!(m.evicted, 1);
        assert_eq!(m.get(r(1)), None);
        assert_eq!(m.next_expiry(), Some(t0 + Duration::from_secs(2)));
        m.expire(t0 + Duration::from_secs(2));
        assert_eq!(m.get(r(2)), None);
        assert_eq!(m.get(r(3)), Some(&"c"));
        assert_eq!(m.remove(r(3)), Some("c"));
        assert!(m.is_empty());
        assert_eq!(m.next_expiry(), None);
    }

    #[test]
    fn churn_behind_a_long_lived_entry_keeps_the_order_queue_bounded() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        let mut m = Expiring::new(1000);
        m.insert(r(1), 0, t0 + ttl);
        for i in 0..10_000u32 {
            let at = t0 + ttl + Duration::from_micros(u64::from(i));
            m.insert(r(2), i, at);
            if i % 2 == 0 {
                assert_eq!(m.remove(r(2)), Some(i));
            }
        }
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(r(2)), Some(&9_999));
        assert!(m.order.len() <= 2 * m.len() + 65, "{}", m.order.len());
        m.expire(t0 + ttl);
        assert_eq!((m.get(r(1)), m.len()), (None, 1));
        assert_eq!(
            m.next_expiry(),
            Some(t0 + ttl + Duration::from_micros(9_999))
        );
    }

    /// The map as first written (each removal rescans the order queue):
    /// the reference the amortised version must agree with.
    struct NaiveExpiring {
        entries: Vec<(RoomId, Instant, u32)>,
        cap: usize,
        evicted: u64,
    }

    impl NaiveExpiring {
        fn insert(&mut self, room: RoomId, v: u32, at: Instant) {
            self.entries.retain(|(r, _, _)| *r != room);
            self.entries.push((room, at, v));
            while self.entries.len() > self.cap {
                self.entries.remove(0);
                self.evicted += 1;
            }
        }
        fn remove(&mut self, room: RoomId) -> Option<u32> {
            let i = self.entries.iter().position(|(r, _, _)| *r == room)?;
            Some(self.entries.remove(i).2)
        }
        fn expire(&mut self, now: Instant) {
            while self.entries.first().is_some_and(|(_, at, _)| *at <= now) {
                self.entries.remove(0);
            }
        }
    }

    proptest::proptest! {
        /// Random inserts, replacements, removals and expiries (time only
        /// moves forward, the TTL is fixed) leave the amortised map equal to
        /// the naive one after every step: the same entries, the same
        /// evictions, the same next expiry, and an order queue that stays
        /// bounded.
        #[test]
        fn expiring_agrees_with_the_naive_map(
            ops in proptest::collection::vec((0u8..4, 1u64..12, 0u64..3), 1..400),
            cap in 0usize..64,
            ttl_ms in 1u64..2000,
        ) {
            let t0 = Instant::now();
            let ttl = Duration::from_millis(ttl_ms);
            let mut now = t0;
            let mut m = Expiring::new(cap);
            let mut naive = NaiveExpiring { entries: vec![], cap, evicted: 0 };
            for (i, (op, room, dt)) in ops.into_iter().enumerate() {
                now += Duration::from_millis(dt);
                let room = r(room);
                match op {
                    0 | 1 => {
                        m.insert(room, i as u32, now + ttl);
                        naive.insert(room, i as u32, now + ttl);
                    }
                    2 => proptest::prop_assert_eq!(m.remove(room), naive.remove(room)),
                    _ => {
                        m.expire(now);
                        naive.expire(now);
                    }
                }
                proptest::prop_assert_eq!(m.len(), naive.entries.len());
                proptest::prop_assert_eq!(m.evicted, naive.evicted);
                proptest::prop_assert_eq!(m.next_expiry(), naive.entries.first().map(|e| e.1));
                for (room, _, v) in &naive.entries {
                    proptest::prop_assert_eq!(m.get(*room), Some(v));
                }
                proptest::prop_assert!(m.order.len() <= 2 * m.len() + 65);
            }
        }
    }

    #[test]
    fn deadlines_pop_in_order_without_duplicates() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.push(t0 + Duration::from_secs(5), r(2));
        d.push(t0 + Duration::from_secs(1), r(1));
        d.push(t0 + Duration::from_secs(3), r(1));
        assert_eq!(d.next(), Some(t0 + Duration::from_secs(1)));
        assert_eq!(d.pop_due(t0 + Duration::from_secs(3)), vec![r(1)]);
        assert_eq!(d.len(), 1);
        d.rebuild(std::iter::empty());
        assert!(d.is_empty());
    }

    #[test]
    fn order_is_monotonic_with_terminal_top() {
        let all = [
            RoomState::Bootstrapping,
            RoomState::WaitingForInput,
            RoomState::Transferring,
            RoomState::Draining,
            RoomState::Success,
        ];
        for w in all.windows(2) {
            assert!(w[0].order() < w[1].order());
        }
        assert_eq!(RoomState::Failed.order(), RoomState::Success.order());
        assert!(RoomState::Failed.is_terminal() && !RoomState::Draining.is_terminal());
    }
}
