//! Deterministic simulation of prefill and decode room tables on a virtual
//! clock (DESIGN.md §9; quinn's `Pair::drive`). Every control message goes
//! through the real codec over simulated links that can drop, duplicate,
//! delay (and so reorder) frames; peers can crash; aborts and rejections are
//! injected in every state. A tiny shell per node plays the transport and
//! engine: it computes, "writes" pages (a ledger of in-flight writes), checks
//! the aux slot, commits, releases.
//!
//! Checked during every run: decode never releases or commits pages while a
//! write to them is in flight. Checked after every scenario: zero live rooms
//! on every surviving table, every page and aux slot back in its pool, no
//! write in flight, every request answered.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use handoff_proto::error::{AbortOrigin, TransferError};
use handoff_proto::frame::{encode_frame, FrameDecoder, DEFAULT_MAX_FRAME_LEN};
use handoff_proto::fuzz::sample_fingerprint;
use handoff_proto::handshake::{Capabilities, Handshake, HandshakeConfig, Negotiated};
use handoff_proto::heartbeat::Liveness;
use handoff_proto::message::Message;
use handoff_proto::receiver_room::{ReceiverAction, ReceiverRooms, Source};
use handoff_proto::room::{RoomConfig, RoomState, Transmit};
use handoff_proto::sender_room::{SenderAction, SenderRooms};
use handoff_proto::{AuxSlot, PageIndex, RankId, Role, RoomId};

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
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
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
    Decode,
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
        room: RoomId,
        pages: u32,
    },
    Reserve {
        room: RoomId,
        pages: u32,
    },
    ComputeDone {
        p: u32,
        room: RoomId,
    },
    WriteDone {
        p: u32,
        room: RoomId,
    },
    EngineFinish {
        pages: Vec<PageIndex>,
        aux: AuxSlot,
    },
    ClientAbort {
        room: RoomId,
    },
    PrefillReject {
        p: u32,
        room: RoomId,
    },
    Crash(Node),
}

struct PrefillNode {
    rooms: SenderRooms,
    live: Liveness,
    decoder: FrameDecoder,
}

struct DecodeNode {
    rooms: ReceiverRooms,
    live: Liveness,
    decoders: BTreeMap<u32, FrameDecoder>,
}

struct Sim {
    now: Instant,
    t0: Instant,
    rng: Rng,
    faults: Faults,
    neg: Negotiated,
    prefill: Vec<Option<PrefillNode>>,
    decode: Option<DecodeNode>,
    tasks: Vec<(Instant, u64, Task)>,
    seq: u64,
    // Shell ledgers.
    free_pages: BTreeSet<PageIndex>,
    total_pages: usize,
    free_aux: BTreeSet<u32>,
    room_aux: HashMap<RoomId, AuxSlot>,
    aux_content: HashMap<u32, u64>,
    /// (prefill rank, room) -> destination pages being written.
    writes: BTreeMap<(u32, RoomId), Vec<PageIndex>>,
    cancelled: BTreeSet<(u32, RoomId)>,
    // Outcomes.
    decode_result: BTreeMap<RoomId, (Duration, Result<(), TransferError>)>,
    prefill_result: BTreeMap<(u32, RoomId), (Duration, Result<(), TransferError>)>,
    released_at: BTreeMap<RoomId, (Duration, bool)>,
    submitted: BTreeSet<RoomId>,
    compute_ms: u64,
    write_ms: u64,
}

