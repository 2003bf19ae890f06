//! One posted NIXL READ, polled to its end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_sys::{MemType, XferDescList, XferOp, XferRequest, XferStatus};

use super::agent::{Nixl, RemoteAgent};
use super::region::Registration;
use crate::error::TransportError;

/// A READ from a peer's registered memory into ours. Holds what it writes
/// into (the registrations, so their regions stay mapped and registered)
/// until it has ended. Dropped while still in flight it is leaked, with
/// them: NIXL cannot take back a posted READ safely, and memory it may
/// still write must never be handed to anyone else.
pub struct Transfer {
    req: Option<XferRequest>,
    nixl: Arc<Nixl>,
    done: bool,
    keep: Vec<Arc<Registration>>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("done", &self.done)
            .finish()
    }
}

impl Transfer {
    /// Post a READ of `pieces`, each `(local address, remote address,
    /// length)`: local ones inside `keep`'s regions, remote ones inside
    /// what `remote` registered (NIXL refuses descriptors outside them).
    pub fn read(
        remote: &RemoteAgent,
        pieces: impl IntoIterator<Item = (usize, usize, usize)>,
        keep: Vec<Arc<Registration>>,
    ) -> Result<Transfer, TransportError> {
        let nixl = remote.nixl().clone();
        let err = |what: &str, e: nixl_sys::NixlError| {
            TransportError::Nixl(format!("{what} a READ from {}: {e}", remote.name()))
        };
        let mut local = XferDescList::new(MemType::Dram).map_err(|e| err("describing", e))?;
        let mut far = XferDescList::new(MemType::Dram).map_err(|e| err("describing", e))?;
        for (l, r, len) in pieces {
            local.add_desc(l, len, 0);
            far.add_desc(r, len, 0);
        }
        let req = nixl
            .agent()
            .create_xfer_req(XferOp::Read, &local, &far, remote.name(), None)
            .map_err(|e| err("creating", e))?;
        let mut t = Transfer {
            req: Some(req),
            nixl,
            done: false,
            keep,
        };
        let posted = t
            .nixl
            .agent()
            .post_xfer_req(t.req.as_ref().expect("just made"), None);
        match posted {
            Ok(in_flight) => t.done = !in_flight,
            // Never posted: nothing is in flight.
            Err(e) => {
                t.done = true;
                return Err(err("posting", e));
            }
        }
        Ok(t)
    }

    /// Whether the READ has ended: `Ok(true)` with every byte in place,
    /// `Ok(false)` still in flight, an error when it failed (it has ended
    /// then too: nothing more lands).
    pub fn poll(&mut self) -> Result<bool, TransportError> {
        if self.done {
            return Ok(true);
        }
        let req = self
            .req
            .as_ref()
            .expect("a transfer not done has its request");
        match self.nixl.agent().get_xfer_status(req) {
            Ok(XferStatus::Success) => {
                self.done = true;
                Ok(true)
            }
            Ok(XferStatus::InProgress) => Ok(false),
            Err(e) => {
                self.done = true;
                Err(TransportError::Nixl(format!("READ failed: {e}")))
            }
        }
    }

    /// Poll until the READ ends or `within` passes (`Ok(false)`: still in
    /// flight). Spins briefly, then sleeps between polls, longer each time
    /// up to 100 us: the agent's progress thread moves the bytes, and a
    /// waiting reader must not take the CPU a prefill computes on.
    pub fn wait(&mut self, within: Duration) -> Result<bool, TransportError> {
        let t0 = Instant::now();
        let mut spins = 0u32;
        let mut pause = Duration::from_micros(5);
        loop {
            if self.poll()? {
                return Ok(true);
            }
            if t0.elapsed() >= within {
                return Ok(false);
            }
            spins += 1;
            if spins < 32 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(100));
            }
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if !self.done && !matches!(self.poll(), Ok(true) | Err(_)) {
            tracing::warn!("a NIXL READ dropped in flight: its request and memory are kept");
            std::mem::forget(self.req.take());
            std::mem::forget(std::mem::take(&mut self.keep));
        }
    }
}
