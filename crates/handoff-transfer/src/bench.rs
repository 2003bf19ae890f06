//! `bench-transfer` (DESIGN.md §1, §9; issue 3 "Benchmark"): KV transfer
//! bandwidth and latency per transport and page size, with the machine's
//! limits measured in the same run.
//!
//! Workload (kept exactly as the field's comparison harness): `bytes`
//! (1 GiB) pushed from a prefill *process* (this one) to a decode *process*
//! (a child: `<peer_exe> bench-peer ...`) on this host; cases one contiguous
//! buffer, 4 KiB, 64 KiB and 256 KiB pages; pages scattered on both sides
//! (pools of 2 × `bytes`; page i goes from source slot S[i] to destination
//! slot D[i], S and D shuffled choices of N distinct slots out of 2N,
//! seeded); 1 warm-up, 3 timed runs, median; timing ends when the data is in
//! the destination memory (prefill's room succeeds only after decode
//! acknowledged every byte); every run verified outside the timing. Also the
//! single 4 KiB transfer latency (the room's last send, finish and wait
//! issued from a task on the endpoint's I/O runtime, as the prefill engine
//! runs its rooms, and once more from outside it) and abort → room released
//! latency (median, p99), and for the same cases single-thread memcpy and raw loopback TCP
//! (one stream, one write/read per page, payload only), each of ours printed
//! as a ratio to them, plus CPU-seconds (both processes) per run. Each
//! baseline run follows one of ours (shm then memcpy, tcp then raw TCP,
//! warm-up included), so a slow phase of a shared host lands on both sides
//! of the ratio.
//!
//! The tcp latency and the raw ping-pong (4 KiB out, 1 byte back, blocking
//! threads) alternate in [`LATENCY_ROUNDS`] rounds, so a slow phase of a
//! shared host lands on both. On a VM the placement matters more than
//! anything else: two processes that wake each other on one CPU pay no
//! inter-processor interrupt, across two CPUs they pay one per wake-up.
//! `--pin same|split` (the `handoff` CLI, through [`PEER_CPU_ENV`]) fixes it.

use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_kv::{
    KvDtype, KvGeometry, KvLayout, KvPool, PageIndex, PageLease, ShmRegion, ShmRegionHandle,
};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig, KvDtype as WireDtype, KvLayoutKind};
use handoff_proto::receiver_room::Source;
use handoff_proto::room::RoomState;
use handoff_proto::{AbortOrigin, AuxSlot, Role, RoomId, TransferError};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use crate::{
    AuxData, KvReceiver, KvSender, ReceiverConfig, ReceiverPoll, SenderConfig, SenderPoll,
    TransportKind,
};

/// One page-size case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageCase {
    /// One contiguous buffer (placed as 256 KiB units, identity slots).
    Contiguous,
    /// Scattered pages of this many bytes.
    Paged(usize),
}

impl PageCase {
    /// The four cases of the workload.
    pub const STANDARD: [PageCase; 4] = [
        PageCase::Contiguous,
        PageCase::Paged(4 << 10),
        PageCase::Paged(64 << 10),
        PageCase::Paged(256 << 10),
    ];

    fn page_bytes(self) -> usize {
        match self {
            PageCase::Contiguous => 256 << 10,
            PageCase::Paged(b) => b,
        }
    }

    /// Label used in reports.
    pub fn label(self) -> String {
        match self {
            PageCase::Contiguous => "contiguous".into(),
            PageCase::Paged(b) => format!("{}KiB", b >> 10),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Bytes per transfer (1 GiB in the standard workload).
    pub bytes: usize,
    /// Page cases.
    pub cases: Vec<PageCase>,
    /// Transports.
    pub transports: Vec<TransportKind>,
    /// Untimed warm-up runs.
    pub warmup: usize,
    /// Timed runs.
    pub runs: usize,
    /// Placement seed.
    pub seed: u64,
    /// Iterations of the latency measurements.
    pub latency_iters: usize,
    /// Executable that runs `bench-peer` (the decode process).
    pub peer_exe: PathBuf,
    /// TCP streams per data link. With more than one, each tcp run moves
    /// its pages as that many concurrent rooms (a room travels on one
    /// stream), reported as transport `tcp-<N>streams`.
    pub tcp_streams: u8,
    /// Only the latency measurements (4 KiB case: tcp and shm, the raw
    /// ping-pong, abort → release), no bandwidth runs. The pools are sized
    /// from `bytes` as in the full run.
    pub latency_only: bool,
    /// Set as `HANDOFF_BENCH_PEER_CPU` in the decode process's environment:
    /// the CPU its `bench-peer` entry pins it to (`--pin`).
    pub peer_cpu: Option<usize>,
    /// Placements the tcp latency and the raw ping-pong are compared in
    /// again, after the comparison in the run's own placement. Needs
    /// `pin_threads` (in this process and in the decode process's
    /// `peer_main`).
    pub placements: Vec<Placement>,
    /// Re-pins every thread of the calling process (see [`PinThreads`]).
    pub pin_threads: Option<PinThreads>,
}

/// Re-pins every thread of the calling process: `Some(cpu)` onto that CPU,
/// `None` back onto the CPUs it started with. Threads it starts later
/// inherit the mask.
pub type PinThreads = fn(Option<usize>) -> Result<(), String>;

/// Where the two processes run for one latency comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Its name in the report.
    pub name: &'static str,
    /// The CPU of this (prefill) process.
    pub prefill_cpu: usize,
    /// The CPU of the decode process.
    pub decode_cpu: usize,
}

impl Placement {
    /// Prefill on CPU 0, decode on CPU 1: every wake-up crosses CPUs, as
    /// between a prefill and a decode worker on separate devices.
    pub const SPLIT: Placement = Placement {
        name: "split",
        prefill_cpu: 0,
        decode_cpu: 1,
    };
    /// Both on CPU 0: every wake-up is a context switch on one CPU.
    pub const SAME: Placement = Placement {
        name: "same",
        prefill_cpu: 0,
        decode_cpu: 0,
    };
}

impl BenchConfig {
    /// The standard workload; `peer_exe` must dispatch `bench-peer` to
    /// [`peer_main`].
    pub fn standard(peer_exe: PathBuf) -> Self {
        Self {
            bytes: 1 << 30,
            cases: PageCase::STANDARD.to_vec(),
            transports: TransportKind::ALL.to_vec(),
            warmup: 1,
            runs: 3,
            seed: 42,
            latency_iters: 200,
            peer_exe,
            tcp_streams: 1,
            latency_only: false,
            peer_cpu: None,
            placements: Vec::new(),
            pin_threads: None,
        }
    }
}

/// One (transport or baseline, page case) result.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// `shm`, `tcp`, or a baseline: `memcpy`, `raw_tcp`.
    pub transport: String,
    /// Page case label.
    pub page: String,
    /// Bytes per run.
    pub bytes: u64,
    /// GB/s (10^9 bytes per second) of each timed run.
    pub gbps_runs: Vec<f64>,
    /// Median of `gbps_runs`.
    pub gbps_median: f64,
    /// Every run (warm-up included) was byte-exact.
    pub verified: bool,
    /// CPU seconds (user + system, both processes) of each timed run.
    pub cpu_s_runs: Vec<f64>,
    /// Ours / the matching baseline (shm / memcpy, tcp / raw_tcp).
    pub ratio: Option<f64>,
}

