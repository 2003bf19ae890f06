//! Tool calling on `/v1/chat/completions`: `tools`, `tool_choice` and
//! `parallel_tool_calls` read and checked; the tools, the assistant's past
//! calls and the tools' answers rendered into the conversation; calls
//! parsed out of the output (whole and streamed) into `tool_calls`.
//!
//! The format is Hermes's (the one Qwen2.5, Hermes and many fine-tunes are
//! trained on, and that llama.cpp and vLLM parse): the tools are described
//! in the system message inside `<tools></tools>`, a call is
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and a
//! tool's answer comes back as a user turn inside
//! `<tool_response></tool_response>`. It goes through the model's chat
//! template as plain messages, so any template renders it (a template's
//! own tool syntax is not used: said in the README).
//!
//! With `tool_choice: "required"` or a named function the output is
//! constrained (llguidance, [`crate::worker::structured`]) to calls whose
//! arguments follow each function's JSON schema, so they always parse.

use handoff_engine::grammar::GrammarSpec;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::http::errors::ApiError;

/// Most tools one request may give.
pub const MAX_TOOLS: usize = 128;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// What it does (for the model).
    pub description: Option<String>,
    /// Its arguments' JSON schema (an object schema).
    pub parameters: Value,
}

/// What the model may or must do with the tools.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// The tools are not shown and no call is parsed.
    None,
    /// The model answers in text or calls tools, as it likes.
    Auto,
    /// The model must call at least one tool.
    Required,
    /// The model must call this function.
    Named(String),
}

/// A request's tools and what to do with them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The functions offered.
    pub functions: Vec<Function>,
    /// `tool_choice`.
    pub choice: Choice,
    /// Whether several calls may come in one answer.
    pub parallel: bool,
}

#[derive(Deserialize)]
struct ToolInput {
    #[serde(rename = "type")]
    kind: String,
    function: Option<FunctionInput>,
}

