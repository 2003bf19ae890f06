//! What a worker serves: the colocated engine, or one
//! side of a prefill/decode pair. A PD worker takes SGLang's bootstrap
//! fields from each request: the prefill needs `bootstrap_room`, the decode
//! needs `bootstrap_host`, `bootstrap_port` and `bootstrap_room` to find the
//! prefill's transfer endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use handoff_engine::handle::{EngineHandle, LoadSnapshot, ModelInfo, RequestStream};
use handoff_engine::pd::{DecodeHandle, OnTransferFailure, PrefillHandle, PrefillTicket, RoomId};
use handoff_engine::request::GenerateRequest;
use handoff_engine::EngineError;
use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;
use serde_json::Value;

use crate::http::errors::ApiError;

/// What a PD worker's transfer endpoint reports for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferSnapshot {
    /// KV bytes sent to decode workers (prefill; a total that only grows).
    pub kv_bytes_sent: u64,
    /// Rooms the endpoint holds now.
    pub live_rooms: usize,
    /// Decode: requests it prefilled itself, and why.
    pub local_prefills: handoff_engine::pd::LocalPrefills,
}

/// The engine behind a worker.
#[derive(Clone)]
pub enum Backend {
    /// Prefill and decode in one engine (no transfer): the baseline.
    Colocated(EngineHandle),
    /// The prefill side of PD serving.
    Prefill(PrefillHandle),
    /// The decode side of PD serving.
    Decode(DecodeHandle),
}

/// A request's PD fields (SGLang's names), range-checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bootstrap {
    /// The prefill's host.
    pub host: Option<String>,
    /// The prefill's bootstrap (transfer) port.
    pub port: Option<u16>,
    /// The room pairing the two halves.
    pub room: Option<u64>,
    /// The router's signature of host, port and room
    /// ([`handoff_proto::bootstrap_auth`]).
    pub sig: Option<String>,
    /// When the router signed, seconds since the Unix epoch.
    pub ts: Option<u64>,
    /// Set once [`crate::AppState::check_bootstrap`] found the endpoint
    /// trusted: a decode backend dials nothing else.
    pub(crate) trusted: bool,
    /// The routing fields handoff adds to SGLang's (set by `handoff router`).
    pub handover: Handover,
}

/// handoff's routing fields: how a request reaches its decode worker when
/// it is not (only) a prefill's KV.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Handover {
    /// `local_prefill`: a decode worker prefills the prompt itself (no
    /// bootstrap fields: no prefill worker is involved).
    pub local: bool,
    /// `on_transfer_failure`: what a decode worker does when the KV transfer
    /// fails (`None`: the worker's `--on-transfer-failure`).
    pub on_failure: Option<OnTransferFailure>,
    /// `resume_output_ids`: output another decode worker already streamed
    /// (mid-stream migration); this worker generates what follows.
    pub resume: Vec<u32>,
    /// `stream_marks`: each streamed event carries, in an SSE comment, the
    /// ids of the tokens it covers (and `end` on the last one), so the
    /// router knows what the client has if it must migrate the stream.
    pub marks: bool,
    /// The request's W3C `traceparent` header: its spans' parent.
    pub traceparent: Option<String>,
    /// `priority` and the tenant: the order it waits in
    /// ([`crate::http::tenancy`]).
    pub class: handoff_engine::fair::Class,
}

/// A request's `traceparent` header, if it has one.
pub fn traceparent_of(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

impl Handover {
    /// Check the raw fields; `null` means absent.
    pub fn parse(
        resume: Option<&Value>,
        local: Option<&Value>,
        on_failure: Option<&Value>,
        marks: Option<&Value>,
    ) -> Result<Self, ApiError> {
        let flag = |field: &str, v: Option<&Value>| -> Result<bool, ApiError> {
            match v.filter(|v| !v.is_null()) {
                None => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(ApiError::invalid_param(
                    field,
                    format!("{field} must be true or false, got {v}"),
                )),
            }
        };
        let on_failure = match on_failure.filter(|v| !v.is_null()) {
            None => None,
            Some(Value::String(s)) => Some(s.parse().map_err(|e: String| {
                ApiError::invalid_param("on_transfer_failure", format!("on_transfer_failure {e}"))
            })?),
            Some(v) => {
                return Err(ApiError::invalid_param(
                    "on_transfer_failure",
                    format!("on_transfer_failure must be \"recompute\" or \"fail\", got {v}"),
                ))
            }
        };
        let resume = match resume.filter(|v| !v.is_null()) {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| {
                            ApiError::invalid_param(
                                "resume_output_ids",
                                format!("resume_output_ids[{i}] must be a token id (an integer 0..2^32), got {v}"),
                            )
                        })
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(ApiError::invalid_param(
                    "resume_output_ids",
                    format!("resume_output_ids must be a list of token ids, got {v}"),
                ))
            }
        };
        Ok(Handover {
            local: flag("local_prefill", local)?,
            on_failure,
            resume,
            marks: flag("stream_marks", marks)?,
            traceparent: None,
            class: handoff_engine::fair::Class::default(),
        })
    }

    /// What the request's headers add: its `traceparent`, its tenant, and
    /// its priority checked against its key's limit (a priority it did not
    /// ask for is the limit's default).
    pub fn from_headers(
        &mut self,
        headers: &axum::http::HeaderMap,
        priority: Option<&Value>,
    ) -> Result<(), ApiError> {
        self.traceparent = traceparent_of(headers);
        let asked = crate::http::tenancy::parse_priority(priority)?;
        self.class = crate::http::tenancy::class_of(asked, headers)?;
        Ok(())
    }
}

