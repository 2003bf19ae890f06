//! The `Transport` trait and its two implementations, seen
//! from the writing (prefill) side of one data link:
//!
//! * [`ShmTransport`] — decode maps our pool read-only; each segment goes
//!   out as its record header and a [`PullRef`] (where its bytes are in our
//!   pool), and decode's link reader copies them into its own pages (a
//!   one-sided read, like an RDMA read). No process writes another's memory.
//! * [`TcpTransport`] — segments are streamed as a record header followed by
//!   the payload, several coalesced segments per vectored write; decode's
//!   link reader places them into its pool.
//!
//! Both carry the aux record and the end-of-room marker on the link socket,
//! so the decode side acknowledges a room only once all of its bytes are in
//! memory. Later transports (RDMA, CUDA IPC) implement the same trait.

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::os::fd::AsFd;

use handoff_kv::{PageGenerations, ShmRegion, WritePart};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;

use crate::error::TransportError;
pub use crate::segment::Segment;
use handoff_proto::datalink::{PullRef, Record, RECORD_LEN};

/// Which transport a data link uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Shared memory (same host).
    Shm,
    /// TCP payload streaming (any host).
    Tcp,
    /// NIXL (UCX underneath): decode READs each segment out of the
    /// prefill's registered pool, as over shm. Needs a build with the
    /// `nixl` feature and NIXL's libraries on the loader path.
    Nixl,
}

impl TransportKind {
    /// The kinds every build has, for conformance loops (NIXL is a
    /// feature: see [`Self::available`]).
    pub const ALL: [TransportKind; 2] = [TransportKind::Shm, TransportKind::Tcp];

    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Nixl => "nixl",
        }
    }

    /// Whether segments of this kind are pulled by decode (a [`PullRef`]
    /// follows each header) rather than streamed by prefill.
    pub const fn pulls(self) -> bool {
        matches!(self, TransportKind::Shm | TransportKind::Nixl)
    }

    /// Whether this build can move KV over this kind: shm and tcp always,
    /// NIXL only with the `nixl` feature.
    pub const fn available(self) -> bool {
        match self {
            TransportKind::Shm | TransportKind::Tcp => true,
            TransportKind::Nixl => cfg!(feature = "nixl"),
        }
    }
}

/// The writing side of one data link.
pub trait Transport: Send + 'static {
    /// Which kind this is.
    fn kind(&self) -> TransportKind;

    /// Write `segs`, then the `trailer` records (a room's aux and end) on
    /// the link. Stops early, without error, once `cancel` is set: `Ok(true)`
    /// when everything was written, `Ok(false)` when cancelled (the trailer
    /// was then not written).
    fn write_segments<'a>(
        &'a mut self,
        segs: &'a [Segment],
        trailer: &'a [Record],
        cancel: &'a AtomicBool,
    ) -> impl Future<Output = Result<bool, TransportError>> + Send + 'a;

    /// Write aux or end records on the link, in one write.
    fn write_records<'a>(
        &'a mut self,
        recs: &'a [Record],
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a;
}

/// `recs` encoded back to back.
fn encode_records(recs: &[Record]) -> Vec<u8> {
    recs.iter().flat_map(|r| r.encode()).collect()
}

/// Segments announced per write (a cancellation check between writes).
const SHM_BATCH_SEGS: usize = 1024;

/// Shared-memory transport: tells decode where each segment's bytes are in
/// our pool; decode pulls them.
#[derive(Debug)]
pub struct ShmTransport {
    gens: PageGenerations,
    link: OwnedWriteHalf,
    /// Shm, or NIXL (the same records; decode READs instead of copying).
    kind: TransportKind,
}

impl ShmTransport {
    /// A transport announcing pulls from the pool whose page generations
    /// are `gens`, with `link` carrying records.
    pub fn new(gens: PageGenerations, link: OwnedWriteHalf) -> Self {
        Self {
            gens,
            link,
            kind: TransportKind::Shm,
        }
    }

    /// The same announcements for a decode that READs them over NIXL
    /// out of our registered pool.
    pub fn nixl(gens: PageGenerations, link: OwnedWriteHalf) -> Self {
        Self {
            kind: TransportKind::Nixl,
            ..Self::new(gens, link)
        }
    }
}

