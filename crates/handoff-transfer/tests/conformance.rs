//! The transport conformance suite (issue 3): the same test
//! bodies run once per transport (`shm`, `tcp`), with real sockets on
//! 127.0.0.1, real shared memory and, for "killed" and "frozen", a real
//! child process. After every test: zero live rooms, zero leased pages, no
//! task left running.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_kv::{KvPool, PageIndex};
use handoff_proto::connection::{Connection, ConnectionEvent};
use handoff_proto::handshake::HandshakeConfig;
use handoff_proto::message::{Abort, Destination, Message};
use handoff_proto::{
    AbortOrigin, AuxSlot, FailureKind, HandshakeError, Misbehavior, PeerId, RankId, RoomId,
    TransferError,
};
use handoff_transfer::testing::{self, sources};
use handoff_transfer::{
    AuxData, KvReceiver, KvSender, ReceiverRoom, SenderRoom, TransportError, TransportKind,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod shm {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(handoff_transfer::TransportKind::Shm).await }) *
        }
        mod tcp {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(handoff_transfer::TransportKind::Tcp).await }) *
        }
        /// NIXL (UCX over tcp on loopback; `--features nixl`).
        #[cfg(feature = "nixl")]
        mod nixl {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(handoff_transfer::TransportKind::Nixl).await }) *
        }
        /// TCP links of three streams (rooms spread over them by id).
        mod tcp_streams {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                handoff_transfer::testing::with_tcp_streams(
                    3,
                    super::$name(handoff_transfer::TransportKind::Tcp),
                )
                .await
            }) *
        }
    };
}

conformance!(
    success_with_scattered_pages_is_byte_exact,
    decode_abort_in_each_state_releases_prefill_room_fast,
    prefill_rejection_reaches_decode_with_reason_and_status,
    abort_for_unknown_room_is_acked_and_creates_nothing,
    late_success_after_failure_stays_failed,
    duplicate_room_is_rejected,
    bad_frames_are_counted_and_dropped,
    version_and_fingerprint_mismatch_fail_at_handshake,
    bad_secret_is_refused,
    out_of_range_destination_page_is_rejected_and_nothing_written,
    decode_rejects_segments_outside_the_room_and_writes_nothing,
    malformed_frames_and_records_from_a_prefill_harm_nothing_else,
    killed_decode_fails_prefill_room_in_each_state,
    killed_prefill_fails_decode_room_in_each_state,
    pages_are_not_reused_while_a_frozen_writer_may_write,
    frozen_peers_are_declared_dead_by_heartbeat,
    peers_of_the_same_tp_rank_do_not_collide,
    a_cancelled_connect_leaves_no_peer_or_link_behind,
    fan_in_two_prefill_ranks_fill_one_decode_rank,
    fan_out_one_prefill_rank_feeds_two_decode_ranks,
    decode_rejects_head_slices_it_does_not_hold_and_writes_nothing_else,
    room_handles_own_their_rooms,
    a_decode_speaking_the_previous_version_completes_a_room,
);

fn room(n: u64) -> RoomId {
    RoomId::new(n).unwrap()
}

struct Pair {
    tx: KvSender,
    rx: KvReceiver,
    p_pool: KvPool,
    d_pool: KvPool,
    rank: PeerId,
}

/// Fill the prefill pool with a pattern unique per byte position.
fn fill(pool: &KvPool) {
    let region = pool.shared_region().unwrap();
    let bytes: Vec<u8> = (0..pool.layout().pool_bytes())
        .map(|i| (i * 7 + i / 251) as u8 | 1)
        .collect();
    region.write_at(0, &bytes).unwrap();
}

async fn pair(kind: TransportKind) -> Pair {
    pair_with(testing::receiver_config(kind)).await
}

/// A connected pair whose decode endpoint runs `rcfg`.
async fn pair_with(rcfg: handoff_transfer::ReceiverConfig) -> Pair {
    let (p_pool, _) = testing::pool();
    let (d_pool, _) = testing::pool();
    fill(&p_pool);
    let tx = KvSender::start(
        testing::sender_config(),
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    let rx = KvReceiver::start(
        rcfg,
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let rank = rx.connect(tx.local_addr()).await.unwrap();
    Pair {
        tx,
        rx,
        p_pool,
        d_pool,
        rank,
    }
}

async fn eventually<F, Fut>(what: &str, within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < end, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Nothing left behind: rooms, leases, tasks.
async fn teardown(p: Pair) {
    let Pair {
        tx,
        rx,
        d_pool,
        p_pool,
        ..
    } = p;
    eventually("no live rooms", Duration::from_secs(3), || async {
        tx.stats().await.unwrap().live_rooms == 0 && rx.stats().await.unwrap().live_rooms == 0
    })
    .await;
    eventually("no leased pages", Duration::from_secs(3), || async {
        d_pool.allocator().stats().leased == 0
    })
    .await;
    tx.shutdown();
    rx.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        tx.live_tasks() == 0 && rx.live_tasks() == 0
    })
    .await;
    drop(p_pool);
}

/// The prefill room's end, within `within` (a room still pending then
/// fails the test).
async fn sender_outcome(sr: &mut SenderRoom, within: Duration) -> Result<(), TransferError> {
    let r = sr.room().get();
    tokio::time::timeout(within, sr.outcome())
        .await
        .unwrap_or_else(|_| panic!("prefill room {r} still pending after {within:?}"))
}

/// The decode room's end, within `within` (a room still pending then fails
/// the test).
async fn receiver_outcome(
    dr: &mut ReceiverRoom,
    within: Duration,
) -> Result<(handoff_kv::PageLease, AuxData), TransferError> {
    let r = dr.room().get();
    tokio::time::timeout(within, dr.landed())
        .await
        .unwrap_or_else(|_| panic!("decode room {r} still pending after {within:?}"))
}

/// Whether the decode room is still pending (no end) for `d` from now.
/// Leaves the room as it is.
async fn receiver_pending(dr: &mut ReceiverRoom, d: Duration) -> bool {
    tokio::time::timeout(d, dr.landed()).await.is_err()
}

/// Wait (5 s at most) until every decode destination of the prefill room
/// arrived: compute may start.
async fn ready(sr: &mut SenderRoom) {
    let r = sr.room().get();
    match tokio::time::timeout(Duration::from_secs(5), sr.ready()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("prefill room {r} ended before its compute: {e}"),
        Err(_) => panic!("prefill room {r} still waits for its destinations"),
    }
}

/// Submit `r` on both sides and reserve `n` decode pages; prefill waits for
/// compute. Returns both handles and the decode pages.
async fn open_both(p: &Pair, r: RoomId, n: usize) -> (SenderRoom, ReceiverRoom, Vec<PageIndex>) {
    let mut sr = p.tx.submit(r).await.unwrap();
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    let lease = p.d_pool.allocator().lease(n).unwrap();
    let pages = lease.pages().to_vec();
    dr.reserve(lease, AuxSlot(5), 0).await.unwrap();
    ready(&mut sr).await;
    (sr, dr, pages)
}

fn span_bytes(pool: &KvPool, layer: usize, page: PageIndex) -> Vec<u8> {
    let l = pool.layout();
    let k = l.block_bytes(layer, page, handoff_kv::KvPart::K).unwrap();
    let v = l.block_bytes(layer, page, handoff_kv::KvPart::V).unwrap();
    assert_eq!(k.end, v.start);
    let mut out = vec![0u8; v.end - k.start];
    pool.shared_region()
        .unwrap()
        .read_at(k.start, &mut out)
        .unwrap();
    out
}

/// Finish the room with `aux` on prefill, wait until both sides report
/// success, and return what decode committed.
async fn finish_and_commit(
    sr: &mut SenderRoom,
    dr: &mut ReceiverRoom,
    aux: AuxData,
) -> (handoff_kv::PageLease, AuxData) {
    sr.finish(aux).await.unwrap();
    assert_eq!(sender_outcome(sr, Duration::from_secs(3)).await, Ok(()));
    let Ok((lease, aux)) = receiver_outcome(dr, Duration::from_secs(3)).await else {
        panic!("decode did not commit room {}", dr.room().get())
    };
    (lease, aux)
}

/// Layers `0..layers` of every source page landed on its destination page.
fn assert_moved(p: &Pair, layers: usize, src: &[PageIndex], dst: &[PageIndex]) {
    for layer in 0..layers {
        for (s, d) in src.iter().zip(dst) {
            assert_eq!(
                span_bytes(&p.p_pool, layer, *s),
                span_bytes(&p.d_pool, layer, *d),
                "layer {layer} page {s:?} -> {d:?}"
            );
        }
    }
}

/// Version window (issue 14 item 9): a decode that speaks only protocol 1
/// with protocol 1's capabilities (the kept encoder: this build configured
/// as N-1) connects to the current prefill, which settles on version 1 and
/// no optional field, and a room completes byte for byte. A peer outside
/// the window is refused naming both ranges
/// (`version_and_fingerprint_mismatch_fail_at_handshake`).
async fn a_decode_speaking_the_previous_version_completes_a_room(kind: TransportKind) {
    let mut cfg = testing::receiver_config(kind);
    cfg.handshake.max_version = handoff_proto::frame::PROTOCOL_VERSION - 1;
    cfg.handshake.capabilities = handoff_proto::handshake::Capabilities::V1;
    let p = pair_with(cfg).await;
    let r = room(12);
    let (mut sr, mut dr, dst) = open_both(&p, r, 3).await;
    let src: Arc<[PageIndex]> = [9, 4, 30]
        .into_iter()
        .map(PageIndex)
        .collect::<Vec<_>>()
        .into();
    sr.send(0..2, 0..3, src.clone()).await.unwrap();
    let aux = AuxData {
        first_token: 99,
        logprob: -1.5,
        top: handoff_proto::datalink::TopLogprobs::NONE,
    };
    let (lease, got) = finish_and_commit(&mut sr, &mut dr, aux).await;
    assert_eq!((lease.pages(), got.first_token), (&dst[..], 99));
    assert_moved(&p, 2, &src, &dst);
    drop(lease);
    teardown(p).await;
}

async fn success_with_scattered_pages_is_byte_exact(kind: TransportKind) {
    let p = pair(kind).await;
    // Scatter decode pages: lease, lease, give the first back.
    let hole = p.d_pool.allocator().lease(5).unwrap();
    let _keep = p.d_pool.allocator().lease(3).unwrap();
    drop(hole);
    let r = room(11);
    let (mut sr, mut dr, dst) = open_both(&p, r, 9).await;
    drop(_keep);
    let src: Vec<PageIndex> = [40, 41, 42, 7, 3, 20, 21, 60, 12]
        .into_iter()
        .map(PageIndex)
        .collect();
    let src: Arc<[PageIndex]> = src.into();
    // Layer by layer, the second layer in two page ranges.
    sr.send(0..1, 0..9, src.clone()).await.unwrap();
    sr.send(1..2, 0..4, src.clone()).await.unwrap();
    sr.send(1..2, 4..9, src.clone()).await.unwrap();
    // With the first position's alternatives (an odd count: the last
    // record holds one pair).
    let top: Vec<(u32, f32)> = (0..5).map(|i| (4242 + i, -0.25 - i as f32)).collect();
    let sent = AuxData {
        first_token: 4242,
        logprob: -0.25,
        top: handoff_proto::datalink::TopLogprobs::from_slice(&top),
    };
    let (lease, aux) = finish_and_commit(&mut sr, &mut dr, sent).await;
    assert_eq!(lease.pages(), &dst[..]);
    assert_eq!(
        aux, sent,
        "first token, logprob and alternatives arrive whole"
    );
    assert_eq!(aux.top.as_slice(), top.as_slice());
    assert_eq!(aux.logprob, -0.25);
    assert_moved(&p, 2, &src, &dst);
    // Pages outside the room are untouched.
    let untouched = (0..testing::TEST_PAGES as u32)
        .map(PageIndex)
        .filter(|p| !dst.contains(p));
    for page in untouched {
        assert!(span_bytes(&p.d_pool, 0, page).iter().all(|b| *b == 0));
    }
    drop(lease);
    teardown(p).await;
}

/// The room handles ([`handoff_transfer::SenderRoom`],
/// [`handoff_transfer::ReceiverRoom`]): a room driven through them lands
/// byte-exact; dropping either handle before the end fails the room on both
/// sides with the dropping side's reason (no timeout); a prefill refusal of
/// a room it never took reaches decode with its status, and a refusal of a
/// room it already owns changes nothing.
async fn room_handles_own_their_rooms(kind: TransportKind) {
    let p = pair(kind).await;
    let within = Duration::from_secs(5);
    let aux = AuxData {
        first_token: 7,
        logprob: -0.5,
        top: handoff_proto::datalink::TopLogprobs::NONE,
    };
    // 1. The whole room through the handles.
    let r = room(21);
    let mut sr = p.tx.submit(r).await.unwrap();
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    let lease = p.d_pool.allocator().lease(3).unwrap();
    let dst = lease.pages().to_vec();
    dr.reserve(lease, AuxSlot(1), 0).await.unwrap();
    let src = pages(&[9, 4, 30]);
    let (lease, got) = complete(&mut sr, &mut dr, src.clone(), aux).await;
    assert_eq!((lease.pages(), got.first_token), (&dst[..], 7));
    for layer in 0..2 {
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(
                span_bytes(&p.p_pool, layer, *s),
                span_bytes(&p.d_pool, layer, *d)
            );
        }
    }
    drop((lease, sr, dr));

    // 2. Decode's handle dropped after its destination went: prefill's room
    // ends as the client's abort, and decode's pages come back.
    let r = room(22);
    let mut sr = p.tx.submit(r).await.unwrap();
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    dr.reserve(p.d_pool.allocator().lease(2).unwrap(), AuxSlot(2), 0)
        .await
        .unwrap();
    tokio::time::timeout(within, sr.ready())
        .await
        .unwrap()
        .unwrap();
    drop(dr);
    let e = tokio::time::timeout(within, sr.outcome())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!((e.error_type(), e.http_status()), ("aborted", 499), "{e}");
    eventually("decode pages back", within, || async {
        p.d_pool.allocator().stats().leased == 0
    })
    .await;
    drop(sr);

    // 3. Prefill's handle dropped before compute: decode's room fails with
    // the prefill's reason and status at once.
    let r = room(23);
    let sr = p.tx.submit(r).await.unwrap();
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    dr.reserve(p.d_pool.allocator().lease(2).unwrap(), AuxSlot(3), 0)
        .await
        .unwrap();
    drop(sr);
    let e = tokio::time::timeout(within, dr.landed())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.http_status(), 503, "{e}");
    assert!(
        e.reason()
            .contains("the prefill worker stopped the request"),
        "{e}"
    );

    // 4. A refusal of a room prefill never took reaches decode as a 400;
    // a refusal of a room it owns changes nothing.
    let r = room(24);
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    dr.reserve(p.d_pool.allocator().lease(2).unwrap(), AuxSlot(4), 0)
        .await
        .unwrap();
    let rejected = TransferError::Rejected {
        http_status: 400,
        reason: "prompt too long".into(),
        code: None,
    };
    p.tx.refuse(r, rejected.clone());
    let e = tokio::time::timeout(within, dr.landed())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (e.error_type(), e.http_status(), e.reason()),
        ("rejected", 400, "prompt too long".to_string())
    );
    let r = room(25);
    let mut sr = p.tx.submit(r).await.unwrap();
    p.tx.refuse(r, rejected);
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    dr.reserve(p.d_pool.allocator().lease(1).unwrap(), AuxSlot(5), 0)
        .await
        .unwrap();
    let (lease, _) = complete(&mut sr, &mut dr, pages(&[3]), aux).await;
    drop((lease, sr, dr));
    teardown(p).await;
}

