//! PD workers over HTTP: a prefill and a decode worker, each
//! behind the worker API, paired per request by SGLang's bootstrap fields,
//! over shm and tcp. Greedy output equals the colocated worker's on every
//! endpoint, streamed or not; a request the prefill refuses comes back from
//! decode with the prefill's status and reason at once (seed 004); a client
//! that leaves mid-stream frees the room and the pages on both sides
//! (seed 000); requests without bootstrap fields get a 400 naming them.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::sse_data;
use handoff_engine::handle::EngineHandle;
use handoff_engine::pd::{
    DecodeEngine, DecodeHandle, PdConfig, PrefillEngine, PrefillHandle, TransportKind,
};
use handoff_engine::{Engine, EngineConfig};
use handoff_server::router::PrefillSpec;
use handoff_server::RouterConfig;
use serde_json::{json, Value};

const PAGE_SIZE: usize = 16;
const KV_PAGES: usize = 512;
/// The context of the "small" prefill: longer prompts are refused by it
/// and accepted by decode.
const SMALL_CONTEXT: usize = 256;

struct Workers {
    /// handoff's router in front of `prefill` + `decode_shm`, and in front
    /// of `prefill` + `decode_tcp`.
    router_shm: String,
    router_tcp: String,
    /// handoff's router in front of `small_prefill` + `decode_shm`, and in
    /// front of `small_prefill` + `decode_tcp`.
    router_small_shm: String,
    router_small_tcp: String,
    colocated: (String, EngineHandle),
    prefill: (String, PrefillHandle),
    small_prefill: (String, PrefillHandle),
    decode_shm: (String, DecodeHandle),
    decode_tcp: (String, DecodeHandle),
}

fn config(model: &std::path::Path) -> EngineConfig {
    EngineConfig {
        threads: 2,
        page_size: PAGE_SIZE,
        kv_pages: KV_PAGES,
        max_batch: 16,
        prefill_chunk: 64,
        served_name: Some("tiny-pd".to_string()),
        ..EngineConfig::new(model)
    }
}

/// The transfer secret the routers sign bootstrap fields with and the decode
/// workers check them against.
const SECRET: &[u8] = b"pd-http test secret";

/// Serve a decode worker that dials what [`SECRET`] signs.
fn serve_decode(d: &DecodeHandle) -> String {
    common::serve_state(
        handoff_server::AppState::new(d.clone()).with_bootstrap_trust(
            handoff_server::worker::trust::BootstrapTrust::new(Some(SECRET.to_vec()), vec![]),
        ),
    )
}

/// Sign `b`'s bootstrap fields with [`SECRET`], as a router does.
fn sign(b: &mut Value) {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claim = handoff_proto::bootstrap_auth::BootstrapClaim {
        room: b["bootstrap_room"].as_u64().unwrap_or(0),
        host: b["bootstrap_host"].as_str().unwrap_or(""),
        port: b["bootstrap_port"].as_u64().unwrap_or(0) as u16,
        ts,
    };
    let sig = handoff_proto::bootstrap_auth::sign(SECRET, &claim);
    b["bootstrap_ts"] = json!(ts);
    b["bootstrap_sig"] = json!(sig);
}

/// handoff's router on an ephemeral port in front of one pair.
fn serve_router(prefill: &str, bootstrap_port: u16, decode: &str) -> String {
    let mut config = RouterConfig::new(
        vec![PrefillSpec {
            url: prefill.to_string(),
            bootstrap_port: Some(bootstrap_port),
        }],
        vec![decode.to_string()],
    );
    config.health_interval = Duration::from_secs(1);
    // Every prompt through the prefill: these tests are about the pair.
    config.local_prefill_below = 0;
    config.transfer_secret = handoff_server::worker::trust::TransferSecret::new(SECRET.to_vec());
    common::serve_on_thread(move |listener| async move {
        handoff_server::run_router(listener, config, std::future::pending())
            .await
            .expect("router");
    })
}

/// How late the routers' requests reach the small prefill.
const PREFILL_DELAY: Duration = Duration::from_millis(500);

