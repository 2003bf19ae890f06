//! Errors of the KV pool.

/// What went wrong with a KV pool operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// A geometry field is zero or the pool would not fit in memory.
    #[error("invalid KV geometry: {0}")]
    InvalidGeometry(String),
    /// The pool cannot store this element type.
    #[error("a KV pool of {dtype} is not supported: the pool stores f32 or f16")]
    UnsupportedDtype {
        /// The dtype asked for.
        dtype: &'static str,
    },
    /// A lease with a writer guard out cannot give pages away.
    #[error("the lease has a writer guard out: its pages cannot move")]
    LeaseGuarded,
    /// A page asked of a lease is not in it.
    #[error("page {page} is not in this lease")]
    NotInLease {
        /// The page.
        page: u32,
    },
    /// A page index is outside the pool.
    #[error("page {page} is out of range for a pool of {num_pages} pages")]
    PageOutOfRange {
        /// The offending page.
        page: u32,
        /// Pages in the pool.
        num_pages: usize,
    },
    /// Not enough free pages.
    #[error("need {needed} free KV pages, only {free} are free")]
    OutOfPages {
        /// Pages asked for.
        needed: usize,
        /// Pages free at the time.
        free: usize,
    },
    /// A byte range is outside a region.
    #[error("byte range {start}..{end} is outside a region of {len} bytes")]
    OutOfBounds {
        /// Start of the range.
        start: usize,
        /// End of the range.
        end: usize,
        /// Region length.
        len: usize,
    },
    /// Creating, opening or mapping shared memory failed.
    #[error("shared memory: {0}")]
    Shm(String),
}
