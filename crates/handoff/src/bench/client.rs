//! One streamed request of `handoff bench` and its timings: the SSE stream is
//! cut into events by a byte-level parser (robust to events and UTF-8 split
//! across chunks), each event is classified, and the shell stamps them with
//! `Instant`s.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::workload::{Endpoint, Prompt, RequestSpec};

/// One server-sent event's payload.
#[derive(Debug, Clone, PartialEq)]
pub enum SseEvent {
    /// `data: [DONE]`.
    Done,
    /// A JSON payload.
    Json(Value),
    /// A payload that is not JSON.
    Malformed(String),
}

/// Cuts a byte stream into SSE events: `data:` lines are gathered until a
/// blank line; other fields and comments are skipped.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Feed one chunk; returns the events it completes.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let mut line = &self.buf[start..start + nl];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            let line = String::from_utf8_lossy(line).into_owned();
            start += nl + 1;
            self.line(&line, &mut out);
        }
        self.buf.drain(..start);
        out
    }

    /// The stream ended: an event not closed by a blank line still counts.
    pub fn finish(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.buf.is_empty() {
            let rest = String::from_utf8_lossy(&std::mem::take(&mut self.buf)).into_owned();
            self.line(rest.trim_end_matches('\r'), &mut out);
        }
        self.line("", &mut out);
        out
    }

    fn line(&mut self, line: &str, out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                out.push(if data.trim() == "[DONE]" {
                    SseEvent::Done
                } else {
                    match serde_json::from_str(&data) {
                        Ok(v) => SseEvent::Json(v),
                        Err(_) => SseEvent::Malformed(data),
                    }
                });
            }
        } else if let Some(rest) = line.strip_prefix("data:") {
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(rest);
                }
                None => self.data = Some(rest.to_string()),
            }
        }
    }
}

/// What a JSON event of an OpenAI stream means to the benchmark.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// `{"error": ...}`: the request failed with this message.
    Error(String),
    /// A regular chunk.
    Data {
        /// It carries generated tokens: text, or (completions) a token chunk
        /// whose text is still held back (`finish_reason` null).
        content: bool,
        /// `usage.completion_tokens`, if present.
        completion_tokens: Option<u64>,
        /// `usage.prompt_tokens_details.cached_tokens`, if present.
        cached_tokens: Option<u64>,
    },
}

fn non_empty(v: &Value) -> bool {
    v.as_str().is_some_and(|s| !s.is_empty())
}

/// Classify one JSON event.
pub fn classify(v: &Value) -> Chunk {
    if let Some(e) = v.get("error") {
        let msg = e
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| e.to_string());
        return Chunk::Error(msg);
    }
    let content = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .is_some_and(|c| {
            let delta = c.get("delta");
            non_empty(&c["text"])
                || delta
                    .is_some_and(|d| non_empty(&d["content"]) || non_empty(&d["reasoning_content"]))
                || (c.get("text").is_some() && c["finish_reason"].is_null())
        });
    let usage = v.get("usage");
    Chunk::Data {
        content,
        completion_tokens: usage
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64),
        cached_tokens: usage
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64),
    }
}

/// Why a request failed, by kind (the report counts kinds).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// `connect`, `timeout`, `transport`, `http_<status>`, `sse_error`,
    /// `bad_event` or `incomplete`.
    pub kind: String,
    /// Human-readable detail.
    pub message: String,
}

/// Timings of one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Time from send to the first content event.
    pub ttft: Option<Duration>,
    /// Gaps between successive content events.
    pub itl: Vec<Duration>,
    /// Time from send to the end of the stream.
    pub e2e: Duration,
    /// Output tokens: usage, else the number of content events.
    pub output_tokens: u64,
    /// Prompt length sent.
    pub prompt_tokens: u32,
    /// Prompt tokens the server reported as served from its prefix cache.
    pub cached_tokens: u64,
    /// Workload class of the request.
    pub class: usize,
    /// Set if the request failed.
    pub failure: Option<Failure>,
}