/// A TCP proxy to `target` (`http://host:port`) that forwards what the
/// client sends `delay` late; returns its `http://` URL.
fn delayed_proxy(target: &str, delay: Duration) -> String {
    let target = target.trim_start_matches("http://").to_string();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            listener.set_nonblocking(true).expect("nonblocking");
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let target = target.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    let (mut in_read, mut in_write) = inbound.into_split();
                    let (mut out_read, mut out_write) = outbound.into_split();
                    // Every byte towards the worker is late (a pooled
                    // connection's next request too); answers are not.
                    let to_worker = async move {
                        let mut buf = vec![0u8; 1 << 16];
                        while let Ok(n) = in_read.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            tokio::time::sleep(delay).await;
                            if out_write.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    let to_client = tokio::io::copy(&mut out_read, &mut in_write);
                    tokio::select! {
                        _ = to_worker => {}
                        _ = to_client => {}
                    }
                });
            }
        });
    });
    url
}

fn workers() -> &'static Workers {
    static W: OnceLock<Workers> = OnceLock::new();
    W.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("handoff-pd-http-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let model = dir.join("tiny.gguf");
        let tiny = handoff_model::tiny::TinyConfig {
            context_length: 4096,
            ..Default::default()
        };
        handoff_model::tiny::write_tiny_gguf_with(&model, 11, tiny).expect("tiny GGUF");
        let colocated = Engine::start(config(&model)).expect("colocated engine");
        let prefill = PrefillEngine::start(config(&model), PdConfig::new(TransportKind::Tcp))
            .expect("prefill engine");
        let small = EngineConfig {
            max_context: Some(SMALL_CONTEXT),
            ..config(&model)
        };
        let small_prefill =
            PrefillEngine::start(small, PdConfig::new(TransportKind::Tcp)).expect("small prefill");
        let decode_shm = DecodeEngine::start(config(&model), PdConfig::new(TransportKind::Shm))
            .expect("decode engine (shm)");
        let decode_tcp = DecodeEngine::start(config(&model), PdConfig::new(TransportKind::Tcp))
            .expect("decode engine (tcp)");
        let prefill_url = common::serve_worker(prefill.clone());
        let decode_shm_url = serve_decode(&decode_shm);
        let decode_tcp_url = serve_decode(&decode_tcp);
        let boot = prefill.bootstrap_addr().port();
        let small_url = common::serve_worker(small_prefill.clone());
        let small_boot = small_prefill.bootstrap_addr().port();
        // The routers reach the small prefill's HTTP port late, so decode
        // (which connects to its transfer port directly) has surely reserved
        // pages when the prefill refuses.
        let small_late = delayed_proxy(&small_url, PREFILL_DELAY);
        Workers {
            router_shm: serve_router(&prefill_url, boot, &decode_shm_url),
            router_tcp: serve_router(&prefill_url, boot, &decode_tcp_url),
            router_small_shm: serve_router(&small_late, small_boot, &decode_shm_url),
            router_small_tcp: serve_router(&small_late, small_boot, &decode_tcp_url),
            colocated: (common::serve_worker(colocated.clone()), colocated),
            prefill: (prefill_url, prefill),
            small_prefill: (small_url, small_prefill),
            decode_shm: (decode_shm_url, decode_shm),
            decode_tcp: (decode_tcp_url, decode_tcp),
        }
    })
}

fn next_room() -> u64 {
    static ROOM: AtomicU64 = AtomicU64::new(1000);
    ROOM.fetch_add(1, Ordering::Relaxed)
}

/// `body` with the bootstrap fields of `prefill` and a fresh room.
fn paired(body: &Value, prefill: &PrefillHandle) -> Value {
    let mut b = body.clone();
    let addr = prefill.bootstrap_addr();
    b["bootstrap_host"] = json!(addr.ip().to_string());
    b["bootstrap_port"] = json!(addr.port());
    b["bootstrap_room"] = json!(next_room());
    sign(&mut b);
    b
}

