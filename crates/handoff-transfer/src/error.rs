//! Errors of the I/O shell: who is to blame, a
//! stable `error_type()` and the HTTP status a client would see.

use handoff_proto::{AbortOrigin, HandshakeError, TransferError};

use crate::link::SetupRefusal;
use crate::plan::PlanError;

/// Why a transfer-layer operation failed (connections, links, handles).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Socket-level failure.
    #[error("I/O error during {what}: {source}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The handshake failed (version, fingerprint, secret, timeout).
    #[error("handshake failed: {0}")]
    Handshake(#[from] HandshakeError),
    /// The peer broke the data-plane protocol.
    #[error("peer misbehaved on the data link: {0}")]
    PeerMisbehaved(String),
    /// We refused a decode peer's data link setup (and told it why).
    #[error("data link setup refused: {0}")]
    LinkSetup(#[from] SetupRefusal),
    /// Shared memory could not be mapped or written.
    #[error("shared memory: {0}")]
    Kv(#[from] handoff_kv::KvError),
    /// A room-level failure.
    #[error(transparent)]
    Room(#[from] TransferError),
    /// The endpoint already keeps connections to this many peer
    /// addresses and was asked for another one.
    #[error("the endpoint already keeps connections to {limit} peer addresses, its limit")]
    TooManyPeers {
        /// The limit.
        limit: usize,
    },
    /// NIXL is not usable here: a build without the `nixl` feature, its
    /// library not found, its backend not created, or a NIXL call failed.
    #[error("nixl: {0}")]
    Nixl(String),
    /// The endpoint was shut down.
    #[error("transfer endpoint is shut down")]
    Shutdown,
    /// Bootstrap could not find or reach the prefill ranks.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// Our own settings cannot work with this peer (e.g. a pool whose KV
    /// heads per block are not this rank's TP share).
    #[error("configuration: {0}")]
    Config(#[from] PlanError),
}

impl TransportError {
    /// Stable label for metrics, OpenAI error objects and SSE events.
    pub fn error_type(&self) -> &'static str {
        match self {
            TransportError::Io { .. } => "transport_io",
            TransportError::Handshake(e) => e.error_type(),
            TransportError::PeerMisbehaved(_) => "peer_misbehaved",
            TransportError::LinkSetup(SetupRefusal::Plan(_)) => "config",
            TransportError::LinkSetup(_) => "peer_misbehaved",
            TransportError::Kv(_) => "shared_memory",
            TransportError::Room(e) => e.error_type(),
            TransportError::TooManyPeers { .. } => "too_many_peers",
            TransportError::Nixl(_) => "nixl",
            TransportError::Shutdown => "shutdown",
            TransportError::Bootstrap(_) => "bootstrap",
            TransportError::Config(_) => "config",
        }
    }

    /// HTTP status a client would see.
    pub fn http_status(&self) -> u16 {
        match self {
            TransportError::Room(e) => e.http_status(),
            TransportError::Handshake(e) => e.http_status(),
            TransportError::Shutdown
            | TransportError::Bootstrap(_)
            | TransportError::TooManyPeers { .. } => 503,
            _ => 500,
        }
    }

    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> TransportError {
        move |source| TransportError::Io { what, source }
    }
}

/// The failure of a prefill room whose owner went away before the room
/// ended (the prefill worker stopped the request).
pub(crate) fn prefill_dropped() -> TransferError {
    TransferError::Aborted {
        origin: AbortOrigin::Shutdown,
        reason: "the prefill worker stopped the request".into(),
        http_status: 503,
    }
}

/// The failure of a room whose owner went away (its client left).
pub(crate) fn client_gone() -> TransferError {
    TransferError::Aborted {
        origin: AbortOrigin::Client,
        reason: "the client went away".into(),
        http_status: 499,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_timeout_is_labelled_as_a_timeout() {
        let t =
            TransportError::Handshake(HandshakeError::TimedOut(std::time::Duration::from_secs(2)));
        assert_eq!(
            (t.error_type(), t.http_status()),
            ("handshake_timeout", 504)
        );
        let i = TransportError::Handshake(HandshakeError::AuthFailed);
        assert_eq!(
            (i.error_type(), i.http_status()),
            ("peer_incompatible", 500)
        );
        let r = TransportError::Room(TransferError::DuplicateRoom);
        assert_eq!((r.error_type(), r.http_status()), ("duplicate_room", 409));
    }
}
