//! What decode's link reader and its driver say to each other.

use handoff_kv::lease::WriterGuard;
use handoff_proto::datalink::AuxData;
use handoff_proto::RoomId;

use super::error::LinkReadError;

/// Decode side: commands from the driver to a link reader.
pub enum ReaderCmd {
    /// `room` may receive writes into `pages` (sorted) and `aux_slot`.
    Register {
        /// The room.
        room: RoomId,
        /// Its pages, sorted.
        pages: Vec<u32>,
        /// Its aux slot.
        aux_slot: u32,
        /// Keeps the pages from the free list while this link may write.
        guard: WriterGuard,
    },
    /// Stop writing `room` and drop its guard: the reader is the only
    /// writer of its pages, so nothing lands for it after this command.
    Forget {
        /// The room.
        room: RoomId,
    },
}

/// Decode side: what a link reader reports to the driver.
#[derive(Debug)]
pub enum ReaderEvent {
    /// The aux record of `room` arrived (before its end marker).
    Aux {
        /// The room.
        room: RoomId,
        /// The room id written in the slot.
        written_room: u64,
        /// The data.
        aux: AuxData,
        /// The room's prompt scores (flat pairs; empty unless asked for).
        prompt: Vec<(u32, f32)>,
    },
    /// The link closed.
    Closed {
        /// Why.
        reason: LinkReadError,
    },
}