/// One run of a case: its rate, CPU time and whether it landed byte-exact.
struct Sample {
    gbps: f64,
    cpu_s: f64,
    verified: bool,
}

impl CaseReport {
    fn new(transport: String, case: &PageCase, bytes: usize) -> Self {
        CaseReport {
            transport,
            page: case.label(),
            bytes: bytes as u64,
            gbps_runs: vec![],
            gbps_median: 0.0,
            verified: true,
            cpu_s_runs: vec![],
            ratio: None,
        }
    }

    /// Take a run's sample (a warm-up only counts towards `verified`).
    fn record(&mut self, timed: bool, x: Sample) {
        self.verified &= x.verified;
        if timed {
            self.gbps_runs.push(x.gbps);
            self.cpu_s_runs.push(x.cpu_s);
            self.gbps_median = percentile(&mut self.gbps_runs.clone(), 0.5);
        }
    }
}

/// Median and 99th percentile in microseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LatencyReport {
    /// Median.
    pub median_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchReport {
    /// Bandwidth cases.
    pub cases: Vec<CaseReport>,
    /// Single 4 KiB transfer over tcp: the room's send, finish and wait
    /// issued from a task on the endpoint's I/O runtime (where the prefill
    /// engine runs each room), until prefill's room succeeded.
    pub latency_4k: LatencyReport,
    /// The same over tcp with the caller on another runtime's thread: one
    /// more cross-thread hop each way (command in, outcome out).
    pub latency_4k_off_runtime: LatencyReport,
    /// Single 4 KiB transfer over shm.
    pub latency_4k_shm: LatencyReport,
    /// Raw TCP ping-pong: 4 KiB one way, 1 byte back. Measured in rounds
    /// interleaved with `latency_4k`'s, so both see the same phases of a
    /// shared host and the same placement of the two processes on its CPUs.
    pub latency_4k_raw_tcp: LatencyReport,
    /// `latency_4k`'s median over the ping-pong's.
    pub latency_4k_vs_raw_tcp: f64,
    /// Decode abort → its pages back in the free list.
    pub abort_release: LatencyReport,
    /// The tcp latency and the raw ping-pong again, in each of
    /// [`BenchConfig::placements`] (both processes pinned).
    pub latency_4k_placed: Vec<PlacedLatency>,
}

/// The tcp latency against the raw ping-pong in one placement.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PlacedLatency {
    /// [`Placement::name`].
    pub placement: String,
    /// Single 4 KiB transfer over tcp, as [`BenchReport::latency_4k`].
    pub tcp: LatencyReport,
    /// The raw ping-pong, alternating with `tcp` in rounds.
    pub raw_tcp: LatencyReport,
    /// `tcp`'s median over `raw_tcp`'s.
    pub tcp_vs_raw_tcp: f64,
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Environment variable naming the CPU the decode process pins itself to.
pub const PEER_CPU_ENV: &str = "HANDOFF_BENCH_PEER_CPU";

/// Rounds the tcp latency and the raw ping-pong alternate in.
const LATENCY_ROUNDS: usize = 10;

/// A batch of single-page latency rooms: `n` of them, on destination pages
/// `first_page..first_page + n`.
#[derive(Debug, Clone, Copy)]
struct Rooms {
    n: usize,
    first_page: usize,
}

fn latency(mut v: Vec<f64>) -> LatencyReport {
    LatencyReport {
        median_us: percentile(&mut v, 0.5),
        p99_us: percentile(&mut v, 0.99),
    }
}