/// The JSON body of a request.
pub fn body(spec: &RequestSpec, endpoint: Endpoint, model: Option<&str>) -> Value {
    let mut b = json!({
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": 0,
        "ignore_eos": true,
        "max_tokens": spec.max_tokens,
    });
    match (&spec.prompt, endpoint) {
        (Prompt::Ids(ids), _) => b["prompt"] = json!(ids),
        (Prompt::Text(t), Endpoint::Chat) => {
            b["messages"] = json!([{"role": "user", "content": t}])
        }
        (Prompt::Text(t), Endpoint::Completions) => b["prompt"] = json!(t),
    }
    if let Some(m) = model {
        b["model"] = json!(m);
    }
    b
}

/// The innermost cause of an error, in words (`connection refused` rather
/// than reqwest's outer "error sending request").
pub fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    if let Some(io) = cur.downcast_ref::<std::io::Error>() {
        if io.kind() == std::io::ErrorKind::ConnectionRefused {
            return "connection refused".into();
        }
    }
    cur.to_string()
}

fn transport_failure(e: &reqwest::Error) -> Failure {
    let kind = if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else {
        "transport"
    };
    Failure {
        kind: kind.into(),
        message: format!("{kind}: {}", root_cause(e)),
    }
}

/// Send one request (`body`, made from `spec`) and time its stream.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    spec: &RequestSpec,
    timeout: Duration,
) -> Outcome {
    let t0 = Instant::now();
    let mut out = Outcome {
        prompt_tokens: spec.prompt_len,
        class: spec.class,
        ..Outcome::default()
    };
    let fail = |mut out: Outcome, f: Failure| {
        out.e2e = t0.elapsed();
        out.failure = Some(f);
        out
    };
    let mut resp = match client.post(url).json(body).timeout(timeout).send().await {
        Ok(r) => r,
        Err(e) => return fail(out, transport_failure(&e)),
    };
    let status = resp.status();
    if status != reqwest::StatusCode::OK {
        let text = resp.text().await.unwrap_or_default();
        let detail = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| text.chars().take(200).collect());
        let f = Failure {
            kind: format!("http_{}", status.as_u16()),
            message: format!("HTTP {status}: {detail}"),
        };
        return fail(out, f);
    }
    let mut parser = SseParser::default();
    let mut last: Option<Instant> = None;
    let mut content_events = 0u64;
    let mut usage = None;
    let mut done = false;
    loop {
        let (events, end) = match resp.chunk().await {
            Ok(Some(bytes)) => (parser.push(&bytes), false),
            Ok(None) => (parser.finish(), true),
            Err(e) => return fail(out, transport_failure(&e)),
        };
        let now = Instant::now();
        for ev in events {
            match ev {
                SseEvent::Done => done = true,
                SseEvent::Malformed(s) => {
                    let f = Failure {
                        kind: "bad_event".into(),
                        message: format!(
                            "event is not JSON: {}",
                            s.chars().take(200).collect::<String>()
                        ),
                    };
                    return fail(out, f);
                }
                SseEvent::Json(v) => match classify(&v) {
                    Chunk::Error(message) => {
                        let f = Failure {
                            kind: "sse_error".into(),
                            message: format!("error event: {message}"),
                        };
                        return fail(out, f);
                    }
                    Chunk::Data {
                        content,
                        completion_tokens,
                        cached_tokens,
                    } => {
                        usage = completion_tokens.or(usage);
                        if let Some(c) = cached_tokens {
                            out.cached_tokens = c;
                        }
                        if content {
                            content_events += 1;
                            match last {
                                None => out.ttft = Some(now - t0),
                                Some(prev) => out.itl.push(now - prev),
                            }
                            last = Some(now);
                        }
                    }
                },
            }
        }
        if done || end {
            break;
        }
    }
    out.e2e = t0.elapsed();
    out.output_tokens = usage.unwrap_or(content_events);
    if !done {
        out.failure = Some(Failure {
            kind: "incomplete".into(),
            message: "stream ended without data: [DONE]".into(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":null}]}\n\n",
        ": keep-alive comment\n\n",
        "data: {\"choices\":[{\"index\":0,\"text\":\"h\u{e9}llo\",\"finish_reason\":null}]}\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n",
        "data: [DONE]\n\n",
    );

    fn parse_in_pieces(bytes: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for c in bytes.chunks(piece) {
            out.extend(p.push(c));
        }
        out.extend(p.finish());
        out
    }

    #[test]
    fn split_chunks_give_the_same_events() {
        let whole = parse_in_pieces(STREAM.as_bytes(), STREAM.len());
        assert_eq!(whole.len(), 5);
        assert_eq!(whole[4], SseEvent::Done);
        let SseEvent::Json(v) = &whole[1] else {
            panic!("{whole:?}")
        };
        assert_eq!(v["choices"][0]["text"], "h\u{e9}llo");
        // Every split point, including inside "é" and inside "\r\n".
        for piece in 1..STREAM.len() {
            assert_eq!(
                parse_in_pieces(STREAM.as_bytes(), piece),
                whole,
                "piece {piece}"
            );
        }
        let kinds: Vec<Chunk> = whole[..4]
            .iter()
            .map(|e| match e {
                SseEvent::Json(v) => classify(v),
                other => panic!("{other:?}"),
            })
            .collect();
        let data = |content, completion_tokens| Chunk::Data {
            content,
            completion_tokens,
            cached_tokens: None,
        };
        assert_eq!(
            kinds,
            [
                data(true, None),
                data(true, None),
                data(false, None),
                data(false, Some(2))
            ]
        );
    }

    #[test]
    fn unterminated_last_event_and_multiline_data() {
        let mut p = SseParser::default();
        assert_eq!(p.push(b"data: {\"a\":\ndata: 1}\n"), []);
        assert_eq!(p.push(b"\ndata: [DONE]"), [SseEvent::Json(json!({"a": 1}))]);
        assert_eq!(p.finish(), [SseEvent::Done]);
        let mut p = SseParser::default();
        assert_eq!(
            p.push(b"data: not json\n\n"),
            [SseEvent::Malformed("not json".into())]
        );
    }

    #[test]
    fn error_event_is_a_failure_with_its_message() {
        let ev = parse_in_pieces(
            b"data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"code\":\"model_error\"}}\n\n",
            7,
        );
        let [SseEvent::Json(v)] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        assert_eq!(classify(v), Chunk::Error("boom".into()));
        assert_eq!(
            classify(&json!({"error": "plain"})),
            Chunk::Error("\"plain\"".into())
        );
    }

    #[test]
    fn the_usage_chunk_reports_prefix_cache_hits() {
        let usage = json!({"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,
            "prompt_tokens_details":{"cached_tokens":32}}});
        assert_eq!(
            classify(&usage),
            Chunk::Data {
                content: false,
                completion_tokens: Some(2),
                cached_tokens: Some(32)
            }
        );
    }

    #[test]
    fn chat_chunks_count_only_with_content() {
        let role =
            json!({"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]});
        let tok = json!({"choices":[{"delta":{"content":"hi"},"finish_reason":null}]});
        assert_eq!(
            classify(&role),
            Chunk::Data {
                content: false,
                completion_tokens: None,
                cached_tokens: None
            }
        );
        assert_eq!(
            classify(&tok),
            Chunk::Data {
                content: true,
                completion_tokens: None,
                cached_tokens: None
            }
        );
    }

    #[test]
    fn bodies_follow_the_openai_shape() {
        let spec = RequestSpec {
            prompt: Prompt::Ids(vec![101, 102]),
            class: 0,
            prompt_len: 2,
            max_tokens: 5,
        };
        let b = body(&spec, Endpoint::Completions, Some("m"));
        assert_eq!(b["prompt"], json!([101, 102]));
        assert_eq!(b["max_tokens"], 5);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["model"], "m");
        let spec = RequestSpec {
            prompt: Prompt::Text("a b".into()),
            class: 0,
            prompt_len: 2,
            max_tokens: 5,
        };
        let b = body(&spec, Endpoint::Chat, None);
        assert_eq!(b["messages"][0]["content"], "a b");
        assert!(b.get("model").is_none());
    }
}
