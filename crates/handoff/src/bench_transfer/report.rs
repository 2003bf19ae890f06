//! `bench-transfer`'s report: per-case bandwidth with its baseline ratio,
//! latency medians and p99s, and the human-readable table.

use serde::Serialize;

use super::workload::{PageCase, LATENCY_ROUNDS};

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
pub struct Sample {
    /// GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// CPU seconds (user + system) of the processes that did the work.
    pub cpu_s: f64,
    /// The pages landed byte-exact.
    pub verified: bool,
}

impl CaseReport {
    pub fn new(transport: String, case: &PageCase, bytes: usize) -> Self {
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
    pub fn record(&mut self, timed: bool, x: Sample) {
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
    /// Single 4 KiB transfer over NIXL.
    pub latency_4k_nixl: LatencyReport,
    /// Decode abort → its pages back in the free list, over NIXL.
    pub abort_release_nixl: LatencyReport,
    /// Each process's CPU with a link up and idle, per transport.
    pub idle_cpu: Vec<IdleCpu>,
    /// The tcp latency and the raw ping-pong again, in each of
    /// [`BenchConfig::placements`](super::workload::BenchConfig::placements) (both processes pinned).
    pub latency_4k_placed: Vec<PlacedLatency>,
}

/// What each process of the pair used of one core, a link up and idle.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IdleCpu {
    /// The link's transport.
    pub transport: String,
    /// The prefill process (this one), percent of a core.
    pub prefill_pct: f64,
    /// The decode process (the peer), percent of a core.
    pub decode_pct: f64,
}

/// The tcp latency against the raw ping-pong in one placement.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PlacedLatency {
    /// [`Placement::name`](super::workload::Placement::name).
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

pub fn latency(mut v: Vec<f64>) -> LatencyReport {
    LatencyReport {
        median_us: percentile(&mut v, 0.5),
        p99_us: percentile(&mut v, 0.99),
    }
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
    if r.latency_4k_nixl.median_us > 0.0 {
        out.push_str(&l("4 KiB latency nixl", &r.latency_4k_nixl));
        out.push_str(&l("abort -> released (nixl)", &r.abort_release_nixl));
    }
    for c in &r.cases {
        if c.transport != "nixl" {
            continue;
        }
        let tcp = r
            .cases
            .iter()
            .find(|t| t.transport == "tcp" && t.page == c.page && t.gbps_median > 0.0);
        if let Some(t) = tcp {
            out.push_str(&format!(
                "nixl / tcp {:<11}      {:.2}x (GB/s medians, same run)\n",
                c.page,
                c.gbps_median / t.gbps_median
            ));
        }
    }
    for i in &r.idle_cpu {
        out.push_str(&format!(
            "idle, link up ({:<4})       prefill {:>5.2}% of a core, decode {:>5.2}%\n",
            i.transport, i.prefill_pct, i.decode_pct
        ));
    }
    out
}