/// A non-negative integer of at most `max`, or a 400 naming the field.
pub fn bounded_integer(field: &str, v: &Value, max: u64) -> Result<u64, ApiError> {
    match v.as_u64() {
        Some(n) if n <= max => Ok(n),
        _ => Err(ApiError::invalid_param(
            field,
            format!("{field} must be an integer between 0 and {max}, got {v}"),
        )),
    }
}

impl Bootstrap {
    /// Check the raw fields: the room an integer in 0..=2^63-1, the port in
    /// 0..=65535, `null` meaning absent.
    pub fn parse(
        host: Option<&String>,
        port: Option<&Value>,
        room: Option<&Value>,
        sig: Option<&String>,
        ts: Option<&Value>,
    ) -> Result<Self, ApiError> {
        let ts = match ts.filter(|v| !v.is_null()) {
            Some(v) => Some(bounded_integer("bootstrap_ts", v, i64::MAX as u64)?),
            None => None,
        };
        let room = match room.filter(|v| !v.is_null()) {
            Some(v) => Some(bounded_integer("bootstrap_room", v, i64::MAX as u64)?),
            None => None,
        };
        let port = match port.filter(|v| !v.is_null()) {
            Some(v) => Some(bounded_integer("bootstrap_port", v, u64::from(u16::MAX))? as u16),
            None => None,
        };
        Ok(Bootstrap {
            host: host.filter(|h| !h.is_empty()).cloned(),
            port,
            room,
            sig: sig.cloned(),
            ts,
            trusted: false,
            handover: Handover::default(),
        })
    }

    /// With handoff's routing fields.
    pub fn with_handover(mut self, handover: Handover) -> Self {
        self.handover = handover;
        self
    }

    /// Whether any SGLang bootstrap field is present.
    fn has_bootstrap(&self) -> bool {
        self.host.is_some() || self.port.is_some() || self.room.is_some()
    }

    fn room_id(&self, role: &str, needs: &str) -> Result<RoomId, ApiError> {
        let Some(room) = self.room else {
            return Err(missing(role, needs));
        };
        RoomId::new(room).ok_or_else(|| {
            ApiError::invalid_param(
                "bootstrap_room",
                "bootstrap_room must be non-zero (0 names no room)",
            )
        })
    }

    /// The prefill's transfer endpoint: `host:port` resolved, once the
    /// endpoint was found trusted (never before: not even the name is
    /// looked up).
    async fn prefill_addr(&self) -> Result<SocketAddr, ApiError> {
        let (Some(host), Some(port)) = (self.host.as_deref(), self.port) else {
            return Err(missing("decode", DECODE_NEEDS));
        };
        if !self.trusted {
            return Err(ApiError::new(
                403,
                "untrusted_bootstrap",
                format!(
                    "this decode worker does not dial {host}:{port}: the endpoint was not checked"
                ),
            ));
        }
        let bad = |why: String| {
            ApiError::invalid_param(
                "bootstrap_host",
                format!("bootstrap_host `{host}` (port {port}) cannot be resolved: {why}"),
            )
        };
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| bad(e.to_string()))?
            .collect();
        addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or(addrs.first())
            .copied()
            .ok_or_else(|| bad("no address".into()))
    }
}

const PREFILL_NEEDS: &str = "bootstrap_room";
const DECODE_NEEDS: &str = "bootstrap_host, bootstrap_port and bootstrap_room";

