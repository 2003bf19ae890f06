//! The prefill room handle: one request, one owner, one event stream.
//!
//! [`SenderRoom`] (from [`KvSender::submit`]) owns its room between
//! accepting a request and the room's end: its events arrive on the
//! handle's own channel (no polling, no outcome that another caller could
//! take), and dropping it before the room's end fails the room through the
//! protocol, so the peer never waits for a timeout (seed 000). No caller
//! keeps an "armed" flag: the handle knows whether the room ended.

use std::ops::Range;
use std::sync::Arc;

use handoff_kv::PageIndex;
use handoff_proto::datalink::AuxData;
use handoff_proto::{AbortOrigin, RoomId, TransferError};
use tokio::sync::mpsc;

use super::commands::Cmd;
use super::config::SenderRoomEvent;
use super::KvSender;
use crate::error::TransportError;

impl KvSender {
    /// Accept a request for `room` and own it: the returned
    /// [`SenderRoom`] says when compute may start and how the room ended,
    /// on one event stream, and fails the room if dropped before its end.
    /// Fails like [`KvSender::open`]. Cancel-safe: a room opened for a caller
    /// that is gone is failed by the driver.
    pub async fn submit(&self, room: RoomId) -> Result<SenderRoom, TransportError> {
        let events = self.ask(|r| Cmd::Submit(room, r)).await??;
        Ok(SenderRoom::new(self.clone(), room, events))
    }
}

/// A prefill room owned by the engine's request task: see the module docs.
#[derive(Debug)]
pub struct SenderRoom {
    sender: KvSender,
    room: RoomId,
    events: mpsc::UnboundedReceiver<SenderRoomEvent>,
    /// The room's end, once it arrived on `events` (or the endpoint is
    /// gone).
    end: Option<SenderRoomEvent>,
    /// We failed it ourselves: dropping needs no other failure.
    failed: bool,
}

/// Why a [`SenderRoom`] that ends early failed the room.
impl SenderRoom {
    pub(crate) fn new(
        sender: KvSender,
        room: RoomId,
        events: mpsc::UnboundedReceiver<SenderRoomEvent>,
    ) -> Self {
        Self {
            sender,
            room,
            events,
            end: None,
            failed: false,
        }
    }

    /// The room.
    pub fn room(&self) -> RoomId {
        self.room
    }

    /// Wait for the room's next event and return it; its end is kept, so
    /// [`Self::ready`] and [`Self::outcome`] both see it. Cancel safe.
    async fn next(&mut self) -> SenderRoomEvent {
        if let Some(end) = &self.end {
            return end.clone();
        }
        let ev =
            self.events
                .recv()
                .await
                .unwrap_or(SenderRoomEvent::Failed(TransferError::Aborted {
                    origin: AbortOrigin::Shutdown,
                    reason: "the prefill transfer endpoint stopped".into(),
                    http_status: 503,
                }));
        if ev != SenderRoomEvent::Ready {
            self.end = Some(ev.clone());
        }
        ev
    }

    /// Wait until every decode destination arrived (the handshake gates
    /// compute). `Err` is the room's end if it came first (decode aborted,
    /// a deadline passed, the peer died). Cancel safe.
    pub async fn ready(&mut self) -> Result<(), TransferError> {
        match self.next().await {
            SenderRoomEvent::Ready | SenderRoomEvent::Success => Ok(()),
            SenderRoomEvent::Failed(e) => Err(e),
        }
    }

    /// Wait for the room's end: `Ok` once every destination has its KV and
    /// aux, else the failure as the side that saw it reported. Cancel safe.
    pub async fn outcome(&mut self) -> Result<(), TransferError> {
        loop {
            match self.next().await {
                SenderRoomEvent::Ready => {}
                SenderRoomEvent::Success => return Ok(()),
                SenderRoomEvent::Failed(e) => return Err(e),
            }
        }
    }

    /// Write `layers` × room pages `pages` from source pages `src` (see
    /// [`KvSender::send`]).
    pub async fn send(
        &self,
        layers: Range<usize>,
        pages: Range<usize>,
        src: Arc<[PageIndex]>,
    ) -> Result<(), TransportError> {
        self.sender.send(self.room, layers, pages, src).await
    }

    /// Every send is queued: the aux record and the room's end go out (see
    /// [`KvSender::finish`]).
    pub async fn finish(&self, aux: AuxData) -> Result<(), TransportError> {
        self.sender.finish(self.room, aux).await
    }

    /// [`Self::finish`] with the room's prompt scores (flat (token,
    /// log-probability) pairs: each scored prompt token, then its
    /// alternatives), sent ahead of the aux record.
    pub async fn finish_scored(
        &self,
        aux: AuxData,
        prompt: Arc<[(u32, f32)]>,
    ) -> Result<(), TransportError> {
        self.sender.finish_scored(self.room, aux, prompt).await
    }

    /// Fail the room (an engine error): every decode destination learns
    /// `error`. Its end still comes through [`Self::outcome`] once no write
    /// is in flight.
    pub fn fail(&mut self, error: TransferError) {
        if self.end.is_none() && !self.failed {
            self.failed = true;
            self.sender.fail(self.room, error);
        }
    }
}

impl Drop for SenderRoom {
    fn drop(&mut self) {
        if self.end.is_none() && !self.failed {
            self.sender.fail(self.room, crate::error::prefill_dropped());
        }
    }
}
