//! The PD router in process on loopback, in front of colocated workers (a
//! colocated worker accepts and ignores the bootstrap fields and answers in
//! full) and a few fake workers for the failure paths: relayed answers equal
//! direct ones, errors keep their status and body, streams are relayed
//! incrementally, a client disconnect cancels both sides, dead workers give
//! 502 or are retried around, policies pair as they should.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing;
use handoff_engine::handle::EngineHandle;
use handoff_server::router::{PolicyKind, PrefillSpec};
use handoff_server::{router_app, RouterConfig, RouterHandle};
use serde_json::{json, Value};

use common::sse_data;

/// Real workers shared by the tests: one prefill, two decode URLs served by
/// one decode engine.
struct Workers {
    prefill: String,
    prefill_engine: EngineHandle,
    decode: String,
    decode_b: String,
    decode_engine: EngineHandle,
}

fn workers() -> &'static Workers {
    static W: OnceLock<Workers> = OnceLock::new();
    W.get_or_init(|| {
        let p = common::server();
        let decode_engine = common::start_engine();
        Workers {
            prefill: p.base.clone(),
            prefill_engine: p.engine.clone(),
            decode: common::serve_worker(decode_engine.clone()),
            decode_b: common::serve_worker(decode_engine.clone()),
            decode_engine,
        }
    })
}

/// Tests that use the real workers run one at a time, so load checks see
/// only their own requests.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static M: OnceLock<tokio::sync::Mutex<()>> = OnceLock::new();
    M.get_or_init(|| tokio::sync::Mutex::new(())).lock().await
}

fn config(prefill: &[&str], decode: &[&str]) -> RouterConfig {
    let mut c = RouterConfig::new(
        prefill
            .iter()
            .map(|u| PrefillSpec {
                url: u.to_string(),
                bootstrap_port: Some(8998),
            })
            .collect(),
        decode.iter().map(|u| u.to_string()).collect(),
    );
    c.health_interval = Duration::from_secs(1);
    c.request_timeout = Duration::from_secs(30);
    // These tests are about PD pairing: every prompt through a prefill
    // (the per-request decision has its own test).
    c.local_prefill_below = 0;
    c
}

struct TestRouter {
    base: String,
    handle: RouterHandle,
}

async fn start_router(config: RouterConfig) -> TestRouter {
    let (app, handle) = router_app(config).expect("router config");
    let base = common::serve_in_task(app).await;
    TestRouter { base, handle }
}

/// A router in front of the real workers, probed once.
async fn real_router(decode: &[&str], policy: PolicyKind) -> TestRouter {
    let w = workers();
    let mut c = config(&[&w.prefill], decode);
    c.prefill_policy = policy;
    c.decode_policy = policy;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    r
}

async fn post_raw(base: &str, path: &str, body: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let (s, t) = post_raw(base, path, &body.to_string()).await;
    let v = serde_json::from_str(&t).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {t}"));
    (s, v)
}

async fn get(base: &str, path: &str) -> (u16, String) {
    let resp = reqwest::get(format!("{base}{path}"))
        .await
        .expect("request");
    let s = resp.status().as_u16();
    (s, resp.text().await.expect("body"))
}

/// The generated text of a whole answer.
fn whole_text(path: &str, v: &Value) -> String {
    let t = match path {
        "/v1/chat/completions" => &v["choices"][0]["message"]["content"],
        "/v1/completions" => &v["choices"][0]["text"],
        _ => &v["text"],
    };
    t.as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

/// The generated text of a stream's events (which must end with `[DONE]`).
fn streamed_text(path: &str, events: &[String]) -> String {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("event is JSON"))
        .collect();
    match path {
        "/v1/chat/completions" => chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect(),
        "/v1/completions" => chunks
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect(),
        _ => chunks.last().expect("a chunk")["text"]
            .as_str()
            .expect("text")
            .to_string(),
    }
}

