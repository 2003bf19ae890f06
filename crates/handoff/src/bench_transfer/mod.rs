//! `handoff bench-transfer`: KV transfer
//! bandwidth and latency per transport and page size, with the machine's
//! limits measured in the same run.
//!
//! Workload (kept exactly as the field's comparison harness): `bytes`
//! (1 GiB) pushed from a prefill *process* (this one) to a decode *process*
//! (a child: this executable as `handoff bench-peer ...`) on this host;
//! cases one contiguous buffer, 4 KiB, 64 KiB and 256 KiB pages; pages scattered on both sides
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
//! threads) alternate in [`workload::LATENCY_ROUNDS`] rounds, so a slow phase of a
//! shared host lands on both. On a VM the placement matters more than
//! anything else: two processes that wake each other on one CPU pay no
//! inter-processor interrupt, across two CPUs they pay one per wake-up.
//! `--pin same|split` fixes it (through [`workload::PEER_CPU_ENV`] in the
//! decode process).
//!
//! * [`workload`] — the page cases, the run's settings, geometry, placement.
//! * [`prefill`] — the measuring process: rooms, timing, baselines.
//! * [`decode`] — the decode process, `handoff bench-peer`.
//! * [`report`] — the report and its table.

mod decode;
mod prefill;
mod report;
mod workload;

use anyhow::Context;
use handoff_transfer::TransportKind;
use workload::{BenchConfig, PageCase, Placement, PEER_CPU_ENV};

/// Flags of `handoff bench-transfer`.
#[derive(Debug, clap::Args)]
pub struct BenchTransferArgs {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Bytes per transfer (the standard workload is 1 GiB).
    #[arg(long, default_value_t = 1 << 30)]
    bytes: usize,
    /// Timed runs per case (median reported); bandwidth runs only, so
    /// refused with `--only latency`.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100), conflicts_with = "only")]
    runs: u32,
    /// TCP streams per data link; with more than one, each tcp run moves
    /// its pages as that many concurrent rooms.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    tcp_streams: u8,
    /// Iterations of each latency measurement.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    latency_iters: u32,
    /// Run only this part: `latency` (4 KiB latency over tcp and shm, the
    /// raw ping-pong, abort → release; no bandwidth runs).
    #[arg(long, value_parser = ["latency"])]
    only: Option<String>,
    /// Pin the two processes (this one and the decode child) for a
    /// reproducible placement: `same` puts both on CPU 0, `split` this one
    /// on CPU 0 and decode on CPU 1. Latency on a VM depends mostly on
    /// whether the two wake each other on one CPU or across two.
    #[arg(long, value_enum)]
    pin: Option<Pin>,
    /// Run only these page cases (repeat the flag for several; default:
    /// all four).
    #[arg(long = "case", value_enum)]
    cases: Vec<CaseArg>,
    /// Run only this transport (and its baseline: memcpy for shm, raw TCP
    /// for tcp and nixl); default: shm and tcp, and nixl in a build with
    /// the `nixl` feature.
    #[arg(long, value_enum)]
    transport: Option<TransportArg>,
}

/// A page case of `--case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CaseArg {
    /// One contiguous buffer.
    Contiguous,
    /// Scattered 4 KiB pages.
    #[value(name = "4k")]
    K4,
    /// Scattered 64 KiB pages.
    #[value(name = "64k")]
    K64,
    /// Scattered 256 KiB pages.
    #[value(name = "256k")]
    K256,
}

impl CaseArg {
    fn case(self) -> PageCase {
        match self {
            CaseArg::Contiguous => PageCase::Contiguous,
            CaseArg::K4 => PageCase::Paged(4 << 10),
            CaseArg::K64 => PageCase::Paged(64 << 10),
            CaseArg::K256 => PageCase::Paged(256 << 10),
        }
    }
}

/// A transport of `--transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// Shared memory (decode pulls), against memcpy.
    Shm,
    /// TCP, against raw TCP.
    Tcp,
    /// NIXL (UCX), against raw TCP; compare it with tcp's row of the
    /// same run. Needs a build with the `nixl` feature.
    Nixl,
}

/// Where `--pin` puts the two benchmark processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Pin {
    /// Both on CPU 0.
    Same,
    /// Prefill (this process) on CPU 0, decode on CPU 1.
    Split,
}

