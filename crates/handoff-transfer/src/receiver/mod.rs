//! The decode side: [`KvReceiver`], a
//! cheap handle around one driver task, the I/O shell of a
//! [`ReceiverEndpoint`](handoff_proto::receiver_endpoint::ReceiverEndpoint), which owns the rooms, the page leases of live rooms,
//! the aux records, heartbeats and what is known of every prefill peer; the
//! driver holds the sockets' and tasks' handles only.
//!
//! An engine asks [`KvReceiver::peer`] for the prefill at a bootstrap
//! address (connected once, again after the endpoint found it dead; the
//! index of addresses, connect numbers and ids lives in `peers.rs`),
//! calls [`KvReceiver::submit`] when it accepts a request, and
//! drives the returned [`ReceiverRoom`](crate::ReceiverRoom): `reserve` once it holds the pages
//! (backpressure: a room may wait in `Bootstrapping` for them), then
//! `landed` for the lease and aux, or the failure as the side that saw it
//! reported. Dropping the room aborts it; [`KvReceiver::refuse`] aborts a
//! room never submitted. The pages of an aborted room return to the pool
//! only after every prefill writer drained or the abort fence passed.
//!
//! The files: this one is the handle's API; `peers.rs` the peers by
//! address; `connect.rs` connects to a prefill (control connection, then
//! the data link); `driver.rs` is the
//! driver task; `commands.rs` what the handle tells the driver;
//! `config.rs` the settings.

use std::sync::Arc;

use handoff_kv::{KvLayout, PageLease, ShmRegion};
use handoff_proto::handshake::Capabilities;
use handoff_proto::receiver_room::Source;
use handoff_proto::{AuxSlot, PeerId, RoomId, TransferError};
use tokio::sync::{mpsc, oneshot};

use crate::conn::TaskCounter;
use crate::error::TransportError;
use crate::stats::EndpointStats;
use commands::{Cmd, Ev};
use driver::Driver;

mod commands;
mod config;
mod connect;
mod driver;
mod peers;
pub(crate) mod room;

pub use config::{ReceiverConfig, ReceiverOutcome};
pub use peers::MAX_PEER_ADDRESSES;

/// Handle to a decode transfer endpoint. Cheap to clone.
#[derive(Clone)]
pub struct KvReceiver {
    tx: mpsc::UnboundedSender<Ev>,
    config: ReceiverConfig,
    /// Our pool (a NIXL link registers it to READ into).
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    tasks: TaskCounter,
    peers: Arc<peers::Peers>,
    endpoint: u64,
}

impl std::fmt::Debug for KvReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvReceiver")
            .field("transport", &self.config.transport)
            .finish()
    }
}

impl KvReceiver {
    /// Start the endpoint for the decode pool `pool` laid out as `layout`
    /// (its pages are leased from the pool's allocator by the engine).
    pub fn start(config: ReceiverConfig, pool: Arc<ShmRegion>, layout: KvLayout) -> KvReceiver {
        let (tx, rx) = mpsc::unbounded_channel();
        let tasks = TaskCounter::default();
        let driver = Driver::new(&config, tasks.clone(), pool.clone(), layout, tx.downgrade());
        tasks.spawn(driver.run(rx));
        KvReceiver {
            tx,
            config,
            pool,
            layout,
            tasks,
            peers: Arc::default(),
            endpoint: rand::random(),
        }
    }

    async fn ask<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, TransportError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Ev::Cmd(f(tx)))
            .map_err(|_| TransportError::Shutdown)?;
        rx.await.map_err(|_| TransportError::Shutdown)
    }

    /// Whether the prefill peer `peer` (from [`Self::connect`]) still has
    /// its control connection and data link up.
    pub async fn is_connected(&self, peer: PeerId) -> Result<bool, TransportError> {
        self.ask(|r| Cmd::Connected(peer, r)).await
    }

    /// Refuse a request for `room` that never reaches [`Self::submit`] (it
    /// failed validation, or its client left before): the room is opened and
    /// aborted with `error` at once, so every source learns it. A room that
    /// exists already stays as it is.
    pub fn refuse(&self, room: RoomId, sources: Vec<Source>, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Refuse(room, sources, error)));
    }

    /// Pages for `room` are reserved (`lease`, in token order) with aux slot
    /// `aux_slot`: destinations go to every source. `prefix_tokens` (whole
    /// pages, 0 for none) are the prompt's leading tokens decode already
    /// holds: `lease` starts at the page after them and the sources send
    /// only what follows (delta transfer; refused unless every source's
    /// connection negotiated it, see [`Self::delta_capable`]). On error the
    /// lease is dropped (the pages were never advertised).
    pub(crate) async fn reserve(
        &self,
        room: RoomId,
        lease: PageLease,
        aux_slot: AuxSlot,
        prefix_tokens: u32,
    ) -> Result<(), TransportError> {
        Ok(self
            .ask(|reply| Cmd::Reserve {
                room,
                lease,
                aux_slot,
                prefix_tokens,
                reply,
            })
            .await??)
    }

    /// Whether `peer`'s control connection negotiated delta transfer
    /// (`DESTINATION_PREFIX`): a room it serves may then reserve past a
    /// cached prefix. `false` while it has no connection.
    pub async fn delta_capable(&self, peer: PeerId) -> Result<bool, TransportError> {
        let caps = self.ask(|r| Cmd::Capabilities(peer, r)).await?;
        Ok(caps.is_some_and(|c| c.contains(Capabilities::DESTINATION_PREFIX)))
    }

    /// Whether `peer`'s control connection negotiated `AUX_TOP`: its
    /// prefill sends the first position's most likely tokens for a room
    /// that asks. `false` while it has no connection.
    pub async fn aux_top_capable(&self, peer: PeerId) -> Result<bool, TransportError> {
        let caps = self.ask(|r| Cmd::Capabilities(peer, r)).await?;
        Ok(caps.is_some_and(|c| c.contains(Capabilities::AUX_TOP)))
    }

    /// Abort `room` (client gone, validation, shutdown): it fails now, every
    /// source is told, pages wait for the writers to drain.
    pub(crate) fn abort(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Abort(room, error)));
    }

    /// Counters and gauges.
    pub async fn stats(&self) -> Result<EndpointStats, TransportError> {
        let mut s = self.ask(Cmd::Stats).await?;
        s.tasks = self.tasks.live();
        Ok(s)
    }

    /// Live tasks of this endpoint (zero after shutdown completes).
    pub fn live_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// Stop: close every connection and task; leases held for live rooms are
    /// dropped (their pages return once link readers stopped).
    pub fn shutdown(&self) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Shutdown));
    }
}
