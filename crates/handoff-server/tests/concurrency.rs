//! 16 simultaneous streams give their single-request greedy outputs, and
//! every KV page returns to the pool; a client that disconnects mid-stream
//! cancels its request.

mod common;

use common::{post, server, wait_idle};
use serde_json::{json, Value};

fn body(i: usize, stream: bool) -> Value {
    json!({
        "text": format!("Prompt number {i}: {}", "la ".repeat(i)),
        "sampling_params": {"max_new_tokens": 12 + i % 5, "temperature": 0, "ignore_eos": true},
        "stream": stream,
    })
}

// One test function: both parts check the pool is empty, so they must not overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_and_disconnects() {
    sixteen_streams_match_single_requests_and_free_pages().await;
    disconnect_cancels_the_request().await;
    non_streaming_disconnect_cancels_too().await;
}

async fn generated_tokens() -> u64 {
    let (_, text) = common::get("/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix("handoff_generation_tokens_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("generation token counter")
}

/// A client that gives up on a whole (non-streamed) answer cancels it too:
/// the handler future is dropped with the connection.
async fn non_streaming_disconnect_cancels_too() {
    let ctx = server().engine.model().context_length;
    let max_new = ctx - 16;
    let before = generated_tokens().await;
    let b = json!({
        "text": "Keep talking",
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": true},
    });
    let err = reqwest::Client::new()
        .post(format!("{}/generate", server().base))
        .json(&b)
        .timeout(std::time::Duration::from_millis(150))
        .send()
        .await
        .expect_err("the client gives up first");
    assert!(err.is_timeout(), "{err}");
    let load = wait_idle().await;
    assert_eq!(load.pages_used, 0, "{load:?}");
    let generated = generated_tokens().await - before;
    assert!(
        (generated as usize) < max_new,
        "the request ran to completion ({generated} tokens) instead of being cancelled"
    );
}

async fn sixteen_streams_match_single_requests_and_free_pages() {
    let mut expected = Vec::new();
    for i in 0..16 {
        let (s, v) = post("/generate", &body(i, false)).await;
        assert_eq!(s, 200, "{v}");
        expected.push((v["text"].clone(), v["output_ids"].clone()));
    }
    assert_eq!(wait_idle().await.pages_used, 0);

    let tasks: Vec<_> = (0..16)
        .map(|i| {
            tokio::spawn(async move {
                let (s, events) = common::post_sse("/generate", &body(i, true)).await;
                assert_eq!(s, 200);
                assert_eq!(
                    events.last().map(String::as_str),
                    Some("[DONE]"),
                    "stream {i}"
                );
                let last: Value = serde_json::from_str(&events[events.len() - 2]).expect("JSON");
                (last["text"].clone(), last["output_ids"].clone())
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let got = t.await.expect("stream task");
        assert_eq!(
            got, expected[i],
            "stream {i} differs from its single-request output"
        );
    }
    let load = wait_idle().await;
    assert_eq!(load.pages_used, 0, "{load:?}");
    assert_eq!(load.running, 0, "{load:?}");
}

async fn disconnect_cancels_the_request() {
    let ctx = server().engine.model().context_length;
    let b = json!({
        "text": "Go on forever",
        "sampling_params": {"max_new_tokens": ctx / 2, "temperature": 0, "ignore_eos": true},
        "stream": true,
    });
    let mut resp = reqwest::Client::new()
        .post(format!("{}/generate", server().base))
        .json(&b)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    let first = resp.chunk().await.expect("read").expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    assert!(
        server().engine.load().pages_used > 0,
        "request holds pages while running"
    );
    drop(resp);
    let load = wait_idle().await;
    assert_eq!(load.pages_used, 0, "pages freed after disconnect: {load:?}");
    assert_eq!(load.running, 0, "{load:?}");
}
