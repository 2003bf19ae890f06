//! Deterministic simulation of prefill and decode room tables on a virtual
//! clock. Any number of prefill and
//! decode TP ranks (fan-in and fan-out through the real rank mapping); every
//! control message goes through the real codec over simulated links that can
//! drop, duplicate and delay (and so reorder) frames; peers can crash; aborts
//! and rejections are injected in every state. Each node is the real
//! sans-IO endpoint ([`SenderEndpoint`] / [`ReceiverEndpoint`], the ones the
//! transfer drivers run); the simulation plays only the sockets and the
//! engine: it computes, "writes" pages (a ledger of in-flight writes), hands
//! the aux record over, holds committed leases.
//!
//! Checked during every run: no decode rank releases or commits pages while a
//! write to them is in flight. Checked after every scenario: zero live rooms
//! on every surviving table, every page and aux slot back in its pool, no
//! write in flight, every request answered on every surviving rank, and a
//! request committed on a decode rank only if every prefill rank succeeded.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::time::{Duration, Instant};

use handoff_proto::datalink::AuxData;
use handoff_proto::error::{AbortOrigin, TransferError};
use handoff_proto::frame::{encode_frame, FrameDecoder, DEFAULT_MAX_FRAME_LEN};
use handoff_proto::fuzz::sample_fingerprint;
use handoff_proto::handshake::{Capabilities, Handshake, HandshakeConfig, Negotiated};
use handoff_proto::message::{Abort, Message};
use handoff_proto::rank::RankMap;
use handoff_proto::receiver_endpoint::{
    ReceiverEndpoint, ReceiverEvent, ReceiverOutcome, TpPosition,
};
use handoff_proto::receiver_room::Source;
use handoff_proto::room::{RoomConfig, RoomState, Transmit};
use handoff_proto::sender_endpoint::{SenderEndpoint, SenderEvent, SenderRoomEvent};
use handoff_proto::{AuxSlot, PageIndex, PeerId, RankId, Role, RoomId};

/// splitmix64: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Node {
    Prefill(u32),
    Decode(u32),
}

#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    drop: f64,
    duplicate: f64,
    max_extra_delay_ms: u64,
}

#[derive(Debug, Clone)]
enum Task {
    Deliver {
        from: Node,
        to: Node,
        bytes: Vec<u8>,
    },
    OpenPrefill {
        p: u32,
        room: RoomId,
    },
    OpenDecode {
        d: u32,
        room: RoomId,
        pages: u32,
    },
    Reserve {
        d: u32,
        room: RoomId,
        pages: u32,
    },
    ComputeDone {
        p: u32,
        room: RoomId,
    },
    WriteDone {
        p: u32,
        d: u32,
        room: RoomId,
    },
    EngineFinish {
        d: u32,
        room: RoomId,
    },
    ClientAbort {
        d: u32,
        room: RoomId,
    },
    PrefillReject {
        p: u32,
        room: RoomId,
    },
    Crash(Node),
}

/// A room's event sink (the request task's handle): its room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Waiter(RoomId);

/// In-flight writes: (prefill rank, decode rank, room) -> destination pages.
type Writes = Rc<RefCell<BTreeMap<(u32, u32, RoomId), Vec<PageIndex>>>>;

/// One decode rank's pool of pages and aux slots.
struct Pool {
    free_pages: BTreeSet<PageIndex>,
    free_aux: BTreeSet<u32>,
    /// The process died: its memory is gone, nothing is checked any more.
    crashed: bool,
}

/// The decode engine's lease of a room's pages and aux slot: dropping it
/// returns them to the pool, and checks that no prefill write into them is
/// still in flight (no page is freed under a write).
#[derive(Debug)]
struct SimLease {
    d: u32,
    room: RoomId,
    pages: Vec<PageIndex>,
    aux: u32,
    pool: Rc<RefCell<Pool>>,
    writes: Writes,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool({} free)", self.free_pages.len())
    }
}

impl Drop for SimLease {
    fn drop(&mut self) {
        let mut pool = self.pool.borrow_mut();
        if pool.crashed {
            return;
        }
        for ((p, wd, wr), wpages) in self.writes.borrow().iter() {
            let overlap = *wd == self.d && wpages.iter().any(|x| self.pages.contains(x));
            assert!(
                !overlap,
                "decode {}: pages of {} freed while prefill {p} still writes {wr} into them",
                self.d, self.room
            );
        }
        for p in &self.pages {
            assert!(pool.free_pages.insert(*p), "{p} released twice");
        }
        assert!(pool.free_aux.insert(self.aux), "aux slot released twice");
    }
}

/// A prefill rank: the real endpoint (no link streams or cancel tokens: the
/// simulation's ledger of writes plays the link writers).
struct PrefillNode {
    ep: SenderEndpoint<(), Waiter, ()>,
    decoders: BTreeMap<u32, FrameDecoder>,
}

/// A decode rank: the real endpoint over the simulation's leases.
struct DecodeNode {
    ep: ReceiverEndpoint<SimLease, Waiter>,
    decoders: BTreeMap<u32, FrameDecoder>,
    pool: Rc<RefCell<Pool>>,
}

const PAGES: u32 = 64;
const AUX_SLOTS: u32 = 16;
const LATENCY: Duration = Duration::from_millis(1);
const KV_HEADS: u32 = 8;