/// Drive a room whose destination was reserved to its end through both
/// handles: ready, every page of `src` in layers 0..2, finish; both ends
/// must succeed. Returns decode's lease and aux.
async fn complete(
    sr: &mut handoff_transfer::SenderRoom,
    dr: &mut handoff_transfer::ReceiverRoom,
    src: Arc<[PageIndex]>,
    aux: AuxData,
) -> (handoff_kv::PageLease, AuxData) {
    let within = Duration::from_secs(5);
    tokio::time::timeout(within, sr.ready())
        .await
        .unwrap()
        .unwrap();
    sr.send(0..2, 0..src.len(), src).await.unwrap();
    sr.finish(aux).await.unwrap();
    assert_eq!(
        tokio::time::timeout(within, sr.outcome()).await.unwrap(),
        Ok(())
    );
    tokio::time::timeout(within, dr.landed())
        .await
        .unwrap()
        .unwrap()
}

fn client_abort() -> TransferError {
    TransferError::Aborted {
        origin: AbortOrigin::Client,
        reason: "client went away".into(),
        http_status: 499,
    }
}

/// A TCP link of several streams: concurrent rooms are spread over the
/// streams by id, and each lands byte-exact with its own aux record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_rooms_over_a_link_of_several_tcp_streams_are_byte_exact() {
    let p = testing::with_tcp_streams(4, pair(TransportKind::Tcp)).await;
    let (ts, rs) = (p.tx.stats().await.unwrap(), p.rx.stats().await.unwrap());
    assert_eq!(
        (ts.links, ts.link_streams),
        (1, 4),
        "prefill: one link of 4 streams"
    );
    assert_eq!(
        (rs.links, rs.link_streams),
        (1, 4),
        "decode: one link of 4 streams"
    );
    // Rooms 21..=28: two per stream.
    let mut rooms = Vec::new();
    for (i, n) in (21..=28).enumerate() {
        let r = room(n);
        let (sr, dr, dst) = open_both(&p, r, 3).await;
        let src: Arc<[PageIndex]> = (0..3u32)
            .map(|k| PageIndex(60 - 3 * i as u32 - k))
            .collect();
        rooms.push((r, sr, dr, src, dst));
    }
    // Every room's writes and end are queued before any completes.
    for (r, sr, _, src, _) in &rooms {
        sr.send(0..2, 0..3, src.clone()).await.unwrap();
        sr.finish(AuxData {
            first_token: r.get() as u32,
            logprob: -1.0,
            top: handoff_proto::datalink::TopLogprobs::NONE,
        })
        .await
        .unwrap();
    }
    for (r, sr, dr, src, dst) in &mut rooms {
        assert_eq!(sender_outcome(sr, Duration::from_secs(3)).await, Ok(()));
        let Ok((lease, aux)) = receiver_outcome(dr, Duration::from_secs(3)).await else {
            panic!("decode did not commit room {}", r.get())
        };
        assert_eq!(aux.first_token, r.get() as u32);
        for layer in 0..2 {
            for (s, d) in src.iter().zip(dst.iter()) {
                assert_eq!(
                    span_bytes(&p.p_pool, layer, *s),
                    span_bytes(&p.d_pool, layer, *d),
                    "room {} layer {layer} page {s:?} -> {d:?}",
                    r.get()
                );
            }
        }
        drop(lease);
    }
    drop(rooms);
    teardown(p).await;
}

/// A send naming layers or pages outside the room or the prefill pool
/// (inverted ranges included) is refused with a reason, writes nothing, and
/// the room carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_send_ranges_are_refused_and_the_room_carries_on() {
    let p = pair(TransportKind::Tcp).await;
    let r = room(31);
    let (mut sr, mut dr, dst) = open_both(&p, r, 3).await;
    let src: Arc<[PageIndex]> = [PageIndex(9), PageIndex(10), PageIndex(11)].into();
    let outside: Arc<[PageIndex]> = [PageIndex(9), PageIndex(10_000), PageIndex(11)].into();
    #[allow(clippy::reversed_empty_ranges)]
    let bad = [
        (0..99, 0..3, src.clone()),
        (1..0, 0..3, src.clone()),
        (0..1, 2..1, src.clone()),
        (0..1, 0..4, src.clone()),
        (0..1, 1..2, outside.clone()),
    ];
    for (layers, pages, s) in bad {
        let e = sr.send(layers.clone(), pages.clone(), s).await.unwrap_err();
        assert!(
            e.to_string()
                .contains("outside the room or the prefill pool"),
            "{layers:?} {pages:?}: {e}"
        );
    }
    // The pages that are in range still go.
    sr.send(0..2, 0..1, outside.clone()).await.unwrap();
    sr.send(0..2, 1..3, src.clone()).await.unwrap();
    sr.finish(AuxData {
        first_token: 1,
        logprob: 0.0,
        top: handoff_proto::datalink::TopLogprobs::NONE,
    })
    .await
    .unwrap();
    assert_eq!(
        sender_outcome(&mut sr, Duration::from_secs(3)).await,
        Ok(())
    );
    let Ok((lease, _)) = receiver_outcome(&mut dr, Duration::from_secs(3)).await else {
        panic!("decode did not commit")
    };
    for layer in 0..2 {
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(
                span_bytes(&p.p_pool, layer, *s),
                span_bytes(&p.d_pool, layer, *d)
            );
        }
    }
    drop(lease);
    teardown(p).await;
}

async fn decode_abort_in_each_state_releases_prefill_room_fast(kind: TransportKind) {
    let p = pair(kind).await;
    for (i, state) in ["bootstrapping", "waiting", "transferring"]
        .iter()
        .enumerate()
    {
        let r = room(100 + i as u64);
        let mut sr = p.tx.submit(r).await.unwrap();
        let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
        if *state != "bootstrapping" {
            let lease = p.d_pool.allocator().lease(4).unwrap();
            dr.reserve(lease, AuxSlot(1), 0).await.unwrap();
            ready(&mut sr).await;
        }
        if *state == "transferring" {
            // The first send moves the room to Transferring (not visible
            // through the handle).
            let src: Arc<[PageIndex]> = (0..4).map(PageIndex).collect::<Vec<_>>().into();
            sr.send(0..1, 0..4, src).await.unwrap();
        }
        let t0 = Instant::now();
        dr.abort(client_abort());
        let out = sender_outcome(&mut sr, Duration::from_secs(3)).await;
        let took = t0.elapsed();
        let Err(TransferError::Aborted {
            reason,
            http_status,
            ..
        }) = out
        else {
            panic!("{state}: prefill outcome {out:?}")
        };
        assert_eq!(
            (reason.as_str(), http_status),
            ("client went away", 499),
            "{state}"
        );
        // By the abort message, not a timer: the test timers are 1 s (the
        // fence) and more, the abort takes a few ms; 600 ms tells them apart
        // with room for a loaded 2-core box.
        assert!(
            took < Duration::from_millis(600),
            "{state}: prefill released after {took:?}"
        );
        let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(1)).await else {
            panic!("decode not failed")
        };
        assert_eq!(e.http_status(), 499);
        // Pages come back on the writer's word, well before the 1 s fence.
        eventually(state, Duration::from_millis(300), || async {
            p.d_pool.allocator().stats().leased == 0
        })
        .await;
    }
    teardown(p).await;
}

async fn prefill_rejection_reaches_decode_with_reason_and_status(kind: TransportKind) {
    let p = pair(kind).await;
    // Rejected before decode's destination arrived, and after.
    for (i, early) in [true, false].into_iter().enumerate() {
        let r = room(200 + i as u64);
        let mut sr = p.tx.submit(r).await.unwrap();
        let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
        let reject = TransferError::Rejected {
            http_status: 400,
            reason: "prompt of 9000 tokens exceeds the context of 8192".into(),
            code: None,
        };
        if early {
            sr.fail(reject.clone());
            let lease = p.d_pool.allocator().lease(2).unwrap();
            dr.reserve(lease, AuxSlot(0), 0).await.unwrap();
        } else {
            let lease = p.d_pool.allocator().lease(2).unwrap();
            dr.reserve(lease, AuxSlot(0), 0).await.unwrap();
            ready(&mut sr).await;
            sr.fail(reject.clone());
        }
        let t0 = Instant::now();
        let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(2)).await else {
            panic!("decode did not fail")
        };
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "not at a timeout"
        );
        assert_eq!(e.http_status(), 400);
        assert_eq!(e.error_type(), "rejected");
        assert_eq!(
            e.reason(),
            "prompt of 9000 tokens exceeds the context of 8192"
        );
        assert_eq!(e.kind(), FailureKind::Rejected);
        assert_eq!(
            sender_outcome(&mut sr, Duration::from_secs(1)).await,
            Err(reject)
        );
    }
    teardown(p).await;
}

