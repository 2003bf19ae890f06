//! Error types: every error says who is to blame.
//!
//! * [`CodecError`] — a frame or message that is not valid on the wire
//!   (always the peer's fault; counted and dropped, never fatal to a reader).
//! * [`HandshakeError`] — a connection that must not be used: wrong version,
//!   incompatible KV geometry, failed authentication.
//! * [`TransferError`] — why one room failed, with [`TransferError::http_status`]
//!   and a stable [`TransferError::error_type`] label for metrics, the OpenAI
//!   error object and SSE error events. It travels over the wire in
//!   [`crate::message::Status`] so both sides report the same reason; a
//!   failure received from a peer stays the peer's
//!   ([`TransferError::Remote`]), never rebuilt as one of ours.

use std::fmt;

use crate::ids::{PeerId, RankId, Role};

/// A frame or message payload that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The frame does not start with [`crate::frame::MAGIC`].
    #[error("bad magic {found:02x?}: not a handoff frame")]
    BadMagic {
        /// The four bytes found instead.
        found: [u8; 4],
    },
    /// The header's protocol version is outside what this build speaks.
    #[error("unsupported protocol version {version} (this build speaks {min}..={max})")]
    UnsupportedVersion {
        /// Version in the header.
        version: u8,
        /// Lowest version this build accepts.
        min: u8,
        /// Highest version this build accepts.
        max: u8,
    },
    /// The header names a message kind this build does not know.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// Reserved header flags were set.
    #[error("reserved header flags {0:#06x} set")]
    ReservedFlags(u16),
    /// The payload length exceeds the frame limit.
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    Oversize {
        /// Declared payload length.
        len: u32,
        /// Maximum accepted.
        max: u32,
    },
    /// The payload ended before a field was complete.
    #[error("truncated {what}: needed {needed} bytes, {remaining} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes that were left.
        remaining: usize,
    },
    /// The payload has bytes after the last field.
    #[error("{count} trailing bytes after {kind} payload")]
    TrailingBytes {
        /// How many extra bytes.
        count: usize,
        /// Message kind name.
        kind: &'static str,
    },
    /// A field has a value outside its domain.
    #[error("bad value {value} for field {field}")]
    BadValue {
        /// Field name.
        field: &'static str,
        /// The offending value.
        value: u64,
    },
    /// A string or list exceeds its limit.
    #[error("field {field} has length {len}, limit {max}")]
    TooLong {
        /// Field name.
        field: &'static str,
        /// Declared length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A string field is not UTF-8.
    #[error("field {field} is not valid UTF-8")]
    InvalidUtf8 {
        /// Field name.
        field: &'static str,
    },
}

impl CodecError {
    /// Stable label for metrics (`malformed_frames_total{reason=...}`).
    pub fn reason_label(&self) -> &'static str {
        match self {
            CodecError::BadMagic { .. } => "bad_magic",
            CodecError::UnsupportedVersion { .. } => "unsupported_version",
            CodecError::UnknownKind(_) => "unknown_kind",
            CodecError::ReservedFlags(_) => "reserved_flags",
            CodecError::Oversize { .. } => "oversize",
            CodecError::Truncated { .. } => "truncated",
            CodecError::TrailingBytes { .. } => "trailing_bytes",
            CodecError::BadValue { .. } => "bad_value",
            CodecError::TooLong { .. } => "too_long",
            CodecError::InvalidUtf8 { .. } => "invalid_utf8",
        }
    }
}