struct Sim {
    now: Instant,
    t0: Instant,
    rng: Rng,
    faults: Faults,
    neg: Negotiated,
    map: RankMap,
    prefill: Vec<Option<PrefillNode>>,
    decode: Vec<Option<DecodeNode>>,
    tasks: Vec<(Instant, u64, Task)>,
    seq: u64,
    writes: Writes,
    cancelled: BTreeSet<(u32, u32, RoomId)>,
    /// Leases the decode engines hold after a commit.
    engine: BTreeMap<(u32, RoomId), SimLease>,
    /// Pages of each submitted room.
    room_pages: BTreeMap<RoomId, u32>,
    decode_result: BTreeMap<(u32, RoomId), (Duration, Result<(), TransferError>)>,
    prefill_result: BTreeMap<(u32, RoomId), (Duration, Result<(), TransferError>)>,
    released_at: BTreeMap<(u32, RoomId), (Duration, bool)>,
    submitted: BTreeSet<RoomId>,
    compute_ms: u64,
    write_ms: u64,
}

fn room(n: u64) -> RoomId {
    RoomId::new(n).unwrap()
}

fn handshake_pair(decode_v1: bool) -> Negotiated {
    let p = HandshakeConfig::new(Role::Prefill, sample_fingerprint());
    let mut d = HandshakeConfig::new(Role::Decode, sample_fingerprint());
    if decode_v1 {
        d.max_version = 1;
        d.capabilities = Capabilities::V1;
    }
    let mut hp = Handshake::new(p, [1; 32]);
    let mut hd = Handshake::new(d, [2; 32]);
    for _ in 0..4 {
        let to_p: Vec<Message> = std::iter::from_fn(|| hd.poll_transmit()).collect();
        let to_d: Vec<Message> = std::iter::from_fn(|| hp.poll_transmit()).collect();
        for m in to_p {
            hp.handle(m).unwrap();
        }
        for m in to_d {
            hd.handle(m).unwrap();
        }
    }
    let n = hp.negotiated().unwrap().clone();
    assert_eq!(n.capabilities, hd.negotiated().unwrap().capabilities);
    n
}

impl Sim {
    fn new(prefill_tp: u32, decode_tp: u32, seed: u64, faults: Faults, decode_v1: bool) -> Self {
        let t0 = Instant::now();
        let neg = handshake_pair(decode_v1);
        let decoder = || {
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
            d.set_capabilities(neg.capabilities);
            d
        };
        // Every pair is connected (control connection and data link) from
        // the start; a crash is seen through heartbeats.
        let prefill = (0..prefill_tp)
            .map(|_| {
                let mut ep = SenderEndpoint::new(RoomConfig::default(), 1, 1);
                for d in 0..decode_tp {
                    let rank = PeerId(d);
                    assert!(ep.handle_control_up(rank, 1, 1, t0));
                    assert!(ep.handle_link_stream(rank, 1, (1, 0, 1), (), t0).is_some());
                    ep.handle_link_up(rank, 1, PAGES as usize);
                }
                Some(PrefillNode {
                    ep,
                    decoders: (0..decode_tp).map(|d| (d, decoder())).collect(),
                })
            })
            .collect();
        let decode = (0..decode_tp)
            .map(|d| {
                let mut fp = sample_fingerprint();
                (fp.kv_heads, fp.tp_rank, fp.tp_size) = (KV_HEADS, d, decode_tp);
                let mut ep =
                    ReceiverEndpoint::new(RoomConfig::default(), fp, Duration::from_secs(5));
                for p in 0..prefill_tp {
                    assert!(ep.handle_control_up(PeerId(p), 1, Capabilities::ALL, t0));
                    let tp = TpPosition {
                        rank: p,
                        size: prefill_tp,
                    };
                    ep.handle_link_up(PeerId(p), 1, tp);
                }
                Some(DecodeNode {
                    ep,
                    decoders: (0..prefill_tp).map(|p| (p, decoder())).collect(),
                    pool: Rc::new(RefCell::new(Pool {
                        free_pages: (0..PAGES).map(PageIndex).collect(),
                        free_aux: (0..AUX_SLOTS).collect(),
                        crashed: false,
                    })),
                })
            })
            .collect();
        Sim {
            now: t0,
            t0,
            rng: Rng(seed),
            faults,
            neg,
            map: RankMap::new(KV_HEADS, prefill_tp, decode_tp).unwrap(),
            prefill,
            decode,
            tasks: Vec::new(),
            seq: 0,
            writes: Writes::default(),
            cancelled: BTreeSet::new(),
            engine: BTreeMap::new(),
            room_pages: BTreeMap::new(),
            decode_result: BTreeMap::new(),
            prefill_result: BTreeMap::new(),
            released_at: BTreeMap::new(),
            submitted: BTreeSet::new(),
            compute_ms: 50,
            write_ms: 20,
        }
    }

    fn prefill_tp(&self) -> u32 {
        self.prefill.len() as u32
    }

    fn decode_tp(&self) -> u32 {
        self.decode.len() as u32
    }

    fn elapsed(&self) -> Duration {
        self.now - self.t0
    }

    fn schedule(&mut self, after: Duration, task: Task) {
        self.seq += 1;
        self.tasks.push((self.now + after, self.seq, task));
    }

    /// Router: the same request to every prefill and decode rank, with a
    /// small random skew (so destinations sometimes arrive before a prefill
    /// opened the room and are parked).
    fn submit(&mut self, r: RoomId, pages: u32) {
        self.submitted.insert(r);
        self.room_pages.insert(r, pages);
        for p in 0..self.prefill_tp() {
            let skew = Duration::from_millis(self.rng.below(8));
            self.schedule(skew, Task::OpenPrefill { p, room: r });
        }
        for d in 0..self.decode_tp() {
            let skew = Duration::from_millis(self.rng.below(3));
            self.schedule(skew, Task::OpenDecode { d, room: r, pages });
        }
    }

