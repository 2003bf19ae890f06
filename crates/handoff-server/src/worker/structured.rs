//! The structured-output fields of a request (OpenAI's `response_format`,
//! SGLang's `json_schema`, `regex` and `ebnf`, vLLM's `guided_*`), read
//! into one [`GrammarSpec`] and compiled, or refused with a 400 naming the
//! field and what is wrong with it.

use handoff_engine::grammar::{Grammar, GrammarSpec, Grammars};
use serde_json::{Map, Value};

use crate::http::errors::ApiError;
use crate::worker::fields::Endpoint;

/// The fields each endpoint reads here (taken out of its `extra` map).
fn fields(endpoint: Endpoint) -> &'static [&'static str] {
    match endpoint {
        Endpoint::Chat | Endpoint::Completions => &[
            "response_format",
            "json_schema",
            "regex",
            "ebnf",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ],
        Endpoint::SamplingParams => &["json_schema", "regex", "ebnf"],
        Endpoint::Generate => &[],
    }
}

/// Take `endpoint`'s structured-output fields out of `extra` and compile
/// the one given; `None` when none asks for anything.
pub fn take(
    endpoint: Endpoint,
    extra: &mut Map<String, Value>,
    grammars: &Grammars,
) -> Result<Option<Grammar>, ApiError> {
    let mut found: Option<(String, GrammarSpec)> = None;
    for &field in fields(endpoint) {
        let Some(v) = extra.remove(field) else {
            continue;
        };
        let param = match endpoint {
            Endpoint::SamplingParams => format!("sampling_params.{field}"),
            _ => field.to_string(),
        };
        let Some(spec) = spec_of(field, v).map_err(|m| invalid(&param, m))? else {
            continue;
        };
        if let Some((first, _)) = &found {
            return Err(invalid(
                &param,
                format!("`{param}` and `{first}` both constrain the output: give one"),
            ));
        }
        found = Some((param, spec));
    }
    let Some((param, spec)) = found else {
        return Ok(None);
    };
    grammars
        .compile(spec)
        .map(Some)
        .map_err(|e| invalid(&param, format!("`{param}` cannot be used: {e}")))
}

fn invalid(param: &str, message: String) -> ApiError {
    let mut e = ApiError::new(400, "invalid_request_error", message);
    e.param = Some(param.to_string());
    e
}

/// What `field`'s value asks for; `None` when nothing (`null`, a
/// `response_format` of type `text`).
fn spec_of(field: &str, v: Value) -> Result<Option<GrammarSpec>, String> {
    if v.is_null() {
        return Ok(None);
    }
    Ok(Some(match field {
        "response_format" => return response_format(v),
        "json_schema" | "guided_json" => GrammarSpec::JsonSchema(schema_value(field, v)?),
        "regex" | "guided_regex" => GrammarSpec::Regex(string(field, v)?),
        "ebnf" | "guided_grammar" => GrammarSpec::Grammar(string(field, v)?),
        "guided_choice" => {
            let choices: Vec<String> = serde_json::from_value(v)
                .map_err(|_| format!("{field} must be a list of strings"))?;
            GrammarSpec::Choice(choices)
        }
        _ => return Ok(None),
    }))
}

fn string(field: &str, v: Value) -> Result<String, String> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s),
        Value::String(_) => Err(format!("{field} is empty")),
        _ => Err(format!("{field} must be a string")),
    }
}

/// A schema given as an object, or as a string holding one (SGLang's
/// `json_schema` is a string).
fn schema_value(field: &str, v: Value) -> Result<Value, String> {
    match v {
        Value::String(s) => {
            serde_json::from_str(&s).map_err(|e| format!("{field} is not valid JSON: {e}"))
        }
        Value::Object(_) | Value::Bool(_) => Ok(v),
        _ => Err(format!("{field} must be a JSON schema (an object)")),
    }
}

/// OpenAI's `response_format`: `{"type": "text"}`, `{"type":
/// "json_object"}`, or `{"type": "json_schema", "json_schema": {"name",
/// "schema", "strict"}}`.
fn response_format(v: Value) -> Result<Option<GrammarSpec>, String> {
    let Value::Object(mut o) = v else {
        return Err("response_format must be an object with a `type`".into());
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let Some(Value::Object(mut js)) = o.remove("json_schema") else {
                return Err(
                    "response_format of type json_schema needs a `json_schema` object".into(),
                );
            };
            // `strict` is what handoff always does: the output follows the
            // schema token by token. A `json_schema` without `schema`
            // allows any JSON value (OpenAI's default).
            match js.remove("schema") {
                None | Some(Value::Null) => Ok(Some(GrammarSpec::JsonSchema(Value::Bool(true)))),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(GrammarSpec::JsonSchema(s)))
                }
                Some(_) => Err("response_format.json_schema.schema must be an object".into()),
            }
        }
        Some(other) => Err(format!(
            "response_format type `{other}` is not one of text, json_object, json_schema"
        )),
        None => Err("response_format needs a `type`".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_read_into_specs_and_bad_values_name_the_problem() {
        let s = |f: &str, v: Value| spec_of(f, v);
        assert_eq!(
            s("response_format", json!({"type": "json_object"})),
            Ok(Some(GrammarSpec::JsonObject))
        );
        assert_eq!(s("response_format", json!({"type": "text"})), Ok(None));
        assert_eq!(
            s(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": true}})
            ),
            Ok(Some(GrammarSpec::JsonSchema(json!({"type": "integer"}))))
        );
        assert_eq!(
            s("json_schema", json!("{\"type\": \"string\"}")),
            Ok(Some(GrammarSpec::JsonSchema(json!({"type": "string"}))))
        );
        assert_eq!(
            s("guided_choice", json!(["a", "b"])),
            Ok(Some(GrammarSpec::Choice(vec!["a".into(), "b".into()])))
        );
        assert!(s("json_schema", json!("{not json"))
            .unwrap_err()
            .starts_with("json_schema is not valid JSON"));
        assert_eq!(
            s("response_format", json!({"type": "yaml"})).unwrap_err(),
            "response_format type `yaml` is not one of text, json_object, json_schema"
        );
        assert_eq!(s("regex", json!(3)).unwrap_err(), "regex must be a string");
        assert_eq!(s("regex", Value::Null), Ok(None));
    }
}