/// A hand-driven decode control connection speaking the protocol directly.
struct RawDecode {
    s: TcpStream,
    conn: Connection,
    endpoint: u64,
}

/// The connect number of a raw decode's control connection and data link.
const RAW_CONNECT: u64 = 1;

fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0xdec0_de00);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl RawDecode {
    async fn connect(
        addr: std::net::SocketAddr,
        cfg: HandshakeConfig,
    ) -> Result<RawDecode, HandshakeError> {
        Self::connect_as(addr, cfg, rand_id(), RAW_CONNECT).await
    }

    /// A control connection of decode endpoint `endpoint`, for its connect
    /// number `connect`.
    async fn connect_as(
        addr: std::net::SocketAddr,
        cfg: HandshakeConfig,
        endpoint: u64,
        connect: u64,
    ) -> Result<RawDecode, HandshakeError> {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Preface: control, this raw endpoint's id, its connect number.
        let preface = handoff_proto::datalink::encode_preface(
            handoff_proto::datalink::PREFACE_CONTROL,
            endpoint,
            connect,
        );
        s.write_all(&preface).await.unwrap();
        let mut raw = Self::handshake(s, cfg).await?;
        raw.endpoint = endpoint;
        Ok(raw)
    }

    /// Handshake on an open socket (either role).
    async fn handshake(
        mut s: TcpStream,
        cfg: HandshakeConfig,
    ) -> Result<RawDecode, HandshakeError> {
        let mut conn = Connection::new(
            cfg,
            [9; 32],
            Duration::from_secs(2),
            std::time::Instant::now(),
        );
        let mut buf = vec![0u8; 4096];
        loop {
            let out = conn.take_output();
            s.write_all(&out).await.unwrap();
            if conn.negotiated().is_some() {
                return Ok(RawDecode {
                    s,
                    conn,
                    endpoint: 0,
                });
            }
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
                .await
                .expect("handshake stalled")
                .unwrap();
            if n == 0 {
                return Err(HandshakeError::AuthFailed);
            }
            conn.handle_bytes(&buf[..n], std::time::Instant::now());
            while let Some(ev) = conn.poll_event() {
                if let ConnectionEvent::Failed(e) = ev {
                    return Err(e);
                }
            }
        }
    }

    async fn send(&mut self, m: Message) {
        self.conn.send(&m).unwrap();
        let out = self.conn.take_output();
        self.s.write_all(&out).await.unwrap();
    }

    async fn raw(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    /// Next non-heartbeat message within `within`.
    async fn recv(&mut self, within: Duration) -> Option<Message> {
        let end = tokio::time::Instant::now() + within;
        let mut buf = vec![0u8; 4096];
        loop {
            while let Some(ev) = self.conn.poll_event() {
                match ev {
                    ConnectionEvent::Message(Message::Heartbeat(_)) => {}
                    ConnectionEvent::Message(m) => return Some(m),
                    _ => {}
                }
            }
            let n = tokio::time::timeout_at(end, self.s.read(&mut buf))
                .await
                .ok()?
                .ok()?;
            if n == 0 {
                return None;
            }
            self.conn.handle_bytes(&buf[..n], std::time::Instant::now());
        }
    }
}

/// A second decode rank (rank 1 of 2), so the raw peer never replaces the
/// real decode's connection.
fn decode_handshake() -> HandshakeConfig {
    let mut h = testing::receiver_config(TransportKind::Tcp).handshake;
    h.fingerprint.tp_rank = 1;
    h.fingerprint.tp_size = 2;
    h
}

fn abort_msg(r: RoomId) -> Message {
    Message::Abort(Abort {
        room: r,
        reason: "gone".into(),
        http_status: Some(499),
        origin: Some(AbortOrigin::Client),
    })
}

async fn abort_for_unknown_room_is_acked_and_creates_nothing(kind: TransportKind) {
    let p = pair(kind).await;
    let mut raw = RawDecode::connect(p.tx.local_addr(), decode_handshake())
        .await
        .unwrap();
    let r = room(300);
    raw.send(abort_msg(r)).await;
    match raw.recv(Duration::from_secs(1)).await {
        Some(Message::AbortAck(a)) => assert_eq!((a.room, a.drained), (r, true)),
        other => panic!("expected AbortAck, got {other:?}"),
    }
    let st = p.tx.stats().await.unwrap();
    assert_eq!(st.live_rooms, 0);
    assert_eq!(st.room_stats.unknown_room_events, 1, "{st:?}");
    // Decode side: aborting a room decode does not hold (a handle whose
    // room already ended there, its end not yet taken) is a no-op: nothing
    // is created and the room's end stays what it was.
    let r = room(301);
    p.tx.refuse(
        r,
        TransferError::Rejected {
            http_status: 400,
            reason: "prompt too long".into(),
            code: None,
        },
    );
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    dr.reserve(p.d_pool.allocator().lease(1).unwrap(), AuxSlot(1), 0)
        .await
        .unwrap();
    eventually("decode room ended", Duration::from_secs(3), || async {
        p.rx.stats().await.unwrap().live_rooms == 0
    })
    .await;
    let before = p.rx.stats().await.unwrap().room_stats.unknown_room_events;
    dr.abort(client_abort());
    let st = p.rx.stats().await.unwrap();
    assert_eq!(st.live_rooms, 0);
    assert_eq!(st.room_stats.unknown_room_events, before + 1, "{st:?}");
    let e = receiver_outcome(&mut dr, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.http_status(), e.reason()),
        (400, "prompt too long".to_string())
    );
    drop(raw);
    teardown(p).await;
}

async fn late_success_after_failure_stays_failed(kind: TransportKind) {
    let p = pair(kind).await;
    let r = room(400);
    let (mut sr, mut dr, _) = open_both(&p, r, 3).await;
    // Prefill fails the room, then its engine (not yet told) sends and finishes.
    sr.fail(TransferError::Internal {
        reason: "engine error".into(),
    });
    let src: Arc<[PageIndex]> = (0..3).map(PageIndex).collect::<Vec<_>>().into();
    assert!(sr.send(0..2, 0..3, src).await.is_err());
    assert!(sr
        .finish(AuxData {
            first_token: 1,
            logprob: 0.0,
            top: handoff_proto::datalink::TopLogprobs::NONE,
        })
        .await
        .is_err());
    let out = sender_outcome(&mut sr, Duration::from_secs(1)).await;
    assert!(out.is_err(), "{out:?}");
    // Decode: a room that failed is not resurrected by aborting it (once its
    // failure reached decode, before its end is taken): nothing is live and
    // its end is still the prefill's failure.
    eventually("decode room failed", Duration::from_secs(3), || async {
        p.rx.stats().await.unwrap().live_rooms == 0
    })
    .await;
    dr.abort(client_abort());
    assert_eq!(p.rx.stats().await.unwrap().live_rooms, 0);
    let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(1)).await else {
        panic!("decode did not fail")
    };
    assert_eq!(e.reason(), "engine error");
    teardown(p).await;
}

async fn duplicate_room_is_rejected(kind: TransportKind) {
    let p = pair(kind).await;
    let r = room(500);
    let mut sr = p.tx.submit(r).await.unwrap();
    let e = p.tx.submit(r).await.unwrap_err();
    assert_eq!(e.error_type(), "duplicate_room");
    assert_eq!(e.http_status(), 409);
    let mut dr = p.rx.submit(r, sources(p.rank)).await.unwrap();
    assert_eq!(
        p.rx.submit(r, sources(p.rank))
            .await
            .unwrap_err()
            .error_type(),
        "duplicate_room"
    );
    dr.abort(client_abort());
    let _ = sender_outcome(&mut sr, Duration::from_secs(1)).await;
    let _ = receiver_outcome(&mut dr, Duration::from_secs(1)).await;
    teardown(p).await;
}

async fn bad_frames_are_counted_and_dropped(kind: TransportKind) {
    let p = pair(kind).await;
    // A live room on the real decode connection must be unaffected.
    let live = room(600);
    let (mut sr, mut dr, _) = open_both(&p, live, 2).await;
    let mut raw = RawDecode::connect(p.tx.local_addr(), decode_handshake())
        .await
        .unwrap();
    let mut header = b"HOFF".to_vec();
    header.extend_from_slice(&[2, 4, 0, 0]);
    let mut oversized = header.clone();
    oversized.extend_from_slice(&(64u32 << 20).to_le_bytes());
    let mut unknown_kind = b"HOFF".to_vec();
    unknown_kind.extend_from_slice(&[2, 99, 0, 0, 0, 0, 0, 0]);
    let mut truncated = header.clone();
    truncated.extend_from_slice(&3u32.to_le_bytes());
    truncated.extend_from_slice(&[1, 2, 3]);
    raw.raw(b"GET / HTTP/1.1\r\n\r\n").await; // foreign
    raw.raw(&unknown_kind).await;
    raw.raw(&truncated).await;
    // The connection still carries a well-formed message afterwards.
    let r = room(601);
    raw.send(abort_msg(r)).await;
    match raw.recv(Duration::from_secs(1)).await {
        Some(Message::AbortAck(a)) => assert_eq!(a.room, r),
        other => panic!("expected AbortAck after garbage, got {other:?}"),
    }
    let stats = p.tx.stats().await.unwrap();
    assert!(stats.malformed_frames >= 3, "{stats:?}");
    // An oversized frame (on its own connection: its declared payload is
    // skipped) is counted too; the endpoint carries on.
    let mut raw2 = RawDecode::connect(p.tx.local_addr(), decode_handshake())
        .await
        .unwrap();
    raw2.raw(&oversized).await;
    eventually("oversize counted", Duration::from_secs(1), || async {
        p.tx.stats().await.unwrap().malformed_frames > stats.malformed_frames
    })
    .await;
    drop(raw2);
    // The other room completes.
    let src: Arc<[PageIndex]> = [9, 10]
        .into_iter()
        .map(PageIndex)
        .collect::<Vec<_>>()
        .into();
    sr.send(0..2, 0..2, src).await.unwrap();
    sr.finish(AuxData {
        first_token: 1,
        logprob: 0.0,
        top: handoff_proto::datalink::TopLogprobs::NONE,
    })
    .await
    .unwrap();
    assert_eq!(
        sender_outcome(&mut sr, Duration::from_secs(2)).await,
        Ok(())
    );
    receiver_outcome(&mut dr, Duration::from_secs(2))
        .await
        .expect("decode did not commit");
    drop(raw);
    teardown(p).await;
}

async fn version_and_fingerprint_mismatch_fail_at_handshake(kind: TransportKind) {
    let p = pair(kind).await;
    let (pool, _) = testing::pool();
    let region = pool.shared_region().unwrap().clone();
    let mut cfg = testing::receiver_config(kind);
    cfg.handshake.fingerprint.layers = 30;
    let rx = KvReceiver::start(cfg, region.clone(), *pool.layout());
    let e = rx.connect(p.tx.local_addr()).await.unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            TransportError::Handshake(HandshakeError::Incompatible {
                field: "layers",
                ..
            })
        ),
        "{msg}"
    );
    assert!(
        msg.contains("layers: prefill has 2, decode has 30"),
        "{msg}"
    );
    eventually("no half-connected peer", Duration::from_secs(2), || async {
        rx.stats().await.unwrap().peers == 0
    })
    .await;
    rx.shutdown();
    let mut cfg = testing::receiver_config(kind);
    cfg.handshake.min_version = 9;
    cfg.handshake.max_version = 9;
    let rx2 = KvReceiver::start(cfg, region, *pool.layout());
    let e = rx2.connect(p.tx.local_addr()).await.unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::Handshake(HandshakeError::VersionMismatch { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("protocol version"), "{e}");
    rx2.shutdown();
    eventually("mismatched peers gone", Duration::from_secs(3), || async {
        rx.live_tasks() == 0 && rx2.live_tasks() == 0
    })
    .await;
    assert_eq!(p.tx.stats().await.unwrap().live_rooms, 0);
    teardown(p).await;
}

