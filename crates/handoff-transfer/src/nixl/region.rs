//! Registering memory with the agent. The descriptor trait NIXL reads a
//! region's address through is an `unsafe fn`; implementing it is the one
//! place this crate allows `unsafe` (nothing here dereferences anything).
#![allow(unsafe_code)]

use std::sync::Arc;

use handoff_kv::ShmRegion;
use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};

/// A span of this process's memory, by address, as NIXL describes it.
#[derive(Debug)]
pub(super) struct Span {
    pub(super) addr: usize,
    pub(super) len: usize,
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// A region registered with the agent; deregistered when the last holder
/// drops it, and the region stays mapped until then.
#[derive(Debug)]
pub struct Registration {
    // Field order is drop order: deregister, then let the mapping go.
    pub(super) _handle: RegistrationHandle,
    pub(super) region: Arc<ShmRegion>,
}

impl Registration {
    /// The registered region.
    pub fn region(&self) -> &Arc<ShmRegion> {
        &self.region
    }
}
