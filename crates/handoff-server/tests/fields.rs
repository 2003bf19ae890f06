//! The rule of the front door: every request field a spec defines is either
//! honoured or refused with a 400 naming it, never silently ignored.
//!
//! The walk below sends every field of OpenAI's chat and completions
//! request schemas and of SGLang's `/generate` body and `sampling_params`,
//! each with a value that asks for something, to a real engine (the tiny
//! model), and checks what comes back: a 400 whose `param` names the field,
//! or a 200 whose output differs from the same request without the field
//! (or carries the part of the answer the field asks for). Bookkeeping
//! fields (`user`, `metadata`, ...) must change nothing. Fields whose effect
//! is the transport of the answer (`stream`) name the test that shows it.

mod common;

use common::post;
use serde_json::{json, Value};

/// What a field must do.
enum Expect {
    /// A 400 whose `param` names the field.
    Refused,
    /// A 200 whose generated output differs from the request without it.
    Changes,
    /// A 200 whose answer has a non-null value at this JSON pointer, absent
    /// (null) without the field.
    Adds(&'static str),
    /// A 200 with the same output: it changes nothing a client gets back.
    NoEffect,
    /// Its effect is the answer's transport or shape, shown by this test.
    ShownBy(&'static str),
}

/// One field of the walk.
struct Row {
    field: &'static str,
    /// The field's value, from the baseline answer's text when it needs one.
    value: fn(&str) -> Value,
    /// Fields set on both sides of the comparison (the context the field's
    /// effect needs, e.g. a temperature for `seed`).
    base: Value,
    expect: Expect,
}

fn row(field: &'static str, value: fn(&str) -> Value, base: Value, expect: Expect) -> Row {
    Row {
        field,
        value,
        base,
        expect,
    }
}

/// The tiny model's byte tokens: byte `b` is token `3 + b`.
const Q: &str = "116";
/// The tiny model's `<|im_end|>`, an end-of-generation token.
const IM_END: &str = "2";

/// Rows shared by every endpoint's sampling fields (OpenAI's names; SGLang's
/// `sampling_params` spells the same controls the same way).
/// Four tokens far above the rest: 16 tokens drawn from them repeat some,
/// so a penalty on repeats changes which comes next.
fn few() -> Value {
    json!({"logit_bias": {"100": 50, "101": 50, "102": 50, "103": 50}})
}

/// `presence_penalty` of `value` over [`few`] tokens. Which sign shows the
/// effect depends on the prompt: a penalty of 2 changes nothing when the
/// four are first used in the order they would come anyway, and a favour of
/// -2 changes nothing when one of them comes every time.
fn presence(value: fn(&str) -> Value) -> Row {
    row("presence_penalty", value, few(), Expect::Changes)
}

fn sampling_rows() -> Vec<Row> {
    use Expect::*;
    let hot = || json!({"temperature": 1.5, "seed": 7, "sampling_seed": 7});
    let forced_eog = || json!({"ignore_eos": false, "logit_bias": {IM_END: 100}});
    vec![
        row(
            "temperature",
            |_| json!(1.5),
            json!({"seed": 7, "sampling_seed": 7}),
            Changes,
        ),
        row("top_p", |_| json!(0.05), hot(), Changes),
        row("top_k", |_| json!(1), hot(), Changes),
        row("min_p", |_| json!(0.9), hot(), Changes),
        // The baseline's third and fourth characters as a stop string.
        row(
            "stop",
            |t| json!(t.chars().skip(2).take(2).collect::<String>()),
            json!({}),
            Changes,
        ),
        row(
            "stop_token_ids",
            |_| json!([116]),
            json!({"logit_bias": {Q: 100}}),
            Changes,
        ),
        row("ignore_eos", |_| json!(true), forced_eog(), Changes),
        row("logit_bias", |_| json!({Q: 100}), json!({}), Changes),
        row("frequency_penalty", |_| json!(2.0), few(), Changes),
        row("repetition_penalty", |_| json!(2.0), few(), Changes),
        row(
            "skip_special_tokens",
            |_| json!(false),
            json!({"logit_bias": {IM_END: 100}}),
            Changes,
        ),
        row(
            "spaces_between_special_tokens",
            |_| json!(false),
            json!({"logit_bias": {IM_END: 100}, "skip_special_tokens": false}),
            Changes,
        ),
    ]
}

/// Fields of OpenAI's and its peers' chat and completions requests that are
/// the same on both endpoints.
fn openai_rows() -> Vec<Row> {
    use Expect::*;
    let mut rows = sampling_rows();
    rows.extend([
        row(
            "seed",
            |_| json!(8),
            json!({"temperature": 1.5, "seed": 7}),
            Changes,
        ),
        row(
            "min_tokens",
            |_| json!(5),
            json!({"ignore_eos": false, "logit_bias": {IM_END: 100}}),
            Changes,
        ),
        row("n", |_| json!(2), json!({}), Adds("/choices/1/index")),
        row("model", |_| json!("any-name"), json!({}), NoEffect),
        row("user", |_| json!("u-1"), json!({}), NoEffect),
        row("metadata", |_| json!({"k": "v"}), json!({}), NoEffect),
        row("store", |_| json!(true), json!({}), NoEffect),
        row("service_tier", |_| json!("auto"), json!({}), NoEffect),
        row("prompt_cache_key", |_| json!("k"), json!({}), NoEffect),
        row("safety_identifier", |_| json!("s"), json!({}), NoEffect),
        row(
            "response_format",
            |_| json!({"type": "json_object"}),
            json!({}),
            Changes,
        ),
        row("regex", |_| json!("a+"), json!({}), Changes),
        row(
            "json_schema",
            |_| json!({"type": "object"}),
            json!({}),
            Changes,
        ),
        row("ebnf", |_| json!("root ::= \"a\""), json!({}), Changes),
        row(
            "guided_json",
            |_| json!({"type": "integer"}),
            json!({}),
            Changes,
        ),
        row("guided_regex", |_| json!("b+"), json!({}), Changes),
        row("guided_choice", |_| json!(["x", "y"]), json!({}), Changes),
        row(
            "guided_grammar",
            |_| json!("start: \"q\""),
            json!({}),
            Changes,
        ),
        row(
            "structured_outputs",
            |_| json!({"regex": "a"}),
            json!({}),
            Refused,
        ),
        row("stop_regex", |_| json!(["a"]), json!({}), Refused),
        row("no_stop_trim", |_| json!(true), json!({}), Refused),
        row("lora_path", |_| json!("adapter"), json!({}), Refused),
        row(
            "custom_logit_processor",
            |_| json!("code"),
            json!({}),
            Refused,
        ),
        row("prompt_logprobs", |_| json!(1), json!({}), Refused),
        row("return_hidden_states", |_| json!(true), json!({}), Refused),
        row("bad_words", |_| json!(["a"]), json!({}), Refused),
        row("allowed_token_ids", |_| json!([5]), json!({}), Refused),
        row("truncate_prompt_tokens", |_| json!(2), json!({}), Refused),
        row("use_beam_search", |_| json!(true), json!({}), Refused),
        row("length_penalty", |_| json!(0.5), json!({}), Refused),
    ]);
    rows
}

/// `/v1/chat/completions` (OpenAI's CreateChatCompletionRequest).
fn chat_rows() -> Vec<Row> {
    use Expect::*;
    let mut rows = openai_rows();
    rows.extend([
        row(
            "messages",
            |_| json!([{"role": "user", "content": "another question entirely"}]),
            json!({}),
            Changes,
        ),
        row("max_tokens", |_| json!(4), json!({}), Changes),
        presence(|_| json!(2.0)),
        row(
            "max_completion_tokens",
            |_| json!(4),
            json!({"max_tokens": null, "max_completion_tokens": 16}),
            Changes,
        ),
        row(
            "logprobs",
            |_| json!(true),
            json!({}),
            Adds("/choices/0/logprobs/content"),
        ),
        row(
            "top_logprobs",
            |_| json!(2),
            json!({"logprobs": true}),
            Adds("/choices/0/logprobs/content/0/top_logprobs/1"),
        ),
        row(
            "stream",
            |_| json!(true),
            json!({}),
            ShownBy("http_api::chat_completion_whole_and_streamed_agree"),
        ),
        row(
            "stream_options",
            |_| json!({"include_usage": true}),
            json!({"stream": true}),
            ShownBy("http_api::chat_completion_whole_and_streamed_agree"),
        ),
        row(
            "tools",
            |_| json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
            json!({}),
            Changes,
        ),
        row(
            "tool_choice",
            |_| json!("required"),
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "max_tokens": 64}),
            Adds("/choices/0/message/tool_calls/0/function/arguments"),
        ),
        row(
            "parallel_tool_calls",
            |_| json!(false),
            json!({}),
            ShownBy("tools::parallel_tool_calls_decides_how_many_calls_come"),
        ),
        row("functions", |_| json!([{"name": "f"}]), json!({}), Refused),
        row("function_call", |_| json!("auto"), json!({}), Refused),
        row(
            "audio",
            |_| json!({"voice": "alloy", "format": "wav"}),
            json!({}),
            Refused,
        ),
        row(
            "modalities",
            |_| json!(["text", "audio"]),
            json!({}),
            Refused,
        ),
        row(
            "prediction",
            |_| json!({"type": "content", "content": "x"}),
            json!({}),
            Refused,
        ),
        row("reasoning_effort", |_| json!("low"), json!({}), Refused),
        row("verbosity", |_| json!("low"), json!({}), Refused),
        row("web_search_options", |_| json!({}), json!({}), Refused),
        row(
            "chat_template_kwargs",
            |_| json!({"enable_thinking": true}),
            json!({}),
            Refused,
        ),
        row(
            "continue_final_message",
            |_| json!(true),
            json!({}),
            Refused,
        ),
        row("echo", |_| json!(true), json!({}), Refused),
    ]);
    rows
}

