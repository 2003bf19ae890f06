//! Data links: one per (decode peer, prefill peer) pair,
//! opened by decode next to its control connection, authenticated with the
//! same handshake, then set up for one transport. Both fingerprints fix
//! the link's [`LinkPlan`](crate::plan::LinkPlan): whole spans, or head slices when the TP sizes
//! differ. Prefill confirms the setup only once its driver registered the
//! link, so decode's first destination never arrives ahead of it.
//!
//! * Prefill side: a writer task owns the [`Transport`](crate::transport::Transport) and runs the jobs
//!   the driver queues; an ack task reads decode's acknowledgements.
//! * Decode side: one reader task owns the socket and the table of rooms it
//!   may write, each holding the lease's writer guard, and it is the only
//!   writer of decode's pages on every transport: over tcp it reads payloads
//!   into them, over shm it copies them out of its read-only mapping of the
//!   prefill's pool ([`PullRef`](handoff_proto::datalink::PullRef)). Every segment is bounds-checked against
//!   that room's own pages (and a head slice against the heads the plan lets
//!   this prefill peer write) before a byte lands; when the driver forgets a
//!   room, the reader stops writing it at once (the reader itself is the
//!   writer), so a page never returns under a writer, however long the
//!   prefill stalls.
//!
//! The files: `setup.rs` opens a link on both sides, `writer.rs` runs
//! prefill's writer and ack reader, `reader.rs` is decode's reader (its
//! record handling in `reader/records.rs`), `source.rs` the prefill pool
//! decode pulls from, `socket.rs` the read helpers both sides share. The
//! rules the reader applies are pure functions in `handoff-proto`
//! (`placement::place`, `SourceShape::pull_source`, `landing::RoomLanding`).

mod counters;
mod error;
mod reader;
mod reader_api;
mod setup;
mod socket;
mod source;
mod span;
mod writer;

#[cfg(test)]
mod tests;

pub use counters::LinkCounters;
pub use error::{LinkReadError, SetupRefusal};
pub use reader::LinkReader;
pub use reader_api::{ReaderCmd, ReaderEvent};
#[cfg(all(feature = "nixl", feature = "testing"))]
pub(crate) use setup::offer_nixl as offer_nixl_for_tests;
pub use setup::{accept_link, connect_link, connect_link_stream, AcceptedLink, LinkStream};
pub use source::{PullSource, SourcePool};
pub use span::{page_span, span_offset};
pub use writer::{LinkEvent, LinkJob};
