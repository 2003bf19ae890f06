//! Control messages and their payload encoding.
//!
//! One codec for every transport. Optional fields exist only when the
//! connection negotiated the [`Capabilities`] bit that introduces them, so an
//! older peer never sees a field it does not know (rolling upgrade, N ↔ N-1):
//! they decode as `None` and the room tables fill in the documented default.

use crate::capabilities::Capabilities;
use crate::codec::{Reader, Writer};
use crate::error::{AbortOrigin, CodecError, FailureKind, RejectCode};
use crate::fingerprint::{Fingerprint, KvLayoutKind};
use crate::ids::{AuxSlot, PageIndex, Role, RoomId};
use crate::layout::KvDtype;

/// Most page indices one `Destination` may carry.
pub const MAX_PAGES_PER_DESTINATION: usize = 1 << 18;
/// Most extensions one `Register` may carry.
pub const MAX_EXTENSIONS: usize = 64;
/// Length of handshake nonces and MACs.
pub const NONCE_LEN: usize = 32;

/// The kind byte of a frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// [`Register`].
    Register,
    /// [`AuthProof`].
    AuthProof,
    /// [`Destination`].
    Destination,
    /// [`Abort`].
    Abort,
    /// [`AbortAck`].
    AbortAck,
    /// [`Status`].
    Status,
    /// [`Heartbeat`].
    Heartbeat,
}

impl MessageKind {
    /// Every kind.
    pub const ALL: [MessageKind; 7] = [
        MessageKind::Register,
        MessageKind::AuthProof,
        MessageKind::Destination,
        MessageKind::Abort,
        MessageKind::AbortAck,
        MessageKind::Status,
        MessageKind::Heartbeat,
    ];

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            MessageKind::Register => 1,
            MessageKind::AuthProof => 2,
            MessageKind::Destination => 3,
            MessageKind::Abort => 4,
            MessageKind::AbortAck => 5,
            MessageKind::Status => 6,
            MessageKind::Heartbeat => 7,
        }
    }

    /// From a wire code.
    pub fn from_code(code: u8) -> Result<Self, CodecError> {
        MessageKind::ALL
            .into_iter()
            .find(|k| k.code() == code)
            .ok_or(CodecError::UnknownKind(code))
    }

    /// Stable name, used in errors and logs.
    pub const fn name(self) -> &'static str {
        match self {
            MessageKind::Register => "Register",
            MessageKind::AuthProof => "AuthProof",
            MessageKind::Destination => "Destination",
            MessageKind::Abort => "Abort",
            MessageKind::AbortAck => "AbortAck",
            MessageKind::Status => "Status",
            MessageKind::Heartbeat => "Heartbeat",
        }
    }
}

/// First message on a connection, both ways: who I am, what I speak, what my
/// KV cache looks like, and a fresh nonce for the optional secret check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Register {
    /// Sender's role.
    pub role: Role,
    /// Lowest protocol version the sender speaks.
    pub min_version: u8,
    /// Highest protocol version the sender speaks.
    pub max_version: u8,
    /// Capability bits the sender supports (unknown bits are ignored).
    pub capabilities: Capabilities,
    /// The sender's compatibility fingerprint.
    pub fingerprint: Fingerprint,
    /// Fresh random nonce for challenge-response (caller-provided).
    pub nonce: [u8; NONCE_LEN],
    /// Largest frame payload the sender accepts (extension tag 1; `None` from
    /// peers that do not send it).
    pub max_frame_len: Option<u32>,
}

/// Proof of the shared secret: `HMAC-SHA256(secret, transcript)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthProof {
    /// The MAC.
    pub mac: [u8; NONCE_LEN],
}

