//! Data links: one per (decode peer, prefill peer) pair,
//! opened by decode next to its control connection, authenticated with the
//! same handshake, then set up for one transport. Both fingerprints fix
//! the link's [`LinkPlan`]: whole spans, or head slices when the TP sizes
//! differ. Prefill confirms the setup only once its driver registered the
//! link, so decode's first destination never arrives ahead of it.
//!
//! * Prefill side: a writer task owns the [`Transport`] and runs the jobs
//!   the driver queues; an ack task reads decode's acknowledgements.
//! * Decode side: one reader task owns the socket and the table of rooms it
//!   may write, each holding the lease's writer guard, and it is the only
//!   writer of decode's pages on every transport: over tcp it reads payloads
//!   into them, over shm it copies them out of its read-only mapping of the
//!   prefill's pool ([`PullRef`]). Every segment is bounds-checked against
//!   that room's own pages (and a head slice against the heads the plan lets
//!   this prefill peer write) before a byte lands; when the driver forgets a
//!   room, the reader stops writing it at once (the reader itself is the
//!   writer), so a page never returns under a writer, however long the
//!   prefill stalls.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_kv::lease::WriterGuard;
use handoff_kv::{
    KvLayout, KvPart, KvPool, PageGenerations, PageIndex, PageLayout, ShmRegion, ShmRegionHandle,
};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig};
use handoff_proto::{PeerId, RoomId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::conn::handshake_exact;
use crate::error::TransportError;
use crate::plan::{LinkPlan, PlanError};
use crate::transport::{Segment, ShmTransport, TcpTransport, Transport, TransportKind};
use handoff_proto::datalink::{
    encode_preface, Ack, AuxData, HeadSlice, PullRef, Record, RecordError, TcpStreamSetup, ACK_LEN,
    PREFACE_DATA, RECORD_LEN, SETUP_SHM, SETUP_SHM_PUSH, SETUP_TCP,
};

/// Bytes of one (layer, page): its K and V blocks, adjacent in the layout.
pub fn page_span(layout: &KvLayout) -> usize {
    2 * layout.page_layout().block_bytes()
}

/// Byte offset of (layer, page) in a pool of `num_pages` pages (its K
/// block, which its V block follows).
pub fn span_offset(layout: &KvLayout, num_pages: usize, layer: usize, page: usize) -> usize {
    let l = PageLayout {
        num_pages: num_pages as u32,
        ..layout.page_layout()
    };
    l.block_index(layer as u32, PageIndex(page as u32), KvPart::K) * l.block_bytes()
}

/// Counters shared by an endpoint's tasks (read for stats and metrics).
#[derive(Debug, Default)]
pub struct LinkCounters {
    /// Malformed control frames dropped.
    pub malformed_frames: AtomicU64,
    /// Data segments rejected (unknown room, page not the room's, range).
    pub rejected_segments: AtomicU64,
    /// Handshakes refused.
    pub handshakes_failed: AtomicU64,
    /// Payload bytes placed into the pool.
    pub bytes_landed: AtomicU64,
    /// KV payload bytes queued onto data links (prefill; a room cancelled
    /// mid-write moves less).
    pub kv_bytes_sent: AtomicU64,
}

/// Refuse a link setup with `msg` (success is a single 0 byte, written by
/// [`PendingWriter::confirm`]).
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
}

impl SetupRefusal {
    /// True when the peer sent something wrong (not our own settings).
    pub fn blames_peer(&self) -> bool {
        !matches!(self, SetupRefusal::Plan(_) | SetupRefusal::Shm(_))
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
    fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> LinkReadError {
        move |source| LinkReadError::Io { what, source }
    }
}

async fn refuse_setup(stream: &mut TcpStream, msg: &str) {
    let mut out = vec![1u8];
    let b = msg.as_bytes();
    let n = b.len().min(1024);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&b[..n]);
    let _ = stream.write_all(&out).await;
}

/// `read_exact` bounded by `timeout`: a peer that stalls in the middle of
/// link setup cannot hold the task forever.
async fn read_setup(
    s: &mut TcpStream,
    buf: &mut [u8],
    timeout: Duration,
    what: &'static str,
) -> Result<(), TransportError> {
    match tokio::time::timeout(timeout, s.read_exact(buf)).await {
        Ok(r) => r.map(|_| ()).map_err(TransportError::io(what)),
        Err(_) => Err(TransportError::PeerMisbehaved(format!(
            "{what}: no answer within {timeout:?}"
        ))),
    }
}

/// Decode side: open a data link of one stream to `addr` for `kind`, for
/// our pool of `num_pages` pages, as decode endpoint
/// `endpoint`, for its connect number `connect` ([`handoff_proto::datalink::CONNECT_SEQ_LEN`]).
/// Returns the socket and the prefill's fingerprint (its TP rank and size).
#[allow(clippy::too_many_arguments)]
pub async fn connect_link(
    addr: std::net::SocketAddr,
    endpoint: u64,
    connect: u64,
    config: HandshakeConfig,
    timeout: Duration,
    kind: TransportKind,
    num_pages: usize,
) -> Result<(TcpStream, Fingerprint), TransportError> {
    let one = TcpStreamSetup {
        nonce: rand::random(),
        index: 0,
        count: 1,
    };
    connect_link_stream(
        addr, endpoint, connect, config, timeout, kind, num_pages, one,
    )
    .await
    .map(|l| (l.stream, l.fingerprint))
}

/// A data link stream decode opened.
pub struct LinkStream {
    /// The socket.
    pub stream: TcpStream,
    /// The prefill's fingerprint (its TP rank and size).
    pub fingerprint: Fingerprint,
    /// Over shm, the prefill's pool, mapped read-only, that this link
    /// pulls from.
    pub source: Option<Arc<SourcePool>>,
}

/// A prefill's pool as decode maps it (read-only) to pull KV out of it.
#[derive(Debug)]
pub struct SourcePool {
    region: Arc<ShmRegion>,
    /// End of its KV bytes (pulls never read past it).
    kv_end: usize,
    /// Its pages.
    pages: usize,
    gens: PageGenerations,
}

impl SourcePool {
    /// The bytes of `layer`'s blocks of pages `first..first + n` (the
    /// pool is layer-major, then page, K before V, so they are one run),
    /// or `None` if the pages or the layer are outside the pool.
    fn pages_range(
        &self,
        layers: u32,
        layer: u32,
        first: u32,
        n: u32,
    ) -> Option<std::ops::Range<usize>> {
        let (layers, layer) = (layers as usize, layer as usize);
        let end_page = (first as usize).checked_add(n as usize)?;
        if layer >= layers || end_page > self.pages || layers * self.pages == 0 {
            return None;
        }
        // Bytes of one (layer, page): K and V blocks, at the prefill's own
        // head count (which a TP prefill's differs from ours).
        let per = self.kv_end / (layers * self.pages);
        if (per * layers * self.pages).next_multiple_of(8) != self.kv_end {
            return None;
        }
        let at = |page: usize| (layer * self.pages + page) * per;
        Some(at(first as usize)..at(end_page))
    }

