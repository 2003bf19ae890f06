//! Rolling restarts of `handoff serve` (issue 15 item 4): under a steady
//! load of streamed requests, `POST /admin/restart` (behind the API key) and
//! then SIGHUP each replace every worker process, one at a time, and not
//! one request fails: every stream is complete and equal to its reference
//! output. A second restart asked for while one runs is refused (409), and
//! the route refuses a caller without the key (401).

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::serve;

const KEY: &str = "rolling-restart-test-key";

fn client() -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {KEY}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(h)
        .build()
        .unwrap()
}

fn body(prompt: u32, stream: bool) -> Value {
    json!({
        "input_ids": (0..40u32).map(|i| 30 + (i * 13 + prompt * 5) % 150).collect::<Vec<_>>(),
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "stream": stream,
    })
}

/// A streamed `/generate`: its status and, if the stream ended with
/// `[DONE]` and no error event, its final `output_ids`.
async fn streamed(c: &reqwest::Client, url: &str, prompt: u32) -> (u16, Result<Value, String>) {
    let r = match c
        .post(format!("{url}/generate"))
        .json(&body(prompt, true))
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return (0, Err(format!("send: {e}"))),
    };
    let status = r.status().as_u16();
    let text = match r.text().await {
        Ok(t) => t,
        Err(e) => return (status, Err(format!("body: {e}"))),
    };
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    if events.last() != Some(&"[DONE]") {
        return (status, Err(format!("no [DONE]: {text}")));
    }
    let mut last = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or(Value::Null);
        if v.get("error").is_some() || v.is_null() {
            return (status, Err(format!("error event: {e}")));
        }
        last = v;
    }
    (status, Ok(last["output_ids"].clone()))
}

async fn restart_progress(c: &reqwest::Client, url: &str) -> Value {
    c.get(format!("{url}/admin/restart"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Wait until `finished` restarts have ended; the progress then.
async fn wait_restarts(c: &reqwest::Client, url: &str, finished: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let p = restart_progress(c, url).await;
        if p["finished"].as_u64() == Some(finished) && p["running"] == false {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "restart {finished} never ended: {p}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn worker_urls(c: &reqwest::Client, url: &str) -> Vec<String> {
    let w: Value = c
        .get(format!("{url}/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut urls: Vec<String> = w
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["url"].as_str().unwrap().to_string())
        .collect();
    urls.sort();
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_under_streamed_load_fail_nothing() {
    let dir = std::env::temp_dir().join(format!("handoff-rolling-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    handoff_model::tiny::write_tiny_gguf(&model, 5).expect("tiny GGUF");
    let s = serve(
        &model,
        &["--prefill-replicas", "1", "--decode-replicas", "2"],
        &[("HANDOFF_API_KEY", KEY)],
    );
    let url = s.url.clone();
    let c = client();

    // References, not streamed.
    let mut answers = Vec::new();
    for p in 0..6u32 {
        let r = c
            .post(format!("{url}/generate"))
            .json(&body(p, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        answers.push(v["output_ids"].clone());
    }
    let before = worker_urls(&c, &url).await;
    assert_eq!(before.len(), 3, "{before:?}");

    // Without the key: refused.
    let r = reqwest::Client::new()
        .post(format!("{url}/admin/restart"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // A steady load of streamed requests from 3 clients.
    let done = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for k in 0..3u32 {
        let (url, done, c) = (url.clone(), done.clone(), c.clone());
        clients.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut n = 0u32;
            while !done.load(Ordering::Relaxed) {
                let p = (k * 2 + n) % 6;
                let (status, got) = streamed(&c, &url, p).await;
                out.push((p, status, got));
                n += 1;
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Over HTTP, behind the key; a second one meanwhile is refused.
    let r = c.post(format!("{url}/admin/restart")).send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    let r = c.post(format!("{url}/admin/restart")).send().await.unwrap();
    assert_eq!(r.status(), 409);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "restart_in_progress", "{v}");
    let p = wait_restarts(&c, &url, 1).await;
    assert_eq!(p["replaced"], 3, "{p}");
    assert!(p["last_error"].is_null(), "{p}");
    let middle = worker_urls(&c, &url).await;
    assert_eq!(middle.len(), 3, "{middle:?}");
    assert!(
        middle.iter().all(|u| !before.contains(u)),
        "every worker is new: {before:?} -> {middle:?}"
    );

    // By SIGHUP.
    assert!(Command::new("kill")
        .args(["-HUP", &s.child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let p = wait_restarts(&c, &url, 2).await;
    assert_eq!(p["replaced"], 3, "{p}");
    assert!(p["last_error"].is_null(), "{p}");
    let after = worker_urls(&c, &url).await;
    assert!(after.iter().all(|u| !middle.contains(u)), "{after:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    done.store(true, Ordering::Relaxed);

    let mut all = Vec::new();
    for t in clients {
        all.extend(t.await.unwrap());
    }
    assert!(all.len() >= 12, "only {} requests", all.len());
    for (p, status, got) in &all {
        assert_eq!(*status, 200, "prompt {p}: {got:?}");
        let got = got.as_ref().unwrap_or_else(|e| panic!("prompt {p}: {e}"));
        assert_eq!(got, &answers[*p as usize], "prompt {p}");
    }
    // 3 first workers, then 3 per restart; none died on its own.
    let started = s.workers.lock().unwrap().len();
    assert_eq!(started, 9, "{:?}", s.workers.lock().unwrap());
    eprintln!(
        "{} streamed requests through two rolling restarts",
        all.len()
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
