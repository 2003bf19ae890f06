//! One request, one owner, one event stream: the handles an
//! engine holds for a room between accepting a request and the room's end.
//!
//! [`SenderRoom`] (prefill, from [`KvSender::submit`]) and [`ReceiverRoom`]
//! (decode, from [`KvReceiver::submit`]) each own their room: its events
//! arrive on the handle's own channel (no polling, no outcome that another
//! caller could take), and dropping a handle before the room's end fails or
//! aborts the room through the protocol, so the peer never waits for a
//! timeout (seed 000). No caller keeps an "armed" flag: the handle knows
//! whether the room ended.

use std::ops::Range;
use std::sync::Arc;

use handoff_kv::{PageIndex, PageLease};
use handoff_proto::datalink::AuxData;
use handoff_proto::room::RoomState;
use handoff_proto::{AbortOrigin, AuxSlot, RoomId, TransferError};
use tokio::sync::{mpsc, oneshot};

use crate::error::TransportError;
use crate::receiver::{KvReceiver, ReceiverPoll};
use crate::sender::{KvSender, SenderPoll};

/// A prefill room owned by the engine's request task: see the module docs.
#[derive(Debug)]
pub struct SenderRoom {
    sender: KvSender,
    room: RoomId,
    events: mpsc::UnboundedReceiver<SenderPoll>,
    /// The room's outcome arrived on `events` (or the endpoint is gone).
    ended: bool,
    /// We failed it ourselves: dropping needs no other failure.
    failed: bool,
}

/// Why a [`SenderRoom`] that ends early failed the room.
fn dropped_prefill() -> TransferError {
    TransferError::Aborted {
        origin: AbortOrigin::Shutdown,
        reason: "the prefill worker stopped the request".into(),
        http_status: 503,
    }
}

impl SenderRoom {
    pub(crate) fn new(
        sender: KvSender,
        room: RoomId,
        events: mpsc::UnboundedReceiver<SenderPoll>,
    ) -> Self {
        Self {
            sender,
            room,
            events,
            ended: false,
            failed: false,
        }
    }

    /// The failure of a room whose owner went away before it could own it.
    pub(crate) fn gone() -> TransferError {
        dropped_prefill()
    }

    /// The room.
    pub fn room(&self) -> RoomId {
        self.room
    }

    /// The room's next event: `Pending(WaitingForInput)` once every
    /// destination arrived (compute may start), `Unknown` if it ended first
    /// (its outcome follows), then `Success` or `Failed` (its end). Cancel
    /// safe.
    async fn next(&mut self) -> SenderPoll {
        if self.ended {
            return SenderPoll::Unknown;
        }
        let ev = self
            .events
            .recv()
            .await
            .unwrap_or(SenderPoll::Failed(TransferError::Aborted {
                origin: AbortOrigin::Shutdown,
                reason: "the prefill transfer endpoint stopped".into(),
                http_status: 503,
            }));
        if matches!(ev, SenderPoll::Success | SenderPoll::Failed(_)) {
            self.ended = true;
        }
        ev
    }

    /// Wait until every decode destination arrived (the handshake gates
    /// compute). `Err` is the room's end if it came first (decode aborted,
    /// a deadline passed, the peer died). Cancel safe.
    pub async fn ready(&mut self) -> Result<(), TransferError> {
        loop {
            match self.next().await {
                SenderPoll::Pending(RoomState::WaitingForInput) => return Ok(()),
                SenderPoll::Failed(e) => return Err(e),
                SenderPoll::Success => {
                    return Err(TransferError::Internal {
                        reason: "room succeeded before its compute".into(),
                    })
                }
                SenderPoll::Pending(_) | SenderPoll::Unknown => {}
            }
        }
    }

