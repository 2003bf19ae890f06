//! Sampling fields shared by the OpenAI and SGLang request shapes, checked
//! and turned into the engine's [`SamplingParams`] with messages that name
//! the field and the accepted range.

use handoff_engine::request::{Penalties, SamplingParams};
use serde::Deserialize;

use crate::http::errors::ApiError;

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
    /// Name under which the client sent the minimum output (`min_tokens`,
    /// `min_new_tokens`).
    pub min_tokens_field: &'static str,
    /// Minimum output before any end of generation.
    pub min_tokens: Option<i64>,
    /// Min-p filter.
    pub min_p: Option<f64>,
    /// Presence penalty.
    pub presence_penalty: Option<f64>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f64>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string, OpenAI's shape) → bias.
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    /// Special tokens add no text (default true).
    pub skip_special_tokens: Option<bool>,
    /// Spaces around special tokens in the text (default true).
    pub spaces_between_special_tokens: Option<bool>,
}

/// `value` of `field` if it lies in `range`, else a 400 naming the field.
fn in_range(
    field: &'static str,
    value: Option<f64>,
    default: f32,
    range: std::ops::RangeInclusive<f64>,
    what: &str,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if v.is_finite() && range.contains(&v) => Ok(v as f32),
        Some(v) => Err(ApiError::invalid_param(
            field,
            format!("{field} must be {what}, got {v}"),
        )),
    }
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

/// The sampling a request gets for the fields it leaves unset: the
/// model file's own recommendation (`general.sampling.*`) where it has one,
/// else llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95,
/// min_p 0.05), which is what a user of `llama-server` expects of the same
/// file. Sent explicitly, a field is always the client's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Defaults {
    /// Temperature (0 is greedy).
    pub temperature: f32,
    /// Top-k (0 is off).
    pub top_k: usize,
    /// Top-p.
    pub top_p: f32,
    /// Min-p.
    pub min_p: f32,
    /// Repetition penalty (1 is off).
    pub repetition_penalty: f32,
}

impl Defaults {
    /// llama.cpp's sampler defaults (`common/common.h`).
    pub const LLAMA_CPP: Defaults = Defaults {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repetition_penalty: 1.0,
    };

    /// The defaults of the model `engine` serves.
    pub fn of_backend(engine: &crate::worker::backend::Backend) -> Defaults {
        Self::of(&engine.model().sampling_defaults)
    }

    /// The file's values over llama.cpp's.
    pub fn of(file: &handoff_model::SamplingDefaults) -> Defaults {
        let d = Self::LLAMA_CPP;
        Defaults {
            temperature: file.temperature.unwrap_or(d.temperature),
            top_k: file.top_k.map_or(d.top_k, |k| k as usize),
            top_p: file.top_p.unwrap_or(d.top_p),
            min_p: file.min_p.unwrap_or(d.min_p),
            repetition_penalty: file.repetition_penalty.unwrap_or(d.repetition_penalty),
        }
    }
}

impl RawSampling {
    /// Validate and convert. `default_max` is used when no limit was given;
    /// `defaults` ([`Defaults::of`]) for the sampling fields left unset.
    pub fn into_params(
        self,
        default_max: usize,
        defaults: &Defaults,
    ) -> Result<SamplingParams, ApiError> {
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
            None => defaults.temperature,
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
            None => defaults.top_p,
            Some(p) if p.is_finite() && p > 0.0 && p <= 1.0 => p as f32,
            Some(p) => {
                return Err(ApiError::invalid_param(
                    "top_p",
                    format!("top_p must be in (0, 1], got {p}"),
                ))
            }
        };
        let top_k = match self.top_k {
            None => defaults.top_k,
            Some(-1) | Some(0) => 0,
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
        let min_p = in_range("min_p", self.min_p, defaults.min_p, 0.0..=1.0, "in [0, 1]")?;
        let presence = in_range(
            "presence_penalty",
            self.presence_penalty,
            0.0,
            -2.0..=2.0,
            "in [-2, 2]",
        )?;
        let frequency = in_range(
            "frequency_penalty",
            self.frequency_penalty,
            0.0,
            -2.0..=2.0,
            "in [-2, 2]",
        )?;
        let repetition = match self.repetition_penalty {
            Some(r) if r <= 0.0 => {
                return Err(ApiError::invalid_param(
                    "repetition_penalty",
                    format!("repetition_penalty must be in (0, 2] (1 is off), got {r}"),
                ))
            }
            r => in_range(
                "repetition_penalty",
                r,
                defaults.repetition_penalty,
                0.0..=2.0,
                "in (0, 2] (1 is off)",
            )?,
        };
        let logit_bias = parse_logit_bias(self.logit_bias)?;
        let min_field = if self.min_tokens_field.is_empty() {
            "min_tokens"
        } else {
            self.min_tokens_field
        };
        let min_new_tokens = match self.min_tokens {
            None => 0,
            Some(n) if n >= 0 && (n as u64) <= max_new_tokens as u64 => n as usize,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    min_field,
                    format!(
                        "{min_field} must be between 0 and {field} ({max_new_tokens}), got {n}"
                    ),
                ))
            }
        };
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            max_new_tokens,
            stop,
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_p,
            penalties: Penalties {
                presence,
                frequency,
                repetition,
                logit_bias,
            },
            min_new_tokens,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            spaces_between_special_tokens: self.spaces_between_special_tokens.unwrap_or(true),
            top_logprobs: 0,
            prompt_logprobs: false,
            grammar: None,
        })
    }
}

