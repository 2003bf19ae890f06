//! The link's writer and reader against real sockets.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_kv::KvLayout;
use handoff_proto::datalink::{Ack, AuxData, PullRef, Record, SegmentHeader, ACK_LEN, RECORD_LEN};
use handoff_proto::RoomId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::reader::DIRECT_MIN;
use super::socket::read_once;
use super::source::SHM_REPLY_LEN;
use super::writer::{read_acks, run_writer};
use super::*;
use crate::error::TransportError;
use crate::plan::LinkPlan;
use crate::segment::Segment;
use crate::transport::{Transport, TransportKind};

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
    pulls_land_only_checked_unchanged_pages_of_their_room(TransportKind::Shm).await
}

/// The same over NIXL: the bytes are READ, then each room's source pages'
/// stamps at its end (in-process, the prefill's agent is our own).
#[cfg(feature = "nixl")]
#[tokio::test]
async fn nixl_pulls_land_only_checked_unchanged_pages_of_their_room() {
    pulls_land_only_checked_unchanged_pages_of_their_room(TransportKind::Nixl).await
}

async fn pulls_land_only_checked_unchanged_pages_of_their_room(kind: TransportKind) {
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
    let source = match kind {
        TransportKind::Shm => PullSource::Mapped(source),
        #[cfg(feature = "nixl")]
        TransportKind::Nixl => {
            let gens = prefill_pool.generations().unwrap().clone();
            let offer =
                super::setup::offer_nixl(prefill_pool.shared_region().unwrap(), gens).unwrap();
            let reply = offer.reply();
            let (h, rest) = reply.split_at(handoff_proto::datalink::NixlSetupHead::LEN);
            let head =
                handoff_proto::datalink::NixlSetupHead::decode(h.try_into().unwrap()).unwrap();
            let (name, md) = rest.split_at(usize::from(head.name_len));
            let src = crate::nixl::NixlSource::open(
                &head,
                std::str::from_utf8(name).unwrap(),
                md,
                decode_pool.shared_region().unwrap(),
            )
            .unwrap();
            // The prefill's registration lives as long as the test.
            std::mem::forget(offer);
            PullSource::Nixl(Arc::new(src))
        }
        other => unreachable!("{other:?} does not pull"),
    };
    let (mut prefill, decode) = tcp_pair().await;
    let plan = LinkPlan {
        pair: handoff_proto::rank::PairPlan::Whole,
        decode_heads: 1,
    };
    let counters: Arc<LinkCounters> = Default::default();
    let reader = LinkReader::new(
        decode,
        kind,
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