/// Geometry whose (layer, page) span is `page_bytes`.
fn geometry(page_bytes: usize) -> KvGeometry {
    KvGeometry {
        layers: 1,
        kv_heads: 1,
        head_dim: page_bytes / 8,
        page_size: 1,
        dtype: KvDtype::F32,
    }
}

fn handshake(role: Role, g: &KvGeometry) -> HandshakeConfig {
    let mut h = HandshakeConfig::new(
        role,
        Fingerprint {
            model_id: "bench".into(),
            model_hash: [0; 32],
            layers: g.layers as u32,
            kv_heads: g.kv_heads as u32,
            head_dim: g.head_dim as u32,
            page_size: g.page_size as u32,
            dtype: WireDtype::F32,
            layout: KvLayoutKind::LayerPageKv,
            tp_rank: 0,
            tp_size: 1,
        },
    );
    // A destination of 2^18 pages is a 1 MiB frame.
    h.max_frame_len = 4 << 20;
    h
}

/// (S, D): source and destination slots of `n` pages out of `2n`.
fn placement(seed: u64, n: usize, contiguous: bool) -> (Vec<PageIndex>, Vec<PageIndex>) {
    if contiguous {
        let v: Vec<PageIndex> = (0..n as u32).map(PageIndex).collect();
        return (v.clone(), v);
    }
    let pick = |s: u64| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(s);
        let mut all: Vec<u32> = (0..2 * n as u32).collect();
        all.shuffle(&mut rng);
        all.truncate(n);
        all.into_iter().map(PageIndex).collect::<Vec<_>>()
    };
    (pick(seed), pick(seed ^ 0x9e37_79b9_7f4a_7c15))
}

fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn fill(region: &ShmRegion, pages: &[PageIndex], page: usize, salt: u64) {
    let mut buf = vec![0u8; page];
    for (i, p) in pages.iter().enumerate() {
        let mut x = salt ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for c in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        let _ = region.write_at(p.0 as usize * page, &buf);
    }
}

fn zero(region: &ShmRegion, pages: &[PageIndex], page: usize) {
    let z = vec![0u8; page];
    for p in pages {
        let _ = region.write_at(p.0 as usize * page, &z);
    }
}

fn verify(src: &ShmRegion, s: &[PageIndex], dst: &ShmRegion, d: &[PageIndex], page: usize) -> bool {
    s.iter().zip(d).all(|(a, b)| {
        let ra = a.0 as usize * page..(a.0 as usize + 1) * page;
        let rb = b.0 as usize * page..(b.0 as usize + 1) * page;
        src.with_slices(std::slice::from_ref(&ra), |x| {
            dst.with_slices(std::slice::from_ref(&rb), |y| x[0][..] == y[0][..])
                .unwrap_or(false)
        })
        .unwrap_or(false)
    })
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// The decode process, driven over stdin/stdout.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
    region: ShmRegion,
}

impl Peer {
    /// Start `cfg.peer_exe bench-peer` (seeded and pinned as `cfg` says).
    fn spawn(
        cfg: &BenchConfig,
        addr: SocketAddr,
        kind: TransportKind,
        page: usize,
        pages: usize,
        streams: u8,
    ) -> Result<Peer, String> {
        let (exe, seed) = (&cfg.peer_exe, cfg.seed);
        let mut cmd = Command::new(exe);
        if let Some(cpu) = cfg.peer_cpu {
            cmd.env(PEER_CPU_ENV, cpu.to_string());
        }
        let mut child = cmd
            .args([
                "bench-peer".to_string(),
                addr.to_string(),
                kind.name().to_string(),
                page.to_string(),
                pages.to_string(),
                seed.to_string(),
                streams.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", exe.display()))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| "decode peer did not start".to_string())?;
        let f: Vec<&str> = first.split_whitespace().collect();
        let (pid, fd, len) = match f.as_slice() {
            ["HANDLE", pid, fd, len] => (pid.parse(), fd.parse(), len.parse()),
            _ => return Err(format!("decode peer said {first:?}")),
        };
        let handle = ShmRegionHandle {
            pid: pid.map_err(|_| "pid")?,
            fd: fd.map_err(|_| "fd")?,
            len: len.map_err(|_| "len")?,
        };
        let region = ShmRegion::open(&handle).map_err(|e| e.to_string())?;
        Ok(Peer {
            child,
            stdin,
            lines,
            region,
        })
    }

    fn cmd(&mut self, line: &str) -> Result<String, String> {
        writeln!(self.stdin, "{line}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        self.lines
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| format!("decode peer did not answer {line:?}"))
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "QUIT");
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_waiting(tx: &KvSender, room: RoomId) -> Result<(), String> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        match tx.poll(room).await.map_err(|e| e.to_string())? {
            SenderPoll::Pending(RoomState::WaitingForInput) => return Ok(()),
            SenderPoll::Pending(_) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_micros(100)).await
            }
            other => return Err(format!("room {}: {other:?}", room.get())),
        }
    }
}

struct Ctx {
    next_room: u64,
}

impl Ctx {
    fn room(&mut self) -> RoomId {
        self.next_room += 1;
        // Counts up from 1: never the reserved 0.
        RoomId::new(self.next_room).expect("room ids start at 1")
    }
}

