//! Turning request inputs into prompt token ids: chat messages through the
//! model's chat template (message contents read as plain text, so only the
//! template's markup yields control tokens), texts through the tokenizer
//! (special tokens parsed, BOS only if the GGUF asks for it), token ids
//! checked against the vocabulary.
//!
//! This is CPU work proportional to the request body: handlers run it
//! through [`off_runtime`], on tokio's blocking pool, so a huge prompt never
//! holds a runtime thread that `/health` and every other request need; and a
//! text that cannot fit the context is refused before it is tokenized.

use crate::worker::backend::Backend;
use handoff_model::chat_template::ChatMessage;

use crate::http::errors::ApiError;
use crate::worker::openai_types::{ContentInput, MessageInput, PromptInput};
use crate::worker::tools::Tools;

/// Roles accepted in `messages` (`developer` is read as `system`).
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];
/// Most messages one conversation may hold.
pub const MAX_MESSAGES: usize = 4096;

/// Run `f` (templating, tokenizing, checking a request) on tokio's blocking
/// pool and wait for it.
pub async fn off_runtime<T, F>(f: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            500,
            "internal_error",
            format!("preparing the prompt failed: {e}"),
        ))
    })
}

/// Refuse, without tokenizing it, a prompt whose `bytes` of text cannot fit
/// the model's context whatever their tokens (no token stands for more than
/// the longest token's text).
fn check_fits(engine: &Backend, bytes: usize) -> Result<(), ApiError> {
    let least = bytes / engine.tokenizer().max_token_len();
    let context = engine.model().context_length;
    if least > context {
        return Err(ApiError::new(
            400,
            "context_length_exceeded",
            format!(
                "the prompt of {bytes} bytes is at least {least} tokens, over the context length of {context} tokens"
            ),
        ));
    }
    Ok(())
}

/// Check the messages and render them with the chat template.
pub fn chat_prompt(
    engine: &Backend,
    messages: &[MessageInput],
    tools: Option<&Tools>,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must contain at least one message",
        ));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid_param(
            "messages",
            format!(
                "messages holds {} messages: at most {MAX_MESSAGES} are accepted",
                messages.len()
            ),
        ));
    }
    let mut conv = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "developer" => "system",
            r if ROLES.contains(&r) => r,
            other => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!(
                        "messages[{i}] has unknown role `{other}`: expected one of {}",
                        ROLES.join(", ")
                    ),
                ))
            }
        };
        let calls = m.tool_calls.as_deref().unwrap_or_default();
        if !calls.is_empty() && role != "assistant" {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].tool_calls"),
                format!("messages[{i}] has tool_calls but role `{role}`: only assistant messages call tools"),
            ));
        }
        let mut content = match &m.content {
            None if !calls.is_empty() => String::new(),
            None => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].content"),
                    format!("messages[{i}] ({role}) has no content"),
                ))
            }
            Some(ContentInput::Text(t)) => t.clone(),
            Some(ContentInput::Parts(parts)) => {
                let mut s = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid_param(
                                &format!("messages[{i}].content[{j}].text"),
                                format!("messages[{i}].content[{j}] is a text part without `text`"),
                            ))
                        }
                        (kind, _) => {
                            return Err(ApiError::invalid_param(
                                &format!("messages[{i}].content[{j}].type"),
                                format!(
                                    "messages[{i}].content[{j}] has type `{kind}`: only `text` parts are supported"
                                ),
                            ))
                        }
                    }
                }
                s
            }
        };
        // Past calls and tools' answers in the Hermes format the tools
        // are offered in ([`crate::worker::tools`]).
        for c in calls {
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&crate::worker::tools::render_call(
                &c.function.name,
                &c.function.arguments,
            ));
        }
        if role == "tool" {
            conv.push(ChatMessage::new(
                "user",
                crate::worker::tools::render_response(&content),
            ));
        } else {
            conv.push(ChatMessage::new(role, content));
        }
    }
    if let Some(t) = tools {
        match conv.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{}", first.content, t.system_text());
            }
            _ => conv.insert(0, ChatMessage::new("system", t.system_text())),
        }
    }
    // The rendered prompt holds every message's text.
    check_fits(engine, conv.iter().map(|m| m.content.len()).sum())?;
    let template = engine.chat_template().ok_or_else(|| {
        ApiError::bad_request(
            "no_chat_template",
            "the model has no chat template: use /v1/completions or /generate with a raw prompt",
        )
    })?;
    // User text is text: only the template's own markup yields control
    // tokens, so a message cannot close its turn and forge a system one.
    let rendered = template.render_marked(&conv, true)?;
    if !rendered.verbatim {
        // The template rewrote some content, so where it lies is unknown:
        // refuse the spelling of a control token rather than obey it.
        for (i, m) in conv.iter().enumerate() {
            if let Some(t) = engine.tokenizer().spelled_control_token(&m.content) {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].content"),
                    format!(
                        "messages[{i}].content spells the control token `{t}`, which this model's chat template cannot keep apart from its own markup"
                    ),
                ));
            }
        }
    }
    marked_prompt(engine, &rendered.text, &rendered.content)
}

