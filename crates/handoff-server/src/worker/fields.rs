//! The rule that every request field a spec defines is either honoured or
//! refused, never silently ignored.
//!
//! The request types ([`crate::worker::openai_types`], [`crate::worker::generate_api`]) read
//! the fields handoff implements; every other field lands in their `extra`
//! map. [`check`] looks each one up in its endpoint's table, built from the
//! OpenAI API reference and SGLang's and vLLM's request models: a field
//! handoff does not implement is a 400 naming it (unless its value is the
//! one that asks for nothing), a field that changes nothing a client gets
//! back (`user`, `metadata`, routing hints) is accepted, and a field no spec
//! defines is ignored, as OpenAI clients send many.

use serde_json::{Map, Value};

use crate::http::errors::ApiError;

/// What handoff does with a field its request type does not read.
#[derive(Debug, Clone, Copy)]
pub enum Support {
    /// Changes nothing a client gets back (bookkeeping, routing hints).
    NoEffect,
    /// Not implemented: refused unless the value asks for nothing
    /// ([`NoOp`]); the text says what to do instead.
    Refused(NoOp, &'static str),
}

/// The values of a refused field that ask for nothing (besides `null`,
/// which always does).
#[derive(Debug, Clone, Copy)]
pub enum NoOp {
    /// Only `null`.
    Null,
    /// `false`.
    False,
    /// `true`.
    True,
    /// An empty list or object, or an empty string.
    Empty,
    /// This exact string (`tool_choice: "none"`).
    Str(&'static str),
    /// This number (`length_penalty: 1`).
    Num(f64),
    /// An object whose `type` is this (`response_format: {"type": "text"}`).
    Type(&'static str),
}

impl NoOp {
    fn holds(self, v: &Value) -> bool {
        if v.is_null() {
            return true;
        }
        match self {
            NoOp::Null => false,
            NoOp::False => v == &Value::Bool(false),
            NoOp::True => v == &Value::Bool(true),
            NoOp::Empty => match v {
                Value::Array(a) => a.is_empty(),
                Value::Object(o) => o.is_empty(),
                Value::String(s) => s.is_empty(),
                _ => false,
            },
            NoOp::Str(s) => v.as_str() == Some(s),
            NoOp::Num(n) => v.as_f64() == Some(n),
            NoOp::Type(t) => v.get("type").and_then(Value::as_str) == Some(t),
        }
    }
}

const STRUCTURED: &str =
    "structured output goes in `sampling_params` (`json_schema`, `regex`, `ebnf`)";
const STRUCTURAL_TAG: &str =
    "structural tags are not implemented: use `json_schema`, `regex` or `ebnf`";
const TOOLS: &str =
    "the deprecated function-calling fields are not implemented: use `tools` and `tool_choice`";
const MEDIA: &str = "handoff serves text-only models: send text";
const ALTERNATIVES: &str =
    "log-probabilities are returned for generated tokens only (with their top alternatives), not for the prompt or chosen token lists";
const ADAPTERS: &str = "handoff serves the one model it loaded, without adapters";
const BEAM: &str = "handoff samples; beam search is not implemented";

/// Fields of the OpenAI API and SGLang's and vLLM's extensions that no
/// endpoint reads, with what handoff does with them.
const COMMON: &[(&str, Support)] = &[
    // Bookkeeping and routing: nothing a client gets back changes.
    ("user", Support::NoEffect),
    ("metadata", Support::NoEffect),
    ("store", Support::NoEffect),
    ("safety_identifier", Support::NoEffect),
    ("prompt_cache_key", Support::NoEffect),
    ("service_tier", Support::NoEffect),
    ("rid", Support::NoEffect),
    ("request_id", Support::NoEffect),
    ("extra_key", Support::NoEffect),
    ("cache_salt", Support::NoEffect),
    ("custom_labels", Support::NoEffect),
    ("routed_dp_rank", Support::NoEffect),
    ("data_parallel_rank", Support::NoEffect),
    ("disagg_prefill_dp_rank", Support::NoEffect),
    // Structured output: chat, completions and `sampling_params` read these
    // ([`crate::worker::structured`]) before this table is looked at; at
    // `/generate`'s top level they belong in `sampling_params`.
    (
        "response_format",
        Support::Refused(NoOp::Type("text"), STRUCTURED),
    ),
    ("json_schema", Support::Refused(NoOp::Null, STRUCTURED)),
    ("regex", Support::Refused(NoOp::Null, STRUCTURED)),
    ("ebnf", Support::Refused(NoOp::Null, STRUCTURED)),
    (
        "structural_tag",
        Support::Refused(NoOp::Null, STRUCTURAL_TAG),
    ),
    ("guided_json", Support::Refused(NoOp::Null, STRUCTURED)),
    ("guided_regex", Support::Refused(NoOp::Null, STRUCTURED)),
    ("guided_choice", Support::Refused(NoOp::Null, STRUCTURED)),
    ("guided_grammar", Support::Refused(NoOp::Null, STRUCTURED)),
    (
        "structured_outputs",
        Support::Refused(NoOp::Null, STRUCTURAL_TAG),
    ),
    // Stopping and output shaping handoff does not do.
    (
        "stop_regex",
        Support::Refused(
            NoOp::Empty,
            "stop strings are matched literally: use `stop`",
        ),
    ),
    (
        "no_stop_trim",
        Support::Refused(
            NoOp::False,
            "the matched stop string is never part of the output",
        ),
    ),
    (
        "include_stop_str_in_output",
        Support::Refused(
            NoOp::False,
            "the matched stop string is never part of the output",
        ),
    ),
    (
        "return_hidden_states",
        Support::Refused(NoOp::False, "hidden states are not returned"),
    ),
    (
        "return_routed_experts",
        Support::Refused(NoOp::False, "the served models have no experts"),
    ),
    (
        "return_token_ids",
        Support::Refused(
            NoOp::False,
            "use `/generate`, whose answer has `output_ids`",
        ),
    ),
    (
        "return_tokens_as_token_ids",
        Support::Refused(
            NoOp::False,
            "use `/generate`, whose answer has `output_ids`",
        ),
    ),
    (
        "return_cached_tokens_details",
        Support::Refused(
            NoOp::False,
            "usage.prompt_tokens_details is not returned yet",
        ),
    ),
    (
        "prompt_logprobs",
        Support::Refused(NoOp::Null, ALTERNATIVES),
    ),
    (
        "custom_logit_processor",
        Support::Refused(NoOp::Empty, "no code from a request is ever run"),
    ),
    (
        "custom_params",
        Support::Refused(NoOp::Empty, "no code from a request is ever run"),
    ),
    ("lora_path", Support::Refused(NoOp::Null, ADAPTERS)),
    ("lora_request", Support::Refused(NoOp::Null, ADAPTERS)),
    (
        "session_params",
        Support::Refused(
            NoOp::Null,
            "sessions are not implemented; send the whole conversation",
        ),
    ),
    (
        "session_id",
        Support::Refused(
            NoOp::Null,
            "sessions are not implemented; send the whole conversation",
        ),
    ),
    ("use_beam_search", Support::Refused(NoOp::False, BEAM)),
    ("length_penalty", Support::Refused(NoOp::Num(1.0), BEAM)),
    ("early_stopping", Support::Refused(NoOp::False, BEAM)),
    (
        "bad_words",
        Support::Refused(
            NoOp::Empty,
            "use `logit_bias` with -100 for the words' tokens",
        ),
    ),
    (
        "allowed_token_ids",
        Support::Refused(NoOp::Null, "use `logit_bias` to steer the choice of tokens"),
    ),
    (
        "truncate_prompt_tokens",
        Support::Refused(
            NoOp::Null,
            "prompts are never truncated: shorten it yourself",
        ),
    ),
    ("images_config", Support::Refused(NoOp::Empty, MEDIA)),
];

/// Fields only the chat endpoint's specs define.
const CHAT: &[(&str, Support)] = &[
    // `tools`, `tool_choice` and `parallel_tool_calls` are read
    // ([`crate::worker::tools`]) before this table is looked at.
    ("functions", Support::Refused(NoOp::Empty, TOOLS)),
    ("function_call", Support::Refused(NoOp::Str("none"), TOOLS)),
    ("audio", Support::Refused(NoOp::Null, MEDIA)),
    ("modalities", Support::Refused(NoOp::Null, MEDIA)),
    (
        "prediction",
        Support::Refused(NoOp::Null, "predicted outputs are not implemented"),
    ),
    (
        "reasoning_effort",
        Support::Refused(
            NoOp::Null,
            "the served models have no reasoning effort to set",
        ),
    ),
    (
        "verbosity",
        Support::Refused(NoOp::Null, "the served models have no verbosity to set"),
    ),
    (
        "web_search_options",
        Support::Refused(
            NoOp::Null,
            "handoff reaches no network on a request's behalf",
        ),
    ),
    (
        "continue_final_message",
        Support::Refused(
            NoOp::False,
            "the chat template always opens a new assistant turn",
        ),
    ),
    (
        "add_generation_prompt",
        Support::Refused(
            NoOp::True,
            "the chat template always opens a new assistant turn",
        ),
    ),
    (
        "chat_template",
        Support::Refused(NoOp::Null, "no template from a request is ever run"),
    ),
    (
        "chat_template_kwargs",
        Support::Refused(NoOp::Empty, "the chat template takes no extra arguments"),
    ),
    (
        "documents",
        Support::Refused(NoOp::Empty, "the chat template takes no documents"),
    ),
    // SGLang splits reasoning out of `content` only when its server runs a
    // `--reasoning-parser`; without one both values give the same answer.
    // handoff runs no reasoning parser, so it answers as SGLang does then.
    // SGLang's router sends both fields, `true`, on every chat request.
    ("separate_reasoning", Support::NoEffect),
    ("stream_reasoning", Support::NoEffect),
    (
        "echo",
        Support::Refused(
            NoOp::False,
            "the chat answer never repeats the conversation",
        ),
    ),
];

/// Fields of SGLang's `/generate` body besides those read.
const GENERATE: &[(&str, Support)] = &[
    ("log_metrics", Support::NoEffect),
    (
        "input_embeds",
        Support::Refused(NoOp::Null, "send `text` or `input_ids`"),
    ),
    ("image_data", Support::Refused(NoOp::Null, MEDIA)),
    ("audio_data", Support::Refused(NoOp::Null, MEDIA)),
    ("video_data", Support::Refused(NoOp::Null, MEDIA)),
    ("modalities", Support::Refused(NoOp::Null, MEDIA)),
    (
        "token_ids_logprob",
        Support::Refused(NoOp::Null, ALTERNATIVES),
    ),
];

/// SGLang's `sampling_params` fields besides those read.
const SAMPLING_PARAMS: &[(&str, Support)] = &[
    ("stream_interval", Support::NoEffect),
    ("dtype", Support::NoEffect),
];

/// The endpoint whose fields a body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/generate`'s top level.
    Generate,
    /// `/generate`'s `sampling_params`.
    SamplingParams,
}

impl Endpoint {
    fn tables(self) -> &'static [&'static [(&'static str, Support)]] {
        match self {
            Endpoint::Chat => &[COMMON, CHAT],
            Endpoint::Completions | Endpoint::Generate => &[COMMON, GENERATE],
            Endpoint::SamplingParams => &[COMMON, SAMPLING_PARAMS],
        }
    }

    /// How a field of this endpoint is named in an error.
    fn param(self, field: &str) -> String {
        match self {
            Endpoint::SamplingParams => format!("sampling_params.{field}"),
            _ => field.to_string(),
        }
    }
}

/// What handoff does with `field` of `endpoint` when its request type does
/// not read it; `None` for a field no spec defines.
pub fn support(endpoint: Endpoint, field: &str) -> Option<Support> {
    let tables = endpoint.tables();
    // `/v1/completions` shares `/generate`'s table for the SGLang
    // extensions, but its own spec has no `/generate`-only fields.
    let generate_only = endpoint == Endpoint::Completions;
    tables
        .iter()
        .enumerate()
        .filter(|(i, _)| !(generate_only && *i == 1))
        .flat_map(|(_, t)| t.iter())
        .find(|(name, _)| *name == field)
        .map(|(_, s)| *s)
}

/// Refuse the first field of `extra` (what the request type did not read)
/// that `endpoint` does not implement and that asks for something.
pub fn check(endpoint: Endpoint, extra: &Map<String, Value>) -> Result<(), ApiError> {
    for (field, value) in extra {
        if let Some(Support::Refused(noop, instead)) = support(endpoint, field) {
            if !noop.holds(value) {
                let param = endpoint.param(field);
                let mut e = ApiError::new(
                    400,
                    "unsupported_parameter",
                    format!("`{param}` is not supported by handoff: {instead}"),
                );
                e.param = Some(param);
                return Err(e);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn extra(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_refused_field_is_named_unless_it_asks_for_nothing() {
        let e = check(
            Endpoint::Chat,
            &extra(json!({"functions": [{"name": "f"}]})),
        )
        .unwrap_err();
        assert_eq!(
            (e.status, e.code, e.param.as_deref()),
            (400, "unsupported_parameter", Some("functions"))
        );
        assert!(
            e.message.contains(
                "`functions` is not supported by handoff: the deprecated function-calling fields"
            ),
            "{}",
            e.message
        );
        let e = check(
            Endpoint::SamplingParams,
            &extra(json!({"structural_tag": "{}"})),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.structural_tag"));
        for asks_nothing in [
            json!({"functions": []}),
            json!({"function_call": "none"}),
            json!({"response_format": {"type": "text"}}),
            json!({"regex": null}),
            json!({"no_stop_trim": false}),
            json!({"user": "u1", "metadata": {"a": "b"}, "store": true}),
            json!({"some_field_no_spec_defines": 3}),
        ] {
            check(Endpoint::Chat, &extra(asks_nothing.clone()))
                .unwrap_or_else(|e| panic!("{asks_nothing}: {}", e.message));
        }
        // The defaults SGLang's router (sgl-model-gateway) serializes into
        // every chat request it forwards ask for nothing.
        let gateway_defaults = json!({
            "logprobs": false, "stream": false, "no_stop_trim": false,
            "ignore_eos": false, "continue_final_message": false,
            "skip_special_tokens": true, "separate_reasoning": true,
            "stream_reasoning": true, "return_hidden_states": false,
        });
        check(Endpoint::Chat, &extra(gateway_defaults))
            .unwrap_or_else(|e| panic!("the gateway's defaults: {}", e.message));
        // `/generate`-only fields are not `/v1/completions` fields.
        assert!(support(Endpoint::Generate, "image_data").is_some());
        assert!(support(Endpoint::Completions, "image_data").is_none());
        assert!(support(Endpoint::Completions, "regex").is_some());
    }
}