/// Why a connection's handshake failed. The connection must be closed; no
/// room may use it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The version ranges do not overlap (prefill first, so both ends log
    /// the same line).
    #[error("protocol version: prefill speaks {prefill_min}..={prefill_max}, decode speaks {decode_min}..={decode_max}")]
    VersionMismatch {
        /// Prefill's lowest version.
        prefill_min: u8,
        /// Prefill's highest version.
        prefill_max: u8,
        /// Decode's lowest version.
        decode_min: u8,
        /// Decode's highest version.
        decode_max: u8,
    },
    /// A compatibility fingerprint field differs, e.g.
    /// `page size: prefill has 16, decode has 64` (always prefill first, so
    /// both ends log the same line).
    #[error("{field}: prefill has {prefill}, decode has {decode}")]
    Incompatible {
        /// Human name of the field ("page size").
        field: &'static str,
        /// The prefill side's value, rendered.
        prefill: String,
        /// The decode side's value, rendered.
        decode: String,
    },
    /// Both ends claim the same role.
    #[error("both ends are {0}: a connection pairs a prefill with a decode")]
    SameRole(Role),
    /// One side has a shared secret configured and the other does not.
    #[error(
        "authentication mismatch: {with_secret} has a shared secret configured, {without} does not"
    )]
    AuthMismatch {
        /// The side with a secret.
        with_secret: Role,
        /// The side without.
        without: Role,
    },
    /// The peer's proof of the shared secret is wrong.
    #[error("authentication failed: the peer does not know the shared secret")]
    AuthFailed,
    /// A message arrived that the handshake does not expect now.
    #[error("unexpected {kind} during handshake (expecting {expecting})")]
    Unexpected {
        /// Kind of the message received.
        kind: &'static str,
        /// What the handshake was waiting for.
        expecting: &'static str,
    },
    /// The peer's message could not be decoded.
    #[error("malformed handshake message: {0}")]
    Codec(#[from] CodecError),
    /// The handshake did not complete in time.
    #[error("handshake did not complete within {0:?}")]
    TimedOut(std::time::Duration),
}

impl HandshakeError {
    /// Stable label for metrics, error bodies and SSE events. A handshake
    /// that did not finish in time says so (`handshake_timeout`): it is not
    /// evidence that the peer is incompatible.
    pub fn error_type(&self) -> &'static str {
        match self {
            HandshakeError::TimedOut(_) => "handshake_timeout",
            _ => "peer_incompatible",
        }
    }

    /// The HTTP status a client whose request needed this connection should
    /// see: 504 for a handshake that timed out, 500 otherwise.
    pub fn http_status(&self) -> u16 {
        match self {
            HandshakeError::TimedOut(_) => 504,
            _ => 500,
        }
    }
}

/// The phase of a room a timeout fired in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Waiting for the peer / destinations to show up.
    Bootstrapping,
    /// Waiting for input: destinations (prefill) or the first write (decode).
    WaitingForInput,
    /// KV being written.
    Transferring,
    /// Abort sent, waiting for the writer to drain.
    Draining,
}

impl Phase {
    /// Stable snake-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Bootstrapping => "bootstrapping",
            Phase::WaitingForInput => "waiting_for_input",
            Phase::Transferring => "transferring",
            Phase::Draining => "draining",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Who started an abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortOrigin {
    /// The client went away or cancelled.
    Client,
    /// The router decided (e.g. its own timeout, policy).
    Router,
    /// The prefill worker.
    Prefill,
    /// The decode worker.
    Decode,
    /// A worker shutting down.
    Shutdown,
}

impl AbortOrigin {
    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            AbortOrigin::Client => "client",
            AbortOrigin::Router => "router",
            AbortOrigin::Prefill => "prefill",
            AbortOrigin::Decode => "decode",
            AbortOrigin::Shutdown => "shutdown",
        }
    }

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            AbortOrigin::Client => 0,
            AbortOrigin::Router => 1,
            AbortOrigin::Prefill => 2,
            AbortOrigin::Decode => 3,
            AbortOrigin::Shutdown => 4,
        }
    }

    /// From a wire code.
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => AbortOrigin::Client,
            1 => AbortOrigin::Router,
            2 => AbortOrigin::Prefill,
            3 => AbortOrigin::Decode,
            4 => AbortOrigin::Shutdown,
            _ => return None,
        })
    }

    /// The origin implied by a peer's role, for peers that do not send one.
    pub const fn of_role(role: Role) -> Self {
        match role {
            Role::Prefill => AbortOrigin::Prefill,
            Role::Decode => AbortOrigin::Decode,
        }
    }
}

