//! Bootstrap: decode learns where each prefill rank listens, waiting (with
//! backoff) for ranks that register late, then connects to them.

use std::time::Duration;

use handoff_proto::RankId;
use handoff_transfer::bootstrap::{self, BootstrapServer};
use handoff_transfer::testing;
use handoff_transfer::{KvReceiver, KvSender, TransportError, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_finds_a_late_prefill_rank_and_connects() {
    let server = BootstrapServer::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let at = server.local_addr();
    // Decode asks before prefill registered: it retries.
    let asking = tokio::spawn(async move { bootstrap::query(at, 1, Duration::from_secs(3)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (p_pool, _) = testing::pool();
    let tx = KvSender::start(
        testing::sender_config(),
        p_pool.shared_region().unwrap().clone(),
        *p_pool.layout(),
    )
    .await
    .unwrap();
    server.register(RankId(0), tx.local_addr());
    let ranks = asking.await.unwrap().unwrap();
    assert_eq!(ranks.get(&RankId(0)), Some(&tx.local_addr()));
    let (d_pool, _) = testing::pool();
    let rx = KvReceiver::start(
        testing::receiver_config(TransportKind::Tcp),
        d_pool.shared_region().unwrap().clone(),
        *d_pool.layout(),
    );
    assert_eq!(rx.connect(ranks[&RankId(0)]).await.unwrap(), RankId(0));
    rx.shutdown();
    tx.shutdown();
    server.shutdown();
    let end = tokio::time::Instant::now() + Duration::from_secs(3);
    while rx.live_tasks() + tx.live_tasks() + server.live_tasks() > 0 {
        assert!(tokio::time::Instant::now() < end, "tasks left");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn missing_ranks_fail_with_a_bootstrap_error_not_a_hang() {
    let server = BootstrapServer::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let e = bootstrap::query(server.local_addr(), 2, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(e, TransportError::Bootstrap(ref m) if m.contains("0 of 2 ranks")),
        "{e}"
    );
    assert_eq!(e.http_status(), 503);
    server.shutdown();
}