const LATENCY: Duration = Duration::from_millis(1);

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
    fn new(prefill_ranks: u32, seed: u64, faults: Faults, decode_v1: bool) -> Self {
        let t0 = Instant::now();
        let neg = handshake_pair(decode_v1);
        let decoder = || {
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
            d.set_capabilities(neg.capabilities);
            d
        };
        let mut decode = DecodeNode {
            rooms: ReceiverRooms::new(RoomConfig::default()),
            live: Liveness::new(RoomConfig::default().timers),
            decoders: BTreeMap::new(),
        };
        let mut prefill = Vec::new();
        for p in 0..prefill_ranks {
            let mut live = Liveness::new(RoomConfig::default().timers);
            live.add_peer(RankId(0), t0);
            prefill.push(Some(PrefillNode {
                rooms: SenderRooms::new(RoomConfig::default()),
                live,
                decoder: decoder(),
            }));
            decode.live.add_peer(RankId(p), t0);
            decode.decoders.insert(p, decoder());
        }
        Sim {
            now: t0,
            t0,
            rng: Rng(seed),
            faults,
            neg,
            prefill,
            decode: Some(decode),
            tasks: Vec::new(),
            seq: 0,
            free_pages: (0..64).map(PageIndex).collect(),
            total_pages: 64,
            free_aux: (0..16).collect(),
            room_aux: HashMap::new(),
            aux_content: HashMap::new(),
            writes: BTreeMap::new(),
            cancelled: BTreeSet::new(),
            decode_result: BTreeMap::new(),
            prefill_result: BTreeMap::new(),
            released_at: BTreeMap::new(),
            submitted: BTreeSet::new(),
            compute_ms: 50,
            write_ms: 20,
        }
    }

    fn elapsed(&self) -> Duration {
        self.now - self.t0
    }

    fn schedule(&mut self, after: Duration, task: Task) {
        self.seq += 1;
        self.tasks.push((self.now + after, self.seq, task));
    }

    /// Router: the same request to every prefill rank and the decode, with
    /// a small random skew (so destinations sometimes arrive before the
    /// prefill opened the room and are parked).
    fn submit(&mut self, r: RoomId, pages: u32) {
        self.submitted.insert(r);
        for p in 0..self.prefill.len() as u32 {
            let skew = Duration::from_millis(self.rng.below(8));
            self.schedule(skew, Task::OpenPrefill { p, room: r });
        }
        let skew = Duration::from_millis(self.rng.below(3));
        self.schedule(skew, Task::OpenDecode { room: r, pages });
    }

    fn send(&mut self, from: Node, t: Transmit) {
        let to = match from {
            Node::Decode => Node::Prefill(t.to.0),
            Node::Prefill(_) => Node::Decode,
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
        for n in self.prefill.iter().flatten() {
            t.extend(n.rooms.poll_timeout());
            t.extend(n.live.poll_timeout());
        }
        if let Some(d) = &self.decode {
            t.extend(d.rooms.poll_timeout());
            t.extend(d.live.poll_timeout());
        }
        t.into_iter().min()
    }

    /// Advance to the next event and process everything due.
    fn step(&mut self) -> bool {
        let Some(at) = self.next_time() else {
            return false;
        };
        self.now = self.now.max(at);
        let now = self.now;
        // Tasks due, in (time, seq) order.
        self.tasks.sort_by_key(|(at, seq, _)| (*at, *seq));
        let due: Vec<Task> = {
            let n = self
                .tasks
                .iter()
                .take_while(|(at, _, _)| *at <= now)
                .count();
            self.tasks.drain(..n).map(|(_, _, t)| t).collect()
        };
        for task in due {
            self.run_task(task);
            self.flush();
        }
        for p in 0..self.prefill.len() {
            if let Some(n) = self.prefill[p].as_mut() {
                n.rooms.handle_timeout(now);
                for dead in n.live.handle_timeout(now) {
                    n.rooms.handle_peer_dead(dead, now);
                }
            }
        }
        if let Some(d) = self.decode.as_mut() {
            d.rooms.handle_timeout(now);
            for dead in d.live.handle_timeout(now) {
                d.rooms.handle_peer_dead(dead, now);
            }
        }
        self.flush();
        true
    }

    fn run_task(&mut self, task: Task) {
        let now = self.now;
        match task {
            Task::Deliver { from, to, bytes } => match to {
                Node::Prefill(p) => {
                    let Some(n) = self.prefill[p as usize].as_mut() else {
                        return;
                    };
                    n.decoder.push(&bytes);
                    while let Some(r) = n.decoder.poll() {
                        let m = r.expect("the simulation sends only valid frames");
                        n.live.handle_seen(RankId(0), now);
                        n.rooms.handle_message(RankId(0), m, now);
                    }
                }
                Node::Decode => {
                    let Node::Prefill(p) = from else { return };
                    let Some(d) = self.decode.as_mut() else {
                        return;
                    };
                    let Some(dec) = d.decoders.get_mut(&p) else {
                        return;
                    };
                    dec.push(&bytes);
                    while let Some(r) = dec.poll() {
                        let m = r.expect("the simulation sends only valid frames");
                        d.live.handle_seen(RankId(p), now);
                        d.rooms.handle_message(RankId(p), m, now);
                    }
                }
            },
            Task::OpenPrefill { p, room: r } => {
                if let Some(n) = self.prefill[p as usize].as_mut() {
                    if let Err(e) = n.rooms.open(r, now) {
                        // Decode aborted first: the request is answered now.
                        self.prefill_result.insert((p, r), (now - self.t0, Err(e)));
                    }
                }
            }
            Task::OpenDecode { room: r, pages } => {
                let n = self.prefill.len() as u32;
                let Some(d) = self.decode.as_mut() else {
                    return;
                };
                let sources = (0..n)
                    .map(|k| Source {
                        rank: RankId(k),
                        required_destinations: 1,
                    })
                    .collect();
                d.rooms.open(r, sources, now).expect("fresh room");
                // Page reservation takes a moment (prealloc queue).
                self.schedule(Duration::from_millis(2), Task::Reserve { room: r, pages });
            }
            Task::Reserve { room: r, pages } => {
                let Some(d) = self.decode.as_mut() else {
                    return;
                };
                if self.free_pages.len() < pages as usize || self.free_aux.is_empty() {
                    self.schedule(Duration::from_millis(5), Task::Reserve { room: r, pages });
                    return;
                }
                let taken: Vec<PageIndex> = self
                    .free_pages
                    .iter()
                    .take(pages as usize)
                    .copied()
                    .collect();
                for p in &taken {
                    self.free_pages.remove(p);
                }
                let aux = *self.free_aux.iter().next().unwrap();
                self.free_aux.remove(&aux);
                match d
                    .rooms
                    .handle_pages_reserved(r, taken, AuxSlot(aux), Some(0), now)
                {
                    Ok(()) => {
                        self.room_aux.insert(r, AuxSlot(aux));
                    }
                    Err(refused) => {
                        self.free_pages.extend(refused.pages);
                        self.free_aux.insert(refused.aux_slot.0);
                    }
                }
            }
            Task::ComputeDone { p, room: r } => {
                if let Some(n) = self.prefill[p as usize].as_mut() {
                    n.rooms.handle_compute_done(r, now);
                }
            }
            Task::WriteDone { p, room: r } => {
                let Some(pages) = self.writes.remove(&(p, r)) else {
                    return;
                };
                let cancelled = self.cancelled.remove(&(p, r));
                let Some(n) = self.prefill[p as usize].as_mut() else {
                    return;
                };
                if cancelled || self.decode.is_none() {
                    let err = TransferError::Internal {
                        reason: "write cancelled".into(),
                    };
                    n.rooms.handle_write_failed(r, RankId(0), err, now);
                } else {
                    let _ = pages;
                    if p == 0 {
                        // KV first, then aux carrying the room id.
                        if let Some(slot) = self.room_aux.get(&r) {
                            self.aux_content.insert(slot.0, r.get());
                        }
                    }
                    n.rooms.handle_write_done(r, RankId(0), now);
                }
            }
            Task::EngineFinish { pages, aux, .. } => {
                self.free_pages.extend(pages);
                self.aux_content.remove(&aux.0);
                self.free_aux.insert(aux.0);
            }
            Task::ClientAbort { room: r } => {
                if let Some(d) = self.decode.as_mut() {
                    let e = TransferError::Aborted {
                        origin: AbortOrigin::Client,
                        reason: "client disconnected".into(),
                        http_status: 499,
                    };
                    d.rooms.abort(r, e, now);
                }
            }
            Task::PrefillReject { p, room: r } => {
                if let Some(n) = self.prefill[p as usize].as_mut() {
                    n.rooms.fail(
                        r,
                        TransferError::Rejected {
                            http_status: 400,
                            reason: "prompt too long".into(),
                        },
                        now,
                    );
                }
            }
            Task::Crash(Node::Prefill(p)) => {
                // The process is gone: its writes stop, its state is lost.
                self.prefill[p as usize] = None;
                self.writes.retain(|(k, _), _| *k != p);
                self.tasks.retain(|(_, _, t)| !matches!(t, Task::Deliver { from: Node::Prefill(k), .. } if *k == p));
            }
            Task::Crash(Node::Decode) => {
                self.decode = None;
                self.tasks.retain(|(_, _, t)| {
                    !matches!(
                        t,
                        Task::Deliver {
                            from: Node::Decode,
                            ..
                        }
                    )
                });
                // Writes into a dead process fail quickly.
                let inflight: Vec<(u32, RoomId)> = self.writes.keys().copied().collect();
                for (p, r) in inflight {
                    self.schedule(Duration::from_millis(1), Task::WriteDone { p, room: r });
                }
            }
        }
    }

    fn flush(&mut self) {
        loop {
            let mut progressed = false;
            let now = self.now;
            for p in 0..self.prefill.len() as u32 {
                let (txs, acts) = match self.prefill[p as usize].as_mut() {
                    Some(n) => {
                        let mut txs: Vec<Transmit> =
                            std::iter::from_fn(|| n.rooms.poll_transmit()).collect();
                        txs.extend(std::iter::from_fn(|| n.live.poll_transmit(now)));
                        let acts: Vec<SenderAction> =
                            std::iter::from_fn(|| n.rooms.poll_action()).collect();
                        (txs, acts)
                    }
                    None => continue,
                };
                progressed |= !txs.is_empty() || !acts.is_empty();
                for t in txs {
                    self.send(Node::Prefill(p), t);
                }
                for a in acts {
                    self.prefill_action(p, a);
                }
            }
            let (txs, acts) = match self.decode.as_mut() {
                Some(d) => {
                    let mut txs: Vec<Transmit> =
                        std::iter::from_fn(|| d.rooms.poll_transmit()).collect();
                    txs.extend(std::iter::from_fn(|| d.live.poll_transmit(now)));
                    let acts: Vec<ReceiverAction> =
                        std::iter::from_fn(|| d.rooms.poll_action()).collect();
                    (txs, acts)
                }
                None => (vec![], vec![]),
            };
            progressed |= !txs.is_empty() || !acts.is_empty();
            for t in txs {
                self.send(Node::Decode, t);
            }
            for a in acts {
                self.decode_action(a);
            }
            if !progressed {
                break;
            }
        }
    }

    fn prefill_action(&mut self, p: u32, a: SenderAction) {
        match a {
            SenderAction::StartCompute { room: r } => {
                let ms = self.compute_ms;
                self.schedule(Duration::from_millis(ms), Task::ComputeDone { p, room: r });
            }
            SenderAction::StartWrites {
                room: r,
                destinations,
            } => {
                assert!(
                    self.decode_result
                        .get(&r)
                        .is_none_or(|(_, res)| res.is_err()),
                    "write for a committed room"
                );
                for (_, d) in destinations {
                    assert!(
                        self.writes.insert((p, r), d.pages).is_none(),
                        "two writes of one room"
                    );
                }
                let ms = self.write_ms;
                self.schedule(Duration::from_millis(ms), Task::WriteDone { p, room: r });
            }
            SenderAction::CancelWrites { room: r } => {
                if self.writes.contains_key(&(p, r)) {
                    self.cancelled.insert((p, r));
                    self.schedule(Duration::from_millis(1), Task::WriteDone { p, room: r });
                }
            }
            SenderAction::Finished { room: r, result } => {
                let at = self.elapsed();
                assert!(
                    self.prefill_result.insert((p, r), (at, result)).is_none(),
                    "prefill finished {r} twice"
                );
                assert!(
                    !self.writes.contains_key(&(p, r)),
                    "prefill finished {r} with a write in flight"
                );
            }
        }
    }

    fn decode_action(&mut self, a: ReceiverAction) {
        let now = self.now;
        match a {
            ReceiverAction::CheckAux { room: r, aux_slot } => {
                let found = self.aux_content.get(&aux_slot.0).copied().unwrap_or(0);
                if let Some(d) = self.decode.as_mut() {
                    d.rooms.handle_aux_checked(r, found, now);
                }
                self.flush();
            }
            ReceiverAction::Commit {
                room: r,
                pages,
                aux_slot,
            } => {
                self.assert_no_write_into(r, &pages, "committed");
                let at = self.elapsed();
                assert!(self.decode_result.insert(r, (at, Ok(()))).is_none());
                self.room_aux.remove(&r);
                self.schedule(
                    Duration::from_millis(10),
                    Task::EngineFinish {
                        pages,
                        aux: aux_slot,
                    },
                );
            }
            ReceiverAction::FailRequest { room: r, error } => {
                let at = self.elapsed();
                assert!(
                    self.decode_result.insert(r, (at, Err(error))).is_none(),
                    "decode answered {r} twice"
                );
            }
            ReceiverAction::ReleasePages {
                room: r,
                pages,
                aux_slot,
                fence_expired,
            } => {
                self.assert_no_write_into(r, &pages, "released");
                assert!(
                    matches!(self.decode_result.get(&r), Some((_, Err(_)))),
                    "released {r} before failing it"
                );
                for p in &pages {
                    assert!(self.free_pages.insert(*p), "{p} released twice");
                }
                self.aux_content.remove(&aux_slot.0);
                assert!(self.free_aux.insert(aux_slot.0));
                self.room_aux.remove(&r);
                self.released_at
                    .insert(r, (self.now - self.t0, fence_expired));
            }
        }
    }

    fn assert_no_write_into(&self, r: RoomId, pages: &[PageIndex], what: &str) {
        for ((p, wr), wpages) in &self.writes {
            let overlap = wpages.iter().any(|x| pages.contains(x));
            assert!(
                !overlap,
                "pages of {r} {what} while prefill rank {p} still writes {wr} into them"
            );
        }
    }

    fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Sim) -> bool) -> bool {
        let end = self.t0 + limit;
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

    fn decode_state(&self, r: RoomId) -> Option<RoomState> {
        self.decode.as_ref().and_then(|d| d.rooms.state(r))
    }

    fn prefill_state(&self, p: u32, r: RoomId) -> Option<RoomState> {
        self.prefill[p as usize]
            .as_ref()
            .and_then(|n| n.rooms.state(r))
    }

    fn quiet(&self) -> bool {
        let rooms_done = self
            .prefill
            .iter()
            .flatten()
            .all(|n| n.rooms.live_rooms() == 0)
            && self
                .decode
                .as_ref()
                .is_none_or(|d| d.rooms.live_rooms() == 0);
        let work_done = !self
            .tasks
            .iter()
            .any(|(_, _, t)| !matches!(t, Task::Deliver { .. }));
        rooms_done && work_done && self.writes.is_empty()
    }

    /// Run until everything settles, then check nothing is left behind.
    fn finish(&mut self) {
        let settled = self.run_until(Duration::from_secs(600), Sim::quiet);
        assert!(settled, "did not settle: {:?}", self.debug_live());
        for n in self.prefill.iter().flatten() {
            assert_eq!(n.rooms.live_rooms(), 0);
            assert_eq!(n.decoder.stats().errors, 0);
        }
        if let Some(d) = &self.decode {
            assert_eq!(d.rooms.live_rooms(), 0);
            assert_eq!(d.rooms.leased_pages(), 0);
            assert_eq!(self.free_pages.len(), self.total_pages, "pages leaked");
            assert_eq!(self.free_aux.len(), 16, "aux slots leaked");
            for r in &self.submitted {
                assert!(
                    self.decode_result.contains_key(r),
                    "decode never answered {r}"
                );
            }
        }
        assert!(self.writes.is_empty());
        for (p, n) in self.prefill.iter().enumerate() {
            if n.is_some() {
                for r in &self.submitted {
                    assert!(
                        self.prefill_result.contains_key(&(p as u32, *r)),
                        "prefill {p} never answered {r}"
                    );
                }
            }
        }
        // A decode commit implies every prefill rank succeeded.
        for (r, (_, res)) in &self.decode_result {
            if res.is_ok() {
                for p in 0..self.prefill.len() as u32 {
                    if let Some((_, pres)) = self.prefill_result.get(&(p, *r)) {
                        assert!(
                            pres.is_ok(),
                            "decode committed {r} but prefill {p} failed: {pres:?}"
                        );
                    }
                }
            }
        }
    }

    fn debug_live(&self) -> String {
        let mut s = String::new();
        for r in &self.submitted {
            s += &format!("{r}: decode {:?}", self.decode_state(*r));
            for p in 0..self.prefill.len() as u32 {
                s += &format!(" prefill{p} {:?}", self.prefill_state(p, *r));
            }
            s += "; ";
        }
        s + &format!("writes {:?} tasks {}", self.writes, self.tasks.len())
    }

    fn decode_error(&self, r: RoomId) -> &TransferError {
        match self.decode_result.get(&r) {
            Some((_, Err(e))) => e,
            other => panic!("expected decode failure for {r}, got {other:?}"),
        }
    }

    fn prefill_error(&self, p: u32, r: RoomId) -> &TransferError {
        match self.prefill_result.get(&(p, r)) {
            Some((_, Err(e))) => e,
            other => panic!("expected prefill {p} failure for {r}, got {other:?}"),
        }
    }
}