/// The transfer endpoint's own I/O runtime: one thread, as the prefill and
/// decode engines run it (`handoff_engine::pd::PdConfig::io_threads`), so
/// the benchmark measures the hops the product has. Shut down in the
/// background when dropped (it may be dropped inside the caller's runtime).
struct IoRuntime(Option<tokio::runtime::Runtime>);

impl IoRuntime {
    fn new() -> Result<Self, String> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-transfer-io")
            .enable_all()
            .build()
            .map(|rt| Self(Some(rt)))
            .map_err(|e| format!("I/O runtime: {e}"))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        match &self.0 {
            Some(rt) => rt.handle(),
            None => unreachable!("taken only on drop"),
        }
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Run the benchmark (this process is prefill; children are decode).
pub async fn run(cfg: &BenchConfig) -> Result<BenchReport, String> {
    let io = IoRuntime::new()?;
    let mut report = BenchReport::default();
    let mut ctx = Ctx { next_room: 0 };
    let latency_case = PageCase::Paged(4 << 10);
    for case in &cfg.cases {
        if cfg.latency_only && *case != latency_case {
            continue;
        }
        let page = case.page_bytes();
        let n = cfg.bytes / page;
        let contiguous = matches!(case, PageCase::Contiguous);
        let (s, d) = placement(cfg.seed, n, contiguous);
        let g = geometry(page);
        let (src_pool, _) = KvPool::new_shared(g, 2 * n).map_err(|e| e.to_string())?;
        let src = src_pool.shared_region().ok_or("pool not shared")?.clone();
        fill(&src, &s, page, cfg.seed);
        let layout = *src_pool.layout();
        let mut scfg = SenderConfig::new(handshake(Role::Prefill, &g));
        scfg.max_segment_bytes = 4 << 20;
        let tx = io
            .handle()
            .spawn(KvSender::start(scfg, src.clone(), layout))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let src_arc: Arc<[PageIndex]> = s.clone().into();
        let mut ours: Vec<CaseReport> = Vec::new();
        for kind in &cfg.transports {
            let streams = match kind {
                TransportKind::Tcp => cfg.tcp_streams.max(1),
                TransportKind::Shm => 1,
            };
            let mut peer = Peer::spawn(cfg, tx.local_addr(), *kind, page, 2 * n, streams)?;
            // One room per stream, each a contiguous share of the pages.
            let k = usize::from(streams);
            let shares: Vec<Arc<[PageIndex]>> = (0..k)
                .map(|i| s[i * n / k..(i + 1) * n / k].into())
                .collect();
            let label = if streams > 1 {
                format!("{}-{streams}streams", kind.name())
            } else {
                kind.name().into()
            };
            let mut rep = CaseReport::new(label, case, n * page);
            // The baseline's runs alternate with ours, so a slow phase of a
            // shared host lands on both sides of the ratio.
            let mut base = CaseReport::new(
                match kind {
                    TransportKind::Shm => "memcpy",
                    TransportKind::Tcp => "raw_tcp",
                }
                .into(),
                case,
                n * page,
            );
            let runs = if cfg.latency_only {
                0
            } else {
                cfg.warmup + cfg.runs
            };
            let memcpy_dst = match kind {
                TransportKind::Shm if runs > 0 => {
                    Some(ShmRegion::create("bench-memcpy", src.len()).map_err(|e| e.to_string())?)
                }
                _ => None,
            };
            for run in 0..runs {
                zero(&peer.region, &d, page);
                let rooms: Vec<RoomId> = (0..k).map(|_| ctx.room()).collect();
                for room in &rooms {
                    tx.open(*room).await.map_err(|e| e.to_string())?;
                }
                let ok = peer.cmd(&format!(
                    "ROOMS {} {k} {}",
                    rooms[0].get(),
                    u8::from(contiguous)
                ))?;
                if ok != "OK" {
                    return Err(format!("decode peer: {ok}"));
                }
                for room in &rooms {
                    wait_waiting(&tx, *room).await?;
                }
                let cpu0 = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid());
                let t0 = Instant::now();
                // Every room's write and end are queued before any wait.
                for (room, share) in rooms.iter().zip(&shares) {
                    let (a, b) = tokio::join!(
                        tx.send(*room, 0..1, 0..share.len(), share.clone()),
                        tx.finish(
                            *room,
                            AuxData {
                                first_token: 1,
                                logprob: 0.0
                            }
                        )
                    );
                    a.and(b).map_err(|e| e.to_string())?;
                }
                let mut out = SenderPoll::Success;
                for room in &rooms {
                    let o = tx.wait(*room).await.map_err(|e| e.to_string())?;
                    if o != SenderPoll::Success {
                        out = o;
                    }
                }
                let dt = t0.elapsed();
                let cpu = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid()) - cpu0;
                if out != SenderPoll::Success {
                    return Err(format!("{} {}: {out:?}", kind.name(), case.label()));
                }
                let timed = run >= cfg.warmup;
                rep.record(
                    timed,
                    Sample {
                        gbps: gbps(n * page, dt),
                        cpu_s: cpu,
                        verified: verify(&src, &s, &peer.region, &d, page),
                    },
                );
                let b = match &memcpy_dst {
                    Some(dst) => memcpy_run(&src, dst, &s, &d, page, contiguous)?,
                    None => raw_tcp_run(&mut peer, &src, &s, &d, page, contiguous)?,
                };
                base.record(timed, b);
            }
            drop(memcpy_dst);
            if runs > 0 {
                rep.ratio = Some(rep.gbps_median / base.gbps_median);
                report.cases.push(base);
            }
            if *case == latency_case {
                let iters = cfg.latency_iters;
                let on_io = Some(io.handle());
                match kind {
                    TransportKind::Tcp => {
                        let mut cmp = TcpVsPing {
                            iters,
                            tx: &tx,
                            peer: &mut peer,
                            ctx: &mut ctx,
                            src: &src_arc,
                            io: on_io,
                        };
                        let here = cmp.run().await?;
                        report.latency_4k = here.tcp;
                        report.latency_4k_raw_tcp = here.raw_tcp;
                        report.latency_4k_vs_raw_tcp = here.tcp_vs_raw_tcp;
                        if let Some(pin) = cfg.pin_threads {
                            for p in &cfg.placements {
                                let placed = cmp.run_placed(pin, p).await;
                                // Back to where the run started, even after a failure.
                                let restored = cmp.pin_both(pin, None, None);
                                report.latency_4k_placed.push(placed?);
                                restored?;
                            }
                        }
                        let rooms = Rooms {
                            n: iters,
                            first_page: 0,
                        };
                        report.latency_4k_off_runtime = latency(
                            latency_4k(rooms, &tx, &mut peer, &mut ctx, &src_arc, None).await?,
                        );
                        report.abort_release = abort_release(cfg, &tx, &mut peer, &mut ctx).await?;
                    }
                    TransportKind::Shm => {
                        let rooms = Rooms {
                            n: iters,
                            first_page: 0,
                        };
                        report.latency_4k_shm = latency(
                            latency_4k(rooms, &tx, &mut peer, &mut ctx, &src_arc, on_io).await?,
                        );
                    }
                }
            }
            if !cfg.latency_only {
                ours.push(rep);
            }
            drop(peer);
        }
        if cfg.latency_only {
            tx.shutdown();
            continue;
        }
        report.cases.append(&mut ours);
        tx.shutdown();
    }
    Ok(report)
}