    fn send(&mut self, from: Node, t: Transmit) {
        let to = match from {
            Node::Decode(_) => Node::Prefill(t.to.0),
            Node::Prefill(_) => Node::Decode(t.to.0),
        };
        let mut bytes = Vec::new();
        encode_frame(
            &t.message,
            self.neg.version,
            self.neg.capabilities,
            self.neg.peer_max_frame_len,
            &mut bytes,
        )
        .expect("control frames fit");
        if self.rng.chance(self.faults.drop) {
            return;
        }
        let copies = if self.rng.chance(self.faults.duplicate) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let extra = Duration::from_millis(self.rng.below(self.faults.max_extra_delay_ms + 1));
            self.schedule(
                LATENCY + extra,
                Task::Deliver {
                    from,
                    to,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    fn next_time(&self) -> Option<Instant> {
        let mut t: Vec<Instant> = self.tasks.iter().map(|(at, _, _)| *at).collect();
        t.extend(
            self.prefill
                .iter()
                .flatten()
                .filter_map(|n| n.ep.poll_timeout()),
        );
        t.extend(
            self.decode
                .iter()
                .flatten()
                .filter_map(|n| n.ep.poll_timeout()),
        );
        t.into_iter().min()
    }

    /// Advance to the next event and process everything due.
    fn step(&mut self) -> bool {
        let Some(at) = self.next_time() else {
            return false;
        };
        self.now = self.now.max(at);
        let now = self.now;
        self.tasks.sort_by_key(|(at, seq, _)| (*at, *seq));
        let n = self
            .tasks
            .iter()
            .take_while(|(at, _, _)| *at <= now)
            .count();
        let due: Vec<Task> = self.tasks.drain(..n).map(|(_, _, t)| t).collect();
        for task in due {
            self.run_task(task);
            self.flush();
        }
        for n in self.prefill.iter_mut().flatten() {
            n.ep.handle_timeout(now);
        }
        for n in self.decode.iter_mut().flatten() {
            n.ep.handle_timeout(now);
        }
        self.flush();
        true
    }

    fn run_task(&mut self, task: Task) {
        let now = self.now;
        match task {
            Task::Deliver { from, to, bytes } => {
                let (peer, msgs) = match (from, to) {
                    (Node::Decode(d), Node::Prefill(p)) => {
                        let Some(n) = self.prefill[p as usize].as_mut() else {
                            return;
                        };
                        (d, decode_frames(n.decoders.get_mut(&d), &bytes))
                    }
                    (Node::Prefill(p), Node::Decode(d)) => {
                        let Some(n) = self.decode[d as usize].as_mut() else {
                            return;
                        };
                        (p, decode_frames(n.decoders.get_mut(&p), &bytes))
                    }
                    _ => return,
                };
                for m in msgs {
                    match to {
                        Node::Prefill(p) => {
                            if let Some(n) = self.prefill[p as usize].as_mut() {
                                n.ep.handle_message(PeerId(peer), m, now);
                            }
                        }
                        Node::Decode(d) => {
                            if let Some(n) = self.decode[d as usize].as_mut() {
                                n.ep.handle_message(PeerId(peer), m, now);
                            }
                        }
                    }
                }
            }
            Task::OpenPrefill { p, room: r } => {
                if let Some(n) = self.prefill[p as usize].as_mut() {
                    match n.ep.open(r, (), Waiter(r), now) {
                        Ok(()) => {}
                        // Decode aborted first: the request is answered now.
                        Err(e) => {
                            self.prefill_result.insert((p, r), (now - self.t0, Err(e)));
                        }
                    }
                }
            }
            Task::OpenDecode { d, room: r, pages } => {
                let sources =
                    Source::for_decode_rank(&self.map, RankId(d), |r| PeerId(r.0)).unwrap();
                let Some(n) = self.decode[d as usize].as_mut() else {
                    return;
                };
                n.ep.open(r, sources, Waiter(r), now).expect("fresh room");
                // Page reservation takes a moment (prealloc queue).
                self.schedule(
                    Duration::from_millis(2),
                    Task::Reserve { d, room: r, pages },
                );
            }
            Task::Reserve { d, room: r, pages } => {
                let Some(n) = self.decode[d as usize].as_mut() else {
                    return;
                };
                let taken = {
                    let mut pool = n.pool.borrow_mut();
                    match (
                        pool.free_aux.first().copied(),
                        pool.free_pages.len() >= pages as usize,
                    ) {
                        (Some(aux), true) => {
                            let taken: Vec<PageIndex> = pool
                                .free_pages
                                .iter()
                                .take(pages as usize)
                                .copied()
                                .collect();
                            for p in &taken {
                                pool.free_pages.remove(p);
                            }
                            pool.free_aux.remove(&aux);
                            Some((taken, aux))
                        }
                        _ => None,
                    }
                };
                let Some((taken, aux)) = taken else {
                    self.schedule(
                        Duration::from_millis(5),
                        Task::Reserve { d, room: r, pages },
                    );
                    return;
                };
                let lease = SimLease {
                    d,
                    room: r,
                    pages: taken.clone(),
                    aux,
                    pool: n.pool.clone(),
                    writes: self.writes.clone(),
                };
                // A refused reservation drops the lease: the pages were never
                // advertised and come straight back.
                let _ = n.ep.reserve(r, lease, taken, AuxSlot(aux), Some(0), now);
            }
            Task::ComputeDone { p, room: r } => {
                let pages = self.room_pages[&r] as usize;
                let Some(n) = self.prefill[p as usize].as_mut() else {
                    return;
                };
                // The whole room in one send (the real engine streams it
                // layer by layer), then the end of the room.
                let Ok((dests, ())) = n.ep.send(r, 0..1, 0..pages, now) else {
                    return; // it failed meanwhile
                };
                let aux = AuxData {
                    first_token: 1,
                    logprob: 0.0,
                    top: handoff_proto::datalink::TopLogprobs::NONE,
                };
                n.ep.finish(r, aux, std::sync::Arc::from([]), now)
                    .expect("writes started");
                let expected = self.map.destination_ranks(RankId(p)).unwrap();
                for w in dests {
                    let (d, dest) = (w.peer, w.destination);
                    assert!(
                        expected.contains(&RankId(d.0)),
                        "prefill {p} writes {r} to {d}"
                    );
                    assert!(
                        self.writes
                            .borrow_mut()
                            .insert((p, d.0, r), dest.pages.clone())
                            .is_none(),
                        "two writes of one room"
                    );
                }
                for d in expected {
                    assert!(
                        self.writes.borrow().contains_key(&(p, d.0, r))
                            || self.decode[d.0 as usize].is_none(),
                        "prefill {p} does not write {r} to live decode {d}"
                    );
                }
            }
            Task::WriteDone { p, d, room: r } => {
                if self.writes.borrow_mut().remove(&(p, d, r)).is_none() {
                    return;
                }
                let cancelled = self.cancelled.remove(&(p, d, r));
                // The first source of a decode rank writes its aux record,
                // after the KV, carrying the room id.
                let first_source = self.map.required_prefill_ranks(RankId(d)).unwrap()[0].0;
                let decode_alive = self.decode[d as usize].is_some();
                if !cancelled && p == first_source {
                    if let Some(n) = self.decode[d as usize].as_mut() {
                        let aux = AuxData {
                            first_token: 1,
                            logprob: 0.0,
                            top: handoff_proto::datalink::TopLogprobs::NONE,
                        };
                        n.ep.handle_aux(r, r.get(), aux, Vec::new());
                    }
                }
                let Some(n) = self.prefill[p as usize].as_mut() else {
                    return;
                };
                if decode_alive {
                    // The end marker's ack (a cancelled room's too: the
                    // endpoint knows its writes were cancelled).
                    n.ep.handle_ack(PeerId(d), r, true, now);
                } else {
                    let err = TransferError::PeerDead {
                        peer: PeerId(d),
                        detail: "write into a dead process".into(),
                    };
                    n.ep.handle_write_failed(r, PeerId(d), err, now);
                }
            }
            Task::EngineFinish { d, room: r } => {
                drop(self.engine.remove(&(d, r)));
            }
            Task::ClientAbort { d, room: r } => {
                if let Some(n) = self.decode[d as usize].as_mut() {
                    let e = TransferError::Aborted {
                        origin: AbortOrigin::Client,
                        reason: "client disconnected".into(),
                        http_status: 499,
                    };
                    n.ep.abort(r, e, now);
                }
            }
            Task::PrefillReject { p, room: r } => {
                if let Some(n) = self.prefill[p as usize].as_mut() {
                    let e = TransferError::Rejected {
                        http_status: 400,
                        reason: "prompt too long".into(),
                        code: None,
                    };
                    n.ep.fail(r, e, now);
                }
            }
            Task::Crash(Node::Prefill(p)) => {
                // The process is gone: its writes stop, its state is lost.
                self.prefill[p as usize] = None;
                self.writes.borrow_mut().retain(|(k, _, _), _| *k != p);
                self.tasks.retain(|(_, _, t)| !matches!(t, Task::Deliver { from: Node::Prefill(k), .. } if *k == p));
            }
            Task::Crash(Node::Decode(d)) => {
                if let Some(n) = self.decode[d as usize].take() {
                    n.pool.borrow_mut().crashed = true;
                }
                self.engine.retain(|(k, _), _| *k != d);
                self.tasks.retain(|(_, _, t)| !matches!(t, Task::Deliver { from: Node::Decode(k), .. } if *k == d));
                // Writes into a dead process fail quickly.
                let inflight: Vec<(u32, u32, RoomId)> = self
                    .writes
                    .borrow()
                    .keys()
                    .copied()
                    .filter(|(_, k, _)| *k == d)
                    .collect();
                for (p, d, r) in inflight {
                    self.schedule(Duration::from_millis(1), Task::WriteDone { p, d, room: r });
                }
            }
        }
    }

    fn flush(&mut self) {
        loop {
            let mut progressed = false;
            let now = self.now;
            for p in 0..self.prefill_tp() {
                let Some(n) = self.prefill[p as usize].as_mut() else {
                    continue;
                };
                let events: Vec<_> = std::iter::from_fn(|| n.ep.poll_event()).collect();
                let txs: Vec<Transmit> = std::iter::from_fn(|| n.ep.poll_transmit(now)).collect();
                progressed |= !txs.is_empty() || !events.is_empty();
                for e in events {
                    self.prefill_event(p, e);
                }
                for t in txs {
                    self.send(Node::Prefill(p), t);
                }
            }
            for d in 0..self.decode_tp() {
                let Some(n) = self.decode[d as usize].as_mut() else {
                    continue;
                };
                let events: Vec<_> = std::iter::from_fn(|| n.ep.poll_event()).collect();
                let txs: Vec<Transmit> = std::iter::from_fn(|| n.ep.poll_transmit(now)).collect();
                progressed |= !txs.is_empty() || !events.is_empty();
                for e in events {
                    self.decode_event(d, e);
                }
                for t in txs {
                    self.send(Node::Decode(d), t);
                }
            }
            if !progressed {
                break;
            }
        }
    }

    fn prefill_event(&mut self, p: u32, e: SenderEvent<Waiter, ()>) {
        match e {
            SenderEvent::Finish {
                peer: rank,
                room: r,
                aux: Some(_),
                ..
            } => {
                let ms = self.write_ms + self.rng.below(5);
                self.schedule(
                    Duration::from_millis(ms),
                    Task::WriteDone {
                        p,
                        d: rank.0,
                        room: r,
                    },
                );
            }
            // A cancelled room's end: its writes are acked through `Cancel`.
            SenderEvent::Finish { aux: None, .. } | SenderEvent::ClosePeer { .. } => {}
            SenderEvent::Cancel { room: r, .. } => {
                let inflight: Vec<u32> = self
                    .writes
                    .borrow()
                    .keys()
                    .filter(|(k, _, rr)| *k == p && *rr == r)
                    .map(|(_, d, _)| *d)
                    .collect();
                for d in inflight {
                    self.cancelled.insert((p, d, r));
                    self.schedule(Duration::from_millis(1), Task::WriteDone { p, d, room: r });
                }
            }
            SenderEvent::Room {
                sink: Waiter(r),
                event: SenderRoomEvent::Ready,
            } => {
                let ms = self.compute_ms;
                self.schedule(Duration::from_millis(ms), Task::ComputeDone { p, room: r });
            }
            SenderEvent::Room {
                sink: Waiter(r),
                event,
            } => {
                let result = match event {
                    SenderRoomEvent::Success => Ok(()),
                    SenderRoomEvent::Failed(e) => Err(e),
                    other => panic!("prefill {p} room {r} ended as {other:?}"),
                };
                let at = self.elapsed();
                assert!(
                    self.prefill_result.insert((p, r), (at, result)).is_none(),
                    "prefill {p} finished {r} twice"
                );
                assert!(
                    !self
                        .writes
                        .borrow()
                        .keys()
                        .any(|(k, _, rr)| *k == p && *rr == r),
                    "prefill {p} finished {r} with a write in flight"
                );
            }
        }
    }

    fn decode_event(&mut self, d: u32, e: ReceiverEvent<SimLease, Waiter>) {
        match e {
            ReceiverEvent::RegisterWrites { .. }
            | ReceiverEvent::ForgetWrites { .. }
            | ReceiverEvent::ClosePeer { .. } => {}
            ReceiverEvent::Released {
                room: r,
                fence_expired,
            } => {
                assert!(
                    matches!(self.decode_result.get(&(d, r)), Some((_, Err(_)))),
                    "released {r} before failing it"
                );
                let at = self.elapsed();
                self.released_at.insert((d, r), (at, fence_expired));
            }
            ReceiverEvent::Outcome {
                room: r,
                waiter,
                outcome,
            } => {
                assert_eq!(waiter, Waiter(r));
                let at = self.elapsed();
                let result = match outcome {
                    ReceiverOutcome::Success { lease, aux, .. } => {
                        self.assert_no_write_into(d, r, &lease.pages, "committed");
                        assert_eq!(aux.first_token, 1);
                        self.engine.insert((d, r), lease);
                        self.schedule(Duration::from_millis(10), Task::EngineFinish { d, room: r });
                        Ok(())
                    }
                    ReceiverOutcome::Failed(e) => Err(e),
                };
                assert!(
                    self.decode_result.insert((d, r), (at, result)).is_none(),
                    "decode {d} answered {r} twice"
                );
            }
        }
    }

    fn assert_no_write_into(&self, d: u32, r: RoomId, pages: &[PageIndex], what: &str) {
        for ((p, wd, wr), wpages) in self.writes.borrow().iter() {
            let overlap = *wd == d && wpages.iter().any(|x| pages.contains(x));
            assert!(
                !overlap,
                "decode {d}: pages of {r} {what} while prefill {p} still writes {wr} into them"
            );
        }
    }

    fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Sim) -> bool) -> bool {
        let end = self.now + limit;
        while self.now < end {
            if done(self) {
                return true;
            }
            if !self.step() {
                break;
            }
        }
        done(self)
    }

    fn decode_state(&self, d: u32, r: RoomId) -> Option<RoomState> {
        self.decode[d as usize].as_ref().and_then(|n| n.ep.state(r))
    }

    fn prefill_state(&self, p: u32, r: RoomId) -> Option<RoomState> {
        self.prefill[p as usize]
            .as_ref()
            .and_then(|n| n.ep.state(r))
    }

    fn quiet(&self) -> bool {
        let rooms_done = self
            .prefill
            .iter()
            .flatten()
            .all(|n| n.ep.stats().live_rooms == 0)
            && self
                .decode
                .iter()
                .flatten()
                .all(|n| n.ep.stats().live_rooms == 0);
        let work_done = !self
            .tasks
            .iter()
            .any(|(_, _, t)| !matches!(t, Task::Deliver { .. }));
        rooms_done && work_done && self.writes.borrow().is_empty()
    }

    /// Run until everything settles, then check nothing is left behind.
    fn finish(&mut self) {
        let settled = self.run_until(Duration::from_secs(600), Sim::quiet);
        assert!(settled, "did not settle: {}", self.debug_live());
        assert!(self.writes.borrow().is_empty());
        assert!(self.engine.is_empty());
        for (p, n) in self.prefill.iter().enumerate() {
            let Some(n) = n else { continue };
            let s = n.ep.stats();
            assert_eq!(
                (s.live_rooms, s.writing_rooms, s.sinks),
                (0, 0, 0),
                "prefill {p} kept rooms, writes or sinks"
            );
            assert!(n.decoders.values().all(|d| d.stats().errors == 0));
            for r in &self.submitted {
                assert!(
                    self.prefill_result.contains_key(&(p as u32, *r)),
                    "prefill {p} never answered {r}"
                );
            }
        }
        for (d, n) in self.decode.iter().enumerate() {
            let Some(n) = n else { continue };
            let s = n.ep.stats();
            assert_eq!(
                (s.live_rooms, s.leased_rooms, s.waiters),
                (0, 0, 0),
                "decode {d} kept rooms, leases or sinks"
            );
            let pool = n.pool.borrow();
            assert_eq!(
                pool.free_pages.len(),
                PAGES as usize,
                "decode {d} leaked pages"
            );
            assert_eq!(
                pool.free_aux.len(),
                AUX_SLOTS as usize,
                "decode {d} leaked aux slots"
            );
            for r in &self.submitted {
                assert!(
                    self.decode_result.contains_key(&(d as u32, *r)),
                    "decode {d} never answered {r}"
                );
            }
        }
        // A decode commit implies every prefill rank it needs succeeded.
        for ((d, r), (_, res)) in &self.decode_result {
            if res.is_ok() {
                for p in self.map.required_prefill_ranks(RankId(*d)).unwrap() {
                    if let Some((_, pres)) = self.prefill_result.get(&(p.0, *r)) {
                        assert!(
                            pres.is_ok(),
                            "decode {d} committed {r} but prefill {} failed: {pres:?}",
                            p.0
                        );
                    }
                }
            }
        }
    }

    fn debug_live(&self) -> String {
        let mut s = String::new();
        for r in &self.submitted {
            s += &format!("{r}:");
            for d in 0..self.decode_tp() {
                s += &format!(" decode{d} {:?}", self.decode_state(d, *r));
            }
            for p in 0..self.prefill_tp() {
                s += &format!(" prefill{p} {:?}", self.prefill_state(p, *r));
            }
            s += "; ";
        }
        s + &format!(
            "writes {:?} tasks {}",
            self.writes.borrow(),
            self.tasks.len()
        )
    }

    fn decode_error(&self, d: u32, r: RoomId) -> &TransferError {
        match self.decode_result.get(&(d, r)) {
            Some((_, Err(e))) => e,
            other => panic!("expected decode {d} failure for {r}, got {other:?}"),
        }
    }

    fn prefill_error(&self, p: u32, r: RoomId) -> &TransferError {
        match self.prefill_result.get(&(p, r)) {
            Some((_, Err(e))) => e,
            other => panic!("expected prefill {p} failure for {r}, got {other:?}"),
        }
    }

    fn all_ok(&self, r: RoomId) -> bool {
        (0..self.decode_tp()).all(|d| matches!(self.decode_result.get(&(d, r)), Some((_, Ok(())))))
            && (0..self.prefill_tp())
                .all(|p| matches!(self.prefill_result.get(&(p, r)), Some((_, Ok(())))))
    }
}

/// The messages in `bytes` off a control connection (none for a peer this
/// node has no decoder for).
fn decode_frames(dec: Option<&mut FrameDecoder>, bytes: &[u8]) -> Vec<Message> {
    let Some(dec) = dec else {
        return Vec::new();
    };
    dec.push(bytes);
    std::iter::from_fn(|| dec.poll())
        .map(|r| r.expect("the simulation sends only valid frames"))
        .collect()
}

#[test]
fn happy_path_in_every_tp_shape() {
    for (p, d) in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (2, 2)] {
        let mut sim = Sim::new(p, d, u64::from(p * 10 + d), Faults::default(), false);
        for n in 1..=4 {
            sim.submit(room(n), 3);
        }
        sim.finish();
        for n in 1..=4 {
            assert!(
                sim.all_ok(room(n)),
                "{p}:{d} room {n}: {:?}",
                sim.decode_result
            );
        }
    }
}

