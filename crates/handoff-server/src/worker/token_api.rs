//! `POST /tokenize` and `POST /detokenize` (SGLang's and vLLM's routes):
//! the served model's tokenizer over HTTP, with the same rules as a prompt
//! (a text is tokenized with special tokens parsed and the model's BOS;
//! `messages` go through the chat template, their contents as plain text),
//! on the blocking pool like every prompt.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::http::extract::JsonBody;
use crate::state::AppState;
use crate::worker::openai_types::MessageInput;
use crate::worker::prompt;

/// A text or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TextOrTexts {
    /// One text.
    One(String),
    /// Several texts, each tokenized on its own.
    Many(Vec<String>),
}

/// `POST /tokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeBody {
    /// Model name (any value is accepted; the server serves one model).
    #[serde(default)]
    pub model: Option<String>,
    /// The text(s) to tokenize.
    #[serde(default)]
    pub prompt: Option<TextOrTexts>,
    /// A conversation to render with the chat template, then tokenize.
    #[serde(default)]
    pub messages: Option<Vec<MessageInput>>,
    /// Add the model's BOS as a prompt gets it (default true); `false`
    /// tokenizes the text alone.
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Also return each token's text (vLLM's `token_strs`).
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

/// Token ids, one list or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum IdsOrIdLists {
    /// One list.
    One(Vec<u32>),
    /// Several lists, each decoded on its own.
    Many(Vec<Vec<u32>>),
}

/// `POST /detokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeBody {
    /// Model name (any value is accepted).
    #[serde(default)]
    pub model: Option<String>,
    /// The ids to turn back into text.
    pub tokens: IdsOrIdLists,
    /// Leave out special tokens' text (default false: every token shows).
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
}

/// `POST /tokenize`: `{"tokens", "count", "max_model_len"}` (lists of
/// those for several prompts), plus `token_strs` when asked.
pub async fn tokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<TokenizeBody>,
) -> Result<Json<Value>, ApiError> {
    let st = state.clone();
    prompt::off_runtime(move || tokenize_body(&st, body))
        .await
        .map(Json)
}

fn tokenize_body(state: &AppState, body: TokenizeBody) -> Result<Value, ApiError> {
    let engine = &state.engine;
    let bos = body.add_special_tokens.unwrap_or(true);
    let one = |text: &str| -> Result<Vec<u32>, ApiError> {
        if bos {
            prompt::text_prompt(engine, text)
        } else {
            prompt::text_prompt_without_bos(engine, text)
        }
    };
    let (ids, many): (Vec<Vec<u32>>, bool) = match (body.prompt, body.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "messages",
                "send either `prompt` or `messages`, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "send the text to tokenize as `prompt` (or a conversation as `messages`)",
            ))
        }
        (Some(TextOrTexts::One(t)), None) => (vec![one(&t)?], false),
        (Some(TextOrTexts::Many(ts)), None) => {
            if ts.len() > prompt::MAX_MESSAGES {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!(
                        "prompt holds {} texts, over the limit of {}",
                        ts.len(),
                        prompt::MAX_MESSAGES
                    ),
                ));
            }
            (ts.iter().map(|t| one(t)).collect::<Result<_, _>>()?, true)
        }
        (None, Some(messages)) => {
            if !bos {
                return Err(ApiError::invalid_param(
                    "add_special_tokens",
                    "a conversation is always rendered with the chat template's own tokens",
                ));
            }
            (vec![prompt::chat_prompt(engine, &messages, None)?], false)
        }
    };
    let tok = engine.tokenizer();
    let strs = |ids: &[u32]| -> Vec<String> {
        ids.iter()
            .map(|&id| {
                tok.token_bytes(id, false)
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default()
            })
            .collect()
    };
    let max_model_len = engine.model().context_length;
    let mut out = if many {
        json!({
            "tokens": ids,
            "count": ids.iter().map(Vec::len).collect::<Vec<_>>(),
            "max_model_len": max_model_len,
        })
    } else {
        json!({
            "tokens": ids[0],
            "count": ids[0].len(),
            "max_model_len": max_model_len,
        })
    };
    if body.return_token_strs == Some(true) {
        out["token_strs"] = if many {
            json!(ids.iter().map(|i| strs(i)).collect::<Vec<_>>())
        } else {
            json!(strs(&ids[0]))
        };
    }
    Ok(out)
}

/// `POST /detokenize`: `{"text"}` (a list of texts for several lists).
pub async fn detokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<DetokenizeBody>,
) -> Result<Json<Value>, ApiError> {
    let st = state.clone();
    prompt::off_runtime(move || detokenize_body(&st, body))
        .await
        .map(Json)
}

fn detokenize_body(state: &AppState, body: DetokenizeBody) -> Result<Value, ApiError> {
    let skip = body.skip_special_tokens.unwrap_or(false);
    let tok = state.engine.tokenizer();
    let decode = |ids: Vec<u32>, field: &str| -> Result<String, ApiError> {
        let ids = prompt::id_prompt(&state.engine, ids, field)?;
        Ok(tok.decode(&ids, skip)?)
    };
    Ok(match body.tokens {
        IdsOrIdLists::One(ids) => json!({ "text": decode(ids, "tokens")? }),
        IdsOrIdLists::Many(lists) => {
            let texts = lists
                .into_iter()
                .enumerate()
                .map(|(i, ids)| decode(ids, &format!("tokens[{i}]")))
                .collect::<Result<Vec<_>, _>>()?;
            json!({ "text": texts })
        }
    })
}