async fn bad_secret_is_refused(kind: TransportKind) {
    let (p_pool, _) = testing::pool();
    let mut scfg = testing::sender_config();
    scfg.handshake.secret = Some(b"right secret".to_vec());
    let tx = KvSender::start(
        scfg,
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    let (d_pool, _) = testing::pool();
    let mut rcfg = testing::receiver_config(kind);
    rcfg.handshake.secret = Some(b"wrong secret".to_vec());
    let rx = KvReceiver::start(
        rcfg,
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let e = rx.connect(tx.local_addr()).await.unwrap_err();
    assert!(
        matches!(e, TransportError::Handshake(_) | TransportError::Io { .. }),
        "{e}"
    );
    let mut no_secret = testing::receiver_config(kind).handshake;
    no_secret.secret = None;
    assert!(RawDecode::connect(tx.local_addr(), no_secret)
        .await
        .is_err());
    eventually("refusals counted", Duration::from_secs(2), || async {
        tx.stats().await.unwrap().handshakes_failed >= 2
    })
    .await;
    assert_eq!(tx.stats().await.unwrap().peers, 0);
    // The right secret works.
    let mut good = testing::receiver_config(kind);
    good.handshake.secret = Some(b"right secret".to_vec());
    let rx_good = KvReceiver::start(
        good,
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let rank = rx_good.connect(tx.local_addr()).await.unwrap();
    rx.shutdown();
    let p = Pair {
        tx,
        rx: rx_good,
        p_pool,
        d_pool,
        rank,
    };
    teardown(p).await;
}

async fn out_of_range_destination_page_is_rejected_and_nothing_written(kind: TransportKind) {
    let p = pair(kind).await;
    // A decode that lies: its destination names a page outside its pool.
    let mut raw = RawDecode::connect(p.tx.local_addr(), decode_handshake())
        .await
        .unwrap();
    let (_link, _rank) = handoff_transfer::link::connect_link(
        p.tx.local_addr(),
        raw.endpoint,
        RAW_CONNECT,
        decode_handshake(),
        Duration::from_secs(2),
        kind,
        testing::TEST_PAGES,
        p.d_pool.shared_region(),
    )
    .await
    .unwrap();
    let r = room(700);
    let mut sr = p.tx.submit(r).await.unwrap();
    raw.send(Message::Destination(Destination {
        room: r,
        pages: vec![
            handoff_proto::PageIndex(1),
            handoff_proto::PageIndex(1_000_000),
        ],
        aux_slot: AuxSlot(0),
        required_destinations: 1,
        prefix_tokens: None,
    }))
    .await;
    ready(&mut sr).await;
    let src: Arc<[PageIndex]> = [1, 2].into_iter().map(PageIndex).collect::<Vec<_>>().into();
    sr.send(0..2, 0..2, src).await.unwrap();
    let out = sender_outcome(&mut sr, Duration::from_secs(1)).await;
    let Err(TransferError::PeerMisbehaved { what }) = out else {
        panic!("{out:?}")
    };
    assert!(
        matches!(what, Misbehavior::PageOutsidePool { .. }),
        "{what}"
    );
    match raw.recv(Duration::from_secs(1)).await {
        Some(Message::Status(s)) => assert_eq!(s.room, r),
        other => panic!("decode not told: {other:?}"),
    }
    drop(raw);
    drop(_link);
    teardown(p).await;
}

fn peer_bin() -> &'static str {
    env!("CARGO_BIN_EXE_handoff-transfer-peer")
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child's stdout lines, read on a thread.
struct Lines(std::sync::mpsc::Receiver<String>);

impl Lines {
    fn of(child: &mut Child) -> Lines {
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines(rx)
    }

    fn next(&self) -> String {
        self.0
            .recv_timeout(Duration::from_secs(10))
            .expect("child said nothing")
    }
}

async fn killed_decode_fails_prefill_room_in_each_state(kind: TransportKind) {
    let (p_pool, _) = testing::pool();
    let tx = KvSender::start(
        testing::sender_config(),
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    for (i, state) in ["bootstrapping", "waiting", "transferring"]
        .into_iter()
        .enumerate()
    {
        let r = room(77 + i as u64);
        let mut sr = tx.submit(r).await.unwrap();
        let mut child = ChildGuard(
            Command::new(peer_bin())
                .args([
                    "decode",
                    &tx.local_addr().to_string(),
                    kind.name(),
                    state,
                    &r.get().to_string(),
                ])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let lines = Lines::of(&mut child.0);
        assert_eq!(lines.next(), "READY");
        if state != "bootstrapping" {
            ready(&mut sr).await;
        }
        if state == "transferring" {
            let src: Arc<[PageIndex]> = (0..4).map(PageIndex).collect::<Vec<_>>().into();
            sr.send(0..1, 0..4, src).await.unwrap();
        }
        let t0 = Instant::now();
        child.0.kill().unwrap();
        let out = sender_outcome(&mut sr, Duration::from_secs(5)).await;
        let took = t0.elapsed();
        if state == "bootstrapping" {
            // No destination came from the dead decode: the room is nobody's
            // yet, and fails at its (seconds, not minutes) bootstrap deadline.
            let Err(e) = out else {
                panic!("{state}: {out:?}")
            };
            assert_eq!(e.kind(), FailureKind::Timeout, "{state}: {e}");
        } else {
            let Err(e) = out else {
                panic!("{state}: {out:?}")
            };
            assert_eq!(e.kind(), FailureKind::PeerDead, "{state}: {e}");
            assert!(
                took < testing::timers().heartbeat_miss + Duration::from_millis(600),
                "{state}: {took:?}"
            );
        }
        // The room ended: its handle goes without failing anything, and
        // prefill holds nothing of it.
        drop(sr);
        eventually("prefill room gone", Duration::from_secs(3), || async {
            tx.stats().await.unwrap().live_rooms == 0
        })
        .await;
        drop(child);
    }
    tx.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        tx.live_tasks() == 0
    })
    .await;
}

async fn killed_prefill_fails_decode_room_in_each_state(kind: TransportKind) {
    for state in ["bootstrapping", "waiting", "transferring"] {
        let mut child = ChildGuard(
            Command::new(peer_bin())
                .args(["prefill", kind.name(), state])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let lines = Lines::of(&mut child.0);
        let addr: std::net::SocketAddr = lines.next().parse().unwrap();
        let (d_pool, _) = testing::pool();
        let rx = KvReceiver::start(
            testing::receiver_config(kind),
            d_pool.shared_region().unwrap().clone(),
            *d_pool.layout(),
        );
        let rank = rx.connect(addr).await.unwrap();
        let r = room(77);
        let mut dr = rx.submit(r, sources(rank)).await.unwrap();
        if state != "bootstrapping" {
            let lease = d_pool.allocator().lease(4).unwrap();
            dr.reserve(lease, AuxSlot(1), 0).await.unwrap();
        }
        if state != "bootstrapping" {
            assert_eq!(lines.next(), "READY");
        }
        let t0 = Instant::now();
        child.0.kill().unwrap();
        let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(2)).await else {
            panic!("{state}: decode did not fail")
        };
        assert_eq!(e.kind(), FailureKind::PeerDead, "{state}: {e}");
        let took = t0.elapsed();
        assert!(
            took < testing::timers().heartbeat_miss + Duration::from_millis(600),
            "{state}: {took:?} {e}"
        );
        // Pages of a dead writer wait for the fence, then return.
        eventually(
            "pages back after the fence",
            Duration::from_secs(3),
            || async { d_pool.allocator().stats().leased == 0 },
        )
        .await;
        assert_eq!(rx.stats().await.unwrap().live_rooms, 0);
        drop(dr);
        rx.shutdown();
        eventually("no task left", Duration::from_secs(3), || async {
            rx.live_tasks() == 0
        })
        .await;
        drop(child);
    }
}

async fn pages_are_not_reused_while_a_frozen_writer_may_write(kind: TransportKind) {
    // The child's pool is all 0xA5 and it keeps writing the room's pages
    // every 5 ms, so a write of its that lands anywhere shows.
    let mut child = ChildGuard(
        Command::new(peer_bin())
            .args(["prefill", kind.name(), "streaming"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = Lines::of(&mut child.0);
    let addr: std::net::SocketAddr = lines.next().parse().unwrap();
    let (d_pool, _) = testing::pool();
    let region = d_pool.shared_region().unwrap().clone();
    let rx = KvReceiver::start(
        testing::receiver_config(kind),
        region.clone(),
        *d_pool.layout(),
    );
    let rank = rx.connect(addr).await.unwrap();
    let r = room(77);
    let mut dr = rx.submit(r, sources(rank)).await.unwrap();
    let lease = d_pool.allocator().lease(4).unwrap();
    dr.reserve(lease, AuxSlot(1), 0).await.unwrap();
    assert_eq!(lines.next(), "READY");
    // Let some writes land, then freeze the writer mid-stream: it can
    // neither write nor acknowledge.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pid = child.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let t0 = Instant::now();
    dr.abort(client_abort());
    assert!(receiver_outcome(&mut dr, Duration::from_secs(1))
        .await
        .is_err());
    // Decode's link reader is the only writer of its pages on every
    // transport (over shm and NIXL it pulls from the prefill's pool), and
    // it stopped writing the room when the room failed: the fence releases
    // the pages while the prefill is still frozen, and a new owner takes
    // every page.
    let fence = testing::timers().abort_ack_fence;
    let released = || async { d_pool.allocator().stats().leased == 0 };
    let mut within = fence + Duration::from_secs(2);
    if kind == TransportKind::Nixl {
        // Unless the freeze caught a READ in flight: NIXL cannot take one
        // back, so its pages stay held until it ends. The reader gives the
        // READ up after its stall limit (2 s) and says so; the pages then
        // return only once the writer resumes (below).
        within += Duration::from_secs(3);
    }
    let deadline = Instant::now() + within;
    while !released().await && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !released().await {
        let stalled = rx.stats().await.unwrap().stalled_reads;
        assert!(
            kind == TransportKind::Nixl && stalled > 0,
            "fence did not release the pages while the prefill is frozen ({} stalled READs)",
            stalled
        );
        assert!(Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success());
        eventually(
            "a stalled READ's pages return once it ends",
            Duration::from_secs(5),
            released,
        )
        .await;
        drop(dr);
        drop(child);
        rx.shutdown();
        return;
    }
    assert!(t0.elapsed() >= fence);
    let reused = d_pool.allocator().lease(testing::TEST_PAGES).unwrap();
    let kv_bytes = d_pool.layout().pool_bytes();
    region.write_at(0, &vec![0x5A; kv_bytes]).unwrap();
    // The writer resumes mid-stream and keeps sending the room's segments
    // until it is refused: none of it may reach the new owner's pages.
    assert!(Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    let stopped = lines.next();
    assert!(
        stopped.starts_with("STOPPED") && stopped.contains("resumed=true"),
        "the writer was not seen resuming: {stopped}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut now = vec![0u8; kv_bytes];
    region.read_at(0, &mut now).unwrap();
    let landed = now.iter().filter(|&&b| b != 0x5A).count();
    assert_eq!(
        landed, 0,
        "a resumed writer wrote {landed} bytes into reused pages ({stopped})"
    );
    drop(reused);
    drop(dr);
    drop(child);
    rx.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        rx.live_tasks() == 0
    })
    .await;
}

/// A prefill that lies on the data link: segments for pages that are not the
/// room's, beyond the pool, or in a layer that does not exist. Decode
/// rejects each before a byte lands, and its ack says so.
async fn decode_rejects_segments_outside_the_room_and_writes_nothing(kind: TransportKind) {
    use handoff_proto::datalink::{Record, SegmentHeader};
    let r = room(800);
    let RawRoom {
        d_pool,
        src,
        rx,
        mut dr,
        mut control,
        mut data,
        mine,
        _others,
    } = raw_decode_room(kind, r).await;
    let span = handoff_transfer::link::page_span(d_pool.layout());
    let not_mine = (0..testing::TEST_PAGES as u32)
        .find(|p| !mine.contains(&PageIndex(*p)))
        .unwrap();
    for (layer, dst_page) in [(0, not_mine), (0, 10_000), (7, mine[0].0)] {
        let h = Record::Segment(SegmentHeader {
            room: r,
            layer,
            dst_page,
            n_pages: 1,
            heads: None,
        });
        send_segment(kind, &mut data, &src, h, 0xAB, span).await;
    }
    end_room_expecting_a_refusal(&mut data, r).await;
    assert_pool_untouched(&d_pool, "nothing written");
    assert_eq!(rx.stats().await.unwrap().rejected_segments, 3);
    // The lying prefill reports failure; decode fails the room and frees it.
    raw_prefill_gives_up(&mut control, &mut dr).await;
    eventually("pages back", Duration::from_secs(1), || async {
        d_pool.allocator().stats().leased == 0
    })
    .await;
    assert_eq!(rx.stats().await.unwrap().live_rooms, 0);
    // A late Success after the failure changes nothing and creates nothing.
    control
        .send(Message::Status(handoff_proto::message::Status {
            room: r,
            outcome: handoff_proto::message::Outcome::Success,
        }))
        .await;
    // An abort for a room decode never had is acknowledged, nothing created.
    let unknown = room(801);
    control.send(abort_msg(unknown)).await;
    match control.recv(Duration::from_secs(1)).await {
        Some(Message::AbortAck(a)) => assert_eq!((a.room, a.drained), (unknown, true)),
        other => panic!("expected AbortAck, got {other:?}"),
    }
    // Neither the late Success nor the abort created a room: both were
    // counted as for a room decode does not hold.
    let st = rx.stats().await.unwrap();
    assert_eq!(st.live_rooms, 0);
    assert!(st.room_stats.unknown_room_events >= 2, "{st:?}");
    drop((dr, control, data));
    shut_down(&rx).await;
}

/// A prefill that sends garbage: malformed control frames are counted and
/// dropped, the control connection carries on; a malformed data record
/// cannot be skipped (the byte stream has no resync point), so decode
/// closes that link, fails the room as the prefill's fault, writes nothing
/// and frees the pages; the endpoint keeps serving.
async fn malformed_frames_and_records_from_a_prefill_harm_nothing_else(kind: TransportKind) {
    let r = room(820);
    let RawRoom {
        d_pool,
        rx,
        mut dr,
        mut control,
        mut data,
        _others,
        ..
    } = raw_decode_room(kind, r).await;
    // Control: a foreign protocol, an unknown message kind, a truncated
    // payload, a header declaring 64 MiB.
    let mut unknown_kind = b"HOFF".to_vec();
    unknown_kind.extend_from_slice(&[2, 99, 0, 0, 0, 0, 0, 0]);
    let mut truncated = b"HOFF".to_vec();
    truncated.extend_from_slice(&[2, 4, 0, 0]);
    truncated.extend_from_slice(&3u32.to_le_bytes());
    truncated.extend_from_slice(&[1, 2, 3]);
    control.raw(b"GET / HTTP/1.1\r\n\r\n").await;
    control.raw(&unknown_kind).await;
    control.raw(&truncated).await;
    // The connection still carries well-formed messages: an abort for an
    // unknown room is acknowledged.
    let unknown = room(821);
    control.send(abort_msg(unknown)).await;
    match control.recv(Duration::from_secs(1)).await {
        Some(Message::AbortAck(a)) => assert_eq!(a.room, unknown),
        other => panic!("expected AbortAck after garbage, got {other:?}"),
    }
    let st = rx.stats().await.unwrap();
    assert!(st.malformed_frames >= 3, "{st:?}");
    assert!(
        receiver_pending(&mut dr, Duration::from_millis(20)).await,
        "garbage on the control connection must not touch a live room"
    );
    // Data link: a record header that decodes to nothing.
    data.write_all(&[0xEE; handoff_proto::datalink::RECORD_LEN])
        .await
        .unwrap();
    let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(2)).await else {
        panic!("decode kept a room whose link sent garbage")
    };
    assert!(
        matches!(
            e.kind(),
            FailureKind::PeerMisbehaved | FailureKind::PeerDead
        ),
        "{e}"
    );
    assert_pool_untouched(&d_pool, "garbage landed in the pool");
    eventually("pages back", Duration::from_secs(3), || async {
        d_pool.allocator().stats().leased == 0
    })
    .await;
    // The endpoint still answers and holds nothing of that room.
    let st = rx.stats().await.unwrap();
    assert_eq!(st.live_rooms, 0, "{st:?}");
    drop((dr, control, data));
    shut_down(&rx).await;
}

/// A decode endpoint with room `r` submitted and two pages reserved for it,
/// connected to a raw prefill (this test's sockets) that has read the
/// room's destination.
struct RawRoom {
    d_pool: KvPool,
    /// The raw prefill's pool (what decode pulls from over shm).
    src: KvPool,
    rx: KvReceiver,
    /// The room's handle.
    dr: ReceiverRoom,
    control: RawDecode,
    data: TcpStream,
    /// The pages reserved for the room.
    mine: Vec<PageIndex>,
    /// The raw prefill's other data streams, kept open.
    _others: Vec<TcpStream>,
}

async fn raw_decode_room(kind: TransportKind, r: RoomId) -> RawRoom {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (d_pool, _) = testing::pool();
    let rx = KvReceiver::start(
        testing::receiver_config(kind),
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let rx2 = rx.clone();
    let connecting = tokio::spawn(async move { rx2.connect(addr).await });
    let (src, _) = testing::pool();
    let (mut control, data, _others) =
        raw_prefill(&listener, testing::sender_config().handshake, r, &src).await;
    let rank = connecting.await.unwrap().unwrap();
    let mut dr = rx.submit(r, sources(rank)).await.unwrap();
    let lease = d_pool.allocator().lease(2).unwrap();
    let mine = lease.pages().to_vec();
    dr.reserve(lease, AuxSlot(0), 0).await.unwrap();
    let Some(Message::Destination(dest)) = control.recv(Duration::from_secs(1)).await else {
        panic!("no destination")
    };
    assert_eq!(dest.pages, mine);
    RawRoom {
        d_pool,
        src,
        rx,
        dr,
        control,
        data,
        mine,
        _others,
    }
}

/// Every KV byte of `pool`'s region is still zero.
fn assert_pool_untouched(pool: &KvPool, what: &str) {
    let region = pool.shared_region().unwrap();
    let mut all = vec![0u8; pool.layout().pool_bytes()];
    region.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|b| *b == 0), "{what}");
}

/// Shut `rx` down and wait for its tasks to end.
async fn shut_down(rx: &KvReceiver) {
    rx.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        rx.live_tasks() == 0
    })
    .await;
}

fn signal(child: &Child, sig: &str) {
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

/// A stall of a whole process holding both ends (a VM pause, `SIGSTOP`),
/// three times the heartbeat miss bound, is no peer's silence: the room in
/// flight through it completes on both ends, both still hold their peer,
/// and both counted the stall. (The ends live in a child, so the freeze
/// does not touch this suite's other tests.)
fn a_stall_of_the_whole_process_kills_no_live_peer(kind: TransportKind) {
    use std::io::Write;
    let stall = testing::timers().heartbeat_miss * 3;
    let mut child = ChildGuard(
        Command::new(peer_bin())
            .args(["pair", kind.name()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = Lines::of(&mut child.0);
    assert_eq!(lines.next(), "READY");
    signal(&child.0, "-STOP");
    std::thread::sleep(stall);
    signal(&child.0, "-CONT");
    writeln!(child.0.stdin.as_mut().unwrap(), "go").unwrap();
    let out = lines.next();
    let stalled = out
        .strip_prefix("decode=success prefill=success peers=1/1 stalled=")
        .unwrap_or_else(|| panic!("the stall broke the pair: {out}"));
    for ms in stalled.split('/') {
        let ms: u64 = ms.parse().unwrap();
        assert!(
            Duration::from_millis(ms) >= stall / 2 && Duration::from_millis(ms) <= stall * 3,
            "stall of {stall:?} counted as {ms} ms: {out}"
        );
    }
}

#[test]
fn a_stall_of_the_whole_process_kills_no_live_peer_shm() {
    a_stall_of_the_whole_process_kills_no_live_peer(TransportKind::Shm);
}

#[test]
fn a_stall_of_the_whole_process_kills_no_live_peer_tcp() {
    a_stall_of_the_whole_process_kills_no_live_peer(TransportKind::Tcp);
}

/// A hung peer keeps its sockets open: only heartbeats can tell. Both
/// directions: a frozen prefill fails decode's room, a frozen decode fails
/// prefill's room, each with a peer-dead error within the miss bound.
async fn frozen_peers_are_declared_dead_by_heartbeat(kind: TransportKind) {
    // Declared dead by the heartbeat (its sockets stay open while frozen):
    // the miss bound (400 ms) plus the slack a loaded 2-core box needs to
    // fire the check; well under the 1 s fence and 3 s room timers.
    let bound = testing::timers().heartbeat_miss + Duration::from_millis(500);
    // Frozen prefill.
    let mut child = ChildGuard(
        Command::new(peer_bin())
            .args(["prefill", kind.name(), "waiting"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = Lines::of(&mut child.0);
    let addr: std::net::SocketAddr = lines.next().parse().unwrap();
    let (d_pool, _) = testing::pool();
    let rx = KvReceiver::start(
        testing::receiver_config(kind),
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let rank = rx.connect(addr).await.unwrap();
    let r = room(77);
    let mut dr = rx.submit(r, sources(rank)).await.unwrap();
    dr.reserve(d_pool.allocator().lease(4).unwrap(), AuxSlot(1), 0)
        .await
        .unwrap();
    assert_eq!(lines.next(), "READY");
    signal(&child.0, "-STOP");
    let t0 = Instant::now();
    let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(10)).await else {
        panic!("decode room did not fail")
    };
    let took = t0.elapsed();
    assert_eq!(e.kind(), FailureKind::PeerDead, "{e}");
    assert!(took <= bound, "frozen prefill declared dead after {took:?}");
    // Its data link goes with it, while it is still frozen (its sockets
    // are open): a dead peer's link and tasks do not linger.
    let s = rx.stats().await.unwrap();
    assert_eq!(
        (s.peers, s.links),
        (0, 0),
        "decode still holds the dead prefill"
    );
    // Nothing of the frozen prefill can write our pages on either transport
    // (over shm decode pulls; the prefill maps nothing of ours): the pages
    // come back at the fence while it is still frozen.
    eventually(
        "pages back after the fence, the prefill still frozen",
        Duration::from_secs(3),
        || async { d_pool.allocator().stats().leased == 0 },
    )
    .await;
    signal(&child.0, "-CONT");
    drop(dr);
    drop(child);
    rx.shutdown();
    // Frozen decode.
    let (p_pool, _) = testing::pool();
    let tx = KvSender::start(
        testing::sender_config(),
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    let r = room(78);
    let mut sr = tx.submit(r).await.unwrap();
    let mut child = ChildGuard(
        Command::new(peer_bin())
            .args([
                "decode",
                &tx.local_addr().to_string(),
                kind.name(),
                "waiting",
                "78",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = Lines::of(&mut child.0);
    assert_eq!(lines.next(), "READY");
    ready(&mut sr).await;
    signal(&child.0, "-STOP");
    let t0 = Instant::now();
    let Err(e) = sender_outcome(&mut sr, Duration::from_secs(10)).await else {
        panic!("prefill room did not fail")
    };
    let took = t0.elapsed();
    assert_eq!(e.kind(), FailureKind::PeerDead, "{e}");
    assert!(took <= bound, "frozen decode declared dead after {took:?}");
    let s = tx.stats().await.unwrap();
    assert_eq!(s.live_rooms, 0);
    assert_eq!(
        (s.peers, s.links),
        (0, 0),
        "prefill still holds the dead decode"
    );
    signal(&child.0, "-CONT");
    drop(sr);
    drop(child);
    tx.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        tx.live_tasks() == 0 && rx.live_tasks() == 0
    })
    .await;
}

/// Run one room from open to commit between `tx` and `rx` (peer `rank`),
/// checking the bytes.
async fn one_room(
    tx: &KvSender,
    rx: &KvReceiver,
    rank: PeerId,
    d_pool: &KvPool,
    p_pool: &KvPool,
    r: RoomId,
) {
    let mut sr = tx.submit(r).await.unwrap();
    let mut dr = rx.submit(r, sources(rank)).await.unwrap();
    let lease = d_pool.allocator().lease(2).unwrap();
    let dst = lease.pages().to_vec();
    dr.reserve(lease, AuxSlot(0), 0).await.unwrap();
    ready(&mut sr).await;
    let src: Arc<[PageIndex]> = [30, 9]
        .into_iter()
        .map(PageIndex)
        .collect::<Vec<_>>()
        .into();
    sr.send(0..2, 0..2, src.clone()).await.unwrap();
    sr.finish(AuxData {
        first_token: r.get() as u32,
        logprob: 0.0,
        top: handoff_proto::datalink::TopLogprobs::NONE,
    })
    .await
    .unwrap();
    assert_eq!(
        sender_outcome(&mut sr, Duration::from_secs(10)).await,
        Ok(())
    );
    let Ok((lease, aux)) = receiver_outcome(&mut dr, Duration::from_secs(10)).await else {
        panic!("room {} did not commit", r.get())
    };
    assert_eq!(aux.first_token, r.get() as u32);
    for layer in 0..2 {
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(span_bytes(p_pool, layer, *s), span_bytes(d_pool, layer, *d));
        }
    }
    drop(lease);
}

/// Two decode workers, both TP rank 0, on one prefill; and one decode on two
/// prefill workers, both TP rank 0: every pair is its own peer.
async fn peers_of_the_same_tp_rank_do_not_collide(kind: TransportKind) {
    let a = pair(kind).await;
    // A second decode worker (same fingerprint, same TP rank) on a's prefill.
    let (d2_pool, _) = testing::pool();
    let rx2 = KvReceiver::start(
        testing::receiver_config(kind),
        d2_pool.shared_region().unwrap().clone(),
        *d2_pool.layout(),
    );
    let rank2 = rx2.connect(a.tx.local_addr()).await.unwrap();
    // A second prefill worker (same TP rank) that a's decode also talks to.
    let (p2_pool, _) = testing::pool();
    fill(&p2_pool);
    let tx2 = KvSender::start(
        testing::sender_config(),
        p2_pool.shared_region().unwrap().clone(),
        *p2_pool.layout(),
    )
    .await
    .unwrap();
    let rank_p2 = a.rx.connect(tx2.local_addr()).await.unwrap();
    assert_ne!(rank_p2, a.rank);
    assert_eq!(a.tx.stats().await.unwrap().peers, 2);
    one_room(&a.tx, &a.rx, a.rank, &a.d_pool, &a.p_pool, room(901)).await;
    one_room(&a.tx, &rx2, rank2, &d2_pool, &a.p_pool, room(902)).await;
    one_room(&tx2, &a.rx, rank_p2, &a.d_pool, &p2_pool, room(903)).await;
    // Losing one decode fails nothing of the other.
    rx2.shutdown();
    eventually("second decode gone", Duration::from_secs(2), || async {
        a.tx.stats().await.unwrap().peers == 1
    })
    .await;
    one_room(&a.tx, &a.rx, a.rank, &a.d_pool, &a.p_pool, room(904)).await;
    tx2.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        rx2.live_tasks() == 0 && tx2.live_tasks() == 0
    })
    .await;
    assert_eq!(d2_pool.allocator().stats().leased, 0);
    teardown(a).await;
}

/// A connect dropped part-way (as when the request that started it is
/// cancelled) leaves no control connection, data link or pending stream on
/// either side, wherever it was cut. (A new connect from the same decode
/// endpoint to the same prefill supersedes the earlier connection, so what
/// may remain is the last connect that finished, or nothing.) A connect
/// left to finish afterwards gives one peer and one link that carry a room.
async fn a_cancelled_connect_leaves_no_peer_or_link_behind(kind: TransportKind) {
    let a = pair(kind).await;
    let mut rank = a.rank;
    let mut cut = 0;
    // Longest first: the connects cut short come last, so no finished one
    // supersedes what they might leave behind.
    for i in (0..80u64).rev() {
        let within = Duration::from_micros(i * 50);
        match tokio::time::timeout(within, a.rx.connect(a.tx.local_addr())).await {
            Ok(Ok(r)) => rank = r,
            Ok(Err(e)) => panic!("connect failed: {e}"),
            Err(_) => cut += 1,
        }
    }
    // The timer's granularity is a millisecond, so on a fast host every
    // connect above may finish in time: the last one is dropped after its
    // first poll, whatever the clock says.
    {
        let mut last = std::pin::pin!(a.rx.connect(a.tx.local_addr()));
        match std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(last.as_mut(), cx))
        })
        .await
        {
            std::task::Poll::Ready(Ok(r)) => rank = r,
            std::task::Poll::Ready(Err(e)) => panic!("connect failed: {e}"),
            std::task::Poll::Pending => cut += 1,
        }
    }
    assert!(cut > 0, "no connect was cut short");
    // Both ends agree: no peer or link but the last finished connect's
    // (or none, when a connect cut short after it reached prefill replaced
    // it there, as connecting again does).
    until_links(
        &a,
        "no peer or link but the last finished connect's",
        |r, t| {
            r.peers_ranks.iter().all(|p| *p == rank)
                && (r.links, t.peers, t.links) == (r.peers, r.peers, r.peers)
        },
    )
    .await;
    let rank = a.rx.connect(a.tx.local_addr()).await.unwrap();
    until_links(&a, "one peer and one link", |r, t| {
        (r.peers, r.links, t.peers, t.links) == (1, 1, 1, 1)
    })
    .await;
    one_room(&a.tx, &a.rx, rank, &a.d_pool, &a.p_pool, room(911)).await;
    teardown(a).await;
}

/// A prefill endpoint on the test pool, with no decode connected.
async fn lone_sender() -> (KvSender, KvPool) {
    let (p_pool, _) = testing::pool();
    let tx = KvSender::start(
        testing::sender_config(),
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    (tx, p_pool)
}

/// Per decode endpoint prefill keeps the newest connect: a control
/// connection of an older connect that completes after a newer one (a
/// connect decode cancelled, finishing late) is closed, and the newer one
/// keeps serving; a newer connect replaces the older one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_connection_of_an_older_connect_replaces_nothing() {
    let (tx, _p_pool) = lone_sender().await;
    let endpoint = rand_id();
    let connect = |n| RawDecode::connect_as(tx.local_addr(), decode_handshake(), endpoint, n);
    let mut newer = connect(5).await.unwrap();
    eventually(
        "the newer connect's peer",
        Duration::from_secs(3),
        || async { tx.stats().await.unwrap().peers == 1 },
    )
    .await;
    let mut older = connect(3).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(3), older.s.read(&mut buf))
        .await
        .expect("the older connect's connection stayed open")
        .unwrap_or(0);
    assert_eq!(n, 0, "the older connect's connection got {n} bytes");
    // The newer one still serves: prefill acknowledges an abort on it.
    let r = room(4242);
    newer.send(abort_msg(r)).await;
    match newer.recv(Duration::from_secs(2)).await {
        Some(Message::AbortAck(a)) => assert_eq!(a.room, r),
        other => panic!("the newer connect stopped answering: {other:?}"),
    }
    // A newer connect still replaces it.
    let _newest = connect(6).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(3), newer.s.read(&mut buf))
        .await
        .expect("the replaced connection stayed open")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert_eq!(tx.stats().await.unwrap().peers, 1);
    tx.shutdown();
}

/// Poll both ends' stats until `ok(decode, prefill)` (5 s at most); the
/// failure shows the peers and links each end last had.
async fn until_links(
    a: &Pair,
    what: &str,
    ok: impl Fn(&handoff_transfer::EndpointStats, &handoff_transfer::EndpointStats) -> bool,
) {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let (r, t) = (a.rx.stats().await.unwrap(), a.tx.stats().await.unwrap());
        if ok(&r, &t) {
            return;
        }
        assert!(
            Instant::now() < end,
            "not within 5 s: {what}; decode has peers {:?} and {} links, prefill peers {:?} and {} links",
            r.peers_ranks,
            r.links,
            t.peers_ranks,
            t.links
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A decode offering its own pool for prefill to write into (the shm setup
/// before decode pulled) is refused by name: prefill maps nothing of a
/// peer's and writes into no other process's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_offering_its_pool_for_writes_is_refused() {
    let (tx, p_pool) = lone_sender().await;
    let (d_pool, handle) = testing::pool();
    let mut s = TcpStream::connect(tx.local_addr()).await.unwrap();
    let preface = handoff_proto::datalink::encode_preface(
        handoff_proto::datalink::PREFACE_DATA,
        rand_id(),
        RAW_CONNECT,
    );
    s.write_all(&preface).await.unwrap();
    handoff_transfer::conn::handshake_exact(&mut s, decode_handshake(), Duration::from_secs(2))
        .await
        .unwrap();
    let mut setup = vec![handoff_proto::datalink::SETUP_SHM_PUSH];
    setup.extend_from_slice(&handle.to_bytes());
    s.write_all(&setup).await.unwrap();
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut reply)).await;
    assert_eq!(reply.first(), Some(&1), "refused");
    let msg = String::from_utf8_lossy(&reply[3..]);
    assert!(msg.contains("upgrade the decode worker"), "{msg}");
    assert_pool_untouched(&d_pool, "prefill wrote into a decode pool");
    assert_eq!(tx.stats().await.unwrap().links, 0);
    drop(p_pool);
    tx.shutdown();
    eventually("no task left", Duration::from_secs(3), || async {
        tx.live_tasks() == 0
    })
    .await;
}

/// A prefill whose shm setup reply names a shared file that is not a KV
/// pool (here another memfd of the same user) is refused by decode before
/// anything is mapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_naming_a_foreign_file_for_pulls_is_refused() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let foreign = handoff_kv::ShmRegion::create("secrets", 1 << 16).unwrap();
    let reply_handle = foreign.handle();
    let raw = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut pre = [0u8; handoff_proto::datalink::PREFACE_LEN];
        s.read_exact(&mut pre).await.unwrap();
        let hs = testing::sender_config().handshake;
        handoff_transfer::conn::handshake_exact(&mut s, hs, Duration::from_secs(2))
            .await
            .unwrap();
        let mut setup = [0u8; 9];
        s.read_exact(&mut setup).await.unwrap();
        assert_eq!(setup[0], handoff_proto::datalink::SETUP_SHM);
        let mut ok = vec![0u8];
        ok.extend_from_slice(&reply_handle.to_bytes());
        ok.extend_from_slice(&4u64.to_le_bytes());
        ok.extend_from_slice(&0u64.to_le_bytes());
        s.write_all(&ok).await.unwrap();
        s
    });
    let e = handoff_transfer::link::connect_link(
        addr,
        rand_id(),
        RAW_CONNECT,
        decode_handshake(),
        Duration::from_secs(2),
        TransportKind::Shm,
        testing::TEST_PAGES,
        None,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("not a handoff KV pool"), "{e}");
    drop(raw.await.unwrap());
}