/// One run of the memcpy baseline: single-thread copies of the same pages
/// from `src` into `dst` (a region the size of decode's pool).
fn memcpy_run(
    src: &ShmRegion,
    dst: &ShmRegion,
    s: &[PageIndex],
    d: &[PageIndex],
    page: usize,
    contiguous: bool,
) -> Result<Sample, String> {
    zero(dst, d, page);
    let cpu0 = cpu_seconds(std::process::id());
    let t0 = Instant::now();
    if contiguous {
        dst.copy_from(0, src, 0, s.len() * page)
            .map_err(|e| e.to_string())?;
    } else {
        for (a, b) in s.iter().zip(d) {
            dst.copy_from(b.0 as usize * page, src, a.0 as usize * page, page)
                .map_err(|e| e.to_string())?;
        }
    }
    let dt = t0.elapsed();
    Ok(Sample {
        gbps: gbps(s.len() * page, dt),
        cpu_s: cpu_seconds(std::process::id()) - cpu0,
        verified: verify(src, s, dst, d, page),
    })
}

/// One run of the raw TCP baseline: one stream, payload only, one write
/// per page, into the decode child's pool.
fn raw_tcp_run(
    peer: &mut Peer,
    src: &ShmRegion,
    s: &[PageIndex],
    d: &[PageIndex],
    page: usize,
    contiguous: bool,
) -> Result<Sample, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    zero(&peer.region, d, page);
    writeln!(peer.stdin, "RAW {addr} {}", u8::from(contiguous)).map_err(|e| e.to_string())?;
    peer.stdin.flush().map_err(|e| e.to_string())?;
    let (mut sock, _) = listener.accept().map_err(|e| e.to_string())?;
    let _ = sock.set_nodelay(true);
    let cpu0 = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid());
    let t0 = Instant::now();
    if contiguous {
        let all = 0..s.len() * page;
        src.with_slices(std::slice::from_ref(&all), |b| sock.write_all(&b[0]))
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    } else {
        for a in s {
            let r = a.0 as usize * page..(a.0 as usize + 1) * page;
            src.with_slices(std::slice::from_ref(&r), |b| sock.write_all(&b[0]))
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
        }
    }
    let done = peer
        .lines
        .recv_timeout(Duration::from_secs(120))
        .map_err(|_| "raw tcp receiver did not finish")?;
    let dt = t0.elapsed();
    let cpu = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid()) - cpu0;
    if done != "DONE" {
        return Err(format!("raw tcp receiver: {done}"));
    }
    Ok(Sample {
        gbps: gbps(s.len() * page, dt),
        cpu_s: cpu,
        verified: verify(src, s, &peer.region, d, page),
    })
}

/// `n` round trips of the raw ping-pong; the samples in µs.
fn raw_ping(n: usize, peer: &mut Peer) -> Result<Vec<f64>, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    writeln!(peer.stdin, "PING {addr} {n}").map_err(|e| e.to_string())?;
    peer.stdin.flush().map_err(|e| e.to_string())?;
    let (mut sock, _) = listener.accept().map_err(|e| e.to_string())?;
    let _ = sock.set_nodelay(true);
    let buf = vec![7u8; 4096];
    let mut one = [0u8; 1];
    let mut v = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        sock.write_all(&buf).map_err(|e| e.to_string())?;
        sock.read_exact(&mut one).map_err(|e| e.to_string())?;
        v.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let done = peer
        .lines
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| "ping peer did not finish")?;
    if done != "DONE" {
        return Err(format!("ping peer: {done}"));
    }
    Ok(v)
}

