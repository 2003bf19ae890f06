//! A transfer peer in its own process, for the conformance tests that kill
//! or freeze a real process. Built only with the `testing` feature (the
//! crate's own tests turn it on); `handoff bench-transfer` does not use it,
//! its decode side is `handoff bench-peer`.
//!
//! `handoff-transfer-peer decode <prefill-addr> <shm|tcp> <state>`: connect,
//! open room 77 and drive it to `state` (bootstrapping, waiting,
//! transferring), print `READY`, then wait forever.
//! `handoff-transfer-peer prefill <shm|tcp> <state>`: listen, print the
//! address, open room 77 and, once decode's destination arrived, drive it to
//! `state` (waiting, transferring), print `READY`, then wait forever. Its
//! pool is filled with the byte 0xA5 first, so any write it makes shows.
//! State `streaming`: like `transferring`, then keep sending the room's
//! layers in turn every 5 ms until a send is refused; then print
//! `STOPPED sends=<n> resumed=<whether a send came after a pause of over
//! 1 s, a freeze>`.
//! `handoff-transfer-peer pair <shm|tcp>`: prefill and decode both in this
//! process, room 77 half sent; print `READY`, wait for a line on stdin (the
//! test freezes and thaws the whole process meanwhile), finish the room,
//! then print both outcomes, both peer counts and both endpoints' stall
//! time in ms: `decode=success prefill=success peers=1/1 stalled=812/809`.
#![forbid(unsafe_code)]

use std::sync::Arc;

use handoff_transfer::testing;
use handoff_transfer::{KvReceiver, KvSender, TransportKind};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Err(e) = run(&args).await {
        eprintln!("peer: {e}");
        std::process::exit(2);
    }
}

fn kind(s: &str) -> TransportKind {
    match s {
        "shm" => TransportKind::Shm,
        "nixl" => TransportKind::Nixl,
        _ => TransportKind::Tcp,
    }
}

async fn run(args: &[String]) -> Result<(), String> {
    match args.get(1).map(String::as_str) {
        Some("decode") => {
            let raw: u64 = args.get(5).and_then(|r| r.parse().ok()).unwrap_or(77);
            let room = handoff_proto::RoomId::new(raw).ok_or("room")?;
            let addr = args
                .get(2)
                .ok_or("addr")?
                .parse()
                .map_err(|e| format!("{e}"))?;
            let k = kind(args.get(3).ok_or("transport")?);
            let state = args.get(4).ok_or("state")?.clone();
            let (pool, _) = testing::pool();
            let region = pool.shared_region().ok_or("shared")?.clone();
            let rx = KvReceiver::start(testing::receiver_config(k), region, *pool.layout());
            let rank = rx.connect(addr).await.map_err(|e| e.to_string())?;
            let mut r = rx
                .submit(room, testing::sources(rank))
                .await
                .map_err(|e| e.to_string())?;
            if state != "bootstrapping" {
                let lease = pool.allocator().lease(4).map_err(|e| e.to_string())?;
                r.reserve(lease, handoff_proto::AuxSlot(1), 0)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            println!("READY");
            std::future::pending::<()>().await;
        }
        Some("prefill") => {
            let room = handoff_proto::RoomId::new(77).ok_or("room")?;
            let k = kind(args.get(2).ok_or("transport")?);
            let state = args.get(3).ok_or("state")?.clone();
            // As a prefill worker started for NIXL does: the agent is made
            // (or refused) before anyone connects.
            handoff_transfer::check_transport(k).map_err(|e| e.to_string())?;
            let (pool, _) = testing::pool();
            let region = pool.shared_region().ok_or("shared")?.clone();
            region
                .write_at(0, &vec![0xA5; pool.layout().pool_bytes()])
                .map_err(|e| e.to_string())?;
            let tx = KvSender::start(testing::sender_config(), region, *pool.layout())
                .await
                .map_err(|e| e.to_string())?;
            println!("{}", tx.local_addr());
            let mut r = tx.submit(room).await.map_err(|e| e.to_string())?;
            if state != "bootstrapping" {
                r.ready().await.map_err(|e| e.to_string())?;
            }
            let src: Arc<[handoff_kv::PageIndex]> =
                (0..4).map(handoff_kv::PageIndex).collect::<Vec<_>>().into();
            if state == "transferring" || state == "streaming" {
                r.send(0..1, 0..4, src.clone())
                    .await
                    .map_err(|e| e.to_string())?;
            }
            println!("READY");
            if state == "streaming" {
                let layers = testing::geometry().layers;
                let (mut sends, mut resumed) = (1u64, false);
                let mut last = std::time::Instant::now();
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    // A gap this long is the test's SIGSTOP: what follows is
                    // the writer resumed.
                    resumed |= last.elapsed() > std::time::Duration::from_secs(1);
                    last = std::time::Instant::now();
                    let layer = (sends as usize) % layers;
                    if let Err(e) = r.send(layer..layer + 1, 0..4, src.clone()).await {
                        println!("STOPPED sends={sends} resumed={resumed} error={e}");
                        break;
                    }
                    sends += 1;
                }
            }
            std::future::pending::<()>().await;
        }
        Some("pair") => pair(kind(args.get(2).ok_or("transport")?))
            .await
            .map_err(|e| e.to_string())?,
        _ => return Err("usage: handoff-transfer-peer decode|prefill|pair ...".into()),
    }
    Ok(())
}