impl fmt::Display for AbortOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a peer did that it must not: each check that can blame a peer has
/// its own variant, so tests and logs match on the fault, not on text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Misbehavior {
    /// The aux record landed in our slot carries another room's id.
    #[error("aux slot carries room {found:#018x}, expected {expected:#018x}")]
    AuxRoomMismatch {
        /// Room id found in the slot.
        found: u64,
        /// Our room.
        expected: u64,
    },
    /// Decode acknowledged a room's end as failed: it rejected some write.
    #[error("decode rejected part of the room's writes")]
    WritesRejected,
    /// A destination lists fewer pages than the room sends.
    #[error("destination has {has} pages, the room sends {sends}")]
    DestinationTooShort {
        /// Pages in the destination.
        has: usize,
        /// Pages the room writes.
        sends: usize,
    },
    /// A destination's cached prefix (delta transfer) does not end on a
    /// page boundary: the pages after it could not line up with ours.
    #[error("destination says decode holds {tokens} tokens, not a whole number of {page_size}-token pages")]
    PrefixNotPageAligned {
        /// The prefix it claims.
        tokens: u32,
        /// Tokens per page.
        page_size: usize,
    },
    /// A destination page is outside the decode pool the link announced.
    #[error("destination page {page} is outside the decode pool of {pool_pages} pages")]
    PageOutsidePool {
        /// The page.
        page: u32,
        /// Pages in the decode pool.
        pool_pages: usize,
    },
    /// A decode rank's destination count contradicts an earlier one.
    #[error("{peer} says {said} destinations, an earlier destination said {earlier}")]
    DestinationCountChanged {
        /// Who said it.
        peer: PeerId,
        /// Its count.
        said: u16,
        /// The count already known.
        earlier: u16,
    },
    /// A destination arrived after every expected one had.
    #[error("destination from {peer} after all {arrived} arrived")]
    DestinationAfterAll {
        /// Who sent it.
        peer: PeerId,
        /// Destinations that had arrived.
        arrived: usize,
    },
    /// Prefill's first token is outside the model's vocabulary.
    #[error("prefill sent first token {token} outside the vocabulary of {vocab}")]
    TokenOutsideVocabulary {
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
}