/// `seg`'s record and pull reference, as the shm link carries them.
fn pull_record(seg: &Segment, epoch: u64) -> impl Iterator<Item = u8> {
    let pull = PullRef {
        src_offset: seg.src.start as u64,
        src_page: seg.src_pages.start,
        src_pages: seg.src_pages.len() as u32,
        epoch,
    };
    Record::Segment(seg.header)
        .encode()
        .into_iter()
        .chain(pull.encode())
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    async fn write_segments<'a>(
        &'a mut self,
        segs: &'a [Segment],
        trailer: &'a [Record],
        cancel: &'a AtomicBool,
    ) -> Result<bool, TransportError> {
        // Every source page was stamped when it was leased, before it was
        // computed: none is past the epoch read now, and one handed out
        // again later (it should not be, while the room lives) is.
        let epoch = self.gens.epoch();
        let mut chunks = segs.chunks(SHM_BATCH_SEGS).peekable();
        loop {
            if cancel.load(Ordering::Acquire) {
                return Ok(false);
            }
            let chunk = chunks.next().unwrap_or_default();
            let last = chunks.peek().is_none();
            let mut out: Vec<u8> = chunk.iter().flat_map(|s| pull_record(s, epoch)).collect();
            if last {
                out.extend(encode_records(trailer));
            }
            if !out.is_empty() {
                self.link
                    .write_all(&out)
                    .await
                    .map_err(TransportError::io("shm link record"))?;
            }
            if last {
                return Ok(true);
            }
        }
    }

    async fn write_records<'a>(&'a mut self, recs: &'a [Record]) -> Result<(), TransportError> {
        if recs.is_empty() {
            return Ok(());
        }
        self.link
            .write_all(&encode_records(recs))
            .await
            .map_err(TransportError::io("shm link record"))
    }
}

/// Most bytes gathered into one vectored write.
const TCP_BATCH_BYTES: usize = 8 << 20;
/// Most segments gathered into one vectored write (two iovecs each).
const TCP_BATCH_SEGS: usize = 256;

/// TCP transport: header + payload records, vectored writes.
#[derive(Debug)]
pub struct TcpTransport {
    src: Arc<ShmRegion>,
    link: OwnedWriteHalf,
}

impl TcpTransport {
    /// A transport streaming from `src` on `link`.
    pub fn new(src: Arc<ShmRegion>, link: OwnedWriteHalf) -> Self {
        Self { src, link }
    }

    /// One vectored write of `segs` (header + payload each) followed by
    /// the already encoded `tail` records.
    async fn write_batch(&mut self, segs: &[Segment], tail: &[u8]) -> Result<(), TransportError> {
        let headers: Vec<[u8; RECORD_LEN]> = segs
            .iter()
            .map(|s| Record::Segment(s.header).encode())
            .collect();
        let ranges: Vec<Range<usize>> = segs.iter().map(|s| s.src.clone()).collect();
        let total: usize =
            segs.iter().map(|s| RECORD_LEN + s.src.len()).sum::<usize>() + tail.len();
        let mut done = 0usize;
        while done < total {
            self.link
                .writable()
                .await
                .map_err(TransportError::io("tcp link writable"))?;
            let parts: Vec<WritePart<'_>> = headers
                .iter()
                .zip(&ranges)
                .flat_map(|(h, r)| [WritePart::Bytes(&h[..]), WritePart::Region(r.clone())])
                .chain(std::iter::once(WritePart::Bytes(tail)))
                .collect();
            let stream: &tokio::net::TcpStream = self.link.as_ref();
            let mut bounds = None;
            // `try_io` clears the socket's readiness on WouldBlock, so the
            // next `writable()` waits for room again.
            let res = stream.try_io(tokio::io::Interest::WRITABLE, || {
                match self.src.writev_to(&parts, done, stream.as_fd()) {
                    Ok(r) => r,
                    Err(e) => {
                        bounds = Some(e);
                        Ok(0)
                    }
                }
            });
            if let Some(e) = bounds {
                return Err(e.into());
            }
            match res {
                Ok(0) => {
                    return Err(TransportError::Io {
                        what: "tcp link write",
                        source: std::io::ErrorKind::WriteZero.into(),
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(TransportError::io("tcp link write")(e)),
            }
        }
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    async fn write_segments<'a>(
        &'a mut self,
        segs: &'a [Segment],
        trailer: &'a [Record],
        cancel: &'a AtomicBool,
    ) -> Result<bool, TransportError> {
        // The trailer rides in the last batch's vectored write: a small
        // room is one write() and, on loopback, one wake-up of the reader.
        let tail = encode_records(trailer);
        let mut start = 0;
        loop {
            if cancel.load(Ordering::Acquire) {
                return Ok(false);
            }
            let mut end = start;
            let mut bytes = 0;
            while end < segs.len() && end - start < TCP_BATCH_SEGS && bytes < TCP_BATCH_BYTES {
                bytes += segs[end].src.len();
                end += 1;
            }
            let last = end == segs.len();
            self.write_batch(&segs[start..end], if last { &tail } else { &[] })
                .await?;
            if last {
                return Ok(true);
            }
            start = end;
        }
    }

    async fn write_records<'a>(&'a mut self, recs: &'a [Record]) -> Result<(), TransportError> {
        if recs.is_empty() {
            return Ok(());
        }
        self.link
            .write_all(&encode_records(recs))
            .await
            .map_err(TransportError::io("tcp link record"))
    }
}
