//! `handoff serve --prefill-replicas 2 --decode-replicas 2` (issue 15 item
//! 2): four supervised worker processes behind the router, every one takes
//! requests, and a decode replica killed with SIGKILL under a steady load
//! fails no request that had not started on it (they go to the other
//! replica); the ones it was generating end with a typed error, and no
//! answer is wrong; the supervisor starts it again and all four are
//! healthy again. The four share one weight cache file, written once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{serve, workers};

async fn generate(url: &str, prompt: u32) -> (u16, Value) {
    let body = json!({
        "input_ids": (0..48u32).map(|i| 30 + (i * 11 + prompt * 7) % 150).collect::<Vec<_>>(),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    });
    match reqwest::Client::new()
        .post(format!("{url}/generate"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => {
            let s = r.status().as_u16();
            (s, r.json::<Value>().await.unwrap_or(Value::Null))
        }
        Err(e) => (0, json!(e.to_string())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_all_serve_and_a_killed_decode_fails_only_what_it_was_generating() {
    let dir = std::env::temp_dir().join(format!("handoff-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    handoff_model::tiny::write_tiny_gguf(&model, 5).expect("tiny GGUF");
    let cache = dir.join("weights");
    let s = serve(
        &model,
        &[
            "--prefill-replicas",
            "2",
            "--decode-replicas",
            "2",
            "--weight-cache",
            cache.to_str().unwrap(),
        ],
        &[],
    );
    let url = s.url.clone();
    let mut answers = Vec::new();
    for p in 0..8u32 {
        let (status, v) = generate(&url, p).await;
        assert_eq!(status, 200, "{v}");
        answers.push(v["output_ids"].clone());
    }
    let w = workers(&url).await;
    assert_eq!(w.len(), 4, "{w:#?}");
    for x in &w {
        assert!(
            x["served"].as_u64() > Some(0),
            "a replica took nothing: {x}"
        );
    }

    // The four workers share one weight cache file: one wrote it, the
    // others mapped it; their matrices are mapped, not each one's own.
    let mut written = 0;
    for x in &w {
        let info: Value = reqwest::get(format!("{}/server_info", x["url"].as_str().unwrap()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let how = info["weight_cache"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let file = how
            .rsplit(' ')
            .find(|w| w.ends_with(".q8w"))
            .map(std::path::PathBuf::from);
        assert!(
            file.as_ref()
                .is_some_and(|f| f.starts_with(&cache) && f.exists()),
            "{info}"
        );
        written += usize::from(how.starts_with("written"));
        let (all, mapped) = (
            info["weight_bytes"].as_u64().unwrap(),
            info["weight_bytes_mapped"].as_u64().unwrap(),
        );
        assert!(
            mapped * 2 > all,
            "{mapped} of {all} weight bytes mapped: {info}"
        );
    }
    assert_eq!(written, 1, "the weight cache written once");

    // A steady load from 4 clients; one decode replica dies in the middle.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for c in 0..4u32 {
        let (url, done, answers) = (url.clone(), done.clone(), answers.clone());
        clients.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut n = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let p = (c + n) % 8;
                let start = t0.elapsed();
                let (status, v) = generate(&url, p).await;
                out.push((
                    start,
                    t0.elapsed(),
                    status,
                    v.clone(),
                    v["output_ids"] == answers[p as usize],
                ));
                n += 1;
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed_at = t0.elapsed();
    s.kill_first("decode");
    // The signal was sent when `kill` returned; the process is gone (its
    // sockets closed, which the router's connection pool must see) a moment
    // later: requests started by then may still have gone to it.
    let gone_by = t0.elapsed() + Duration::from_millis(300);
    tokio::time::sleep(Duration::from_secs(3)).await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.await.unwrap());
    }
    let after: Vec<_> = all.iter().filter(|r| r.0 > gone_by).collect();
    assert!(
        after.len() >= 8,
        "only {} requests after the kill",
        after.len()
    );
    for (start, end, status, v, same) in &all {
        match status {
            200 => assert!(same, "a wrong answer: {v}"),
            // In flight on the killed replica: a typed error, at once.
            502 => {
                assert!(
                    *start < gone_by && *end > killed_at,
                    "{start:?} {end:?} {v}"
                );
                assert!(v["error"]["message"].as_str().is_some(), "{v}");
            }
            other => panic!("{other}: {v}"),
        }
    }
    for (_, _, status, v, _) in &after {
        assert_eq!(*status, 200, "a request started after the kill failed: {v}");
    }
    // Started again by the supervisor, and healthy.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let w = workers(&url).await;
        let healthy = w.iter().filter(|x| x["health"] == "healthy").count();
        let restarted = s.workers.lock().unwrap().len() == 5;
        if healthy == 4 && restarted {
            break;
        }
        assert!(Instant::now() < deadline, "not back: {w:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
