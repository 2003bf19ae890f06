//! handoff-transfer: the I/O shell around handoff-proto.
//!
//! * [`conn`] — control connections: one task owns the sans-IO
//!   `Connection`, one writer task owns the socket's write half.
//! * [`link`] — data links: handshake, transport setup, and decode's
//!   bounds-checking link reader (the record format is
//!   [`handoff_proto::datalink`]).
//! * [`transport`] — the [`Transport`] trait, [`ShmTransport`], [`TcpTransport`].
//! * [`sender`] — [`KvSender`], the prefill endpoint.
//! * [`receiver`] — [`KvReceiver`], the decode endpoint.
//! * [`SenderRoom`] (`sender/room.rs`), [`ReceiverRoom`] (`receiver/room.rs`):
//!   one request's room, owned by its request task, with its events on one
//!   channel.
//! * [`segment`] — [`segment::Segment`], a run of KV bytes and where it goes.
//! * `testing` (feature `testing`, tests only) — fixtures for tests.
//!
//! The protocol (rooms, deadlines, handshake, codec) lives in handoff-proto;
//! this crate owns sockets, tasks and the clock, and does nothing clever.
//!
//! # What an engine does
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use handoff_kv::{KvDtype, KvGeometry, KvPool, PageIndex};
//! use handoff_proto::receiver_room::Source;
//! use handoff_proto::{AuxSlot, RoomId};
//! use handoff_transfer::testing::{receiver_config, sender_config};
//! use handoff_transfer::*;
//!
//! let g = handoff_transfer::testing::geometry();
//! // Both pools in shared memory; the transport reads/writes their pages.
//! let (prefill_pool, _) = KvPool::new_shared(g, 64)?;
//! let (decode_pool, _) = KvPool::new_shared(g, 64)?;
//! let prefill = KvSender::start(
//!     sender_config(),
//!     prefill_pool.shared_region().unwrap().clone(),
//!     *prefill_pool.layout(),
//! )
//! .await?;
//! let decode = KvReceiver::start(
//!     receiver_config(TransportKind::Tcp),
//!     decode_pool.shared_region().unwrap().clone(),
//!     *decode_pool.layout(),
//! );
//! // Decode connects to each prefill (address from bootstrap) once, and
//! // again after the connection died.
//! let peer = decode.peer(prefill.local_addr(), TransportKind::Tcp).await?;
//!
//! // Each side owns its room through a handle; dropping it aborts the room.
//! let room = RoomId::new(7).unwrap();
//! let mut p = prefill.submit(room).await?; // prefill accepted the request
//! let mut d = decode.submit(room, vec![Source { peer, required_destinations: 1 }]).await?;
//! let lease = decode_pool.allocator().lease(2)?; // backpressure lives here
//! d.reserve(lease, AuxSlot(0), 0).await?;
//! // Prefill computes once the destination arrived ...
//! p.ready().await?;
//! // ... and streams KV layer by layer, then the aux record.
//! let src: Arc<[PageIndex]> = vec![PageIndex(10), PageIndex(11)].into();
//! for layer in 0..g.layers {
//!     p.send(layer..layer + 1, 0..2, src.clone()).await?;
//! }
//! p.finish(AuxData { first_token: 42, logprob: -0.1, top: handoff_proto::datalink::TopLogprobs::NONE }).await?;
//! p.outcome().await?;
//! let (lease, aux) = d.landed().await?;
//! assert_eq!((lease.len(), aux.first_token), (2, 42)); // decode owns the pages now
//! # drop(lease);
//! # prefill.shutdown();
//! # decode.shutdown();
//! # Ok(())
//! # }
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
//! ```
// No `unsafe` here, except (with the `nixl` feature) the one descriptor
// impl NIXL's registration needs (`nixl/region.rs`).
#![cfg_attr(not(feature = "nixl"), forbid(unsafe_code))]
#![cfg_attr(feature = "nixl", deny(unsafe_code))]
#![warn(missing_docs)]

pub mod conn;
pub mod error;
pub mod link;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod plan;
pub mod receiver;
pub mod segment;
pub mod sender;
mod stats;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
mod wakeup;

pub use error::TransportError;
pub use handoff_proto::datalink::AuxData;
pub use receiver::room::ReceiverRoom;
pub use receiver::{KvReceiver, ReceiverConfig, ReceiverOutcome, MAX_PEER_ADDRESSES};
pub use sender::room::SenderRoom;
pub use sender::{KvSender, SenderConfig, SenderRoomEvent};
pub use stats::EndpointStats;
pub use transport::{ShmTransport, TcpTransport, Transport, TransportKind};

/// Make sure this build and process can move KV over `kind` (for a worker
/// that names it at start): for NIXL, the `nixl` feature, the real library
/// on the loader path and its UCX backend, else the error says which is
/// missing. Shm and tcp always can.
pub fn check_transport(kind: TransportKind) -> Result<(), TransportError> {
    match kind {
        TransportKind::Shm | TransportKind::Tcp => Ok(()),
        #[cfg(feature = "nixl")]
        TransportKind::Nixl => nixl::nixl().map(|_| ()),
        #[cfg(not(feature = "nixl"))]
        TransportKind::Nixl => Err(TransportError::Nixl(NO_NIXL.into())),
    }
}

/// What a build without the `nixl` feature says when asked for NIXL.
#[cfg(not(feature = "nixl"))]
pub(crate) const NO_NIXL: &str =
    "this handoff was built without NIXL; rebuild with `--features nixl` \
     (needs libclang to build, and scripts/fetch-nixl.sh's libraries to run)";