/// Why a room failed — the blame enum shared by both sides and carried in
/// [`crate::message::Status`] so the decode side reports the prefill's reason
/// (and vice versa) with the original HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The peer sent something it must not (aux slot with the wrong room
    /// id, destination count changed, a page outside its pool...).
    #[error("peer misbehaved: {what}")]
    PeerMisbehaved {
        /// What it did.
        what: Misbehavior,
    },
    /// The peer's configuration cannot work with ours.
    #[error("peer incompatible: {detail}")]
    PeerIncompatible {
        /// Which setting.
        detail: String,
    },
    /// The peer stopped answering heartbeats or its connection broke.
    #[error("{peer} is dead: {detail}")]
    PeerDead {
        /// The dead peer.
        peer: PeerId,
        /// How it was detected.
        detail: String,
    },
    /// A room deadline passed.
    #[error("timed out in {phase} after {:.1} s", after.as_secs_f64())]
    Timeout {
        /// Phase the room was in.
        phase: Phase,
        /// The deadline's length.
        after: std::time::Duration,
    },
    /// Someone aborted the request.
    #[error("aborted by {origin}: {reason}")]
    Aborted {
        /// Who.
        origin: AbortOrigin,
        /// Why.
        reason: String,
        /// Status to report to the client.
        http_status: u16,
    },
    /// A worker rejected the request (e.g. validation: prompt too long).
    #[error("rejected with status {http_status}: {reason}")]
    Rejected {
        /// Status to report (400, 413 ...).
        http_status: u16,
        /// Why.
        reason: String,
        /// The API's name for it, when the rejecting worker gave one.
        code: Option<RejectCode>,
    },
    /// Out of some resource (pages, rooms, unknown-room slots).
    #[error("capacity: {what}")]
    Capacity {
        /// Which resource.
        what: String,
    },
    /// The room id is already live.
    #[error("duplicate live room id")]
    DuplicateRoom,
    /// A local fault (transport error, engine error, a broken invariant).
    #[error("internal: {reason}")]
    Internal {
        /// What broke.
        reason: String,
    },
    /// Our own caller used the API wrongly (e.g. opened a room without
    /// distinct sources): a bug on this side, not the peer's. On the wire it
    /// is [`FailureKind::Internal`] (older peers know no other code), so the
    /// peer sees an `internal` failure with this reason.
    #[error("API misuse: {reason}")]
    ApiMisuse {
        /// What the caller did wrong.
        reason: String,
    },
    /// A failure the peer saw and reported in a `Status(Failed)` — a dead
    /// peer, a timeout, a duplicate room, capacity, misbehaviour or an
    /// internal fault on its side: kind, reason and status exactly as it
    /// sent them, attributed to the peer's role.
    #[error("{} reported by {peer}: {reason}", kind.name())]
    Remote {
        /// The peer's failure kind (this is the `error_type`).
        kind: FailureKind,
        /// The peer's reason.
        reason: String,
        /// The peer's status.
        http_status: u16,
        /// The peer's role.
        peer: Role,
    },
}

impl TransferError {
    /// The HTTP status a client should see for this failure.
    pub fn http_status(&self) -> u16 {
        match self {
            TransferError::PeerMisbehaved { .. }
            | TransferError::PeerIncompatible { .. }
            | TransferError::Internal { .. }
            | TransferError::ApiMisuse { .. } => 500,
            TransferError::PeerDead { .. } | TransferError::Capacity { .. } => 503,
            TransferError::Timeout { .. } => 504,
            TransferError::Aborted { http_status, .. }
            | TransferError::Rejected { http_status, .. }
            | TransferError::Remote { http_status, .. } => *http_status,
            TransferError::DuplicateRoom => 409,
        }
    }

