//! The prefill pool as decode READs it over NIXL: its agent, where its pool
//! and page generations are, and our own pool's registration.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_kv::ShmRegion;
use handoff_proto::datalink::NixlSetupHead;
use handoff_proto::placement::SourceShape;

use super::agent::{nixl, RemoteAgent};
use super::read::Transfer;
use super::region::Registration;
use crate::error::TransportError;

/// A prefill's pool, registered with its agent, that this link READs from.
#[derive(Debug)]
pub struct NixlSource {
    remote: RemoteAgent,
    /// Where the prefill's region is in its process.
    base: usize,
    /// End of its KV bytes (its generation table starts there).
    kv_end: usize,
    pages: u32,
    /// Our pool, registered.
    local: Arc<Registration>,
    /// Where the source pages' generation words land to be checked
    /// (grown when a batch needs more).
    scratch: Mutex<Option<Arc<Registration>>>,
}

/// Why a batch's bytes cannot be kept.
#[derive(Debug)]
pub enum PullError {
    /// Its READ did not end in time: it is still in flight, and the pages
    /// it writes must stay held until [`Transfer::poll`] says it ended.
    Stalled(Transfer),
    /// A READ could not be posted or failed (nothing is in flight): the
    /// link cannot move KV, and this says why.
    Failed(TransportError),
}

impl NixlSource {
    /// Load the prefill's agent from its setup answer and register our
    /// pool `local`.
    pub fn open(
        head: &NixlSetupHead,
        name: &str,
        metadata: &[u8],
        local: &Arc<ShmRegion>,
    ) -> Result<Self, TransportError> {
        let bad = |what: &str| {
            TransportError::PeerMisbehaved(format!("nixl link setup: {what} does not fit here"))
        };
        let n = nixl()?;
        // A prefill in this very process shares our agent: then its pool
        // must be one this agent registered, and not ours (a peer naming
        // our agent cannot make us copy our own memory around).
        if name == n.name()
            && (!n.has_registered(head.base as usize, head.len as usize)
                || head.base as usize == local.addr())
        {
            return Err(TransportError::PeerMisbehaved(
                "nixl link setup: a pool under this process's own agent name that it did not register as a prefill's".into(),
            ));
        }
        let remote = n.load_remote(name, metadata)?;
        Ok(Self {
            base: usize::try_from(head.base).map_err(|_| bad("the region's address"))?,
            kv_end: usize::try_from(head.generations_at)
                .map_err(|_| bad("the generation table's offset"))?,
            pages: u32::try_from(head.pages).map_err(|_| bad("the page count"))?,
            local: n.register(local)?,
            remote,
            scratch: Mutex::new(None),
        })
    }

    /// The pool as the pull rule sees it, for a model of `layers` layers.
    pub fn shape(&self, layers: u32) -> SourceShape {
        SourceShape {
            layers,
            pages: self.pages,
            kv_end: self.kv_end,
        }
    }

    /// The peer agent's name.
    pub fn agent(&self) -> &str {
        self.remote.name()
    }

    /// READ `pieces`, each `(offset in our pool, offset in the prefill's,
    /// length)`, checked by the pull rule. A READ that fails is an error
    /// (the peer is gone, or NIXL cannot move these bytes); one still in
    /// flight after `stall` is handed back, to be held until it ends. The
    /// bytes may be kept only once [`Self::unchanged`] says so for their
    /// pages.
    pub fn read(
        &self,
        pieces: impl ExactSizeIterator<Item = (usize, usize, usize)>,
        stall: Duration,
    ) -> Result<(), PullError> {
        if pieces.len() == 0 {
            return Ok(());
        }
        let base = self.local.region().addr();
        let data = pieces.map(|(dst, src, len)| (base + dst, self.base + src, len));
        let read = Transfer::read(&self.remote, data, vec![self.local.clone()]);
        Self::finish(read, stall)
    }

