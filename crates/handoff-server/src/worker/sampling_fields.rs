//! The sampling fields every generation API takes under the same names
//! (`/v1/chat/completions` and `/v1/completions` at the top level,
//! `/generate` inside `sampling_params`): one struct flattened into each
//! request type. The output limits and the minimum output are named
//! differently by each API and stay in its own type.
//!
//! Each field is raw JSON here, typed by [`SamplingFields::raw`] with a 400
//! naming the field: a flattened field of a concrete type would lose its
//! name in serde's error (the path reads `.`), as [`crate::worker::pd_fields`]
//! found for the PD fields.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::http::errors::ApiError;
use crate::worker::params::RawSampling;

/// The sampling fields shared by every generation API.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Temperature (default 1; 0 is greedy).
    #[serde(default)]
    pub temperature: Option<Value>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<Value>,
    /// Top-k (0 or -1 disable it).
    #[serde(default)]
    pub top_k: Option<Value>,
    /// RNG seed.
    #[serde(default)]
    pub seed: Option<Value>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Value>,
    /// Stop token ids.
    #[serde(default)]
    pub stop_token_ids: Option<Value>,
    /// Keep generating after EOS.
    #[serde(default)]
    pub ignore_eos: Option<Value>,
    /// Min-p filter (SGLang, vLLM).
    #[serde(default)]
    pub min_p: Option<Value>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<Value>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<Value>,
    /// Repetition penalty (SGLang, vLLM).
    #[serde(default)]
    pub repetition_penalty: Option<Value>,
    /// Token id → bias in [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<Value>,
    /// Special tokens add no text (default true; SGLang, vLLM).
    #[serde(default)]
    pub skip_special_tokens: Option<Value>,
    /// Spaces around special tokens in the text (default true; vLLM).
    #[serde(default)]
    pub spaces_between_special_tokens: Option<Value>,
}

/// `value` of the field named `prefix` + `field` as a `T` (`null` or
/// absent: `None`), else a 400 naming the field (the name is built only
/// then).
pub fn typed<T: DeserializeOwned>(
    prefix: &str,
    field: &str,
    value: Option<&Value>,
) -> Result<Option<T>, ApiError> {
    match value.filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => T::deserialize(v).map(Some).map_err(|e| {
            let name = format!("{prefix}{field}");
            let mut err =
                ApiError::bad_request("invalid_type", format!("invalid value for `{name}`: {e}"));
            err.param = Some(name);
            err
        }),
    }
}

/// One API's names for the fields it does not share: the output limit and
/// the minimum output.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The name the output limit came under.
    pub max_tokens_field: &'static str,
    /// The output limit.
    pub max_tokens: Option<i64>,
    /// The name the minimum output came under.
    pub min_tokens_field: &'static str,
    /// The minimum output.
    pub min_tokens: Option<i64>,
}

impl SamplingFields {
    /// The fields typed, with the API's own `limits`; a field of the wrong
    /// type is a 400 naming it, after `prefix` (`sampling_params.` on
    /// `/generate`).
    pub fn raw(&self, prefix: &str, limits: Limits) -> Result<RawSampling, ApiError> {
        macro_rules! field {
            ($f:ident) => {
                typed(prefix, stringify!($f), self.$f.as_ref())?
            };
        }
        Ok(RawSampling {
            max_tokens_field: limits.max_tokens_field,
            max_tokens: limits.max_tokens,
            temperature: field!(temperature),
            top_p: field!(top_p),
            top_k: field!(top_k),
            seed: field!(seed),
            stop: field!(stop),
            stop_token_ids: field!(stop_token_ids),
            ignore_eos: field!(ignore_eos),
            min_tokens_field: limits.min_tokens_field,
            min_tokens: limits.min_tokens,
            min_p: field!(min_p),
            presence_penalty: field!(presence_penalty),
            frequency_penalty: field!(frequency_penalty),
            repetition_penalty: field!(repetition_penalty),
            logit_bias: field!(logit_bias),
            skip_special_tokens: field!(skip_special_tokens),
            spaces_between_special_tokens: field!(spaces_between_special_tokens),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn limits() -> Limits {
        Limits {
            max_tokens_field: "max_tokens",
            max_tokens: Some(4),
            min_tokens_field: "min_tokens",
            min_tokens: None,
        }
    }

    #[test]
    fn a_value_of_the_wrong_type_is_named_with_its_prefix() {
        let f: SamplingFields =
            serde_json::from_value(json!({"temperature": 0.5, "top_k": "many"})).unwrap();
        let e = f.raw("sampling_params.", limits()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.top_k"));
        assert!(
            e.message.contains(
                "invalid value for `sampling_params.top_k`: invalid type: string \"many\""
            ),
            "{}",
            e.message
        );
        let e = serde_json::from_value::<SamplingFields>(json!({"logit_bias": {"5": "x"}}))
            .unwrap()
            .raw("", limits())
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
    }

    #[test]
    fn values_are_typed_and_null_is_absent() {
        let f: SamplingFields = serde_json::from_value(json!({
            "temperature": 0.5, "top_p": null, "seed": 7, "stop": ["x"],
            "logit_bias": {"5": -100}, "ignore_eos": true
        }))
        .unwrap();
        let r = f.raw("", limits()).unwrap();
        assert_eq!(r.temperature, Some(0.5));
        assert_eq!(r.top_p, None);
        assert_eq!(r.seed, Some(7));
        assert_eq!(r.ignore_eos, Some(true));
        assert_eq!(r.logit_bias.unwrap()["5"], -100.0);
        assert!(r.stop.is_some());
        assert_eq!((r.max_tokens_field, r.max_tokens), ("max_tokens", Some(4)));
    }
}
