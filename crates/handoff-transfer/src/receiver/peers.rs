//! The decode endpoint's prefill peers as its callers know them: by
//! address. [`KvReceiver::peer`] connects once per address, reuses the
//! connection while the endpoint holds it live, and connects again once
//! the endpoint found it dead (the prefill died or restarted, or reported
//! that its end of the link died). The connect numbers prefill uses to keep
//! the newest connection live here too.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex};

use handoff_proto::PeerId;

use super::KvReceiver;
use crate::error::TransportError;
use crate::transport::TransportKind;

/// Most prefill addresses one decode endpoint keeps a connection for at
/// once (the router's configured or discovered prefill workers).
pub const MAX_PEER_ADDRESSES: usize = 256;

/// One address's connection, once made; held while it is being made, so
/// requests to one address wait for one connect.
type Slot = Arc<tokio::sync::Mutex<Option<PeerId>>>;

/// Peer identity on the handle side: see the module docs.
#[derive(Debug, Default)]
pub(super) struct Peers {
    /// This endpoint's connect numbers: prefill keeps the connections of
    /// the newest connect of an endpoint.
    pub(super) conn_ids: AtomicU64,
    /// Our ids for prefill endpoints (two prefill workers of the same TP
    /// rank are different peers).
    pub(super) next_peer: AtomicU32,
    by_addr: Mutex<HashMap<SocketAddr, Slot>>,
}

impl Peers {
    /// The slot of `addr`; refused past [`MAX_PEER_ADDRESSES`] addresses.
    /// A slot in no use and never connected is dropped first.
    fn slot(&self, addr: SocketAddr) -> Result<Slot, TransportError> {
        let mut by_addr = self.by_addr.lock().unwrap_or_else(|e| e.into_inner());
        by_addr.retain(|_, s| Arc::strong_count(s) > 1 || s.try_lock().is_ok_and(|p| p.is_some()));
        if !by_addr.contains_key(&addr) && by_addr.len() >= MAX_PEER_ADDRESSES {
            return Err(TransportError::TooManyPeers {
                limit: MAX_PEER_ADDRESSES,
            });
        }
        Ok(by_addr.entry(addr).or_default().clone())
    }
}

impl KvReceiver {
    /// The prefill peer listening at `addr`, its data link over
    /// `transport`: connected on first use and reused while this endpoint
    /// holds its control connection and data link live. A peer the endpoint
    /// found dead (a missed heartbeat, a closed connection, or a room that
    /// failed because the prefill's end of the link died) is connected
    /// again here, under a new id.
    ///
    /// The connect runs in a task of its own: a caller cancelled meanwhile
    /// leaves no half-made connection, and the others waiting for the same
    /// address get its result. Other addresses are not held up (a prefill
    /// that never answers costs its own callers the handshake deadline).
    pub async fn peer(
        &self,
        addr: SocketAddr,
        transport: TransportKind,
    ) -> Result<PeerId, TransportError> {
        let slot = self.peers.slot(addr)?;
        let rx = self.clone();
        tokio::spawn(async move {
            let mut known = slot.lock().await;
            if let Some(p) = *known {
                if rx.is_connected(p).await? {
                    return Ok(p);
                }
                tracing::info!(prefill = %addr, peer = p.0, "prefill connection lost: reconnecting");
                *known = None;
            }
            let peer = rx.connect_with(addr, transport).await?;
            tracing::info!(prefill = %addr, peer = peer.0, transport = transport.name(), "connected to a prefill");
            *known = Some(peer);
            Ok(peer)
        })
        .await
        .unwrap_or(Err(TransportError::Shutdown))
    }
}