// ---- TP fan-in / fan-out ----

/// A byte for (prefill rank, layer, source page, K|V, global head, byte
/// index): well mixed, never zero (an untouched decode pool is all zeros).
fn tp_byte(rank: usize, layer: usize, page: u32, part: usize, head: usize, i: usize) -> u8 {
    let mut x = ((((rank as u64 * 8 + layer as u64) * 1024 + u64::from(page)) * 2 + part as u64)
        * 64
        + head as u64)
        * 65_536
        + i as u64;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x as u8) | 1
}

const KV_KINDS: [handoff_kv::KvPart; 2] = [handoff_kv::KvPart::K, handoff_kv::KvPart::V];

/// Fill prefill TP rank `rank` of `tp`'s pool: every head of every block
/// gets bytes naming (rank, layer, page, K|V, global head).
fn fill_tp(pool: &KvPool, rank: usize, tp: usize) {
    let l = pool.layout();
    let local = testing::TP_KV_HEADS / tp;
    let region = pool.shared_region().unwrap();
    let mut all = vec![0u8; l.pool_bytes()];
    for layer in 0..l.geometry.layers {
        for page in 0..l.num_pages as u32 {
            for (part, kind) in KV_KINDS.into_iter().enumerate() {
                for lh in 0..local {
                    let r = l
                        .head_slice_bytes(layer, PageIndex(page), kind, lh..lh + 1)
                        .unwrap();
                    let global = rank * local + lh;
                    for (i, b) in all[r].iter_mut().enumerate() {
                        *b = tp_byte(rank, layer, page, part, global, i);
                    }
                }
            }
        }
    }
    region.write_at(0, &all).unwrap();
}