/// `/v1/completions` (OpenAI's CreateCompletionRequest).
fn completion_rows() -> Vec<Row> {
    use Expect::*;
    let mut rows = openai_rows();
    rows.extend([
        row(
            "prompt",
            |_| json!("another prompt entirely"),
            json!({}),
            Changes,
        ),
        row("max_tokens", |_| json!(4), json!({}), Changes),
        presence(|_| json!(-2.0)),
        row(
            "best_of",
            |_| json!(2),
            json!({}),
            ShownBy("choices::best_of_returns_the_likeliest_and_generate_lists_n"),
        ),
        // The prompt comes back ahead of the completion (and, with
        // logprobs, scored: `http_api::completions_echo_scores_the_prompt`).
        row("echo", |_| json!(true), json!({}), Changes),
        row(
            "logprobs",
            |_| json!(2),
            json!({}),
            Adds("/choices/0/logprobs/top_logprobs/0"),
        ),
        row("suffix", |_| json!("and then"), json!({}), Refused),
        row(
            "stream",
            |_| json!(true),
            json!({}),
            ShownBy("http_api::completions_whole_and_streamed_agree"),
        ),
        row(
            "stream_options",
            |_| json!({"include_usage": true}),
            json!({"stream": true}),
            ShownBy("http_api::completions_whole_and_streamed_agree"),
        ),
    ]);
    rows
}

