//! A transfer peer in its own process, for tests that kill or freeze a real
//! process (and for the transfer benchmark's decode side).
//!
//! `handoff-transfer-peer decode <prefill-addr> <shm|tcp> <state>`: connect,
//! open room 77 and drive it to `state` (bootstrapping, waiting,
//! transferring), print `READY`, then wait forever.
//! `handoff-transfer-peer prefill <shm|tcp> <state>`: listen, print the
//! address, open room 77 and, once decode's destination arrived, drive it to
//! `state` (waiting, transferring), print `READY`, then wait forever.
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
    if s == "shm" {
        TransportKind::Shm
    } else {
        TransportKind::Tcp
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
            rx.open(room, testing::sources(rank))
                .await
                .map_err(|e| e.to_string())?;
            if state != "bootstrapping" {
                let lease = pool.allocator().lease(4).map_err(|e| e.to_string())?;
                rx.reserve(room, lease, handoff_proto::AuxSlot(1))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            println!("READY");
            std::future::pending::<()>().await;
        }
        Some("prefill") => {
            let room = handoff_proto::RoomId::new(77).ok_or("room")?;
            let _k = kind(args.get(2).ok_or("transport")?);
            let state = args.get(3).ok_or("state")?.clone();
            let (pool, _) = testing::pool();
            let region = pool.shared_region().ok_or("shared")?.clone();
            let tx = KvSender::start(testing::sender_config(), region, *pool.layout())
                .await
                .map_err(|e| e.to_string())?;
            println!("{}", tx.local_addr());
            tx.open(room).await.map_err(|e| e.to_string())?;
            if state != "bootstrapping" {
                testing::wait_sender_state(
                    &tx,
                    room,
                    handoff_proto::room::RoomState::WaitingForInput,
                )
                .await
                .map_err(|e| e.to_string())?;
            }
            if state == "transferring" {
                let src: Arc<[handoff_kv::PageIndex]> =
                    (0..4).map(handoff_kv::PageIndex).collect::<Vec<_>>().into();
                tx.send(room, 0..1, 0..4, src)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            println!("READY");
            std::future::pending::<()>().await;
        }
        _ => return Err("usage: handoff-transfer-peer decode|prefill ...".into()),
    }
    Ok(())
}
