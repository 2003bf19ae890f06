//! Discovery on a real etcd (issue 15): `handoff prefill|decode
//! --discovery etcd://...` register under a lease, `handoff router
//! --discovery ...` (no static workers) finds them. Two prefill and two
//! decode workers of the tiny model all serve, with one answer per prompt
//! whichever pair took it; a decode killed with SIGKILL leaves the router's
//! set within the lease TTL and requests keep succeeding; a prefill
//! stopped with SIGTERM deregisters at once; a worker of another model is
//! refused, with the reason in `/workers`.
//!
//! Needs Debian's `etcd-server` (`etcd` on PATH), which `scripts/test.sh`
//! installs; without it the test says so and passes, unless
//! `HANDOFF_REQUIRE_ETCD` is set (CI sets it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{generate, workers};

struct Proc {
    child: Child,
    http: String,
    /// Every line of its log.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Etcd {
    _proc: Proc,
    endpoint: String,
    _dir: tempdir::Dir,
}

mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    pub fn new(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!(
            "handoff-{tag}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh single-member etcd on loopback, or `None` (skip) without one.
async fn etcd() -> Option<Etcd> {
    if !common::etcd_on_path() {
        return None;
    }
    let dir = tempdir::new("etcd");
    let (client, peer) = (free_port(), free_port());
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new("etcd")
        .args(["--name", "t", "--data-dir"])
        .arg(dir.0.join("data"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("t={peer_url}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn etcd");
    let p = Proc {
        child,
        http: client_url.clone(),
        log: Default::default(),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let up = reqwest::Client::new()
            .post(format!("{client_url}/v3/kv/range"))
            .json(&json!({"key": "AA=="}))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if up {
            break;
        }
        assert!(Instant::now() < deadline, "etcd never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Some(Etcd {
        _proc: p,
        endpoint: format!("etcd://127.0.0.1:{client}/t{:x}", rand::random::<u32>()),
        _dir: dir,
    })
}

fn tiny(dir: &Path, seed: u64) -> PathBuf {
    let path = dir.join(format!("tiny-{seed}.gguf"));
    handoff_model::tiny::write_tiny_gguf(&path, seed).expect("tiny GGUF");
    path
}

const SECRET: &str = "discovery test secret";

/// Start `handoff <args>` and read its log until it listens.
fn start(role: &str, args: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg(role)
        .args(["--port", "0"])
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env("HANDOFF_TRANSFER_SECRET", SECRET)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn handoff");
    let (http, log) = common::listening_url_logged(&mut child);
    Proc {
        child,
        http: http.unwrap_or_else(|| panic!("{role} never listened")),
        log,
    }
}

fn worker(role: &str, model: &Path, discovery: &str) -> Proc {
    let model = model.to_str().unwrap();
    let mut args = vec![
        "--model",
        model,
        "--kv-pages",
        "256",
        "--discovery",
        discovery,
    ];
    // Each role takes only its own transfer flags (a flag a role does not
    // read is refused).
    if role == "prefill" {
        args.extend(["--disaggregation-bootstrap-port", "0"]);
    } else {
        args.extend(["--disaggregation-transfer-backend", "tcp"]);
    }
    start(role, &args)
}

/// Wait until `/workers` satisfies `ok`, or fail after `within`.
async fn until(router: &str, within: Duration, what: &str, ok: impl Fn(&[Value]) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let w = workers(router).await;
        if ok(&w) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not within {within:?}: {what}: {w:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn count(w: &[Value], role: &str, health: &str) -> usize {
    w.iter()
        .filter(|w| w["role"] == role && w["health"] == health)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_found_in_etcd_serve_and_leave_when_they_go() {
    let Some(etcd) = etcd().await else { return };
    let dir = tempdir::new("discovery-models");
    let model = tiny(&dir.0, 5);
    let ep = etcd.endpoint.as_str();
    // The router starts first, with no worker anywhere: a request that
    // comes now waits (--queue-timeout-secs) for workers to register.
    let router = start(
        "router",
        &[
            "--discovery",
            ep,
            "--health-check-interval-secs",
            "1",
            "--queue-timeout-secs",
            "30",
        ],
    );
    let r = router.http.as_str();
    let early = {
        let r = r.to_string();
        tokio::spawn(async move { generate(&r, 0).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!early.is_finished(), "the early request did not wait");
    let mut prefills = vec![worker("prefill", &model, ep), worker("prefill", &model, ep)];
    let mut decodes = vec![worker("decode", &model, ep), worker("decode", &model, ep)];
    let (s, v) = early.await.unwrap();
    assert_eq!(s, 200, "the early request: {v}");
    until(r, Duration::from_secs(20), "four healthy workers", |w| {
        count(w, "prefill", "healthy") == 2 && count(w, "decode", "healthy") == 2
    })
    .await;

    // Without workers and with a short queue timeout: a 503 that says when
    // to retry.
    let empty = format!("{ep}-empty");
    let lonely = start(
        "router",
        &["--discovery", &empty, "--queue-timeout-secs", "1"],
    );
    let t0 = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("{}/generate", lonely.http))
        .json(&json!({"text": "hi", "sampling_params": {"max_new_tokens": 1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    drop(lonely);

    // Every worker takes requests; a prompt's answer is the same whichever
    // pair served it.
    let mut answers: Vec<Option<Value>> = vec![None; 3];
    for i in 0..12u32 {
        let (s, v) = generate(r, i % 3).await;
        assert_eq!(s, 200, "{v}");
        let text = v["output_ids"].clone();
        let slot = &mut answers[(i % 3) as usize];
        match slot {
            None => *slot = Some(text),
            Some(want) => assert_eq!(&text, want, "prompt {} answered differently", i % 3),
        }
    }
    let w = workers(r).await;
    for x in &w {
        assert!(x["served"].as_u64() > Some(0), "a worker took nothing: {x}");
    }
    for p in prefills.iter().chain(&decodes) {
        assert!(
            w.iter().any(|x| x["url"] == p.http.as_str()),
            "{} not listed",
            p.http
        );
    }

    // etcd frozen for 10 s (longer than the leases): the router keeps
    // serving with the workers it knows and says discovery is stale; when
    // etcd is back it catches up, the expired leases' keys go, the workers
    // register again, and all four are back.
    let etcd_pid = etcd._proc.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &etcd_pid])
        .status()
        .unwrap()
        .success());
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_secs(10) {
        let (s, v) = generate(r, i % 3).await;
        assert_eq!(s, 200, "while etcd is frozen: {v}");
        assert_eq!(Some(v["output_ids"].clone()), answers[(i % 3) as usize]);
        i += 1;
    }
    // The router noticed (a frozen etcd keeps its watch open and silent).
    let said = |what: &str| router.log.lock().unwrap().iter().any(|l| l.contains(what));
    assert!(
        said("discovery is stale"),
        "the router never said discovery is stale"
    );
    assert!(Command::new("kill")
        .args(["-CONT", &etcd_pid])
        .status()
        .unwrap()
        .success());
    for i in 0..6u32 {
        let (s, v) = generate(r, i % 3).await;
        assert_eq!(s, 200, "after etcd came back: {v}");
    }
    until(
        r,
        Duration::from_secs(20),
        "all four back after etcd returned",
        |w| count(w, "prefill", "healthy") == 2 && count(w, "decode", "healthy") == 2,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !said("discovery caught up with etcd") {
        assert!(
            Instant::now() < deadline,
            "the router never caught up with etcd"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // SIGKILL a decode: its lease (3 s) expires and the router drops it;
    // requests keep succeeding on the other.
    let dead = decodes.remove(0);
    let dead_url = dead.http.clone();
    let t0 = Instant::now();
    drop(dead);
    until(r, Duration::from_secs(8), "the killed decode gone", |w| {
        !w.iter().any(|x| x["url"] == dead_url.as_str())
    })
    .await;
    let gone_after = t0.elapsed();
    assert!(gone_after <= Duration::from_secs(6), "{gone_after:?}");
    for i in 0..4u32 {
        let (s, v) = generate(r, i % 3).await;
        assert_eq!(s, 200, "after a decode died: {v}");
        assert_eq!(Some(v["output_ids"].clone()), answers[(i % 3) as usize]);
    }

    // SIGTERM a prefill: it revokes its lease before draining, so the
    // router drops it well before a TTL would.
    let leaving = prefills.remove(0);
    let leaving_url = leaving.http.clone();
    let t0 = Instant::now();
    let pid = leaving.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    // Until it closes its port, it answers health checks (and new work)
    // with 503 `draining`, never 200 again.
    let probe = {
        let url = leaving_url.clone();
        tokio::spawn(async move {
            let c = reqwest::Client::new();
            let mut seen = Vec::new();
            let until = Instant::now() + Duration::from_secs(8);
            while Instant::now() < until {
                match c.get(format!("{url}/health")).send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let v: Value = resp.json().await.unwrap_or(Value::Null);
                        seen.push((status, v["error"]["code"].as_str().map(String::from)));
                    }
                    Err(_) => break,
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        })
    };
    until(r, Duration::from_secs(5), "the stopped prefill gone", |w| {
        !w.iter().any(|x| x["url"] == leaving_url.as_str())
    })
    .await;
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    let seen = probe.await.unwrap();
    let first = seen
        .iter()
        .position(|(s, _)| *s == 503)
        .unwrap_or_else(|| panic!("never answered 503 draining: {seen:?}"));
    assert!(
        seen[first..]
            .iter()
            .all(|(s, code)| *s == 503 && code.as_deref() == Some("draining")),
        "{seen:?}"
    );
    drop(leaving);

    // Another model: refused, with the reason listed.
    let other = tiny(&dir.0, 6);
    let stranger = worker("decode", &other, ep);
    until(r, Duration::from_secs(10), "the other model refused", |w| {
        w.iter().any(|x| {
            x["url"] == stranger.http.as_str()
                && x["health"] == "refused"
                && x["reason"].as_str().is_some_and(|s| s.contains("differs"))
        })
    })
    .await;
    let (s, v) = generate(r, 1).await;
    assert_eq!(
        (s, Some(v["output_ids"].clone())),
        (200, answers[1].clone())
    );
    drop(stranger);
    drop(router);
}

/// A server of an attacker's that answers 200 to everything, counting the
/// requests it gets.
fn impostor() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = hits.clone();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
            );
        }
    });
    (url, hits)
}

/// Whoever can write under the prefix cannot register a worker: a copy of
/// a real decode record pointing at a live impostor (so its model and KV
/// fingerprint match), and the same copy unsigned, are refused and listed
/// with the reason, and the impostor gets no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_record_pointing_at_an_impostor_gets_no_request() {
    let Some(etcd) = etcd().await else { return };
    let dir = tempdir::new("discovery-forged");
    let model = tiny(&dir.0, 6);
    let ep = etcd.endpoint.as_str();
    let router = start(
        "router",
        &["--discovery", ep, "--health-check-interval-secs", "1"],
    );
    let r = router.http.as_str();
    let _prefill = worker("prefill", &model, ep);
    let _decode = worker("decode", &model, ep);
    until(r, Duration::from_secs(20), "two healthy workers", |w| {
        count(w, "prefill", "healthy") == 1 && count(w, "decode", "healthy") == 1
    })
    .await;
    let endpoint: handoff_server::discovery::EtcdEndpoint = ep.parse().unwrap();
    let client =
        handoff_server::discovery::Etcd::new(&endpoint.base, Duration::from_secs(2)).unwrap();
    let (_, kvs) = client
        .range_prefix(&format!("{}/workers/decode/", endpoint.prefix))
        .await
        .unwrap();
    assert_eq!(kvs.len(), 1, "{kvs:?}");
    let real: handoff_server::discovery::WorkerRecord = serde_json::from_slice(&kvs[0].1).unwrap();
    assert!(
        real.sig.is_some(),
        "a worker with the secret signs its record"
    );
    let (evil, hits) = impostor();
    let mut forged = real.clone();
    forged.url = evil.clone();
    let mut unsigned = forged.clone();
    unsigned.sig = None;
    for (name, rec) in [("forged", &forged), ("unsigned", &unsigned)] {
        let key = format!("{}/workers/decode/{name}", endpoint.prefix);
        client
            .put(&key, &serde_json::to_vec(rec).unwrap(), None)
            .await
            .unwrap();
    }
    until(r, Duration::from_secs(10), "both listed as refused", |w| {
        w.iter().filter(|x| x["health"] == "refused").count() == 2
    })
    .await;
    let w = workers(r).await;
    let reason = |key: &str| {
        w.iter()
            .find(|x| x["key"].as_str().is_some_and(|k| k.ends_with(key)))
            .map(|x| x["reason"].as_str().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    assert!(
        reason("forged").contains("record signature refused"),
        "{w:#?}"
    );
    assert!(reason("unsigned").contains("unsigned record"), "{w:#?}");
    for i in 0..8u32 {
        let (s, v) = generate(r, i % 3).await;
        assert_eq!(s, 200, "{v}");
    }
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the impostor got requests"
    );
}