/// Send `body` to the prefill and the decode worker at once, as a router
/// does; returns (decode status, decode body, prefill status, prefill body).
async fn pd_post(
    prefill: &(String, PrefillHandle),
    decode: &str,
    path: &str,
    body: &Value,
) -> (u16, String, u16, String) {
    let b = paired(body, &prefill.1);
    let (p, d) = tokio::join!(
        common::post_text(&prefill.0, path, &b),
        common::post_text(decode, path, &b)
    );
    (d.0, d.1, p.0, p.1)
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The JSON events of an SSE body that ends with `[DONE]`.
fn sse_values(body: &str) -> Vec<Value> {
    let events = sse_data(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect()
}

/// The generated text of a response (whole or SSE) of `path`.
fn output_text(path: &str, stream: bool, body: &str) -> String {
    let pick = |v: &Value| -> String {
        match path {
            "/generate" => v["text"].as_str().unwrap_or_default().to_string(),
            "/v1/completions" => v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            _ if stream => v["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            _ => v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        }
    };
    if !stream {
        return pick(&json_of(body));
    }
    let values = sse_values(body);
    for v in &values {
        assert!(v.get("error").is_none(), "error event: {v}");
    }
    if path == "/generate" {
        // Cumulative objects: the last one holds the whole text.
        values.last().map(pick).unwrap_or_default()
    } else {
        values.iter().map(pick).collect()
    }
}

fn request(path: &str, i: usize, stream: bool) -> Value {
    let words = "the quick brown fox jumps over a lazy dog ".repeat(1 + i * 7);
    let max = 6 + i * 5;
    match path {
        "/generate" => json!({
            "text": words,
            "sampling_params": {"max_new_tokens": max, "temperature": 0, "ignore_eos": true},
            "stream": stream,
        }),
        "/v1/completions" => json!({
            "prompt": words, "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": stream,
        }),
        _ => json!({
            "messages": [{"role": "user", "content": words}],
            "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": stream,
        }),
    }
}

async fn wait_decode_idle(d: &DecodeHandle) -> handoff_engine::handle::LoadSnapshot {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let load = d.load();
        let idle = load.pages_used == 0 && load.running == 0 && load.waiting == 0;
        if idle || Instant::now() > deadline {
            return load;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn rooms(p: &PrefillHandle, d: &DecodeHandle) -> (usize, usize) {
    let pr = p.transfer_stats().await.expect("prefill stats").live_rooms;
    let dr = d.transfer_stats().await.expect("decode stats").live_rooms;
    (pr, dr)
}

/// Wait (up to 2 s) until neither endpoint has a live room.
async fn rooms_drained(p: &PrefillHandle, d: &DecodeHandle) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while rooms(p, d).await != (0, 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_http_workers() {
    let w = workers();
    greedy_pd_equals_colocated(w).await;
    prefill_refusal_reaches_the_client_with_its_status(w).await;
    missing_or_bad_bootstrap_fields_are_named(w).await;
    client_leaving_mid_stream_frees_both_sides(w).await;
    server_info_reports_the_mode(w).await;
    for (router, small, decode, label) in [
        (&w.router_shm, &w.router_small_shm, &w.decode_shm, "shm"),
        (&w.router_tcp, &w.router_small_tcp, &w.decode_tcp, "tcp"),
    ] {
        router_output_equals_colocated(w, router, label).await;
        router_top_logprobs_equal_colocated(w, router, label).await;
        router_sixteen_concurrent_equal_colocated(w, router, label).await;
        router_invalid_request_keeps_its_400(w, router, decode).await;
        router_prefill_refusal_after_decode_reserved(w, small, decode, label).await;
        router_client_leaving_frees_both_sides(w, router, decode, label).await;
    }
}

/// Through handoff's router: every endpoint, whole and streamed, equals the
/// colocated output.
async fn router_output_equals_colocated(w: &Workers, router: &str, label: &str) {
    for path in ["/generate", "/v1/completions", "/v1/chat/completions"] {
        for stream in [false, true] {
            let body = request(path, 1, stream);
            let (cs, colocated) = common::post_text(&w.colocated.0, path, &body).await;
            assert_eq!(cs, 200, "{colocated}");
            let (rs, routed) = common::post_text(router, path, &body).await;
            assert_eq!(rs, 200, "{label} {path}: {routed}");
            assert_eq!(
                output_text(path, stream, &routed),
                output_text(path, stream, &colocated),
                "{label} {path} stream={stream}"
            );
        }
    }
}

/// The log-probabilities of a response (whole or SSE) of `path`: every
/// logprobs object in order (for `/generate`, the last cumulative one).
fn logprob_parts(path: &str, stream: bool, body: &str) -> Vec<Value> {
    let pick = |v: &Value| -> Value {
        match path {
            "/generate" => json!([
                v["meta_info"]["output_token_logprobs"],
                v["meta_info"]["output_top_logprobs"],
                v["meta_info"]["input_token_logprobs"],
                v["meta_info"]["input_top_logprobs"]
            ]),
            "/v1/completions" => json!([v["choices"][0]["logprobs"], v["choices"][0]["text"]]),
            _ => v["choices"][0]["logprobs"].clone(),
        }
    };
    if !stream {
        return vec![pick(&json_of(body))];
    }
    let values = sse_values(body);
    if path == "/generate" {
        values.last().map(pick).into_iter().collect()
    } else {
        values.iter().map(pick).filter(|v| !v.is_null()).collect()
    }
}

/// Top logprobs through the router equal colocated ones, bit for bit (the
/// first position's come from the prefill), on every endpoint, whole and
/// streamed; so do the prompt's scores (`echo`, `logprob_start_len`),
/// which the prefill computes.
async fn router_top_logprobs_equal_colocated(w: &Workers, router: &str, label: &str) {
    for path in ["/generate", "/v1/completions", "/v1/chat/completions"] {
        for stream in [false, true] {
            let mut body = request(path, 1, stream);
            match path {
                "/generate" => {
                    body["return_logprob"] = json!(true);
                    body["top_logprobs_num"] = json!(3);
                    body["logprob_start_len"] = json!(0);
                }
                "/v1/completions" => {
                    body["logprobs"] = json!(3);
                    body["echo"] = json!(true);
                }
                _ => {
                    body["logprobs"] = json!(true);
                    body["top_logprobs"] = json!(3);
                }
            }
            let (cs, colocated) = common::post_text(&w.colocated.0, path, &body).await;
            assert_eq!(cs, 200, "{colocated}");
            let (rs, routed) = common::post_text(router, path, &body).await;
            assert_eq!(rs, 200, "{label} {path}: {routed}");
            let want = logprob_parts(path, stream, &colocated);
            assert!(!want.is_empty(), "{colocated}");
            let text = want[0].to_string();
            assert!(
                text.contains("top_logprobs") || path == "/generate",
                "{text}"
            );
            if path == "/generate" {
                assert!(want[0][2].as_array().is_some_and(|a| a.len() > 2), "{text}");
            }
            assert_eq!(
                logprob_parts(path, stream, &routed),
                want,
                "{label} {path} stream={stream}"
            );
        }
    }
}

/// 16 requests at once through the router, prompts from one to many pages:
/// each equals its colocated output.
async fn router_sixteen_concurrent_equal_colocated(w: &Workers, router: &str, label: &str) {
    let bodies: Vec<Value> = (0..16)
        .map(|i| {
            json!({
                "text": format!("{i} {}", "pages and pages of text ".repeat(1 + i * 3)),
                "sampling_params": {"max_new_tokens": 8 + i, "temperature": 0, "ignore_eos": true},
                "stream": i % 2 == 0,
            })
        })
        .collect();
    let mut want = Vec::new();
    for b in &bodies {
        let (s, t) = common::post_text(&w.colocated.0, "/generate", b).await;
        assert_eq!(s, 200, "{t}");
        want.push(output_text("/generate", b["stream"] == true, &t));
    }
    let got = futures_util::future::join_all(
        bodies
            .iter()
            .map(|b| common::post_text(router, "/generate", b)),
    )
    .await;
    for (i, ((s, t), w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(*s, 200, "{label} request {i}: {t}");
        assert_eq!(
            &output_text("/generate", bodies[i]["stream"] == true, t),
            w,
            "{label} request {i}"
        );
    }
}

/// Seed 004 through the router: a prompt longer than the context is the
/// workers' 400 with their message; decode's pages are back at once and no
/// KV moved.
async fn router_invalid_request_keeps_its_400(
    w: &Workers,
    router: &str,
    decode: &(String, DecodeHandle),
) {
    let before = w
        .prefill
        .1
        .transfer_stats()
        .await
        .expect("stats")
        .room_stats
        .succeeded;
    let t = Instant::now();
    let (s, b) = common::post_text(
        router,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "word ".repeat(5000)}], "max_tokens": 4}),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(s, 400, "{b}");
    let e = json_of(&b);
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{b}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exceeds the context length of 4096 tokens"),
        "{b}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert_eq!(decode.1.load().pages_used, 0);
    let after = w
        .prefill
        .1
        .transfer_stats()
        .await
        .expect("stats")
        .room_stats
        .succeeded;
    assert_eq!(after, before, "a transfer happened for a refused request");
}

/// Seed 004 through the router, the refusal coming from prefill after
/// decode reserved pages (the small prefill's context is 256, decode's
/// 4096): the client gets prefill's 400 and reason, decode opened a room
/// and failed it, and every page it reserved is back.
async fn router_prefill_refusal_after_decode_reserved(
    w: &Workers,
    router: &str,
    decode: &(String, DecodeHandle),
    label: &str,
) {
    let stats = |d: &DecodeHandle| {
        let d = d.clone();
        async move { d.transfer_stats().await.expect("stats").room_stats }
    };
    let before = stats(&decode.1).await;
    let t = Instant::now();
    let body =
        json!({"messages": [{"role": "user", "content": "word ".repeat(400)}], "max_tokens": 4});
    let router_url = router.to_string();
    let answer =
        tokio::spawn(
            async move { common::post_text(&router_url, "/v1/chat/completions", &body).await },
        );
    // Decode reserves the prompt's pages while the prefill has not yet seen
    // the request (its HTTP port is reached late).
    let mut reserved = 0;
    while !answer.is_finished() && reserved == 0 {
        reserved = decode.1.load().pages_used;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (s, b) = answer.await.unwrap();
    let took = t.elapsed();
    assert!(
        reserved >= 400 / PAGE_SIZE,
        "{label}: decode never held the prompt's pages ({reserved}): the refusal did not come after the reservation"
    );
    assert_eq!(s, 400, "{label}: {b}");
    let e = json_of(&b);
    // Whichever answer reaches the router first, prefill's own or decode's
    // relay of it, it names the same error and field: the refusal's API
    // code crosses the transfer protocol (`Status` with REJECT_CODE).
    assert_eq!(
        e["error"]["code"], "context_length_exceeded",
        "{label}: {b}"
    );
    assert_eq!(e["error"]["param"], "messages", "{label}: {b}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exceeds the context length of 256 tokens"),
        "{label}: the prefill's reason, not decode's: {b}"
    );
    // Not a timeout: the refusal crossed the protocol (the prefill sees the
    // request after PREFILL_DELAY; the room timers are 30 s).
    assert!(
        took < PREFILL_DELAY + Duration::from_secs(5),
        "took {took:?}"
    );
    let load = wait_decode_idle(&decode.1).await;
    assert_eq!(load.pages_used, 0, "{label}: decode kept pages: {load:?}");
    rooms_drained(&w.small_prefill.1, &decode.1).await;
    // Decode opened and failed this room (a refusal decode relayed for the
    // previous step's request may land in the same window, so at least).
    let after = stats(&decode.1).await;
    assert!(
        after.opened > before.opened && after.failed > before.failed,
        "{label}: decode must have reserved a room and failed it: {before:?} -> {after:?}"
    );
    assert_eq!(after.succeeded, before.succeeded, "{label}");
}

/// Seed 000 through the router: a client that leaves mid-prefill (the
/// prompt's KV is being written) or mid-decode frees the room and every page
/// on both workers within 100 ms.
async fn router_client_leaving_frees_both_sides(
    w: &Workers,
    router: &str,
    decode: &(String, DecodeHandle),
    label: &str,
) {
    for phase in ["prefill", "decode"] {
        let (prompt_words, max_new) = match phase {
            "prefill" => (700, 4),
            _ => (4, 3000),
        };
        let body = json!({
            "text": "word ".repeat(prompt_words),
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": true},
            "stream": true,
        });
        let client = reqwest::Client::new();
        let req = client.post(format!("{router}/generate")).json(&body).send();
        let left = if phase == "prefill" {
            // Leave once the prefill computes and decode holds the pages.
            let task = tokio::spawn(req);
            let deadline = Instant::now() + Duration::from_secs(5);
            while !(w.prefill.1.load().running > 0 && decode.1.load().pages_used > 0) {
                assert!(Instant::now() < deadline, "{label}: prefill never started");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            task.abort();
            let _ = task.await;
            Instant::now()
        } else {
            let mut resp = req.await.expect("router answers");
            let mut seen = 0;
            while seen < 2 {
                let chunk = resp.chunk().await.expect("chunk").expect("more");
                seen += String::from_utf8_lossy(&chunk).matches("data:").count();
            }
            drop(resp);
            Instant::now()
        };
        let deadline = left + Duration::from_secs(3);
        loop {
            let d = decode.1.load();
            let p = w.prefill.1.load();
            let r = rooms(&w.prefill.1, &decode.1).await;
            if d.pages_used == 0
                && d.running == 0
                && d.waiting == 0
                && p.pages_used == 0
                && r == (0, 0)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{label} {phase}: not freed: {d:?} {p:?} rooms {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let freed = left.elapsed();
        eprintln!("{label}: client left mid-{phase}; both sides free after {freed:?}");
        // Freed by the protocol, not a timer: the room and fence timers are
        // 5 s and more, a client abort frees both sides in a few ms here; 1 s
        // tells them apart on a loaded 2-core box.
        assert!(
            freed < Duration::from_secs(1),
            "{label} {phase}: freed after {freed:?}"
        );
    }
}

async fn greedy_pd_equals_colocated(w: &Workers) {
    for (decode, label) in [(&w.decode_shm, "shm"), (&w.decode_tcp, "tcp")] {
        for path in ["/generate", "/v1/completions", "/v1/chat/completions"] {
            for stream in [false, true] {
                for i in 0..2 {
                    let body = request(path, i, stream);
                    let (cs, colocated) = common::post_text(&w.colocated.0, path, &body).await;
                    assert_eq!(cs, 200, "{colocated}");
                    let (ds, dbody, ps, pbody) = pd_post(&w.prefill, &decode.0, path, &body).await;
                    assert_eq!(ds, 200, "{label} {path}: decode said {dbody}");
                    assert_eq!(ps, 200, "{label} {path}: prefill said {pbody}");
                    let want = output_text(path, stream, &colocated);
                    let got = output_text(path, stream, &dbody);
                    assert!(!want.is_empty(), "{path}: empty colocated output");
                    assert_eq!(got, want, "{label} {path} stream={stream} prompt {i}");
                    // The prefill's own answer is the first token.
                    let first = output_text(path, stream, &pbody);
                    assert!(
                        want.starts_with(&first),
                        "prefill said {first:?}, output {want:?}"
                    );
                }
            }
        }
        let load = wait_decode_idle(&decode.1).await;
        assert_eq!(load.pages_used, 0, "{label}: {load:?}");
        assert_eq!(w.prefill.1.load().pages_used, 0);
    }
    // The prefill worker's timeline: every completed prefill has its stages.
    let metrics = reqwest::get(format!("{}/metrics", w.prefill.0))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body");
    for stage in ["wait_destination", "compute", "transfer_tail"] {
        let count = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "handoff_prefill_stage_seconds_count{{stage=\"{stage}\"}} "
                ))
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {stage} count in\n{metrics}"));
        assert_eq!(count, 24, "{stage}: one per PD request");
    }
    // What the prefill sent decode, as the bench reads it.
    let kv_bytes = metrics
        .lines()
        .find_map(|l| l.strip_prefix("handoff_kv_transfer_bytes_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no KV byte count in\n{metrics}"));
    assert!(kv_bytes > 0, "{kv_bytes}");
}

/// Seed 004: the small prefill refuses a prompt the decode accepts; decode
/// answers with the prefill's 400 and reason at once, and its pages return.
async fn prefill_refusal_reaches_the_client_with_its_status(w: &Workers) {
    let body = json!({
        "prompt": "lorem ipsum ".repeat(SMALL_CONTEXT),
        "max_tokens": 4,
        "temperature": 0,
    });
    for decode in [&w.decode_shm, &w.decode_tcp] {
        let t = Instant::now();
        let (ds, dbody, ps, pbody) =
            pd_post(&w.small_prefill, &decode.0, "/v1/completions", &body).await;
        let took = t.elapsed();
        assert_eq!(ps, 400, "{pbody}");
        let perr = json_of(&pbody);
        let pmsg = perr["error"]["message"].as_str().expect("message");
        assert!(pmsg.contains("exceeds the context length of 256"), "{pmsg}");
        assert_eq!(ds, 400, "decode must keep the prefill's status: {dbody}");
        let dmsg = json_of(&dbody)["error"]["message"]
            .as_str()
            .expect("message")
            .to_string();
        assert!(
            dmsg.contains(pmsg),
            "decode said {dmsg:?}, prefill {pmsg:?}"
        );
        assert!(
            took < Duration::from_secs(2),
            "took {took:?}: a timeout, not the protocol"
        );
        let load = wait_decode_idle(&decode.1).await;
        assert_eq!(load.pages_used, 0, "{load:?}");
        rooms_drained(&w.small_prefill.1, &decode.1).await;
        assert_eq!(rooms(&w.small_prefill.1, &decode.1).await, (0, 0));
    }
}

async fn missing_or_bad_bootstrap_fields_are_named(w: &Workers) {
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}});
    let (s, b) = common::post_text(&w.decode_tcp.0, "/generate", &body).await;
    assert_eq!(s, 400, "{b}");
    let e = json_of(&b);
    assert_eq!(e["error"]["code"], "missing_bootstrap");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("this is a decode worker: a request needs bootstrap_host, bootstrap_port and bootstrap_room"),
        "{b}"
    );
    let (s, b) = common::post_text(&w.prefill.0, "/v1/completions", &json!({"prompt": "hi"})).await;
    assert_eq!(s, 400, "{b}");
    assert!(
        b.contains("this is a prefill worker: a request needs bootstrap_room"),
        "{b}"
    );
    let mut bad = paired(&body, &w.prefill.1);
    bad["bootstrap_room"] = json!("12");
    let (s, b) = common::post_text(&w.decode_tcp.0, "/generate", &bad).await;
    assert_eq!(s, 400, "{b}");
    assert!(
        b.contains(
            "bootstrap_room must be an integer between 0 and 9223372036854775807, got \\\"12\\\""
        ),
        "{b}"
    );
    bad["bootstrap_room"] = json!(0);
    let (s, b) = common::post_text(&w.prefill.0, "/generate", &bad).await;
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("bootstrap_room must be non-zero"), "{b}");
    let mut bad = paired(&body, &w.prefill.1);
    bad["bootstrap_host"] = json!("no-such-host.invalid");
    sign(&mut bad);
    let (s, b) = common::post_text(&w.decode_tcp.0, "/generate", &bad).await;
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("bootstrap_host `no-such-host.invalid`"), "{b}");
    untrusted_endpoints_are_refused_and_never_dialled(w, &body).await;
    // A colocated worker accepts and ignores the fields.
    let (s, b) = common::post_text(&w.colocated.0, "/generate", &paired(&body, &w.prefill.1)).await;
    assert_eq!(s, 200, "{b}");
}

