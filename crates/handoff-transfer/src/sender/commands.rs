//! What the prefill handle tells its driver task.

use std::ops::Range;
use std::sync::Arc;

use handoff_kv::PageIndex;
use handoff_proto::datalink::AuxData;
use handoff_proto::{PeerId, RoomId, TransferError};
use tokio::sync::{mpsc, oneshot};

use super::config::SenderRoomEvent;
use crate::conn::CtlEvent;
use crate::link::{AcceptedLink, LinkEvent};
use crate::stats::EndpointStats;

/// Where a room's events go: its handle's stream.
pub(super) type Reply = mpsc::UnboundedSender<SenderRoomEvent>;

pub(super) type RoomEvents = mpsc::UnboundedReceiver<SenderRoomEvent>;

pub(super) enum Cmd {
    Submit(RoomId, oneshot::Sender<Result<RoomEvents, TransferError>>),
    Fail(RoomId, TransferError),
    Refuse(RoomId, TransferError),
    Send {
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: Arc<[PageIndex]>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Finish(
        RoomId,
        AuxData,
        Arc<[(u32, f32)]>,
        oneshot::Sender<Result<(), TransferError>>,
    ),
    Stats(oneshot::Sender<EndpointStats>),
    /// The peer id of the decode endpoint a connection's preface named.
    PeerId(u64, oneshot::Sender<PeerId>),
    Shutdown,
}

pub(super) enum Ev {
    Cmd(Cmd),
    /// A control connection's event, with decode's connect number.
    Ctl(CtlEvent, u64),
    Link(LinkEvent),
    /// A data link stream, with decode's endpoint id and connect number.
    Accepted(Box<AcceptedLink>, u64, u64),
}