/// Decode TP rank `d` of `d_tp` holds, in room page `dst[i]`, exactly its
/// own heads, each from the prefill rank (of `p_tp`) holding it, copied
/// from that rank's source page `src[p][i]`; every page outside the room
/// is untouched.
fn verify_tp(
    d_pool: &KvPool,
    d: usize,
    d_tp: usize,
    p_tp: usize,
    dst: &[PageIndex],
    src: &[Arc<[PageIndex]>],
) {
    let l = d_pool.layout();
    let region = d_pool.shared_region().unwrap();
    let (dl, pl) = (testing::TP_KV_HEADS / d_tp, testing::TP_KV_HEADS / p_tp);
    assert_eq!(l.geometry.kv_heads, dl);
    for layer in 0..l.geometry.layers {
        for (i, page) in dst.iter().enumerate() {
            for (part, kind) in KV_KINDS.into_iter().enumerate() {
                for lh in 0..dl {
                    let global = d * dl + lh;
                    let p = global / pl;
                    let r = l.head_slice_bytes(layer, *page, kind, lh..lh + 1).unwrap();
                    let mut got = vec![0u8; r.len()];
                    region.read_at(r.start, &mut got).unwrap();
                    let want: Vec<u8> = (0..got.len())
                        .map(|j| tp_byte(p, layer, src[p][i].0, part, global, j))
                        .collect();
                    assert!(
                        got == want,
                        "decode rank {d}: layer {layer} room page {i} ({page:?}) {kind:?} head {global} \
                         should come from prefill rank {p} page {:?}",
                        src[p][i]
                    );
                }
            }
        }
    }
    for page in (0..l.num_pages as u32).map(PageIndex) {
        if dst.contains(&page) {
            continue;
        }
        for layer in 0..l.geometry.layers {
            for kind in KV_KINDS {
                let r = l.block_bytes(layer, page, kind).unwrap();
                let mut got = vec![0u8; r.len()];
                region.read_at(r.start, &mut got).unwrap();
                assert!(
                    got.iter().all(|b| *b == 0),
                    "decode rank {d}: page {page:?} outside the room was written"
                );
            }
        }
    }
}

