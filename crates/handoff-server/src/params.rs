//! Sampling fields shared by the OpenAI and SGLang request shapes, checked
//! and turned into the engine's [`SamplingParams`] with messages that name
//! the field and the accepted range.

use handoff_engine::request::SamplingParams;
use serde::Deserialize;

use crate::errors::ApiError;

/// `stop`: one string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum StopInput {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopInput {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopInput::One(s) => vec![s],
            StopInput::Many(v) => v,
        }
    }
}

/// The raw sampling fields of a request, before validation.
#[derive(Debug, Clone, Default)]
pub struct RawSampling {
    /// Name under which the client sent the output limit (`max_tokens`, `max_new_tokens`...).
    pub max_tokens_field: &'static str,
    /// Output limit; `None` means the endpoint's default.
    pub max_tokens: Option<i64>,
    /// Temperature.
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Top-k; 0 or -1 disable it.
    pub top_k: Option<i64>,
    /// RNG seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopInput>,
    /// Stop token ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep going past EOS.
    pub ignore_eos: Option<bool>,
}

/// Largest accepted temperature.
pub const MAX_TEMPERATURE: f64 = 100.0;
/// Most stop strings one request may give (OpenAI allows 4, SGLang has no
/// limit; matching cost does not grow with the count, the request body does).
pub const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in bytes (text this long is held back while it
/// could still become a stop).
pub const MAX_STOP_BYTES: usize = 256;
/// Most stop token ids one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

impl RawSampling {
    /// Validate and convert. `default_max` is used when no limit was given.
    pub fn into_params(self, default_max: usize) -> Result<SamplingParams, ApiError> {
        let field = if self.max_tokens_field.is_empty() {
            "max_tokens"
        } else {
            self.max_tokens_field
        };
        let max_new_tokens = match self.max_tokens {
            None => default_max.max(1),
            Some(n) if n < 1 => {
                return Err(ApiError::invalid_param(
                    field,
                    format!("{field} must be at least 1, got {n}"),
                ))
            }
            Some(n) => usize::try_from(n).map_err(|_| {
                ApiError::invalid_param(field, format!("{field} is too large: {n}"))
            })?,
        };
        let temperature = match self.temperature {
            None => 1.0,
            Some(t) if t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t) => t as f32,
            Some(t) => {
                return Err(ApiError::invalid_param(
                    "temperature",
                    format!(
                    "temperature must be between 0 and {MAX_TEMPERATURE} (0 means greedy), got {t}"
                ),
                ))
            }
        };
        let top_p = match self.top_p {
            None => 1.0,
            Some(p) if p.is_finite() && p > 0.0 && p <= 1.0 => p as f32,
            Some(p) => {
                return Err(ApiError::invalid_param(
                    "top_p",
                    format!("top_p must be in (0, 1], got {p}"),
                ))
            }
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("top_k must be a positive integer, or 0 / -1 to disable it, got {k}"),
                ))
            }
        };
        let seed = match self.seed {
            None => None,
            Some(s) if s >= 0 => Some(s as u64),
            Some(s) => {
                return Err(ApiError::invalid_param(
                    "seed",
                    format!("seed must be a non-negative integer, got {s}"),
                ))
            }
        };
        let stop = self.stop.map(StopInput::into_vec).unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid_param(
                "stop",
                "stop strings must not be empty",
            ));
        }
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop holds {} strings: at most {MAX_STOP_STRINGS} are accepted",
                    stop.len()
                ),
            ));
        }
        if let Some((i, s)) = stop
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop[{i}] is {} bytes long: stop strings may be at most {MAX_STOP_BYTES} bytes",
                    s.len()
                ),
            ));
        }
        let stop_token_ids = self.stop_token_ids.unwrap_or_default();
        if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::invalid_param(
                "stop_token_ids",
                format!(
                    "stop_token_ids holds {} ids: at most {MAX_STOP_TOKEN_IDS} are accepted",
                    stop_token_ids.len()
                ),
            ));
        }
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            max_new_tokens,
            stop,
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let p = RawSampling::default().into_params(16).unwrap();
        assert_eq!(p.max_new_tokens, 16);
        assert_eq!(p.temperature, 1.0);
        assert_eq!((p.top_k, p.top_p, p.seed), (0, 1.0, None));
    }

    #[test]
    fn rejects_out_of_range_values_by_name() {
        let bad = |r: RawSampling, needle: &str| {
            let e = r.into_params(16).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(needle), "{}", e.message);
        };
        bad(
            RawSampling {
                max_tokens_field: "max_new_tokens",
                max_tokens: Some(-3),
                ..Default::default()
            },
            "max_new_tokens must be at least 1, got -3",
        );
        bad(
            RawSampling {
                temperature: Some(-1.0),
                ..Default::default()
            },
            "temperature must be between 0",
        );
        bad(
            RawSampling {
                top_p: Some(0.0),
                ..Default::default()
            },
            "top_p must be in (0, 1]",
        );
        bad(
            RawSampling {
                top_k: Some(-5),
                ..Default::default()
            },
            "top_k must be a positive integer",
        );
        bad(
            RawSampling {
                seed: Some(-1),
                ..Default::default()
            },
            "seed must be a non-negative integer",
        );
        bad(
            RawSampling {
                stop: Some(StopInput::One(String::new())),
                ..Default::default()
            },
            "stop strings must not be empty",
        );
    }

    #[test]
    fn request_shape_limits_name_their_field() {
        let refused = |r: RawSampling| r.into_params(16).unwrap_err();
        let many = refused(RawSampling {
            stop: Some(StopInput::Many(vec!["x".into(); MAX_STOP_STRINGS + 1])),
            ..Default::default()
        });
        assert_eq!((many.status, many.param.as_deref()), (400, Some("stop")));
        assert!(
            many.message.contains("stop holds 65 strings: at most 64"),
            "{}",
            many.message
        );
        let long = refused(RawSampling {
            stop: Some(StopInput::Many(vec![
                "a".into(),
                "y".repeat(MAX_STOP_BYTES + 1),
            ])),
            ..Default::default()
        });
        assert!(
            long.message.contains("stop[1] is 257 bytes long"),
            "{}",
            long.message
        );
        let ids = refused(RawSampling {
            stop_token_ids: Some(vec![7; MAX_STOP_TOKEN_IDS + 1]),
            ..Default::default()
        });
        assert_eq!(ids.param.as_deref(), Some("stop_token_ids"));
        // At the limits, accepted.
        let ok = RawSampling {
            stop: Some(StopInput::Many(vec![
                "z".repeat(MAX_STOP_BYTES);
                MAX_STOP_STRINGS
            ])),
            stop_token_ids: Some(vec![7; MAX_STOP_TOKEN_IDS]),
            ..Default::default()
        };
        assert_eq!(ok.into_params(16).unwrap().stop.len(), MAX_STOP_STRINGS);
    }
}