    /// Stable label: metrics, the OpenAI error object's `type`, SSE events.
    /// The wire kind's name, except for [`TransferError::ApiMisuse`], which
    /// has its own label here and travels as `internal`.
    /// A rejection's API code names it (`context_length_exceeded` ...).
    pub fn error_type(&self) -> &'static str {
        match self {
            TransferError::ApiMisuse { .. } => "api_misuse",
            TransferError::Rejected {
                code: Some(code), ..
            } => code.api_type(),
            other => other.kind().name(),
        }
    }

    /// The API code a rejection carries (sent in `Status(Failed)`).
    pub fn reject_code(&self) -> Option<RejectCode> {
        match self {
            TransferError::Rejected { code, .. } => *code,
            _ => None,
        }
    }

    /// The wire kind of this error (what a `Status(Failed)` carries). For a
    /// [`TransferError::Remote`] it is the peer's kind, so a relayed failure
    /// keeps its class; [`TransferError::ApiMisuse`] maps onto
    /// [`FailureKind::Internal`] (no new wire code: an older decoder refuses
    /// codes it does not know).
    pub fn kind(&self) -> FailureKind {
        match self {
            TransferError::PeerMisbehaved { .. } => FailureKind::PeerMisbehaved,
            TransferError::PeerIncompatible { .. } => FailureKind::PeerIncompatible,
            TransferError::PeerDead { .. } => FailureKind::PeerDead,
            TransferError::Timeout { .. } => FailureKind::Timeout,
            TransferError::Aborted { .. } => FailureKind::Aborted,
            TransferError::Rejected { .. } => FailureKind::Rejected,
            TransferError::Capacity { .. } => FailureKind::Capacity,
            TransferError::DuplicateRoom => FailureKind::DuplicateRoom,
            TransferError::Internal { .. } | TransferError::ApiMisuse { .. } => {
                FailureKind::Internal
            }
            TransferError::Remote { kind, .. } => *kind,
        }
    }

    /// The human reason carried on the wire in `Status::Failed` / `Abort`.
    pub fn reason(&self) -> String {
        match self {
            TransferError::Aborted { reason, .. }
            | TransferError::Rejected { reason, .. }
            | TransferError::Remote { reason, .. }
            | TransferError::Internal { reason }
            | TransferError::ApiMisuse { reason } => reason.clone(),
            TransferError::PeerMisbehaved { what } => what.to_string(),
            TransferError::PeerIncompatible { detail } => detail.clone(),
            TransferError::Capacity { what } => what.clone(),
            other => other.to_string(),
        }
    }

    /// Rebuild the error a peer (`peer` is its role) reported in a
    /// `Status::Failed`. The kind, reason and status are kept exactly so both
    /// sides report the same thing, and the blame stays with the peer: every
    /// kind becomes [`TransferError::Remote`] — the peer's `peer_misbehaved`
    /// or `internal` is not ours — except the two that already say who
    /// decided: `rejected` (a verdict on the request, whoever made it) and
    /// `aborted` (its origin is the peer's role).
    /// A rejection keeps its API code (`code`, ignored for other kinds).
    pub fn from_wire(
        kind: FailureKind,
        reason: String,
        http_status: u16,
        code: Option<RejectCode>,
        peer: Role,
    ) -> Self {
        match kind {
            FailureKind::Aborted => TransferError::Aborted {
                origin: AbortOrigin::of_role(peer),
                reason,
                http_status,
            },
            FailureKind::Rejected => TransferError::Rejected {
                http_status,
                reason,
                code,
            },
            FailureKind::PeerMisbehaved
            | FailureKind::PeerIncompatible
            | FailureKind::PeerDead
            | FailureKind::Timeout
            | FailureKind::Capacity
            | FailureKind::DuplicateRoom
            | FailureKind::Internal => TransferError::Remote {
                kind,
                reason,
                http_status,
                peer,
            },
        }
    }
}

/// Wire code of a [`TransferError`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// See [`TransferError::PeerMisbehaved`].
    PeerMisbehaved,
    /// See [`TransferError::PeerIncompatible`].
    PeerIncompatible,
    /// See [`TransferError::PeerDead`].
    PeerDead,
    /// See [`TransferError::Timeout`].
    Timeout,
    /// See [`TransferError::Aborted`].
    Aborted,
    /// See [`TransferError::Rejected`].
    Rejected,
    /// See [`TransferError::Capacity`].
    Capacity,
    /// See [`TransferError::DuplicateRoom`].
    DuplicateRoom,
    /// See [`TransferError::Internal`] (and [`TransferError::ApiMisuse`],
    /// which travels as this kind).
    Internal,
}

impl FailureKind {
    /// Every kind, in wire-code order.
    pub const ALL: [FailureKind; 9] = [
        FailureKind::PeerMisbehaved,
        FailureKind::PeerIncompatible,
        FailureKind::PeerDead,
        FailureKind::Timeout,
        FailureKind::Aborted,
        FailureKind::Rejected,
        FailureKind::Capacity,
        FailureKind::DuplicateRoom,
        FailureKind::Internal,
    ];

