//! Shutdown drains, within a bound (`HttpLimits::drain_timeout`, the
//! `--drain-timeout-secs` of every role): once the shutdown signal comes,
//! no new connection is accepted, a request already in flight still gets
//! its whole answer, and one that outlives the drain timeout is cut so the
//! process can exit.

use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_finish_and_the_drain_is_bounded() {
    let app = Router::new()
        .route(
            "/short",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(600)).await;
                "done"
            }),
        )
        .route(
            "/forever",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                "never"
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let limits = handoff_server::HttpLimits {
        drain_timeout: Duration::from_millis(1500),
        ..Default::default()
    };
    let server = tokio::spawn(handoff_server::serve(listener, app, limits, async move {
        let _ = stop_rx.await;
    }));
    let short = tokio::spawn(reqwest::get(format!("http://{addr}/short")));
    let forever = tokio::spawn(reqwest::get(format!("http://{addr}/forever")));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    stop_tx.send(()).unwrap();
    // In flight when the signal came: answered in full.
    let r = short.await.unwrap().expect("the short request was cut");
    assert_eq!(r.text().await.unwrap(), "done");
    // No new connection once draining.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        reqwest::get(format!("http://{addr}/short")).await.is_err(),
        "a connection was accepted while draining"
    );
    // The endless one is cut at the drain timeout and the server returns.
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the drain was not bounded")
        .unwrap()
        .unwrap();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(8),
        "{took:?}"
    );
    assert!(
        forever.await.unwrap().is_err(),
        "the endless request got an answer"
    );
}
