//! Bootstrap rooms: a random id in `1..=i64::MAX`
//! per attempt, unique among the router's live requests. A [`RoomGuard`]
//! holds the id; dropping it (completion, failure, client gone) frees it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use handoff_proto::RoomId;
use rand::Rng;

/// The live rooms.
#[derive(Debug, Default)]
pub struct Rooms {
    live: Mutex<HashSet<u64>>,
}

impl Rooms {
    /// Draw a fresh room, re-drawing while the id is live.
    pub fn allocate(self: &Arc<Self>) -> RoomGuard {
        let mut rng = rand::rng();
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let id = rng.random_range(1..=i64::MAX as u64);
            if live.insert(id) {
                return RoomGuard {
                    id: RoomId::new(id).expect("drawn from 1.."),
                    rooms: Arc::clone(self),
                };
            }
        }
    }

    /// Rooms live now.
    pub fn live(&self) -> usize {
        self.live.lock().map(|l| l.len()).unwrap_or(0)
    }
}

/// A live room; dropping it frees the id.
#[derive(Debug)]
pub struct RoomGuard {
    id: RoomId,
    rooms: Arc<Rooms>,
}

impl RoomGuard {
    /// The id.
    pub fn id(&self) -> RoomId {
        self.id
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        let mut live = self.rooms.live.lock().unwrap_or_else(|e| e.into_inner());
        live.remove(&self.id.get());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_are_unique_nonzero_and_freed() {
        let rooms = Arc::new(Rooms::default());
        let guards: Vec<_> = (0..1000).map(|_| rooms.allocate()).collect();
        let ids: HashSet<u64> = guards.iter().map(|g| g.id().get()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|&i| i >= 1 && i <= i64::MAX as u64));
        assert_eq!(rooms.live(), 1000);
        drop(guards);
        assert_eq!(rooms.live(), 0);
    }
}