#[test]
fn happy_path_one_to_one() {
    let mut sim = Sim::new(1, 1, Faults::default(), false);
    for n in 1..=5 {
        sim.submit(room(n), 4);
    }
    sim.finish();
    for n in 1..=5 {
        assert!(matches!(sim.decode_result[&room(n)], (_, Ok(()))));
        assert!(matches!(sim.prefill_result[&(0, room(n))], (_, Ok(()))));
    }
}

#[test]
fn happy_path_fan_in_from_two_prefill_ranks() {
    let mut sim = Sim::new(2, 2, Faults::default(), false);
    for n in 1..=3 {
        sim.submit(room(n), 2);
    }
    sim.finish();
    for n in 1..=3 {
        assert!(matches!(sim.decode_result[&room(n)], (_, Ok(()))));
        assert!(matches!(sim.prefill_result[&(1, room(n))], (_, Ok(()))));
    }
}

#[test]
fn old_decode_peer_interoperates() {
    let mut sim = Sim::new(1, 3, Faults::default(), true);
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
    assert!(matches!(sim.decode_result[&room(1)], (_, Ok(()))));
    let e = sim.decode_error(room(2));
    // v1 has no status field: the kind's default (400 for rejected) applies.
    assert_eq!(
        (e.error_type(), e.http_status(), e.reason()),
        ("rejected", 400, "prompt too long".to_string())
    );
}

