//! Disaggregated serving on the tiny seeded model, prefill and decode engines
//! in one process with real transfer over loopback, every test once per
//! transport (shm, tcp, and nixl with the `nixl` feature):
//!
//! * output identity: greedy PD output equals colocated output token for
//!   token, for page sizes 1, 16 and 64, at concurrency 1 and 16;
//! * seed 004: a request the prefill rejects fails on decode with the
//!   prefill's 400 and message, and decode's pages return at once;
//! * seed 000: a decode stream dropped mid-prefill and mid-decode releases
//!   the pages on both sides within 100 ms.
//!
//! After every test: zero pages used and zero live rooms on both sides.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use handoff_engine::error::TransferError;
use handoff_engine::pd::{
    DecodeEngine, DecodeHandle, OnTransferFailure, PdConfig, PrefillEngine, PrefillHandle,
    PrefillTicket,
};
use handoff_engine::{
    Engine, EngineConfig, EngineError, EngineHandle, FinishReason, GenerateRequest, RequestStream,
    SamplingParams, StreamEvent,
};
use handoff_kv::KvDtype;
use handoff_model::tiny::write_tiny_gguf;
use handoff_proto::room::RoomConfig;
use handoff_proto::timer::TimerConfig;
use handoff_proto::RoomId;
use handoff_transfer::TransportKind;

macro_rules! per_transport {
    ($($name:ident),* $(,)?) => {
        mod shm {
            $(#[test]
            fn $name() { super::$name(handoff_transfer::TransportKind::Shm) }) *
        }
        mod tcp {
            $(#[test]
            fn $name() { super::$name(handoff_transfer::TransportKind::Tcp) }) *
        }
        /// NIXL (`--features nixl`, its libraries on LD_LIBRARY_PATH).
        #[cfg(feature = "nixl")]
        mod nixl {
            $(#[test]
            fn $name() { super::$name(handoff_transfer::TransportKind::Nixl) }) *
        }
    };
}

per_transport!(
    greedy_output_is_colocated_output_page_size_1,
    greedy_output_is_colocated_output_page_size_16,
    greedy_output_is_colocated_output_page_size_64,
    greedy_output_is_colocated_output_with_f32_kv,
    prefill_prefix_cache_hits_keep_pd_output_equal_to_colocated,
    delta_transfer_moves_only_the_pages_decode_lacks,
    a_prefill_without_delta_transfer_still_serves_correctly,
    top_logprobs_from_a_prefill_without_them_are_refused_by_name,
    decode_cache_eviction_under_pressure_never_touches_pages_in_use,
    a_prefill_that_never_answers_holds_up_no_other_request,
    a_prefill_behind_a_dropped_port_holds_up_no_other_request,
    a_short_prompt_is_not_stuck_behind_a_long_prefill,
    prefill_compute_goes_by_priority_then_tenant_share,
    prompts_sharing_a_prefill_pass_keep_their_bits,
    a_prefill_with_another_kv_dtype_fails_at_the_handshake_naming_both,
    seeded_sampling_is_colocated_sampling,
    sampling_controls_are_colocated_controls,
    prefill_rejection_reaches_decode_with_status_and_reason,
    dropped_stream_mid_prefill_releases_both_sides,
    dropped_stream_mid_decode_releases_both_sides,
    decode_rejection_reaches_prefill_with_status_and_reason,
    prefill_death_fails_decode_with_a_typed_error_and_pages_return,
    decode_death_fails_prefill_and_frees_its_pages_and_compute,
    dropped_stream_before_prefill_accepts_fails_the_prefill_at_once,
    decode_batch_limit_queues_prefilled_requests,
    engines_start_and_serve_from_async_code,
    half_pairs_are_cleaned_up_by_their_timers,
    full_decode_pool_queues_requests_and_prefill_waits,
    streams_dropped_at_any_moment_leave_nothing_behind,
);

/// Room deadlines of the tests that do not test deadlines: the transfer
/// suite's fast heartbeats and fence, but room deadlines long enough for 16
/// queued prefills on a loaded 2-core CI machine (a room waits in
/// WaitingForInput while earlier prefills compute; 3 s was exceeded there).
fn room_timers() -> TimerConfig {
    TimerConfig {
        bootstrap: Duration::from_secs(60),
        waiting_for_input: Duration::from_secs(60),
        transfer: Duration::from_secs(60),
        ..handoff_transfer::testing::timers()
    }
}

/// Prefill chunk of every engine here (prompts span several chunks).
const CHUNK: usize = 16;

struct Setup {
    prefill: PrefillHandle,
    decode: DecodeHandle,
    colocated: EngineHandle,
    prefill_cfg: EngineConfig,
    decode_cfg: EngineConfig,
    kind: TransportKind,
    _dir: tempfile::TempDir,
}

struct Opts {
    page_size: usize,
    kv_pages: usize,
    prefill_chunk: usize,
    prefill_max_context: Option<usize>,
    decode_max_context: Option<usize>,
    decode_max_batch: usize,
    timers: Option<TimerConfig>,
    decode_kv_pages: Option<usize>,
    kv_dtype: KvDtype,
    prefill_kv_dtype: Option<KvDtype>,
    /// The prefill offers delta transfer (decode always does).
    prefill_delta: bool,
    /// The prefill offers the first position's alternatives.
    prefill_aux_top: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            page_size: 16,
            kv_pages: 512,
            prefill_chunk: CHUNK,
            prefill_max_context: None,
            decode_max_context: None,
            decode_max_batch: 32,
            timers: None,
            decode_kv_pages: None,
            kv_dtype: KvDtype::F16,
            prefill_kv_dtype: None,
            prefill_delta: true,
            prefill_aux_top: true,
        }
    }
}

fn pd_config(kind: TransportKind) -> PdConfig {
    pd_config_with(kind, room_timers())
}

fn pd_config_with(kind: TransportKind, timers: TimerConfig) -> PdConfig {
    let mut c = PdConfig::new(kind);
    c.rooms = RoomConfig {
        timers,
        ..RoomConfig::default()
    };
    c.handshake_timeout = Duration::from_secs(2);
    // These tests are about how a failed transfer reaches decode's client:
    // the typed error, not the local recompute (continuation.rs tests that).
    c.on_transfer_failure = OnTransferFailure::Fail;
    c
}