/// SGLang's `sampling_params` (its `SamplingParams`).
fn sampling_params_rows() -> Vec<Row> {
    use Expect::*;
    let mut rows = sampling_rows();
    rows.extend([
        row("max_new_tokens", |_| json!(4), json!({}), Changes),
        presence(|_| json!(-2.0)),
        row(
            "sampling_seed",
            |_| json!(8),
            json!({"temperature": 1.5, "sampling_seed": 7}),
            Changes,
        ),
        row(
            "min_new_tokens",
            |_| json!(5),
            json!({"ignore_eos": false, "logit_bias": {IM_END: 100}}),
            Changes,
        ),
        row("stream_interval", |_| json!(4), json!({}), NoEffect),
        row("n", |_| json!(2), json!({}), Adds("/1/index")),
        row(
            "json_schema",
            |_| json!("{\"type\": \"object\"}"),
            json!({}),
            Changes,
        ),
        row("regex", |_| json!("a+"), json!({}), Changes),
        row("ebnf", |_| json!("root ::= \"a\""), json!({}), Changes),
        row("structural_tag", |_| json!("{}"), json!({}), Refused),
        row("no_stop_trim", |_| json!(true), json!({}), Refused),
        row("stop_regex", |_| json!(["a"]), json!({}), Refused),
        row("custom_params", |_| json!({"a": 1}), json!({}), Refused),
    ]);
    rows
}

