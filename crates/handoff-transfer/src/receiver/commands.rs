//! What the decode handle tells its driver task.

use std::sync::Arc;

use handoff_kv::PageLease;
use handoff_proto::handshake::Capabilities;
use handoff_proto::receiver_endpoint::TpPosition;
use handoff_proto::receiver_room::Source;
use handoff_proto::{AuxSlot, PeerId, RoomId, TransferError};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::config::ReceiverPoll;
use crate::conn::CtlEvent;
use crate::link::{ReaderEvent, SourcePool};
use crate::plan::LinkPlan;
use crate::stats::EndpointStats;
use crate::transport::TransportKind;

/// A room's outcome goes here. `keep` says whether an outcome whose
/// receiver is gone is kept for [`KvReceiver::poll`] (a `wait` caller may
/// poll later) or dropped (a [`ReceiverRoom`] owner is gone for good: its
/// lease goes back at once).
pub(super) struct Waiter {
    pub(super) tx: oneshot::Sender<ReceiverPoll>,
    pub(super) keep: bool,
}

pub(super) type Outcome = oneshot::Receiver<ReceiverPoll>;

pub(super) enum Cmd {
    Open(
        RoomId,
        Vec<Source>,
        oneshot::Sender<Result<(), TransferError>>,
    ),
    Submit(
        RoomId,
        Vec<Source>,
        oneshot::Sender<Result<Outcome, TransferError>>,
    ),
    Refuse(RoomId, Vec<Source>, TransferError),
    Reserve {
        room: RoomId,
        lease: PageLease,
        aux_slot: AuxSlot,
        prefix_tokens: u32,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Abort(RoomId, TransferError),
    Poll(RoomId, oneshot::Sender<ReceiverPoll>),
    Wait(RoomId, oneshot::Sender<ReceiverPoll>),
    AddLink(PeerId, NewLink),
    Connected(PeerId, oneshot::Sender<bool>),
    Capabilities(PeerId, oneshot::Sender<Option<Capabilities>>),
    /// Answer once `peer`'s control connection is up.
    AwaitControl(PeerId, oneshot::Sender<()>),
    Abandon(PeerId),
    Stats(oneshot::Sender<EndpointStats>),
    Shutdown,
}

pub(super) enum Ev {
    Cmd(Cmd),
    Ctl(CtlEvent),
    Reader(PeerId, u64, ReaderEvent),
}

/// A data link whose streams connected, for the driver to start.
pub(super) struct NewLink {
    pub(super) kind: TransportKind,
    pub(super) sockets: Vec<TcpStream>,
    pub(super) plan: LinkPlan,
    pub(super) tp: TpPosition,
    /// Over shm, the prefill's pool this link pulls from.
    pub(super) source: Option<Arc<SourcePool>>,
}
