//! The worker API beyond generation (issue 17 items 7, 8): `/tokenize` and
//! `/detokenize` agree with generation's own tokenization, `/abort_request`
//! ends a request by id (streamed and whole) and frees its pages, ids are
//! the client's `rid` or random, `system_fingerprint` is stable, and
//! `/metrics` carries SGLang's `sglang:` names with their values, and a
//! request that gets no token for the stall timeout ends as `stalled`.

mod common;

use std::time::{Duration, Instant};

use common::{get, post, server};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip_as_prompts_do() {
    let text = "Hello world, how are you?";
    let (s, v) = post("/tokenize", &json!({"prompt": text})).await;
    assert_eq!(s, 200, "{v}");
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect();
    assert_eq!(v["count"], ids.len(), "{v}");
    assert_eq!(v["max_model_len"], 16384, "{v}");
    // The same ids a generation of that prompt counts as its prompt.
    let (s, g) = post(
        "/generate",
        &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}),
    )
    .await;
    assert_eq!(s, 200, "{g}");
    assert_eq!(g["meta_info"]["prompt_tokens"], ids.len(), "{g}");
    // Back to the text.
    let (s, d) = post("/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(s, 200, "{d}");
    assert!(d["text"].as_str().expect("text").ends_with(text), "{d}");
    // Several prompts, each on its own; token texts on request.
    let (s, many) = post(
        "/tokenize",
        &json!({"prompt": [text, "a"], "return_token_strs": true, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(s, 200, "{many}");
    assert_eq!(many["count"].as_array().map(Vec::len), Some(2), "{many}");
    let strs = many["token_strs"][0].as_array().expect("token_strs");
    let joined: String = strs.iter().map(|s| s.as_str().unwrap_or("")).collect();
    assert_eq!(joined, text, "{many}");
    let (s, both) = post("/detokenize", &json!({"tokens": many["tokens"]})).await;
    assert_eq!(s, 200, "{both}");
    assert_eq!(both["text"], json!([text, "a"]), "{both}");
    // A conversation goes through the chat template.
    let (s, chat) = post(
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 200, "{chat}");
    assert!(chat["count"].as_u64().unwrap() > 1, "{chat}");
    // Bad input names the field.
    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": []}),
            "messages",
        ),
        ("/detokenize", json!({"tokens": [1, 99999999]}), "tokens"),
        (
            "/detokenize",
            json!({"tokens": [[1], [99999999]]}),
            "tokens[1]",
        ),
    ] {
        let (s, e) = post(path, &body).await;
        assert_eq!(s, 400, "{path} {body}: {e}");
        assert_eq!(e["error"]["param"], param, "{path} {body}: {e}");
    }
    let (s, e) = post("/tokenize", &json!({"prompt": "a", "chat_template": "x"})).await;
    assert_eq!(s, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chat_template"),
        "an unimplemented field is named: {e}"
    );
}

async fn start_long_stream(rid: &str) -> reqwest::Response {
    common::long_stream(&server().base, rid).await
}

use common::read_rest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_request_ends_a_request_by_id_and_frees_its_pages() {
    let engine = &server().engine;
    let stream = start_long_stream("abort-me-stream").await;
    assert!(engine.load().pages_used > 0);
    // Another id aborts nothing.
    let (s, v) = post("/abort_request", &json!({"rid": "someone-else"})).await;
    assert_eq!((s, &v["aborted"]), (200, &json!(0)), "{v}");
    let t = Instant::now();
    let (s, v) = post("/abort_request", &json!({"rid": "abort-me-stream"})).await;
    assert_eq!((s, &v["aborted"]), (200, &json!(1)), "{v}");
    let rest = tokio::time::timeout(Duration::from_secs(10), read_rest(stream))
        .await
        .expect("the stream ends");
    let events = common::sse_data(&rest);
    let last: Value = events
        .iter()
        .rev()
        .find_map(|e| serde_json::from_str(e).ok())
        .expect("a JSON event");
    assert_eq!(last["error"]["code"], "aborted", "{rest}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("abort-me-stream"),
        "{last}"
    );
    // The engine let go of the request: its pages are back.
    let load = common::wait_idle().await;
    assert_eq!((load.running, load.pages_used), (0, 0), "{load:?}");
    // 8000 tokens take far longer than the abort (seconds on this model).
    assert!(t.elapsed() < Duration::from_secs(10));

    // A whole (non-streamed) request: the answer is the 499.
    let whole = tokio::spawn(async {
        let body = json!({"text": "count", "rid": "abort-me-whole",
                "sampling_params": {"max_new_tokens": 8000, "ignore_eos": true}});
        post("/generate", &body).await
    });
    let mut aborted = json!(0);
    for _ in 0..200 {
        let (_, v) = post("/abort_request", &json!({"rid": "abort-me-whole"})).await;
        aborted = v["aborted"].clone();
        if aborted == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(aborted, 1);
    let (s, v) = whole.await.expect("join");
    common::assert_error(s, &v, 499, "aborted", "abort-me-whole");
    let load = common::wait_idle().await;
    assert_eq!((load.running, load.pages_used), (0, 0), "{load:?}");

    // Malformed abort requests are 400s naming the field.
    for (body, param) in [
        (json!({}), "rid"),
        (json!({"rid": "a", "abort_all": true}), "abort_all"),
        (json!({"rid": ""}), "rid"),
    ] {
        let (s, v) = post("/abort_request", &body).await;
        assert_eq!(
            (s, &v["error"]["param"]),
            (400, &json!(param)),
            "{body}: {v}"
        );
    }
    let (s, v) = post("/abort_request", &json!({"rid": "a", "session": 1})).await;
    assert_eq!(s, 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_the_clients_rid_or_random_and_the_fingerprint_is_stable() {
    let body = |rid: Option<&str>| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        if let Some(r) = rid {
            b["rid"] = json!(r);
        }
        b
    };
    let (s, a) = post("/v1/chat/completions", &body(None)).await;
    assert_eq!(s, 200, "{a}");
    let (_, b) = post("/v1/chat/completions", &body(None)).await;
    let id = a["id"].as_str().expect("id");
    assert!(id.starts_with("chatcmpl-"), "{id}");
    // 96 random bits: 24 hex digits after the prefix.
    assert_eq!(id.len(), "chatcmpl-".len() + 24, "{id}");
    assert_ne!(a["id"], b["id"]);
    let fp = a["system_fingerprint"].as_str().expect("fingerprint");
    assert!(fp.starts_with("fp_") && fp.len() == 13, "{fp}");
    assert_eq!(a["system_fingerprint"], b["system_fingerprint"]);
    let (_, c) = post("/v1/chat/completions", &body(Some("my-own-id"))).await;
    assert_eq!(c["id"], "my-own-id", "{c}");
    let (_, d) = post(
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 1, "rid": "cmpl-mine"}),
    )
    .await;
    assert_eq!(
        (&d["id"], &d["system_fingerprint"]),
        (&json!("cmpl-mine"), &a["system_fingerprint"])
    );
    let (s, e) = post("/v1/chat/completions", &body(Some(&"x".repeat(300)))).await;
    assert_eq!((s, &e["error"]["param"]), (400, &json!("rid")), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_sglang_names_with_the_model_label() {
    let (s, _) = post(
        "/generate",
        &json!({"text": "metrics please", "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(s, 200);
    let (s, text) = get("/metrics").await;
    assert_eq!(s, 200);
    let value = |name: &str| -> f64 {
        let prefix = format!("{name}{{model_name=\"tiny-test\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
            .parse()
            .expect("a number")
    };
    // Tests in this file run concurrently: counters are at least this one's.
    assert!(value("sglang:generation_tokens_total") >= 3.0);
    assert!(value("sglang:prompt_tokens_total") >= 2.0);
    assert!(value("sglang:time_to_first_token_seconds_count") >= 1.0);
    assert!(value("sglang:e2e_request_latency_seconds_count") >= 1.0);
    let total = value("sglang:max_total_num_tokens");
    assert_eq!(total, (common::KV_PAGES * common::PAGE_SIZE) as f64);
    for gauge in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
    ] {
        assert!(value(gauge) >= 0.0, "{gauge}");
    }
    assert_eq!(text.matches("# EOF").count(), 1);
    // /get_load carries the totals a router sums.
    let (_, load) = get("/get_load").await;
    let load: Value = serde_json::from_str(&load).unwrap();
    assert_eq!(load[0]["model_name"], "tiny-test", "{load}");
    assert_eq!(
        load[0]["max_total_num_tokens"],
        common::KV_PAGES * common::PAGE_SIZE
    );
    assert!(
        load[0]["generation_tokens"].as_u64().unwrap() >= 3,
        "{load}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_tokens_past_the_stall_timeout_ends_stalled_and_leaves_the_queue() {
    // A pool that holds one long request: the second waits for pages and
    // gets no token while the first runs.
    let engine = common::start_engine_with(|c| c.kv_pages = 1100);
    let stall = Duration::from_millis(700);
    let state = handoff_server::AppState::new(engine.clone()).with_stall_timeout(Some(stall));
    let base = common::serve_state(state);
    let long = |rid: &str| {
        json!({"text": "count", "rid": rid, "stream": true,
               "sampling_params": {"max_new_tokens": 16000, "ignore_eos": true}})
    };
    let client = reqwest::Client::new();
    let send = |body: Value| {
        client
            .post(format!("{base}/generate"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let mut holder = send(long("holder")).await.expect("holder");
    holder
        .chunk()
        .await
        .expect("chunk")
        .expect("the holder runs");
    let t = Instant::now();
    let waiter = send(long("waiter")).await.expect("waiter");
    assert_eq!(waiter.status(), 200, "the stream opened");
    let text = tokio::time::timeout(Duration::from_secs(30), read_rest(waiter))
        .await
        .expect("the waiter's stream ends");
    let waited = t.elapsed();
    let events = common::sse_data(&text);
    assert_eq!(events.len(), 1, "no token, one error event: {text}");
    let e: Value = serde_json::from_str(&events[0]).expect("JSON");
    assert_eq!(
        (&e["error"]["type"], &e["error"]["code"]),
        (&json!("stalled"), &json!("stalled")),
        "{e}"
    );
    assert!(waited >= stall, "ended at {waited:?}, before the timeout");
    // The waiter left the queue (the engine drops a cancelled request at
    // its next step); the holder still holds its pages.
    for _ in 0..100 {
        if engine.load().waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(engine.load().waiting, 0, "{:?}", engine.load());
    assert!(engine.load().running >= 1);
    let (_, metrics) = {
        let r = reqwest::get(format!("{base}/metrics"))
            .await
            .expect("metrics");
        (r.status(), r.text().await.expect("body"))
    };
    assert!(
        metrics.contains("handoff_requests_stalled_total 1"),
        "{metrics}"
    );
    let aborted = client
        .post(format!("{base}/abort_request"))
        .header("content-type", "application/json")
        .body(json!({"rid": "holder"}).to_string())
        .send()
        .await
        .expect("abort");
    assert_eq!(aborted.status(), 200);
    drop(holder);
    for _ in 0..200 {
        let l = engine.load();
        if l.running == 0 && l.pages_used == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let l = engine.load();
    assert_eq!((l.running, l.waiting, l.pages_used), (0, 0, 0), "{l:?}");
}
