//! A real engine and server on an ephemeral port, shared by the tests of one
//! file, plus a small HTTP/SSE client.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use handoff_engine::handle::EngineHandle;
use handoff_engine::{Engine, EngineConfig};
use serde_json::Value;

/// The running server of this test binary.
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The engine behind it.
    pub engine: EngineHandle,
}

/// KV pool of the test server.
pub const KV_PAGES: usize = 2048;
/// Page size of the test server.
pub const PAGE_SIZE: usize = 16;

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("handoff-server-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tiny.gguf");
        // A long context so that a request generating up to it takes seconds:
        // the disconnect tests must give up long before it could finish.
        let cfg = handoff_model::tiny::TinyConfig {
            context_length: 16384,
            ..Default::default()
        };
        handoff_model::tiny::write_tiny_gguf_with(&path, 7, cfg).expect("write tiny GGUF");
        path
    })
    .clone()
}

/// A fresh engine on the tiny test model.
pub fn start_engine() -> EngineHandle {
    start_engine_with(|_| {})
}

/// A fresh engine on the tiny test model, its configuration changed by `f`.
pub fn start_engine_with(f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let mut config = EngineConfig {
        threads: 2,
        page_size: PAGE_SIZE,
        kv_pages: KV_PAGES,
        max_batch: 16,
        prefill_chunk: 64,
        served_name: Some("tiny-test".to_string()),
        ..EngineConfig::new(model_path())
    };
    f(&mut config);
    Engine::start(config).expect("engine starts")
}

/// Run `serve` on a listener bound to an ephemeral loopback port, on a
/// runtime of its own thread (it outlives any one test's runtime); returns
/// `http://127.0.0.1:PORT`.
pub fn serve_on_thread<F, Fut>(serve: F) -> String
where
    F: FnOnce(tokio::net::TcpListener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr"))
                .expect("send addr");
            serve(listener).await;
        });
    });
    let addr = rx.recv().expect("server address");
    format!("http://{addr}")
}

/// Serve `app` on an ephemeral loopback port from a task of the current
/// runtime; returns `http://127.0.0.1:PORT`.
pub async fn serve_in_task(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

/// POST `body` as JSON to `base` + `path`; the status and the body's text.
pub async fn post_text(base: &str, path: &str, body: &Value) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

/// Serve the worker API around `engine` (see [`serve_on_thread`]).
pub fn serve_worker(engine: impl Into<handoff_server::Backend>) -> String {
    serve_state(handoff_server::AppState::new(engine))
}

/// Serve the worker API around prepared state (see [`serve_on_thread`]).
pub fn serve_state(state: handoff_server::AppState) -> String {
    serve_on_thread(|listener| async move {
        axum::serve(listener, handoff_server::app_with_state(state))
            .await
            .expect("serve");
    })
}

/// Post a streamed `/generate` of `body` to `addr` from a socket with a
/// small receive buffer, read the response head, and hand back the
/// connection, from which the caller then reads nothing: a client that
/// stopped reading its stream.
pub async fn stalled_stream(addr: std::net::SocketAddr, body: &Value) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("receive buffer");
    let mut conn = socket.connect(addr).await.expect("connect");
    conn.write_all(
        format!(
            "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .expect("request");
    let mut head = [0u8; 64];
    conn.read_exact(&mut head).await.expect("response head");
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    conn
}

/// Read `conn` to its end; panics if it stays open 30 s without a byte.
pub async fn read_until_closed(conn: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(std::time::Duration::from_secs(30), conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the server kept the connection open for 30 s"),
        }
    }
}

/// Start (once) and return the shared server.
pub fn server() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let engine = start_engine();
        TestServer {
            base: serve_worker(engine.clone()),
            engine,
        }
    })
}

/// POST `body` (raw text) to `path`; returns status and body text.
pub async fn post_raw(path: &str, body: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", server().base))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

/// POST JSON; returns status and parsed JSON body.
pub async fn post(path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = post_raw(path, &body.to_string()).await;
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("body of {path} is not JSON ({e}): {text}"));
    (status, v)
}

/// GET; returns status and body text.
pub async fn get(path: &str) -> (u16, String) {
    let resp = reqwest::get(format!("{}{path}", server().base))
        .await
        .expect("request");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

/// POST a streaming request; returns status and the `data:` payloads in order.
pub async fn post_sse(path: &str, body: &Value) -> (u16, Vec<String>) {
    let (status, text) = post_raw(path, &body.to_string()).await;
    (status, sse_data(&text))
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|ev| {
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("data:")
                        .map(|d| d.strip_prefix(' ').unwrap_or(d))
                })
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// Assert an OpenAI error body with this status, code and message part.
#[track_caller]
pub fn assert_error(status: u16, body: &Value, want_status: u16, code: &str, message_part: &str) {
    assert_eq!(status, want_status, "status; body {body}");
    let err = &body["error"];
    assert_eq!(err["code"], code, "code; body {body}");
    let kind = if want_status < 500 {
        "invalid_request_error"
    } else {
        err["type"].as_str().unwrap_or("")
    };
    assert_eq!(err["type"], kind, "type; body {body}");
    let msg = err["message"].as_str().expect("message");
    assert!(
        msg.contains(message_part),
        "message {msg:?} lacks {message_part:?}"
    );
}

/// Wait until no request holds KV pages or runs.
pub async fn wait_idle() -> handoff_engine::handle::LoadSnapshot {
    let engine = &server().engine;
    for _ in 0..200 {
        let load = engine.load();
        if load.pages_used == 0 && load.running == 0 && load.waiting == 0 {
            return load;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    engine.load()
}

/// Start a long streamed `/generate` (8000 tokens, EOS ignored) named `rid`
/// at `base`, and read it until its first event.
pub async fn long_stream(base: &str, rid: &str) -> reqwest::Response {
    let body = serde_json::json!({
        "text": "count", "rid": rid, "stream": true,
        "sampling_params": {"max_new_tokens": 8000, "ignore_eos": true},
    });
    let mut resp = reqwest::Client::new()
        .post(format!("{base}/generate"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.expect("chunk").expect("a first event");
    assert!(first.starts_with(b"data:"), "{first:?}");
    resp
}

/// The rest of a streamed answer, as text.
pub async fn read_rest(mut resp: reqwest::Response) -> String {
    let mut out = Vec::new();
    while let Ok(Some(c)) = resp.chunk().await {
        out.extend_from_slice(&c);
    }
    String::from_utf8_lossy(&out).into_owned()
}