#[test]
fn old_decode_peer_interoperates() {
    let mut sim = Sim::new(1, 1, 3, Faults::default(), true);
    assert_eq!(sim.neg.version, 1);
    sim.submit(room(1), 2);
    sim.submit(room(2), 2);
    sim.schedule(
        Duration::from_millis(20),
        Task::PrefillReject {
            p: 0,
            room: room(2),
        },
    );
    sim.finish();
    assert!(sim.all_ok(room(1)));
    let e = sim.decode_error(0, room(2));
    // v1 has no status field: the kind's default (400 for rejected) applies.
    assert_eq!(
        (e.error_type(), e.http_status(), e.reason()),
        ("rejected", 400, "prompt too long".to_string())
    );
}

/// Decode aborts (client disconnect) while its room is in `state`: every
/// prefill rank learns within milliseconds, not at a timeout (seed 000), and
/// the pages come back on the writers' word, not at the fence.
#[test]
fn decode_abort_in_every_state() {
    for (i, state) in [
        RoomState::Bootstrapping,
        RoomState::WaitingForInput,
        RoomState::Transferring,
    ]
    .into_iter()
    .enumerate()
    {
        for (ptp, dtp) in [(1u32, 1u32), (2, 1)] {
            let mut sim = Sim::new(ptp, dtp, 10 + i as u64, Faults::default(), false);
            let r = room(7);
            sim.submit(r, 3);
            let reached = if state == RoomState::Transferring {
                // A write in flight: watch the prefill's view.
                sim.run_until(Duration::from_secs(5), |s| {
                    s.prefill_state(0, r) == Some(RoomState::Transferring)
                })
            } else {
                sim.run_until(Duration::from_secs(5), |s| {
                    s.decode_state(0, r) == Some(state)
                })
            };
            assert!(reached, "{state:?}");
            let t_abort = sim.elapsed();
            sim.schedule(Duration::ZERO, Task::ClientAbort { d: 0, room: r });
            sim.finish();
            let e = sim.decode_error(0, r);
            assert_eq!(
                (e.error_type(), e.http_status()),
                ("aborted", 499),
                "{state:?}"
            );
            for p in 0..ptp {
                let pe = sim.prefill_error(p, r);
                assert_eq!(
                    (pe.error_type(), pe.http_status()),
                    ("aborted", 499),
                    "{state:?} prefill {p}"
                );
                let (at, _) = sim.prefill_result[&(p, r)];
                assert!(
                    at - t_abort < Duration::from_millis(100),
                    "{state:?}: prefill learned after {:?}",
                    at - t_abort
                );
            }
            if let Some((at, fence)) = sim.released_at.get(&(0, r)) {
                assert!(
                    !fence,
                    "{state:?}: released at the fence, not on the drained ack"
                );
                assert!(
                    *at - t_abort < Duration::from_millis(100),
                    "{state:?}: release took {:?}",
                    *at - t_abort
                );
            } else {
                assert_eq!(
                    state,
                    RoomState::Bootstrapping,
                    "only a room without pages has nothing to release"
                );
            }
        }
    }
}

