//! Tool calling over HTTP on the tiny test model (seeded-random weights:
//! left alone its output is noise, so every well-formed call below is the
//! grammar's doing): `tool_choice` named and `required` give calls whose
//! arguments follow the function's schema, whole and streamed, at
//! temperature 1; `parallel_tool_calls` decides whether several come; past
//! calls and tools' answers are accepted in `messages`; bad tools and
//! messages are 400s naming the field.

mod common;

use common::{assert_error, post, post_sse};
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": false
        }
    }})
}

fn clock() -> Value {
    json!({"type": "function", "function": {"name": "now"}})
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny-test",
        "messages": [{"role": "user", "content": "what is the weather?"}],
        "max_tokens": 400,
        "temperature": 1.0,
        "tools": [weather(), clock()],
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// Why `args` are not valid `get_weather` arguments, if they are not.
fn weather_violation(args: &str) -> Option<String> {
    let v: Value = match serde_json::from_str(args) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON: {e}")),
    };
    let o = v.as_object()?;
    let ok = o.len() == 3
        && o["city"].as_str().is_some_and(|c| c.chars().count() <= 12)
        && o["days"].as_u64().is_some_and(|d| (1..=7).contains(&d))
        && (o["unit"] == "celsius" || o["unit"] == "fahrenheit");
    (!ok).then(|| format!("{v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_function_is_called_with_arguments_that_validate() {
    let mut args_seen = Vec::new();
    for seed in 0..8 {
        let (s, v) = post(
            "/v1/chat/completions",
            &chat(json!({"seed": seed, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        assert_eq!(c["message"]["content"], Value::Null, "{c}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{c}");
        assert_eq!(calls[0]["type"], "function");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args = calls[0]["function"]["arguments"].as_str().unwrap();
        if let Some(why) = weather_violation(args) {
            panic!("seed {seed}: arguments {args} do not validate: {why}");
        }
        args_seen.push(args.to_string());
    }
    args_seen.sort();
    args_seen.dedup();
    assert!(args_seen.len() >= 4, "temperature 1 samples: {args_seen:?}");

    // `required`: a call to one of the tools.
    let (s, v) = post(
        "/v1/chat/completions",
        &chat(json!({"seed": 3, "tool_choice": "required", "parallel_tool_calls": false})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    let name = calls[0]["function"]["name"].as_str().unwrap();
    let args = calls[0]["function"]["arguments"].as_str().unwrap();
    match name {
        "now" => assert_eq!(args, "{}"),
        "get_weather" => assert_eq!(weather_violation(args), None, "{args}"),
        other => panic!("{other}"),
    }

    // Streamed: the call comes whole in a `tool_calls` delta.
    let (s, events) = post_sse(
        "/v1/chat/completions",
        &chat(json!({"seed": 5, "stream": true, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})),
    )
    .await;
    assert_eq!(s, 200);
    let mut calls = Vec::new();
    let mut finish = Value::Null;
    let mut content = String::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        if let Some(tc) = c["delta"]["tool_calls"].as_array() {
            calls.extend(tc.iter().cloned());
        }
        if let Some(t) = c["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "tool_calls");
    assert_eq!(content, "", "no call text leaks into content");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args = calls[0]["function"]["arguments"].as_str().unwrap();
    assert_eq!(weather_violation(args), None, "{args}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_tool_calls_decides_how_many_calls_come() {
    let count = |v: &Value| {
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .map_or(0, Vec::len)
    };
    let mut most = 0;
    for seed in 0..8 {
        let body = chat(json!({"seed": seed, "tool_choice": "required", "max_tokens": 800}));
        let (s, v) = post("/v1/chat/completions", &body).await;
        assert_eq!(s, 200, "{v}");
        most = most.max(count(&v));
        let mut one = body.clone();
        one["parallel_tool_calls"] = json!(false);
        let (s, v) = post("/v1/chat/completions", &one).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(count(&v), 1, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }
    assert!(most >= 2, "parallel calls never came: at most {most}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_calls_are_accepted_and_bad_tools_are_named() {
    // A conversation with a call and its answer; `tool_choice: none` shows
    // no tools and parses no call.
    let history = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1, \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
    ]);
    for choice in ["auto", "none"] {
        let (s, v) = post(
            "/v1/chat/completions",
            &chat(json!({"messages": history, "tool_choice": choice, "max_tokens": 4, "seed": 1})),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 40);
    }
    // The tools and the call are in the prompt: fewer tokens without them.
    let (_, with) = post(
        "/v1/chat/completions",
        &chat(json!({"messages": history, "max_tokens": 1})),
    )
    .await;
    let (_, without) = post(
        "/v1/chat/completions",
        &chat(json!({"messages": history, "max_tokens": 1, "tool_choice": "none"})),
    )
    .await;
    assert!(
        with["usage"]["prompt_tokens"].as_u64() > without["usage"]["prompt_tokens"].as_u64(),
        "{with} {without}"
    );

    let cases = [
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "later"}}}),
            "tool_choice",
            "`later`, which is not among tools",
        ),
        (
            json!({"tool_choice": "always"}),
            "tool_choice",
            "tool_choice `always`",
        ),
        (
            json!({"tools": [{"type": "code"}]}),
            "tools[0].type",
            "only `function` tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
            "must be 1 to 64 letters",
        ),
        (
            json!({"tools": [weather(), weather()]}),
            "tools[1].function.name",
            "two tools are named `get_weather`",
        ),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
            "cannot be combined",
        ),
        (
            json!({"tools": [], "tool_choice": "required"}),
            "tool_choice",
            "no tools are given",
        ),
        (
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content",
            "messages[0] (user) has no content",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls",
            "only assistant messages call tools",
        ),
        (
            json!({"parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
            "must be a boolean",
        ),
    ];
    for (extra, param, part) in cases {
        let (s, v) = post("/v1/chat/completions", &chat(extra.clone())).await;
        assert_error(s, &v, 400, "invalid_value", part);
        assert_eq!(v["error"]["param"], param, "{extra}");
    }
}