/// Decode → prefill: where to write the KV of a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// The room.
    pub room: RoomId,
    /// Destination pages in the decode pool, in token order.
    pub pages: Vec<PageIndex>,
    /// Aux slot for first token / logprob / room id.
    pub aux_slot: AuxSlot,
    /// How many destinations (decode ranks) the prefill must wait for before
    /// computing this room. At least 1.
    pub required_destinations: u16,
    /// Leading tokens decode already has (prefix cache hit) and that need not
    /// be sent. Capability [`Capabilities::DESTINATION_PREFIX`].
    pub prefix_tokens: Option<u32>,
}

/// Either side: stop this room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    /// The room.
    pub room: RoomId,
    /// Why.
    pub reason: String,
    /// Status for the client. Capability [`Capabilities::FAILURE_DETAIL`].
    pub http_status: Option<u16>,
    /// Who started it. Capability [`Capabilities::FAILURE_DETAIL`].
    pub origin: Option<AbortOrigin>,
}

/// Answer to [`Abort`]: the room is failed on this side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortAck {
    /// The room.
    pub room: RoomId,
    /// `true` when no write of this side to the room's pages is in flight any
    /// more (or never was). `false` means the peer must keep the pages fenced
    /// until its abort-ack deadline.
    pub drained: bool,
}

/// The result a sender reports for a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every byte of KV and aux for this destination is written.
    Success,
    /// The room failed on the sender; no more writes will come from it.
    Failed {
        /// Failure class.
        kind: FailureKind,
        /// Human reason.
        reason: String,
        /// Status for the client. Capability [`Capabilities::FAILURE_DETAIL`].
        http_status: Option<u16>,
        /// A rejection's API code. Capability [`Capabilities::REJECT_CODE`];
        /// a code this build does not know reads as `None`.
        code: Option<RejectCode>,
    },
}

/// Prefill → decode (or decode → prefill for a failure): room outcome. A
/// `Status` is sent only when the sender has no write in flight to the room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The room.
    pub room: RoomId,
    /// Outcome.
    pub outcome: Outcome,
}

/// Liveness ping, both ways.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    /// Sender's counter.
    pub seq: u64,
}

/// Every control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// See [`Register`].
    Register(Register),
    /// See [`AuthProof`].
    AuthProof(AuthProof),
    /// See [`Destination`].
    Destination(Destination),
    /// See [`Abort`].
    Abort(Abort),
    /// See [`AbortAck`].
    AbortAck(AbortAck),
    /// See [`Status`].
    Status(Status),
    /// See [`Heartbeat`].
    Heartbeat(Heartbeat),
}

const EXT_MAX_FRAME_LEN: u16 = 1;

fn put_room(w: &mut Writer<'_>, room: RoomId) {
    w.u64(room.get());
}

fn get_room(r: &mut Reader<'_>) -> Result<RoomId, CodecError> {
    let raw = r.u64("room")?;
    RoomId::new(raw).ok_or(CodecError::BadValue {
        field: "room",
        value: 0,
    })
}

/// The status put on the wire: anything outside 100..=599 (which the peer
/// would reject, dropping the whole message) is sent as 500.
fn wire_status(s: u16) -> u16 {
    if (100..=599).contains(&s) {
        s
    } else {
        500
    }
}

fn get_http_status(r: &mut Reader<'_>) -> Result<u16, CodecError> {
    let s = r.u16("http_status")?;
    if (100..=599).contains(&s) {
        Ok(s)
    } else {
        Err(CodecError::BadValue {
            field: "http_status",
            value: s.into(),
        })
    }
}

fn get_bool(r: &mut Reader<'_>, what: &'static str) -> Result<bool, CodecError> {
    match r.u8(what)? {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(CodecError::BadValue {
            field: what,
            value: v.into(),
        }),
    }
}