/// The tcp latency against the raw ping-pong: `iters` of each, alternating
/// in [`LATENCY_ROUNDS`] rounds so both see the same phases of the host.
struct TcpVsPing<'a> {
    iters: usize,
    tx: &'a KvSender,
    peer: &'a mut Peer,
    ctx: &'a mut Ctx,
    src: &'a Arc<[PageIndex]>,
    io: Option<&'a tokio::runtime::Handle>,
}

impl TcpVsPing<'_> {
    async fn run(&mut self) -> Result<PlacedLatency, String> {
        let rounds = LATENCY_ROUNDS.clamp(1, self.iters.max(1));
        let per = self.iters.div_ceil(rounds);
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let rooms = Rooms {
                n: per,
                first_page: round * per,
            };
            let mut v = latency_4k(rooms, self.tx, self.peer, self.ctx, self.src, self.io).await?;
            ours.append(&mut v);
            raw.append(&mut raw_ping(per, self.peer)?);
        }
        let (tcp, raw_tcp) = (latency(ours), latency(raw));
        Ok(PlacedLatency {
            placement: String::new(),
            tcp_vs_raw_tcp: tcp.median_us / raw_tcp.median_us,
            tcp,
            raw_tcp,
        })
    }

    /// Pin both processes as `p` says, then [`Self::run`].
    async fn run_placed(
        &mut self,
        pin: PinThreads,
        p: &Placement,
    ) -> Result<PlacedLatency, String> {
        self.pin_both(pin, Some(p.prefill_cpu), Some(p.decode_cpu))?;
        let mut r = self.run().await?;
        r.placement = p.name.to_string();
        Ok(r)
    }

    /// Re-pin this process's threads and the decode process's (`None`:
    /// back to the CPUs each started with).
    fn pin_both(
        &mut self,
        pin: PinThreads,
        prefill: Option<usize>,
        decode: Option<usize>,
    ) -> Result<(), String> {
        pin(prefill)?;
        let arg = decode.map_or("all".to_string(), |c| c.to_string());
        match self.peer.cmd(&format!("PIN {arg}"))?.as_str() {
            "OK" => Ok(()),
            other => Err(format!("decode peer: {other}")),
        }
    }
}

/// The timed part of one latency room: send, finish and wait issued
/// together, as a room's last write, its end and its outcome.
async fn one_room(
    tx: &KvSender,
    room: RoomId,
    src: Arc<[PageIndex]>,
) -> (Duration, Result<SenderPoll, String>) {
    let t0 = Instant::now();
    // The three commands are queued at once, in order: the driver
    // queues the write, the end, and registers the waiter in one go.
    let (a, b, out) = tokio::join!(
        tx.send(room, 0..1, 0..1, src),
        tx.finish(
            room,
            AuxData {
                first_token: 1,
                logprob: 0.0
            }
        ),
        tx.wait(room)
    );
    let dt = t0.elapsed();
    let out = a.and(b).and(out).map_err(|e| e.to_string());
    (dt, out)
}

/// `rooms.n` single 4 KiB rooms, one at a time; the samples in µs. With
/// `io`, each room's timed part runs as a task on the endpoint's I/O
/// runtime, as the prefill engine runs its rooms
/// (`handoff_engine::pd::prefill`); without, on the caller's own runtime.
/// Decode's destination page is touched before each room, so no
/// first-touch page fault of its fresh pool lands in the timing.
async fn latency_4k(
    rooms: Rooms,
    tx: &KvSender,
    peer: &mut Peer,
    ctx: &mut Ctx,
    src: &Arc<[PageIndex]>,
    io: Option<&tokio::runtime::Handle>,
) -> Result<Vec<f64>, String> {
    let mut v = Vec::new();
    for i in rooms.first_page..rooms.first_page + rooms.n {
        let room = ctx.room();
        tx.open(room).await.map_err(|e| e.to_string())?;
        zero(&peer.region, &[PageIndex(i as u32)], 4 << 10);
        let ok = peer.cmd(&format!("ONE {} {i}", room.get()))?;
        if ok != "OK" {
            return Err(format!("decode peer: {ok}"));
        }
        wait_waiting(tx, room).await?;
        let (dt, out) = match io {
            Some(io) => {
                let (tx, src) = (tx.clone(), src.clone());
                io.spawn(async move { one_room(&tx, room, src).await })
                    .await
                    .map_err(|e| e.to_string())?
            }
            None => one_room(tx, room, src.clone()).await,
        };
        v.push(dt.as_secs_f64() * 1e6);
        if out? != SenderPoll::Success {
            return Err(format!("latency room {}: not a success", room.get()));
        }
    }
    Ok(v)
}

async fn abort_release(
    cfg: &BenchConfig,
    tx: &KvSender,
    peer: &mut Peer,
    ctx: &mut Ctx,
) -> Result<LatencyReport, String> {
    let first = ctx.next_room + 1;
    let rooms: Vec<RoomId> = (0..cfg.latency_iters).map(|_| ctx.room()).collect();
    for r in &rooms {
        tx.open(*r).await.map_err(|e| e.to_string())?;
    }
    let line = peer.cmd(&format!("ABORTS {first} {}", rooms.len()))?;
    let v: Vec<f64> = line
        .strip_prefix("ABORTS ")
        .ok_or_else(|| format!("decode peer: {line}"))?
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    for r in &rooms {
        let _ = tx.wait(*r).await;
    }
    Ok(latency(v))
}

