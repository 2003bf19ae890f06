//! Decode's side of a link: the one reader task that owns the socket and
//! the rooms it may write, and is the only writer of their pages. Its
//! record handling is in `reader/records.rs`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use handoff_kv::lease::WriterGuard;
use handoff_kv::{KvLayout, ShmRegion};
use handoff_proto::datalink::RECORD_LEN;
use handoff_proto::landing::RoomLanding;
use handoff_proto::RoomId;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::counters::LinkCounters;
use super::error::LinkReadError;
use super::reader_api::{ReaderCmd, ReaderEvent};
use super::socket::{read_once, read_once_with};
use super::source::PullSource;
use crate::plan::LinkPlan;
use crate::transport::TransportKind;

mod records;

/// A room this reader may write: what its records must follow (pure,
/// `handoff-proto`'s [`RoomLanding`]) and the guard that keeps its pages.
struct Slot {
    landing: RoomLanding,
    /// Keeps the room's pages from the free list while this reader may
    /// write them (held for its drop).
    _guard: WriterGuard,
    /// Over NIXL: the source pages (and their epochs) of the bytes READ
    /// for this room, whose stamps are checked once, at its end.
    #[cfg(feature = "nixl")]
    unchecked: Vec<(std::ops::Range<u32>, u64)>,
}

enum ReadState {
    Header,
    Payload {
        room: RoomId,
        dst: std::ops::Range<usize>,
        filled: usize,
        keep: bool,
    },
    /// Over shm: a segment header was read, its [`PullRef`] comes next.
    Pull {
        room: RoomId,
        /// The segment's layer (its source bytes must lie in that layer's
        /// blocks of the pages its pull names).
        layer: u32,
        /// Where the bytes go, `None` when the segment was refused (or its
        /// room forgotten since).
        dst: Option<std::ops::Range<usize>>,
    },
}

/// Decode side link reader: owns the socket and the writable-room table.
pub struct LinkReader {
    stream: TcpStream,
    kind: TransportKind,
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    /// What this link may write (whole spans, or which head slices).
    plan: LinkPlan,
    rooms: HashMap<RoomId, Slot>,
    state: ReadState,
    counters: Arc<LinkCounters>,
    /// Staging for headers and small payloads (`pos..len` unread).
    buf: Vec<u8>,
    pos: usize,
    len: usize,
    /// Size of the last segment payload (picks the next read's size).
    last_payload: usize,
    /// Acks of the rooms whose end was read, not yet written.
    acks: Vec<u8>,
    /// Events for the driver, sent before the acks gathered with them.
    events: Vec<ReaderEvent>,
    /// Over shm or NIXL, the prefill's pool this link pulls from.
    source: Option<PullSource>,
    /// Bytes landed since the last [`Self::flush`], added to
    /// `counters.bytes_landed` there: one atomic add per batch of records,
    /// not one per page (a locked add right after a page copy waits for
    /// the copy's stores to drain).
    landed: u64,
    /// Over shm or NIXL: pulls checked and not yet copied
    /// ([`Self::run_pulls`]).
    pulls: Vec<Pull>,
    /// Bytes of `pulls`.
    pulled: usize,
    /// Why the link must close (a NIXL READ failed), once it must.
    failed: Option<LinkReadError>,
}

/// A checked shm pull waiting for its copy: `len` bytes from `src` (in
/// the prefill's pool) to `dst` (our room's pages), then the source pages'
/// generations checked against `epoch`.
struct Pull {
    room: RoomId,
    dst: usize,
    src: usize,
    len: usize,
    pages: std::ops::Range<u32>,
    epoch: u64,
    /// Whether the copy went through (set by [`LinkReader::run_pulls`]).
    copied: bool,
}

/// Most pulls gathered before they are copied: small pages are copied
/// back to back, then their generations checked together (what lets a
/// 4 KiB page cost about a memcpy).
const PULL_BATCH: usize = 64;
/// The same over NIXL, where each batch costs two round trips (its READ,
/// then its stamps'): larger batches, up to [`NIXL_BATCH_BYTES`].
const NIXL_PULL_BATCH: usize = 1024;
/// Most bytes one NIXL batch READs.
const NIXL_BATCH_BYTES: usize = 64 << 20;