/// Decode aborts (client disconnect) while its room is in `state`: the
/// prefill learns within milliseconds, not at a timeout (seed 000), and the
/// pages come back on the writers' word, not at the fence.
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
        for ranks in [1u32, 2] {
            let mut sim = Sim::new(ranks, 10 + i as u64, Faults::default(), false);
            let r = room(7);
            sim.submit(r, 3);
            if state == RoomState::Transferring {
                // Transferring on decode once the first rank reported; for a
                // write in flight use the prefill's view instead.
                assert!(
                    sim.run_until(Duration::from_secs(5), |s| s.prefill_state(0, r)
                        == Some(RoomState::Transferring))
                );
            } else {
                assert!(
                    sim.run_until(Duration::from_secs(5), |s| s.decode_state(r) == Some(state)),
                    "{state:?}"
                );
            }
            let t_abort = sim.elapsed();
            sim.schedule(Duration::ZERO, Task::ClientAbort { room: r });
            sim.finish();
            let e = sim.decode_error(r);
            assert_eq!(
                (e.error_type(), e.http_status()),
                ("aborted", 499),
                "{state:?}"
            );
            for p in 0..ranks {
                let pe = sim.prefill_error(p, r);
                assert_eq!(pe.error_type(), "aborted", "{state:?} prefill {p}");
                assert_eq!(pe.http_status(), 499);
                let (at, _) = sim.prefill_result[&(p, r)];
                assert!(
                    at - t_abort < Duration::from_millis(100),
                    "{state:?}: prefill learned after {:?}",
                    at - t_abort
                );
            }
            if let Some((at, fence)) = sim.released_at.get(&r) {
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

/// Prefill rejects (400) in every state it can: decode fails with the same
/// reason and status, without waiting for a timeout (seed 004).
#[test]
fn prefill_rejection_in_every_state_reaches_decode() {
    for state in [
        RoomState::Bootstrapping,
        RoomState::WaitingForInput,
        RoomState::Transferring,
    ] {
        let mut sim = Sim::new(1, 20, Faults::default(), false);
        let r = room(9);
        sim.submit(r, 2);
        // Bootstrapping: reject before decode's destination arrives.
        let ok = if state == RoomState::Bootstrapping {
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
        let e = sim.decode_error(r);
        assert_eq!(
            (e.error_type(), e.http_status(), e.reason()),
            ("rejected", 400, "prompt too long".to_string()),
            "{state:?}"
        );
        let (at, _) = sim.decode_result[&r];
        assert!(
            at - t_reject < Duration::from_millis(100),
            "{state:?}: decode learned after {:?}",
            at - t_reject
        );
        assert_eq!(sim.prefill_error(0, r).http_status(), 400);
    }
}

/// A peer process dies in each state: the other side fails the room as
/// peer-dead within the heartbeat bound and leaks nothing.
#[test]
fn peer_crash_in_every_state() {
    let bound = Duration::from_secs(5) + Duration::from_secs(1) + Duration::from_millis(50);
    for victim in [Node::Prefill(0), Node::Decode] {
        for state in [
            RoomState::Bootstrapping,
            RoomState::WaitingForInput,
            RoomState::Transferring,
        ] {
            let mut sim = Sim::new(1, 30, Faults::default(), false);
            let r = room(11);
            sim.submit(r, 2);
            assert!(
                sim.run_until(Duration::from_secs(5), |s| s.prefill_state(0, r)
                    == Some(state)
                    || (state == RoomState::Bootstrapping
                        && s.decode_state(r) == Some(state)))
            );
            let t_crash = sim.elapsed();
            sim.schedule(Duration::ZERO, Task::Crash(victim));
            sim.finish();
            let (at, e) = match victim {
                Node::Prefill(_) => (sim.decode_result[&r].0, sim.decode_error(r).clone()),
                Node::Decode => (
                    sim.prefill_result[&(0, r)].0,
                    sim.prefill_error(0, r).clone(),
                ),
            };
            if victim == Node::Decode && state == RoomState::Bootstrapping {
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
        }
    }
}

#[test]
fn abort_for_unknown_room_creates_nothing() {
    let mut sim = Sim::new(1, 40, Faults::default(), false);
    sim.schedule(Duration::ZERO, Task::ClientAbort { room: room(99) });
    // An abort frame straight to prefill for a room it never saw.
    let t = Transmit {
        to: RankId(0),
        message: Message::Abort(handoff_proto::message::Abort {
            room: room(98),
            reason: "x".into(),
            http_status: Some(499),
            origin: Some(AbortOrigin::Client),
        }),
    };
    sim.send(Node::Decode, t);
    sim.run_until(Duration::from_secs(1), |_| false);
    let p = sim.prefill[0].as_ref().unwrap();
    assert_eq!(p.rooms.live_rooms(), 0);
    assert_eq!(p.rooms.stats().unknown_room_events, 1);
    assert_eq!(
        sim.decode
            .as_ref()
            .unwrap()
            .rooms
            .stats()
            .unknown_room_events,
        2,
        "the ack and the local abort"
    );
    sim.finish();
}

#[test]
fn duplicate_live_room_is_rejected_not_crashed() {
    let mut sim = Sim::new(1, 41, Faults::default(), false);
    sim.submit(room(5), 2);
    sim.run_until(Duration::from_millis(20), |_| false);
    let now = sim.now;
    let err = sim.prefill[0]
        .as_mut()
        .unwrap()
        .rooms
        .open(room(5), now)
        .unwrap_err();
    assert_eq!(
        (err.error_type(), err.http_status()),
        ("duplicate_room", 409)
    );
    let err = sim
        .decode
        .as_mut()
        .unwrap()
        .rooms
        .open(
            room(5),
            vec![Source {
                rank: RankId(0),
                required_destinations: 1,
            }],
            now,
        )
        .unwrap_err();
    assert_eq!(err.error_type(), "duplicate_room");
    sim.finish();
    assert!(matches!(sim.decode_result[&room(5)], (_, Ok(()))));
}

/// Random drop / duplicate / delay (reorder) with random aborts, rejections
/// and crashes; every request ends, nothing leaks, no page is released under
/// a write.
#[test]
fn random_faults_leave_nothing_behind() {
    let mut outcomes: BTreeMap<&'static str, u32> = BTreeMap::new();
    for seed in 0..48u64 {
        let faults = Faults {
            drop: 0.03 * (seed % 4) as f64,
            duplicate: 0.05 * (seed % 3) as f64,
            max_extra_delay_ms: 5 * (seed % 5),
        };
        let ranks = 1 + (seed % 2) as u32;
        let mut sim = Sim::new(ranks, 1000 + seed, faults, seed % 7 == 0);
        for n in 1..=4u64 {
            let at = Duration::from_millis(sim.rng.below(200));
            let r = room(seed * 10 + n);
            sim.submit(r, 1 + (n as u32 % 3));
            match sim.rng.below(6) {
                0 => sim.schedule(at, Task::ClientAbort { room: r }),
                1 => {
                    let p = sim.rng.below(u64::from(ranks)) as u32;
                    sim.schedule(at, Task::PrefillReject { p, room: r });
                }
                _ => {}
            }
        }
        if seed % 8 == 5 {
            let at = Duration::from_millis(sim.rng.below(150));
            sim.schedule(at, Task::Crash(Node::Prefill(ranks - 1)));
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
    // The mix must exercise both success and several failure kinds.
    assert!(
        outcomes.get("ok").copied().unwrap_or(0) > 20,
        "{outcomes:?}"
    );
    assert!(outcomes.len() >= 3, "{outcomes:?}");
}