fn missing(role: &str, needs: &str) -> ApiError {
    ApiError::bad_request(
        "missing_bootstrap",
        format!(
            "this is a {role} worker: a request needs {needs} (send requests through a PD router such as `handoff router`)"
        ),
    )
}

/// A request accepted by the backend.
#[derive(Debug)]
pub enum Submitted {
    /// Tokens streamed by an engine (colocated or decode).
    Stream(RequestStream),
    /// A prefill: resolves once the KV landed at decode.
    Prefill(PrefillTicket),
}

impl Backend {
    /// `null`, `prefill` or `decode` (SGLang's `disaggregation_mode`).
    pub fn mode(&self) -> &'static str {
        match self {
            Backend::Colocated(_) => "null",
            Backend::Prefill(_) => "prefill",
            Backend::Decode(_) => "decode",
        }
    }

    /// The loaded model.
    pub fn model(&self) -> &ModelInfo {
        match self {
            Backend::Colocated(e) => e.model(),
            Backend::Prefill(p) => p.model(),
            Backend::Decode(d) => d.model(),
        }
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        match self {
            Backend::Colocated(e) => e.tokenizer(),
            Backend::Prefill(p) => p.tokenizer(),
            Backend::Decode(d) => d.tokenizer(),
        }
    }

    /// The model's chat template, if the GGUF has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match self {
            Backend::Colocated(e) => e.chat_template(),
            Backend::Prefill(p) => p.chat_template(),
            Backend::Decode(d) => d.chat_template(),
        }
    }

    /// Empty the prefix cache: pages freed (0 with the cache off).
    pub async fn flush_cache(&self) -> Result<usize, EngineError> {
        match self {
            Backend::Colocated(e) => e.flush_cache().await,
            Backend::Prefill(p) => Ok(p.flush_cache()),
            Backend::Decode(d) => Ok(d.flush_cache()),
        }
    }

    /// What this worker's transfer endpoint reports for `/metrics`: KV
    /// bytes sent to decode workers (prefill) and live rooms (either PD
    /// role; a leak shows there). Zeros for colocated serving or an
    /// endpoint that does not answer.
    pub async fn transfer_snapshot(&self) -> TransferSnapshot {
        let stats = match self {
            Backend::Prefill(p) => p.transfer_stats().await.ok(),
            Backend::Decode(d) => d.transfer_stats().await.ok(),
            Backend::Colocated(_) => None,
        };
        let local_prefills = match self {
            Backend::Decode(d) => d.local_prefills(),
            _ => Default::default(),
        };
        stats.map_or_else(TransferSnapshot::default, |s| TransferSnapshot {
            kv_bytes_sent: s.kv_bytes_sent,
            live_rooms: s.live_rooms,
            local_prefills,
        })
    }

    /// A PD worker's registration record for discovery (`None` for
    /// colocated serving): its role, `url`, the bootstrap port of a
    /// prefill's transfer endpoint, and what its transfer handshake says
    /// about the model and KV layout.
    pub fn discovery_record(&self, url: &str) -> Option<crate::discovery::WorkerRecord> {
        let (role, fp, port) = match self {
            Backend::Prefill(p) => ("prefill", p.fingerprint(), Some(p.bootstrap_addr().port())),
            Backend::Decode(d) => ("decode", d.fingerprint(), None),
            Backend::Colocated(_) => return None,
        };
        Some(crate::discovery::WorkerRecord {
            role: role.into(),
            url: url.to_string(),
            bootstrap_port: port,
            model: fp.model_id.clone(),
            model_hash: fp.model_hash.iter().map(|b| format!("{b:02x}")).collect(),
            kv: format!(
                "{}/{}/{}/{}/{}",
                fp.layers,
                fp.kv_heads,
                fp.head_dim,
                fp.page_size,
                fp.dtype.name()
            ),
            protocol: [
                handoff_proto::frame::PROTOCOL_VERSION_MIN,
                handoff_proto::frame::PROTOCOL_VERSION,
            ],
            sig: None,
        })
    }

    /// Current load.
    pub fn load(&self) -> LoadSnapshot {
        match self {
            Backend::Colocated(e) => e.load(),
            Backend::Prefill(p) => p.load(),
            Backend::Decode(d) => d.load(),
        }
    }

    /// Check the PD fields this backend needs before any other work, so a
    /// request without them fails fast (and names them).
    pub fn check_bootstrap(&self, b: &Bootstrap) -> Result<(), ApiError> {
        let h = &b.handover;
        match self {
            Backend::Colocated(_) => {
                if h.on_failure.is_some() {
                    return Err(ApiError::invalid_param(
                        "on_transfer_failure",
                        "on_transfer_failure applies to a decode worker: this worker is colocated and receives no KV",
                    ));
                }
                Ok(())
            }
            Backend::Prefill(_) => {
                // `on_transfer_failure` rides to the decode worker on the
                // same body: it is decode's to apply.
                if h.local || !h.resume.is_empty() {
                    let field = if h.local {
                        "local_prefill"
                    } else {
                        "resume_output_ids"
                    };
                    return Err(ApiError::invalid_param(
                        field,
                        format!("{field} is for a decode worker (which prefills itself): this is a prefill worker"),
                    ));
                }
                b.room_id("prefill", PREFILL_NEEDS).map(|_| ())
            }
            Backend::Decode(_) if h.local => {
                if b.has_bootstrap() {
                    return Err(ApiError::invalid_param(
                        "local_prefill",
                        "local_prefill means no prefill worker: send it without bootstrap_host, bootstrap_port and bootstrap_room",
                    ));
                }
                Ok(())
            }
            Backend::Decode(_) => {
                if !h.resume.is_empty() {
                    return Err(ApiError::invalid_param(
                        "resume_output_ids",
                        "resume_output_ids needs local_prefill: true (a continued stream is prefilled on its decode worker)",
                    ));
                }
                if b.host.is_none() || b.port.is_none() {
                    return Err(missing("decode", DECODE_NEEDS));
                }
                b.room_id("decode", DECODE_NEEDS).map(|_| ())
            }
        }
    }

    /// Validate and submit. A PD engine that refuses the request tells its
    /// peer through the transfer protocol (seed 004).
    pub async fn submit(
        &self,
        mut req: GenerateRequest,
        b: &Bootstrap,
    ) -> Result<Submitted, ApiError> {
        req.output_so_far = b.handover.resume.clone();
        req.class = b.handover.class.clone();
        match self {
            Backend::Colocated(e) => Ok(Submitted::Stream(e.submit(req)?)),
            Backend::Decode(d) if b.handover.local => Ok(Submitted::Stream(d.submit_local(req)?)),
            Backend::Prefill(p) => {
                let room = b.room_id("prefill", PREFILL_NEEDS)?;
                Ok(Submitted::Prefill(p.submit(req, room)?))
            }
            Backend::Decode(d) => {
                let room = b.room_id("decode", DECODE_NEEDS)?;
                let addr = b.prefill_addr().await?;
                Ok(Submitted::Stream(d.submit_pd(
                    req,
                    room,
                    addr,
                    b.handover.on_failure,
                )?))
            }
        }
    }

    /// The request was refused before [`Self::submit`] (a bad field, say):
    /// tell the peer, with the same status and reason, so it releases its
    /// half of the room at once instead of at a timeout (seed 004).
    pub async fn reject(&self, b: &Bootstrap, error: &ApiError) {
        let Some(room) = b.room.and_then(RoomId::new) else {
            return;
        };
        match self {
            Backend::Colocated(_) => {}
            Backend::Prefill(p) => p.reject(room, error.status, &error.message, reject_code(error)),
            Backend::Decode(d) => {
                if let Ok(addr) = b.prefill_addr().await {
                    d.reject(room, addr, error.status, &error.message, reject_code(error));
                }
            }
        }
    }
}

