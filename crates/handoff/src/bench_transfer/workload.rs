//! What `bench-transfer` moves and how both of its processes set up: the
//! page cases, the run's settings, the geometry and handshake both sides
//! agree on, the seeded page placement, filling and checking the pages, and
//! the endpoints' own I/O runtime.

use std::path::PathBuf;

use handoff_kv::{KvDtype, KvGeometry, PageIndex, ShmRegion};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig, KvLayoutKind};
use handoff_proto::Role;
use handoff_transfer::TransportKind;
use rand::seq::SliceRandom;
use rand::SeedableRng;

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

    pub fn page_bytes(self) -> usize {
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
    /// [`peer_main`](super::decode::peer_main).
    pub fn standard(peer_exe: PathBuf) -> Self {
        Self {
            bytes: 1 << 30,
            cases: PageCase::STANDARD.to_vec(),
            transports: TransportKind::ALL
                .into_iter()
                .chain(
                    TransportKind::Nixl
                        .available()
                        .then_some(TransportKind::Nixl),
                )
                .collect(),
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

/// Environment variable naming the CPU the decode process pins itself to.
pub const PEER_CPU_ENV: &str = "HANDOFF_BENCH_PEER_CPU";

/// Rounds the tcp latency and the raw ping-pong alternate in.
pub const LATENCY_ROUNDS: usize = 10;

/// Geometry whose (layer, page) span is `page_bytes`.
pub fn geometry(page_bytes: usize) -> KvGeometry {
    KvGeometry {
        layers: 1,
        kv_heads: 1,
        head_dim: page_bytes / 8,
        page_size: 1,
        dtype: KvDtype::F32,
    }
}

pub fn handshake(role: Role, g: &KvGeometry) -> HandshakeConfig {
    let mut h = HandshakeConfig::new(
        role,
        Fingerprint {
            model_id: "bench".into(),
            model_hash: [0; 32],
            layers: g.layers as u32,
            kv_heads: g.kv_heads as u32,
            head_dim: g.head_dim as u32,
            page_size: g.page_size as u32,
            dtype: g.dtype,
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
pub fn placement(seed: u64, n: usize, contiguous: bool) -> (Vec<PageIndex>, Vec<PageIndex>) {
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

pub fn fill(region: &ShmRegion, pages: &[PageIndex], page: usize, salt: u64) {
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

pub fn zero(region: &ShmRegion, pages: &[PageIndex], page: usize) {
    let z = vec![0u8; page];
    for p in pages {
        let _ = region.write_at(p.0 as usize * page, &z);
    }
}

pub fn verify(
    src: &ShmRegion,
    s: &[PageIndex],
    dst: &ShmRegion,
    d: &[PageIndex],
    page: usize,
) -> bool {
    s.iter().zip(d).all(|(a, b)| {
        let ra = a.0 as usize * page..(a.0 as usize + 1) * page;
        let rb = b.0 as usize * page..(b.0 as usize + 1) * page;
        let (mut x, mut y) = (vec![0u8; page], vec![0u8; page]);
        src.read_at(ra.start, &mut x).is_ok() && dst.read_at(rb.start, &mut y).is_ok() && x == y
    })
}

/// The transfer endpoint's own I/O runtime: one thread, as the prefill and
/// decode engines run it (`handoff_engine::pd::PdConfig::io_threads`), so
/// the benchmark measures the hops the product has. Shut down in the
/// background when dropped (it may be dropped inside the caller's runtime).
pub struct IoRuntime(Option<tokio::runtime::Runtime>);

impl IoRuntime {
    pub fn new() -> Result<Self, String> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-transfer-io")
            .enable_all()
            .build()
            .map(|rt| Self(Some(rt)))
            .map_err(|e| format!("I/O runtime: {e}"))
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
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
