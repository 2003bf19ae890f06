//! Every endpoint over real HTTP against a real engine on the tiny test model:
//! shapes, streaming, and every bad-input case with status, type and message.

mod common;

use common::{assert_error, get, post, post_raw, post_sse, server};
use serde_json::{json, Value};

fn chat_body(content: &str, max_tokens: u64) -> Value {
    json!({
        "model": "tiny-test",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_endpoints() {
    let (s, body) = get("/health").await;
    assert_eq!((s, body.as_str()), (200, ""));
    let (s, _) = get("/health_generate").await;
    assert_eq!(s, 200);

    let (s, body) = get("/v1/models").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny-test");
    assert_eq!(v["data"][0]["object"], "model");

    let (s, body) = get("/server_info").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["served_model_name"], "tiny-test");
    assert!(v["model_path"].as_str().unwrap().ends_with("tiny.gguf"));
    assert_eq!(v["page_size"], common::PAGE_SIZE);
    assert_eq!(v["kv_pages_total"], common::KV_PAGES);
    assert!(v["context_length"].as_u64().unwrap() > 0);

    let (s, body) = get("/get_model_info").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["is_generation"], true);
    assert!(v["model_path"].as_str().unwrap().ends_with("tiny.gguf"));
    // A repeated prompt reuses its cached pages, and says so in both APIs.
    let long = "the prefix cache keeps whole pages of this prompt ".repeat(4);
    let body = chat_body(&long, 2);
    let (s, first) = post("/v1/chat/completions", &body).await;
    assert_eq!(s, 200, "{first}");
    let (_, again) = post("/v1/chat/completions", &body).await;
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > 0 && cached < prompt,
        "{cached} of {prompt}: {again}"
    );
    assert_eq!(cached % common::PAGE_SIZE as u64, 0, "whole pages");
    assert_eq!(
        again["choices"][0]["message"],
        first["choices"][0]["message"]
    );
    let gen_body =
        json!({"text": long, "sampling_params": {"max_new_tokens": 2, "temperature": 0}});
    let (_, gen) = post("/generate", &gen_body).await;
    let (_, gen_again) = post("/generate", &gen_body).await;
    assert_eq!(gen_again["output_ids"], gen["output_ids"]);
    assert!(
        gen_again["meta_info"]["cached_tokens"].as_u64().unwrap() > 0,
        "{gen_again}"
    );
    common::wait_idle().await;
    let (s, text) = post_raw("/flush_cache", "").await;
    assert_eq!(s, 200);
    assert!(
        text.starts_with("Cache flushed: ") && text.contains(" KV pages freed"),
        "{text}"
    );
    assert_ne!(text, "Cache flushed: 0 KV pages freed.\n", "{text}");

    let (s, body) = get("/get_load").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    let ranks = v.as_array().expect("array");
    assert_eq!(ranks.len(), 1);
    for key in ["dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"] {
        assert!(ranks[0][key].is_u64(), "{key} in {v}");
    }

    // One request so that latency histograms and counters move.
    let (s, _) = post("/v1/chat/completions", &chat_body("metrics", 3)).await;
    assert_eq!(s, 200);
    let (s, text) = get("/metrics").await;
    assert_eq!(s, 200);
    for needle in [
        "handoff_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}",
        "handoff_time_to_first_token_seconds_count",
        "handoff_inter_token_latency_seconds_count",
        "handoff_e2e_request_latency_seconds_count",
        "handoff_generation_tokens_total",
        "handoff_prompt_tokens_total",
        "handoff_num_requests_running",
        "handoff_num_requests_waiting",
        "handoff_kv_pages_free",
        "handoff_kv_pages_used",
    ] {
        assert!(text.contains(needle), "/metrics lacks {needle}:\n{text}");
    }

    let (s, body) = get("/nope").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_error(s, &v, 404, "not_found", "no route for GET /nope");
    let (s, body) = get("/generate").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_error(
        s,
        &v,
        405,
        "method_not_allowed",
        "GET is not allowed on /generate",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_whole_and_streamed_agree() {
    let (s, whole) = post("/v1/chat/completions", &chat_body("Hello there", 6)).await;
    assert_eq!(s, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(whole["model"], "tiny-test");
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let usage = &whole["usage"];
    assert_eq!(usage["completion_tokens"], 6);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + 6
    );
    let content = choice["message"]["content"].as_str().unwrap().to_string();

    let mut body = chat_body("Hello there", 6);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (s, events) = post_sse("/v1/chat/completions", &body).await;
    assert_eq!(s, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk is JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut streamed = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
    }
    assert_eq!(streamed, content, "streamed text equals the whole answer");
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    // The same usage, except that the second request may have found the
    // first's prompt pages in the prefix cache (unless another test flushed
    // it in between; `info_endpoints` checks the hit).
    let mut streamed_usage = chunks[n - 1]["usage"].clone();
    streamed_usage["prompt_tokens_details"]["cached_tokens"].take();
    let mut whole_usage = usage.clone();
    whole_usage["prompt_tokens_details"]["cached_tokens"].take();
    assert_eq!(streamed_usage, whole_usage);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs() {
    let mut body = chat_body("logprobs please", 4);
    body["logprobs"] = json!(true);
    let (s, v) = post("/v1/chat/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 4);
    for t in lp {
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert!(t["bytes"].is_array());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_whole_and_streamed_agree() {
    let body = json!({"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "ignore_eos": true});
    let (s, whole) = post("/v1/completions", &body).await;
    assert_eq!(s, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 5);
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, events) = post_sse("/v1/completions", &sbody).await;
    assert_eq!(s, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut streamed = String::new();
    let mut finish = Value::Null;
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        assert!(c.get("usage").is_none(), "no usage without include_usage");
        streamed.push_str(c["choices"][0]["text"].as_str().unwrap());
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(streamed, text);
    assert_eq!(finish, "length");

    // Token-id prompts give the same answer as the text they encode.
    let ids = server()
        .engine
        .tokenizer()
        .encode("The quick brown fox", true)
        .unwrap();
    let mut ibody = body.clone();
    ibody["prompt"] = json!(ids);
    let (s, v) = post("/v1/completions", &ibody).await;
    assert_eq!(s, 200);
    assert_eq!(v["choices"][0]["text"], text.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_ends_the_answer() {
    let body =
        json!({"prompt": "Stop here", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (_, v) = post("/v1/completions", &body).await;
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    // Pick a stop string from the middle of the greedy answer.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "greedy answer too short to cut: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut sbody = body.clone();
    sbody["stop"] = json!([stop]);
    let (s, v) = post("/v1/completions", &sbody).await;
    assert_eq!(s, 200, "{v}");
    let cut = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let expected = &text[..text.find(&stop).unwrap()];
    assert_eq!(cut, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_whole_streamed_and_ids() {
    let body = json!({
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": true},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 9223372036854775807u64,
    });
    let (s, whole) = post("/generate", &body).await;
    assert_eq!(s, 200, "{whole}");
    let ids = whole["output_ids"].as_array().unwrap().clone();
    assert_eq!(ids.len(), 5);
    let meta = &whole["meta_info"];
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "length", "length": 5})
    );
    assert_eq!(meta["completion_tokens"], 5);
    assert!(meta["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(meta["e2e_latency"].as_f64().unwrap() > 0.0);
    assert!(meta["id"].is_string());

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, events) = post_sse("/generate", &sbody).await;
    assert_eq!(s, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["text"], whole["text"]);
    assert_eq!(last["output_ids"], whole["output_ids"]);
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    // Cumulative: each object extends the previous one.
    let mut prev = 0;
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let n = c["output_ids"].as_array().unwrap().len();
        assert!(n >= prev);
        prev = n;
    }

    let ibody = json!({
        "input_ids": server().engine.tokenizer().encode("Once upon a time", true).unwrap(),
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": true},
        "return_logprob": true,
    });
    let (s, v) = post("/generate", &ibody).await;
    assert_eq!(s, 200);
    assert_eq!(v["output_ids"], whole["output_ids"]);
    assert_eq!(v["text"], whole["text"]);
    let lps = v["meta_info"]["output_token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), 5);
    for (lp, id) in lps.iter().zip(ids.iter()) {
        assert!(lp[0].as_f64().unwrap() <= 0.0);
        assert_eq!(&lp[1], id);
        assert_eq!(lp[2], Value::Null);
    }

    // `return_text_in_logprobs`: each entry spells its token, whole and
    // streamed, output and prompt, chosen and alternatives alike; the
    // texts join into the output's text.
    let mut tbody = ibody.clone();
    tbody["return_text_in_logprobs"] = json!(true);
    tbody["top_logprobs_num"] = json!(2);
    tbody["logprob_start_len"] = json!(0);
    let (s, v) = post("/generate", &tbody).await;
    assert_eq!(s, 200, "{v}");
    let meta = &v["meta_info"];
    let spelled: String = meta["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[2].as_str().unwrap().to_string())
        .collect();
    assert_eq!(spelled, v["text"].as_str().unwrap());
    assert!(meta["output_top_logprobs"][0][1][2].is_string(), "{meta}");
    assert_eq!(meta["input_token_logprobs"][1][2], "n", "{meta}");
    tbody["stream"] = json!(true);
    let (s, events) = post_sse("/generate", &tbody).await;
    assert_eq!(s, 200);
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        last["meta_info"]["output_token_logprobs"], meta["output_token_logprobs"],
        "streamed equals whole"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_is_reproducible() {
    let body = json!({
        "text": "Random",
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 42, "ignore_eos": true},
    });
    let ids = |status: u16, v: &Value| -> Vec<u64> {
        assert_eq!(status, 200, "{v}");
        let ids: Vec<u64> = v["output_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no output_ids in {v}"))
            .iter()
            .map(|i| i.as_u64().expect("token id"))
            .collect();
        assert_eq!(ids.len(), 8, "{v}");
        ids
    };
    let (s, a) = post("/generate", &body).await;
    let a = ids(s, &a);
    let (s, b) = post("/generate", &body).await;
    assert_eq!(a, ids(s, &b), "the same seed, the same tokens");
    let mut body2 = body.clone();
    body2["sampling_params"]["seed"] = json!(null);
    body2["sampling_params"]["sampling_seed"] = json!(42);
    let (s, c) = post("/generate", &body2).await;
    assert_eq!(a, ids(s, &c), "sampling_seed is an alias of seed");
    // Other seeds draw other tokens (8 tokens from the top 20 at
    // temperature 1: five seeds all agreeing with seed 42 would mean the
    // seed is ignored).
    let mut differ = 0;
    for seed in 43..48 {
        let mut other = body.clone();
        other["sampling_params"]["seed"] = json!(seed);
        let (s, o) = post("/generate", &other).await;
        differ += usize::from(ids(s, &o) != a);
    }
    assert!(
        differ >= 4,
        "only {differ} of 5 other seeds changed the output"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_400_with_an_actionable_message() {
    let (s, t) = post_raw("/v1/chat/completions", "{\"messages\": [").await;
    let v: Value = serde_json::from_str(&t).expect("error body is JSON");
    assert_error(s, &v, 400, "invalid_json", "not valid JSON");

    let (s, t) = post_raw("/generate", "").await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_error(s, &v, 400, "invalid_json", "request body is empty");

    let mut b = chat_body("hi", 4);
    b["max_tokens"] = json!("ten");
    let (s, v) = post("/v1/chat/completions", &b).await;
    assert_error(s, &v, 400, "invalid_type", "invalid value for `max_tokens`");
    assert_eq!(v["error"]["param"], "max_tokens");

    let (s, v) = post("/v1/chat/completions", &json!({"messages": "hi"})).await;
    assert_error(s, &v, 400, "invalid_type", "`messages`");

    let (s, v) = post("/v1/chat/completions", &json!({"max_tokens": 3})).await;
    assert_error(s, &v, 400, "invalid_type", "missing field `messages`");

    b["max_tokens"] = json!(-5);
    let (s, v) = post("/v1/chat/completions", &b).await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        "max_tokens must be at least 1, got -5",
    );

    b["max_tokens"] = json!(1_000_000_000u64);
    let (s, v) = post("/v1/chat/completions", &b).await;
    assert_error(
        s,
        &v,
        400,
        "context_length_exceeded",
        "exceeds the context length",
    );
    // An engine refusal names the field at fault, as each endpoint spells it.
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    let (s, v) = post(
        "/generate",
        &json!({"text": "hi", "sampling_params": {"max_new_tokens": 1_000_000_000u64}}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "sampling_params.max_new_tokens", "{v}");

    let mut b = chat_body("hi", 4);
    b.as_object_mut().unwrap().remove("max_tokens");
    b["max_completion_tokens"] = json!(0);
    let (s, v) = post("/v1/chat/completions", &b).await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        "max_completion_tokens must be at least 1, got 0",
    );

    let ctx = server().engine.model().context_length;
    let long = json!({"prompt": vec![5u32; ctx + 1], "max_tokens": 1});
    let (s, v) = post("/v1/completions", &long).await;
    assert_error(
        s,
        &v,
        400,
        "context_length_exceeded",
        &format!("context length of {ctx} tokens"),
    );
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let mut long_stream = long.clone();
    long_stream["stream"] = json!(true);
    let (s, v) = post("/v1/completions", &long_stream).await;
    assert_error(
        s,
        &v,
        400,
        "context_length_exceeded",
        "exceeds the context length",
    );

    let (s, v) = post("/v1/chat/completions", &json!({"messages": []})).await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        "messages must contain at least one message",
    );

    let (s, v) = post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "wizard", "content": "x"}]}),
    )
    .await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        "messages[0] has unknown role `wizard`: expected one of system, developer, user, assistant",
    );

    let mut b = chat_body("hi", 4);
    b["n"] = json!(17);
    let (s, v) = post("/v1/chat/completions", &b).await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        "n must be between 1 and 16, got 17",
    );

    let mut b = chat_body("hi", 4);
    b["temperature"] = json!(-1);
    let (s, v) = post("/v1/chat/completions", &b).await;
    assert_error(s, &v, 400, "invalid_value", "temperature must be between 0");

    let (s, v) = post("/v1/completions", &json!({"prompt": "", "max_tokens": 3})).await;
    assert_error(s, &v, 400, "empty_prompt", "the prompt is empty");

    // (`[]` reads as an empty token list: "the prompt is empty".)
    let many: Vec<String> = (0..17).map(|i| format!("p{i}")).collect();
    let (s, v) = post("/v1/completions", &json!({"prompt": many})).await;
    assert_error(s, &v, 400, "invalid_value", "prompt holds 17 prompts");

    let vocab = server().engine.tokenizer().vocab_size();
    let (s, v) = post("/generate", &json!({"input_ids": [1, vocab]})).await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        &format!("input_ids[1] = {vocab} is out of range"),
    );

    let (s, v) = post(
        "/generate",
        &json!({"sampling_params": {"max_new_tokens": 2}}),
    )
    .await;
    assert_error(s, &v, 400, "invalid_value", "`text` or `input_ids`");

    let (s, v) = post(
        "/generate",
        &json!({"text": "x", "sampling_params": {"max_new_tokens": -1}}),
    )
    .await;
    assert_error(
        s,
        &v,
        400,
        "invalid_value",
        "max_new_tokens must be at least 1, got -1",
    );

    for (field, value) in [
        ("bootstrap_room", json!(-1)),
        ("bootstrap_room", json!(1.5)),
        ("bootstrap_room", json!("12")),
        ("bootstrap_room", json!(9223372036854775808u64)),
        ("bootstrap_port", json!(70000)),
    ] {
        let mut b = json!({"text": "x", "sampling_params": {"max_new_tokens": 1}});
        b[field] = value.clone();
        let (s, v) = post("/generate", &b).await;
        assert_error(
            s,
            &v,
            400,
            "invalid_value",
            &format!("{field} must be an integer between 0 and"),
        );
        assert_eq!(v["error"]["param"], field, "{value}");
    }

    // The server keeps serving after all of that.
    let (s, _) = post("/v1/chat/completions", &chat_body("still there?", 2)).await;
    assert_eq!(s, 200);
    let (_, text) = get("/metrics").await;
    assert!(
        text.contains(
            "handoff_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"}"
        ),
        "{text}"
    );
    assert!(
        text.contains("error_type=\"context_length_exceeded\""),
        "{text}"
    );
}

/// Alternatives per position: 0 to 20, only with logprobs on; anything
/// else is a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_logprobs_limits_are_named() {
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (path, body, param, says) in [
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
            "between 0 and 20",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            "top_logprobs",
            "needs logprobs: true",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2, "logprobs": -1}),
            "logprobs",
            "between 0 and 20",
        ),
        (
            "/generate",
            json!({"text": "hi", "top_logprobs_num": 2}),
            "top_logprobs_num",
            "needs return_logprob: true",
        ),
        (
            "/generate",
            json!({"text": "hi", "return_logprob": true, "top_logprobs_num": 50}),
            "top_logprobs_num",
            "between 0 and 20",
        ),
    ] {
        let (s, v) = post(path, &body).await;
        assert_eq!(s, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{msg}");
    }
    // Streamed chat: each chunk carries its token's alternatives.
    let (s, text) = common::post_raw(
        "/v1/chat/completions",
        &chat(json!({"logprobs": true, "top_logprobs": 4, "stream": true, "max_tokens": 3, "temperature": 0}))
            .to_string(),
    )
    .await;
    assert_eq!(s, 200, "{text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .filter(|v: &Value| !v["choices"][0]["logprobs"].is_null())
        .collect();
    assert_eq!(chunks.len(), 3, "{text}");
    for c in &chunks {
        let entry = &c["choices"][0]["logprobs"]["content"][0];
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 4, "{c}");
        assert_eq!(
            top[0]["logprob"], entry["logprob"],
            "greedy picks the likeliest"
        );
    }
}