/// With prefill TP 1 and decode TP 2, one decode rank's abort fails the
/// request on the prefill, which tells the other decode rank with the same
/// reason and status: any rank's failure fails it everywhere, promptly.
#[test]
fn one_decode_rank_aborting_fails_the_other_rank_too() {
    for state in [RoomState::WaitingForInput, RoomState::Transferring] {
        let mut sim = Sim::new(1, 2, 50, Faults::default(), false);
        let r = room(8);
        sim.submit(r, 2);
        assert!(
            sim.run_until(Duration::from_secs(5), |s| s.prefill_state(0, r)
                == Some(state))
        );
        let t_abort = sim.elapsed();
        sim.schedule(Duration::ZERO, Task::ClientAbort { d: 1, room: r });
        sim.finish();
        let other = sim.decode_error(0, r);
        assert_eq!(
            (other.error_type(), other.http_status(), other.reason()),
            ("aborted", 499, "client disconnected".to_string()),
            "{state:?}"
        );
        let (at, _) = sim.decode_result[&(0, r)];
        assert!(
            at - t_abort < Duration::from_millis(100),
            "{state:?}: decode 0 learned after {:?}",
            at - t_abort
        );
        assert_eq!(sim.prefill_error(0, r).error_type(), "aborted");
    }
}