    /// After the READs of `checks`' bytes ended: whether no source page of
    /// any of them was handed out again after its epoch (one READ of their
    /// stamps; seqlock order: a page handed out again during a READ, or at
    /// any time before this one, shows a newer stamp, so checking later
    /// only rejects more). A stamps READ that stalls rejects; its buffer is
    /// then left to it and a new one made. An error: the READ failed.
    pub fn unchanged(
        &self,
        checks: &[(Range<u32>, u64)],
        stall: Duration,
    ) -> Result<bool, TransportError> {
        let runs = merged(checks.iter().map(|c| c.0.clone()));
        if runs.is_empty() {
            return Ok(true);
        }
        let words: usize = runs.iter().map(|r| r.len()).sum();
        let scratch = self.scratch(words * 8)?;
        let mut at = 0usize;
        let mut pieces = Vec::with_capacity(runs.len());
        for r in &runs {
            let remote = self.base + self.kv_end + 8 * (1 + r.start as usize);
            pieces.push((scratch.region().addr() + at, remote, 8 * r.len()));
            at += 8 * r.len();
        }
        let read = Transfer::read(&self.remote, pieces, vec![scratch.clone()]);
        match Self::finish(read, stall) {
            Ok(()) => {}
            Err(PullError::Stalled(t)) => {
                // It may still write the buffer: never read it again.
                *self.scratch.lock().expect("nixl scratch") = None;
                drop(t);
                return Ok(false);
            }
            Err(PullError::Failed(e)) => return Err(e),
        }
        let mut raw = vec![0u8; at];
        scratch.region().read_at(0, &mut raw)?;
        // Each run's stamps, in order, then a page's by binary search.
        let mut offsets = Vec::with_capacity(runs.len());
        let mut off = 0usize;
        for r in &runs {
            offsets.push(off);
            off += 8 * r.len();
        }
        let stamp = |page: u32| -> u64 {
            let i = runs.partition_point(|r| r.end <= page);
            match runs.get(i) {
                Some(r) if r.contains(&page) => {
                    let at = offsets[i] + 8 * (page - r.start) as usize;
                    u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes"))
                }
                _ => u64::MAX,
            }
        };
        Ok(checks
            .iter()
            .all(|(pages, epoch)| pages.clone().all(|pg| stamp(pg) <= *epoch)))
    }

    /// Wait for a READ to end with every byte in.
    fn finish(read: Result<Transfer, TransportError>, stall: Duration) -> Result<(), PullError> {
        let mut t = read.map_err(PullError::Failed)?;
        match t.wait(stall) {
            Ok(true) => Ok(()),
            Ok(false) => Err(PullError::Stalled(t)),
            Err(e) => Err(PullError::Failed(e)),
        }
    }

    /// A registered buffer of at least `bytes`.
    fn scratch(&self, bytes: usize) -> Result<Arc<Registration>, TransportError> {
        let mut s = self.scratch.lock().expect("nixl scratch");
        match &*s {
            Some(r) if r.region().len() >= bytes => Ok(r.clone()),
            _ => {
                let region = ShmRegion::create("handoff-nixl-stamps", bytes.max(4096))?;
                let r = nixl()?.register(&Arc::new(region))?;
                *s = Some(r.clone());
                Ok(r)
            }
        }
    }
}

/// `ranges` sorted and merged where they touch or overlap.
fn merged(ranges: impl Iterator<Item = Range<u32>>) -> Vec<Range<u32>> {
    let mut v: Vec<Range<u32>> = ranges.filter(|r| !r.is_empty()).collect();
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u32>> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that names this process's own agent (which needs no
    /// metadata) is believed only for a pool the agent registered that is
    /// not the decode pool itself: it cannot make decode copy its own
    /// memory into a room.
    #[test]
    fn a_peer_naming_our_own_agent_gets_only_a_pool_we_registered_for_it() {
        let n = nixl().expect("NIXL usable in this test process");
        let ours = Arc::new(ShmRegion::create("nixl-test-decode", 1 << 16).unwrap());
        let theirs = Arc::new(ShmRegion::create("nixl-test-prefill", 1 << 16).unwrap());
        let head = |r: &ShmRegion| NixlSetupHead {
            base: r.addr() as u64,
            len: r.len() as u64,
            pages: 4,
            generations_at: 4096,
            metadata_len: 1,
            name_len: n.name().len() as u16,
        };
        let open = |r: &ShmRegion| NixlSource::open(&head(r), n.name(), b"x", &ours);
        let e = open(&theirs).unwrap_err();
        assert!(e.to_string().contains("own agent name"), "{e}");
        // Registered as a prefill's pool (as an in-process prefill does).
        let _reg = n.register(&theirs).unwrap();
        let src = open(&theirs).expect("a pool this agent registered");
        assert_eq!(src.agent(), n.name());
        // Our own pool is registered now (the source READs into it), and
        // still refused as a source.
        let e = open(&ours).unwrap_err();
        assert!(e.to_string().contains("own agent name"), "{e}");
    }

    #[test]
    fn page_runs_merge_where_they_touch_or_overlap() {
        let runs = merged([5..7, 0..2, 2..3, 6..9, 20..21, 4..4].into_iter());
        assert_eq!(runs, vec![0..3, 5..9, 20..21]);
    }
}
