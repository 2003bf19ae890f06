//! The ids prefill gives decode endpoints (sans-IO; the sender endpoint
//! owns the table, [`crate::sender_endpoint::SenderEndpoint::peer_id`]).

use std::collections::HashMap;

use crate::ids::PeerId;

/// Decode endpoint id → the peer id the room table knows it by. An id is
/// assigned when a connection's preface arrives, before its handshake, so
/// unauthenticated connections can create ids: those stay *unconfirmed* and
/// at most [`MAX_UNCONFIRMED`] of them are kept (oldest forgotten first).
/// An id is *confirmed* once a data link of that endpoint passed its
/// handshake; confirmed ids are never evicted by unconfirmed churn, so a
/// flood of bogus prefaces cannot take a live decode's id away (a
/// reconnecting decode whose id was forgotten simply gets a new one).
#[derive(Debug, Default)]
pub struct PeerIds {
    ids: HashMap<u64, (PeerId, bool)>,
    unconfirmed: std::collections::VecDeque<u64>,
    confirmed: std::collections::VecDeque<u64>,
    next: u32,
}

/// Most ids kept for endpoints that never completed a handshake.
pub const MAX_UNCONFIRMED: usize = 4096;
/// Most ids kept for endpoints that did.
const MAX_CONFIRMED: usize = 65_536;

impl PeerIds {
    /// The id of decode endpoint `endpoint` (a new one the first time).
    pub fn assign(&mut self, endpoint: u64) -> PeerId {
        let t = self;
        if let Some((r, _)) = t.ids.get(&endpoint) {
            return *r;
        }
        let r = PeerId(t.next);
        t.next = t.next.wrapping_add(1);
        t.ids.insert(endpoint, (r, false));
        t.unconfirmed.push_back(endpoint);
        while t.unconfirmed.len() > MAX_UNCONFIRMED {
            if let Some(old) = t.unconfirmed.pop_front() {
                if matches!(t.ids.get(&old), Some((_, false))) {
                    t.ids.remove(&old);
                }
            }
        }
        r
    }

    /// `endpoint` passed a handshake: keep its id.
    pub fn confirm(&mut self, endpoint: u64) {
        let t = self;
        let Some(entry) = t.ids.get_mut(&endpoint) else {
            return;
        };
        if entry.1 {
            return;
        }
        entry.1 = true;
        t.unconfirmed.retain(|e| *e != endpoint);
        t.confirmed.push_back(endpoint);
        while t.confirmed.len() > MAX_CONFIRMED {
            if let Some(old) = t.confirmed.pop_front() {
                t.ids.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_unauthenticated_prefaces_keeps_a_confirmed_id() {
        let mut ids = PeerIds::default();
        let live = ids.assign(7);
        ids.confirm(7);
        for e in 1000..(1000 + 3 * MAX_UNCONFIRMED as u64) {
            ids.assign(e);
        }
        assert_eq!(ids.assign(7), live, "the live decode kept its id");
        assert!(
            ids.ids.len() <= MAX_UNCONFIRMED + 1,
            "{} ids kept",
            ids.ids.len()
        );
    }

    #[test]
    fn unconfirmed_ids_are_forgotten_oldest_first() {
        let mut ids = PeerIds::default();
        let first = ids.assign(1);
        for e in 2..=(MAX_UNCONFIRMED as u64 + 1) {
            ids.assign(e);
        }
        assert_ne!(
            ids.assign(1),
            first,
            "the oldest unconfirmed id was forgotten"
        );
    }
}
