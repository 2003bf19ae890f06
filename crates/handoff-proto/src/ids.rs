//! Identifier newtypes: rooms, pages, ranks, aux slots.
//!
//! Bare integers are never passed where one of these is meant, so a page index
//! cannot be handed to something that wants a rank.

use std::fmt;

/// A request's bootstrap room: a random non-zero `u64`, unique among live rooms.
///
/// `0` is reserved as "no room" and can never be constructed through
/// [`RoomId::new`]; the decoder rejects it on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RoomId(u64);

impl RoomId {
    /// The room id for `raw`, or `None` for the reserved value `0`.
    pub const fn new(raw: u64) -> Option<Self> {
        if raw == 0 {
            None
        } else {
            Some(Self(raw))
        }
    }

    /// The raw non-zero value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RoomId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "room {:#018x}", self.0)
    }
}

/// Index of a KV page in a decode worker's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageIndex(pub u32);

impl fmt::Display for PageIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

/// A tensor-parallel rank of one worker group (prefill or decode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankId(pub u32);

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// This endpoint's own number for one peer endpoint (a worker at the other
/// end of the PD pair), assigned per connection by whoever accepts or dials
/// it. Unrelated to the peer's TP rank: two prefill workers of TP rank 0 are
/// two peers, and the rank map works on [`RankId`]s, never on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(pub u32);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {}", self.0)
    }
}

/// Index of the auxiliary (metadata) slot that carries the first token,
/// its logprob and the room id for a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AuxSlot(pub u32);

impl fmt::Display for AuxSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "aux slot {}", self.0)
    }
}

/// Which side of the disaggregated pair a worker plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes the prompt's KV and writes it to decode.
    Prefill,
    /// Reserves pages, receives KV, generates tokens.
    Decode,
}

impl Role {
    /// Stable lower-case name, used in error messages ("prefill has 16").
    pub const fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The other role.
    pub const fn peer(self) -> Role {
        match self {
            Role::Prefill => Role::Decode,
            Role::Decode => Role::Prefill,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_zero_is_reserved() {
        assert_eq!(RoomId::new(0), None);
        assert_eq!(RoomId::new(7).map(RoomId::get), Some(7));
    }

    #[test]
    fn display_names_the_thing() {
        assert_eq!(
            RoomId::new(255).unwrap().to_string(),
            "room 0x00000000000000ff"
        );
        assert_eq!(PageIndex(3).to_string(), "page 3");
        assert_eq!(RankId(1).to_string(), "rank 1");
        assert_eq!(PeerId(1).to_string(), "peer 1");
        assert_eq!(Role::Prefill.peer(), Role::Decode);
    }
}
