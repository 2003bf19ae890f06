//! What the decode handle tells its driver task.

use handoff_kv::PageLease;
use handoff_proto::handshake::Capabilities;
use handoff_proto::receiver_endpoint::TpPosition;
use handoff_proto::receiver_room::Source;
use handoff_proto::{AuxSlot, PeerId, RoomId, TransferError};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::config::ReceiverOutcome;
use crate::conn::CtlEvent;
use crate::link::{PullSource, ReaderEvent};
use crate::plan::LinkPlan;
use crate::stats::EndpointStats;
use crate::transport::TransportKind;

/// A room's outcome goes here: the room handle's end of the channel. An
/// outcome whose handle is gone is dropped (its lease goes back at once).
pub(super) type Waiter = oneshot::Sender<ReceiverOutcome>;

pub(super) type Outcome = oneshot::Receiver<ReceiverOutcome>;

pub(super) enum Cmd {
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
    /// Over shm or NIXL, the prefill's pool this link pulls from.
    pub(super) source: Option<PullSource>,
}