async fn pair(k: TransportKind) -> Result<(), handoff_transfer::TransportError> {
    use handoff_transfer::AuxData;
    let room = handoff_proto::RoomId::new(77).expect("non-zero");
    let (p_pool, _) = testing::pool();
    let (d_pool, _) = testing::pool();
    let shared = |p: &handoff_kv::KvPool| p.shared_region().expect("shared pool").clone();
    let tx = KvSender::start(testing::sender_config(), shared(&p_pool), *p_pool.layout()).await?;
    let rx = KvReceiver::start(
        testing::receiver_config(k),
        shared(&d_pool),
        *d_pool.layout(),
    );
    let rank = rx.connect(tx.local_addr()).await?;
    let mut d = rx.submit(room, testing::sources(rank)).await?;
    let mut p = tx.submit(room).await?;
    let lease = d_pool
        .allocator()
        .lease(4)
        .map_err(|e| handoff_transfer::TransportError::Bootstrap(e.to_string()))?;
    d.reserve(lease, handoff_proto::AuxSlot(1), 0)
        .await
        .map_err(handoff_transfer::TransportError::Room)?;
    p.ready()
        .await
        .map_err(handoff_transfer::TransportError::Room)?;
    let src: Arc<[handoff_kv::PageIndex]> =
        (0..4).map(handoff_kv::PageIndex).collect::<Vec<_>>().into();
    p.send(0..1, 0..4, src.clone()).await?;
    println!("READY");
    let (go, went) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let _ = go.send(());
    });
    let _ = went.await;
    // The room's rest goes only if the stall left the peers paired.
    let _ = p.send(1..2, 0..4, src).await;
    let _ = p
        .finish(AuxData {
            first_token: 7,
            logprob: 0.0,
            top: handoff_proto::datalink::TopLogprobs::NONE,
        })
        .await;
    let decode = match d.landed().await {
        Ok(_) => "success".to_string(),
        Err(e) => format!("Failed({e:?})"),
    };
    let prefill = match p.outcome().await {
        Ok(()) => "success".to_string(),
        Err(e) => format!("Failed({e:?})"),
    };
    let (ps, ds) = (tx.stats().await?, rx.stats().await?);
    println!(
        "decode={decode} prefill={prefill} peers={}/{} stalled={}/{}",
        ps.peers,
        ds.peers,
        ps.stalled.as_millis(),
        ds.stalled.as_millis()
    );
    Ok(())
}