/// Fail clearly unless this process may run on each of `cpus`.
fn check_cpus(cpus: &[usize]) -> anyhow::Result<()> {
    use nix::sched::sched_getaffinity;
    use nix::unistd::Pid;
    let allowed = sched_getaffinity(Pid::from_raw(0)).context("reading this process's CPUs")?;
    for &cpu in cpus {
        if !allowed.is_set(cpu).unwrap_or(false) {
            anyhow::bail!(
                "cannot pin to CPU {cpu}: this process may not run there \
                 (`--pin split` needs CPUs 0 and 1, `--pin same` CPU 0)"
            );
        }
    }
    Ok(())
}

/// Re-pin every thread of this process: onto `cpu`, or back onto the CPUs
/// the process started with (`None`). Threads started later inherit the
/// mask of the thread that starts them.
fn pin_threads(cpu: Option<usize>) -> Result<(), String> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    static START: std::sync::OnceLock<Result<CpuSet, String>> = std::sync::OnceLock::new();
    let start = START
        .get_or_init(|| {
            sched_getaffinity(Pid::from_raw(0))
                .map_err(|e| format!("reading this process's CPUs: {e}"))
        })
        .clone()?;
    let set = match cpu {
        Some(c) => {
            let mut s = CpuSet::new();
            s.set(c).map_err(|e| format!("CPU {c}: {e}"))?;
            s
        }
        None => start,
    };
    let tasks =
        std::fs::read_dir("/proc/self/task").map_err(|e| format!("/proc/self/task: {e}"))?;
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        match sched_setaffinity(Pid::from_raw(tid), &set) {
            // A thread that ended since the listing needs nothing.
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => return Err(format!("pinning thread {tid} to {cpu:?}: {e}")),
        }
    }
    Ok(())
}

/// Arguments of the hidden decode-side process.
#[derive(Debug, clap::Args)]
pub struct BenchPeerArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Run the benchmark and print its report.
pub fn run(args: BenchTransferArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the handoff executable")?;
    let mut cfg = BenchConfig::standard(exe);
    cfg.bytes = args.bytes;
    cfg.runs = args.runs as usize;
    cfg.tcp_streams = args.tcp_streams;
    cfg.latency_iters = args.latency_iters as usize;
    cfg.latency_only = args.only.as_deref() == Some("latency");
    if !args.cases.is_empty() {
        if cfg.latency_only && !args.cases.contains(&CaseArg::K4) {
            anyhow::bail!("--only latency measures the 4 KiB case: --case must include 4k");
        }
        cfg.cases = args.cases.iter().map(|c| c.case()).collect();
    }
    if let Some(t) = args.transport {
        cfg.transports = vec![match t {
            TransportArg::Shm => TransportKind::Shm,
            TransportArg::Tcp => TransportKind::Tcp,
            TransportArg::Nixl => TransportKind::Nixl,
        }];
    }
    if let Some(pin) = args.pin {
        let peer_cpu = match pin {
            Pin::Same => 0,
            Pin::Split => 1,
        };
        check_cpus(&[0, peer_cpu])?;
        // Before the runtime starts, so its threads inherit the mask.
        pin_threads(Some(0)).map_err(anyhow::Error::msg)?;
        cfg.peer_cpu = Some(peer_cpu);
    } else if check_cpus(&[0, 1]).is_ok() {
        // Unpinned, the kernel decides whether the two processes wake each
        // other on one CPU or across two, and it need not decide alike for
        // our tasks and for the ping-pong's two blocking threads: compare
        // them again in both fixed placements.
        cfg.placements = vec![Placement::SPLIT, Placement::SAME];
        cfg.pin_threads = Some(pin_threads);
    }
    let report = runtime()?
        .block_on(prefill::run(&cfg))
        .map_err(|e| anyhow::anyhow!("bench-transfer failed: {e}"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::render(&report));
    }
    Ok(())
}

/// The decode side of the benchmark.
pub fn peer(args: BenchPeerArgs) -> anyhow::Result<()> {
    if let Ok(cpu) = std::env::var(PEER_CPU_ENV) {
        let cpu: usize = cpu
            .parse()
            .with_context(|| format!("{}={cpu:?} is not a CPU number", PEER_CPU_ENV))?;
        pin_threads(Some(cpu)).map_err(anyhow::Error::msg)?;
    }
    runtime()?
        .block_on(decode::peer_main(&args.args, Some(pin_threads)))
        .map_err(|e| anyhow::anyhow!("bench peer failed: {e}"))
}