/// Prefill rejects (400) in every state it can: every decode rank fails
/// with the same reason and status, without waiting for a timeout (seed 004).
#[test]
fn prefill_rejection_in_every_state_reaches_decode() {
    for state in [
        RoomState::Bootstrapping,
        RoomState::WaitingForInput,
        RoomState::Transferring,
    ] {
        for (ptp, dtp) in [(1u32, 1u32), (1, 2), (2, 1)] {
            let mut sim = Sim::new(ptp, dtp, 20, Faults::default(), false);
            let r = room(9);
            sim.submit(r, 2);
            let ok = if state == RoomState::Bootstrapping {
                // Before any destination reached prefill 0.
                sim.run_until(Duration::from_secs(5), |s| s.prefill_state(0, r).is_some())
            } else {
                sim.run_until(Duration::from_secs(5), |s| {
                    s.prefill_state(0, r) == Some(state)
                })
            };
            assert!(ok, "{state:?}");
            let t_reject = sim.elapsed();
            sim.schedule(Duration::ZERO, Task::PrefillReject { p: 0, room: r });
            sim.finish();
            for d in 0..dtp {
                let e = sim.decode_error(d, r);
                assert_eq!(
                    (e.error_type(), e.http_status(), e.reason()),
                    ("rejected", 400, "prompt too long".to_string()),
                    "{state:?} {ptp}:{dtp} decode {d}"
                );
                let (at, _) = sim.decode_result[&(d, r)];
                assert!(
                    at - t_reject < Duration::from_millis(100),
                    "{state:?}: decode {d} learned after {:?}",
                    at - t_reject
                );
            }
            assert_eq!(sim.prefill_error(0, r).http_status(), 400);
        }
    }
}