/// SGLang's `/generate` body (its `GenerateReqInput`), besides
/// `sampling_params` and the bootstrap fields a PD router sets (those are
/// tested through PD in pd_http.rs and the router tests).
fn generate_rows() -> Vec<Row> {
    use Expect::*;
    vec![
        row(
            "text",
            |_| json!("another prompt entirely"),
            json!({}),
            Changes,
        ),
        row(
            "input_ids",
            |_| json!([5, 6, 7]),
            json!({}),
            ShownBy("http_api::generate_whole_streamed_and_ids"),
        ),
        row(
            "stream",
            |_| json!(true),
            json!({}),
            ShownBy("http_api::generate_whole_streamed_and_ids"),
        ),
        row(
            "return_logprob",
            |_| json!(true),
            json!({}),
            Adds("/meta_info/output_token_logprobs"),
        ),
        row("rid", |_| json!("walk-rid"), json!({}), NoEffect),
        row("log_metrics", |_| json!(false), json!({}), NoEffect),
        row(
            "logprob_start_len",
            |_| json!(0),
            json!({"return_logprob": true}),
            Adds("/meta_info/input_token_logprobs/1/0"),
        ),
        row(
            "top_logprobs_num",
            |_| json!(2),
            json!({"return_logprob": true}),
            Adds("/meta_info/output_top_logprobs/0/1"),
        ),
        row(
            "token_ids_logprob",
            |_| json!([5]),
            json!({"return_logprob": true}),
            Refused,
        ),
        row(
            "return_text_in_logprobs",
            |_| json!(true),
            json!({"return_logprob": true}),
            Adds("/meta_info/output_token_logprobs/0/2"),
        ),
        row(
            "image_data",
            |_| json!("data:image/png;base64,AA=="),
            json!({}),
            Refused,
        ),
        row("audio_data", |_| json!("a.wav"), json!({}), Refused),
        row("video_data", |_| json!("v.mp4"), json!({}), Refused),
        row("input_embeds", |_| json!([[0.0]]), json!({}), Refused),
        row("lora_path", |_| json!("adapter"), json!({}), Refused),
        row(
            "custom_logit_processor",
            |_| json!("code"),
            json!({}),
            Refused,
        ),
        row("return_hidden_states", |_| json!(true), json!({}), Refused),
        row("session_params", |_| json!({"id": "s"}), json!({}), Refused),
    ]
}

/// Every field of the schemas, by endpoint, as the specs list them: the
/// walk must have a row for each (a field added here without a row fails).
const CHAT_SPEC: &[&str] = &[
    "messages",
    "model",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
    // SGLang's and vLLM's extensions.
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "regex",
    "ebnf",
    "json_schema",
    "no_stop_trim",
    "continue_final_message",
    "chat_template_kwargs",
    "lora_path",
];
const COMPLETION_SPEC: &[&str] = &[
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "regex",
    "ebnf",
    "json_schema",
    "no_stop_trim",
    "lora_path",
];
const SAMPLING_PARAMS_SPEC: &[&str] = &[
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "regex",
    "ebnf",
    "json_schema",
    "structural_tag",
    "n",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "stream_interval",
];
const GENERATE_SPEC: &[&str] = &[
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "stream",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "lora_path",
    "custom_logit_processor",
    "return_hidden_states",
    "session_params",
    "log_metrics",
];

/// What a request generated: the text and, where the answer has them, the
/// token ids and finish reason.
fn output(v: &Value) -> Value {
    if let Some(c) = v["choices"].get(0) {
        let text = c["message"]["content"].clone();
        let text = if text.is_null() {
            c["text"].clone()
        } else {
            text
        };
        json!([text, c["finish_reason"]])
    } else {
        json!([v["text"], v["output_ids"], v["meta_info"]["finish_reason"]])
    }
}