fn setup(kind: TransportKind, o: Opts) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, 11).unwrap();
    let mut cfg = EngineConfig::new(&path);
    cfg.page_size = o.page_size;
    cfg.kv_pages = o.kv_pages;
    cfg.prefill_chunk = o.prefill_chunk;
    cfg.kv_dtype = o.kv_dtype;
    cfg.threads = 1;
    let colocated = Engine::start(cfg.clone()).unwrap();
    let mut dcfg = cfg.clone();
    dcfg.max_context = o.decode_max_context;
    dcfg.max_batch = o.decode_max_batch;
    dcfg.kv_pages = o.decode_kv_pages.unwrap_or(o.kv_pages);
    let timers = o.timers.unwrap_or_else(room_timers);
    let decode = DecodeEngine::start(dcfg.clone(), pd_config_with(kind, timers)).unwrap();
    let mut pcfg = cfg;
    pcfg.max_context = o.prefill_max_context;
    pcfg.kv_dtype = o.prefill_kv_dtype.unwrap_or(o.kv_dtype);
    let mut ppd = pd_config_with(kind, timers);
    ppd.delta_transfer = o.prefill_delta;
    ppd.aux_top = o.prefill_aux_top;
    let prefill = PrefillEngine::start(pcfg.clone(), ppd).unwrap();
    Setup {
        prefill,
        decode,
        colocated,
        prefill_cfg: pcfg,
        decode_cfg: dcfg,
        kind,
        _dir: dir,
    }
}

fn room() -> RoomId {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    RoomId::new(((std::process::id() as u64) << 32) | (n + 1)).unwrap()
}

fn req(prompt: Vec<u32>, max_new: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        sampling: SamplingParams {
            max_new_tokens: max_new,
            ignore_eos: true,
            ..Default::default()
        },
        arrived: Instant::now(),
        output_so_far: Vec::new(),
        class: Default::default(),
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + salt * 17) % 250)
        .collect()
}

type Output = (Vec<u32>, String, FinishReason);

fn drain(mut s: RequestStream) -> Result<Output, EngineError> {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            Some(StreamEvent::Finished(f)) => {
                assert_eq!(f.completion_tokens, ids.len());
                return Ok((ids, text, f.reason));
            }
            Some(StreamEvent::Error(e)) => return Err(e),
            None => panic!("stream ended without Finished or Error"),
        }
    }
}

fn colocated(s: &Setup, r: &GenerateRequest) -> Output {
    drain(s.colocated.submit(r.clone()).unwrap()).unwrap()
}

/// Submit both halves of `r` in a fresh room: the prefill's ticket and the
/// decode stream.
fn start(s: &Setup, r: &GenerateRequest) -> (PrefillTicket, RequestStream) {
    let room = room();
    let ticket = s.prefill.submit(r.clone(), room).unwrap();
    let stream = s
        .decode
        .submit(r.clone(), room, s.prefill.bootstrap_addr())
        .unwrap();
    (ticket, stream)
}

/// One request through prefill and decode; the prefill's first token must
/// be the stream's first token.
fn pd(s: &Setup, r: &GenerateRequest) -> Output {
    let (ticket, stream) = start(s, r);
    let out = drain(stream).unwrap_or_else(|e| panic!("PD request failed: {e}"));
    let done = ticket.blocking_wait().unwrap();
    assert_eq!(done.first_token, out.0[0]);
    assert_eq!(done.prompt_tokens, r.prompt_ids.len());
    out
}

/// KV payload bytes the prefill's transfer endpoint sent so far.
fn kv_bytes_sent(s: &Setup) -> u64 {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(s.prefill.transfer_stats())
        .unwrap()
        .kv_bytes_sent
}

/// One request through PD: its output and the KV bytes it moved.
fn pd_bytes(s: &Setup, r: &GenerateRequest) -> (Output, u64) {
    let before = kv_bytes_sent(s);
    let out = pd(s, r);
    (out, kv_bytes_sent(s) - before)
}

fn eventually(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < within, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
    t.elapsed()
}

/// Nothing left behind on either side.
fn assert_clean(s: &Setup) {
    eventually("pages and rooms released", Duration::from_secs(5), || {
        let (p, d) = (s.prefill.load(), s.decode.load());
        p.pages_used == 0
            && d.pages_used == 0
            && p.running + p.waiting + d.running + d.waiting == 0
            && s.prefill.live_rooms() == 0
            && s.decode.live_rooms() == 0
    });
    assert_eq!(s.colocated.load().pages_used, 0);
}

