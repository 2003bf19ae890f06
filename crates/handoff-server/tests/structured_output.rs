//! Structured output over HTTP on the tiny test model (a seeded-random
//! model: left alone, its output is noise), so every well-formed answer
//! below is the grammar's doing: `response_format`, SGLang's `json_schema`,
//! `regex` and `ebnf`, vLLM's `guided_*`, whole and streamed, sampled at
//! temperature 1; and every bad spec is a 400 naming its field.

mod common;

use common::{assert_error, post, post_sse};
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny-test",
        "messages": [{"role": "user", "content": "answer"}],
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 3,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

async fn content(extra: Value) -> (String, String) {
    let (s, v) = post("/v1/chat/completions", &chat(extra.clone())).await;
    assert_eq!(s, 200, "{extra}: {v}");
    let c = &v["choices"][0];
    (
        c["message"]["content"].as_str().unwrap().to_string(),
        c["finish_reason"].as_str().unwrap().to_string(),
    )
}

/// Whether `text` is `prefix` followed by one or more of `repeated`.
fn is_repeat(text: &str, prefix: &str, repeated: &str) -> bool {
    text.strip_prefix(prefix)
        .is_some_and(|rest| !rest.is_empty() && rest.replace(repeated, "").is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_constraint_shapes_the_output() {
    // Unconstrained, the tiny model's sampled text is noise (the test of
    // the test: none of the shapes below happen by chance).
    let (free, _) = content(json!({})).await;
    assert!(serde_json::from_str::<Value>(&free).is_err(), "{free:?}");

    for seed in 0..5 {
        let (text, reason) = content(json!({"regex": "id-[0-9]{3}", "seed": seed})).await;
        assert!(
            text.len() == 6
                && text.starts_with("id-")
                && text[3..].bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
        assert_eq!(reason, "stop");
    }
    let (text, _) = content(json!({"guided_regex": "(ab)+", "max_tokens": 9})).await;
    assert!(is_repeat(&text, "", "ab"), "{text:?}");
    let (text, _) = content(json!({"guided_choice": ["yes", "no", "maybe"]})).await;
    assert!(["yes", "no", "maybe"].contains(&text.as_str()), "{text:?}");
    // GBNF (SGLang's `ebnf`): rules, a character class, repetition.
    let (text, reason) = content(json!({
        "ebnf": "root ::= \"n=\" digit digit? \";\"\ndigit ::= [0-9]"
    }))
    .await;
    assert!(
        text.starts_with("n=") && text.ends_with(';') && (4..=5).contains(&text.len()),
        "{text:?}"
    );
    assert_eq!(reason, "stop");
    // Lark (vLLM's `guided_grammar` through llguidance).
    let (text, _) = content(json!({"guided_grammar": "start: \"<\" /[a-c]{2}/ \">\""})).await;
    assert!(
        text.len() == 4 && text.starts_with('<') && text.ends_with('>'),
        "{text:?}"
    );

    let (text, reason) =
        content(json!({"response_format": {"type": "json_object"}, "max_tokens": 200})).await;
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v.is_object(), "{text:?}");
    assert_eq!(reason, "stop");

    let schema = json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
            "kind": {"enum": ["a", "b"]}
        },
        "required": ["ok", "n", "kind"],
        "additionalProperties": false
    });
    for seed in 0..4 {
        let (text, reason) = content(json!({
            "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": true}}
        }))
        .await;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["ok"].is_boolean(), "{text}");
        assert!((1..=9).contains(&v["n"].as_i64().unwrap()), "{text}");
        assert!(v["kind"] == "a" || v["kind"] == "b", "{text}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        assert_eq!(reason, "stop");
    }
    // The same schema, streamed: the deltas join into a valid instance.
    let mut body = chat(json!({"stream": true, "guided_json": schema}));
    body["seed"] = json!(11);
    let (s, events) = post_sse("/v1/chat/completions", &body).await;
    assert_eq!(s, 200);
    let mut text = String::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(d) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(d);
        }
    }
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert_eq!(v.as_object().unwrap().len(), 3, "{text}");

    // Completions and /generate read them too.
    let (s, v) = post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 20, "temperature": 1, "regex": "[xyz]{4}"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.len() == 4 && text.bytes().all(|b| b"xyz".contains(&b)),
        "{text:?}"
    );
    let (s, v) = post(
        "/generate",
        &json!({"text": "x", "sampling_params": {"max_new_tokens": 30, "temperature": 1,
            "json_schema": "{\"type\": \"array\", \"items\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 999}, \"minItems\": 2, \"maxItems\": 2}"}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let text = v["text"].as_str().unwrap();
    let arr: Vec<i64> = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert_eq!(arr.len(), 2);
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_spec_is_a_400_naming_its_field() {
    let cases = [
        (
            json!({"json_schema": {"type": "nonsense"}}),
            "json_schema",
            "Invalid type: nonsense",
        ),
        (json!({"regex": "(open"}), "regex", "unclosed group"),
        (
            json!({"ebnf": "root ::= \"open"}),
            "ebnf",
            "unterminated string",
        ),
        (
            json!({"ebnf": "start ::= \"a\""}),
            "ebnf",
            "needs a `root` rule",
        ),
        (
            json!({"guided_choice": "yes"}),
            "guided_choice",
            "must be a list of strings",
        ),
        (
            json!({"guided_choice": []}),
            "guided_choice",
            "at least one string",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
            "type `yaml` is not one of",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
            "needs a `json_schema` object",
        ),
        (
            json!({"regex": "a", "ebnf": "root ::= \"b\""}),
            "ebnf",
            "`ebnf` and `regex` both constrain the output",
        ),
    ];
    for (extra, param, part) in cases {
        let (s, v) = post("/v1/chat/completions", &chat(extra.clone())).await;
        assert_error(s, &v, 400, "invalid_request_error", part);
        assert_eq!(v["error"]["param"], param, "{extra}");
    }
    let (s, v) = post(
        "/generate",
        &json!({"text": "x", "sampling_params": {"json_schema": "{not json"}}),
    )
    .await;
    assert_error(s, &v, 400, "invalid_request_error", "is not valid JSON");
    assert_eq!(v["error"]["param"], "sampling_params.json_schema");
    // The server serves on.
    let (text, _) = content(json!({"regex": "ok"})).await;
    assert_eq!(text, "ok");
}