/// `base` with `extra`'s fields set (null removes one).
fn merged(base: &Value, extra: &Value) -> Value {
    let mut out = base.clone();
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            out.as_object_mut().unwrap().remove(k);
        } else {
            out[k.as_str()] = v.clone();
        }
    }
    out
}

/// Walk `rows` on `path`. `inner` names the object the fields go in
/// (`sampling_params`), `prefix` how an error names them.
async fn walk(path: &str, baseline: Value, inner: Option<&str>, rows: Vec<Row>, spec: &[&str]) {
    for field in spec {
        assert!(
            rows.iter().any(|r| r.field == *field),
            "{path}: the spec's field `{field}` has no row in the walk"
        );
    }
    let with = |extra: &Value| -> Value {
        match inner {
            None => merged(&baseline, extra),
            Some(k) => {
                let mut b = baseline.clone();
                b[k] = merged(&baseline[k], extra);
                b
            }
        }
    };
    let (s, plain) = post(path, &baseline).await;
    assert_eq!(s, 200, "{path} baseline: {plain}");
    let plain_text = output(&plain)[0].as_str().unwrap_or_default().to_string();
    assert!(plain_text.chars().count() >= 4, "{plain}");
    let mut failures = Vec::new();
    for r in rows {
        if let Expect::ShownBy(test) = r.expect {
            assert!(test.contains("::"), "{test}");
            continue;
        }
        let value = (r.value)(&plain_text);
        let base = with(&r.base);
        let mut set = r.base.clone();
        set[r.field] = value.clone();
        let body = with(&set);
        let param = match inner {
            None => r.field.to_string(),
            Some(k) => format!("{k}.{}", r.field),
        };
        let (s, got) = post(path, &body).await;
        let verdict = match &r.expect {
            Expect::Refused => {
                if s == 400 && got["error"]["param"] == param.as_str() {
                    Ok(())
                } else {
                    Err(format!("want a 400 naming `{param}`, got {s}: {got}"))
                }
            }
            expect => {
                let (bs, before) = post(path, &base).await;
                if s != 200 || bs != 200 {
                    Err(format!("want 200s, got {s} / {bs}: {got} / {before}"))
                } else {
                    match expect {
                        Expect::Changes if output(&got) == output(&before) => {
                            Err(format!("output unchanged: {}", output(&got)))
                        }
                        Expect::NoEffect if output(&got) != output(&before) => Err(format!(
                            "output changed: {} vs {}",
                            output(&got),
                            output(&before)
                        )),
                        Expect::Adds(ptr) => {
                            let on = got.pointer(ptr).is_some_and(|v| !v.is_null());
                            let off = before.pointer(ptr).is_some_and(|v| !v.is_null());
                            if on && !off {
                                Ok(())
                            } else {
                                Err(format!("{ptr}: with it {on}, without it {off}: {got}"))
                            }
                        }
                        _ => Ok(()),
                    }
                }
            }
        };
        if let Err(e) = verdict {
            failures.push(format!("{path} `{param}` = {value}: {e}"));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chat_field_is_honoured_or_refused() {
    let baseline = json!({
        "messages": [{"role": "user", "content": "walk every field"}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": true,
    });
    walk(
        "/v1/chat/completions",
        baseline,
        None,
        chat_rows(),
        CHAT_SPEC,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completions_field_is_honoured_or_refused() {
    let baseline = json!({
        "prompt": "walk every field", "max_tokens": 16, "temperature": 0, "ignore_eos": true,
    });
    walk(
        "/v1/completions",
        baseline,
        None,
        completion_rows(),
        COMPLETION_SPEC,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sampling_params_field_is_honoured_or_refused() {
    let baseline = json!({
        "text": "walk every field",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": true},
    });
    walk(
        "/generate",
        baseline.clone(),
        Some("sampling_params"),
        sampling_params_rows(),
        SAMPLING_PARAMS_SPEC,
    )
    .await;
    walk("/generate", baseline, None, generate_rows(), GENERATE_SPEC).await;
}