/// Most bytes a reader moves before it looks at its commands again.
const READ_BUDGET: usize = 16 << 20;
/// Staging buffer: headers and small payloads arrive many per `read()`.
const STAGING_BYTES: usize = 256 << 10;
/// A payload at least this large is read straight into the pool.
pub(super) const DIRECT_MIN: usize = 64 << 10;

impl LinkReader {
    /// A reader for an established link that carries `plan`.
    pub fn new(
        stream: TcpStream,
        kind: TransportKind,
        pool: Arc<ShmRegion>,
        layout: KvLayout,
        plan: LinkPlan,
        counters: Arc<LinkCounters>,
    ) -> Self {
        Self {
            stream,
            kind,
            pool,
            layout,
            plan,
            rooms: HashMap::new(),
            state: ReadState::Header,
            counters,
            buf: vec![0; STAGING_BYTES],
            pos: 0,
            len: 0,
            last_payload: 0,
            acks: Vec::new(),
            events: Vec::new(),
            source: None,
            landed: 0,
            pulls: Vec::with_capacity(PULL_BATCH),
            pulled: 0,
            failed: None,
        }
    }

    /// Over shm or NIXL: the prefill's pool this link pulls from (from the
    /// link setup). Without it a pulling link refuses every segment.
    pub fn with_source(mut self, source: Option<PullSource>) -> Self {
        self.source = source;
        self
    }

    /// Run until the link closes or the driver drops the command channel.
    pub async fn run<F>(mut self, mut cmds: mpsc::UnboundedReceiver<ReaderCmd>, send: F)
    where
        F: Fn(ReaderEvent) -> bool,
    {
        let reason = loop {
            tokio::select! {
                biased;
                c = cmds.recv() => match c {
                    Some(c) => self.command(c),
                    None => break None,
                },
                r = self.stream.readable() => {
                    if let Err(e) = r {
                        break Some(LinkReadError::io("waiting to read")(e));
                    }
                    match self.on_readable(&send).await {
                        Ok(true) => {}
                        Ok(false) => break Some(LinkReadError::Closed),
                        Err(e) => break Some(e),
                    }
                }
            }
        };
        if let Some(reason) = reason {
            send(ReaderEvent::Closed { reason });
        }
    }

    fn command(&mut self, c: ReaderCmd) {
        match c {
            ReaderCmd::Register {
                room,
                pages,
                aux_slot,
                guard,
            } => {
                self.rooms.insert(
                    room,
                    Slot {
                        landing: RoomLanding::new(&pages, aux_slot),
                        _guard: guard,
                        #[cfg(feature = "nixl")]
                        unchecked: Vec::new(),
                    },
                );
            }
            ReaderCmd::Forget { room } => {
                // A payload or pull in progress for this room is discarded
                // from here on: no byte lands after the guard is gone.
                match &mut self.state {
                    ReadState::Payload { room: r, keep, .. } if *r == room => *keep = false,
                    ReadState::Pull { room: r, dst, .. } if *r == room => *dst = None,
                    _ => {}
                }
                self.rooms.remove(&room);
            }
        }
    }

    /// Validate a segment against its room's pages, the pool and this
    /// link's plan (a head slice must be one this prefill peer serves, within
    /// the local heads); the byte range it may write, or `None` (counted;
    /// the payload is discarded).
    fn place(
        &mut self,
        h: &handoff_proto::datalink::SegmentHeader,
    ) -> Option<std::ops::Range<usize>> {
        let range = handoff_proto::placement::place(
            &self.layout.page_layout(),
            self.plan.decode_heads,
            &self.plan.pair,
            self.rooms.get(&h.room).map(|s| s.landing.pages()),
            h,
            self.pool.len(),
        );
        if range.is_none() {
            self.reject(h.room);
        }
        range
    }

