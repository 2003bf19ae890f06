//! handoff-proto: the sans-IO control-plane core of handoff (DESIGN.md §2, §4).
//!
//! Nothing here does I/O, spawns a thread or reads a clock: time is passed in
//! as [`std::time::Instant`], randomness (handshake nonces) by the caller.
//! The I/O shell (handoff-transfer) feeds received bytes to a
//! [`frame::FrameDecoder`], runs a [`handshake::Handshake`] per connection,
//! then hands decoded messages and local events to the room tables
//! ([`sender_room::SenderRooms`] on prefill, [`receiver_room::ReceiverRooms`]
//! on decode) and carries out what their `poll_*` methods return. This is
//! quinn's `quinn-proto` / `quinn` split.
//!
//! Modules, one concept each:
//! * [`ids`] — `RoomId`, `PageIndex`, `RankId`, `AuxSlot`, `Role`.
//! * [`codec`], [`frame`], [`message`] — the wire format.
//! * [`handshake`] — versions, capabilities, fingerprint, shared secret.
//! * [`connection`] — one control connection: bytes in, events out.
//! * [`room`], [`sender_room`], [`receiver_room`] — per-room state machines.
//! * [`timer`] — the one timer table.
//! * [`heartbeat`] — peer liveness.
//! * [`rank`] — TP rank mapping and head-sliced byte ranges.
//! * [`error`] — who is to blame.
//! * [`fuzz`] — entry points shared by cargo-fuzz targets and tests.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod codec;
pub mod connection;
pub mod error;
pub mod frame;
pub mod fuzz;
pub mod handshake;
pub mod heartbeat;
pub mod ids;
pub mod message;
pub mod rank;
pub mod receiver_room;
pub mod room;
pub mod sender_room;
pub mod timer;

pub use error::{AbortOrigin, CodecError, FailureKind, HandshakeError, Phase, TransferError};
pub use ids::{AuxSlot, PageIndex, RankId, Role, RoomId};