fn role_code(role: Role) -> u8 {
    match role {
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

fn get_role(r: &mut Reader<'_>) -> Result<Role, CodecError> {
    match r.u8("role")? {
        1 => Ok(Role::Prefill),
        2 => Ok(Role::Decode),
        v => Err(CodecError::BadValue {
            field: "role",
            value: v.into(),
        }),
    }
}

impl Fingerprint {
    fn encode(&self, w: &mut Writer<'_>) {
        w.string(&self.model_id);
        w.raw(&self.model_hash);
        w.u32(self.layers);
        w.u32(self.kv_heads);
        w.u32(self.head_dim);
        w.u32(self.page_size);
        w.u8(self.dtype.code());
        w.u8(self.layout.code());
        w.u32(self.tp_rank);
        w.u32(self.tp_size);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, CodecError> {
        let model_id = r.string("model_id")?;
        let model_hash = r.fixed::<32>("model_hash")?;
        let mut nonzero = |what: &'static str| -> Result<u32, CodecError> {
            let v = r.u32(what)?;
            if v == 0 {
                Err(CodecError::BadValue {
                    field: what,
                    value: 0,
                })
            } else {
                Ok(v)
            }
        };
        let layers = nonzero("layers")?;
        let kv_heads = nonzero("kv_heads")?;
        let head_dim = nonzero("head_dim")?;
        let page_size = nonzero("page_size")?;
        let dtype_code = r.u8("dtype")?;
        let dtype = KvDtype::from_code(dtype_code).ok_or(CodecError::BadValue {
            field: "dtype",
            value: dtype_code.into(),
        })?;
        let layout_code = r.u8("layout")?;
        let layout = KvLayoutKind::from_code(layout_code).ok_or(CodecError::BadValue {
            field: "layout",
            value: layout_code.into(),
        })?;
        let tp_rank = r.u32("tp_rank")?;
        let tp_size = r.u32("tp_size")?;
        if tp_size == 0 {
            return Err(CodecError::BadValue {
                field: "tp_size",
                value: 0,
            });
        }
        if tp_rank >= tp_size {
            return Err(CodecError::BadValue {
                field: "tp_rank",
                value: tp_rank.into(),
            });
        }
        Ok(Fingerprint {
            model_id,
            model_hash,
            layers,
            kv_heads,
            head_dim,
            page_size,
            dtype,
            layout,
            tp_rank,
            tp_size,
        })
    }
}

impl Message {
    /// The message's kind.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::Register(_) => MessageKind::Register,
            Message::AuthProof(_) => MessageKind::AuthProof,
            Message::Destination(_) => MessageKind::Destination,
            Message::Abort(_) => MessageKind::Abort,
            Message::AbortAck(_) => MessageKind::AbortAck,
            Message::Status(_) => MessageKind::Status,
            Message::Heartbeat(_) => MessageKind::Heartbeat,
        }
    }

    /// The room this message is about, if any.
    pub fn room(&self) -> Option<RoomId> {
        match self {
            Message::Destination(m) => Some(m.room),
            Message::Abort(m) => Some(m.room),
            Message::AbortAck(m) => Some(m.room),
            Message::Status(m) => Some(m.room),
            Message::Register(_) | Message::AuthProof(_) | Message::Heartbeat(_) => None,
        }
    }

    /// Append the payload (no header) for a connection that negotiated
    /// `caps`. Optional fields whose capability is absent are not written.
    pub fn encode_payload(&self, caps: Capabilities, out: &mut Vec<u8>) {
        let mut w = Writer::new(out);
        let detail = caps.contains(Capabilities::FAILURE_DETAIL);
        match self {
            Message::Register(m) => {
                w.u8(role_code(m.role));
                w.u8(m.min_version);
                w.u8(m.max_version);
                w.u64(m.capabilities.bits());
                m.fingerprint.encode(&mut w);
                w.raw(&m.nonce);
                let mut exts: Vec<(u16, Vec<u8>)> = Vec::new();
                if let Some(len) = m.max_frame_len {
                    let len = len.max(crate::version::MIN_MAX_FRAME_LEN);
                    exts.push((EXT_MAX_FRAME_LEN, len.to_le_bytes().to_vec()));
                }
                w.u16(exts.len() as u16);
                for (tag, body) in exts {
                    w.u16(tag);
                    w.bytes16(&body);
                }
            }
            Message::AuthProof(m) => w.raw(&m.mac),
            Message::Destination(m) => {
                put_room(&mut w, m.room);
                w.u32_list(m.pages.iter().map(|p| p.0));
                w.u32(m.aux_slot.0);
                w.u16(m.required_destinations);
                if caps.contains(Capabilities::DESTINATION_PREFIX) {
                    w.u32(m.prefix_tokens.unwrap_or(0));
                }
            }
            Message::Abort(m) => {
                put_room(&mut w, m.room);
                w.string(&m.reason);
                if detail {
                    w.u16(wire_status(m.http_status.unwrap_or(503)));
                    w.u8(m.origin.map_or(u8::MAX, AbortOrigin::code));
                }
            }
            Message::AbortAck(m) => {
                put_room(&mut w, m.room);
                w.u8(u8::from(m.drained));
            }
            Message::Status(m) => {
                put_room(&mut w, m.room);
                match &m.outcome {
                    Outcome::Success => w.u8(0),
                    Outcome::Failed {
                        kind,
                        reason,
                        http_status,
                        code,
                    } => {
                        w.u8(1);
                        w.u8(kind.code());
                        w.string(reason);
                        if detail {
                            w.u16(wire_status(
                                http_status.unwrap_or_else(|| kind.default_http_status()),
                            ));
                        }
                        if caps.contains(Capabilities::REJECT_CODE) {
                            w.u8(code.map_or(0, RejectCode::code));
                        }
                    }
                }
            }
            Message::Heartbeat(m) => w.u64(m.seq),
        }
    }

    /// Decode and fully validate a payload of `kind` for a connection that
    /// negotiated `caps`. Trailing bytes are an error.
    pub fn decode(
        kind: MessageKind,
        payload: &[u8],
        caps: Capabilities,
    ) -> Result<Self, CodecError> {
        let mut r = Reader::new(payload);
        let detail = caps.contains(Capabilities::FAILURE_DETAIL);
        let msg = match kind {
            MessageKind::Register => {
                let role = get_role(&mut r)?;
                let min_version = r.u8("min_version")?;
                let max_version = r.u8("max_version")?;
                if min_version == 0 || min_version > max_version {
                    return Err(CodecError::BadValue {
                        field: "min_version",
                        value: min_version.into(),
                    });
                }
                let capabilities = Capabilities::from_bits(r.u64("capabilities")?);
                let fingerprint = Fingerprint::decode(&mut r)?;
                let nonce = r.fixed::<NONCE_LEN>("nonce")?;
                let n = r.u16("extensions")? as usize;
                if n > MAX_EXTENSIONS {
                    return Err(CodecError::TooLong {
                        field: "extensions",
                        len: n,
                        max: MAX_EXTENSIONS,
                    });
                }
                let mut max_frame_len = None;
                for _ in 0..n {
                    let tag = r.u16("extension tag")?;
                    let body = r.bytes16("extension", u16::MAX as usize)?;
                    if tag == EXT_MAX_FRAME_LEN {
                        let mut br = Reader::new(body);
                        let v = br.u32("max_frame_len")?;
                        br.finish("max_frame_len extension")?;
                        if v < crate::version::MIN_MAX_FRAME_LEN {
                            return Err(CodecError::BadValue {
                                field: "max_frame_len",
                                value: v.into(),
                            });
                        }
                        max_frame_len = Some(v);
                    }
                    // Unknown tags come from newer peers: skipped by length.
                }
                Message::Register(Register {
                    role,
                    min_version,
                    max_version,
                    capabilities,
                    fingerprint,
                    nonce,
                    max_frame_len,
                })
            }
            MessageKind::AuthProof => Message::AuthProof(AuthProof {
                mac: r.fixed::<NONCE_LEN>("mac")?,
            }),
            MessageKind::Destination => {
                let room = get_room(&mut r)?;
                let pages = r
                    .u32_list("pages", MAX_PAGES_PER_DESTINATION)?
                    .into_iter()
                    .map(PageIndex)
                    .collect();
                let aux_slot = AuxSlot(r.u32("aux_slot")?);
                let required_destinations = r.u16("required_destinations")?;
                if required_destinations == 0 {
                    return Err(CodecError::BadValue {
                        field: "required_destinations",
                        value: 0,
                    });
                }
                let prefix_tokens = if caps.contains(Capabilities::DESTINATION_PREFIX) {
                    Some(r.u32("prefix_tokens")?)
                } else {
                    None
                };
                Message::Destination(Destination {
                    room,
                    pages,
                    aux_slot,
                    required_destinations,
                    prefix_tokens,
                })
            }
            MessageKind::Abort => {
                let room = get_room(&mut r)?;
                let reason = r.string("reason")?;
                let (http_status, origin) = if detail {
                    let status = get_http_status(&mut r)?;
                    let code = r.u8("origin")?;
                    let origin = if code == u8::MAX {
                        None
                    } else {
                        Some(AbortOrigin::from_code(code).ok_or(CodecError::BadValue {
                            field: "origin",
                            value: code.into(),
                        })?)
                    };
                    (Some(status), origin)
                } else {
                    (None, None)
                };
                Message::Abort(Abort {
                    room,
                    reason,
                    http_status,
                    origin,
                })
            }
            MessageKind::AbortAck => Message::AbortAck(AbortAck {
                room: get_room(&mut r)?,
                drained: get_bool(&mut r, "drained")?,
            }),
            MessageKind::Status => {
                let room = get_room(&mut r)?;
                let outcome = match r.u8("outcome")? {
                    0 => Outcome::Success,
                    1 => {
                        let code = r.u8("failure kind")?;
                        let kind = FailureKind::from_code(code).ok_or(CodecError::BadValue {
                            field: "failure kind",
                            value: code.into(),
                        })?;
                        let reason = r.string("reason")?;
                        let http_status = if detail {
                            Some(get_http_status(&mut r)?)
                        } else {
                            None
                        };
                        let code = if caps.contains(Capabilities::REJECT_CODE) {
                            RejectCode::from_code(r.u8("reject code")?)
                        } else {
                            None
                        };
                        Outcome::Failed {
                            kind,
                            reason,
                            http_status,
                            code,
                        }
                    }
                    v => {
                        return Err(CodecError::BadValue {
                            field: "outcome",
                            value: v.into(),
                        })
                    }
                };
                Message::Status(Status { room, outcome })
            }
            MessageKind::Heartbeat => Message::Heartbeat(Heartbeat { seq: r.u64("seq")? }),
        };
        r.finish(kind.name())?;
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    fn round_trip(m: &Message, caps: Capabilities) -> Message {
        let mut buf = Vec::new();
        m.encode_payload(caps, &mut buf);
        Message::decode(m.kind(), &buf, caps).unwrap()
    }

    #[test]
    fn status_failed_keeps_reason_and_status() {
        let m = Message::Status(Status {
            room: room(9),
            outcome: Outcome::Failed {
                kind: FailureKind::Rejected,
                reason: "prompt too long".into(),
                http_status: Some(400),
                code: None,
            },
        });
        assert_eq!(round_trip(&m, Capabilities::ALL), m);
    }

    #[test]
    fn a_rejection_code_travels_only_to_a_peer_that_knows_it() {
        let with = |code| {
            Message::Status(Status {
                room: room(4),
                outcome: Outcome::Failed {
                    kind: FailureKind::Rejected,
                    reason: "prompt too long".into(),
                    http_status: Some(400),
                    code,
                },
            })
        };
        for c in RejectCode::ALL {
            assert_eq!(RejectCode::from_code(c.code()), Some(c));
            let m = with(Some(c));
            assert_eq!(round_trip(&m, Capabilities::ALL), m);
            // Without the capability the byte is not sent at all.
            let caps = Capabilities::FAILURE_DETAIL;
            assert_eq!(round_trip(&m, caps), with(None));
            let (mut a, mut b) = (Vec::new(), Vec::new());
            m.encode_payload(Capabilities::ALL, &mut a);
            m.encode_payload(caps, &mut b);
            assert_eq!(a.len(), b.len() + 1);
        }
        // 0 is "none"; a code from a newer peer reads as none.
        assert_eq!(RejectCode::from_code(0), None);
        let mut buf = Vec::new();
        with(None).encode_payload(Capabilities::ALL, &mut buf);
        *buf.last_mut().unwrap() = 200;
        let back = Message::decode(MessageKind::Status, &buf, Capabilities::ALL).unwrap();
        assert_eq!(back, with(None));
    }

    #[test]
    fn old_peer_gets_no_optional_fields() {
        let m = Message::Abort(Abort {
            room: room(3),
            reason: "client gone".into(),
            http_status: Some(499),
            origin: Some(AbortOrigin::Client),
        });
        let back = round_trip(&m, Capabilities::V1);
        assert_eq!(
            back,
            Message::Abort(Abort {
                room: room(3),
                reason: "client gone".into(),
                http_status: None,
                origin: None
            })
        );
    }

    #[test]
    fn zero_room_is_rejected() {
        let mut buf = Vec::new();
        Writer::new(&mut buf).u64(0);
        buf.push(1);
        assert_eq!(
            Message::decode(MessageKind::AbortAck, &buf, Capabilities::ALL),
            Err(CodecError::BadValue {
                field: "room",
                value: 0
            })
        );
    }

    #[test]
    fn bad_bool_and_status_are_rejected() {
        let mut buf = Vec::new();
        Writer::new(&mut buf).u64(5);
        buf.push(2);
        assert_eq!(
            Message::decode(MessageKind::AbortAck, &buf, Capabilities::ALL),
            Err(CodecError::BadValue {
                field: "drained",
                value: 2
            })
        );
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        w.u64(5);
        w.u8(1);
        w.u8(FailureKind::Rejected.code());
        w.string("x");
        w.u16(999);
        assert_eq!(
            Message::decode(MessageKind::Status, &buf, Capabilities::ALL),
            Err(CodecError::BadValue {
                field: "http_status",
                value: 999
            })
        );
    }

    #[test]
    fn an_invalid_status_is_never_put_on_the_wire() {
        // The peer would reject the whole message: an abort must not be lost
        // because a caller passed a bad status.
        let m = Message::Abort(Abort {
            room: room(3),
            reason: "x".into(),
            http_status: Some(0),
            origin: None,
        });
        let Message::Abort(back) = round_trip(&m, Capabilities::ALL) else {
            panic!()
        };
        assert_eq!(back.http_status, Some(500));
    }

    #[test]
    fn trailing_bytes_after_heartbeat() {
        let mut buf = 7u64.to_le_bytes().to_vec();
        buf.push(0);
        assert_eq!(
            Message::decode(MessageKind::Heartbeat, &buf, Capabilities::ALL),
            Err(CodecError::TrailingBytes {
                count: 1,
                kind: "Heartbeat"
            })
        );
    }

    #[test]
    fn destination_round_trip_with_prefix() {
        let m = Message::Destination(Destination {
            room: room(11),
            pages: vec![PageIndex(4), PageIndex(9), PageIndex(1)],
            aux_slot: AuxSlot(2),
            required_destinations: 2,
            prefix_tokens: Some(32),
        });
        assert_eq!(round_trip(&m, Capabilities::ALL), m);
        let old = round_trip(&m, Capabilities::V1);
        let Message::Destination(d) = old else {
            panic!("kind changed")
        };
        assert_eq!(d.prefix_tokens, None);
        assert_eq!(d.pages.len(), 3);
    }
}