    /// Stable snake-case label (this is [`TransferError::error_type`]).
    pub const fn name(self) -> &'static str {
        match self {
            FailureKind::PeerMisbehaved => "peer_misbehaved",
            FailureKind::PeerIncompatible => "peer_incompatible",
            FailureKind::PeerDead => "peer_dead",
            FailureKind::Timeout => "timeout",
            FailureKind::Aborted => "aborted",
            FailureKind::Rejected => "rejected",
            FailureKind::Capacity => "capacity",
            FailureKind::DuplicateRoom => "duplicate_room",
            FailureKind::Internal => "internal",
        }
    }

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            FailureKind::PeerMisbehaved => 1,
            FailureKind::PeerIncompatible => 2,
            FailureKind::PeerDead => 3,
            FailureKind::Timeout => 4,
            FailureKind::Aborted => 5,
            FailureKind::Rejected => 6,
            FailureKind::Capacity => 7,
            FailureKind::DuplicateRoom => 8,
            FailureKind::Internal => 9,
        }
    }

    /// From a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        FailureKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// The status a peer that does not send one (older protocol) implies.
    pub const fn default_http_status(self) -> u16 {
        match self {
            FailureKind::PeerDead | FailureKind::Capacity => 503,
            FailureKind::Timeout => 504,
            FailureKind::Aborted => 503,
            FailureKind::Rejected => 400,
            FailureKind::DuplicateRoom => 409,
            _ => 500,
        }
    }
}

/// Why a worker refused a request, as its API reports it: the error `type`
/// and the request field at fault. A `Status(Failed)` of kind `rejected`
/// carries it (capability [`crate::handshake::Capabilities::REJECT_CODE`]),
/// so a client that gets a prefill's refusal through decode sees the same
/// error as one that got it from the prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectCode {
    /// The prompt alone fills the context.
    PromptExceedsContext,
    /// The prompt fits, the prompt plus the output asked for does not.
    OutputExceedsContext,
    /// More KV pages than the whole pool.
    ExceedsKvCapacity,
    /// No prompt tokens.
    EmptyPrompt,
    /// A prompt token id outside the vocabulary.
    TokenOutOfRange,
    /// Any other invalid parameter.
    InvalidRequest,
}

impl RejectCode {
    /// Every code, in wire-code order.
    pub const ALL: [RejectCode; 6] = [
        RejectCode::PromptExceedsContext,
        RejectCode::OutputExceedsContext,
        RejectCode::ExceedsKvCapacity,
        RejectCode::EmptyPrompt,
        RejectCode::TokenOutOfRange,
        RejectCode::InvalidRequest,
    ];

    /// Wire code (0 means none and is never a code).
    pub const fn code(self) -> u8 {
        match self {
            RejectCode::PromptExceedsContext => 1,
            RejectCode::OutputExceedsContext => 2,
            RejectCode::ExceedsKvCapacity => 3,
            RejectCode::EmptyPrompt => 4,
            RejectCode::TokenOutOfRange => 5,
            RejectCode::InvalidRequest => 6,
        }
    }

    /// From a wire code; `None` for 0 and for codes of newer peers (their
    /// refusal still arrives, as plain `rejected`).
    pub fn from_code(code: u8) -> Option<Self> {
        RejectCode::ALL.into_iter().find(|c| c.code() == code)
    }

    /// The API error `type`.
    pub const fn api_type(self) -> &'static str {
        match self {
            RejectCode::PromptExceedsContext | RejectCode::OutputExceedsContext => {
                "context_length_exceeded"
            }
            RejectCode::ExceedsKvCapacity => "kv_capacity_exceeded",
            RejectCode::EmptyPrompt => "empty_prompt",
            RejectCode::TokenOutOfRange => "invalid_token_id",
            RejectCode::InvalidRequest => "invalid_request_error",
        }
    }

    /// The request field at fault (named as OpenAI's completions API does).
    pub const fn param(self) -> Option<&'static str> {
        match self {
            RejectCode::PromptExceedsContext
            | RejectCode::EmptyPrompt
            | RejectCode::TokenOutOfRange => Some("prompt"),
            RejectCode::OutputExceedsContext | RejectCode::ExceedsKvCapacity => Some("max_tokens"),
            RejectCode::InvalidRequest => None,
        }
    }
}