#[derive(Deserialize)]
struct FunctionInput {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

impl Tools {
    /// Read `tools`, `tool_choice` and `parallel_tool_calls` out of `extra`;
    /// `None` when no tool is offered (or the choice is `none`).
    pub fn take(extra: &mut Map<String, Value>) -> Result<Option<Tools>, ApiError> {
        let tools = extra.remove("tools").unwrap_or(Value::Null);
        let choice = extra.remove("tool_choice").unwrap_or(Value::Null);
        let parallel = match extra.remove("parallel_tool_calls") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => b,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "parallel_tool_calls",
                    "parallel_tool_calls must be a boolean",
                ))
            }
        };
        let inputs: Vec<ToolInput> = match tools {
            Value::Null => Vec::new(),
            v => serde_json::from_value(v).map_err(|e| {
                ApiError::invalid_param(
                    "tools",
                    format!("tools must be a list of {{\"type\": \"function\", \"function\": {{\"name\", \"description\", \"parameters\"}}}}: {e}"),
                )
            })?,
        };
        if inputs.len() > MAX_TOOLS {
            return Err(ApiError::invalid_param(
                "tools",
                format!(
                    "tools holds {} tools: at most {MAX_TOOLS} are accepted",
                    inputs.len()
                ),
            ));
        }
        let mut functions = Vec::with_capacity(inputs.len());
        for (i, t) in inputs.into_iter().enumerate() {
            let param = format!("tools[{i}]");
            if t.kind != "function" {
                return Err(ApiError::invalid_param(
                    &format!("{param}.type"),
                    format!("{param} has type `{}`: only `function` tools exist", t.kind),
                ));
            }
            let f = t.function.ok_or_else(|| {
                ApiError::invalid_param(
                    &format!("{param}.function"),
                    format!("{param} has no `function`"),
                )
            })?;
            if f.name.is_empty()
                || f.name.len() > 64
                || !f
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(ApiError::invalid_param(
                    &format!("{param}.function.name"),
                    format!(
                        "{param}.function.name `{}` must be 1 to 64 letters, digits, `_` or `-`",
                        f.name
                    ),
                ));
            }
            if functions.iter().any(|g: &Function| g.name == f.name) {
                return Err(ApiError::invalid_param(
                    &format!("{param}.function.name"),
                    format!("two tools are named `{}`", f.name),
                ));
            }
            let parameters = match f.parameters {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p,
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        &format!("{param}.function.parameters"),
                        format!("{param}.function.parameters must be a JSON schema object"),
                    ))
                }
            };
            functions.push(Function {
                name: f.name,
                description: f.description,
                parameters,
            });
        }
        let choice = match &choice {
            Value::Null => Choice::Auto,
            Value::String(s) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice `{other}` is not one of none, auto, required, or a named function"),
                    ))
                }
            },
            Value::Object(o) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "tool_choice",
                            "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                    })?;
                if !functions.iter().any(|f| f.name == name) {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice names `{name}`, which is not among tools"),
                    ));
                }
                Choice::Named(name.to_string())
            }
            _ => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice must be a string or an object",
                ))
            }
        };
        if functions.is_empty() {
            return match choice {
                Choice::None | Choice::Auto => Ok(None),
                _ => Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice asks for a tool call but no tools are given",
                )),
            };
        }
        if choice == Choice::None {
            return Ok(None);
        }
        Ok(Some(Tools {
            functions,
            choice,
            parallel,
        }))
    }

    /// The system text that offers the tools.
    pub fn system_text(&self) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
        );
        for f in &self.functions {
            let mut function = json!({"name": f.name, "parameters": f.parameters});
            if let Some(d) = &f.description {
                function["description"] = json!(d);
            }
            s.push_str(&json!({"type": "function", "function": function}).to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }

    /// The grammar the output must follow: one call to the named function,
    /// or calls to any of them (`required`: one, or several with
    /// `parallel_tool_calls`); none for `auto`.
    pub fn grammar(&self) -> Option<GrammarSpec> {
        let allowed: Vec<&Function> = match &self.choice {
            Choice::Required => self.functions.iter().collect(),
            Choice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
            Choice::None | Choice::Auto => return None,
        };
        let calls: Vec<Value> = allowed
            .iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({
            "anyOf": calls,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        let one = format!("call: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\"");
        // A named function is called once (as vLLM and OpenAI do);
        // `required` may make several calls when parallel calls are on.
        let several = self.parallel && self.choice == Choice::Required;
        let start = if several {
            "start: call (\"\\n\" call)*"
        } else {
            "start: call"
        };
        Some(GrammarSpec::Lark(format!("{start}\n{one}\n")))
    }
}

/// An assistant message's past call, rendered back into the conversation.
pub fn render_call(name: &str, arguments: &str) -> String {
    let args: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!(arguments));
    format!(
        "{OPEN}\n{}\n{CLOSE}",
        json!({"name": name, "arguments": args})
    )
}

/// A tool's answer, rendered as the user turn that brings it back.
pub fn render_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// A call parsed out of the output.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The function called.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// What the output holds, piece by piece.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Text for `content`.
    Text(String),
    /// A call for `tool_calls`.
    Call(Call),
}

/// Splits output text into content and calls as it streams in: text that
/// could still be the start of a call is held back until it is known.
#[derive(Debug)]
pub struct Parser {
    names: Vec<String>,
    buf: String,
}

