//! handoff-proto: the sans-IO control-plane core of handoff.
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
//! * [`ids`] — `RoomId`, `PageIndex`, `RankId`, `PeerId`, `AuxSlot`, `Role`.
//! * [`codec`], [`frame`], [`message`] — the control wire format.
//! * [`datalink`] — the data-link records (KV placement, aux, end, ack).
//! * [`handshake`] — versions, capabilities, fingerprint, shared secret.
//! * [`connection`] — one control connection: bytes in, events out.
//! * [`room`], [`sender_room`], [`receiver_room`] — per-room state machines.
//! * [`sender_endpoint`] — the prefill endpoint: rooms, peers, connect
//!   admission, link assembly and each room's event sink in one sans-IO owner.
//! * [`receiver_endpoint`] — the decode endpoint: rooms, peers, leases,
//!   and each room's event sink in one sans-IO owner.
//! * [`timer`] — the one timer table.
//! * [`heartbeat`] — peer liveness.
//! * [`layout`] — KV dtype, K/V and the pool's byte layout (one copy of it).
//! * [`rank`] — TP rank mapping and head-sliced byte ranges.
//! * [`error`] — who is to blame.
//! * `fuzz` (feature `fuzz`; fuzz targets and tests only) — entry points
//!   shared by cargo-fuzz targets and tests.

//!
//! # Driving the room tables
//!
//! One room from open to commit, with the messages handed across directly
//! (a real shell sends them through a [`connection::Connection`]):
//!
//! ```
//! use std::time::Instant;
//! use handoff_proto::receiver_room::{ReceiverAction, ReceiverRooms, Source};
//! use handoff_proto::room::RoomConfig;
//! use handoff_proto::sender_room::{SenderAction, SenderRooms};
//! use handoff_proto::{AuxSlot, PageIndex, PeerId, RoomId};
//!
//! let now = Instant::now();
//! let room = RoomId::new(42).unwrap();
//! let mut prefill = SenderRooms::new(RoomConfig::default());
//! let mut decode = ReceiverRooms::new(RoomConfig::default());
//!
//! prefill.open(room, now).unwrap();
//! decode
//!     .open(room, vec![Source { peer: PeerId(0), required_destinations: 1 }], now)
//!     .unwrap();
//! // Decode reserved pages: a Destination goes to prefill rank 0.
//! decode
//!     .handle_pages_reserved(room, vec![PageIndex(3), PageIndex(8)], AuxSlot(0), None, now)
//!     .unwrap();
//! while let Some(t) = decode.poll_transmit() {
//!     prefill.handle_message(PeerId(0), t.message, now); // from decode peer 0
//! }
//! // Every destination is known: prefill computes, then writes.
//! assert_eq!(prefill.poll_action(), Some(SenderAction::StartCompute { room }));
//! prefill.handle_compute_done(room, now);
//! assert!(matches!(prefill.poll_action(), Some(SenderAction::StartWrites { .. })));
//! prefill.handle_write_done(room, PeerId(0), now); // KV and aux landed
//! assert!(matches!(prefill.poll_action(), Some(SenderAction::Finished { result: Ok(()), .. })));
//! while let Some(t) = prefill.poll_transmit() {
//!     decode.handle_message(PeerId(0), t.message, now); // Status(Success)
//! }
//! // Decode checks the aux slot carries the room id, then commits.
//! assert_eq!(decode.poll_action(), Some(ReceiverAction::CheckAux { room, aux_slot: AuxSlot(0) }));
//! decode.handle_aux_checked(room, 42, now);
//! assert!(matches!(decode.poll_action(), Some(ReceiverAction::Commit { .. })));
//! assert_eq!((prefill.live_rooms(), decode.live_rooms()), (0, 0));
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bootstrap_auth;
pub mod capabilities;
pub mod codec;
pub mod connection;
pub mod datalink;
pub mod error;
pub mod fingerprint;
pub mod frame;
// Unit tests (handshake, connection) use its sample fingerprint too.
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod handshake;
pub mod heartbeat;
pub mod ids;
pub mod landing;
pub mod layout;
pub mod message;
pub mod peer_ids;
pub mod placement;
pub mod rank;
pub mod receiver_endpoint;
pub mod receiver_room;
pub mod room;
pub mod sender_endpoint;
pub mod sender_room;
pub mod timer;
pub mod version;

pub use error::{
    AbortOrigin, CodecError, FailureKind, HandshakeError, Misbehavior, Phase, RejectCode,
    TransferError,
};
pub use ids::{AuxSlot, PageIndex, PeerId, RankId, Role, RoomId};