/// A peer process dies in each state: the other side fails the room as
/// peer-dead within the heartbeat bound and leaks nothing.
#[test]
fn peer_crash_in_every_state() {
    let bound = Duration::from_secs(5) + Duration::from_secs(1) + Duration::from_millis(50);
    for victim in [Node::Prefill(0), Node::Decode(0)] {
        for state in [
            RoomState::Bootstrapping,
            RoomState::WaitingForInput,
            RoomState::Transferring,
        ] {
            let mut sim = Sim::new(1, 1, 30, Faults::default(), false);
            let r = room(11);
            sim.submit(r, 2);
            let reached = sim.run_until(Duration::from_secs(5), |s| {
                s.prefill_state(0, r) == Some(state)
                    || (state == RoomState::Bootstrapping && s.decode_state(0, r) == Some(state))
            });
            assert!(reached);
            let t_crash = sim.elapsed();
            sim.schedule(Duration::ZERO, Task::Crash(victim));
            sim.finish();
            let (at, e) = match victim {
                Node::Prefill(_) => (sim.decode_result[&(0, r)].0, sim.decode_error(0, r).clone()),
                Node::Decode(_) => (
                    sim.prefill_result[&(0, r)].0,
                    sim.prefill_error(0, r).clone(),
                ),
            };
            if victim == Node::Decode(0) && state == RoomState::Bootstrapping {
                // No destination arrived yet: prefill cannot know which
                // decode the room belongs to, so its bootstrap deadline is
                // the bound.
                assert_eq!(e.to_string(), "timed out in bootstrapping after 30.0 s");
                continue;
            }
            // A write into a dead decode fails even sooner, as a transport error.
            assert!(
                matches!(e.error_type(), "peer_dead" | "internal"),
                "{victim:?} {state:?}: {e}"
            );
            assert!(
                at - t_crash <= bound,
                "{victim:?} {state:?}: noticed after {:?}",
                at - t_crash
            );
            if victim == Node::Prefill(0) {
                // The dead writer's pages wait for the fence, then come back.
                if let Some((_, fence)) = sim.released_at.get(&(0, r)) {
                    assert!(
                        *fence,
                        "{state:?}: pages of a dead writer released before the fence"
                    );
                }
            }
        }
    }
}

