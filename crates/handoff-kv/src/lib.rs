//! KV geometry and memory: the paged KV pool that
//! the model reads and writes and the transfer layer moves, the byte layout of
//! (layer, page, K|V) blocks, and single-owner page leases.
// Only `shm` (the mapping of shared memory) may use `unsafe`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod layout;
pub mod lease;
pub mod pool;
pub mod prefix;
pub mod shm;

pub use error::KvError;
pub use layout::{KvDtype, KvGeometry, KvLayout, KvPart, PageIndex, PageLayout};
pub use lease::{PageAllocator, PageLease, PageStats};
pub use pool::{KvBlock, KvPool};
pub use prefix::{PrefixCache, PrefixLock, PrefixStats};
pub use shm::{PageGenerations, ShmRegion, ShmRegionHandle, WritePart};
