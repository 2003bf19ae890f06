//! Why a link setup is refused, and why decode's reader stops.

use handoff_proto::datalink::{HeadSlice, RecordError};

use crate::plan::PlanError;

/// Refuse a link setup with `msg` (success is a single 0 byte, written by
/// `PendingWriter::confirm`).
/// Why prefill refuses a decode peer's data link setup. Its text goes back
/// to decode in the refusal, and the accepting side reports it typed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupRefusal {
    /// No link plan fits the two ends' TP settings and our pool.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The shared region could not be mapped.
    #[error("shared memory: {0}")]
    Shm(#[from] handoff_kv::KvError),
    /// The TCP stream setup record is malformed.
    #[error("tcp stream setup: {0}")]
    Stream(#[from] RecordError),
    /// Decode offered its own pool for prefill to write into (the shm setup
    /// before decode pulled), which prefill no longer does.
    #[error("decode offered an shm link that prefill writes into (before protocol 2 pulls); upgrade the decode worker or use --disaggregation-transfer-backend tcp")]
    ShmPush,
    /// The decode pool's page count is zero or past `u32`.
    #[error("pool of {0} pages")]
    Pages(u64),
    /// A transport byte we do not know.
    #[error("unknown transport {0}")]
    UnknownTransport(u8),
    /// Decode asked for NIXL and this prefill cannot offer it (a build
    /// without the feature, the library or backend missing).
    #[error("this prefill cannot serve a NIXL link: {0}")]
    Nixl(String),
}

impl SetupRefusal {
    /// True when the peer sent something wrong (not our own settings).
    pub fn blames_peer(&self) -> bool {
        !matches!(
            self,
            SetupRefusal::Plan(_) | SetupRefusal::Shm(_) | SetupRefusal::Nixl(_)
        )
    }
}

/// Why the decode side's reader of a data link stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkReadError {
    /// The prefill side closed the link.
    #[error("peer closed the link")]
    Closed,
    /// Reading, writing acks or writing into the pool failed.
    #[error("{what}: {source}")]
    Io {
        /// What the reader was doing.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A record header did not decode.
    #[error("malformed record: {0}")]
    Record(#[from] RecordError),
    /// A NIXL READ could not be posted or failed.
    #[error("{0}")]
    Nixl(String),
    /// A segment's payload cannot fit our pool.
    #[error("segment of {n_pages} pages, heads {heads:?}, is larger than the pool")]
    SegmentTooLarge {
        /// Pages the header claims.
        n_pages: u32,
        /// Its head slice, if any.
        heads: Option<HeadSlice>,
    },
    /// Writing a staged payload into the shared pool failed.
    #[error("pool write: {0}")]
    Pool(#[from] handoff_kv::KvError),
}

impl LinkReadError {
    pub(super) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> LinkReadError {
        move |source| LinkReadError::Io { what, source }
    }
}
