//! Peer liveness (DESIGN.md §4, FIELD-NOTES invariant 18): both ends send a
//! [`Heartbeat`] every [`Timer::HeartbeatInterval`] and declare a peer dead
//! after [`Timer::HeartbeatMiss`] without hearing anything from it. Any
//! frame counts as a sign of life.
//!
//! Sans-IO: [`Liveness::handle_seen`] on every received frame,
//! [`Liveness::poll_transmit`] for heartbeats to send, and
//! [`Liveness::handle_timeout`] at [`Liveness::poll_timeout`], which returns
//! the peers that just died; hand them to the room table's
//! `handle_peer_dead`.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::ids::RankId;
use crate::message::{Heartbeat, Message};
use crate::room::Transmit;
use crate::timer::{Timer, TimerConfig};

#[derive(Debug, Clone, Copy)]
struct Peer {
    last_seen: Instant,
    next_send: Instant,
}

/// Liveness of every connected peer.
#[derive(Debug)]
pub struct Liveness {
    timers: TimerConfig,
    peers: BTreeMap<RankId, Peer>,
    seq: u64,
}

impl Liveness {
    /// No peers yet.
    pub fn new(timers: TimerConfig) -> Self {
        Self {
            timers,
            peers: BTreeMap::new(),
            seq: 0,
        }
    }

    /// Start tracking `peer` (after its handshake completed).
    pub fn add_peer(&mut self, peer: RankId, now: Instant) {
        self.peers.insert(
            peer,
            Peer {
                last_seen: now,
                next_send: now,
            },
        );
    }

    /// Stop tracking `peer` (connection closed on purpose).
    pub fn remove_peer(&mut self, peer: RankId) {
        self.peers.remove(&peer);
    }

    /// Peers being tracked.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Anything arrived from `peer`.
    pub fn handle_seen(&mut self, peer: RankId, now: Instant) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.last_seen = p.last_seen.max(now);
        }
    }

    /// A heartbeat due to some peer at `now`, if any. Call until `None`.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        let interval = self.timers.get(Timer::HeartbeatInterval);
        let (rank, p) = self.peers.iter_mut().find(|(_, p)| p.next_send <= now)?;
        p.next_send = now + interval;
        self.seq += 1;
        Some(Transmit {
            to: *rank,
            message: Message::Heartbeat(Heartbeat { seq: self.seq }),
        })
    }

    /// Next time a heartbeat is due or a peer may be declared dead.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let miss = self.timers.get(Timer::HeartbeatMiss);
        self.peers
            .values()
            .flat_map(|p| [p.next_send, p.last_seen + miss])
            .min()
    }

    /// Peers silent for the miss bound at `now`; they are forgotten.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<RankId> {
        let miss = self.timers.get(Timer::HeartbeatMiss);
        let dead: Vec<RankId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.last_seen + miss <= now)
            .map(|(r, _)| *r)
            .collect();
        for r in &dead {
            self.peers.remove(r);
        }
        dead
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn silent_peer_dies_at_the_miss_bound() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TimerConfig::default());
        l.add_peer(RankId(1), t0);
        l.add_peer(RankId(2), t0);
        let first = l.poll_transmit(t0).unwrap();
        assert!(matches!(
            first.message,
            Message::Heartbeat(Heartbeat { seq: 1 })
        ));
        assert!(l.poll_transmit(t0).is_some());
        assert!(l.poll_transmit(t0).is_none());
        assert_eq!(l.poll_timeout(), Some(t0 + Duration::from_secs(1)));
        l.handle_seen(RankId(2), t0 + Duration::from_secs(3));
        assert!(l
            .handle_timeout(t0 + Duration::from_millis(4999))
            .is_empty());
        assert_eq!(
            l.handle_timeout(t0 + Duration::from_secs(5)),
            vec![RankId(1)]
        );
        assert_eq!(
            l.handle_timeout(t0 + Duration::from_secs(8)),
            vec![RankId(2)]
        );
        assert_eq!(l.peers(), 0);
    }
}