fn identity(kind: TransportKind, page_size: usize, kv_dtype: KvDtype) {
    let s = setup(
        kind,
        Opts {
            page_size,
            kv_pages: 8192 / page_size,
            kv_dtype,
            ..Opts::default()
        },
    );
    // Short and long prompts (the longest spans 150 pages of 1 token,
    // 10 of 16, 3 of 64, and 10 prefill chunks).
    let reqs: Vec<GenerateRequest> = (0..16)
        .map(|i| {
            let len = [3, 17, 64, 150][i % 4] + i;
            req(prompt(len, i as u32), 6 + i % 4)
        })
        .collect();
    let want: Vec<Output> = reqs.iter().map(|r| colocated(&s, r)).collect();
    // Concurrency 1.
    for (i, r) in reqs.iter().enumerate().take(8) {
        assert_eq!(pd(&s, r), want[i], "request {i}, page size {page_size}");
    }
    assert_clean(&s);
    // Concurrency 16: all at once from 16 threads.
    let got: Vec<Output> = std::thread::scope(|sc| {
        let hs: Vec<_> = reqs.iter().map(|r| sc.spawn(|| pd(&s, r))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "concurrent request {i}, page size {page_size}");
        assert_eq!(g.2, FinishReason::Length);
    }
    assert_clean(&s);
}

fn greedy_output_is_colocated_output_page_size_1(kind: TransportKind) {
    identity(kind, 1, KvDtype::F16);
}

fn greedy_output_is_colocated_output_page_size_16(kind: TransportKind) {
    identity(kind, 16, KvDtype::F16);
}

fn greedy_output_is_colocated_output_page_size_64(kind: TransportKind) {
    identity(kind, 64, KvDtype::F16);
}

fn greedy_output_is_colocated_output_with_f32_kv(kind: TransportKind) {
    identity(kind, 16, KvDtype::F32);
}

fn prefill_prefix_cache_hits_keep_pd_output_equal_to_colocated(kind: TransportKind) {
    let s = setup(
        kind,
        Opts {
            page_size: 4,
            kv_pages: 1024,
            ..Opts::default()
        },
    );
    // A shared system prompt (10 pages), conversations that grow, repeats.
    let system = prompt(40, 5);
    let mut reqs = Vec::new();
    for conv in 0..4u32 {
        let mut history = system.clone();
        for turn in 0..3u32 {
            history.extend(prompt(7 + turn as usize, 50 + conv * 5 + turn));
            reqs.push(req(history.clone(), 5));
        }
    }
    reqs.push(reqs[0].clone());
    let want: Vec<Output> = reqs.iter().map(|r| colocated(&s, r)).collect();
    let run = |r: &GenerateRequest| {
        let (ticket, stream) = start(&s, r);
        let out = drain(stream).unwrap_or_else(|e| panic!("PD request failed: {e}"));
        (out, ticket.blocking_wait().unwrap().cached_tokens)
    };
    let first = run(&reqs[0]);
    assert_eq!(first, (want[0].clone(), 0), "a cold cache");
    let mut hits = 0;
    for (i, r) in reqs.iter().enumerate().skip(1) {
        let (out, cached) = run(r);
        assert_eq!(out, want[i], "request {i}");
        assert_eq!(cached % 4, 0, "whole pages");
        assert!(cached < r.prompt_ids.len());
        hits += usize::from(cached >= 40);
    }
    assert_eq!(
        hits,
        reqs.len() - 1,
        "every later request reuses the system prompt"
    );
    // All at once: hits and misses racing on the same prefixes.
    s.prefill.flush_cache();
    let got: Vec<Output> = std::thread::scope(|sc| {
        let hs: Vec<_> = reqs.iter().map(|r| sc.spawn(|| run(r).0)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
    assert_clean(&s);
    assert!(s.prefill.load().pages_cached > 0);
    assert!(s.prefill.flush_cache() > 0);
    assert_eq!(s.prefill.load().pages_cached, 0);
}

/// Page size of the delta-transfer tests.
const DELTA_PAGE: usize = 16;

fn delta_transfer_moves_only_the_pages_decode_lacks(kind: TransportKind) {
    let s = setup(
        kind,
        Opts {
            page_size: DELTA_PAGE,
            kv_pages: 1024,
            ..Opts::default()
        },
    );
    // A 300-token shared prefix (18 whole pages of 16, then 12 tokens).
    let shared = prompt(300, 7);
    let with_tail = |salt: u32| {
        let mut p = shared.clone();
        p.extend(prompt(20, salt)); // 320 tokens: 20 pages
        req(p, 6)
    };
    let (a, b) = (with_tail(1), with_tail(2));
    let want_a = colocated(&s, &a);
    let want_b = colocated(&s, &b);
    // Cold: the whole prompt moves.
    let (out, cold) = pd_bytes(&s, &a);
    assert_eq!(out, want_a);
    assert!(cold > 0 && cold % 20 == 0, "{cold} bytes for 20 pages");
    let page = cold / 20;
    // The same 300-token prefix: decode holds its 18 whole pages, so only
    // pages 18 and 19 move.
    let (out, warm) = pd_bytes(&s, &b);
    assert_eq!(out, want_b);
    assert_eq!(warm, 2 * page, "{warm} bytes, a page is {page}");
    // A full hit (a whole number of pages, all cached): no KV moves, the
    // prefill still sends the first token.
    let (out, hit) = pd_bytes(&s, &a);
    assert_eq!(out, want_a);
    assert_eq!(hit, 0, "a full hit moves no KV");
    // A prompt that is a prefix of a cached one: all its pages are there.
    let shorter = req(a.prompt_ids[..160].to_vec(), 4);
    let (out, hit) = pd_bytes(&s, &shorter);
    assert_eq!(out, colocated(&s, &shorter));
    assert_eq!(hit, 0);
    assert_clean(&s);
    // The decode cache can be flushed like any other.
    assert!(s.decode.load().pages_cached >= 20);
    assert!(s.decode.flush_cache() >= 20);
    assert_eq!(s.decode.load().pages_cached, 0);
    let (out, cold_again) = pd_bytes(&s, &a);
    assert_eq!(out, want_a);
    assert_eq!(cold_again, cold, "flushed: the whole prompt moves again");
    assert_clean(&s);
}

fn a_prefill_without_delta_transfer_still_serves_correctly(kind: TransportKind) {
    let s = setup(
        kind,
        Opts {
            page_size: DELTA_PAGE,
            kv_pages: 1024,
            prefill_delta: false,
            ..Opts::default()
        },
    );
    let a = req(prompt(320, 3), 6);
    let want = colocated(&s, &a);
    let (out, cold) = pd_bytes(&s, &a);
    assert_eq!(out, want);
    // Decode has every page cached, but this prefill cannot take a
    // prefix: the whole prompt moves again, and the output is the same.
    let (out, again) = pd_bytes(&s, &a);
    assert_eq!(out, want);
    assert_eq!(again, cold);
    assert!(s.decode.load().pages_cached >= 20, "decode still caches");
    assert_clean(&s);
}

fn top_logprobs_from_a_prefill_without_them_are_refused_by_name(kind: TransportKind) {
    let s = setup(
        kind,
        Opts {
            prefill_aux_top: false,
            ..Opts::default()
        },
    );
    let mut a = req(prompt(40, 5), 4);
    a.sampling.top_logprobs = 3;
    let (ticket, stream) = start(&s, &a);
    let e = drain(stream).unwrap_err();
    assert_eq!(e.http_status(), 400, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("top_logprobs") && msg.contains("older handoff"),
        "{msg}"
    );
    assert!(
        ticket.blocking_wait().is_err(),
        "the prefill's room fails too"
    );
    // Without top logprobs the same pair serves, equal to colocated.
    let b = req(prompt(40, 5), 4);
    let (ticket, stream) = start(&s, &b);
    assert_eq!(drain(stream).unwrap(), colocated(&s, &b));
    ticket.blocking_wait().unwrap();
    assert_clean(&s);
}

fn decode_cache_eviction_under_pressure_never_touches_pages_in_use(kind: TransportKind) {
    // Decode holds 40 pages of 4 tokens; 16 concurrent requests sharing
    // prefixes need far more over time, so cached pages are evicted while
    // other requests' transfers and decodes run on theirs.
    let s = setup(
        kind,
        Opts {
            page_size: 4,
            kv_pages: 1024,
            decode_kv_pages: Some(40),
            ..Opts::default()
        },
    );
    let system = prompt(24, 9);
    let reqs: Vec<GenerateRequest> = (0..16u32)
        .map(|i| {
            let mut p = system.clone();
            p.extend(prompt(4 + (i as usize % 5) * 3, 100 + i % 6));
            req(p, 8)
        })
        .collect();
    let want: Vec<Output> = reqs.iter().map(|r| colocated(&s, r)).collect();
    for round in 0..2 {
        let got: Vec<Output> = std::thread::scope(|sc| {
            let hs: Vec<_> = reqs.iter().map(|r| sc.spawn(|| pd(&s, r))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "round {round}, request {i}");
        }
        assert_clean(&s);
    }
    assert!(s.decode.load().pages_cached > 0);
}

fn a_prefill_that_never_answers_holds_up_no_other_request(kind: TransportKind) {
    // Accepts connections (the kernel completes them) and never speaks:
    // the handshake can only time out (2 s here).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    a_stuck_prefill_holds_up_no_other_request(kind, silent.local_addr().unwrap());
}

/// The prefill's port drops every packet (an iptables DROP in a network
/// namespace): the TCP connect itself never completes, and only the
/// handshake deadline (2 s here) ends it, not the OS's SYN retries.
fn a_prefill_behind_a_dropped_port_holds_up_no_other_request(kind: TransportKind) {
    let Some(ns) = DroppedPort::new() else { return };
    a_stuck_prefill_holds_up_no_other_request(kind, ns.addr);
}

/// A request naming a prefill at `stuck` (which never completes a
/// handshake) fails after the handshake deadline, while a request to the
/// good prefill, started meanwhile, is served at once.
fn a_stuck_prefill_holds_up_no_other_request(kind: TransportKind, stuck: std::net::SocketAddr) {
    let s = setup(kind, Opts::default());
    let r = req(prompt(20, 1), 4);
    let want = colocated(&s, &r);
    let pending = s.decode.submit(r.clone(), room(), stuck).unwrap();
    let pending = std::thread::spawn(move || {
        let t = Instant::now();
        (drain(pending), t.elapsed())
    });
    // The stuck connect is under way when the good request starts.
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    assert_eq!(pd(&s, &r), want);
    let good = t.elapsed();
    assert!(
        !pending.is_finished(),
        "the good request ({good:?}) waited for the stuck prefill's handshake"
    );
    let (out, waited) = pending.join().unwrap();
    let e = out.unwrap_err();
    eprintln!("good request {good:?}; stuck prefill {stuck} failed after {waited:?}: {e}");
    assert!(waited >= Duration::from_millis(1500), "{waited:?}: {e}");
    // The handshake deadline, not the kernel's SYN retries (over a minute).
    assert!(waited < Duration::from_secs(20), "{waited:?}: {e}");
    assert_clean(&s);
}

/// A network namespace reached over a veth pair, with an address whose TCP
/// port drops every packet (`iptables -j DROP`). Needs root, `ip` and
/// `iptables`; without them the test is skipped, unless
/// `HANDOFF_REQUIRE_NETNS` is set (scripts/test.sh sets it as root), which
/// makes a missing tool a failure.
struct DroppedPort {
    ns: String,
    host_if: String,
    addr: std::net::SocketAddr,
}

impl DroppedPort {
    fn new() -> Option<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // A /30 of its own per namespace (pid and counter), in 10.231/16.
        let block = ((pid as u64 % 4096) * 4 + n % 4) % 16384;
        let (hi, lo) = (block / 64, (block % 64) * 4);
        let ns = format!("hoff-{pid}-{n}");
        let host_if = format!("hf{pid}x{n}");
        let ns_if = format!("hg{pid}x{n}");
        let (host_ip, ns_ip) = (
            format!("10.231.{hi}.{}", lo + 1),
            format!("10.231.{hi}.{}", lo + 2),
        );
        let port = 4000 + n as u16;
        let me = DroppedPort {
            ns: ns.clone(),
            host_if: host_if.clone(),
            addr: format!("{ns_ip}:{port}").parse().unwrap(),
        };
        let steps: [Vec<String>; 7] = [
            vec!["ip".into(), "netns".into(), "add".into(), ns.clone()],
            vec![
                "ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns", &ns,
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            vec![
                "ip",
                "addr",
                "add",
                &format!("{host_ip}/30"),
                "dev",
                &host_if,
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            vec!["ip", "link", "set", &host_if, "up"]
                .into_iter()
                .map(String::from)
                .collect(),
            in_ns(
                &ns,
                &["ip", "addr", "add", &format!("{ns_ip}/30"), "dev", &ns_if],
            ),
            in_ns(&ns, &["ip", "link", "set", &ns_if, "up"]),
            in_ns(
                &ns,
                &[
                    "iptables",
                    "-A",
                    "INPUT",
                    "-p",
                    "tcp",
                    "--dport",
                    &port.to_string(),
                    "-j",
                    "DROP",
                ],
            ),
        ];
        for step in steps {
            let out = std::process::Command::new(&step[0])
                .args(&step[1..])
                .output();
            let failed = match &out {
                Ok(o) if o.status.success() => continue,
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            let why = format!("{}: {failed}", step.join(" "));
            if std::env::var_os("HANDOFF_REQUIRE_NETNS").is_some() {
                panic!("network namespace setup failed: {why}");
            }
            eprintln!(
                "skipped: no network namespace ({why}); HANDOFF_REQUIRE_NETNS makes this fail"
            );
            return None;
        }
        Some(me)
    }
}

fn in_ns(ns: &str, cmd: &[&str]) -> Vec<String> {
    ["ip", "netns", "exec", ns]
        .iter()
        .chain(cmd)
        .map(|s| s.to_string())
        .collect()
}

impl Drop for DroppedPort {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, and with it ours.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
    }
}

fn a_short_prompt_is_not_stuck_behind_a_long_prefill(kind: TransportKind) {
    // Prefill chunks of 2 tokens: the 1000-token prompt takes 500 chunks;
    // the 32-token one, arriving while it runs, takes turns with it and is
    // done in 16 of its own (so the margin holds on a loaded machine too).
    let s = setup(
        kind,
        Opts {
            kv_pages: 1024,
            prefill_chunk: 2,
            ..Opts::default()
        },
    );
    let long = req(prompt(1000, 1), 2);
    let short = req(prompt(32, 2), 2);
    let want_short = colocated(&s, &short);
    let (long_ticket, long_stream) = start(&s, &long);
    eventually("the long prefill runs", Duration::from_secs(5), || {
        s.prefill.load().running == 1
    });
    let (short_ticket, short_stream) = start(&s, &short);
    let (short_done, long_done) = std::thread::scope(|sc| {
        let a = sc.spawn(|| {
            let d = short_ticket.blocking_wait().unwrap();
            (Instant::now(), d)
        });
        let b = sc.spawn(|| {
            let d = long_ticket.blocking_wait().unwrap();
            (Instant::now(), d)
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(
        short_done.0 < long_done.0,
        "the short prompt's first token came {:?} after the long one's",
        short_done.0 - long_done.0
    );
    assert_eq!(drain(short_stream).unwrap(), want_short);
    assert_eq!(drain(long_stream).unwrap().0.len(), 2);
    assert_clean(&s);
}

fn prefill_compute_goes_by_priority_then_tenant_share(kind: TransportKind) {
    use handoff_engine::fair::Class;
    // Prefill chunks of 2 tokens: one prompt's chunk a pass, each prompt of
    // 200 tokens 100 passes.
    let s = setup(
        kind,
        Opts {
            kv_pages: 1024,
            prefill_chunk: 2,
            ..Opts::default()
        },
    );
    let of = |salt, priority, tenant: &str| {
        let mut r = req(prompt(200, salt), 1);
        r.class = Class {
            priority,
            tenant: Some(tenant.into()),
        };
        r
    };
    // Tenant a's four prompts start; then b's one and a's urgent one.
    let mut started: Vec<(&str, PrefillTicket, RequestStream)> = Vec::new();
    for i in 0..4 {
        let (t, st) = start(&s, &of(10 + i, 0, "a"));
        started.push(("a", t, st));
    }
    eventually("a's prefills run", Duration::from_secs(5), || {
        s.prefill.load().running == 4
    });
    let (t, st) = start(&s, &of(20, 0, "b"));
    started.push(("b", t, st));
    let (t, st) = start(&s, &of(21, 5, "a"));
    started.push(("a-urgent", t, st));
    let mut done: Vec<(Instant, &str)> = std::thread::scope(|sc| {
        let hs: Vec<_> = started
            .into_iter()
            .map(|(name, ticket, stream)| {
                sc.spawn(move || {
                    ticket.blocking_wait().unwrap();
                    let at = Instant::now();
                    drain(stream).unwrap();
                    (at, name)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    done.sort();
    let order: Vec<&str> = done.into_iter().map(|(_, n)| n).collect();
    // The urgent one goes first; b, sharing passes with a's four (not
    // taking one pass in five), finishes long before them although it came
    // later. Round robin alone would finish b last.
    assert_eq!(order, ["a-urgent", "b", "a", "a", "a", "a"]);
    assert_clean(&s);
}

/// Token ids and the bits of their log-probabilities.
fn id_bits(mut s: RequestStream) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    loop {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => out.push((t.id, t.logprob.to_bits())),
            Some(StreamEvent::Finished(_)) => return out,
            Some(StreamEvent::Error(e)) => panic!("{e}"),
            None => panic!("stream ended without Finished or Error"),
        }
    }
}

/// Prompts that arrive while another prefills share its forward passes
/// (up to `prefill_chunk` tokens a pass, all prompts together), and each
/// keeps the bits it has alone: every token and the bits of its
/// log-probability equal colocated, which computes each prompt by itself
/// in chunks cut elsewhere.
fn prompts_sharing_a_prefill_pass_keep_their_bits(kind: TransportKind) {
    // Passes of 4 tokens: the long prompt takes 250 of them, so the short
    // ones arrive while it runs (as in the test above), and their odd
    // lengths leave passes part-filled for the next prompt in turn.
    let s = setup(
        kind,
        Opts {
            kv_pages: 1024,
            prefill_chunk: 4,
            ..Opts::default()
        },
    );
    let long = req(prompt(1000, 5), 3);
    let shorts: Vec<GenerateRequest> = (0..4)
        .map(|i| req(prompt(13 + 7 * i, 20 + i as u32), 4))
        .collect();
    let alone = |r: &GenerateRequest| id_bits(s.colocated.submit(r.clone()).unwrap());
    let want: Vec<_> = shorts.iter().map(alone).collect();
    let want_long = alone(&long);
    let before = s.prefill.load();
    let (long_ticket, long_stream) = start(&s, &long);
    eventually("the long prefill runs", Duration::from_secs(5), || {
        s.prefill.load().running == 1
    });
    let started: Vec<_> = shorts.iter().map(|r| start(&s, r)).collect();
    for (i, ((ticket, stream), want)) in started.into_iter().zip(&want).enumerate() {
        ticket.blocking_wait().unwrap();
        assert_eq!(&id_bits(stream), want, "short prompt {i}");
    }
    long_ticket.blocking_wait().unwrap();
    assert_eq!(id_bits(long_stream), want_long, "the long prompt");
    let after = s.prefill.load();
    let passes = after.prefill_passes - before.prefill_passes;
    let sequences = after.prefill_pass_sequences - before.prefill_pass_sequences;
    // 1000 + 13 + 20 + 27 + 34 tokens in passes of at most 4.
    assert!(passes >= 1094 / 4, "{passes} passes");
    assert!(
        sequences > passes,
        "{sequences} sequences in {passes} passes: no pass held two prompts"
    );
    assert_clean(&s);
}

fn a_prefill_with_another_kv_dtype_fails_at_the_handshake_naming_both(kind: TransportKind) {
    // Short room deadlines: decode never reaches the prefill, so the
    // prefill's half of the pair ends at its bootstrap deadline.
    let timers = TimerConfig {
        bootstrap: Duration::from_millis(500),
        ..room_timers()
    };
    let s = setup(
        kind,
        Opts {
            kv_dtype: KvDtype::F16,
            prefill_kv_dtype: Some(KvDtype::F32),
            timers: Some(timers),
            ..Opts::default()
        },
    );
    let r = req(prompt(20, 3), 4);
    let (ticket, stream) = start(&s, &r);
    let e = drain(stream).unwrap_err();
    assert_eq!(e.error_type(), "peer_incompatible", "{e}");
    assert!(
        e.to_string()
            .contains("KV dtype: prefill has f32, decode has f16"),
        "{e}"
    );
    // The prefill never got a destination: its room times out waiting for
    // one, and nothing is left on either side.
    let e = ticket.blocking_wait().unwrap_err();
    assert_eq!(e.error_type(), "timeout", "{e}");
    assert_clean(&s);
}

fn seeded_sampling_is_colocated_sampling(kind: TransportKind) {
    let s = setup(kind, Opts::default());
    let mut r = req(prompt(30, 9), 12);
    r.sampling.temperature = 1.0;
    r.sampling.top_k = 20;
    r.sampling.seed = Some(42);
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    r.sampling.seed = Some(43);
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    assert_clean(&s);
}

/// Every sampling control gives PD the colocated output token for token,
/// the prefill's first token included, and has the effect it promises.
fn sampling_controls_are_colocated_controls(kind: TransportKind) {
    use handoff_engine::request::Penalties;
    let s = setup(kind, Opts::default());
    let base = req(prompt(30, 4), 10);
    let plain = colocated(&s, &base);
    let with = |f: &dyn Fn(&mut SamplingParams)| {
        let mut r = base.clone();
        f(&mut r.sampling);
        let want = colocated(&s, &r);
        assert_eq!(pd(&s, &r), want, "{:?}", r.sampling);
        want
    };
    // A bias of +100 makes one token every token; -100 keeps the greedy
    // first token out.
    let forced = with(&|p| {
        p.penalties.logit_bias = vec![(3 + b'q' as u32, 100.0)];
    });
    assert_eq!(forced.1, "q".repeat(10));
    let first = plain.0[0];
    let banned = with(&|p| p.penalties.logit_bias = vec![(first, -100.0)]);
    assert!(!banned.0.contains(&first), "{banned:?}");
    // The plain output's first token as a stop id ends generation at once;
    // with min_new_tokens 4 the first four tokens are anything else.
    let stopped = with(&|p| p.stop_token_ids = vec![first]);
    assert_eq!(stopped.0, vec![first]);
    assert_eq!(stopped.2, FinishReason::Eos { token: first });
    let held = with(&|p| {
        p.stop_token_ids = vec![first];
        p.min_new_tokens = 4;
    });
    assert!(
        held.0.len() >= 4 && !held.0[..4].contains(&first),
        "{held:?}"
    );
    // Penalties change the greedy output of a prompt that repeats.
    let repeats = |p: &SamplingParams| {
        let mut r = req(prompt(8, 1).repeat(4), 24);
        r.sampling = SamplingParams {
            max_new_tokens: 24,
            ignore_eos: true,
            ..p.clone()
        };
        let want = colocated(&s, &r);
        assert_eq!(pd(&s, &r), want, "{:?}", r.sampling);
        want
    };
    let unpenalised = repeats(&SamplingParams::default());
    for penalties in [
        Penalties {
            repetition: 1.8,
            ..Penalties::default()
        },
        Penalties {
            frequency: 1.5,
            ..Penalties::default()
        },
        Penalties {
            presence: 2.0,
            ..Penalties::default()
        },
    ] {
        let out = repeats(&SamplingParams {
            penalties: penalties.clone(),
            ..SamplingParams::default()
        });
        assert_ne!(out.0, unpenalised.0, "{penalties:?} changed nothing");
    }
    // Min-p with a seed: same draws on both paths.
    with(&|p| {
        p.temperature = 1.5;
        p.min_p = 0.2;
        p.seed = Some(9);
    });
    assert_clean(&s);
}

fn prefill_rejection_reaches_decode_with_status_and_reason(kind: TransportKind) {
    // The prefill's context is shorter than decode's: decode accepts a
    // request that the prefill must reject.
    let s = setup(
        kind,
        Opts {
            prefill_max_context: Some(32),
            ..Opts::default()
        },
    );
    let r = req(prompt(40, 1), 4);
    assert!(s.decode.validate(&r).is_ok());
    // Rejected before decode's destination arrived, and after.
    for prefill_first in [true, false] {
        let room = room();
        let (rejected, stream) = if prefill_first {
            let rejected = s.prefill.submit(r.clone(), room).unwrap_err();
            let stream = s.decode.submit(r.clone(), room, s.prefill.bootstrap_addr());
            (rejected, stream.unwrap())
        } else {
            let stream = s.decode.submit(r.clone(), room, s.prefill.bootstrap_addr());
            let stream = stream.unwrap();
            eventually("decode reserved its pages", Duration::from_secs(2), || {
                s.decode.load().pages_used > 0
            });
            (s.prefill.submit(r.clone(), room).unwrap_err(), stream)
        };
        assert_eq!(
            rejected,
            EngineError::ContextExceeded {
                prompt_tokens: 40,
                max_new_tokens: 4,
                context_length: 32
            }
        );
        let t0 = Instant::now();
        let e = drain(stream).unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "decode learned of the rejection only after {:?}",
            t0.elapsed()
        );
        assert_eq!(e.http_status(), 400, "{e:?}");
        // Decode reports the prefill's error exactly: type, field, message.
        assert_eq!(e.error_type(), "context_length_exceeded");
        assert_eq!(e.param(), Some("prompt"));
        assert_eq!(e.to_string(), rejected.to_string());
        assert!(matches!(
            &e,
            EngineError::Transfer(TransferError::Rejected {
                http_status: 400,
                reason,
                code: Some(handoff_engine::error::RejectCode::PromptExceedsContext),
            }) if reason.contains("exceeds the context length of 32 tokens")
        ));
        let took = eventually("decode pages back", Duration::from_millis(100), || {
            s.decode.load().pages_used == 0
        });
        eprintln!("prefill_first={prefill_first}: decode pages back {took:?} after the error");
        // The prefill never leased a page: no KV was computed or written.
        assert_eq!(s.prefill.load().pages_used, 0);
    }
    assert_clean(&s);
}

fn dropped_stream_mid_prefill_releases_both_sides(kind: TransportKind) {
    // One token per prefill chunk: a long prompt keeps the prefill busy.
    let s = setup(
        kind,
        Opts {
            prefill_chunk: 1,
            ..Opts::default()
        },
    );
    let r = req(prompt(600, 2), 8);
    let (ticket, stream) = start(&s, &r);
    eventually("prefill computing", Duration::from_secs(3), || {
        s.prefill.load().running == 1 && s.prefill.load().pages_used > 0
    });
    assert!(s.decode.load().pages_used > 0);
    let t0 = Instant::now();
    drop(stream);
    eventually("both sides' pages back", Duration::from_millis(100), || {
        s.decode.load().pages_used == 0 && s.prefill.load().pages_used == 0
    });
    eprintln!(
        "mid-prefill drop: pages back on both sides after {:?}",
        t0.elapsed()
    );
    let e = ticket.blocking_wait().unwrap_err();
    assert_eq!(e.error_type(), "aborted", "{e:?}");
    assert_eq!(e.http_status(), 499);
    assert_clean(&s);
    // The pair still serves.
    let r = req(prompt(20, 3), 5);
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    assert_clean(&s);
}

fn dropped_stream_mid_decode_releases_both_sides(kind: TransportKind) {
    let s = setup(kind, Opts::default());
    let r = req(prompt(50, 4), 900);
    let room = room();
    let ticket = s.prefill.submit(r.clone(), room).unwrap();
    let mut stream = s
        .decode
        .submit(r.clone(), room, s.prefill.bootstrap_addr())
        .unwrap();
    for _ in 0..3 {
        assert!(matches!(
            stream.blocking_next(),
            Some(StreamEvent::Token(_))
        ));
    }
    assert!(ticket.blocking_wait().is_ok());
    assert!(s.decode.load().pages_used > 0);
    let t0 = Instant::now();
    drop(stream);
    eventually("both sides' pages back", Duration::from_millis(100), || {
        s.decode.load().pages_used == 0 && s.prefill.load().pages_used == 0
    });
    eprintln!(
        "mid-decode drop: pages back on both sides after {:?}",
        t0.elapsed()
    );
    assert_clean(&s);
}

fn decode_rejection_reaches_prefill_with_status_and_reason(kind: TransportKind) {
    // Decode's context is shorter than the prefill's: the prefill accepts
    // a request that decode rejects, and must not wait for a timeout.
    let s = setup(
        kind,
        Opts {
            decode_max_context: Some(32),
            ..Opts::default()
        },
    );
    let r = req(prompt(40, 1), 4);
    let room = room();
    let ticket = s.prefill.submit(r.clone(), room).unwrap();
    let rejected = s
        .decode
        .submit(r.clone(), room, s.prefill.bootstrap_addr())
        .unwrap_err();
    assert_eq!(rejected.http_status(), 400);
    let t0 = Instant::now();
    let e = ticket.blocking_wait().unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "prefill learned of the rejection only after {:?}",
        t0.elapsed()
    );
    assert_eq!(e.http_status(), 400, "{e:?}");
    assert_eq!(e.to_string(), rejected.to_string());
    assert_eq!(s.prefill.load().pages_used, 0);
    assert_clean(&s);
}

fn prefill_death_fails_decode_with_a_typed_error_and_pages_return(kind: TransportKind) {
    let mut s = setup(
        kind,
        Opts {
            prefill_chunk: 1,
            ..Opts::default()
        },
    );
    let r = req(prompt(600, 5), 8);
    let (ticket, stream) = start(&s, &r);
    eventually("prefill computing", Duration::from_secs(3), || {
        s.prefill.load().running == 1
    });
    // The prefill worker goes away mid-prefill.
    let fresh = PrefillEngine::start(s.prefill_cfg.clone(), pd_config(s.kind)).unwrap();
    drop(std::mem::replace(&mut s.prefill, fresh));
    let t0 = Instant::now();
    let e = drain(stream).unwrap_err();
    eprintln!("prefill death: decode failed after {:?}: {e}", t0.elapsed());
    assert_eq!(e.error_type(), "peer_dead", "{e:?}");
    assert_eq!(e.http_status(), 503);
    assert!(ticket.blocking_wait().is_err());
    // Pages come back (at the latest when the abort fence passes).
    eventually("decode pages back", Duration::from_secs(2), || {
        s.decode.load().pages_used == 0
    });
    // Decode serves the next request through another prefill.
    let r = req(prompt(20, 6), 5);
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    assert_clean(&s);
}

fn decode_death_fails_prefill_and_frees_its_pages_and_compute(kind: TransportKind) {
    let mut s = setup(
        kind,
        Opts {
            prefill_chunk: 1,
            ..Opts::default()
        },
    );
    let r = req(prompt(600, 8), 8);
    let (ticket, stream) = start(&s, &r);
    eventually("prefill computing", Duration::from_secs(3), || {
        s.prefill.load().running == 1 && s.prefill.load().pages_used > 0
    });
    // The decode worker goes away mid-prefill (its endpoint closes every
    // connection, as a killed process's sockets do); its client is still
    // there, so this is no abort.
    let fresh = DecodeEngine::start(s.decode_cfg.clone(), pd_config(s.kind)).unwrap();
    drop(std::mem::replace(&mut s.decode, fresh));
    let t0 = Instant::now();
    let e = ticket.blocking_wait().unwrap_err();
    eprintln!("decode death: prefill failed after {:?}: {e}", t0.elapsed());
    assert_eq!(e.error_type(), "peer_dead", "a typed peer death: {e:?}");
    assert_eq!(e.http_status(), 503);
    drop(stream);
    // Its compute stops and its pages come back: no prompt of 600 tokens a
    // token at a time runs to the end for nobody.
    eventually("prefill idle, pages back", Duration::from_secs(5), || {
        let l = s.prefill.load();
        l.running == 0 && l.waiting == 0 && l.pages_used == 0
    });
    let freed = t0.elapsed();
    // The prefill serves the next request with the new decode; the same
    // prompt computed to its end is the baseline the freeing must beat.
    let t1 = Instant::now();
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    let whole = t1.elapsed();
    eprintln!("decode death: prefill idle {freed:?} after; the whole prompt takes {whole:?}");
    assert!(
        freed < whole / 2,
        "the prefill seems to have computed the prompt to its end ({freed:?} vs {whole:?})"
    );
    let r = req(prompt(20, 9), 5);
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    assert_clean(&s);
}

fn dropped_stream_before_prefill_accepts_fails_the_prefill_at_once(kind: TransportKind) {
    let s = setup(kind, Opts::default());
    let r = req(prompt(30, 7), 4);
    // Dropped at once (the room may not even be open at decode yet), and
    // after decode reserved its pages and sent its destination.
    for immediate in [true, false] {
        let room = room();
        let stream = s
            .decode
            .submit(r.clone(), room, s.prefill.bootstrap_addr())
            .unwrap();
        if !immediate {
            eventually("decode reserved its pages", Duration::from_secs(2), || {
                s.decode.load().pages_used > 0
            });
        }
        drop(stream);
        eventually("decode pages back", Duration::from_millis(500), || {
            s.decode.load().pages_used == 0 && s.decode.load().waiting == 0
        });
        // The prefill hears of the request only now: it must not compute.
        let t0 = Instant::now();
        let e = s.prefill.submit(r.clone(), room).unwrap().blocking_wait();
        let e = e.unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "immediate={immediate}: prefill failed only after {:?}",
            t0.elapsed()
        );
        assert_eq!(e.error_type(), "aborted", "immediate={immediate}: {e:?}");
        assert_eq!(e.http_status(), 499);
        assert_eq!(s.prefill.load().pages_used, 0);
    }
    assert_clean(&s);
}

fn decode_batch_limit_queues_prefilled_requests(kind: TransportKind) {
    // Two decode slots for eight requests: prefilled requests wait for a
    // slot (their pages held) and still get their colocated output.
    let s = setup(
        kind,
        Opts {
            decode_max_batch: 2,
            ..Opts::default()
        },
    );
    let reqs: Vec<GenerateRequest> = (0..8)
        .map(|i| req(prompt(10 + 7 * i, i as u32), 20))
        .collect();
    let want: Vec<Output> = reqs.iter().map(|r| colocated(&s, r)).collect();
    let got: Vec<Output> = std::thread::scope(|sc| {
        let hs: Vec<_> = reqs.iter().map(|r| sc.spawn(|| pd(&s, r))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
    assert_clean(&s);
}

fn engines_start_and_serve_from_async_code(kind: TransportKind) {
    // What a server does: start the engines inside its own runtime and
    // await streams and tickets there.
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let want = {
        let s = setup(kind, Opts::default());
        colocated(&s, &req(prompt(25, 8), 6))
    };
    server.block_on(async move {
        let s = setup(kind, Opts::default());
        let r = req(prompt(25, 8), 6);
        let room = room();
        let ticket = s.prefill.submit(r.clone(), room).unwrap();
        let mut stream = s
            .decode
            .submit(r.clone(), room, s.prefill.bootstrap_addr())
            .unwrap();
        let mut ids = Vec::new();
        loop {
            match stream.next().await {
                Some(StreamEvent::Token(t)) => ids.push(t.id),
                Some(StreamEvent::Finished(_)) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(ids, want.0);
        assert_eq!(ticket.wait().await.unwrap().first_token, ids[0]);
        assert_eq!(s.decode.transfer_stats().await.unwrap().live_rooms, 0);
        assert_eq!(s.prefill.transfer_stats().await.unwrap().peers, 1);
        drop(s); // engines stop inside the runtime without panicking
    });
}

fn half_pairs_are_cleaned_up_by_their_timers(kind: TransportKind) {
    // A router that retries with a new room leaves half pairs behind: a
    // request only the prefill got, and one only decode got.
    let timers = TimerConfig {
        bootstrap: Duration::from_millis(300),
        waiting_for_input: Duration::from_millis(300),
        transfer: Duration::from_millis(300),
        ..handoff_transfer::testing::timers()
    };
    let s = setup(
        kind,
        Opts {
            timers: Some(timers),
            ..Opts::default()
        },
    );
    let r = req(prompt(30, 9), 4);
    // Prefill only: no destination ever comes; no compute, a timeout.
    let t0 = Instant::now();
    let e = s.prefill.submit(r.clone(), room()).unwrap().blocking_wait();
    let e = e.unwrap_err();
    eprintln!("prefill-only half: {e} after {:?}", t0.elapsed());
    assert_eq!((e.error_type(), e.http_status()), ("timeout", 504), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(s.prefill.load().pages_used, 0);
    // Decode only: its pages are reserved, then released by a timeout.
    let t0 = Instant::now();
    let stream = s
        .decode
        .submit(r.clone(), room(), s.prefill.bootstrap_addr())
        .unwrap();
    let e = drain(stream).unwrap_err();
    eprintln!("decode-only half: {e} after {:?}", t0.elapsed());
    assert_eq!(e.http_status(), 504, "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    eventually("decode pages back", Duration::from_secs(1), || {
        s.decode.load().pages_used == 0
    });
    assert_clean(&s);
    // The pair still serves.
    assert_eq!(pd(&s, &r), colocated(&s, &r));
    assert_clean(&s);
}

fn full_decode_pool_queues_requests_and_prefill_waits(kind: TransportKind) {
    // Decode holds 3 pages of 16 tokens; each request needs 2: one at a
    // time. The others wait in decode's prealloc queue, and the prefill
    // does not compute for them until their pages are reserved.
    let s = setup(
        kind,
        Opts {
            decode_kv_pages: Some(3),
            ..Opts::default()
        },
    );
    let reqs: Vec<GenerateRequest> = (0..4).map(|i| req(prompt(20, 20 + i), 12)).collect();
    let want: Vec<Output> = reqs.iter().map(|r| colocated(&s, r)).collect();
    let mut peak_waiting = 0;
    let got: Vec<Output> = std::thread::scope(|sc| {
        let hs: Vec<_> = reqs.iter().map(|r| sc.spawn(|| pd(&s, r))).collect();
        while !hs.iter().all(|h| h.is_finished()) {
            let (d, p) = (s.decode.load(), s.prefill.load());
            assert!(d.pages_used <= 2, "{d:?}");
            // Only the request holding decode pages may be computing.
            assert!(p.running <= 1, "{p:?}");
            peak_waiting = peak_waiting.max(d.waiting);
            std::thread::sleep(Duration::from_micros(200));
        }
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
    eprintln!("peak decode waiting: {peak_waiting}");
    assert!(peak_waiting >= 1, "no request was seen waiting for pages");
    assert_clean(&s);
}

fn streams_dropped_at_any_moment_leave_nothing_behind(kind: TransportKind) {
    // Clients walking away at every moment of a request's life (before the
    // room opens, while waiting, computing, transferring, committing,
    // decoding): all pages come back well before any room timer or TTL.
    let s = setup(kind, Opts::default());
    std::thread::scope(|sc| {
        for i in 0..24u32 {
            let s = &s;
            sc.spawn(move || {
                let r = req(prompt(20 + 9 * i as usize, i), 30);
                let room = room();
                let ticket = s.prefill.submit(r.clone(), room).unwrap();
                let mut stream = s
                    .decode
                    .submit(r, room, s.prefill.bootstrap_addr())
                    .unwrap();
                if i % 3 == 0 {
                    // Until some number of tokens arrived.
                    for _ in 0..i / 3 {
                        let _ = stream.blocking_next();
                    }
                } else {
                    std::thread::sleep(Duration::from_micros(150 * u64::from(i)));
                }
                drop(stream);
                let _ = ticket.blocking_wait();
            });
        }
    });
    let took = eventually(
        "pages back on both sides",
        Duration::from_millis(500),
        || s.decode.load().pages_used == 0 && s.prefill.load().pages_used == 0,
    );
    eprintln!("all pages back {took:?} after the last ticket");
    assert_clean(&s);
}