    /// Count a refused segment and fail its room's end (if it has one).
    fn reject(&mut self, room: RoomId) {
        self.counters
            .rejected_segments
            .fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = self.rooms.get_mut(&room) {
            slot.landing.reject();
        }
    }

    /// Read what is available. `Ok(false)` on EOF.
    async fn on_readable<F>(&mut self, send: &F) -> Result<bool, LinkReadError>
    where
        F: Fn(ReaderEvent) -> bool,
    {
        let mut budget = READ_BUDGET;
        while budget > 0 {
            self.drain_staging()?;
            self.flush(send).await?;
            let mut body = 0;
            // A large payload goes straight into the pool (no copy), to its
            // last byte; everything else through the staging buffer, so
            // many small records cost one read() between them.
            let direct = match &self.state {
                ReadState::Payload {
                    dst, filled, keep, ..
                } if *keep && dst.len() >= DIRECT_MIN => Some(dst.start + *filled..dst.end),
                _ => None,
            };
            let res = if let Some(want) = direct.clone() {
                body = want.len();
                // Staging is empty: every byte it held went into this
                // payload. The next record's header comes with the same
                // read (one read per large page when data is waiting).
                debug_assert_eq!(self.pos, self.len, "staging not drained");
                self.pos = 0;
                self.len = 0;
                let stream = &self.stream;
                let head = &mut self.buf[..RECORD_LEN];
                let pool = &self.pool;
                // The payload's bytes go from the socket into our pages in
                // the kernel: no reference to shared memory is made.
                read_once_with(stream, want.len() + RECORD_LEN, || {
                    pool.readv_into(want.clone(), head, std::os::fd::AsFd::as_fd(stream))
                        .map_err(std::io::Error::other)?
                })
            } else {
                if self.pos == self.len {
                    self.pos = 0;
                    self.len = 0;
                } else if self.pos > 0 {
                    self.buf.copy_within(self.pos..self.len, 0);
                    self.len -= self.pos;
                    self.pos = 0;
                }
                // After a large payload the next record is most likely
                // another large one: read just its header, so its payload
                // goes straight into the pool rather than through staging.
                let want =
                    if self.last_payload >= DIRECT_MIN && matches!(self.state, ReadState::Header) {
                        // (Staging was compacted above: `pos` is 0.)
                        RECORD_LEN.saturating_sub(self.len).max(1)
                    } else {
                        self.buf.len() - self.len
                    };
                let end = (self.len + want).min(self.buf.len());
                read_once(&self.stream, &mut self.buf[self.len..end])
            };
            let n = match res {
                Ok(0) => return Ok(false),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(LinkReadError::io("reading the link")(e)),
            };
            budget = budget.saturating_sub(n);
            if direct.is_some() {
                self.advance_payload(n.min(body));
                self.len = n.saturating_sub(body);
            } else {
                self.len += n;
            }
        }
        self.drain_staging()?;
        self.flush(send).await?;
        Ok(true)
    }

    /// Hand the driver the events gathered so far, then write the acks
    /// (in the order their ends arrived). Events go first: a room's aux
    /// reaches the driver before prefill can learn, from the ack, that the
    /// room ended.
    async fn flush<F>(&mut self, send: &F) -> Result<(), LinkReadError>
    where
        F: Fn(ReaderEvent) -> bool,
    {
        if self.landed > 0 {
            self.counters
                .bytes_landed
                .fetch_add(std::mem::take(&mut self.landed), Ordering::Relaxed);
        }
        for e in self.events.drain(..) {
            send(e);
        }
        if !self.acks.is_empty() {
            self.stream
                .write_all(&self.acks)
                .await
                .map_err(LinkReadError::io("writing acks"))?;
            self.acks.clear();
        }
        Ok(())
    }

    fn advance_payload(&mut self, n: usize) {
        if let ReadState::Payload {
            dst, filled, keep, ..
        } = &mut self.state
        {
            *filled += n;
            if *keep {
                self.landed += n as u64;
            }
            if *filled == dst.len() {
                self.state = ReadState::Header;
            }
        }
    }
}