fn requests() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/v1/chat/completions",
            json!({"model": "tiny-test", "messages": [{"role": "user", "content": "Hello there"}],
                   "max_tokens": 8, "temperature": 0}),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny-test", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
        ),
        (
            "/generate",
            json!({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_answers_equal_direct_ones() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    for (path, body) in requests() {
        let (s, direct) = post(&w.decode, path, &body).await;
        assert_eq!(s, 200, "{direct}");
        let (s, routed) = post(&r.base, path, &body).await;
        assert_eq!(s, 200, "{routed}");
        assert_eq!(
            whole_text(path, &routed),
            whole_text(path, &direct),
            "{path}"
        );
        if path == "/generate" {
            assert_eq!(routed["output_ids"], direct["output_ids"]);
        } else {
            // The second of two equal requests may reuse the first's
            // cached prompt pages: everything else is equal.
            let (mut ru, mut du) = (routed["usage"].clone(), direct["usage"].clone());
            ru["prompt_tokens_details"]["cached_tokens"].take();
            du["prompt_tokens_details"]["cached_tokens"].take();
            assert_eq!(ru, du, "{path}");
            assert_eq!(
                routed["choices"][0]["finish_reason"],
                direct["choices"][0]["finish_reason"]
            );
        }

        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let (s, direct_events) = post_raw(&w.decode, path, &sbody.to_string()).await;
        assert_eq!(s, 200);
        let resp = reqwest::Client::new()
            .post(format!("{}{path}", r.base))
            .json(&sbody)
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let routed_events = resp.text().await.expect("body");
        assert_eq!(
            streamed_text(path, &sse_data(&routed_events)),
            streamed_text(path, &sse_data(&direct_events)),
            "{path} streamed"
        );
        assert_eq!(
            streamed_text(path, &sse_data(&routed_events)),
            whole_text(path, &direct),
            "{path}: stream equals whole"
        );
    }
    let (_, workers_json) = get(&r.base, "/workers").await;
    let list: Value = serde_json::from_str(&workers_json).unwrap();
    assert_eq!(list[0]["role"], "prefill");
    assert_eq!(list[0]["served"], 6);
    assert_eq!(list[1]["served"], 6);
    assert_eq!(list[1]["in_flight"], 0);
    assert_eq!(r.handle.live_rooms(), 0, "every room is freed");
    let (_, metrics) = get(&r.base, "/metrics").await;
    for needle in [
        "handoff_router_requests_total{route=\"/generate\",status=\"200\"} 2",
        "handoff_router_stage_seconds_count{stage=\"first_token\"} 6",
        "handoff_router_stage_seconds_count{stage=\"done\"} 6",
        "handoff_router_stage_seconds_count{stage=\"dispatched\"} 6",
        "handoff_router_time_to_first_token_seconds_count 3",
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_are_prefilled_on_their_decode_worker() {
    let _g = serial().await;
    let w = workers();
    let mut c = config(&[&w.prefill], &[&w.decode]);
    c.local_prefill_below = 8;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    // 5 token ids: below 8, prefilled where decoded; 12: through the prefill.
    let short = json!({"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0}});
    let long = json!({"input_ids": (1..13).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 4, "temperature": 0}});
    for body in [&short, &long] {
        let (s, direct) = post(&w.decode, "/generate", body).await;
        assert_eq!(s, 200, "{direct}");
        let (s, routed) = post(&r.base, "/generate", body).await;
        assert_eq!(s, 200, "{routed}");
        assert_eq!(routed["output_ids"], direct["output_ids"]);
    }
    let (_, list) = get(&r.base, "/workers").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list[0]["role"], "prefill");
    assert_eq!(list[0]["served"], 1, "only the long prompt: {list}");
    assert_eq!(list[1]["served"], 2, "{list}");
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        metrics.contains(
            "handoff_router_local_prefills_total{route=\"/generate\",reason=\"short_prompt\"} 1"
        ),
        "{metrics}"
    );
    // Text is estimated at 4 characters a token: 40 characters are 10.
    let mut c = config(&[&w.prefill], &[&w.decode]);
    c.local_prefill_below = 11;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    let text = json!({"text": "abcd".repeat(10), "sampling_params": {"max_new_tokens": 2}});
    let (s, v) = post(&r.base, "/generate", &text).await;
    assert_eq!(s, 200, "{v}");
    let (_, list) = get(&r.base, "/workers").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list[0]["served"], 0, "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_its_decode_worker_mostly_holds_is_prefilled_there() {
    let _g = serial().await;
    let w = workers();
    let mut c = config(&[&w.prefill], &[&w.decode]);
    c.local_prefill_below = 20;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    let ids = |salt: u32| {
        (0..100)
            .map(|i| 3 + (i * 7 + salt) % 290)
            .collect::<Vec<u32>>()
    };
    let body = |from| json!({"input_ids": ids(from), "sampling_params": {"max_new_tokens": 2, "temperature": 0}});
    // New: 100 uncached tokens, through the prefill. The same again: the
    // decode worker was sent all of it, prefilled there. Another: prefill.
    for (from, through_prefill) in [(0, 1), (0, 1), (1, 2)] {
        let (s, v) = post(&r.base, "/generate", &body(from)).await;
        assert_eq!(s, 200, "{v}");
        let prefill = worker_entry(&r.base, &w.prefill).await;
        assert_eq!(
            prefill["served"], through_prefill,
            "prompt from {from}: {prefill}"
        );
    }
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        metrics.contains(
            "handoff_router_local_prefills_total{route=\"/generate\",reason=\"cached_prompt\"} 1"
        ),
        "{metrics}"
    );
}

/// A worker that answers with the body it received: after 3 s when the
/// prompt says "hold", else after `ms`.
async fn slow_echo_worker(ms: u64) -> String {
    let handler = move |received: Bytes| async move {
        let hold = String::from_utf8_lossy(&received).contains("hold");
        let ms = if hold { 3000 } else { ms };
        tokio::time::sleep(Duration::from_millis(ms)).await;
        ([("content-type", "application/json")], received).into_response()
    };
    let app = axum::Router::new()
        .route("/health", routing::get(|| async { "" }))
        .route("/generate", routing::post(handler));
    common::serve_in_task(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_behind_a_busy_prefill_is_prefilled_on_its_decode_worker() {
    // The prefill answers well before the decode (a loaded box included),
    // so its time is measured.
    let prefill = slow_echo_worker(50).await;
    let decode = slow_echo_worker(1000).await;
    let mut c = config(&[&prefill], &[&decode]);
    c.health_interval = Duration::ZERO;
    c.local_prefill_wait = Some(Duration::from_millis(1));
    let r = start_router(c).await;
    let ask = |text: &str| json!({"text": text, "sampling_params": {"max_new_tokens": 1}});
    // The first measures the prefill's rate (nothing queued: through it).
    let (s, v) = post(
        &r.base,
        "/generate",
        &ask("first prompt of forty characters, roughly"),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert!(v.get("bootstrap_host").is_some(), "disaggregated: {v}");
    // One held at the prefill for 3 s: its tokens are queued there...
    let base = r.base.clone();
    let held = tokio::spawn(async move {
        post(
            &base,
            "/generate",
            &json!({"text": "hold this one at the prefill for a while please",
            "sampling_params": {"max_new_tokens": 1}}),
        )
        .await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while worker_entry(&r.base, &prefill).await["queued_prompt_tokens"] == 0 {
        assert!(Instant::now() < deadline, "the held request never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...so the next is predicted to wait past 1 ms: prefilled on decode.
    let (s, v) = post(&r.base, "/generate", &ask("second prompt")).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["local_prefill"], true, "{v}");
    assert!(v.get("bootstrap_host").is_none(), "{v}");
    let (s, v) = held.await.unwrap();
    assert_eq!(s, 200, "{v}");
    // The queue is empty again: through the prefill.
    let (s, v) = post(&r.base, "/generate", &ask("third prompt")).await;
    assert_eq!(s, 200, "{v}");
    assert!(v.get("bootstrap_host").is_some(), "{v}");
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        metrics.contains(
            "handoff_router_local_prefills_total{route=\"/generate\",reason=\"prefill_busy\"} 1"
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_predicted_to_miss_its_ttft_slo_gets_a_429_at_once() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    let ids = |n: u32| (0..n).map(|i| 3 + i % 200).collect::<Vec<u32>>();
    // Nothing is refused before the rate was measured once.
    let body = json!({"input_ids": ids(100), "sampling_params": {"max_new_tokens": 2}, "stream": true,
        "slo_ttft_ms": 1});
    let (s, t) = post_raw(&r.base, "/generate", &body.to_string()).await;
    assert_eq!(s, 200, "{t}");
    // Measured now: 100 tokens cannot be prefilled within 1 ms.
    let client = reqwest::Client::new();
    for (via_header, field) in [(false, "slo_ttft_ms"), (true, "x-slo-ttft-ms")] {
        let mut b = json!({"input_ids": ids(100), "sampling_params": {"max_new_tokens": 2}});
        let mut req = client.post(format!("{}/generate", r.base));
        if via_header {
            req = req.header("x-slo-ttft-ms", "1");
        } else {
            b["slo_ttft_ms"] = json!(1);
        }
        let t0 = Instant::now();
        let resp = req.json(&b).send().await.expect("send");
        let took = t0.elapsed();
        assert_eq!(resp.status().as_u16(), 429, "{field}");
        assert_eq!(resp.headers()["retry-after"], "1", "{field}");
        let v: Value = resp.json().await.expect("JSON");
        assert_eq!(v["error"]["code"], "slo_unreachable", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("exceeds this request's SLO of 1 ms"), "{msg}");
        // At once: no worker was asked (the bound is loose for a loaded box;
        // the benchmark measures the real figure).
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
    // A generous SLO is admitted; the SLO field never reaches a worker
    // (they refuse fields they do not implement).
    let b = json!({"input_ids": ids(100), "sampling_params": {"max_new_tokens": 2},
        "slo_ttft_ms": 600000});
    let (s, v) = post(&r.base, "/generate", &b).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(
        &r.base,
        "/generate",
        &json!({"text": "hi", "slo_ttft_ms": "soon"}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "slo_ttft_ms", "{v}");
    let (_, list) = get(&r.base, "/workers").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    for x in list.as_array().unwrap() {
        assert_eq!(x["queued_prompt_tokens"], 0, "released: {x}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_errors_keep_status_and_body() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    let bad = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}),
        ),
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 20000}, "stream": true}),
        ),
    ];
    for (path, body) in bad {
        let (ds, direct) = post(&w.decode, path, &body).await;
        let (rs, routed) = post(&r.base, path, &body).await;
        assert_eq!(ds, 400, "{direct}");
        assert_eq!(rs, 400, "{routed}");
        assert_eq!(routed, direct, "the worker's error body verbatim");
        assert!(routed["error"]["message"].as_str().unwrap().len() > 10);
    }
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        !metrics.contains("handoff_router_retries_total{"),
        "a 400 is never retried: {metrics}"
    );
    // Whichever side answered first is counted: one 400 per request.
    let counted: u64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("handoff_router_worker_failures_total{")
                && l.contains("kind=\"status_400\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(counted, 2, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_is_incremental_and_a_disconnect_cancels_both_sides() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    let ctx = w.decode_engine.model().context_length;
    let body = json!({
        "text": "Go on forever",
        "sampling_params": {"max_new_tokens": ctx / 2, "temperature": 0, "ignore_eos": true},
        "stream": true,
    });
    let mut resp = reqwest::Client::new()
        .post(format!("{}/generate", r.base))
        .json(&body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    let first = resp.chunk().await.expect("read").expect("a first chunk");
    assert!(first.starts_with(b"data: "), "{first:?}");
    let load = w.decode_engine.load();
    assert!(
        load.running > 0 && load.pages_used > 0,
        "the first event arrived while decode still runs: {load:?}"
    );
    assert_eq!(r.handle.live_rooms(), 1);
    drop(resp);
    both_sides_idle_within_1s(&r).await;
}

/// Both workers' engines and the router's rooms are idle within 1 s.
async fn both_sides_idle_within_1s(r: &TestRouter) {
    let w = workers();
    let t0 = Instant::now();
    loop {
        let (d, p) = (w.decode_engine.load(), w.prefill_engine.load());
        let idle = |l: &handoff_engine::handle::LoadSnapshot| {
            l.running == 0 && l.waiting == 0 && l.pages_used == 0
        };
        if idle(&d) && idle(&p) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "still busy 1 s after the client left: decode {d:?}, prefill {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The router's own state follows.
    let t0 = Instant::now();
    while r.handle.live_rooms() > 0
        || r.handle.workers().of(handoff_proto::Role::Decode)[0].in_flight() > 0
    {
        assert!(t0.elapsed() < Duration::from_secs(1), "room still live");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_stops_reading_is_cut_at_the_routers_write_timeout() {
    let _g = serial().await;
    let w = workers();
    let mut c = config(&[&w.prefill], &[&w.decode]);
    c.http.write_timeout = Duration::from_secs(1);
    let limits = c.http;
    let (app, handle) = router_app(c).expect("router config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(handoff_server::serve(
        listener,
        app,
        limits,
        std::future::pending(),
    ));
    handle.probe_now().await;
    let r = TestRouter {
        base: format!("http://{addr}"),
        handle,
    };
    let ctx = w.decode_engine.model().context_length;
    let body = json!({
        "text": "Go on forever",
        "sampling_params": {"max_new_tokens": ctx - 16, "temperature": 0, "ignore_eos": true},
        "stream": true,
    });
    let mut conn = common::stalled_stream(addr, &body).await;
    // The client reads nothing more: the router's write stalls, it drops the
    // connection after 1 s and with it the stream from decode, which cancels.
    let t0 = Instant::now();
    while w.decode_engine.load().running > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "decode still generates for a client that stopped reading"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "decode stopped {:?} after the client stopped reading",
        t0.elapsed()
    );
    both_sides_idle_within_1s(&r).await;
    let rest = common::read_until_closed(&mut conn).await;
    assert!(
        !String::from_utf8_lossy(&rest).contains("data: [DONE]"),
        "the stream ran to its end instead of being cut off"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_disconnect_cancels_both_sides() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    let ctx = w.decode_engine.model().context_length;
    let body = json!({
        "text": "Go on forever",
        "sampling_params": {"max_new_tokens": ctx / 2, "temperature": 0, "ignore_eos": true},
    });
    let err = reqwest::Client::new()
        .post(format!("{}/generate", r.base))
        .json(&body)
        .timeout(Duration::from_millis(300))
        .send()
        .await
        .expect_err("the client gives up first");
    assert!(err.is_timeout(), "{err}");
    both_sides_idle_within_1s(&r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_timeout_is_a_504() {
    let p = fake_worker(Fake::SlowFirstByte, Arc::new(AtomicBool::new(false))).await;
    let d = fake_worker(Fake::SlowFirstByte, Arc::new(AtomicBool::new(false))).await;
    let mut c = config(&[&p], &[&d]);
    c.request_timeout = Duration::from_millis(300);
    let r = start_router(c).await;
    let (s, v) = post(&r.base, "/generate", &json!({"text": "hi", "stream": true})).await;
    assert_eq!(s, 504, "{v}");
    assert_eq!(v["error"]["code"], "request_timeout");
    assert!(v["error"]["message"].as_str().unwrap().contains(&d), "{v}");
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        !metrics.contains("handoff_router_retries_total{"),
        "a timeout is not retried"
    );
}

fn closed_port_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    drop(l);
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_workers_give_502_or_are_retried_around() {
    let _g = serial().await;
    let w = workers();
    let dead = closed_port_url();
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}});

    // Alone and not retried: 502 naming the worker and its side.
    let mut c = config(&[&w.prefill], &[&dead]);
    c.health_interval = Duration::ZERO;
    c.max_retries = 0;
    let r = start_router(c).await;
    let (s, v) = post(&r.base, "/generate", &body).await;
    assert_eq!(s, 502, "{v}");
    assert_eq!(v["error"]["code"], "worker_unreachable");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("decode worker {dead}")), "{msg}");
    // It is now marked unhealthy: the next request has no decode worker.
    let (s, v) = post(&r.base, "/generate", &body).await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "no_healthy_worker");
    assert!(v["error"]["message"].as_str().unwrap().contains("decode"));

    // Next to a live one: every request succeeds, the retry is counted.
    let mut c = config(&[&w.prefill], &[&dead, &w.decode]);
    c.health_interval = Duration::ZERO;
    let r = start_router(c).await;
    for _ in 0..3 {
        let (s, v) = post(&r.base, "/generate", &body).await;
        assert_eq!(s, 200, "{v}");
    }
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        metrics.contains("handoff_router_retries_total{route=\"/generate\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "handoff_router_worker_failures_total{side=\"decode\",kind=\"unreachable\"} 1"
        ),
        "{metrics}"
    );
    let (_, list) = get(&r.base, "/workers").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list[1]["url"], dead.as_str());
    assert_eq!(list[1]["health"], "unhealthy");
    assert_eq!(list[2]["served"], 3);

    // With no healthy prefill the decode worker prefills itself: the
    // router is degraded, not down, and answers the PD output.
    let (s, want) = post(&r.base, "/generate", &body).await;
    assert_eq!(s, 200, "{want}");
    let r = start_router(config(&[&dead], &[&w.decode])).await;
    r.handle.probe_now().await;
    let (s, t) = get(&r.base, "/readiness").await;
    assert_eq!(s, 200, "{t}");
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["status"], "degraded", "{t}");
    assert!(t.contains("no prefill worker is healthy"), "{t}");
    let (s, v) = post(&r.base, "/generate", &body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["output_ids"], want["output_ids"]);
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        metrics.contains(
            "handoff_router_local_prefills_total{route=\"/generate\",reason=\"no_prefill\"} 1"
        ),
        "{metrics}"
    );
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    let (s, t) = get(&r.base, "/readiness").await;
    assert_eq!(s, 200, "{t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_pair_valid_workers() {
    let _g = serial().await;
    let w = workers();
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}});
    for policy in [
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
        PolicyKind::PowerOfTwo,
        PolicyKind::CacheAware,
    ] {
        let r = real_router(&[&w.decode, &w.decode_b], policy).await;
        for _ in 0..4 {
            let (s, v) = post(&r.base, "/generate", &body).await;
            assert_eq!(s, 200, "{policy}: {v}");
        }
        let served: Vec<u64> = r
            .handle
            .workers()
            .of(handoff_proto::Role::Decode)
            .iter()
            .map(|d| d.served())
            .collect();
        assert_eq!(served.iter().sum::<u64>(), 4, "{policy}: {served:?}");
        if policy == PolicyKind::RoundRobin {
            assert_eq!(served, [2, 2], "round robin alternates");
        }
        assert_eq!(
            r.handle.workers().of(handoff_proto::Role::Prefill)[0].served(),
            4
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_conversation_on_one_worker() {
    let _g = serial().await;
    let w = workers();
    let served = |r: &TestRouter| -> Vec<u64> {
        r.handle
            .workers()
            .of(handoff_proto::Role::Decode)
            .iter()
            .map(|d| d.served())
            .collect()
    };
    let system = "You are a patient assistant; answer in one short sentence. ".repeat(8);
    for (policy, want_one_worker) in [
        (PolicyKind::CacheAware, true),
        (PolicyKind::RoundRobin, false),
    ] {
        let r = real_router(&[&w.decode, &w.decode_b], policy).await;
        let mut text = system.clone();
        let mut workers_used = Vec::new();
        for turn in 0..4 {
            text.push_str(&format!(" Question {turn}: what comes after {turn}?"));
            let before = served(&r);
            let body =
                json!({"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}});
            let (s, v) = post(&r.base, "/generate", &body).await;
            assert_eq!(s, 200, "{policy}: {v}");
            let after = served(&r);
            let i = (0..2)
                .find(|&i| after[i] > before[i])
                .expect("a decode worker served it");
            workers_used.push(i);
        }
        let one = workers_used.iter().all(|&i| i == workers_used[0]);
        assert_eq!(
            one, want_one_worker,
            "{policy}: turns went to {workers_used:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_routes() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    let (s, t) = get(&r.base, "/health").await;
    assert_eq!(s, 200, "{t}");
    let (s, routed) = get(&r.base, "/v1/models").await;
    let (_, direct) = get(&w.decode, "/v1/models").await;
    assert_eq!(s, 200);
    assert_eq!(routed, direct);
    let (s, t) = get(&r.base, "/get_load").await;
    assert_eq!(s, 200);
    let load: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(load[0]["role"], "prefill");
    assert_eq!(load[1]["role"], "decode");
    assert_eq!(load[1]["url"], w.decode.as_str());
    assert_eq!(load[1]["load"][0]["dp_rank"], 0, "{load}");
    let (s, t) = get(&r.base, "/workers").await;
    assert_eq!(s, 200);
    let list: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(list[0]["bootstrap_port"], 8998);
    assert_eq!(list[0]["healthy"], true);
    // /flush_cache reaches every worker and reports each answer.
    let (s, v) = post(&r.base, "/flush_cache", &json!({})).await;
    assert_eq!(s, 200, "{v}");
    let replies = v["workers"].as_array().expect("workers");
    assert_eq!(replies.len(), 2, "{v}");
    assert_eq!(replies[0]["role"], "prefill");
    assert_eq!(replies[1]["url"], w.decode.as_str());
    for reply in replies {
        assert_eq!(reply["status"], 200, "{v}");
        assert!(
            reply["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("Cache flushed")),
            "{v}"
        );
    }
    // A worker that cannot answer makes it a 502 that names it.
    let dead = closed_port_url();
    let mut c = config(&[&w.prefill], &[&w.decode, &dead]);
    c.prefill_policy = PolicyKind::RoundRobin;
    let r2 = start_router(c).await;
    let (s, v) = post(&r2.base, "/flush_cache", &json!({})).await;
    assert_eq!(s, 502, "{v}");
    assert_eq!(v["workers"][2]["url"], dead.as_str());
    assert_eq!(v["workers"][2]["status"], 502);
    assert_eq!(v["workers"][1]["status"], 200);
    let (s, t) = get(&r.base, "/nope").await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("not_found")));
    let (s, t) = get(&r.base, "/generate").await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (405, Some("method_not_allowed"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_are_400_with_precise_messages() {
    let dead = closed_port_url();
    let mut c = config(&[&dead], &[&dead]);
    c.health_interval = Duration::ZERO;
    let r = start_router(c).await;
    let (s, t) = post_raw(&r.base, "/v1/chat/completions", "{\"messages\": [").await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("the request body is not valid JSON: EOF while parsing"),
        "{msg}"
    );
    let (s, t) = post_raw(&r.base, "/generate", "[1, 2]").await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(s, 400);
    assert_eq!(
        v["error"]["message"],
        "the request body must be a JSON object, not an array"
    );
    let (s, t) = post_raw(&r.base, "/v1/completions", "").await;
    assert_eq!(s, 400, "{t}");
    assert!(t.contains("empty"));
}

/// A fake worker for failure paths the real ones do not produce on demand.
#[derive(Clone, Copy)]
enum Fake {
    /// `/generate` answers 429 with a JSON error after 200 ms (so the
    /// decode request of the same attempt has surely started).
    Reject,
    /// `/generate` answers 500 with a JSON error at once.
    Fails,
    /// `/generate` answers 200 at once, its first byte after 3 s; sets the
    /// flag when the body is dropped.
    SlowFirstByte,
    /// `/generate` streams one SSE event, then nothing for a minute.
    StallsAfterFirstEvent,
    /// `/generate` streams one event, then the connection breaks.
    BreaksMidStream,
    /// `/generate` answers 200 with the JSON body it received.
    Echo,
    /// `/generate` counts the request, answers 200 and a JSON body that
    /// breaks off half way.
    BreaksMidBody(&'static std::sync::atomic::AtomicUsize),
}

async fn fake_worker(kind: Fake, dropped: Arc<AtomicBool>) -> String {
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let handler = move |received: Bytes| {
        let dropped = Arc::clone(&dropped);
        async move {
            match kind {
                Fake::Echo => ([("content-type", "application/json")], received).into_response(),
                Fake::Fails => (
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    axum::Json(json!({"error": {"message": "decode is broken",
                    "type": "server_error", "code": "model_error"}})),
                )
                    .into_response(),
                Fake::Reject => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    (
                        axum::http::StatusCode::TOO_MANY_REQUESTS,
                        axum::Json(json!({"error": {"message": "prefill says no",
                        "type": "invalid_request_error", "code": "rate_limited"}})),
                    )
                        .into_response()
                }
                Fake::StallsAfterFirstEvent => {
                    use futures_util::StreamExt;
                    let guard = SetOnDrop(dropped);
                    let first = futures_util::stream::once(async {
                        Ok::<_, std::io::Error>(Bytes::from_static(b"data: {\"text\":\"a\"}\n\n"))
                    });
                    let silent = futures_util::stream::once(async move {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        drop(guard);
                        Ok(Bytes::from_static(b"data: [DONE]\n\n"))
                    });
                    event_stream(first.chain(silent))
                }
                Fake::SlowFirstByte => {
                    let guard = SetOnDrop(dropped);
                    let s = futures_util::stream::once(async move {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        drop(guard);
                        Ok::<_, std::io::Error>(Bytes::from_static(b"data: {}\n\n"))
                    });
                    Response::new(Body::from_stream(s))
                }
                Fake::BreaksMidBody(count) => {
                    use futures_util::StreamExt;
                    count.fetch_add(1, Ordering::SeqCst);
                    let first = futures_util::stream::once(async {
                        Ok(Bytes::from_static(b"{\"text\": \"half an ans"))
                    });
                    let broken = futures_util::stream::once(async {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        Err(std::io::Error::other("boom"))
                    });
                    let mut r = Response::new(Body::from_stream(first.chain(broken)));
                    r.headers_mut().insert(
                        "content-type",
                        axum::http::HeaderValue::from_static("application/json"),
                    );
                    r
                }
                Fake::BreaksMidStream => {
                    use futures_util::StreamExt;
                    let first = futures_util::stream::once(async {
                        Ok(Bytes::from_static(b"data: {\"text\":\"a\"}\n\ndata: {\"te"))
                    });
                    let broken = futures_util::stream::once(async {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        Err(std::io::Error::other("boom"))
                    });
                    let s = first.chain(broken);
                    event_stream(s)
                }
            }
        }
    };
    let app = axum::Router::new()
        .route("/health", routing::get(|| async { "" }))
        .route(
            "/get_load",
            routing::get(|| async { axum::Json(json!([{"dp_rank": 0, "num_reqs": 0}])) }),
        )
        .route("/generate", routing::post(handler));
    common::serve_in_task(app).await
}

/// The router's `/workers` entry of the worker at `url`.
async fn worker_entry(base: &str, url: &str) -> Value {
    let (_, list) = get(base, "/workers").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url)
        .unwrap_or_else(|| panic!("{url} not in {list}"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_requests_keep_failing_has_its_circuit_opened() {
    let none = || Arc::new(AtomicBool::new(false));
    let p = fake_worker(Fake::Echo, none()).await;
    let bad = fake_worker(Fake::Fails, none()).await;
    let good = fake_worker(Fake::Echo, none()).await;
    let mut c = config(&[&p], &[&bad, &good]);
    c.decode_policy = PolicyKind::RoundRobin;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    // Round robin: every other request reaches the broken decode (a 500 is
    // the worker's answer, relayed) until three failed in a row.
    let mut failed = 0;
    let mut sent = 0;
    while failed < 3 {
        let (s, v) = post(&r.base, "/generate", &json!({"text": "hi"})).await;
        sent += 1;
        assert!(sent <= 8, "the broken decode was not reached three times");
        if s == 500 {
            assert_eq!(v["error"]["message"], "decode is broken");
            failed += 1;
        } else {
            assert_eq!(s, 200, "{v}");
        }
    }
    // Open: nothing more goes to it, though its health probe passes.
    r.handle.probe_now().await;
    for _ in 0..6 {
        let (s, v) = post(&r.base, "/generate", &json!({"text": "hi"})).await;
        assert_eq!(s, 200, "a request reached the open circuit: {v}");
    }
    let b = worker_entry(&r.base, &bad).await;
    assert_eq!(b["health"], "healthy", "{b}");
    assert_eq!(b["circuit"], "open", "{b}");
    assert_eq!(b["consecutive_failures"], 3, "{b}");
    let backoff = b["circuit_backoff_ms"].as_u64().unwrap();
    assert!((500..=1500).contains(&backoff), "1 s with jitter: {b}");
    let g = worker_entry(&r.base, &good).await;
    assert_eq!(g["circuit"], "closed", "{g}");
    // Past the backoff it is half open: the next request to it fails and
    // opens it again, for about twice as long.
    tokio::time::sleep(Duration::from_millis(backoff + 50)).await;
    let mut reopened = false;
    for _ in 0..4 {
        let (s, _) = post(&r.base, "/generate", &json!({"text": "hi"})).await;
        if s == 500 {
            reopened = true;
            break;
        }
    }
    assert!(reopened, "the half-open circuit let no request through");
    let b = worker_entry(&r.base, &bad).await;
    assert_eq!(b["circuit"], "open", "{b}");
    let again = b["circuit_backoff_ms"].as_u64().unwrap();
    assert!((1000..=3000).contains(&again), "2 s with jitter: {b}");
}

/// A worker whose `/generate` streams five SSE events 200 ms apart (a
/// decode), or, with `fail_after`, answers 500 after that long (a prefill
/// failing while its decode streams).
async fn paced_worker(fail_after: Option<Duration>) -> String {
    let handler = move |_: Bytes| async move {
        if let Some(d) = fail_after {
            tokio::time::sleep(d).await;
            return (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(json!({"error": {"message": "prefill broke late",
                    "type": "server_error", "code": "model_error"}})),
            )
                .into_response();
        }
        use futures_util::StreamExt;
        let events = futures_util::stream::iter(0..5).then(|i| async move {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok::<_, std::io::Error>(Bytes::from(format!("data: {{\"text\":\"{i}\"}}\n\n")))
        });
        event_stream(events)
    };
    let app = axum::Router::new()
        .route("/health", routing::get(|| async { "" }))
        .route("/generate", routing::post(handler));
    common::serve_in_task(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_failing_after_decode_bytes_counts_against_its_circuit() {
    let prefill = paced_worker(Some(Duration::from_millis(300))).await;
    let decode = paced_worker(None).await;
    let mut c = config(&[&prefill], &[&decode]);
    c.health_interval = Duration::ZERO;
    c.migration_limit = 0;
    let r = start_router(c).await;
    for i in 0..3 {
        let (s, events) =
            common::post_text(&r.base, "/generate", &json!({"text": "hi", "stream": true})).await;
        // The client's stream is decode's: the late prefill failure is not
        // its business (decode carries the request).
        assert_eq!(s, 200, "request {i}");
        assert_eq!(
            events.matches("data: {\"text\"").count(),
            5,
            "request {i}: {events}"
        );
    }
    let p = worker_entry(&r.base, &prefill).await;
    assert_eq!(p["consecutive_failures"], 3, "{p}");
    assert_eq!(p["circuit"], "open", "{p}");
    let d = worker_entry(&r.base, &decode).await;
    assert_eq!(d["circuit"], "closed", "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_error_before_any_decode_byte_wins_and_drops_decode() {
    let none = Arc::new(AtomicBool::new(false));
    let decode_dropped = Arc::new(AtomicBool::new(false));
    let p = fake_worker(Fake::Reject, none).await;
    let d = fake_worker(Fake::SlowFirstByte, Arc::clone(&decode_dropped)).await;
    let r = start_router(config(&[&p], &[&d])).await;
    r.handle.probe_now().await;
    let t0 = Instant::now();
    let (s, v) = post(&r.base, "/generate", &json!({"text": "hi", "stream": true})).await;
    assert_eq!(s, 429, "{v}");
    assert_eq!(v["error"]["message"], "prefill says no");
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "did not wait for decode"
    );
    let t0 = Instant::now();
    while !decode_dropped.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "decode request not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_decode_stream_ends_with_a_json_error_event() {
    let flag = Arc::new(AtomicBool::new(false));
    let d = fake_worker(Fake::BreaksMidStream, flag).await;
    let p = fake_worker(Fake::SlowFirstByte, Arc::new(AtomicBool::new(false))).await;
    let r = start_router(config(&[&p], &[&d])).await;
    r.handle.probe_now().await;
    let (s, text) = post_raw(&r.base, "/generate", "{\"text\": \"hi\", \"stream\": true}").await;
    assert_eq!(s, 200, "{text}");
    let events = sse_data(&text);
    assert_eq!(events[0], "{\"text\":\"a\"}", "{text:?}");
    let err: Value = serde_json::from_str(events.last().unwrap())
        .unwrap_or_else(|e| panic!("last event is not JSON ({e}): {text:?}"));
    assert_eq!(err["error"]["code"], "decode_stream_broken");
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"]["message"].as_str().unwrap().contains(&d));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_answer_broken_after_its_status_is_sent_again_to_another_decode() {
    static SEEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let d1 = fake_worker(Fake::BreaksMidBody(&SEEN), Arc::new(AtomicBool::new(false))).await;
    let d2 = fake_worker(Fake::BreaksMidBody(&SEEN), Arc::new(AtomicBool::new(false))).await;
    let p = fake_worker(Fake::SlowFirstByte, Arc::new(AtomicBool::new(false))).await;
    // Nothing reached the client: the request goes to the other decode
    // worker (the broken one is marked unhealthy until its next probe).
    let mut c = config(&[&p], &[&d1, &d2]);
    c.max_retries = 2;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    let (s, v) = post(&r.base, "/generate", &json!({"text": "hi"})).await;
    assert_eq!(s, 502, "{v}");
    assert_eq!(v["error"]["code"], "decode_stream_broken", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("broke off its answer"), "{msg}");
    assert_eq!(SEEN.load(Ordering::SeqCst), 2, "each decode worker once");
    let (_, metrics) = get(&r.base, "/metrics").await;
    assert!(
        metrics.contains("handoff_router_retries_total{route=\"/generate\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "handoff_router_migrations_total{route=\"/generate\",outcome=\"restarted\"} 2"
        ),
        "{metrics}"
    );
    // With migration off, a decode that answered 200 is not sent it again.
    SEEN.store(0, Ordering::SeqCst);
    let mut c = config(&[&p], &[&d1, &d2]);
    c.migration_limit = 0;
    let r = start_router(c).await;
    r.handle.probe_now().await;
    let (s, v) = post(&r.base, "/generate", &json!({"text": "hi"})).await;
    assert_eq!(s, 502, "{v}");
    assert_eq!(
        SEEN.load(Ordering::SeqCst),
        1,
        "sent again with migration off"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_workers_get_the_body_with_the_bootstrap_fields() {
    let p = fake_worker(Fake::Echo, Arc::new(AtomicBool::new(false))).await;
    let d = fake_worker(Fake::Echo, Arc::new(AtomicBool::new(false))).await;
    let mut c = config(&[&p], &[&d]);
    c.prefill[0].bootstrap_port = Some(9123);
    let r = start_router(c).await;
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 3},
        "bootstrap_room": "client's", "bootstrap_port": -1, "bootstrap_host": "evil"});
    let mut rooms = std::collections::HashSet::new();
    let mut rids = std::collections::HashSet::new();
    for _ in 0..3 {
        let (s, got) = post(&r.base, "/generate", &body).await;
        assert_eq!(s, 200, "{got}");
        // A request id for both workers, fresh per request.
        let rid = got["rid"].as_str().expect("a rid").to_string();
        assert!(rid.starts_with("gen-") && rid.len() == 28, "{rid}");
        rids.insert(rid);
        assert_eq!(got["text"], "hi");
        assert_eq!(got["sampling_params"], json!({"max_new_tokens": 3}));
        assert_eq!(got["bootstrap_host"], "127.0.0.1", "the prefill's host");
        assert_eq!(got["bootstrap_port"], 9123);
        let room = got["bootstrap_room"].as_u64().expect("an integer room");
        assert!(room >= 1 && room <= i64::MAX as u64, "{room}");
        rooms.insert(room);
    }
    assert_eq!(rooms.len(), 3, "a fresh room per request");
    assert_eq!(rids.len(), 3, "a fresh id per request");
    let mut mine = body.clone();
    mine["rid"] = json!("client-rid");
    let (_, got) = post(&r.base, "/generate", &mine).await;
    assert_eq!(got["rid"], "client-rid", "the client's id is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_api_is_served_on_the_public_port() {
    let _g = serial().await;
    let w = workers();
    let r = real_router(&[&w.decode], PolicyKind::RoundRobin).await;
    // Answered by a worker, the same as asking it directly.
    for path in ["/get_model_info", "/model_info", "/v1/models"] {
        let (s, routed) = get(&r.base, path).await;
        let (_, direct) = get(&w.decode, path).await;
        assert_eq!((s, &routed), (200, &direct), "{path}");
    }
    let (s, info) = get(&r.base, "/server_info").await;
    assert_eq!(s, 200, "{info}");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["served_model_name"], "tiny-test", "{info}");
    assert_eq!(info["router"]["decode_workers"], 1, "{info}");
    assert_eq!(info["router"]["healthy_prefill_workers"], 1, "{info}");
    let (s, _) = get(&r.base, "/get_server_info").await;
    assert_eq!(s, 200);
    let tok = json!({"prompt": "Hello there"});
    let (s, routed) = post(&r.base, "/tokenize", &tok).await;
    let (_, direct) = post(&w.decode, "/tokenize", &tok).await;
    assert_eq!((s, &routed), (200, &direct));
    let (s, text) = post(&r.base, "/detokenize", &json!({"tokens": routed["tokens"]})).await;
    assert_eq!(s, 200, "{text}");
    assert!(
        text["text"].as_str().unwrap().ends_with("Hello there"),
        "{text}"
    );
    let (s, e) = post(&r.base, "/detokenize", &json!({"tokens": "x"})).await;
    assert_eq!(s, 400, "a worker's refusal keeps its status: {e}");
    let (s, e) = post_raw(&r.base, "/tokenize", "not json").await;
    assert_eq!(s, 400, "{e}");

    // /health_generate really generates: 200 through the pair, and a 503
    // naming the failure when the pair cannot.
    let (s, t) = get(&r.base, "/health_generate").await;
    assert_eq!((s, t.as_str()), (200, ""));
    let dead = closed_port_url();
    let mut c = config(&[&dead], &[&dead]);
    c.health_interval = Duration::ZERO;
    c.max_retries = 0;
    let broken = start_router(c).await;
    let (s, t) = get(&broken.base, "/health_generate").await;
    assert_eq!(s, 503, "{t}");
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["error"]["code"], "unhealthy", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("health generation through a prefill and a decode worker failed"),
        "{v}"
    );

    // /abort_request by the client's rid reaches both workers: the stream
    // ends with the abort, both engines let the request go.
    let resp = common::long_stream(&r.base, "router-abort").await;
    let (s, v) = post(&r.base, "/abort_request", &json!({"rid": "router-abort"})).await;
    assert_eq!(s, 200, "{v}");
    // Both colocated workers ran it (a colocated prefill answers in full).
    assert_eq!(v["aborted"], 2, "{v}");
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(2), "{v}");
    let rest = common::read_rest(resp).await;
    assert!(
        rest.contains("\"aborted\""),
        "the stream ends with the abort: {rest}"
    );
    both_sides_idle_within_1s(&r).await;
    let (s, v) = post(&r.base, "/abort_request", &json!({})).await;
    assert_eq!((s, &v["error"]["param"]), (400, &json!("rid")), "{v}");

    // SGLang's names at the router, per role, summed from the workers.
    r.handle.probe_now().await;
    let (s, text) = get(&r.base, "/metrics").await;
    assert_eq!(s, 200);
    for needle in [
        "sglang:num_running_reqs{model_name=\"tiny-test\",role=\"decode\"}",
        "sglang:num_queue_reqs{model_name=\"tiny-test\",role=\"prefill\"}",
        "sglang:token_usage{model_name=\"tiny-test\",role=\"decode\"}",
        "sglang:gen_throughput{model_name=\"tiny-test\",role=\"decode\"}",
        "sglang:generation_tokens_total{model_name=\"tiny-test\",role=\"decode\"}",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    let generated = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "sglang:generation_tokens_total{model_name=\"tiny-test\",role=\"decode\"} ",
            )
        })
        .and_then(|v| v.parse::<f64>().ok())
        .expect("a count");
    assert!(
        generated >= 1.0,
        "the aborted stream's tokens count: {generated}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_goes_silent_ends_stalled_and_drops_the_workers_request() {
    let decode_dropped = Arc::new(AtomicBool::new(false));
    let d = fake_worker(Fake::StallsAfterFirstEvent, Arc::clone(&decode_dropped)).await;
    let p = fake_worker(Fake::SlowFirstByte, Arc::new(AtomicBool::new(false))).await;
    let mut c = config(&[&p], &[&d]);
    c.stall_timeout = Some(Duration::from_millis(600));
    let r = start_router(c).await;
    r.handle.probe_now().await;
    let t0 = Instant::now();
    let (s, text) = post_raw(
        &r.base,
        "/generate",
        &json!({"text": "hi", "stream": true}).to_string(),
    )
    .await;
    let took = t0.elapsed();
    assert_eq!(s, 200, "{text}");
    let events = sse_data(&text);
    assert_eq!(events.len(), 2, "the event, then the stall: {text}");
    let e: Value = serde_json::from_str(&events[1]).expect("JSON");
    assert_eq!(
        (&e["error"]["type"], &e["error"]["code"]),
        (&json!("stalled"), &json!("stalled")),
        "{e}"
    );
    assert!(e["error"]["message"].as_str().unwrap().contains(&d), "{e}");
    // After the timeout, well before the worker's minute of silence ends.
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(30),
        "{took:?}"
    );
    let t0 = Instant::now();
    while !decode_dropped.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "decode request not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let metrics = get(&r.base, "/metrics").await.1;
    assert!(
        metrics
            .contains("handoff_router_worker_failures_total{side=\"decode\",kind=\"stalled\"} 1"),
        "{metrics}"
    );

    // Silent before its first event: a 504 `stalled`, not retried, and the
    // worker's request dropped.
    let silent_dropped = Arc::new(AtomicBool::new(false));
    let d = fake_worker(Fake::SlowFirstByte, Arc::clone(&silent_dropped)).await;
    let mut c = config(&[&p], &[&d]);
    c.stall_timeout = Some(Duration::from_millis(300));
    let r = start_router(c).await;
    r.handle.probe_now().await;
    let t0 = Instant::now();
    let (s, v) = post(&r.base, "/generate", &json!({"text": "hi", "stream": true})).await;
    let took = t0.elapsed();
    assert_eq!(s, 504, "{v}");
    assert_eq!(
        (&v["error"]["type"], &v["error"]["code"]),
        (&json!("stalled"), &json!("stalled")),
        "{v}"
    );
    // At the watchdog (0.3 s), well before the fake's first event (3 s).
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(2900),
        "{took:?}"
    );
    let t0 = Instant::now();
    while !silent_dropped.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "decode request not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A whole (non-streamed) answer comes at the end: only the request
    // timeout bounds it.
    let (s, v) = post_raw(&r.base, "/generate", &json!({"text": "hi"}).to_string()).await;
    assert_eq!(s, 200, "{v}");
}

/// A `text/event-stream` response with `body`'s chunks.
fn event_stream<S>(body: S) -> Response
where
    S: futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    r
}
