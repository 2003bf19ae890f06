//! A decode worker killed with SIGKILL in the middle of its streams costs the
//! clients nothing (issue 32 item 2): under `handoff serve` (PD) with its
//! default single pair — the supervisor restarts the decode worker and the
//! router continues each stream on it — and with two decode replicas (the
//! streams continue on the other), every stream of the three APIs completes
//! with no error event, and its text equals the fault-free run's, token for
//! token (greedy, SmolLM2-135M). The router counts each continuation.
//!
//! The model is `HANDOFF_MODEL`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

/// Tokens each stream generates: long enough that the kill lands mid-stream.
const TOKENS: u64 = 96;

fn model() -> PathBuf {
    let p = match std::env::var("HANDOFF_MODEL") {
        Ok(p) => PathBuf::from(p),
        Err(_) => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-model.sh",
        p.display()
    );
    p
}

/// Request `i`: a route and a streaming greedy body.
fn request(i: usize) -> (&'static str, Value) {
    let topic = ["lighthouses", "bread", "rivers", "owls", "trains", "glass"][i % 6];
    match i % 3 {
        0 => (
            "/v1/chat/completions",
            json!({
                "messages": [{"role": "user", "content": format!("Tell me about {topic}.")}],
                "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true},
            }),
        ),
        1 => (
            "/v1/completions",
            json!({
                "prompt": format!("A short essay on {topic}:"),
                "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true},
            }),
        ),
        _ => (
            "/generate",
            json!({
                "text": format!("Some facts about {topic}:"),
                "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": true},
                "stream": true,
            }),
        ),
    }
}

/// What a stream gave the client.
#[derive(Debug, Default)]
struct Streamed {
    status: u16,
    /// The whole output text.
    text: String,
    /// `/generate`'s output ids (its last event's).
    ids: Value,
    /// Tokens the answer says it generated (usage or meta_info).
    completion_tokens: Option<u64>,
    errors: Vec<Value>,
    done: bool,
    /// Any line that is not `data: ...` or empty (a mark must never leak).
    other_lines: Vec<String>,
}

/// Stream request `i`, counting its events in `events`.
async fn stream(url: &str, i: usize, events: Arc<AtomicUsize>) -> Streamed {
    let (route, body) = request(i);
    let resp = reqwest::Client::new()
        .post(format!("{url}{route}"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let mut out = Streamed {
        status: resp.status().as_u16(),
        ..Default::default()
    };
    let mut resp = resp;
    let mut buf = String::new();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                out.errors.push(json!(format!("the stream broke off: {e}")));
                break;
            }
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines().filter(|l| !l.is_empty()) {
                let Some(data) = line.strip_prefix("data: ") else {
                    if line.trim() != ":" {
                        out.other_lines.push(line.to_string());
                    }
                    continue;
                };
                if data == "[DONE]" {
                    out.done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).expect("JSON event");
                if v.get("error").is_some() {
                    out.errors.push(v);
                    continue;
                }
                events.fetch_add(1, Ordering::Relaxed);
                match route {
                    "/generate" => {
                        out.text = v["text"].as_str().unwrap_or_default().to_string();
                        out.ids = v["output_ids"].clone();
                        out.completion_tokens = v["meta_info"]["completion_tokens"].as_u64();
                    }
                    _ => {
                        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
                            out.completion_tokens = Some(u);
                        }
                        if let Some(c) = v["choices"].get(0) {
                            let piece = c["delta"]["content"].as_str().or(c["text"].as_str());
                            out.text.push_str(piece.unwrap_or_default());
                        }
                    }
                }
            }
        }
    }
    out
}

/// The router's continuations by outcome, all routes together.
async fn migrations(url: &str) -> std::collections::BTreeMap<String, u64> {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let mut out = std::collections::BTreeMap::new();
    for l in text
        .lines()
        .filter(|l| l.starts_with("handoff_router_migrations_total{"))
    {
        let outcome = common::log_field(l, "outcome").unwrap_or_default();
        let outcome = outcome.split('"').next().unwrap_or_default().to_string();
        let n: f64 = l
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(outcome).or_insert(0) += n as u64;
    }
    out
}

/// Kill a decode worker of `s` with SIGKILL once every one of `n` streams
/// has had a few events, and check that every stream still completes with
/// the fault-free text.
async fn a_killed_decode_costs_no_stream(args: &[&str], n: usize) {
    let s = common::serve(&model(), args, &[]);
    let url = s.url.clone();
    // The fault-free run.
    let mut want = Vec::new();
    for i in 0..n {
        let r = stream(&url, i, Arc::new(AtomicUsize::new(0))).await;
        assert!(r.errors.is_empty() && r.done, "fault-free run {i}: {r:?}");
        assert_eq!(r.completion_tokens, Some(TOKENS), "{i}: {r:?}");
        want.push(r);
    }
    // The same streams at once; one decode worker dies in the middle.
    let counts: Vec<Arc<AtomicUsize>> = (0..n).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (url, c) = (url.clone(), counts[i].clone());
            tokio::spawn(async move { stream(&url, i, c).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while counts.iter().any(|c| c.load(Ordering::Relaxed) < 4) {
        assert!(Instant::now() < deadline, "the streams never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    s.kill_first("decode");
    let at_kill: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let mid_stream = at_kill.iter().filter(|&&c| c < TOKENS as usize / 2).count();
    for (i, t) in tasks.into_iter().enumerate() {
        let got = t.await.unwrap();
        let w = &want[i];
        assert_eq!(got.status, 200, "{i}: {got:?}");
        assert!(got.errors.is_empty(), "stream {i} saw an error: {got:?}");
        assert!(got.other_lines.is_empty(), "stream {i} leaked: {got:?}");
        assert!(got.done, "stream {i} did not end with [DONE]: {got:?}");
        assert_eq!(
            got.text, w.text,
            "stream {i}: the text differs from the fault-free run"
        );
        assert_eq!(got.ids, w.ids, "stream {i}");
        assert_eq!(got.completion_tokens, w.completion_tokens, "stream {i}");
    }
    assert!(
        mid_stream > 0,
        "the kill landed late in every stream (events by then: {at_kill:?})"
    );
    let m = migrations(&url).await;
    assert!(
        m.get("ok").copied().unwrap_or(0) >= 1,
        "no stream was continued: {m:?}"
    );
    for bad in ["no_decode", "refused", "limit"] {
        assert_eq!(m.get(bad), None, "{m:?}");
    }
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_of_the_default_pair_costs_no_stream() {
    a_killed_decode_costs_no_stream(&[], 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_replica_costs_no_stream() {
    a_killed_decode_costs_no_stream(&["--decode-replicas", "2"], 6).await;
}
