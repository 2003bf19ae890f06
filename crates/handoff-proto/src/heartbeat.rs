//! Peer liveness: both ends send a
//! [`Heartbeat`] every [`Timer::HeartbeatInterval`] and declare a peer dead
//! after [`Timer::HeartbeatMiss`] without hearing anything from it. Any
//! frame counts as a sign of life.
//!
//! Silence is measured only while we ourselves were watching. The driver
//! is due back at least every heartbeat interval (to send the next one);
//! when it comes back later than that, its process or machine stalled (a
//! VM pause, a starved runtime, `SIGSTOP`), and every peer's frames of that
//! time may still sit unread in our sockets. The lateness is added to every
//! peer's `last_seen`, as if the clock had stopped while we did, so a stall
//! of our own never kills a live peer. A peer that is really silent still
//! dies: each wake-up counts up to an interval of its silence, so even a
//! driver that is always late declares it dead after the miss bound's
//! worth of intervals.
//!
//! Sans-IO: [`Liveness::handle_seen`] on every received frame,
//! [`Liveness::poll_transmit`] for heartbeats to send, and
//! [`Liveness::handle_timeout`] at [`Liveness::poll_timeout`], which returns
//! the peers that just died; hand them to the room table's
//! `handle_peer_dead`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::ids::PeerId;
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
    peers: BTreeMap<PeerId, Peer>,
    seq: u64,
    /// When any method that takes `now` last ran.
    last_call: Option<Instant>,
    /// Lateness forgiven so far (our own stalls).
    stalled: Duration,
}

impl Liveness {
    /// No peers yet.
    pub fn new(timers: TimerConfig) -> Self {
        Self {
            timers,
            peers: BTreeMap::new(),
            seq: 0,
            last_call: None,
            stalled: Duration::ZERO,
        }
    }

    /// Account for the time since the last call: whatever exceeds one
    /// heartbeat interval (when we were due back at the latest) was a stall
    /// of ours, and does not count as any peer's silence.
    fn wake(&mut self, now: Instant) {
        if let Some(prev) = self.last_call {
            let interval = self.timers.get(Timer::HeartbeatInterval);
            let late = now.saturating_duration_since(prev).saturating_sub(interval);
            if !late.is_zero() {
                self.stalled += late;
                for p in self.peers.values_mut() {
                    p.last_seen = (p.last_seen + late).min(now);
                }
            }
        }
        self.last_call = Some(self.last_call.map_or(now, |prev| prev.max(now)));
    }

    /// Total time our own stalls were forgiven (see the module docs).
    pub fn stalled(&self) -> Duration {
        self.stalled
    }

    /// Start tracking `peer` (after its handshake completed).
    pub fn add_peer(&mut self, peer: PeerId, now: Instant) {
        self.wake(now);
        self.peers.insert(
            peer,
            Peer {
                last_seen: now,
                next_send: now,
            },
        );
    }

    /// Stop tracking `peer` (connection closed on purpose).
    pub fn remove_peer(&mut self, peer: PeerId) {
        self.peers.remove(&peer);
    }

    /// Peers being tracked.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Anything arrived from `peer`.
    pub fn handle_seen(&mut self, peer: PeerId, now: Instant) {
        self.wake(now);
        if let Some(p) = self.peers.get_mut(&peer) {
            p.last_seen = p.last_seen.max(now);
        }
    }

    /// A heartbeat due to some peer at `now`, if any. Call until `None`.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        self.wake(now);
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
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<PeerId> {
        self.wake(now);
        let miss = self.timers.get(Timer::HeartbeatMiss);
        let dead: Vec<PeerId> = self
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

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// A punctual driver: wakes at every `poll_timeout` (sending what is
    /// due, as the transfer drivers do) until `end`; the deaths it saw, at
    /// their offsets from `t0`.
    fn drive(l: &mut Liveness, t0: Instant, end: Instant) -> Vec<(Duration, PeerId)> {
        let mut dead = Vec::new();
        while let Some(at) = l.poll_timeout().filter(|at| *at <= end) {
            dead.extend(l.handle_timeout(at).into_iter().map(|r| (at - t0, r)));
            while l.poll_transmit(at).is_some() {}
        }
        dead
    }

    #[test]
    fn silent_peer_dies_at_the_miss_bound() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TimerConfig::default());
        l.add_peer(PeerId(1), t0);
        l.add_peer(PeerId(2), t0);
        let first = l.poll_transmit(t0).unwrap();
        assert!(matches!(
            first.message,
            Message::Heartbeat(Heartbeat { seq: 1 })
        ));
        assert!(l.poll_transmit(t0).is_some());
        assert!(l.poll_transmit(t0).is_none());
        assert_eq!(l.poll_timeout(), Some(t0 + secs(1.0)));
        assert!(drive(&mut l, t0, t0 + secs(3.0)).is_empty());
        l.handle_seen(PeerId(2), t0 + secs(3.0));
        assert!(drive(&mut l, t0, t0 + secs(4.999)).is_empty());
        assert_eq!(
            drive(&mut l, t0, t0 + secs(20.0)),
            vec![(secs(5.0), PeerId(1)), (secs(8.0), PeerId(2))]
        );
        assert_eq!(l.peers(), 0);
        assert_eq!(l.stalled(), Duration::ZERO);
    }

    /// Our own process stalling (a VM pause, `SIGSTOP`) is not the peers'
    /// silence: their frames of that time are still unread in our sockets.
    #[test]
    fn a_stall_of_our_own_kills_no_peer() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TimerConfig::default());
        l.add_peer(PeerId(1), t0);
        l.add_peer(PeerId(2), t0);
        assert!(drive(&mut l, t0, t0 + secs(2.0)).is_empty());
        l.handle_seen(PeerId(1), t0 + secs(2.0));
        l.handle_seen(PeerId(2), t0 + secs(2.0));
        // Frozen from 2 s to 12 s, when we were due back at 3 s: the first
        // wake-up kills no one, and peer 1's heartbeat, read right after,
        // keeps it alive.
        let back = t0 + secs(12.0);
        assert!(l.handle_timeout(back).is_empty());
        assert_eq!(l.stalled(), secs(9.0));
        l.handle_seen(PeerId(1), back);
        // Peer 2 stays silent: it dies once we watched it for the miss
        // bound (the interval before we were due back, and four seconds
        // after the stall), peer 1 five seconds after its heartbeat.
        assert_eq!(
            drive(&mut l, t0, t0 + secs(30.0)),
            vec![(secs(16.0), PeerId(2)), (secs(17.0), PeerId(1))]
        );
    }

    /// A driver late at every wake-up still declares a silent peer dead:
    /// each wake-up counts one interval of silence.
    #[test]
    fn an_always_late_driver_still_finds_the_dead() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TimerConfig::default());
        l.add_peer(PeerId(1), t0);
        let mut at = t0;
        let mut wakes = 0;
        let died = loop {
            at += secs(4.0); // due after 1 s, 3 s late every time
            wakes += 1;
            let dead = l.handle_timeout(at);
            while l.poll_transmit(at).is_some() {}
            if !dead.is_empty() {
                assert_eq!(dead, vec![PeerId(1)]);
                break wakes;
            }
            assert!(wakes < 10, "never declared dead");
        };
        assert_eq!(died, 5);
    }
}
