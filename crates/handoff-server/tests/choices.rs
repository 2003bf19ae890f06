//! Several choices from one prompt over HTTP on the tiny test model: `n`
//! on chat, completions and `/generate`, `best_of` on completions, whole
//! and streamed; each choice samples on its own (choice `i` of a seeded
//! request is the single request with seed `seed + i`), greedy choices are
//! the greedy output, and the prompt is computed once (the other sequences
//! find its pages in the prefix cache).

mod common;

use common::{assert_error, get, post, post_sse};
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny-test",
        "messages": [{"role": "user", "content": "several answers"}],
        "max_tokens": 12,
        "ignore_eos": true,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn contents(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            c["message"]["content"].as_str().unwrap().to_string()
        })
        .collect()
}

/// `sglang:cached_tokens` on `/metrics`: prompt tokens that came from the
/// prefix cache, over every request so far.
async fn cached_tokens() -> u64 {
    let (_, text) = get("/metrics").await;
    text.lines()
        .find(|l| l.starts_with("sglang:cached_tokens_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no sglang:cached_tokens_total in\n{text}")) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_sample_on_their_own_and_share_the_prompt() {
    // Greedy: every choice is the greedy output.
    let (s, one) = post("/v1/chat/completions", &chat(json!({"temperature": 0}))).await;
    assert_eq!(s, 200, "{one}");
    let single = contents(&one).remove(0);
    let (s, four) = post(
        "/v1/chat/completions",
        &chat(json!({"temperature": 0, "n": 4})),
    )
    .await;
    assert_eq!(s, 200, "{four}");
    assert_eq!(contents(&four), vec![single.clone(); 4]);
    assert_eq!(four["usage"]["completion_tokens"], 48);
    assert_eq!(
        four["usage"]["prompt_tokens"],
        one["usage"]["prompt_tokens"]
    );

    // Seeded: choice i is the single request with seed 7 + i.
    let hot = |extra: Value| {
        let mut b = chat(json!({"temperature": 1.0}));
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let (s, three) = post("/v1/chat/completions", &hot(json!({"seed": 7, "n": 3}))).await;
    assert_eq!(s, 200, "{three}");
    let got = contents(&three);
    for (i, text) in got.iter().enumerate() {
        let (_, v) = post("/v1/chat/completions", &hot(json!({"seed": 7 + i}))).await;
        assert_eq!(text, &contents(&v)[0], "choice {i}");
    }
    assert!(got[0] != got[1] || got[1] != got[2], "{got:?}");

    // Streamed: chunks of every index, joining to the same texts.
    let (s, events) = post_sse(
        "/v1/chat/completions",
        &hot(json!({"seed": 7, "n": 3, "stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(s, 200);
    let mut texts = vec![String::new(); 3];
    let mut finishes = 0;
    let mut usage = Value::Null;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            let i = c["index"].as_u64().unwrap() as usize;
            texts[i].push_str(c["delta"]["content"].as_str().unwrap_or(""));
            finishes += usize::from(!c["finish_reason"].is_null());
        } else {
            usage = v["usage"].clone();
        }
    }
    assert_eq!(texts, got);
    assert_eq!(finishes, 3);
    assert_eq!(usage["completion_tokens"], 36);

    // The prompt is computed once: with a prompt no request sent before,
    // the three later sequences each find its full pages cached.
    let prompt: String = (0..40)
        .map(|i| char::from(b'a' + ((i * 7 + rand_byte()) % 26) as u8))
        .collect();
    let body =
        json!({"prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 1, "ignore_eos": true});
    let before = cached_tokens().await;
    let (s, v) = post("/v1/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let full_pages = prompt_tokens / common::PAGE_SIZE as u64 * common::PAGE_SIZE as u64;
    assert!(full_pages >= 32, "{prompt_tokens} prompt tokens");
    let after = cached_tokens().await;
    assert!(
        after - before >= 3 * full_pages,
        "cached tokens grew by {} (3 sequences × {full_pages} expected)",
        after - before
    );
}

fn rand_byte() -> usize {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as usize
        % 26
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_of_returns_the_likeliest_and_generate_lists_n() {
    let body = |extra: Value| {
        let mut b = json!({"prompt": "pick one", "max_tokens": 6, "temperature": 1.0, "ignore_eos": true, "logprobs": 0});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    // The three sequences best_of 3 runs, one by one.
    let mut runs = Vec::new();
    for i in 0..3 {
        let (s, v) = post("/v1/completions", &body(json!({"seed": 40 + i}))).await;
        assert_eq!(s, 200, "{v}");
        let c = &v["choices"][0];
        let total: f64 = c["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum();
        runs.push((total, c["text"].as_str().unwrap().to_string()));
    }
    runs.sort_by(|a, b| b.0.total_cmp(&a.0));
    let (s, v) = post(
        "/v1/completions",
        &body(json!({"seed": 40, "best_of": 3, "n": 2})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, vec![runs[0].1.as_str(), runs[1].1.as_str()]);

    let (s, v) = post(
        "/generate",
        &json!({"text": "x", "sampling_params": {"n": 2, "max_new_tokens": 3, "temperature": 0, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let list = v.as_array().expect("a list with n > 1");
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["index"], 0);
    assert_eq!(list[1]["index"], 1);
    assert_eq!(list[0]["output_ids"], list[1]["output_ids"]);

    for (path, extra, param, part) in [
        (
            "/v1/completions",
            json!({"best_of": 1, "n": 2}),
            "best_of",
            "best_of (1) must be at least n (2)",
        ),
        (
            "/v1/completions",
            json!({"best_of": 2, "stream": true}),
            "best_of",
            "cannot be streamed",
        ),
        (
            "/v1/completions",
            json!({"n": 17}),
            "n",
            "n must be between 1 and 16",
        ),
        (
            "/v1/completions",
            json!({"n": 0}),
            "n",
            "n must be between 1 and 16, got 0",
        ),
    ] {
        let (s, v) = post(path, &body(extra.clone())).await;
        assert_error(s, &v, 400, "invalid_value", part);
        assert_eq!(v["error"]["param"], param, "{extra}");
    }
    let (s, v) = post(
        "/generate",
        &json!({"text": "x", "stream": true, "sampling_params": {"n": 2}}),
    )
    .await;
    assert_error(s, &v, 400, "invalid_value", "answered whole on /generate");

    // Several prompts: each answered by its own n choices, in order, each
    // equal to that prompt sent alone.
    let (s, v) = post(
        "/v1/completions",
        &json!({"prompt": ["first prompt", "second one", "third"], "n": 2, "max_tokens": 5,
                "temperature": 0, "ignore_eos": true, "echo": true}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    let mut prompt_tokens = 0;
    for (p, prompt) in ["first prompt", "second one", "third"].iter().enumerate() {
        let (_, alone) = post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "echo": true}),
        )
        .await;
        prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
        for j in 0..2 {
            let c = &choices[p * 2 + j];
            assert_eq!(c["index"], p * 2 + j);
            assert_eq!(
                c["text"], alone["choices"][0]["text"],
                "prompt {p} choice {j}"
            );
            assert!(c["text"].as_str().unwrap().starts_with(prompt));
        }
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 30);

    // A /generate batch: one object per prompt (and per choice), in order.
    let (s, v) = post(
        "/generate",
        &json!({"text": ["first prompt", "third"], "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 0, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let list = v.as_array().expect("a batch answers a list");
    assert_eq!(list.len(), 4);
    for (p, prompt) in ["first prompt", "third"].iter().enumerate() {
        let (_, alone) = post(
            "/generate",
            &json!({"text": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
        for j in 0..2 {
            assert_eq!(
                list[p * 2 + j]["output_ids"],
                alone["output_ids"],
                "prompt {p}"
            );
            assert_eq!(list[p * 2 + j]["index"], p * 2 + j);
        }
    }
    let (s, v) = post(
        "/generate",
        &json!({"input_ids": [[5, 6], [7]], "stream": true}),
    )
    .await;
    assert_error(s, &v, 400, "invalid_value", "answered whole on /generate");
    assert_eq!(v["error"]["param"], "input_ids");
}
