//! The measuring (prefill) process of `bench-transfer`: it owns the source
//! pool and the `KvSender`, starts the decode process for each transport,
//! drives the rooms and times them, and runs the memcpy and raw TCP
//! baselines in between.

use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_kv::{KvPool, PageIndex, ShmRegion, ShmRegionHandle};
use handoff_proto::{Role, RoomId};
use handoff_transfer::{AuxData, KvSender, SenderConfig, SenderRoom, TransportKind};

use super::report::{
    latency, BenchReport, CaseReport, IdleCpu, LatencyReport, PlacedLatency, Sample,
};
use super::workload::{
    fill, geometry, handshake, placement, verify, zero, BenchConfig, IoRuntime, PageCase,
    PinThreads, Placement, LATENCY_ROUNDS, PEER_CPU_ENV,
};

/// A batch of single-page latency rooms: `n` of them, on destination pages
/// `first_page..first_page + n`.
#[derive(Debug, Clone, Copy)]
struct Rooms {
    n: usize,
    first_page: usize,
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

/// Wait until decode's destination for `room` arrived (a minute at most).
async fn wait_waiting(room: &mut SenderRoom) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(60), room.ready()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("room {}: {e}", room.room().get())),
        Err(_) => Err(format!(
            "room {}: no destination in 60 s",
            room.room().get()
        )),
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
                TransportKind::Shm | TransportKind::Nixl => 1,
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
                    TransportKind::Tcp | TransportKind::Nixl => "raw_tcp",
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
                let mut rooms = Vec::with_capacity(k);
                for _ in 0..k {
                    let r = tx.submit(ctx.room()).await.map_err(|e| e.to_string())?;
                    rooms.push(r);
                }
                let ok = peer.cmd(&format!(
                    "ROOMS {} {k} {}",
                    rooms[0].room().get(),
                    u8::from(contiguous)
                ))?;
                if ok != "OK" {
                    return Err(format!("decode peer: {ok}"));
                }
                for room in &mut rooms {
                    wait_waiting(room).await?;
                }
                let cpu0 = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid());
                let t0 = Instant::now();
                // Every room's write and end are queued before any wait.
                for (room, share) in rooms.iter().zip(&shares) {
                    let (a, b) = tokio::join!(
                        room.send(0..1, 0..share.len(), share.clone()),
                        room.finish(AuxData {
                            first_token: 1,
                            logprob: 0.0,
                            top: handoff_proto::datalink::TopLogprobs::NONE,
                        })
                    );
                    a.and(b).map_err(|e| e.to_string())?;
                }
                let mut out = Ok(());
                for room in &mut rooms {
                    let o = room.outcome().await;
                    if o.is_err() {
                        out = o;
                    }
                }
                let dt = t0.elapsed();
                let cpu = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid()) - cpu0;
                if let Err(e) = out {
                    return Err(format!("{} {}: {e}", kind.name(), case.label()));
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
                    TransportKind::Shm | TransportKind::Nixl => {
                        let rooms = Rooms {
                            n: iters,
                            first_page: 0,
                        };
                        let l = latency(
                            latency_4k(rooms, &tx, &mut peer, &mut ctx, &src_arc, on_io).await?,
                        );
                        if *kind == TransportKind::Shm {
                            report.latency_4k_shm = l;
                        } else {
                            report.latency_4k_nixl = l;
                            report.abort_release_nixl =
                                abort_release(cfg, &tx, &mut peer, &mut ctx).await?;
                        }
                    }
                }
                // What the two processes burn with a link up and nothing
                // to move (NIXL's progress thread must not spin).
                report
                    .idle_cpu
                    .push(idle_cpu(kind.name(), peer.pid()).await);
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
    let (sock, _) = listener.accept().map_err(|e| e.to_string())?;
    let _ = sock.set_nodelay(true);
    let cpu0 = cpu_seconds(std::process::id()) + cpu_seconds(peer.pid());
    let t0 = Instant::now();
    if contiguous {
        send_region(src, 0..s.len() * page, &sock)?;
    } else {
        for a in s {
            send_region(src, a.0 as usize * page..(a.0 as usize + 1) * page, &sock)?;
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
async fn one_room(mut room: SenderRoom, src: Arc<[PageIndex]>) -> (Duration, Result<(), String>) {
    let t0 = Instant::now();
    // The write and the end are queued at once, in order, and the room's
    // events channel yields its end.
    let (a, b) = tokio::join!(
        room.send(0..1, 0..1, src),
        room.finish(AuxData {
            first_token: 1,
            logprob: 0.0,
            top: handoff_proto::datalink::TopLogprobs::NONE,
        })
    );
    let out = room.outcome().await;
    let dt = t0.elapsed();
    let out = a
        .and(b)
        .map_err(|e| e.to_string())
        .and(out.map_err(|e| e.to_string()));
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
        let mut room = tx.submit(ctx.room()).await.map_err(|e| e.to_string())?;
        let id = room.room().get();
        zero(&peer.region, &[PageIndex(i as u32)], 4 << 10);
        let ok = peer.cmd(&format!("ONE {id} {i}"))?;
        if ok != "OK" {
            return Err(format!("decode peer: {ok}"));
        }
        wait_waiting(&mut room).await?;
        let (dt, out) = match io {
            Some(io) => {
                let src = src.clone();
                io.spawn(one_room(room, src))
                    .await
                    .map_err(|e| e.to_string())?
            }
            None => one_room(room, src.clone()).await,
        };
        v.push(dt.as_secs_f64() * 1e6);
        out.map_err(|e| format!("latency room {id}: {e}"))?;
    }
    Ok(v)
}

/// Percent of one core each process of the pair used over an idle window.
async fn idle_cpu(transport: &str, peer: u32) -> IdleCpu {
    let window = std::time::Duration::from_secs(3);
    let (us0, them0) = (cpu_seconds(std::process::id()), cpu_seconds(peer));
    tokio::time::sleep(window).await;
    let (us1, them1) = (cpu_seconds(std::process::id()), cpu_seconds(peer));
    let pct = |cpu: f64| 100.0 * cpu / window.as_secs_f64();
    IdleCpu {
        transport: transport.into(),
        prefill_pct: pct(us1 - us0),
        decode_pct: pct(them1 - them0),
    }
}

async fn abort_release(
    cfg: &BenchConfig,
    tx: &KvSender,
    peer: &mut Peer,
    ctx: &mut Ctx,
) -> Result<LatencyReport, String> {
    let first = ctx.next_room + 1;
    let mut rooms = Vec::with_capacity(cfg.latency_iters);
    for _ in 0..cfg.latency_iters {
        rooms.push(tx.submit(ctx.room()).await.map_err(|e| e.to_string())?);
    }
    let line = peer.cmd(&format!("ABORTS {first} {}", rooms.len()))?;
    let v: Vec<f64> = line
        .strip_prefix("ABORTS ")
        .ok_or_else(|| format!("decode peer: {line}"))?
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    for r in &mut rooms {
        let _ = r.outcome().await;
    }
    Ok(latency(v))
}

/// Write bytes `range` of `src` whole to the blocking socket `sock`.
fn send_region(
    src: &ShmRegion,
    range: std::ops::Range<usize>,
    sock: &std::net::TcpStream,
) -> Result<(), String> {
    use std::os::fd::AsFd;
    let total = range.len();
    let parts = [handoff_kv::WritePart::Region(range)];
    let mut done = 0;
    while done < total {
        match src
            .writev_to(&parts, done, sock.as_fd())
            .map_err(|e| e.to_string())?
        {
            Ok(0) => return Err("raw tcp: wrote nothing".into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}
