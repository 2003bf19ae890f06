//! A decode endpoint's settings.

use std::time::Duration;

use handoff_kv::PageLease;
use handoff_proto::handshake::HandshakeConfig;
use handoff_proto::room::RoomConfig;

use crate::transport::TransportKind;

/// Settings of a decode endpoint.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// Handshake: role Decode, fingerprint, optional secret.
    pub handshake: HandshakeConfig,
    /// Room table limits and timers.
    pub rooms: RoomConfig,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Transport of new links.
    pub transport: TransportKind,
    /// TCP streams per data link (`1..=16`; shm links have one). Rooms are
    /// spread over the streams by id, so concurrent rooms travel in
    /// parallel; one room always uses one stream.
    pub tcp_streams: u8,
}

impl ReceiverConfig {
    /// Defaults for `handshake` over `transport`.
    pub fn new(handshake: HandshakeConfig, transport: TransportKind) -> Self {
        Self {
            handshake,
            rooms: RoomConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            transport,
            tcp_streams: 1,
        }
    }
}

/// How a decode room ended, as its [`ReceiverRoom`](crate::ReceiverRoom)
/// hears it: committed (the lease and aux come back) or failed.
pub type ReceiverOutcome = handoff_proto::receiver_endpoint::ReceiverOutcome<PageLease>;
