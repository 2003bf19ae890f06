//! Every request body decoder of the worker API over arbitrary JSON (issue
//! 14 item 7: the HTTP bodies): objects built from the real field names and
//! values of every type, sent to a live worker on the tiny model. Each answer
//! is a 200 or a 4xx with an OpenAI-style JSON error that names what is
//! wrong; never a 5xx, never a dropped connection; and the worker keeps
//! serving. A property test, not a coverage-guided one: the decoders are
//! serde structs and the checks after them.

mod common;

use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Field names of the request shapes, real and not.
const KEYS: &[&str] = &[
    "messages",
    "role",
    "content",
    "prompt",
    "text",
    "input_ids",
    "model",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "min_new_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "sampling_params",
    "stream_options",
    "include_usage",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_sig",
    "bootstrap_ts",
    "response_format",
    "tools",
    "tool_choice",
    "return_logprob",
    "tokens",
    "add_special_tokens",
    "abort_all",
    "x",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-3i64..40).prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z<|> ]{0,12}".prop_map(Value::from),
        Just(json!("user")),
        Just(json!("hello")),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..5).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// A valid body of `path`, with up to three fields set to arbitrary values
/// (at the top level or, for `/generate`, in `sampling_params`), or a body
/// of arbitrary fields altogether.
fn body(path: &'static str) -> impl Strategy<Value = Map<String, Value>> {
    let valid = match path {
        "/generate" => json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}}),
        "/v1/completions" => json!({"prompt": "hello", "max_tokens": 2}),
        "/v1/chat/completions" => {
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        }
        "/tokenize" => json!({"prompt": "hello"}),
        "/detokenize" => json!({"tokens": [1, 2]}),
        _ => json!({"rid": "nobody"}),
    };
    let edits = prop::collection::vec((any::<bool>(), prop::sample::select(KEYS), value()), 0..4);
    let arbitrary = prop::collection::vec((prop::sample::select(KEYS), value()), 0..8)
        .prop_map(|kv| kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
    prop_oneof![
        4 => edits.prop_map(move |edits| {
            let mut b = valid.as_object().cloned().unwrap_or_default();
            for (nested, k, v) in edits {
                match b.get_mut("sampling_params") {
                    Some(Value::Object(sp)) if nested => {
                        sp.insert(k.to_string(), v);
                    }
                    _ => {
                        b.insert(k.to_string(), v);
                    }
                }
            }
            b
        }),
        1 => arbitrary,
    ]
}

/// Keep a generation short whatever the body asks for: token limits that
/// parse as large integers become small ones (the rest stays arbitrary).
fn bounded(mut b: Map<String, Value>) -> Value {
    for k in [
        "max_tokens",
        "max_completion_tokens",
        "max_new_tokens",
        "min_tokens",
        "min_new_tokens",
    ] {
        if b.get(k).and_then(Value::as_i64).is_some_and(|n| n > 4) {
            b.insert(k.into(), json!(4));
        }
    }
    if let Some(Value::Object(sp)) = b.get_mut("sampling_params") {
        for k in ["max_new_tokens", "min_new_tokens"] {
            if sp.get(k).and_then(Value::as_i64).is_some_and(|n| n > 4) {
                sp.insert(k.into(), json!(4));
            }
        }
    }
    Value::Object(b)
}

const PATHS: &[&str] = &[
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/abort_request",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bodies_get_a_200_or_a_4xx_that_says_why(
        (path, b) in prop::sample::select(PATHS).prop_flat_map(|p| (Just(p), body(p))),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let body = bounded(b);
        let (status, text) = rt.block_on(common::post_raw(path, &body.to_string()));
        prop_assert!(status == 200 || (400..500).contains(&status), "{path} {body}: {status} {text}");
        if status != 200 {
            let e: Value = serde_json::from_str(&text)
                .map_err(|e| TestCaseError::fail(format!("{path} {body}: not JSON ({e}): {text}")))?;
            let msg = e["error"]["message"].as_str().unwrap_or("");
            prop_assert!(!msg.is_empty(), "{path} {body}: {text}");
            prop_assert!(e["error"]["code"].is_string(), "{path} {body}: {text}");
        }
        // The worker keeps serving.
        let (s, _) = rt.block_on(common::get("/health"));
        prop_assert_eq!(s, 200);
    }
}
