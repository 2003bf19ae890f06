//! The decode process of `bench-transfer` (`handoff bench-peer ...`, started
//! by the measuring process): its own pool in shared memory and a
//! `KvReceiver`, driven by line commands on stdin, answering on stdout.

use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use handoff_kv::{KvLayout, KvPool, PageIndex, PageLease};
use handoff_proto::receiver_room::Source;
use handoff_proto::{AbortOrigin, AuxSlot, Role, RoomId, TransferError};
use handoff_transfer::{KvReceiver, ReceiverConfig, ReceiverRoom, TransportKind};

use super::workload::{geometry, handshake, placement, IoRuntime, PinThreads};

/// Fill `range` of `region` from the blocking socket `s` (the raw TCP
/// baseline reads straight into the pool, as a link reader does).
fn read_exact_into(
    region: &handoff_kv::ShmRegion,
    mut range: std::ops::Range<usize>,
    s: &std::net::TcpStream,
) -> Result<(), String> {
    use std::os::fd::AsFd;
    while !range.is_empty() {
        match region.readv_into(range.clone(), &mut [], s.as_fd()) {
            Err(e) => return Err(e.to_string()),
            Ok(Ok(0)) => return Err("raw stream closed early".into()),
            Ok(Ok(n)) => range.start += n,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Decode side: accept `room` from `sources` and reserve `lease` for it.
async fn open_reserved(
    rx: &KvReceiver,
    room: RoomId,
    sources: &[Source],
    lease: PageLease,
) -> Result<ReceiverRoom, String> {
    let mut r = rx
        .submit(room, sources.to_vec())
        .await
        .map_err(|e| e.to_string())?;
    r.reserve(lease, AuxSlot(0), 0)
        .await
        .map_err(|e| e.to_string())?;
    Ok(r)
}

/// The decode process: `bench-peer <prefill addr> <shm|tcp|nixl> <page bytes>
/// <pool pages> <seed> [tcp streams]`, then commands on stdin (`ROOMS`, `ONE`, `ABORTS`,
/// `RAW`, `PING`, `QUIT`), answers on stdout.
pub async fn peer_main(args: &[String], pin: Option<PinThreads>) -> Result<(), String> {
    let get = |i: usize| args.get(i).cloned().ok_or(format!("missing argument {i}"));
    let addr: SocketAddr = get(0)?.parse().map_err(|e| format!("{e}"))?;
    let kind = match get(1)?.as_str() {
        "shm" => TransportKind::Shm,
        "nixl" => TransportKind::Nixl,
        _ => TransportKind::Tcp,
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
    let peer = {
        let rx = rx.clone();
        io.handle()
            .spawn(async move { rx.connect(addr).await })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?
    };
    let sources = vec![Source {
        peer,
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
                    let mut r = open_reserved(&rx, room, &sources, lease).await?;
                    committing.push(tokio::spawn(async move {
                        // Success hands the lease back; dropping it frees the pages.
                        let _ = r.landed().await;
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
                    let mut r = open_reserved(&rx, room, &sources, lease).await?;
                    // Let the destination reach prefill (WaitingForInput there).
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let t0 = Instant::now();
                    r.abort(TransferError::Aborted {
                        origin: AbortOrigin::Client,
                        reason: "bench abort".into(),
                        http_status: 499,
                    });
                    let a2 = alloc.clone();
                    let released = tokio::task::spawn_blocking(move || {
                        a2.wait_leased_at_most(base, Duration::from_secs(10))
                            .then(Instant::now)
                    })
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("pages never released")?;
                    out.push((released - t0).as_secs_f64() * 1e6);
                    let _ = r.landed().await;
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
                    let s = std::net::TcpStream::connect(a).map_err(|e| e.to_string())?;
                    if contiguous {
                        read_exact_into(&region, 0..dst.len() * page, &s)?;
                    } else {
                        for p in &dst {
                            let r = p.0 as usize * page..(p.0 as usize + 1) * page;
                            read_exact_into(&region, r, &s)?;
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