/// Lease `n` decode pages scattered around a hole.
fn scattered_lease(pool: &KvPool, n: usize) -> handoff_kv::PageLease {
    let hole = pool.allocator().lease(3).unwrap();
    let keep = pool.allocator().lease(2).unwrap();
    drop(hole);
    let lease = pool.allocator().lease(n).unwrap();
    drop(keep);
    lease
}

fn pages(p: &[u32]) -> Arc<[PageIndex]> {
    p.iter().copied().map(PageIndex).collect::<Vec<_>>().into()
}

/// Nothing left behind on any endpoint of a TP test.
async fn teardown_tp(txs: &[KvSender], rxs: &[KvReceiver], d_pools: &[KvPool]) {
    eventually("no live rooms", Duration::from_secs(3), || async {
        let mut live = 0;
        for tx in txs {
            live += tx.stats().await.unwrap().live_rooms;
        }
        for rx in rxs {
            live += rx.stats().await.unwrap().live_rooms;
        }
        live == 0
    })
    .await;
    eventually("no leased pages", Duration::from_secs(3), || async {
        d_pools.iter().all(|p| p.allocator().stats().leased == 0)
    })
    .await;
    for tx in txs {
        tx.shutdown();
    }
    for rx in rxs {
        rx.shutdown();
    }
    eventually("no task left", Duration::from_secs(3), || async {
        txs.iter().all(|t| t.live_tasks() == 0) && rxs.iter().all(|r| r.live_tasks() == 0)
    })
    .await;
}

const TP_AUX: AuxData = AuxData {
    first_token: 77,
    logprob: -1.5,
    top: handoff_proto::datalink::TopLogprobs::NONE,
};