/// `echo` returns the prompt ahead of the completion; with `logprobs` each
/// prompt token after the first is scored (the first has a null logprob),
/// and SGLang's `logprob_start_len` gives the same numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo_scores_the_prompt() {
    let ids: Vec<u32> = (0..12).map(|i| 70 + i * 3).collect();
    let (s, plain) = post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{plain}");
    let (s, v) = post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 1}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().unwrap();
    let completion = plain["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.ends_with(completion) && text.len() > completion.len(),
        "{v}"
    );
    let lp = &choice["logprobs"];
    let n = ids.len() + 2;
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), n, "{key}: {lp}");
    }
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    for i in 1..n {
        let x = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(x <= 0.0, "{lp}");
        assert_eq!(lp["top_logprobs"][i].as_object().unwrap().len(), 1, "{lp}");
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    // The same prompt through /generate from position 0.
    let (s, g) = post(
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                "return_logprob": true, "logprob_start_len": 0}),
    )
    .await;
    assert_eq!(s, 200, "{g}");
    let input = g["meta_info"]["input_token_logprobs"].as_array().unwrap();
    assert_eq!(input.len(), ids.len());
    assert!(input[0][0].is_null());
    for (i, e) in input.iter().enumerate().skip(1) {
        assert_eq!(e[1], json!(ids[i]));
        assert_eq!(e[0], lp["token_logprobs"][i], "position {i}");
    }
    // Refusals name the field.
    for (body, says) in [
        (
            json!({"input_ids": ids, "logprob_start_len": 0}),
            "needs return_logprob",
        ),
        (
            json!({"input_ids": ids, "return_logprob": true, "logprob_start_len": 12}),
            "a prompt position (0 to 11)",
        ),
    ] {
        let (s, e) = post("/generate", &body).await;
        assert_eq!(s, 400, "{e}");
        assert_eq!(e["error"]["param"], "logprob_start_len");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(says),
            "{e}"
        );
    }
}
