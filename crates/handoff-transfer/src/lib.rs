//! handoff-transfer: the I/O shell around handoff-proto (DESIGN.md §2, §5).
//!
//! * [`conn`] — control connections: one task owns the sans-IO
//!   `Connection`, one writer task owns the socket's write half.
//! * [`link`], [`wire`] — data links: handshake, transport setup, the record
//!   format, and decode's bounds-checking link reader.
//! * [`transport`] — the [`Transport`] trait, [`ShmTransport`], [`TcpTransport`].
//! * [`sender`] — [`KvSender`], the prefill endpoint.
//! * [`receiver`] — [`KvReceiver`], the decode endpoint.
//! * [`bootstrap`] — where decode learns each prefill rank's address.
//! * [`bench`] — `bench-transfer`.
//!
//! The protocol (rooms, deadlines, handshake, codec) lives in handoff-proto;
//! this crate owns sockets, tasks and the clock, and does nothing clever.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bench;
pub mod bootstrap;
pub mod conn;
pub mod error;
pub mod link;
pub mod receiver;
pub mod sender;
pub mod testing;
pub mod transport;
pub mod wire;

pub use error::TransportError;
pub use receiver::{KvReceiver, ReceiverConfig, ReceiverPoll};
pub use sender::{KvSender, SenderConfig, SenderPoll};
pub use transport::{ShmTransport, TcpTransport, Transport, TransportKind};
pub use wire::AuxData;

use handoff_proto::room::RoomStats;
use handoff_proto::RankId;

/// Counters and gauges of one endpoint (prefill or decode).
#[derive(Debug, Clone, Default)]
pub struct EndpointStats {
    /// Live rooms (Draining included).
    pub live_rooms: usize,
    /// Peers with an established control connection.
    pub peers: usize,
    /// Their ranks.
    pub peers_ranks: Vec<RankId>,
    /// Data links up.
    pub links: usize,
    /// The room table's counters.
    pub room_stats: RoomStats,
    /// Malformed control frames counted and dropped.
    pub malformed_frames: u64,
    /// Data segments rejected by bounds checks.
    pub rejected_segments: u64,
    /// Handshakes refused (version, fingerprint, secret, garbage).
    pub handshakes_failed: u64,
    /// Live tasks.
    pub tasks: usize,
}