async fn fan_in_two_prefill_ranks_fill_one_decode_rank(kind: TransportKind) {
    use handoff_proto::rank::RankMap;
    use handoff_proto::receiver_room::Source;
    // Prefill TP 2 (2 heads each) -> decode TP 1 (all 4 heads).
    let mut txs = Vec::new();
    let mut p_pools = Vec::new();
    for p in 0..2u32 {
        let (pool, _) = testing::tp_pool(2);
        fill_tp(&pool, p as usize, 2);
        let tx = KvSender::start(
            testing::tp_sender_config(p, 2),
            pool.shared_region().unwrap().clone(),
            *pool.layout(),
        )
        .await
        .unwrap();
        txs.push(tx);
        p_pools.push(pool);
    }
    let (d_pool, _) = testing::tp_pool(1);
    let rx = KvReceiver::start(
        testing::tp_receiver_config(kind, 0, 1),
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let mut peers = Vec::new();
    for tx in &txs {
        peers.push(rx.connect(tx.local_addr()).await.unwrap());
    }
    // The room's sources come from the rank map, prefill TP rank -> peer.
    let map = RankMap::new(testing::TP_KV_HEADS as u32, 2, 1).unwrap();
    let srcs: Vec<Source> =
        Source::for_decode_rank(&map, RankId(0), |r| peers[r.0 as usize]).unwrap();
    assert_eq!(srcs.len(), 2);
    // A room naming only prefill rank 0 could never hold heads 2..4: refused.
    let err = rx.submit(room(901), vec![srcs[0]]).await.unwrap_err();
    assert!(err.to_string().contains("lack [1]"), "{err}");

    let r = room(900);
    let mut srs = Vec::new();
    for tx in &txs {
        srs.push(tx.submit(r).await.unwrap());
    }
    let mut dr = rx.submit(r, srcs.clone()).await.unwrap();
    let lease = scattered_lease(&d_pool, 6);
    let dst = lease.pages().to_vec();
    dr.reserve(lease, AuxSlot(2), 0).await.unwrap();
    for sr in &mut srs {
        ready(sr).await;
    }
    let src = [
        pages(&[9, 10, 11, 30, 2, 50]),
        pages(&[40, 3, 4, 5, 61, 17]),
    ];
    // Prefill rank 0 streams layer by layer and finishes first.
    srs[0].send(0..1, 0..6, src[0].clone()).await.unwrap();
    srs[0].send(1..2, 0..6, src[0].clone()).await.unwrap();
    srs[0].finish(TP_AUX).await.unwrap();
    assert_eq!(
        sender_outcome(&mut srs[0], Duration::from_secs(3)).await,
        Ok(())
    );
    // Half the heads landed: decode must keep waiting for prefill rank 1.
    assert!(
        receiver_pending(&mut dr, Duration::from_millis(20)).await,
        "decode ended a room with half its heads"
    );
    srs[1].send(0..2, 0..3, src[1].clone()).await.unwrap();
    srs[1].send(0..2, 3..6, src[1].clone()).await.unwrap();
    srs[1].finish(TP_AUX).await.unwrap();
    assert_eq!(
        sender_outcome(&mut srs[1], Duration::from_secs(3)).await,
        Ok(())
    );
    let Ok((lease, aux)) = receiver_outcome(&mut dr, Duration::from_secs(3)).await else {
        panic!("decode did not commit")
    };
    assert_eq!(lease.pages(), &dst[..]);
    assert_eq!(aux, TP_AUX);
    verify_tp(&d_pool, 0, 1, 2, &dst, &src);
    let st = rx.stats().await.unwrap();
    assert_eq!(st.rejected_segments, 0);
    drop((lease, srs, dr));

    // A second room: prefill rank 0 delivers its heads, rank 1 refuses the
    // request. Half the heads are no room: decode fails with rank 1's
    // reason and status, and its pages go back.
    let r2 = room(902);
    let mut srs = Vec::new();
    for tx in &txs {
        srs.push(tx.submit(r2).await.unwrap());
    }
    let mut dr = rx.submit(r2, srcs).await.unwrap();
    let lease = d_pool.allocator().lease(3).unwrap();
    dr.reserve(lease, AuxSlot(3), 0).await.unwrap();
    for sr in &mut srs {
        ready(sr).await;
    }
    srs[0].send(0..2, 0..3, src[0].clone()).await.unwrap();
    srs[0].finish(TP_AUX).await.unwrap();
    assert_eq!(
        sender_outcome(&mut srs[0], Duration::from_secs(3)).await,
        Ok(())
    );
    srs[1].fail(TransferError::Rejected {
        http_status: 400,
        reason: "prompt too long".into(),
        code: None,
    });
    let Err(e) = receiver_outcome(&mut dr, Duration::from_secs(3)).await else {
        panic!("decode committed a room missing half its heads")
    };
    assert_eq!(e.http_status(), 400, "{e}");
    assert!(e.to_string().contains("prompt too long"), "{e}");
    assert!(matches!(
        sender_outcome(&mut srs[1], Duration::from_secs(3)).await,
        Err(TransferError::Rejected { .. })
    ));
    drop((srs, dr));
    teardown_tp(&txs, &[rx], &[d_pool]).await;
    drop(p_pools);
}

async fn fan_out_one_prefill_rank_feeds_two_decode_ranks(kind: TransportKind) {
    use handoff_proto::rank::RankMap;
    use handoff_proto::receiver_room::Source;
    // Prefill TP 1 (all 4 heads) -> decode TP 2 (2 heads each).
    let (p_pool, _) = testing::tp_pool(1);
    fill_tp(&p_pool, 0, 1);
    let tx = KvSender::start(
        testing::tp_sender_config(0, 1),
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    let map = RankMap::new(testing::TP_KV_HEADS as u32, 1, 2).unwrap();
    let r = room(910);
    let mut sr = tx.submit(r).await.unwrap();
    let mut rxs = Vec::new();
    let mut drs = Vec::new();
    let mut d_pools = Vec::new();
    let mut dsts = Vec::new();
    for d in 0..2u32 {
        let (pool, _) = testing::tp_pool(2);
        let rx = KvReceiver::start(
            testing::tp_receiver_config(kind, d, 2),
            pool.shared_region().unwrap().clone(),
            *pool.layout(),
        );
        let peer = rx.connect(tx.local_addr()).await.unwrap();
        let srcs: Vec<Source> = Source::for_decode_rank(&map, RankId(d), |_| peer).unwrap();
        assert_eq!(srcs.len(), 1);
        assert_eq!(srcs[0].required_destinations, 2);
        let mut dr = rx.submit(r, srcs).await.unwrap();
        // Each decode rank scatters its pages differently.
        let skip = (d == 1).then(|| pool.allocator().lease(7).unwrap());
        let lease = scattered_lease(&pool, 5);
        dsts.push(lease.pages().to_vec());
        dr.reserve(lease, AuxSlot(d), 0).await.unwrap();
        drop(skip);
        if d == 0 {
            // One destination of two: prefill must not start yet (still
            // bootstrapping: neither ready nor ended).
            assert!(
                tokio::time::timeout(Duration::from_millis(20), sr.ready())
                    .await
                    .is_err(),
                "prefill started with one destination of two"
            );
        }
        rxs.push(rx);
        drs.push(dr);
        d_pools.push(pool);
    }
    ready(&mut sr).await;
    let src = [pages(&[12, 13, 14, 63, 0])];
    sr.send(0..1, 0..5, src[0].clone()).await.unwrap();
    sr.send(1..2, 0..2, src[0].clone()).await.unwrap();
    sr.send(1..2, 2..5, src[0].clone()).await.unwrap();
    sr.finish(TP_AUX).await.unwrap();
    assert_eq!(
        sender_outcome(&mut sr, Duration::from_secs(3)).await,
        Ok(())
    );
    for (d, (rx, dr)) in rxs.iter().zip(&mut drs).enumerate() {
        let Ok((lease, aux)) = receiver_outcome(dr, Duration::from_secs(3)).await else {
            panic!("decode rank {d} did not commit")
        };
        assert_eq!(lease.pages(), &dsts[d][..]);
        assert_eq!(aux, TP_AUX);
        verify_tp(&d_pools[d], d, 2, 1, &dsts[d], &src);
        assert_eq!(rx.stats().await.unwrap().rejected_segments, 0);
    }
    drop((sr, drs));
    teardown_tp(&[tx], &rxs, &d_pools).await;
    drop(p_pool);
}

/// As a raw prefill: report `dr`'s room failed on `control`; decode fails it.
async fn raw_prefill_gives_up(control: &mut RawDecode, dr: &mut ReceiverRoom) {
    control
        .send(Message::Status(handoff_proto::message::Status {
            room: dr.room(),
            outcome: handoff_proto::message::Outcome::Failed {
                kind: FailureKind::Internal,
                reason: "gave up".into(),
                http_status: Some(500),
                code: None,
            },
        }))
        .await;
    assert!(receiver_outcome(dr, Duration::from_secs(1)).await.is_err());
}

/// As a raw prefill: end `room` on `data` and check decode acknowledges it
/// as not ok (some of its writes were refused).
async fn end_room_expecting_a_refusal(data: &mut TcpStream, room: RoomId) {
    use handoff_proto::datalink::{Ack, Record, ACK_LEN};
    let end = Record::End {
        room,
        cancelled: false,
    };
    data.write_all(&end.encode()).await.unwrap();
    let mut ack = [0u8; ACK_LEN];
    data.read_exact(&mut ack).await.unwrap();
    let ack = Ack::decode(&ack).unwrap();
    assert_eq!(
        (ack.room, ack.ok),
        (room, false),
        "decode must not acknowledge bad writes"
    );
}

/// As a raw prefill with pool `src`: send segment `h` whose payload is
/// `len` bytes of `fill`: on a tcp link the bytes follow the header; over
/// shm and NIXL they are put in `src` (at its start) and a pull reference
/// to them follows, as a prefill's would.
async fn send_segment(
    kind: TransportKind,
    data: &mut TcpStream,
    src: &KvPool,
    h: handoff_proto::datalink::Record,
    fill: u8,
    len: usize,
) {
    data.write_all(&h.encode()).await.unwrap();
    match kind {
        TransportKind::Tcp => data.write_all(&vec![fill; len]).await.unwrap(),
        TransportKind::Shm | TransportKind::Nixl => {
            // The bytes at the start of the segment's layer's blocks of
            // source page 0, which the pull names (decode refuses a pull
            // whose bytes lie outside the pages it names).
            let layer = match h {
                handoff_proto::datalink::Record::Segment(s) => s.layer,
                _ => 0,
            };
            let at = src
                .layout()
                .page_layout()
                .block_offset(layer, PageIndex(0), handoff_proto::layout::KvPart::K)
                .unwrap_or(0);
            src.shared_region()
                .unwrap()
                .write_at(at, &vec![fill; len])
                .unwrap();
            let pull = handoff_proto::datalink::PullRef {
                src_offset: at as u64,
                src_page: 0,
                src_pages: 1,
                epoch: src.generations().unwrap().epoch(),
            };
            data.write_all(&pull.encode()).await.unwrap();
        }
    }
}

/// A raw prefill endpoint on `listener` speaking `hs`, with pool `src`
/// (what decode pulls from over shm): the control
/// connection (handshaken) and, of the data link (set up, payload-ready) of
/// the decode endpoint that connects to it, the stream that carries `room`
/// (a link has several streams when the case asks for them), and the other
/// streams (keep them open: decode drops a link when one of them closes).
async fn raw_prefill(
    listener: &tokio::net::TcpListener,
    hs: HandshakeConfig,
    room: RoomId,
    src: &KvPool,
) -> (RawDecode, TcpStream, Vec<TcpStream>) {
    use handoff_proto::datalink::{stream_of, TcpStreamSetup};
    let mut control = None;
    let mut data: Vec<Option<TcpStream>> = Vec::new();
    while control.is_none() || data.is_empty() || data.iter().any(Option::is_none) {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut pre = [0u8; handoff_proto::datalink::PREFACE_LEN];
        s.read_exact(&mut pre).await.unwrap();
        if pre[0] == b'C' {
            let hs = hs.clone();
            control = Some(tokio::spawn(async move {
                RawDecode::handshake(s, hs).await.unwrap()
            }));
        } else {
            handoff_transfer::conn::handshake_exact(&mut s, hs.clone(), Duration::from_secs(2))
                .await
                .unwrap();
            let mut k = [0u8; 1];
            s.read_exact(&mut k).await.unwrap();
            let mut pages = [0u8; 8];
            s.read_exact(&mut pages).await.unwrap();
            let pulls = [
                handoff_proto::datalink::SETUP_SHM,
                handoff_proto::datalink::SETUP_NIXL,
            ];
            let st = if pulls.contains(&k[0]) {
                TcpStreamSetup {
                    nonce: 0,
                    index: 0,
                    count: 1,
                }
            } else {
                let mut st = [0u8; TcpStreamSetup::LEN];
                s.read_exact(&mut st).await.unwrap();
                TcpStreamSetup::decode(&st).unwrap()
            };
            // Setup accepted; over shm, with the pool decode pulls from.
            let mut ok = vec![0u8];
            #[cfg(feature = "nixl")]
            if k[0] == handoff_proto::datalink::SETUP_NIXL {
                let (reply, keep) = testing::nixl_setup_reply(src);
                ok.extend_from_slice(&reply);
                // Registered for the rest of the test process.
                std::mem::forget(keep);
            }
            if k[0] == handoff_proto::datalink::SETUP_SHM {
                let region = src.shared_region().unwrap();
                ok.extend_from_slice(&region.handle().to_bytes());
                ok.extend_from_slice(&(src.layout().num_pages as u64).to_le_bytes());
                let gens_at = KvPool::generations_offset(src.layout()) as u64;
                ok.extend_from_slice(&gens_at.to_le_bytes());
            }
            s.write_all(&ok).await.unwrap();
            data.resize_with(usize::from(st.count), || None);
            data[usize::from(st.index)] = Some(s);
        }
    }
    let n = data.len();
    let stream = data.swap_remove(stream_of(room, n)).unwrap();
    let others = data.into_iter().flatten().collect();
    (control.unwrap().await.unwrap(), stream, others)
}

async fn decode_rejects_head_slices_it_does_not_hold_and_writes_nothing_else(kind: TransportKind) {
    use handoff_proto::datalink::{HeadSlice, Record, SegmentHeader};
    use handoff_proto::layout::KvPart;
    // A raw prefill TP rank 0 of 1 (4 heads) feeding decode rank 1 of 2,
    // whose blocks hold 2 heads.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (d_pool, _) = testing::tp_pool(2);
    let rx = KvReceiver::start(
        testing::tp_receiver_config(kind, 1, 2),
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    let rx2 = rx.clone();
    let connecting = tokio::spawn(async move { rx2.connect(addr).await });
    let r = room(920);
    let (src, _) = testing::pool();
    let (mut control, mut data, _others) = raw_prefill(
        &listener,
        testing::tp_sender_config(0, 1).handshake,
        r,
        &src,
    )
    .await;
    let rank = connecting.await.unwrap().unwrap();
    let mut dr = rx.submit(r, sources(rank)).await.unwrap();
    let lease = d_pool.allocator().lease(2).unwrap();
    let mine = lease.pages().to_vec();
    dr.reserve(lease, AuxSlot(0), 0).await.unwrap();
    let Some(Message::Destination(dest)) = control.recv(Duration::from_secs(1)).await else {
        panic!("no destination")
    };
    assert_eq!(dest.pages.len(), 2);
    let not_mine = (0..testing::TEST_PAGES as u32)
        .find(|p| !mine.contains(&PageIndex(*p)))
        .unwrap();
    let g = d_pool.layout().geometry;
    let head_bytes = g.page_size * g.head_dim * g.dtype.bytes();
    let slice = |layer, page, part, first, count| {
        Record::Segment(SegmentHeader {
            room: r,
            layer,
            dst_page: page,
            n_pages: 1,
            heads: Some(HeadSlice { part, first, count }),
        })
    };
    let bad = [
        // Past the 2 local heads.
        (slice(0, mine[0].0, KvPart::K, 1, 2), 2 * head_bytes),
        (slice(0, mine[0].0, KvPart::V, 2, 1), head_bytes),
        // First head so large the range overflows.
        (slice(0, mine[0].0, KvPart::K, u32::MAX, 1), head_bytes),
        // In range, but not a page of the room / not in the pool / bad layer.
        (slice(0, not_mine, KvPart::K, 0, 1), head_bytes),
        (slice(0, 10_000, KvPart::K, 0, 1), head_bytes),
        (slice(7, mine[0].0, KvPart::K, 0, 1), head_bytes),
        // A whole-span segment on a head-sliced link.
        (
            Record::Segment(SegmentHeader {
                room: r,
                layer: 0,
                dst_page: mine[0].0,
                n_pages: 1,
                heads: None,
            }),
            handoff_transfer::link::page_span(d_pool.layout()),
        ),
    ];
    for (h, len) in &bad {
        send_segment(kind, &mut data, &src, *h, 0xAB, *len).await;
    }
    // One good slice: local head 1 of the room's second page, V block.
    let good_slice = slice(1, mine[1].0, KvPart::V, 1, 1);
    send_segment(kind, &mut data, &src, good_slice, 0xCD, head_bytes).await;
    end_room_expecting_a_refusal(&mut data, r).await;
    let region = d_pool.shared_region().unwrap();
    let mut all = vec![0u8; d_pool.layout().pool_bytes()];
    region.read_at(0, &mut all).unwrap();
    let good = d_pool
        .layout()
        .head_slice_bytes(1, mine[1], handoff_kv::KvPart::V, 1..2)
        .unwrap();
    // On both transports only the good slice landed, exactly where it
    // belongs (over shm, decode pulled it and placed it itself).
    assert!(all[good.clone()].iter().all(|b| *b == 0xCD));
    all[good].fill(0);
    assert!(all.iter().all(|b| *b == 0), "nothing else written");
    assert_eq!(
        rx.stats().await.unwrap().rejected_segments,
        bad.len() as u64
    );
    raw_prefill_gives_up(&mut control, &mut dr).await;
    drop(dr);
    drop(control);
    drop(data);
    teardown_tp(&[], &[rx], &[d_pool]).await;
}
