//! The prefill side: [`KvSender`], a cheap handle
//! around one driver task (TGI's queue shape: commands in, state inside one
//! task, replies on oneshots). The driver is the I/O shell of a
//! [`SenderEndpoint`](handoff_proto::sender_endpoint::SenderEndpoint), which owns the rooms, heartbeats, connect admission
//! and link assembly; the driver holds the sockets' and tasks' handles only.
//!
//! An engine calls [`KvSender::submit`] when it accepts a request and drives
//! the returned [`SenderRoom`](crate::SenderRoom): `ready` (every decode destination arrived:
//! compute may start), then `send` (a range of layers and pages, so
//! layer-by-layer streaming works), `finish` (aux record) and `outcome`.
//! [`KvSender::refuse`] fails a room it never took; its reason and status
//! reach every decode peer. Nothing else answers for a room: tests and the
//! transfer benchmark drive the same handles.
//!
//! The files: this one is the handle's API; `accept.rs` takes decode's
//! connections (the ids it gives them are the endpoint's); `driver.rs` is
//! the driver task; `segments.rs` turns a send into segments; `commands.rs`
//! what the handle tells the driver; `config.rs` the settings.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;

use handoff_kv::{KvLayout, PageIndex, ShmRegion};
use handoff_proto::datalink::AuxData;
use handoff_proto::{RoomId, TransferError};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::conn::TaskCounter;
use crate::error::TransportError;
use crate::link::LinkCounters;
use crate::stats::EndpointStats;
use accept::accept_loop;
use commands::{Cmd, Ev};
use driver::Driver;

mod accept;
mod commands;
mod config;
mod driver;
pub(crate) mod room;
mod segments;

pub use config::{SenderConfig, SenderRoomEvent};

/// Handle to a prefill transfer endpoint. Cheap to clone.
#[derive(Clone)]
pub struct KvSender {
    tx: mpsc::UnboundedSender<Ev>,
    addr: SocketAddr,
    tasks: TaskCounter,
}

impl std::fmt::Debug for KvSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSender")
            .field("addr", &self.addr)
            .finish()
    }
}

impl KvSender {
    /// Bind the listener and start the endpoint. `pool` is the prefill KV
    /// pool's shared region, laid out as `layout`.
    pub async fn start(
        config: SenderConfig,
        pool: Arc<ShmRegion>,
        layout: KvLayout,
    ) -> Result<KvSender, TransportError> {
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(TransportError::io("bind"))?;
        let addr = listener.local_addr().map_err(TransportError::io("bind"))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let tasks = TaskCounter::default();
        let counters = Arc::new(LinkCounters::default());
        let accept = tasks.spawn(accept_loop(
            listener,
            config.clone(),
            pool,
            layout,
            tx.downgrade(),
            tasks.clone(),
            counters.clone(),
        ));
        let driver = Driver::new(config, layout, counters, tasks.clone());
        tasks.spawn(driver.run(rx, accept));
        Ok(KvSender { tx, addr, tasks })
    }

    /// Where decode peers connect (the bootstrap address of this peer).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn ask<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, TransportError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Ev::Cmd(f(tx)))
            .map_err(|_| TransportError::Shutdown)?;
        rx.await.map_err(|_| TransportError::Shutdown)
    }

    /// Fail `room` here (validation rejection, engine error): every decode
    /// destination learns `error`'s reason and status.
    pub(crate) fn fail(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Fail(room, error)));
    }

    /// Refuse a request for `room` that never reaches [`Self::submit`] (it
    /// failed validation): the room is opened and failed at once, so every
    /// decode destination learns `error`. A room decode already aborted
    /// stays as it is.
    pub fn refuse(&self, room: RoomId, error: TransferError) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Refuse(room, error)));
    }

    /// Write `layers` × room pages `pages` (indices into the room's page
    /// list) from source pages `src` (the room's prefill pages, in token
    /// order). The first call marks compute done. Returns once queued.
    pub(crate) async fn send(
        &self,
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: Arc<[PageIndex]>,
    ) -> Result<(), TransportError> {
        Ok(self
            .ask(|reply| Cmd::Send {
                room,
                layers,
                pages,
                src,
                reply,
            })
            .await??)
    }

    /// Every `send` of `room` is queued: write the aux record and end the
    /// room on every link. Success is reported once decode acknowledged.
    pub(crate) async fn finish(&self, room: RoomId, aux: AuxData) -> Result<(), TransportError> {
        self.finish_scored(room, aux, Arc::from([])).await
    }

    /// [`Self::finish`] with the room's prompt scores (flat (token,
    /// log-probability) pairs), sent ahead of the aux record.
    pub(crate) async fn finish_scored(
        &self,
        room: RoomId,
        aux: AuxData,
        prompt: Arc<[(u32, f32)]>,
    ) -> Result<(), TransportError> {
        Ok(self.ask(|r| Cmd::Finish(room, aux, prompt, r)).await??)
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

    /// Stop: close every connection and task.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Ev::Cmd(Cmd::Shutdown));
    }
}
