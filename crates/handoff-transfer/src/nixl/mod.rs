//! KV over NIXL (feature `nixl`), the transfer library the field's PD
//! systems use (UCX underneath: TCP, shared memory, RDMA NICs).
//!
//! The link runs as over shm: prefill announces each segment as a record
//! and a [`PullRef`](handoff_proto::datalink::PullRef), and decode's link
//! reader, the only writer of its pages, fetches the bytes with a NIXL READ
//! from the prefill's registered pool into its own registered pages. Then it
//! READs the source pages' generation words and keeps the bytes only if no
//! page was handed out again after the segment's epoch (the seqlock check
//! shm does on its mapping). No process writes another's memory, so
//! "nothing lands after release" holds as it does over shm, with one
//! addition: a READ that is in flight cannot be cancelled safely (NIXL's
//! UCX backend leaves that a TODO), so the guard on its destination pages is
//! kept until the READ has ended, however long that takes ([`Transfer`]).
//!
//! * `agent.rs`: the process's one NIXL agent and UCX backend, refused at
//!   start when only the stub is loaded or the backend cannot be made.
//! * `region.rs`: registering a pool (the only `unsafe` of this crate: the
//!   descriptor trait NIXL needs).
//! * `read.rs`: one posted READ, polled to its end.
//! * `source.rs`: the prefill pool as decode READs it.

mod agent;
mod read;
mod region;
mod source;

pub use agent::{nixl, Nixl, RemoteAgent};
pub use read::Transfer;
pub use region::Registration;
pub use source::{NixlSource, PullError};
