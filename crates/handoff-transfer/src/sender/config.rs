//! A prefill endpoint's settings.

use std::net::SocketAddr;
use std::time::Duration;

use handoff_proto::handshake::HandshakeConfig;
use handoff_proto::room::RoomConfig;

/// Settings of a prefill endpoint.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// Where to listen for decode peers (control and data links).
    pub listen: SocketAddr,
    /// Handshake: role Prefill, fingerprint, optional secret.
    pub handshake: HandshakeConfig,
    /// Room table limits and timers.
    pub rooms: RoomConfig,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Largest coalesced segment in bytes.
    pub max_segment_bytes: usize,
}

impl SenderConfig {
    /// Defaults for `handshake` on 127.0.0.1, any port.
    pub fn new(handshake: HandshakeConfig) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            handshake,
            rooms: RoomConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            max_segment_bytes: 4 << 20,
        }
    }
}

pub use handoff_proto::sender_endpoint::SenderRoomEvent;