/// Decode side: open `room` from `sources` and reserve `lease` for it.
async fn open_reserved(
    rx: &KvReceiver,
    room: RoomId,
    sources: &[Source],
    lease: PageLease,
) -> Result<(), String> {
    rx.open(room, sources.to_vec())
        .await
        .map_err(|e| e.to_string())?;
    rx.reserve(room, lease, AuxSlot(0))
        .await
        .map_err(|e| e.to_string())
}

/// The decode process: `bench-peer <prefill addr> <shm|tcp> <page bytes>
/// <pool pages> <seed> [tcp streams]`, then commands on stdin (`ROOMS`, `ONE`, `ABORTS`,
/// `RAW`, `PING`, `QUIT`), answers on stdout.
pub async fn peer_main(args: &[String], pin: Option<PinThreads>) -> Result<(), String> {
    let get = |i: usize| args.get(i).cloned().ok_or(format!("missing argument {i}"));
    let addr: SocketAddr = get(0)?.parse().map_err(|e| format!("{e}"))?;
    let kind = if get(1)? == "shm" {
        TransportKind::Shm
    } else {
        TransportKind::Tcp
    };
    let page: usize = get(2)?.parse().map_err(|e| format!("{e}"))?;
    let pages: usize = get(3)?.parse().map_err(|e| format!("{e}"))?;
    let seed: u64 = get(4)?.parse().map_err(|e| format!("{e}"))?;
    let streams: u8 = match args.get(5) {
        Some(s) => s.parse().map_err(|e| format!("streams {s:?}: {e}"))?,
        None => 1,
    };
    let g = geometry(page);
    let (pool, handle) = KvPool::new_shared(g, pages).map_err(|e| e.to_string())?;
    let region = pool.shared_region().ok_or("pool not shared")?.clone();
    let layout: KvLayout = *pool.layout();
    let mut rc = ReceiverConfig::new(handshake(Role::Decode, &g), kind);
    rc.tcp_streams = streams;
    let io = IoRuntime::new()?;
    let rx = {
        let _in_io = io.handle().enter();
        KvReceiver::start(rc, region.clone(), layout)
    };
    let rank = {
        let rx = rx.clone();
        io.handle()
            .spawn(async move { rx.connect(addr).await })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?
    };
    let sources = vec![Source {
        rank,
        required_destinations: 1,
    }];
    println!("HANDLE {} {} {}", handle.pid, handle.fd, handle.len);
    let (ltx, mut lrx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines().map_while(Result::ok) {
            if ltx.send(l).is_err() {
                break;
            }
        }
    });
    let alloc = pool.allocator().clone();
    // Decode's side of the rooms handed out: each ends when decode
    // committed its room (prefill's success comes from the ack, which can
    // be ahead of that) and dropped the lease.
    let mut committing: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    while let Some(line) = lrx.recv().await {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
        match f.first().copied() {
            // `ROOMS <first room> <k> <contiguous>`: the run's destination
            // pages as k rooms, each a contiguous share (in page order).
            // `ONE <room> <page>`: one page.
            Some("ROOMS") | Some("ONE") => {
                let first = num(1);
                let rooms: Vec<(u64, Vec<PageIndex>)> = if f[0] == "ROOMS" {
                    let d = placement(seed, pages / 2, num(3) == 1).1;
                    let k = num(2).max(1) as usize;
                    (0..k)
                        .map(|i| {
                            let share = i * d.len() / k..(i + 1) * d.len() / k;
                            (first + i as u64, d[share].to_vec())
                        })
                        .collect()
                } else {
                    vec![(first, vec![PageIndex(num(2) as u32)])]
                };
                // A run's pages are the previous run's: lease them once the
                // previous rooms let go of them.
                for h in committing.drain(..) {
                    tokio::time::timeout(Duration::from_secs(30), h)
                        .await
                        .map_err(|_| "an earlier room never ended on decode")?
                        .map_err(|e| e.to_string())?;
                }
                for (room, dst) in rooms {
                    let room = RoomId::new(room).ok_or("room 0")?;
                    let lease = alloc.lease_exact(&dst).map_err(|e| e.to_string())?;
                    open_reserved(&rx, room, &sources, lease).await?;
                    let rx2 = rx.clone();
                    committing.push(tokio::spawn(async move {
                        // Success hands the lease back; dropping it frees the pages.
                        let _ = rx2.wait(room).await;
                    }));
                }
                println!("OK");
            }
            Some("ABORTS") => {
                let mut out = Vec::new();
                for i in 0..num(2) {
                    let room = RoomId::new(num(1) + i).ok_or("room 0")?;
                    let lease = alloc
                        .lease_exact(&[PageIndex(i as u32)])
                        .map_err(|e| e.to_string())?;
                    let base = alloc.stats().leased - 1;
                    open_reserved(&rx, room, &sources, lease).await?;
                    // Let the destination reach prefill (WaitingForInput there).
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let t0 = Instant::now();
                    rx.abort(
                        room,
                        TransferError::Aborted {
                            origin: AbortOrigin::Client,
                            reason: "bench abort".into(),
                            http_status: 499,
                        },
                    );
                    let a2 = alloc.clone();
                    let released = tokio::task::spawn_blocking(move || {
                        a2.wait_leased_at_most(base, Duration::from_secs(10))
                            .then(Instant::now)
                    })
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("pages never released")?;
                    out.push((released - t0).as_secs_f64() * 1e6);
                    if let Ok(ReceiverPoll::Pending(_)) = rx.poll(room).await {
                        let _ = rx.wait(room).await;
                    }
                }
                let s: Vec<String> = out.iter().map(|x| format!("{x:.1}")).collect();
                println!("ABORTS {}", s.join(" "));
            }
            Some("RAW") => {
                let a: SocketAddr = f
                    .get(1)
                    .ok_or("addr")?
                    .parse()
                    .map_err(|e| format!("{e}"))?;
                let contiguous = num(2) == 1;
                let dst = placement(seed, pages / 2, contiguous).1;
                let region = region.clone();
                let r = tokio::task::spawn_blocking(move || -> Result<(), String> {
                    let mut s = std::net::TcpStream::connect(a).map_err(|e| e.to_string())?;
                    if contiguous {
                        region
                            .with_mut(0..dst.len() * page, |b| s.read_exact(b))
                            .map_err(|e| e.to_string())?
                            .map_err(|e| e.to_string())?;
                    } else {
                        for p in &dst {
                            let r = p.0 as usize * page..(p.0 as usize + 1) * page;
                            region
                                .with_mut(r, |b| s.read_exact(b))
                                .map_err(|e| e.to_string())?
                                .map_err(|e| e.to_string())?;
                        }
                    }
                    Ok(())
                })
                .await
                .map_err(|e| e.to_string())?;
                r?;
                println!("DONE");
            }
            Some("PING") => {
                let a: SocketAddr = f
                    .get(1)
                    .ok_or("addr")?
                    .parse()
                    .map_err(|e| format!("{e}"))?;
                let iters = num(2);
                tokio::task::spawn_blocking(move || -> Result<(), String> {
                    let mut s = std::net::TcpStream::connect(a).map_err(|e| e.to_string())?;
                    let _ = s.set_nodelay(true);
                    let mut buf = vec![0u8; 4096];
                    for _ in 0..iters {
                        s.read_exact(&mut buf).map_err(|e| e.to_string())?;
                        s.write_all(&[1]).map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
                .await
                .map_err(|e| e.to_string())??;
                println!("DONE");
            }
            // `PIN <cpu>|all`: re-pin this process's threads.
            Some("PIN") => {
                let r = match (f.get(1).copied(), pin) {
                    (_, None) => Err("pinning not available".to_string()),
                    (Some("all"), Some(pin)) => pin(None),
                    (Some(c), Some(pin)) => match c.parse::<usize>() {
                        Ok(cpu) => pin(Some(cpu)),
                        Err(e) => Err(format!("PIN {c}: {e}")),
                    },
                    (None, _) => Err("PIN needs a CPU or `all`".to_string()),
                };
                match r {
                    Ok(()) => println!("OK"),
                    Err(e) => println!("ERR {e}"),
                }
            }
            Some("QUIT") | None => break,
            Some(other) => println!("ERR unknown command {other}"),
        }
    }
    rx.shutdown();
    Ok(())
}

/// Human-readable report: one line per case with ratios.
pub fn render(r: &BenchReport) -> String {
    let mut out = String::new();
    if !r.cases.is_empty() {
        out.push_str(&format!(
            "{:<10} {:<11} {:>9} {:>26} {:>8} {:>9} {:>8}\n",
            "transport", "page", "GB/s med", "GB/s runs", "ratio", "CPU s/run", "verified"
        ));
    }
    for c in &r.cases {
        let runs: Vec<String> = c.gbps_runs.iter().map(|x| format!("{x:.2}")).collect();
        let cpu = if c.cpu_s_runs.is_empty() {
            0.0
        } else {
            c.cpu_s_runs.iter().sum::<f64>() / c.cpu_s_runs.len() as f64
        };
        out.push_str(&format!(
            "{:<10} {:<11} {:>9.2} {:>26} {:>8} {:>9.2} {:>8}\n",
            c.transport,
            c.page,
            c.gbps_median,
            runs.join(" / "),
            c.ratio.map_or("-".to_string(), |x| format!("{x:.2}x")),
            cpu,
            c.verified
        ));
    }
    let l = |name: &str, x: &LatencyReport| {
        format!(
            "{name:<26} median {:>8.1} us   p99 {:>8.1} us\n",
            x.median_us, x.p99_us
        )
    };
    out.push_str(&l("4 KiB latency tcp", &r.latency_4k));
    out.push_str(&l("  caller off the runtime", &r.latency_4k_off_runtime));
    out.push_str(&l("4 KiB latency shm", &r.latency_4k_shm));
    out.push_str(&l("4 KiB raw TCP ping-pong", &r.latency_4k_raw_tcp));
    out.push_str(&format!(
        "4 KiB tcp / ping-pong      {:.2}x (medians; the two alternate in {LATENCY_ROUNDS} rounds)\n",
        r.latency_4k_vs_raw_tcp
    ));
    for p in &r.latency_4k_placed {
        out.push_str(&format!(
            "pinned {:<6} tcp {:>7.1} us, ping-pong {:>7.1} us: {:.2}x (medians)\n",
            p.placement, p.tcp.median_us, p.raw_tcp.median_us, p.tcp_vs_raw_tcp
        ));
    }
    out.push_str(&l("abort -> pages released", &r.abort_release));
    out
}
