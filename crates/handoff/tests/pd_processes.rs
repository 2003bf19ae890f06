//! PD serving as separate processes (`handoff prefill`, `handoff decode`,
//! `handoff serve` for the colocated baseline) on the tiny model: greedy PD
//! output equals colocated output. A prefill killed with SIGKILL in the
//! middle of a long prefill costs its client nothing by default: the decode
//! worker prefills the prompt itself and answers the colocated output
//! (`--on-transfer-failure recompute`). With `--on-transfer-failure fail` it
//! reaches the client as a typed error within the heartbeat bound — a JSON
//! SSE error event when streaming, a 5xx JSON error otherwise — with every
//! decode page back; the decode worker then serves the next request
//! correctly through a new prefill.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

/// A killed process's sockets close at once, so decode sees the death on
/// its connection (tens of ms here), not by the heartbeat, which would take
/// its 5 s bound of silence: 4 s tells the two apart with room for a loaded
/// 2-core box.
const PEER_DEATH_BOUND: Duration = Duration::from_secs(4);

struct Proc {
    child: Child,
    http: String,
    bootstrap: Option<(String, u16)>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn model(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    let cfg = handoff_model::tiny::TinyConfig {
        context_length: 16384,
        ..Default::default()
    };
    handoff_model::tiny::write_tiny_gguf_with(&path, 5, cfg).expect("tiny GGUF");
    path
}

/// Start `handoff <args>` and read its log until it listens.
fn start(role: &str, model: &Path, extra: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg(role)
        .args(["--port", "0", "--kv-pages", "1200", "--prefill-chunk", "64"])
        .args(extra)
        .arg("--model")
        .arg(model)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        // Prefill and decode share a transfer secret; the test signs each
        // request's bootstrap fields with it, as a router does.
        .env("HANDOFF_TRANSFER_SECRET", SECRET)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn handoff");
    let mut bootstrap = None;
    let http = common::listening_url(&mut child, |line| {
        if let Some(i) = line.find("bootstrap=") {
            let addr = line[i + "bootstrap=".len()..]
                .split_whitespace()
                .next()
                .expect("address");
            let (host, port) = addr.rsplit_once(':').expect("host:port");
            bootstrap = Some((host.to_string(), port.parse().expect("port")));
        }
    });
    Proc {
        child,
        http: http.unwrap_or_else(|| panic!("{role} never listened")),
        bootstrap,
    }
}

/// The transfer secret of the test's workers.
const SECRET: &str = "pd-processes test secret";

fn paired(body: &Value, prefill: &Proc, room: u64) -> Value {
    let (host, port) = prefill.bootstrap.clone().expect("a prefill");
    let mut b = body.clone();
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let claim = handoff_proto::bootstrap_auth::BootstrapClaim {
        room,
        host: &host,
        port,
        ts,
    };
    b["bootstrap_sig"] = json!(handoff_proto::bootstrap_auth::sign(
        SECRET.as_bytes(),
        &claim
    ));
    b["bootstrap_ts"] = json!(ts);
    b["bootstrap_host"] = json!(host);
    b["bootstrap_port"] = json!(port);
    b["bootstrap_room"] = json!(room);
    b
}

async fn load(base: &str) -> Value {
    let text = reqwest::get(format!("{base}/get_load"))
        .await
        .expect("get_load")
        .text()
        .await
        .expect("body");
    serde_json::from_str::<Value>(&text).expect("JSON")[0].clone()
}

/// POST to `/generate`: status and body, or status 0 and the transport
/// error (the killed prefill's own request ends that way).
async fn post(base: &str, body: &Value) -> (u16, String) {
    let r = match reqwest::Client::new()
        .post(format!("{base}/generate"))
        .json(body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return (0, e.to_string()),
    };
    let s = r.status().as_u16();
    match r.text().await {
        Ok(t) => (s, t),
        Err(e) => (0, e.to_string()),
    }
}

/// A prompt whose prefill takes seconds on the tiny model.
fn long_prompt(stream: bool) -> Value {
    json!({
        "input_ids": (0..12000u32).map(|i| 40 + i % 200).collect::<Vec<_>>(),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "stream": stream,
    })
}

/// Wait until the prefill computes and decode holds the pages, then kill
/// the prefill with SIGKILL.
async fn kill_mid_prefill(prefill: &mut Proc, decode: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = load(&prefill.http).await;
        let d = load(decode).await;
        if p["num_reqs"].as_u64() > Some(0) && d["num_tokens"].as_u64() > Some(0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the prefill never started: {p} {d}"
        );
        assert!(
            prefill.child.try_wait().expect("wait").is_none(),
            "the prefill exited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    prefill.child.kill().expect("SIGKILL the prefill");
    let _ = prefill.child.wait();
}

/// Decode's pages come back once the dead prefill cannot be writing into
/// them: at the abort fence (5 s) after the room failed — a peer that only
/// looks dead might still write.
async fn decode_pages_back(decode: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let d = load(decode).await;
        if d["num_tokens"] == 0 && d["num_reqs"] == 0 || Instant::now() > deadline {
            return d;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Send `body` to the prefill and the decode worker as a router does, kill
/// the prefill mid-prefill, and wait for decode's answer: its status, its
/// body, and how long after the kill it came.
async fn post_both_killing_prefill(
    prefill: &mut Proc,
    decode: &Proc,
    body: &Value,
) -> (u16, String, Duration) {
    let p = tokio::spawn({
        let (base, body) = (prefill.http.clone(), body.clone());
        async move { post(&base, &body).await }
    });
    let d = tokio::spawn({
        let (base, body) = (decode.http.clone(), body.clone());
        async move {
            let r = post(&base, &body).await;
            (r, Instant::now())
        }
    });
    kill_mid_prefill(prefill, &decode.http).await;
    let killed = Instant::now();
    let ((status, text), answered) = d.await.expect("decode request");
    let _ = p.await;
    (status, text, answered.saturating_duration_since(killed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_killed_mid_transfer_over_tcp() {
    prefill_killed_mid_transfer_is_a_typed_error_and_decode_recovers("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_killed_mid_transfer_over_shm() {
    prefill_killed_mid_transfer_is_a_typed_error_and_decode_recovers("shm").await;
}

async fn prefill_killed_mid_transfer_is_a_typed_error_and_decode_recovers(transport: &str) {
    let dir = std::env::temp_dir().join(format!(
        "handoff-pd-proc-{}-{transport}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let model = model(&dir);
    let colocated = start("serve", &model, &["--colocated"]);
    // Over tcp, links of two streams (rooms alternate between them).
    let decode_flags: &[&str] = match transport {
        "tcp" => &[
            "--transfer",
            "tcp",
            "--transfer-tcp-streams",
            "2",
            "--transfer-io-threads",
            "2",
            "--on-transfer-failure",
            "fail",
        ],
        _ => &["--transfer", transport, "--on-transfer-failure", "fail"],
    };
    let decode = start("decode", &model, decode_flags);
    let boot = ["--disaggregation-bootstrap-port", "0"];

    // Streaming: the client gets a JSON SSE error event.
    let mut prefill = start("prefill", &model, &boot);
    let body = paired(&long_prompt(true), &prefill, 71);
    let (status, text, waited) = post_both_killing_prefill(&mut prefill, &decode, &body).await;
    assert!(waited < PEER_DEATH_BOUND, "error after {waited:?}");
    assert_eq!(status, 200, "the stream had started: {text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let last: Value = serde_json::from_str(data.last().expect("an event"))
        .unwrap_or_else(|e| panic!("the last event is not JSON ({e}): {text}"));
    let msg = last["error"]["message"].as_str().unwrap_or_default();
    assert!(!msg.is_empty(), "no error event: {text}");
    // The peer's death, typed: not a timeout, not an internal error.
    assert_eq!(last["error"]["code"], "peer_dead", "{text}");
    assert_eq!(last["error"]["type"], "service_unavailable", "{text}");
    let d = decode_pages_back(&decode.http).await;
    assert_eq!(d["num_tokens"], 0, "decode pages leaked: {d}");

    // Whole answer: a 5xx JSON error.
    let mut prefill = start("prefill", &model, &boot);
    let body = paired(&long_prompt(false), &prefill, 72);
    let (status, text, waited) = post_both_killing_prefill(&mut prefill, &decode, &body).await;
    assert!(waited < PEER_DEATH_BOUND, "error after {waited:?}");
    // A dead peer is a 503 the client may retry, typed as such.
    assert_eq!(status, 503, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON error body");
    assert_eq!(v["error"]["code"], "peer_dead", "{text}");
    assert!(v["error"]["message"].as_str().is_some(), "{text}");
    let d = decode_pages_back(&decode.http).await;
    assert_eq!(d["num_tokens"], 0, "decode pages leaked: {d}");

    // The decode worker serves the next request through a new prefill,
    // with the colocated output.
    let prefill = start("prefill", &model, &boot);
    let body = json!({
        "text": "after the crash",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true},
    });
    let (cs, want) = post(&colocated.http, &body).await;
    assert_eq!(cs, 200, "{want}");
    let b = paired(&body, &prefill, 73);
    let (p, (ds, got)) = tokio::join!(post(&prefill.http, &b), post(&decode.http, &b));
    assert_eq!(p.0, 200, "{}", p.1);
    assert_eq!(ds, 200, "{got}");
    let want: Value = serde_json::from_str(&want).expect("JSON");
    let got: Value = serde_json::from_str(&got).expect("JSON");
    assert_eq!(got["output_ids"], want["output_ids"]);
    assert_eq!(got["text"], want["text"]);
}

/// The last `data:` event of an SSE body, as JSON.
fn last_event(text: &str) -> Value {
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .collect();
    serde_json::from_str(data.last().expect("an event"))
        .unwrap_or_else(|e| panic!("the last event is not JSON ({e}): {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_killed_mid_transfer_costs_no_request_by_default() {
    let dir = std::env::temp_dir().join(format!("handoff-pd-recompute-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let model = model(&dir);
    let colocated = start("serve", &model, &["--colocated"]);
    let decode = start("decode", &model, &["--transfer", "shm"]);
    let boot = ["--disaggregation-bootstrap-port", "0"];
    for (i, stream) in [(0u64, true), (1, false)] {
        let (cs, want) = post(&colocated.http, &long_prompt(false)).await;
        assert_eq!(cs, 200, "{want}");
        let want: Value = serde_json::from_str(&want).expect("JSON");
        let mut prefill = start("prefill", &model, &boot);
        let body = paired(&long_prompt(stream), &prefill, 81 + i);
        let (status, text, _) = post_both_killing_prefill(&mut prefill, &decode, &body).await;
        assert_eq!(status, 200, "{text}");
        let got = if stream {
            last_event(&text)
        } else {
            serde_json::from_str(&text).expect("JSON")
        };
        assert!(got.get("error").is_none(), "stream {stream}: {text}");
        assert_eq!(got["output_ids"], want["output_ids"], "stream {stream}");
        assert_eq!(got["text"], want["text"], "stream {stream}");
    }
    // Counted, and every page back.
    let m = reqwest::get(format!("{}/metrics", decode.http))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        m.contains("handoff_local_prefills_total{reason=\"recomputed\"} 2"),
        "{m}"
    );
    let d = decode_pages_back(&decode.http).await;
    assert_eq!(d["num_tokens"], 0, "decode pages leaked: {d}");
}