impl Parser {
    /// A parser accepting calls to these functions.
    pub fn new(tools: &Tools) -> Self {
        Self {
            names: tools.functions.iter().map(|f| f.name.clone()).collect(),
            buf: String::new(),
        }
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.buf.find(OPEN) {
                Some(at) => {
                    let Some(end) = self.buf[at..].find(CLOSE).map(|e| at + e) else {
                        // A call still coming: the text before it is known.
                        push_text(&mut out, self.buf[..at].to_string());
                        self.buf.drain(..at);
                        return out;
                    };
                    let body = self.buf[at + OPEN.len()..end].trim().to_string();
                    match self.call_of(&body) {
                        Some(call) => {
                            push_text(&mut out, self.buf[..at].to_string());
                            out.push(Piece::Call(call));
                        }
                        // Not a call to a given tool: it stays text.
                        None => push_text(&mut out, self.buf[..end + CLOSE.len()].to_string()),
                    }
                    self.buf.drain(..end + CLOSE.len());
                }
                None => {
                    // Hold back a tail that may begin `<tool_call>`.
                    let keep = (1..OPEN.len())
                        .rev()
                        .find(|&n| {
                            self.buf.len() >= n
                                && self.buf.is_char_boundary(self.buf.len() - n)
                                && OPEN.starts_with(&self.buf[self.buf.len() - n..])
                        })
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    push_text(&mut out, self.buf[..cut].to_string());
                    self.buf.drain(..cut);
                    return out;
                }
            }
        }
    }

    /// The rest, once the output ended: an unfinished call is text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        push_text(&mut out, std::mem::take(&mut self.buf));
        out
    }

    fn call_of(&self, body: &str) -> Option<Call> {
        let v: Value = serde_json::from_str(body).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let args = v.get("arguments").cloned().unwrap_or_else(|| json!({}));
        Some(Call {
            name: name.to_string(),
            arguments: args.to_string(),
        })
    }
}

fn push_text(out: &mut Vec<Piece>, text: String) {
    if !text.is_empty() {
        out.push(Piece::Text(text));
    }
}

/// A new call id (`call_` and 24 hex digits).
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Result<Option<Tools>, ApiError> {
        let mut extra = json!({
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                {"type": "function", "function": {"name": "now"}}
            ],
            "tool_choice": choice,
        })
        .as_object()
        .unwrap()
        .clone();
        Tools::take(&mut extra)
    }

    #[test]
    fn choices_read_and_bad_tools_name_the_field() {
        assert_eq!(tools(json!("auto")).unwrap().unwrap().choice, Choice::Auto);
        assert_eq!(tools(json!("none")).unwrap(), None);
        let t = tools(json!({"type": "function", "function": {"name": "now"}}))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, Choice::Named("now".into()));
        assert_eq!(
            t.functions[1].parameters,
            json!({"type": "object", "properties": {}})
        );
        let e = tools(json!({"type": "function", "function": {"name": "later"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(
            e.message.contains("`later`, which is not among tools"),
            "{}",
            e.message
        );
        let e = tools(json!("sometimes")).unwrap_err();
        assert!(
            e.message.contains("tool_choice `sometimes`"),
            "{}",
            e.message
        );
        let mut extra = json!({"tools": [{"type": "retrieval"}]})
            .as_object()
            .unwrap()
            .clone();
        let e = Tools::take(&mut extra).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let mut extra = json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})
            .as_object()
            .unwrap()
            .clone();
        let e = Tools::take(&mut extra).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
        let mut extra = json!({"tool_choice": "required"})
            .as_object()
            .unwrap()
            .clone();
        assert!(Tools::take(&mut extra).is_err());
    }

    #[test]
    fn calls_split_from_text_whatever_the_chunking() {
        let t = tools(json!("auto")).unwrap().unwrap();
        let out = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"nope\"}</tool_call> <tool";
        let want = vec![
            Piece::Text("Let me check.".into()),
            Piece::Call(Call {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
            }),
            Piece::Text("\n<tool_call>{\"name\": \"nope\"}</tool_call> <tool".into()),
        ];
        for step in [1, 2, 5, 7, out.len()] {
            let mut p = Parser::new(&t);
            let mut got: Vec<Piece> = Vec::new();
            let bytes: Vec<char> = out.chars().collect();
            for chunk in bytes.chunks(step) {
                got.extend(p.push(&chunk.iter().collect::<String>()));
            }
            got.extend(p.finish());
            // Join adjacent text pieces (chunking splits text anywhere).
            let mut joined: Vec<Piece> = Vec::new();
            for piece in got {
                match (joined.last_mut(), piece) {
                    (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                    (_, p) => joined.push(p),
                }
            }
            assert_eq!(joined, want, "chunks of {step}");
        }
    }
}