    /// Wait for the room's end: `Ok` once every destination has its KV and
    /// aux, else the failure as the side that saw it reported. Cancel safe.
    pub async fn outcome(&mut self) -> Result<(), TransferError> {
        loop {
            match self.next().await {
                SenderPoll::Success => return Ok(()),
                SenderPoll::Failed(e) => return Err(e),
                SenderPoll::Pending(_) | SenderPoll::Unknown if self.ended => {
                    return Err(TransferError::Internal {
                        reason: "room outcome already taken".into(),
                    })
                }
                SenderPoll::Pending(_) | SenderPoll::Unknown => {}
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
        if !self.ended && !self.failed {
            self.failed = true;
            self.sender.fail(self.room, error);
        }
    }
}

impl Drop for SenderRoom {
    fn drop(&mut self) {
        if !self.ended && !self.failed {
            self.sender.fail(self.room, dropped_prefill());
        }
    }
}

/// A decode room owned by the engine's request task: see the module docs.
#[derive(Debug)]
pub struct ReceiverRoom {
    receiver: KvReceiver,
    room: RoomId,
    outcome: Option<oneshot::Receiver<ReceiverPoll>>,
}

impl ReceiverRoom {
    pub(crate) fn new(
        receiver: KvReceiver,
        room: RoomId,
        outcome: oneshot::Receiver<ReceiverPoll>,
    ) -> Self {
        Self {
            receiver,
            room,
            outcome: Some(outcome),
        }
    }

    /// The failure of a room whose owner went away (its client left).
    pub(crate) fn gone() -> TransferError {
        TransferError::Aborted {
            origin: AbortOrigin::Client,
            reason: "the client went away".into(),
            http_status: 499,
        }
    }

    /// The room.
    pub fn room(&self) -> RoomId {
        self.room
    }

    /// The room's pages are reserved (`lease`, in token order, starting
    /// after the `prefix_tokens` decode already holds: see
    /// [`KvReceiver::reserve`]) with aux slot `aux_slot`: its destinations
    /// go to every source. Refused when the room already failed (then that
    /// failure, as the side that saw it reported it).
    pub async fn reserve(
        &mut self,
        lease: PageLease,
        aux_slot: AuxSlot,
        prefix_tokens: u32,
    ) -> Result<(), TransferError> {
        match self
            .receiver
            .reserve(self.room, lease, aux_slot, prefix_tokens)
            .await
        {
            Ok(()) => Ok(()),
            Err(e) => {
                // The room failed while waiting for pages (a deadline, a
                // dead peer): report that failure, not the refusal.
                if let Some(Ok(ReceiverPoll::Failed(f))) =
                    self.outcome.as_mut().map(oneshot::Receiver::try_recv)
                {
                    self.outcome = None;
                    return Err(f);
                }
                Err(match e {
                    TransportError::Room(e) => e,
                    other => TransferError::Internal {
                        reason: other.to_string(),
                    },
                })
            }
        }
    }

    /// Wait for the room's end: the committed pages (the prompt's KV) and
    /// the aux data, or the failure as the side that saw it reported it.
    /// Cancel safe: dropped while waiting, the room is aborted.
    pub async fn landed(&mut self) -> Result<(PageLease, AuxData), TransferError> {
        let Some(rx) = self.outcome.as_mut() else {
            return Err(TransferError::Internal {
                reason: "room outcome already taken".into(),
            });
        };
        let outcome = rx.await;
        self.outcome = None;
        match outcome {
            Ok(ReceiverPoll::Success { lease, aux }) => Ok((lease, aux)),
            Ok(ReceiverPoll::Failed(e)) => Err(e),
            Ok(other) => Err(TransferError::Internal {
                reason: format!("room ended without an outcome: {other:?}"),
            }),
            Err(_) => Err(TransferError::Aborted {
                origin: AbortOrigin::Shutdown,
                reason: "the decode transfer endpoint stopped".into(),
                http_status: 503,
            }),
        }
    }
}

impl ReceiverRoom {
    /// The prompt scores that came with the room's aux record (flat (token,
    /// log-probability) pairs; empty when none were sent). Take them after
    /// [`Self::landed`].
    pub fn take_prompt_scores(&self) -> Vec<(u32, f32)> {
        crate::receiver::lock_board(&self.receiver.prompts)
            .remove(&self.room)
            .unwrap_or_default()
    }
}

impl Drop for ReceiverRoom {
    fn drop(&mut self) {
        crate::receiver::lock_board(&self.receiver.prompts).remove(&self.room);
        // An outcome not yet taken: the room is live (or its end is still in
        // the channel, and goes with it: a lease in it returns its pages).
        if self.outcome.is_some() {
            self.receiver.abort(self.room, Self::gone());
        }
    }
}