/// Every token id a request names (`logit_bias`, `stop_token_ids`) is in
/// the vocabulary; a 400 naming the field otherwise.
pub fn check_token_ids(p: &SamplingParams, vocab_size: usize) -> Result<(), ApiError> {
    if let Some(&(id, _)) = p
        .penalties
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= vocab_size)
    {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("logit_bias names token {id}, outside the vocabulary of {vocab_size} tokens"),
        ));
    }
    if let Some(&id) = p
        .stop_token_ids
        .iter()
        .find(|&&id| id as usize >= vocab_size)
    {
        return Err(ApiError::invalid_param(
            "stop_token_ids",
            format!(
                "stop_token_ids names token {id}, outside the vocabulary of {vocab_size} tokens"
            ),
        ));
    }
    Ok(())
}

/// Most `logit_bias` entries one request may give (the engine's bound).
pub const MAX_LOGIT_BIAS: usize = handoff_engine::engine::MAX_LOGIT_BIAS;

/// `logit_bias` as OpenAI sends it: token ids as strings, biases in
/// [-100, 100]; sorted by id. The engine checks the ids against the
/// vocabulary.
fn parse_logit_bias(
    bias: Option<std::collections::HashMap<String, f64>>,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let bias = bias.unwrap_or_default();
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!(
                "logit_bias holds {} tokens: at most {MAX_LOGIT_BIAS} are accepted",
                bias.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(bias.len());
    for (k, v) in bias {
        let id: u32 = k.trim().parse().map_err(|_| {
            ApiError::invalid_param(
                "logit_bias",
                format!("logit_bias keys are token ids, got {k:?}"),
            )
        })?;
        if !(v.is_finite() && (-100.0..=100.0).contains(&v)) {
            return Err(ApiError::invalid_param(
                "logit_bias",
                format!("logit_bias[{k}] must be in [-100, 100], got {v}"),
            ));
        }
        out.push((id, v as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

/// A request's count of alternatives per position (`top_logprobs`,
/// completions' `logprobs`, SGLang's `top_logprobs_num`): 0 to
/// [`handoff_model::sampling::MAX_TOP_LOGPROBS`], else a 400 naming `field`.
pub fn top_logprobs(field: &'static str, n: Option<i64>) -> Result<usize, ApiError> {
    let max = handoff_model::sampling::MAX_TOP_LOGPROBS;
    match n {
        None => Ok(0),
        Some(n) if (0..=max as i64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid_param(
            field,
            format!("{field} must be between 0 and {max}, got {n}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let p = RawSampling::default()
            .into_params(16, &Defaults::LLAMA_CPP)
            .unwrap();
        assert_eq!(p.max_new_tokens, 16);
        assert_eq!(p.temperature, 0.8);
        assert_eq!((p.top_k, p.top_p, p.min_p, p.seed), (40, 0.95, 0.05, None));
        // The file's recommendation wins over llama.cpp's; the request's
        // own fields over both.
        let file = handoff_model::SamplingDefaults {
            temperature: Some(1.0),
            top_k: Some(64),
            top_p: None,
            min_p: Some(0.0),
            repetition_penalty: None,
        };
        let p = RawSampling::default()
            .into_params(16, &Defaults::of(&file))
            .unwrap();
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.min_p),
            (1.0, 64, 0.95, 0.0)
        );
        let asked = RawSampling {
            temperature: Some(0.0),
            top_k: Some(-1),
            ..Default::default()
        };
        let p = asked.into_params(16, &Defaults::of(&file)).unwrap();
        assert_eq!((p.temperature, p.top_k), (0.0, 0));
    }

    #[test]
    fn rejects_out_of_range_values_by_name() {
        let bad = |r: RawSampling, needle: &str| {
            let e = r.into_params(16, &Defaults::LLAMA_CPP).unwrap_err();
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
        let refused = |r: RawSampling| r.into_params(16, &Defaults::LLAMA_CPP).unwrap_err();
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
        assert_eq!(
            ok.into_params(16, &Defaults::LLAMA_CPP).unwrap().stop.len(),
            MAX_STOP_STRINGS
        );
    }
}