/// Why a mapping or range cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RankError {
    /// TP size or head count of zero.
    #[error("TP size and KV heads must be at least 1 (tp {tp}, kv heads {kv_heads})")]
    Zero {
        /// TP size.
        tp: u32,
        /// KV heads.
        kv_heads: u32,
    },
    /// TP size neither divides nor is a multiple of the KV heads.
    #[error("TP size {tp} neither divides nor is a multiple of {kv_heads} KV heads")]
    Indivisible {
        /// TP size.
        tp: u32,
        /// KV heads.
        kv_heads: u32,
    },
    /// A rank outside `0..tp`.
    #[error("{rank} out of range for TP size {tp}")]
    RankOutOfRange {
        /// The rank.
        rank: RankId,
        /// TP size.
        tp: u32,
    },
    /// A layer, page or head outside the layout, or arithmetic overflow.
    #[error("{what} out of range")]
    OutOfRange {
        /// What.
        what: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incompatible_names_both_values() {
        let e = HandshakeError::Incompatible {
            field: "page size",
            prefill: "16".into(),
            decode: "64".into(),
        };
        assert_eq!(e.to_string(), "page size: prefill has 16, decode has 64");
    }

    #[test]
    fn statuses_and_labels_are_stable() {
        let cases: Vec<(TransferError, u16, &str)> = vec![
            (
                TransferError::PeerMisbehaved {
                    what: Misbehavior::WritesRejected,
                },
                500,
                "peer_misbehaved",
            ),
            (
                TransferError::PeerIncompatible { detail: "x".into() },
                500,
                "peer_incompatible",
            ),
            (
                TransferError::PeerDead {
                    peer: PeerId(1),
                    detail: "x".into(),
                },
                503,
                "peer_dead",
            ),
            (
                TransferError::Timeout {
                    phase: Phase::Transferring,
                    after: std::time::Duration::from_secs(1),
                },
                504,
                "timeout",
            ),
            (
                TransferError::Aborted {
                    origin: AbortOrigin::Client,
                    reason: "gone".into(),
                    http_status: 499,
                },
                499,
                "aborted",
            ),
            (
                TransferError::Rejected {
                    http_status: 400,
                    reason: "too long".into(),
                    code: None,
                },
                400,
                "rejected",
            ),
            (
                TransferError::Capacity {
                    what: "pages".into(),
                },
                503,
                "capacity",
            ),
            (TransferError::DuplicateRoom, 409, "duplicate_room"),
            (
                TransferError::Internal { reason: "x".into() },
                500,
                "internal",
            ),
        ];
        for (e, status, label) in cases {
            assert_eq!(e.http_status(), status, "{e}");
            assert_eq!(e.error_type(), label, "{e}");
        }
    }

    #[test]
    fn failure_kind_codes_round_trip() {
        for k in FailureKind::ALL {
            assert_eq!(FailureKind::from_code(k.code()), Some(k));
        }
        assert_eq!(FailureKind::from_code(0), None);
        assert_eq!(FailureKind::from_code(200), None);
    }

    #[test]
    fn rejection_survives_the_wire() {
        let e = TransferError::Rejected {
            http_status: 400,
            reason: "prompt too long".into(),
            code: None,
        };
        let back =
            TransferError::from_wire(e.kind(), "prompt too long".into(), 400, None, Role::Prefill);
        assert_eq!(back, e);
        assert_eq!(back.http_status(), 400);
    }

    #[test]
    fn every_kind_keeps_its_label_across_the_wire() {
        for k in FailureKind::ALL {
            let e = TransferError::from_wire(k, "why".into(), 418, None, Role::Prefill);
            assert_eq!(e.error_type(), k.name());
            assert_eq!(e.kind(), k);
        }
        let t = TransferError::Timeout {
            phase: Phase::Bootstrapping,
            after: std::time::Duration::from_secs(30),
        };
        let back =
            TransferError::from_wire(t.kind(), t.reason(), t.http_status(), None, Role::Prefill);
        assert_eq!(back.error_type(), "timeout");
        assert_eq!(back.http_status(), 504);
        assert_eq!(back.reason(), "timed out in bootstrapping after 30.0 s");
    }

    #[test]
    fn a_peers_failure_stays_the_peers() {
        // The peer's own misbehaviour verdict, internal fault or capacity is
        // not ours: it comes back as Remote, with the peer's role.
        for (kind, status) in [
            (FailureKind::Internal, 500),
            (FailureKind::PeerMisbehaved, 500),
            (FailureKind::PeerIncompatible, 500),
            (FailureKind::Capacity, 503),
            (FailureKind::PeerDead, 503),
        ] {
            let e = TransferError::from_wire(kind, "gave up".into(), status, None, Role::Prefill);
            assert_eq!(
                e,
                TransferError::Remote {
                    kind,
                    reason: "gave up".into(),
                    http_status: status,
                    peer: Role::Prefill,
                }
            );
            assert_eq!(e.error_type(), kind.name());
            assert_eq!(e.http_status(), status);
            assert_eq!(e.reason(), "gave up");
            assert_eq!(
                e.to_string(),
                format!("{} reported by prefill: gave up", kind.name())
            );
        }
        let e =
            TransferError::from_wire(FailureKind::Internal, "x".into(), 500, None, Role::Decode);
        assert!(matches!(
            e,
            TransferError::Remote {
                kind: FailureKind::Internal,
                peer: Role::Decode,
                ..
            }
        ));
        // Relayed again, it keeps the peer's kind.
        assert_eq!(e.kind(), FailureKind::Internal);
    }

    #[test]
    fn api_misuse_has_its_own_label_and_travels_as_internal() {
        let e = TransferError::ApiMisuse {
            reason: "a room needs distinct sources".into(),
        };
        assert_eq!(e.error_type(), "api_misuse");
        assert_eq!(e.http_status(), 500);
        assert_eq!(e.kind(), FailureKind::Internal);
        assert_eq!(e.reason(), "a room needs distinct sources");
        // No new wire code: the kind byte is one every decoder knows.
        assert_eq!(
            FailureKind::from_code(e.kind().code()),
            Some(FailureKind::Internal)
        );
        let m = crate::message::Message::Status(crate::message::Status {
            room: crate::ids::RoomId::new(7).unwrap(),
            outcome: crate::message::Outcome::Failed {
                kind: e.kind(),
                reason: e.reason(),
                http_status: Some(e.http_status()),
                code: None,
            },
        });
        for caps in [
            crate::handshake::Capabilities::V1,
            crate::handshake::Capabilities::ALL,
        ] {
            let mut buf = Vec::new();
            m.encode_payload(caps, &mut buf);
            let back = crate::message::Message::decode(m.kind(), &buf, caps).unwrap();
            let crate::message::Message::Status(crate::message::Status {
                outcome:
                    crate::message::Outcome::Failed {
                        kind,
                        reason,
                        http_status,
                        ..
                    },
                ..
            }) = back
            else {
                panic!("not a failed status: {back:?}")
            };
            let status = http_status.unwrap_or_else(|| kind.default_http_status());
            let seen = TransferError::from_wire(kind, reason, status, None, Role::Decode);
            assert_eq!(seen.error_type(), "internal");
            assert_eq!(seen.http_status(), 500);
            assert_eq!(seen.reason(), "a room needs distinct sources");
        }
    }

    #[test]
    fn handshake_timeout_is_not_incompatibility() {
        let t = HandshakeError::TimedOut(std::time::Duration::from_secs(2));
        assert_eq!(
            (t.error_type(), t.http_status()),
            ("handshake_timeout", 504)
        );
        let i = HandshakeError::Incompatible {
            field: "page size",
            prefill: "16".into(),
            decode: "64".into(),
        };
        assert_eq!(
            (i.error_type(), i.http_status()),
            ("peer_incompatible", 500)
        );
        assert_eq!(HandshakeError::AuthFailed.error_type(), "peer_incompatible");
    }
}
