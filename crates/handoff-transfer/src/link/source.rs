//! The prefill pool decode maps read-only and pulls KV out of (shm links).

use std::sync::Arc;

use handoff_kv::{PageGenerations, ShmRegion, ShmRegionHandle};
use handoff_proto::placement::SourceShape;

use crate::error::TransportError;

/// A prefill's pool as decode maps it (read-only) to pull KV out of it.
#[derive(Debug)]
pub struct SourcePool {
    pub(super) region: Arc<ShmRegion>,
    /// End of its KV bytes (pulls never read past it).
    kv_end: usize,
    /// Its pages.
    pages: u32,
    pub(super) gens: PageGenerations,
}

impl SourcePool {
    /// The pool as the pull rule sees it, for a model of `layers` layers
    /// (the same on both sides: the handshake checked the model).
    pub(super) fn shape(&self, layers: u32) -> SourceShape {
        SourceShape {
            layers,
            pages: self.pages,
            kv_end: self.kv_end,
        }
    }

    /// Map the pool prefill described in its shm setup reply: read-only,
    /// and only if it is a handoff KV pool with its generations table
    /// inside the region.
    pub(super) fn open(reply: &[u8; SHM_REPLY_LEN]) -> Result<Self, TransportError> {
        let (h, rest) = reply.split_at(ShmRegionHandle::ENCODED_LEN);
        let handle = ShmRegionHandle::from_bytes(h.try_into().expect("16 bytes"));
        let (pages, gens_at) = rest.split_at(8);
        let pages = u64::from_le_bytes(pages.try_into().expect("8 bytes"));
        let gens_at = u64::from_le_bytes(gens_at.try_into().expect("8 bytes"));
        let bad = |why: String| TransportError::PeerMisbehaved(format!("shm link setup: {why}"));
        let path = format!("/proc/{}/fd/{}", handle.pid, handle.fd);
        let name = std::fs::read_link(&path)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !name.starts_with(&format!("/memfd:{}", handoff_kv::shm::POOL_MEMFD_NAME)) {
            return Err(bad(format!("{path} is {name:?}, not a handoff KV pool")));
        }
        let (Ok(pages), Ok(gens_at)) = (u32::try_from(pages), usize::try_from(gens_at)) else {
            return Err(bad(format!("{pages} pages, generations at {gens_at}")));
        };
        let region = Arc::new(
            ShmRegion::open_read_only(&handle)
                .map_err(|e| bad(format!("mapping the prefill pool: {e}")))?,
        );
        let gens = PageGenerations::new(region.clone(), gens_at, pages as usize)
            .map_err(|e| bad(format!("page generations: {e}")))?;
        Ok(Self {
            region,
            kv_end: gens_at,
            pages,
            gens,
        })
    }
}

/// Prefill's shm setup reply after the status byte: its pool's handle,
/// page count and generations offset.
pub(super) const SHM_REPLY_LEN: usize = ShmRegionHandle::ENCODED_LEN + 16;

/// Where a pulling link's bytes come from.
#[derive(Debug, Clone)]
pub enum PullSource {
    /// The prefill's pool, mapped read-only (shm).
    Mapped(Arc<SourcePool>),
    /// The prefill's pool, registered with its NIXL agent.
    #[cfg(feature = "nixl")]
    Nixl(Arc<crate::nixl::NixlSource>),
}

impl PullSource {
    /// The pool as the pull rule sees it.
    pub(super) fn shape(&self, layers: u32) -> SourceShape {
        match self {
            PullSource::Mapped(s) => s.shape(layers),
            #[cfg(feature = "nixl")]
            PullSource::Nixl(s) => s.shape(layers),
        }
    }
}