#[test]
fn abort_for_unknown_room_creates_nothing() {
    let mut sim = Sim::new(1, 1, 40, Faults::default(), false);
    sim.schedule(
        Duration::ZERO,
        Task::ClientAbort {
            d: 0,
            room: room(99),
        },
    );
    // An abort frame straight to prefill for a room it never saw.
    let abort = Abort {
        room: room(98),
        reason: "x".into(),
        http_status: Some(499),
        origin: Some(AbortOrigin::Client),
    };
    sim.send(
        Node::Decode(0),
        Transmit {
            to: PeerId(0),
            message: Message::Abort(abort),
        },
    );
    sim.run_until(Duration::from_secs(1), |_| false);
    let p = sim.prefill[0].as_ref().unwrap().ep.stats();
    assert_eq!(p.live_rooms, 0);
    assert_eq!(p.room_stats.unknown_room_events, 1);
    let d = sim.decode[0].as_ref().unwrap().ep.stats();
    assert_eq!(
        d.room_stats.unknown_room_events, 2,
        "the ack and the local abort"
    );
    sim.finish();
}

#[test]
fn duplicate_live_room_is_rejected_not_crashed() {
    let mut sim = Sim::new(1, 1, 41, Faults::default(), false);
    sim.submit(room(5), 2);
    sim.run_until(Duration::from_millis(20), |_| false);
    let now = sim.now;
    let err = sim.prefill[0]
        .as_mut()
        .unwrap()
        .ep
        .open(room(5), (), Waiter(room(5)), now)
        .unwrap_err();
    assert_eq!(
        (err.error_type(), err.http_status()),
        ("duplicate_room", 409)
    );
    let sources = vec![Source {
        peer: PeerId(0),
        required_destinations: 1,
    }];
    let err = sim.decode[0]
        .as_mut()
        .unwrap()
        .ep
        .open(room(5), sources, Waiter(room(5)), now)
        .unwrap_err();
    assert_eq!(TransferError::from(err).error_type(), "duplicate_room");
    sim.finish();
    assert!(sim.all_ok(room(5)));
}

/// Random drop / duplicate / delay (reorder) with random aborts, rejections
/// and crashes over several TP shapes; every request ends on every rank,
/// nothing leaks, no page is released under a write.
#[test]
fn random_faults_leave_nothing_behind() {
    let shapes = [(1u32, 1u32), (2, 1), (1, 2), (2, 2)];
    let mut outcomes: BTreeMap<&'static str, u32> = BTreeMap::new();
    for seed in 0..48u64 {
        let faults = Faults {
            drop: 0.03 * (seed % 4) as f64,
            duplicate: 0.05 * (seed % 3) as f64,
            max_extra_delay_ms: 5 * (seed % 5),
        };
        let (ptp, dtp) = shapes[(seed % 4) as usize];
        let mut sim = Sim::new(ptp, dtp, 1000 + seed, faults, seed % 7 == 0);
        for n in 1..=4u64 {
            let at = Duration::from_millis(sim.rng.below(200));
            let r = room(seed * 10 + n);
            sim.submit(r, 1 + (n as u32 % 3));
            match sim.rng.below(6) {
                0 => {
                    let d = sim.rng.below(u64::from(dtp)) as u32;
                    sim.schedule(at, Task::ClientAbort { d, room: r });
                }
                1 => {
                    let p = sim.rng.below(u64::from(ptp)) as u32;
                    sim.schedule(at, Task::PrefillReject { p, room: r });
                }
                _ => {}
            }
        }
        match seed % 8 {
            5 => {
                let at = Duration::from_millis(sim.rng.below(150));
                sim.schedule(at, Task::Crash(Node::Prefill(ptp - 1)));
            }
            6 if dtp > 1 => {
                let at = Duration::from_millis(sim.rng.below(150));
                sim.schedule(at, Task::Crash(Node::Decode(dtp - 1)));
            }
            _ => {}
        }
        sim.finish();
        for (_, res) in sim.decode_result.values() {
            *outcomes
                .entry(match res {
                    Ok(()) => "ok",
                    Err(e) => e.error_type(),
                })
                .or_default() += 1;
        }
    }
    // The mix must exercise success and several failure kinds.
    assert!(
        outcomes.get("ok").copied().unwrap_or(0) > 40,
        "{outcomes:?}"
    );
    for kind in ["aborted", "rejected", "timeout", "peer_dead"] {
        assert!(outcomes.contains_key(kind), "no {kind} in {outcomes:?}");
    }
}