impl From<EngineHandle> for Backend {
    fn from(e: EngineHandle) -> Self {
        Backend::Colocated(e)
    }
}

impl From<PrefillHandle> for Backend {
    fn from(p: PrefillHandle) -> Self {
        Backend::Prefill(p)
    }
}

impl From<DecodeHandle> for Backend {
    fn from(d: DecodeHandle) -> Self {
        Backend::Decode(d)
    }
}

/// The wire code of a refusal this server made itself (before the engine saw
/// the request), so the peer worker reports the same error type and field.
fn reject_code(e: &ApiError) -> Option<handoff_engine::error::RejectCode> {
    use handoff_engine::error::RejectCode;
    let output_field = matches!(
        e.param.as_deref(),
        Some("max_tokens" | "max_completion_tokens" | "sampling_params.max_new_tokens")
    );
    Some(match e.code {
        "context_length_exceeded" if output_field => RejectCode::OutputExceedsContext,
        "context_length_exceeded" => RejectCode::PromptExceedsContext,
        "kv_capacity_exceeded" => RejectCode::ExceedsKvCapacity,
        "empty_prompt" => RejectCode::EmptyPrompt,
        "invalid_token_id" => RejectCode::TokenOutOfRange,
        "invalid_request_error" => RejectCode::InvalidRequest,
        _ => return None,
    })
}
