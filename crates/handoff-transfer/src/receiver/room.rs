//! The decode room handle: one request, one owner.
//!
//! [`ReceiverRoom`] (from [`KvReceiver::submit`]) owns its room between
//! accepting a request and the room's end: it reserves the room's pages,
//! yields how the room ended on its own channel, and aborts the room
//! through the protocol if dropped before its end, so the peer never waits
//! for a timeout (seed 000).

use handoff_kv::PageLease;
use handoff_proto::datalink::AuxData;
use handoff_proto::receiver_room::Source;
use handoff_proto::{AbortOrigin, AuxSlot, RoomId, TransferError};
use tokio::sync::oneshot;

use super::commands::Cmd;
use super::config::ReceiverOutcome;
use super::KvReceiver;
use crate::error::TransportError;

impl KvReceiver {
    /// Accept a request for `room` needing KV from `sources` (as
    /// [`KvReceiver::open`]) and own it: the returned [`ReceiverRoom`] reserves
    /// its pages and yields how it ended (the pages and aux, or the failure),
    /// and aborts the room if dropped before its end. Cancel-safe: a room
    /// opened for a caller that is gone is aborted by the driver.
    pub async fn submit(
        &self,
        room: RoomId,
        sources: Vec<Source>,
    ) -> Result<ReceiverRoom, TransportError> {
        let outcome = self.ask(|r| Cmd::Submit(room, sources, r)).await??;
        Ok(ReceiverRoom::new(self.clone(), room, outcome))
    }
}

/// A decode room owned by the engine's request task: see the module docs.
#[derive(Debug)]
pub struct ReceiverRoom {
    receiver: KvReceiver,
    room: RoomId,
    outcome: Option<oneshot::Receiver<ReceiverOutcome>>,
    /// The prompt scores that came with the room's success.
    prompt: Vec<(u32, f32)>,
    /// We aborted it ourselves: dropping needs no other abort.
    aborted: bool,
}

impl ReceiverRoom {
    pub(crate) fn new(
        receiver: KvReceiver,
        room: RoomId,
        outcome: oneshot::Receiver<ReceiverOutcome>,
    ) -> Self {
        Self {
            receiver,
            room,
            outcome: Some(outcome),
            prompt: Vec::new(),
            aborted: false,
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
                if let Some(Ok(ReceiverOutcome::Failed(f))) =
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
    /// Cancel safe: the room stays as it is (dropping the room aborts it).
    pub async fn landed(&mut self) -> Result<(PageLease, AuxData), TransferError> {
        let Some(rx) = self.outcome.as_mut() else {
            return Err(TransferError::Internal {
                reason: "room outcome already taken".into(),
            });
        };
        let outcome = rx.await;
        self.outcome = None;
        match outcome {
            Ok(ReceiverOutcome::Success { lease, aux, prompt }) => {
                self.prompt = prompt;
                Ok((lease, aux))
            }
            Ok(ReceiverOutcome::Failed(e)) => Err(e),
            Err(_) => Err(TransferError::Aborted {
                origin: AbortOrigin::Shutdown,
                reason: "the decode transfer endpoint stopped".into(),
                http_status: 503,
            }),
        }
    }
}

impl ReceiverRoom {
    /// Abort the room with `error` (validation, shutdown, a client gone
    /// with a reason of its own): it fails now, every source is told, and
    /// its pages return once the writers drained. Dropping the room does
    /// the same with a "client gone" error.
    /// Its end still comes through [`Self::landed`].
    pub fn abort(&mut self, error: TransferError) {
        if self.outcome.is_some() && !self.aborted {
            self.aborted = true;
            self.receiver.abort(self.room, error);
        }
    }

    /// The prompt scores that came with the room's aux record (flat (token,
    /// log-probability) pairs; empty when none were sent). Take them after
    /// [`Self::landed`].
    pub fn take_prompt_scores(&mut self) -> Vec<(u32, f32)> {
        std::mem::take(&mut self.prompt)
    }
}

impl Drop for ReceiverRoom {
    fn drop(&mut self) {
        // An outcome not yet taken: the room is live (or its end is still in
        // the channel, and goes with it: a lease in it returns its pages).
        if self.outcome.is_some() && !self.aborted {
            self.receiver.abort(self.room, crate::error::client_gone());
        }
    }
}