    /// Map the pool prefill described in its shm setup reply: read-only,
    /// and only if it is a handoff KV pool with its generations table
    /// inside the region.
    fn open(reply: &[u8; SHM_REPLY_LEN]) -> Result<Self, TransportError> {
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
        let (Ok(pages), Ok(gens_at)) = (usize::try_from(pages), usize::try_from(gens_at)) else {
            return Err(bad(format!("{pages} pages, generations at {gens_at}")));
        };
        let region = Arc::new(
            ShmRegion::open_read_only(&handle)
                .map_err(|e| bad(format!("mapping the prefill pool: {e}")))?,
        );
        let gens = PageGenerations::new(region.clone(), gens_at, pages)
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
const SHM_REPLY_LEN: usize = ShmRegionHandle::ENCODED_LEN + 16;

/// [`connect_link`] for stream `stream.index` of a TCP link of
/// `stream.count` streams (`stream` is ignored for shm).
#[allow(clippy::too_many_arguments)]
pub async fn connect_link_stream(
    addr: std::net::SocketAddr,
    endpoint: u64,
    connect: u64,
    config: HandshakeConfig,
    timeout: Duration,
    kind: TransportKind,
    num_pages: usize,
    stream: TcpStreamSetup,
) -> Result<LinkStream, TransportError> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(TransportError::io("data link connect"))?;
    let _ = s.set_nodelay(true);
    s.write_all(&encode_preface(PREFACE_DATA, endpoint, connect))
        .await
        .map_err(TransportError::io("data link preface"))?;
    let n = handshake_exact(&mut s, config, timeout).await?;
    let mut setup = Vec::new();
    match kind {
        TransportKind::Shm => {
            setup.push(SETUP_SHM);
            setup.extend_from_slice(&(num_pages as u64).to_le_bytes());
        }
        TransportKind::Tcp => {
            setup.push(SETUP_TCP);
            setup.extend_from_slice(&(num_pages as u64).to_le_bytes());
            setup.extend_from_slice(&stream.encode());
        }
    }
    s.write_all(&setup)
        .await
        .map_err(TransportError::io("data link setup"))?;
    let mut status = [0u8; 1];
    read_setup(&mut s, &mut status, timeout, "data link setup reply").await?;
    if status[0] != 0 {
        let mut len = [0u8; 2];
        read_setup(&mut s, &mut len, timeout, "data link setup reply").await?;
        let mut msg = vec![0u8; u16::from_le_bytes(len) as usize];
        read_setup(&mut s, &mut msg, timeout, "data link setup reply").await?;
        return Err(TransportError::PeerMisbehaved(format!(
            "prefill refused the {} link: {}",
            kind.name(),
            String::from_utf8_lossy(&msg)
        )));
    }
    let source = match kind {
        TransportKind::Shm => {
            let mut reply = [0u8; SHM_REPLY_LEN];
            read_setup(&mut s, &mut reply, timeout, "data link setup reply").await?;
            Some(Arc::new(SourcePool::open(&reply)?))
        }
        TransportKind::Tcp => None,
    };
    Ok(LinkStream {
        stream: s,
        fingerprint: n.peer_fingerprint,
        source,
    })
}

/// A link accepted on the prefill side, ready to run.
pub struct AcceptedLink {
    /// The decode peer.
    pub peer: PeerId,
    /// Pages in the decode pool (every destination page is checked against it).
    pub dest_pages: usize,
    /// Transport kind.
    pub kind: TransportKind,
    /// Which stream of its link this is (one stream of one for shm).
    pub stream: TcpStreamSetup,
    /// What this link moves (whole spans, or head slices when TP differs).
    pub plan: LinkPlan,
    writer: PendingWriter,
    acks: OwnedReadHalf,
}

enum LinkWriter {
    Shm(ShmTransport),
    Tcp(TcpTransport),
}

/// A link whose setup succeeded but was not yet confirmed to decode: the
/// success reply goes out only once the driver registered the link
/// ([`AcceptedLink::spawn`]), so a destination decode sends after its
/// `connect` returned can never reach the driver before its link.
struct PendingWriter {
    src: Arc<ShmRegion>,
    /// Over shm, our pool's page generations (their table's place goes to
    /// decode with the pool's handle).
    shm: Option<PageGenerations>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

impl PendingWriter {
    /// Send decode the setup success and build the transport.
    async fn confirm(mut self) -> Result<LinkWriter, TransportError> {
        // Over shm, decode learns which pool to map (read-only) and where
        // its page generations are.
        let mut ok = vec![0u8];
        if let Some(g) = &self.shm {
            ok.extend_from_slice(&self.src.handle().to_bytes());
            ok.extend_from_slice(&(g.pages() as u64).to_le_bytes());
            ok.extend_from_slice(&(g.offset() as u64).to_le_bytes());
        }
        self.w
            .write_all(&ok)
            .await
            .map_err(TransportError::io("data link setup reply"))?;
        Ok(match self.shm {
            Some(gens) => LinkWriter::Shm(ShmTransport::new(gens, self.w)),
            None => LinkWriter::Tcp(TcpTransport::new(self.src, self.w)),
        })
    }
}

/// Prefill side: finish accepting a data link from the decode endpoint known
/// here as `peer` (preface already read).
pub async fn accept_link(
    mut s: TcpStream,
    peer: PeerId,
    config: HandshakeConfig,
    timeout: Duration,
    src: Arc<ShmRegion>,
    layout: &KvLayout,
) -> Result<AcceptedLink, TransportError> {
    let _ = s.set_nodelay(true);
    let ours = config.fingerprint.clone();
    let n = handshake_exact(&mut s, config, timeout).await?;
    let plan = LinkPlan::new(&ours, &n.peer_fingerprint, true, layout.geometry.kv_heads);
    let mut kind = [0u8; 1];
    let read = tokio::time::timeout(timeout, s.read_exact(&mut kind)).await;
    if !matches!(read, Ok(Ok(_))) {
        return Err(TransportError::PeerMisbehaved("no link setup".into()));
    }
    let mut stream = TcpStreamSetup {
        nonce: 0,
        index: 0,
        count: 1,
    };
    let setup: Result<(TransportKind, usize, Option<PageGenerations>), SetupRefusal> =
        match (&plan, kind[0]) {
            (Err(e), _) => Err(e.clone().into()),
            (Ok(_), SETUP_SHM) => {
                let mut b = [0u8; 8];
                read_setup(&mut s, &mut b, timeout, "shm link setup").await?;
                let pages = u64::from_le_bytes(b);
                if pages == 0 || pages > u64::from(u32::MAX) {
                    Err(SetupRefusal::Pages(pages))
                } else {
                    // Decode maps our pool read-only and pulls from it.
                    let gens_at = KvPool::generations_offset(layout);
                    PageGenerations::new(src.clone(), gens_at, layout.num_pages)
                        .map(|g| (TransportKind::Shm, pages as usize, Some(g)))
                        .map_err(SetupRefusal::from)
                }
            }
            (Ok(_), SETUP_SHM_PUSH) => Err(SetupRefusal::ShmPush),
            (Ok(_), SETUP_TCP) => {
                let mut b = [0u8; 8];
                read_setup(&mut s, &mut b, timeout, "tcp link setup").await?;
                let pages = u64::from_le_bytes(b);
                let mut sb = [0u8; TcpStreamSetup::LEN];
                read_setup(&mut s, &mut sb, timeout, "tcp link setup").await?;
                match TcpStreamSetup::decode(&sb) {
                    Err(e) => Err(e.into()),
                    Ok(_) if pages == 0 || pages > u64::from(u32::MAX) => {
                        Err(SetupRefusal::Pages(pages))
                    }
                    Ok(st) => {
                        stream = st;
                        Ok((TransportKind::Tcp, pages as usize, None))
                    }
                }
            }
            (Ok(_), other) => Err(SetupRefusal::UnknownTransport(other)),
        };
    // A refusal is answered now; success only once the link is registered.
    if let Err(why) = &setup {
        refuse_setup(&mut s, &why.to_string()).await;
    }
    let (kind, dest_pages, shm) = setup?;
    let plan = plan.map_err(SetupRefusal::from)?;
    let (r, w) = s.into_split();
    Ok(AcceptedLink {
        peer,
        dest_pages,
        kind,
        stream,
        plan,
        writer: PendingWriter { src, shm, w },
        acks: r,
    })
}

/// Work for a prefill link writer.
#[derive(Debug)]
pub enum LinkJob {
    /// Write these segments of `room`.
    Segments {
        /// The room.
        room: RoomId,
        /// What to write.
        segs: Vec<Segment>,
        /// Set when the room's writes are cancelled.
        cancel: Arc<AtomicBool>,
    },
    /// No more segments: write the aux record (unless cancelled) and the end.
    Finish {
        /// The room.
        room: RoomId,
        /// Aux slot and data.
        aux: Option<(u32, AuxData)>,
        /// The room's prompt scores (flat pairs), sent ahead of the aux.
        prompt: Arc<[(u32, f32)]>,
        /// Set when the room's writes are cancelled.
        cancel: Arc<AtomicBool>,
    },
}

/// What prefill link tasks report to the driver.
#[derive(Debug)]
pub enum LinkEvent {
    /// Decode acknowledged everything of `room` up to its end.
    Acked {
        /// Decode peer.
        peer: PeerId,
        /// Link generation.
        link: u64,
        /// The ack.
        ack: Ack,
    },
    /// The link broke.
    Closed {
        /// Decode peer.
        peer: PeerId,
        /// Link generation.
        link: u64,
        /// Why.
        reason: String,
    },
}

/// Most queued jobs a writer takes in one go.
const WRITER_BATCH: usize = 64;

/// The aux (unless cancelled) and end records that close `room`.
fn finish_records(
    room: RoomId,
    aux: Option<(u32, AuxData)>,
    prompt: &[(u32, f32)],
    cancel: &AtomicBool,
) -> Vec<Record> {
    let cancelled = cancel.load(Ordering::Acquire);
    let mut recs = Vec::with_capacity(2);
    if let (false, Some((aux_slot, aux))) = (cancelled, aux) {
        recs.extend(aux.top.records(room, aux_slot));
        recs.extend(handoff_proto::datalink::prompt_records(room, prompt));
        recs.push(Record::Aux {
            room,
            aux_slot,
            written_room: room.get(),
            aux,
        });
    }
    recs.push(Record::End { room, cancelled });
    recs
}

/// Run a link's jobs in order. Jobs already queued are taken together: a
/// room's consecutive segment jobs become one write, and a room's finish
/// right behind them rides in the same write (one `writev` for a small
/// room, rather than one per job).
async fn run_writer<T: Transport>(
    mut t: T,
    mut jobs: mpsc::UnboundedReceiver<LinkJob>,
    ended: &tokio::sync::Notify,
) -> Result<(), TransportError> {
    let mut queued = Vec::with_capacity(WRITER_BATCH);
    while jobs.recv_many(&mut queued, WRITER_BATCH).await > 0 {
        let mut it = queued.drain(..).peekable();
        while let Some(job) = it.next() {
            match job {
                LinkJob::Segments {
                    room,
                    mut segs,
                    cancel,
                } => {
                    while let Some(LinkJob::Segments { room: r, .. }) = it.peek() {
                        if *r != room {
                            break;
                        }
                        if let Some(LinkJob::Segments { segs: more, .. }) = it.next() {
                            segs.extend(more);
                        }
                    }
                    if cancel.load(Ordering::Acquire) {
                        continue;
                    }
                    let trailer = match it.peek() {
                        Some(LinkJob::Finish { room: r, .. }) if *r == room => match it.next() {
                            Some(LinkJob::Finish {
                                aux,
                                prompt,
                                cancel,
                                ..
                            }) => finish_records(room, aux, &prompt, &cancel),
                            _ => Vec::new(),
                        },
                        _ => Vec::new(),
                    };
                    let complete = t.write_segments(&segs, &trailer, &cancel).await?;
                    if !complete && !trailer.is_empty() {
                        // Cancelled mid-write: the room still needs its end.
                        t.write_records(&[Record::End {
                            room,
                            cancelled: true,
                        }])
                        .await?;
                    }
                    if !trailer.is_empty() {
                        ended.notify_one();
                    }
                }
                LinkJob::Finish {
                    room,
                    aux,
                    prompt,
                    cancel,
                } => {
                    t.write_records(&finish_records(room, aux, &prompt, &cancel))
                        .await?;
                    ended.notify_one();
                }
            }
        }
    }
    Ok(())
}

impl AcceptedLink {
    /// Spawn the writer and ack tasks; events go through `send`. Call once
    /// the link is registered: the writer first tells decode the setup
    /// succeeded.
    pub fn spawn<F>(
        self,
        link: u64,
        tasks: &crate::conn::TaskCounter,
        send: F,
    ) -> mpsc::UnboundedSender<LinkJob>
    where
        F: Fn(LinkEvent) -> bool + Send + Sync + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let peer = self.peer;
        let send = Arc::new(send);
        let s1 = send.clone();
        let ended = Arc::new(tokio::sync::Notify::new());
        let ended2 = ended.clone();
        tasks.spawn(async move {
            let r = match self.writer.confirm().await {
                Ok(LinkWriter::Shm(t)) => run_writer(t, rx, &ended2).await,
                Ok(LinkWriter::Tcp(t)) => run_writer(t, rx, &ended2).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                s1(LinkEvent::Closed {
                    peer,
                    link,
                    reason: e.to_string(),
                });
            }
        });
        let acks = self.acks;
        tasks.spawn(async move {
            let deliver = |ack| send(LinkEvent::Acked { peer, link, ack });
            if let Some(reason) = read_acks(acks, ended, deliver).await {
                send(LinkEvent::Closed { peer, link, reason });
            }
        });
        tx
    }
}

/// Acks taken in one read at most.
const ACK_BATCH: usize = 256;

/// Prefill side: read decode's acks on `r` as they come (as many as arrived
/// per read) and hand each to `deliver`, until the link closes (the reason)
/// or `deliver` refuses one (the driver is gone: `None`). After delivering,
/// the task yields once before it reads again, so the driver completes the
/// acked rooms and their waiters run first. A short read clears readiness
/// ([`read_once`]), so the next wait needs no read that could only say
/// `EAGAIN`.
///
/// `ended` is signalled by the writer each time a room's end went out. The
/// task then reads at once, past tokio's readiness cache: when decode runs
/// on the same CPU its ack is usually in the socket before the writer's
/// `writev` even returned, and waiting for the runtime's next `epoll_wait`
/// to report it costs a whole extra turn of the I/O driver. If nothing is
/// there yet the read says `WouldBlock` and the task waits as before.
async fn read_acks<F>(
    r: OwnedReadHalf,
    ended: Arc<tokio::sync::Notify>,
    deliver: F,
) -> Option<String>
where
    F: Fn(Ack) -> bool,
{
    let mut buf = [0u8; ACK_LEN * ACK_BATCH];
    let mut len = 0usize;
    loop {
        let direct = tokio::select! {
            biased;
            r = r.readable() => match r {
                Ok(()) => false,
                Err(e) => return Some(format!("link closed: {e}")),
            },
            () = ended.notified() => true,
        };
        let got = if direct {
            read_past_readiness(r.as_ref(), &mut [std::io::IoSliceMut::new(&mut buf[len..])])
        } else {
            read_once(r.as_ref(), &mut buf[len..])
        };
        match got {
            Ok(0) => return Some("link closed: end of stream".into()),
            Ok(n) => len += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Some(format!("link closed: {e}")),
        }
        let whole = len - len % ACK_LEN;
        for b in buf[..whole].chunks_exact(ACK_LEN) {
            let mut one = [0u8; ACK_LEN];
            one.copy_from_slice(b);
            match Ack::decode(&one) {
                Ok(ack) => {
                    if !deliver(ack) {
                        return None;
                    }
                }
                Err(e) => return Some(e.to_string()),
            }
        }
        buf.copy_within(whole..len, 0);
        len -= whole;
        if whole > 0 {
            tokio::task::yield_now().await;
        }
    }
}

/// One read into `buf`. A read that leaves `buf` short has drained the
/// socket, so it also clears tokio's readiness (as tokio's own `poll_read`
/// does, for the readiness seen before the read): the reader's next wait
/// then goes straight to the I/O driver, without a read that could only say
/// `WouldBlock`. Data that arrives later raises a new readiness event.
fn read_once(stream: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    read_once_vectored(stream, &mut [std::io::IoSliceMut::new(buf)])
}

/// [`read_once`] into several buffers, filled in order by one `recvmsg`.
fn read_once_vectored(
    stream: &TcpStream,
    bufs: &mut [std::io::IoSliceMut<'_>],
) -> std::io::Result<usize> {
    let want: usize = bufs.iter().map(|b| b.len()).sum();
    read_once_with(stream, want, || read_past_readiness(stream, bufs))
}

/// [`read_once`]'s readiness rule around any one read of up to `want`
/// bytes from `stream`.
fn read_once_with(
    stream: &TcpStream,
    want: usize,
    mut read: impl FnMut() -> std::io::Result<usize>,
) -> std::io::Result<usize> {
    let mut short = None;
    let r = stream.try_io(tokio::io::Interest::READABLE, || {
        let n = read()?;
        if n > 0 && n < want {
            short = Some(n);
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match short {
        Some(n) => Ok(n),
        None => r,
    }
}

/// A plain read (`recvmsg(2)`) on the socket, whatever tokio's readiness
/// cache says (it neither consults nor updates it).
fn read_past_readiness(
    stream: &TcpStream,
    bufs: &mut [std::io::IoSliceMut<'_>],
) -> std::io::Result<usize> {
    use std::io::Read;
    (&*socket2::SockRef::from(stream)).read_vectored(bufs)
}

/// Decode side: commands from the driver to a link reader.
pub enum ReaderCmd {
    /// `room` may receive writes into `pages` (sorted) and `aux_slot`.
    Register {
        /// The room.
        room: RoomId,
        /// Its pages, sorted.
        pages: Vec<u32>,
        /// Its aux slot.
        aux_slot: u32,
        /// Keeps the pages from the free list while this link may write.
        guard: WriterGuard,
    },
    /// Stop writing `room` and drop its guard: the reader is the only
    /// writer of its pages, so nothing lands for it after this command.
    Forget {
        /// The room.
        room: RoomId,
    },
}

/// Decode side: what a link reader reports to the driver.
#[derive(Debug)]
pub enum ReaderEvent {
    /// The aux record of `room` arrived (before its end marker).
    Aux {
        /// The room.
        room: RoomId,
        /// The room id written in the slot.
        written_room: u64,
        /// The data.
        aux: AuxData,
        /// The room's prompt scores (flat pairs; empty unless asked for).
        prompt: Vec<(u32, f32)>,
    },
    /// The link closed.
    Closed {
        /// Why.
        reason: LinkReadError,
    },
}

struct Slot {
    pages: handoff_proto::placement::RoomPages,
    aux_slot: u32,
    rejected: bool,
    /// The first position's most likely tokens read so far (`AuxTop`
    /// records, in order), joined to the aux record.
    top: handoff_proto::datalink::TopLogprobs,
    /// The prompt scores read so far (`AuxPrompt` records, in order).
    prompt: Vec<(u32, f32)>,
    /// Keeps the room's pages from the free list while this reader may
    /// write them (held for its drop).
    _guard: WriterGuard,
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
    /// Over shm, the prefill's pool (mapped read-only) this link pulls
    /// from.
    source: Option<Arc<SourcePool>>,
    /// Bytes landed since the last [`Self::flush`], added to
    /// `counters.bytes_landed` there: one atomic add per batch of records,
    /// not one per page (a locked add right after a page copy waits for
    /// the copy's stores to drain).
    landed: u64,
    /// Over shm: pulls checked and not yet copied ([`Self::run_pulls`]).
    pulls: Vec<Pull>,
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

/// Most bytes a reader moves before it looks at its commands again.
const READ_BUDGET: usize = 16 << 20;
/// Staging buffer: headers and small payloads arrive many per `read()`.
const STAGING_BYTES: usize = 256 << 10;
/// A payload at least this large is read straight into the pool.
const DIRECT_MIN: usize = 64 << 10;

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
        }
    }

    /// Over shm: the prefill's pool this link pulls from (from the link
    /// setup). Without it an shm link refuses every segment.
    pub fn with_source(mut self, source: Option<Arc<SourcePool>>) -> Self {
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
                        pages: handoff_proto::placement::RoomPages::new(&pages),
                        aux_slot,
                        rejected: false,
                        top: handoff_proto::datalink::TopLogprobs::NONE,
                        prompt: Vec::new(),
                        _guard: guard,
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
            self.rooms.get(&h.room).map(|s| &s.pages),
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
            slot.rejected = true;
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

    /// Act on every complete record and payload byte in the staging buffer.
    /// Over shm, the pulls it gathers are all copied and checked before it
    /// returns.
    fn drain_staging(&mut self) -> Result<(), LinkReadError> {
        let r = self.drain_records();
        self.run_pulls();
        r
    }

    fn drain_records(&mut self) -> Result<(), LinkReadError> {
        while self.pos < self.len {
            match &self.state {
                ReadState::Header => {
                    if self.len - self.pos < RECORD_LEN {
                        return Ok(());
                    }
                    let mut h = [0u8; RECORD_LEN];
                    h.copy_from_slice(&self.buf[self.pos..self.pos + RECORD_LEN]);
                    self.pos += RECORD_LEN;
                    let rec = Record::decode(&h)?;
                    // A room's aux and end act on what its pulls did.
                    if !matches!(rec, Record::Segment(_)) {
                        self.run_pulls();
                    }
                    self.record(rec)?;
                }
                ReadState::Pull { room, layer, dst } => {
                    if self.len - self.pos < PullRef::LEN {
                        return Ok(());
                    }
                    let (room, layer, dst) = (*room, *layer, dst.clone());
                    let mut b = [0u8; PullRef::LEN];
                    b.copy_from_slice(&self.buf[self.pos..self.pos + PullRef::LEN]);
                    self.pos += PullRef::LEN;
                    self.state = ReadState::Header;
                    let pull = PullRef::decode(&b)?;
                    if let Some(dst) = dst {
                        self.pull(room, layer, dst, pull);
                    }
                }
                ReadState::Payload {
                    dst, filled, keep, ..
                } => {
                    let n = (dst.len() - filled).min(self.len - self.pos);
                    if *keep {
                        self.pool
                            .write_at(dst.start + filled, &self.buf[self.pos..self.pos + n])?;
                    }
                    self.pos += n;
                    self.advance_payload(n);
                }
            }
        }
        Ok(())
    }

    fn record(&mut self, rec: Record) -> Result<(), LinkReadError> {
        match rec {
            Record::Segment(h) => {
                let head_bytes = self.layout.page_layout().head_bytes();
                let len = h
                    .payload_len(page_span(&self.layout), head_bytes)
                    .filter(|l| *l <= self.pool.len())
                    .ok_or(LinkReadError::SegmentTooLarge {
                        n_pages: h.n_pages,
                        heads: h.heads,
                    })?;
                let place = self.place(&h);
                if self.kind == TransportKind::Shm {
                    // The bytes stay in prefill's pool until we pull them.
                    self.last_payload = PullRef::LEN;
                    self.state = ReadState::Pull {
                        room: h.room,
                        layer: h.layer,
                        dst: place,
                    };
                    return Ok(());
                }
                self.last_payload = len;
                let (dst, keep) = match place {
                    Some(r) => (r, true),
                    None => (0..len, false),
                };
                if !dst.is_empty() {
                    self.state = ReadState::Payload {
                        room: h.room,
                        dst,
                        filled: 0,
                        keep,
                    };
                }
            }
            Record::AuxTop {
                room,
                aux_slot,
                index,
                pairs,
                count,
            } => match self.rooms.get_mut(&room) {
                // In order, for the room's own slot; anything else fails
                // the room (its end is acknowledged as failed).
                Some(slot) if slot.aux_slot == aux_slot && usize::from(index) == slot.top.len() => {
                    for &p in &pairs[..usize::from(count)] {
                        slot.top.push(p);
                    }
                }
                Some(slot) => slot.rejected = true,
                None => {
                    self.counters
                        .rejected_segments
                        .fetch_add(1, Ordering::Relaxed);
                }
            },
            Record::AuxPrompt {
                room,
                index,
                pairs,
                count,
            } => {
                // At most 21 pairs (a token and 20 alternatives) per token
                // the whole pool holds: a peer cannot make this grow past
                // that. (The room's own pages do not bound it: with a
                // decode prefix-cache hit they hold only the prompt's tail.)
                let cap = self.layout.num_pages * self.layout.geometry.page_size * 21;
                match self.rooms.get_mut(&room) {
                    Some(slot)
                        if index as usize == slot.prompt.len()
                            && slot.prompt.len() + usize::from(count) <= cap =>
                    {
                        slot.prompt.extend_from_slice(&pairs[..usize::from(count)]);
                    }
                    Some(slot) => slot.rejected = true,
                    None => {
                        self.counters
                            .rejected_segments
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Record::Aux {
                room,
                aux_slot,
                written_room,
                mut aux,
            } => match self.rooms.get_mut(&room) {
                Some(slot) if slot.aux_slot == aux_slot => {
                    aux.top = std::mem::take(&mut slot.top);
                    self.events.push(ReaderEvent::Aux {
                        room,
                        written_room,
                        aux,
                        prompt: std::mem::take(&mut slot.prompt),
                    });
                }
                Some(slot) => slot.rejected = true,
                None => {
                    self.counters
                        .rejected_segments
                        .fetch_add(1, Ordering::Relaxed);
                }
            },
            Record::End { room, .. } => {
                // Nothing more lands for this room through this link, and
                // its writer guard goes before the ack does: once prefill
                // reports the room's success, no link holds its pages (the
                // decode engine may hand them to its prefix cache).
                let ok = self.rooms.remove(&room).is_some_and(|s| !s.rejected);
                self.acks.extend_from_slice(&Ack { room, ok }.encode());
            }
        }
        Ok(())
    }
}

impl LinkReader {
    /// Over shm: check a segment's pull and queue it for copying out of the
    /// prefill's pool into `dst` (our room's pages). A source range outside
    /// the layer's blocks of the pages it names rejects the room (its end
    /// is then acknowledged as failed).
    fn pull(&mut self, room: RoomId, layer: u32, dst: std::ops::Range<usize>, r: PullRef) {
        let layers = self.layout.page_layout().layers;
        let len = dst.len();
        // The bytes must lie in this layer's blocks of the pages whose
        // generations are checked after the copy: a pull naming one page
        // and reading another could copy a page reused under it.
        let src = self.source.as_ref().and_then(|src| {
            let allowed = src.pages_range(layers, layer, r.src_page, r.src_pages)?;
            let o = usize::try_from(r.src_offset).ok()?;
            let end = o.checked_add(len)?;
            (allowed.start <= o && end <= allowed.end).then_some(o)
        });
        match src {
            Some(src) => {
                self.pulls.push(Pull {
                    room,
                    dst: dst.start,
                    src,
                    len,
                    pages: r.pages(),
                    epoch: r.epoch,
                    copied: false,
                });
                if self.pulls.len() == PULL_BATCH {
                    self.run_pulls();
                }
            }
            None => self.reject(room),
        }
    }

    /// Copy the queued pulls back to back, then keep each only if none of
    /// its source pages was handed out again since its segment was built
    /// (seqlock style: every check follows every copy; checking later only
    /// rejects more). A changed page rejects its room.
    fn run_pulls(&mut self) {
        if self.pulls.is_empty() {
            return;
        }
        let mut pulls = std::mem::take(&mut self.pulls);
        let Some(src) = self.source.clone() else {
            // `pull` queues nothing without a source.
            pulls.clear();
            self.pulls = pulls;
            return;
        };
        for p in &mut pulls {
            p.copied = self
                .pool
                .copy_from(p.dst, &src.region, p.src, p.len)
                .is_ok();
        }
        for p in pulls.drain(..) {
            if p.copied && src.gens.unchanged_since(p.pages, p.epoch) == Some(true) {
                self.landed += p.len as u64;
            } else {
                self.reject(p.room);
            }
        }
        self.pulls = pulls;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_proto::datalink::SegmentHeader;

    /// What a writer asked of its transport.
    #[derive(Debug, PartialEq)]
    enum Call {
        Segments {
            pages: Vec<u32>,
            trailer: Vec<Record>,
        },
        Records(Vec<Record>),
    }

    /// A transport that records calls (the scheduling of jobs into writes
    /// is what is under test; the real transports have their own suite).
    /// With `cancel_mid_write`, a segment write is cancelled while in
    /// progress (the room fails under the writer).
    struct Recorder(Arc<std::sync::Mutex<Vec<Call>>>, bool);

    impl Transport for Recorder {
        fn kind(&self) -> TransportKind {
            TransportKind::Tcp
        }

        async fn write_segments<'a>(
            &'a mut self,
            segs: &'a [Segment],
            trailer: &'a [Record],
            cancel: &'a AtomicBool,
        ) -> Result<bool, TransportError> {
            if self.1 {
                cancel.store(true, Ordering::Release);
            }
            if cancel.load(Ordering::Acquire) {
                return Ok(false);
            }
            self.0.lock().unwrap().push(Call::Segments {
                pages: segs.iter().map(|s| s.header.dst_page).collect(),
                trailer: trailer.to_vec(),
            });
            Ok(true)
        }

        async fn write_records<'a>(&'a mut self, recs: &'a [Record]) -> Result<(), TransportError> {
            self.0.lock().unwrap().push(Call::Records(recs.to_vec()));
            Ok(())
        }
    }

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    fn segs(r: RoomId, page: u32) -> Vec<Segment> {
        vec![Segment {
            header: SegmentHeader {
                room: r,
                layer: 0,
                dst_page: page,
                n_pages: 1,
                heads: None,
            },
            src: 0..8,
            src_pages: 0..1,
            dst: 0..8,
        }]
    }

    const AUX: AuxData = AuxData {
        first_token: 7,
        logprob: -0.5,
        top: handoff_proto::datalink::TopLogprobs::NONE,
    };

    async fn run_jobs(jobs: Vec<LinkJob>, cancel_mid_write: bool) -> Vec<Call> {
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::unbounded_channel();
        // Everything is queued before the writer first looks.
        for j in jobs {
            tx.send(j).unwrap();
        }
        drop(tx);
        run_writer(
            Recorder(calls.clone(), cancel_mid_write),
            rx,
            &tokio::sync::Notify::new(),
        )
        .await
        .unwrap();
        let calls = std::mem::take(&mut *calls.lock().unwrap());
        calls
    }

    /// Both ends of a loopback TCP connection (connecting, accepted).
    /// As a prefill: end `room` on `link` and read decode's ack of it.
    async fn end_and_ack(link: &mut TcpStream, room: RoomId) -> Ack {
        let end = Record::End {
            room,
            cancelled: false,
        };
        link.write_all(&end.encode()).await.unwrap();
        let mut ack = [0u8; ACK_LEN];
        tokio::time::timeout(Duration::from_secs(5), link.read_exact(&mut ack))
            .await
            .expect("no ack")
            .unwrap();
        Ack::decode(&ack).unwrap()
    }

    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, a) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), a.unwrap().0)
    }

    /// A connected pair: (prefill's ack read half, decode's side).
    async fn ack_pair() -> (OwnedReadHalf, TcpStream) {
        let (c, a) = tcp_pair().await;
        // Dropping our write half only ends our direction (as in a link
        // whose writer is idle); the read half is what is under test.
        let (r, _) = c.into_split();
        (r, a)
    }

    #[tokio::test]
    async fn a_short_read_clears_readiness_and_later_data_still_wakes_the_reader() {
        let (reader, mut peer) = tcp_pair().await;
        let mut buf = [0u8; 64];
        async fn woken(r: &TcpStream) {
            let ready = tokio::time::timeout(Duration::from_secs(5), r.readable());
            ready.await.expect("no wake-up").expect("readable");
        }
        // A read that fills its buffer leaves readiness as it was: the
        // next read asks the socket, which has nothing.
        peer.write_all(&[1; 10]).await.unwrap();
        reader.readable().await.unwrap();
        assert_eq!(read_once(&reader, &mut buf[..10]).unwrap(), 10);
        let again = read_once(&reader, &mut buf);
        assert_eq!(again.unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
        // A short read drained the socket: readiness is cleared with it, so
        // the reader waits, and bytes sent later wake it up.
        peer.write_all(&[2; 7]).await.unwrap();
        woken(&reader).await;
        assert_eq!(read_once(&reader, &mut buf).unwrap(), 7);
        assert_eq!(&buf[..7], &[2; 7]);
        let waiting = tokio::time::timeout(Duration::from_millis(50), reader.readable()).await;
        assert!(waiting.is_err(), "readiness outlived a short read");
        peer.write_all(&[3; 5]).await.unwrap();
        woken(&reader).await;
        assert_eq!(read_once(&reader, &mut buf).unwrap(), 5);
        // End of stream reads as 0.
        drop(peer);
        woken(&reader).await;
        assert_eq!(read_once(&reader, &mut buf).unwrap(), 0);
    }

    #[tokio::test]
    async fn acks_split_across_reads_or_packed_in_one_arrive_in_order() {
        let (r, mut decode) = ack_pair().await;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let task = tokio::spawn(read_acks(r, Default::default(), move |a: Ack| {
            s2.lock().unwrap().push((a.room.get(), a.ok));
            true
        }));
        let bytes: Vec<u8> = (1..=5)
            .flat_map(|n| {
                Ack {
                    room: room(n),
                    ok: n != 3,
                }
                .encode()
            })
            .collect();
        // Half an ack, then the rest of it with three more, then the last.
        for part in [&bytes[..4], &bytes[4..40], &bytes[40..]] {
            decode.write_all(part).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        drop(decode);
        let reason = task.await.unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(1, true), (2, true), (3, false), (4, true), (5, true)]
        );
        assert_eq!(reason.as_deref(), Some("link closed: end of stream"));
    }

    #[tokio::test]
    async fn a_bad_ack_closes_the_link_and_a_gone_driver_stops_the_reader() {
        let (r, mut decode) = ack_pair().await;
        let task = tokio::spawn(read_acks(r, Default::default(), |_| true));
        let mut bad = Ack {
            room: room(1),
            ok: true,
        }
        .encode();
        bad[9] = 7;
        decode.write_all(&bad).await.unwrap();
        let reason = task.await.unwrap().unwrap_or_default();
        assert!(reason.contains("bad ack"), "{reason}");

        let (r, mut decode) = ack_pair().await;
        let task = tokio::spawn(read_acks(r, Default::default(), |_| false));
        let ack = Ack {
            room: room(2),
            ok: true,
        };
        decode.write_all(&ack.encode()).await.unwrap();
        assert_eq!(
            task.await.unwrap(),
            None,
            "no close reported to a gone driver"
        );
    }

    #[tokio::test]
    async fn an_end_signal_reads_a_waiting_ack_and_is_harmless_with_none() {
        let (r, mut decode) = ack_pair().await;
        let ended = Arc::new(tokio::sync::Notify::new());
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(read_acks(r, ended.clone(), move |a: Ack| {
            tx.send(a.room.get()).is_ok()
        }));
        // Nothing there: the direct read says WouldBlock, the link stays up.
        ended.notify_one();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        assert!(rx.try_recv().is_err());
        assert!(!task.is_finished());
        // An ack already waiting when the signal comes is delivered.
        for n in [7, 8] {
            let ack = Ack {
                room: room(n),
                ok: true,
            };
            decode.write_all(&ack.encode()).await.unwrap();
            ended.notify_one();
            let got = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv()).await;
            assert_eq!(got.unwrap(), Some(n));
        }
        drop(decode);
        assert_eq!(
            task.await.unwrap().as_deref(),
            Some("link closed: end of stream")
        );
    }

    /// A tcp link reader over a pool whose pages are large enough to be read
    /// straight into the pool (`DIRECT_MIN`), and the prefill's end.
    struct DirectReader {
        pool: handoff_kv::KvPool,
        layout: KvLayout,
        span: usize,
        prefill: TcpStream,
        reader: LinkReader,
        /// The pool's region handle, kept for as long as the test runs.
        _handle: handoff_kv::ShmRegionHandle,
    }

    async fn direct_reader(layers: usize, pages: usize) -> DirectReader {
        let g = handoff_kv::KvGeometry {
            layers,
            kv_heads: 1,
            head_dim: 160,
            page_size: 64,
            dtype: handoff_kv::KvDtype::F32,
        };
        let (pool, handle) = handoff_kv::KvPool::new_shared(g, pages).unwrap();
        let layout = *pool.layout();
        let span = page_span(&layout);
        assert!(span >= DIRECT_MIN, "{span}");
        let (prefill, decode) = tcp_pair().await;
        let plan = LinkPlan {
            pair: handoff_proto::rank::PairPlan::Whole,
            decode_heads: 1,
        };
        let reader = LinkReader::new(
            decode,
            TransportKind::Tcp,
            pool.shared_region().unwrap().clone(),
            layout,
            plan,
            Default::default(),
        );
        DirectReader {
            pool,
            layout,
            span,
            prefill,
            reader,
            _handle: handle,
        }
    }

    /// Over shm, decode pulls: a segment lands only into its room's own
    /// pages, only from inside the prefill's KV bytes, and only if no
    /// source page was handed out again after the epoch the record names
    /// (checked after the copy). Anything else is discarded and fails the
    /// room's ack; a room forgotten between a record and its pull gets
    /// nothing. Each case fails if its check is removed.
    #[tokio::test]
    async fn shm_pulls_land_only_checked_unchanged_pages_of_their_room() {
        let g = handoff_kv::KvGeometry {
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            page_size: 2,
            dtype: handoff_kv::KvDtype::F32,
        };
        let (decode_pool, _dh) = handoff_kv::KvPool::new_shared(g, 8).unwrap();
        let (prefill_pool, ph) = handoff_kv::KvPool::new_shared(g, 8).unwrap();
        let layout = *decode_pool.layout();
        let span = page_span(&layout);
        let mut reply = [0u8; SHM_REPLY_LEN];
        reply[..16].copy_from_slice(&ph.to_bytes());
        reply[16..24].copy_from_slice(&8u64.to_le_bytes());
        let gens_at = handoff_kv::KvPool::generations_offset(prefill_pool.layout());
        reply[24..].copy_from_slice(&(gens_at as u64).to_le_bytes());
        let source = Arc::new(SourcePool::open(&reply).unwrap());
        assert!(
            !source.region.is_writable(),
            "decode maps prefill read-only"
        );
        let (mut prefill, decode) = tcp_pair().await;
        let plan = LinkPlan {
            pair: handoff_proto::rank::PairPlan::Whole,
            decode_heads: 1,
        };
        let counters: Arc<LinkCounters> = Default::default();
        let reader = LinkReader::new(
            decode,
            TransportKind::Shm,
            decode_pool.shared_region().unwrap().clone(),
            layout,
            plan,
            counters.clone(),
        )
        .with_source(Some(source));
        // Prefill's computed pages hold a known pattern.
        let src_lease = prefill_pool.allocator().lease(2).unwrap();
        let src = prefill_pool.shared_region().unwrap();
        for (i, p) in src_lease.pages().iter().enumerate() {
            let at = span_offset(&layout, 8, 0, p.0 as usize);
            src.write_at(at, &vec![0x50 + i as u8; span]).unwrap();
        }
        let epoch = prefill_pool.generations().unwrap().epoch();
        let dst_lease = decode_pool.allocator().lease(6).unwrap();
        let d: Vec<u32> = dst_lease.pages().iter().map(|p| p.0).collect();
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let rooms: Vec<RoomId> = (31..=36).map(room).collect();
        for (r, page) in rooms.iter().zip(&d) {
            cmd_tx
                .send(ReaderCmd::Register {
                    room: *r,
                    pages: vec![*page],
                    aux_slot: 0,
                    guard: dst_lease.writer_guard(),
                })
                .unwrap();
        }
        let task = tokio::spawn(reader.run(cmd_rx, |_| true));
        let s0 = src_lease.pages()[0].0;
        let pull = |r: RoomId, dst_page: u32, src_page: u32, offset: usize, epoch: u64| {
            let mut b = Record::Segment(SegmentHeader {
                room: r,
                layer: 0,
                dst_page,
                n_pages: 1,
                heads: None,
            })
            .encode()
            .to_vec();
            b.extend(
                PullRef {
                    src_offset: offset as u64,
                    src_page,
                    src_pages: 1,
                    epoch,
                }
                .encode(),
            );
            b
        };
        let at0 = span_offset(&layout, 8, 0, s0 as usize);
        let mut wire = Vec::new();
        // 31: a good pull.
        wire.extend(pull(rooms[0], d[0], s0, at0, epoch));
        // 32: into a page that is room 31's, not its own.
        wire.extend(pull(rooms[1], d[0], s0, at0, epoch));
        // 33: from past the prefill's KV bytes (its generations table).
        wire.extend(pull(rooms[2], d[2], s0, gens_at, epoch));
        // 34: its source page was handed out again after the epoch.
        let again = prefill_pool.allocator().lease(1).unwrap();
        wire.extend(pull(
            rooms[3],
            d[3],
            again.pages()[0].0,
            span_offset(&layout, 8, 0, again.pages()[0].0 as usize),
            epoch,
        ));
        // 36: names page s0 (unchanged) but points at the other computed
        // page's bytes: its generation is not the one checked.
        let s1 = src_lease.pages()[1].0;
        wire.extend(pull(
            rooms[5],
            d[5],
            s0,
            span_offset(&layout, 8, 0, s1 as usize),
            epoch,
        ));
        for r in rooms[..4].iter().chain(&rooms[5..6]) {
            wire.extend(
                Record::End {
                    room: *r,
                    cancelled: false,
                }
                .encode(),
            );
        }
        prefill.write_all(&wire).await.unwrap();
        let mut acks = [0u8; 5 * ACK_LEN];
        tokio::time::timeout(Duration::from_secs(5), prefill.read_exact(&mut acks))
            .await
            .expect("no acks")
            .unwrap();
        let oks: Vec<bool> = acks
            .chunks(ACK_LEN)
            .map(|a| Ack::decode(a.try_into().unwrap()).unwrap().ok)
            .collect();
        assert_eq!(oks, [true, false, false, false, false]);
        let dregion = decode_pool.shared_region().unwrap();
        let page = |p: u32| {
            let mut got = vec![0u8; span];
            dregion
                .read_at(span_offset(&layout, 8, 0, p as usize), &mut got)
                .unwrap();
            got
        };
        assert_eq!(page(d[0]), vec![0x50; span], "the good pull landed");
        assert_eq!(page(d[2]), vec![0; span], "nothing from past the KV bytes");
        assert_eq!(
            page(d[5]),
            vec![0; span],
            "nothing from another page's bytes"
        );
        assert_eq!(counters.rejected_segments.load(Ordering::Relaxed), 4);
        // 35: forgotten between its record and its pull reference.
        let rec = pull(rooms[4], d[4], s0, at0, epoch);
        prefill.write_all(&rec[..RECORD_LEN]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        cmd_tx.send(ReaderCmd::Forget { room: rooms[4] }).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        prefill.write_all(&rec[RECORD_LEN..]).await.unwrap();
        assert!(!end_and_ack(&mut prefill, rooms[4]).await.ok);
        assert_eq!(page(d[4]), vec![0; span], "a forgotten room got bytes");
        drop(cmd_tx);
        task.await.unwrap();
    }

    /// A segments job of one page for `room`.
    /// Large payloads (read straight into the pool, each one's tail
    /// together with the next record's header) land byte-exact however the
    /// sender's bytes are split: mid-header, at a payload's last byte, a
    /// header with part of its payload, a payload's tail with half of the
    /// next header, everything left at once. Then the room's ack comes back.
    #[tokio::test]
    async fn large_payloads_split_anywhere_land_byte_exact() {
        let DirectReader {
            pool,
            layout,
            span,
            mut prefill,
            reader,
            _handle,
        } = direct_reader(2, 6).await;
        let lease = pool.allocator().lease(6).unwrap();
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let r = room(9);
        cmd_tx
            .send(ReaderCmd::Register {
                room: r,
                pages: vec![1, 2, 4],
                aux_slot: 3,
                guard: lease.writer_guard(),
            })
            .unwrap();
        let task = tokio::spawn(reader.run(cmd_rx, |_| true));
        // Pages 4, 1 and 2 (the last two as one segment) in both layers.
        let fill = |layer: usize, page: usize, i: usize| (layer * 31 + page * 7 + i) as u8;
        let mut wire = Vec::new();
        for layer in 0..2u32 {
            for (dst_page, n_pages) in [(4u32, 1u32), (1, 2)] {
                let h = SegmentHeader {
                    room: r,
                    layer,
                    dst_page,
                    n_pages,
                    heads: None,
                };
                wire.extend_from_slice(&Record::Segment(h).encode());
                for p in dst_page..dst_page + n_pages {
                    wire.extend((0..span).map(|i| fill(layer as usize, p as usize, i)));
                }
            }
        }
        wire.extend_from_slice(
            &Record::End {
                room: r,
                cancelled: false,
            }
            .encode(),
        );
        let cuts = [
            RECORD_LEN / 2,                             // mid-header
            RECORD_LEN,                                 // the header's end
            RECORD_LEN + span,                          // the payload's last byte
            2 * RECORD_LEN + span + 100,                // a header and part of its payload
            2 * RECORD_LEN + 3 * span + RECORD_LEN / 2, // a tail and half a header
        ];
        let mut at = 0;
        for cut in cuts.into_iter().chain([wire.len()]) {
            prefill.write_all(&wire[at..cut]).await.unwrap();
            at = cut;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut ack = [0u8; ACK_LEN];
        tokio::time::timeout(Duration::from_secs(5), prefill.read_exact(&mut ack))
            .await
            .expect("no ack")
            .unwrap();
        assert_eq!(Ack::decode(&ack).unwrap(), Ack { room: r, ok: true });
        let region = pool.shared_region().unwrap();
        for layer in 0..2 {
            for page in [1, 2, 4] {
                let mut got = vec![0u8; span];
                region
                    .read_at(span_offset(&layout, 6, layer, page), &mut got)
                    .unwrap();
                let want: Vec<u8> = (0..span).map(|i| fill(layer, page, i)).collect();
                assert!(got == want, "layer {layer} page {page}");
            }
        }
        drop(cmd_tx);
        task.await.unwrap();
        drop(lease);
    }

    /// A room forgotten while its large payload is half read straight into
    /// the pool: the rest of that payload, and later segments for the room,
    /// land nowhere; the guard goes at once; the reader stays in step with
    /// the stream (the next room's segment and end are read and acked).
    #[tokio::test]
    async fn forgetting_a_room_mid_direct_read_lands_nothing_more() {
        let DirectReader {
            pool,
            layout,
            span,
            mut prefill,
            reader,
            _handle,
        } = direct_reader(1, 4).await;
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (gone, kept) = (room(21), room(22));
        let lease = pool.allocator().lease(2).unwrap();
        let (gone_page, kept_page) = (lease.pages()[0].0, lease.pages()[1].0);
        for (r, page) in [(gone, gone_page), (kept, kept_page)] {
            cmd_tx
                .send(ReaderCmd::Register {
                    room: r,
                    pages: vec![page],
                    aux_slot: 0,
                    guard: lease.writer_guard(),
                })
                .unwrap();
        }
        let task = tokio::spawn(reader.run(cmd_rx, |_| true));
        let segment = |r: RoomId, page: u32| {
            Record::Segment(SegmentHeader {
                room: r,
                layer: 0,
                dst_page: page,
                n_pages: 1,
                heads: None,
            })
            .encode()
        };
        let region = pool.shared_region().unwrap().clone();
        let page_bytes = |page: u32| {
            let mut got = vec![0u8; span];
            region
                .read_at(span_offset(&layout, 4, 0, page as usize), &mut got)
                .unwrap();
            got
        };
        // Half of the forgotten room's payload arrives and lands.
        prefill.write_all(&segment(gone, gone_page)).await.unwrap();
        prefill.write_all(&vec![0x11; span / 2]).await.unwrap();
        let t = std::time::Instant::now();
        while page_bytes(gone_page)[span / 2 - 1] != 0x11 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "first half never landed"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Forgotten mid-payload: the rest, and a later segment, are discarded.
        cmd_tx.send(ReaderCmd::Forget { room: gone }).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        prefill
            .write_all(&vec![0x22; span - span / 2])
            .await
            .unwrap();
        prefill.write_all(&segment(gone, gone_page)).await.unwrap();
        prefill.write_all(&vec![0x33; span]).await.unwrap();
        // The other room still gets its page, and its ack.
        prefill.write_all(&segment(kept, kept_page)).await.unwrap();
        prefill.write_all(&vec![0x44; span]).await.unwrap();
        let ack = end_and_ack(&mut prefill, kept).await;
        assert_eq!(
            ack,
            Ack {
                room: kept,
                ok: true
            }
        );
        assert!(page_bytes(kept_page).iter().all(|&b| b == 0x44));
        let gone_now = page_bytes(gone_page);
        assert!(gone_now[..span / 2].iter().all(|&b| b == 0x11));
        assert!(
            gone_now[span / 2..].iter().all(|&b| b == 0),
            "bytes landed after the room was forgotten"
        );
        // Both guards are gone (tcp: forgotten and ended): dropping the
        // lease frees the pages.
        drop(lease);
        assert_eq!(pool.allocator().stats().leased, 0);
        drop(cmd_tx);
        task.await.unwrap();
    }

    fn seg_job(room: RoomId, page: u32, cancel: &Arc<AtomicBool>) -> LinkJob {
        LinkJob::Segments {
            room,
            segs: segs(room, page),
            cancel: cancel.clone(),
        }
    }

    /// A finish job for `room`.
    fn finish_job(room: RoomId, aux: Option<(u32, AuxData)>, cancel: &Arc<AtomicBool>) -> LinkJob {
        LinkJob::Finish {
            room,
            aux,
            prompt: Arc::from([]),
            cancel: cancel.clone(),
        }
    }

    #[tokio::test]
    async fn a_rooms_queued_segments_and_finish_become_one_write() {
        let (a, b) = (room(1), room(2));
        let live = Arc::new(AtomicBool::new(false));
        let calls = run_jobs(
            vec![
                seg_job(a, 3, &live),
                seg_job(a, 5, &live),
                finish_job(a, Some((9, AUX)), &live),
                seg_job(b, 4, &live),
                finish_job(b, None, &live),
            ],
            false,
        )
        .await;
        assert_eq!(
            calls,
            vec![
                Call::Segments {
                    pages: vec![3, 5],
                    trailer: vec![
                        Record::Aux {
                            room: a,
                            aux_slot: 9,
                            written_room: 1,
                            aux: AUX
                        },
                        Record::End {
                            room: a,
                            cancelled: false
                        }
                    ],
                },
                Call::Segments {
                    pages: vec![4],
                    trailer: vec![Record::End {
                        room: b,
                        cancelled: false
                    }],
                },
            ]
        );
    }

    #[tokio::test]
    async fn a_cancelled_room_writes_no_segments_and_no_aux_but_still_ends() {
        let a = room(1);
        let cancelled = Arc::new(AtomicBool::new(true));
        let calls = run_jobs(
            vec![
                seg_job(a, 3, &cancelled),
                finish_job(a, Some((9, AUX)), &cancelled),
            ],
            false,
        )
        .await;
        assert_eq!(
            calls,
            vec![Call::Records(vec![Record::End {
                room: a,
                cancelled: true
            }])]
        );
    }

    #[tokio::test]
    async fn a_room_cancelled_mid_write_gets_a_cancelled_end_and_no_aux() {
        let a = room(1);
        let live = Arc::new(AtomicBool::new(false));
        let calls = run_jobs(
            vec![seg_job(a, 3, &live), finish_job(a, Some((9, AUX)), &live)],
            true,
        )
        .await;
        assert_eq!(
            calls,
            vec![Call::Records(vec![Record::End {
                room: a,
                cancelled: true
            }])]
        );
    }
}