/// Tokenize a text prompt (special tokens parsed; BOS if the model wants one).
pub fn text_prompt(engine: &Backend, text: &str) -> Result<Vec<u32>, ApiError> {
    marked_prompt(engine, text, &[])
}

/// Tokenize a text as [`text_prompt`] does, without the model's BOS.
pub fn text_prompt_without_bos(engine: &Backend, text: &str) -> Result<Vec<u32>, ApiError> {
    check_fits(engine, text.len())?;
    Ok(engine.tokenizer().encode_marked(text, true, &[])?)
}

/// [`text_prompt`] with the `plain` byte ranges read as plain text.
fn marked_prompt(
    engine: &Backend,
    text: &str,
    plain: &[std::ops::Range<usize>],
) -> Result<Vec<u32>, ApiError> {
    check_fits(engine, text.len())?;
    let tok = engine.tokenizer();
    let ids = tok.encode_marked(text, true, plain)?;
    let mut out = Vec::with_capacity(ids.len() + 1);
    if tok.add_bos() {
        if let Some(bos) = tok.bos_id() {
            if ids.first() != Some(&bos) {
                out.push(bos);
            }
        }
    }
    out.extend(ids);
    Ok(out)
}

/// Check token ids given directly by the client.
pub fn id_prompt(engine: &Backend, ids: Vec<u32>, field: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = engine.tokenizer().vocab_size();
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(ApiError::invalid_param(
            field,
            format!("{field}[{i}] = {id} is out of range for a vocabulary of {vocab} tokens"),
        ));
    }
    Ok(ids)
}

/// The prompts of `/v1/completions`: one text or id list, or a list of
/// them (each answered by its own choices).
pub fn completion_prompts(
    engine: &Backend,
    prompt: PromptInput,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let some = |n: usize| {
        if n == 0 {
            Err(ApiError::invalid_param(
                "prompt",
                "prompt is an empty list: send at least one prompt",
            ))
        } else if n > crate::worker::choices::MAX_CHOICES {
            Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "prompt holds {n} prompts: at most {} per request",
                    crate::worker::choices::MAX_CHOICES
                ),
            ))
        } else {
            Ok(())
        }
    };
    match prompt {
        PromptInput::Text(t) => Ok(vec![text_prompt(engine, &t)?]),
        PromptInput::Ids(ids) => Ok(vec![id_prompt(engine, ids, "prompt")?]),
        PromptInput::Texts(v) => {
            some(v.len())?;
            v.iter().map(|t| text_prompt(engine, t)).collect()
        }
        PromptInput::IdLists(v) => {
            some(v.len())?;
            v.into_iter()
                .enumerate()
                .map(|(i, ids)| id_prompt(engine, ids, &format!("prompt[{i}]")))
                .collect()
        }
    }
}