/// A decode worker dials no endpoint a client chose: unsigned, wrongly
/// signed, altered or stale bootstrap fields get a 403 naming
/// `bootstrap_host`, and no connection reaches the endpoint they name (a
/// listener counts accepts).
async fn untrusted_endpoints_are_refused_and_never_dialled(w: &Workers, body: &Value) {
    let trap = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    trap.set_nonblocking(true).expect("nonblocking");
    let port = trap.local_addr().unwrap().port();
    let aimed = |b: &mut Value| {
        b["bootstrap_host"] = json!("127.0.0.1");
        b["bootstrap_port"] = json!(port);
    };
    let mut unsigned = paired(body, &w.prefill.1);
    aimed(&mut unsigned);
    unsigned.as_object_mut().unwrap().remove("bootstrap_sig");
    let mut altered = paired(body, &w.prefill.1);
    aimed(&mut altered); // signed for the real prefill, then pointed elsewhere
    let mut stale = paired(body, &w.prefill.1);
    aimed(&mut stale);
    sign(&mut stale);
    let old = stale["bootstrap_ts"].as_u64().unwrap() - 3600;
    stale["bootstrap_ts"] = json!(old);
    let mut forged = paired(body, &w.prefill.1);
    aimed(&mut forged);
    forged["bootstrap_sig"] = json!("0".repeat(64));
    for (label, b, why) in [
        ("unsigned", &unsigned, "carries no bootstrap_sig"),
        ("altered", &altered, "does not match"),
        ("stale", &stale, "does not match"),
        ("forged", &forged, "does not match"),
    ] {
        for path in ["/generate", "/v1/completions", "/v1/chat/completions"] {
            let mut b = b.clone();
            if path != "/generate" {
                b["prompt"] = json!("hi");
                b["messages"] = json!([{"role": "user", "content": "hi"}]);
                if path == "/v1/completions" {
                    b.as_object_mut().unwrap().remove("messages");
                } else {
                    b.as_object_mut().unwrap().remove("prompt");
                }
                b.as_object_mut().unwrap().remove("text");
                b.as_object_mut().unwrap().remove("sampling_params");
            }
            let (s, text) = common::post_text(&w.decode_tcp.0, path, &b).await;
            assert_eq!(s, 403, "{label} {path}: {text}");
            let e = json_of(&text);
            assert_eq!(e["error"]["code"], "untrusted_bootstrap", "{text}");
            assert_eq!(e["error"]["param"], "bootstrap_host", "{text}");
            let msg = e["error"]["message"].as_str().unwrap();
            assert!(
                msg.contains(why) && msg.contains(&format!("127.0.0.1:{port}")),
                "{label}: {msg}"
            );
        }
    }
    // Stale but correctly signed: the clock check names the skew.
    let mut old_sig = paired(body, &w.prefill.1);
    aimed(&mut old_sig);
    let ts = old_sig["bootstrap_ts"].as_u64().unwrap() - 3600;
    let claim = handoff_proto::bootstrap_auth::BootstrapClaim {
        room: old_sig["bootstrap_room"].as_u64().unwrap(),
        host: "127.0.0.1",
        port,
        ts,
    };
    old_sig["bootstrap_ts"] = json!(ts);
    old_sig["bootstrap_sig"] = json!(handoff_proto::bootstrap_auth::sign(SECRET, &claim));
    let (s, text) = common::post_text(&w.decode_tcp.0, "/generate", &old_sig).await;
    assert_eq!(s, 403, "{text}");
    assert!(text.contains("3600 s away"), "{text}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        matches!(trap.accept(), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a decode worker connected to an endpoint a client chose"
    );
    // The same endpoint, signed: decode dials it (the listener sees the
    // connection; it speaks no handoff, so the request then fails).
    let mut signed = paired(body, &w.prefill.1);
    aimed(&mut signed);
    sign(&mut signed);
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        common::post_text(&w.decode_tcp.0, "/generate", &signed),
    )
    .await;
    let t0 = std::time::Instant::now();
    loop {
        match trap.accept() {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "a signed endpoint was never dialled"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Seed 000 over HTTP: the client of the decode worker goes away mid-stream;
/// both workers drop the room and every page.
async fn client_leaving_mid_stream_frees_both_sides(w: &Workers) {
    for decode in [&w.decode_shm, &w.decode_tcp] {
        let body = paired(
            &json!({
                "text": "keep going",
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": true},
                "stream": true,
            }),
            &w.prefill.1,
        );
        let client = reqwest::Client::new();
        let p = tokio::spawn(
            client
                .post(format!("{}/generate", w.prefill.0))
                .json(&body)
                .send(),
        );
        let mut resp = client
            .post(format!("{}/generate", decode.0))
            .json(&body)
            .send()
            .await
            .expect("decode answers");
        assert_eq!(resp.status(), 200);
        // Two events: the request is decoding.
        let mut seen = 0;
        while seen < 2 {
            let chunk = resp.chunk().await.expect("chunk").expect("more data");
            seen += String::from_utf8_lossy(&chunk).matches("data:").count();
        }
        assert!(decode.1.load().pages_used > 0);
        let left = Instant::now();
        drop(resp);
        let load = wait_decode_idle(&decode.1).await;
        let freed = left.elapsed();
        assert_eq!(load.pages_used, 0, "{load:?}");
        assert!(
            freed < Duration::from_millis(500),
            "pages came back after {freed:?}"
        );
        let (ps, _) = {
            let r = p.await.expect("join").expect("prefill answers");
            (r.status().as_u16(), ())
        };
        assert_eq!(ps, 200, "the prefill finished its part");
        rooms_drained(&w.prefill.1, &decode.1).await;
        assert_eq!(rooms(&w.prefill.1, &decode.1).await, (0, 0));
        assert_eq!(w.prefill.1.load().pages_used, 0);
    }
}

async fn server_info_reports_the_mode(w: &Workers) {
    for (base, mode) in [
        (&w.colocated.0, "null"),
        (&w.prefill.0, "prefill"),
        (&w.decode_tcp.0, "decode"),
    ] {
        let text = reqwest::get(format!("{base}/server_info"))
            .await
            .expect("server_info")
            .text()
            .await
            .expect("body");
        assert_eq!(json_of(&text)["disaggregation_mode"], mode, "{text}");
        let health = reqwest::get(format!("{base}/health_generate"))
            .await
            .expect("health_generate");
        assert_eq!(health.status(), 200, "{mode}");
    }
}
