//! Connection handshake (DESIGN.md §4 "Handshake", "Rolling upgrade").
//!
//! Both ends send [`Register`]: version range, capability bits, the KV
//! compatibility [`Fingerprint`] and a caller-provided nonce. Each end then
//! computes the same result: the highest common version, the intersection of
//! capabilities, and either compatibility or an [`HandshakeError`] that names
//! the field and both values ("page size: prefill has 16, decode has 64").
//!
//! With a shared secret, each end proves it with
//! `HMAC-SHA256(secret, label ‖ prover role ‖ prover nonce ‖ verifier nonce)`;
//! the secret never crosses the wire. Decode proves first; prefill answers
//! with its own proof only after checking decode's, so a connector that fails
//! the check gets nothing more from prefill. The fingerprint comparison runs
//! only after authentication.
//!
//! Sans-IO: feed received messages to [`Handshake::handle`], send what
//! [`Handshake::poll_transmit`] returns, stop when [`Handshake::negotiated`]
//! is `Some` or `handle` returned an error (then close the connection).

use std::collections::VecDeque;
use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::HandshakeError;
use crate::frame::{DEFAULT_MAX_FRAME_LEN, PROTOCOL_VERSION, PROTOCOL_VERSION_MIN};
use crate::ids::Role;
use crate::message::{AuthProof, Message, Register, NONCE_LEN};
use crate::rank;

/// Capability bits negotiated per connection (intersection of both ends).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities(u64);

impl Capabilities {
    /// No capability.
    pub const NONE: Capabilities = Capabilities(0);
    /// `Status::Failed` and `Abort` carry an HTTP status and `Abort` its origin
    /// (protocol 2).
    pub const FAILURE_DETAIL: Capabilities = Capabilities(1 << 0);
    /// `Destination` carries the decode prefix-hit length (protocol 2).
    pub const DESTINATION_PREFIX: Capabilities = Capabilities(1 << 1);
    /// The end has a shared secret and runs challenge-response (protocol 1).
    pub const AUTH: Capabilities = Capabilities(1 << 2);
    /// Everything protocol 1 knew.
    pub const V1: Capabilities = Capabilities::AUTH;
    /// Everything this build knows.
    pub const ALL: Capabilities = Capabilities(0b111);

    /// From raw bits; unknown bits are kept (and then lost in intersection).
    pub const fn from_bits(bits: u64) -> Self {
        Capabilities(bits)
    }

    /// Raw bits.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: Capabilities) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bits set in both.
    pub const fn intersect(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & other.0)
    }

    /// Bits set in either.
    pub const fn union(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    /// `self` without the bits of `other`.
    pub const fn without(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & !other.0)
    }
}

impl fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (bit, name) in [
            (Capabilities::FAILURE_DETAIL, "FAILURE_DETAIL"),
            (Capabilities::DESTINATION_PREFIX, "DESTINATION_PREFIX"),
            (Capabilities::AUTH, "AUTH"),
        ] {
            if self.contains(bit) {
                names.push(name);
            }
        }
        let unknown = self.0 & !Capabilities::ALL.0;
        if unknown != 0 {
            return write!(f, "Capabilities({} | {unknown:#x})", names.join(" | "));
        }
        write!(f, "Capabilities({})", names.join(" | "))
    }
}

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, E4M3.
    F8E4M3,
    /// 8-bit float, E5M2.
    F8E5M2,
}

impl KvDtype {
    /// Every dtype.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::F8E4M3,
        KvDtype::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F8E4M3 | KvDtype::F8E5M2 => 1,
        }
    }

    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::F8E4M3 => "f8e4m3",
            KvDtype::F8E5M2 => "f8e5m2",
        }
    }

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::Bf16 => 2,
            KvDtype::F8E4M3 => 3,
            KvDtype::F8E5M2 => 4,
        }
    }

    /// From a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        KvDtype::ALL.into_iter().find(|d| d.code() == code)
    }
}

/// How a KV pool is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvLayoutKind {
    /// Layer-major, then page, then K before V; each block is
    /// `[kv_head][token_slot][head_dim]` (see [`crate::rank::PageLayout`]).
    LayerPageKv,
}

impl KvLayoutKind {
    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            KvLayoutKind::LayerPageKv => "layer-page-kv",
        }
    }

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            KvLayoutKind::LayerPageKv => 0,
        }
    }

    /// From a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(KvLayoutKind::LayerPageKv),
            _ => None,
        }
    }
}

/// What must match between a prefill and a decode before any byte of KV moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// Model identity (name / path), for humans.
    pub model_id: String,
    /// Hash of the weights (e.g. SHA-256 of the GGUF tensor data), so two
    /// files with the same name but different weights do not pair.
    pub model_hash: [u8; 32],
    /// Transformer layers.
    pub layers: u32,
    /// KV heads of the whole model (before TP sharding).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Element type.
    pub dtype: KvDtype,
    /// Memory layout.
    pub layout: KvLayoutKind,
    /// This worker's TP rank.
    pub tp_rank: u32,
    /// This worker group's TP size.
    pub tp_size: u32,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Fingerprint {
    /// Compare with the peer's fingerprint. `self` is `our_role`'s. The error
    /// names the first differing field and both values, prefill first.
    pub fn check_compatible(
        &self,
        our_role: Role,
        peer: &Fingerprint,
    ) -> Result<(), HandshakeError> {
        let (p, d) = match our_role {
            Role::Prefill => (self, peer),
            Role::Decode => (peer, self),
        };
        let fields: [(&'static str, String, String); 8] = [
            ("model", p.model_id.clone(), d.model_id.clone()),
            ("model hash", hex(&p.model_hash), hex(&d.model_hash)),
            ("layers", p.layers.to_string(), d.layers.to_string()),
            ("KV heads", p.kv_heads.to_string(), d.kv_heads.to_string()),
            ("head dim", p.head_dim.to_string(), d.head_dim.to_string()),
            (
                "page size",
                p.page_size.to_string(),
                d.page_size.to_string(),
            ),
            ("KV dtype", p.dtype.name().into(), d.dtype.name().into()),
            ("KV layout", p.layout.name().into(), d.layout.name().into()),
        ];
        for (field, prefill, decode) in fields {
            if prefill != decode {
                return Err(HandshakeError::Incompatible {
                    field,
                    prefill,
                    decode,
                });
            }
        }
        if rank::head_assignment(p.kv_heads, p.tp_size).is_err()
            || rank::head_assignment(d.kv_heads, d.tp_size).is_err()
        {
            return Err(HandshakeError::Incompatible {
                field: "TP size (must divide or be a multiple of the KV heads)",
                prefill: format!("{} for {} KV heads", p.tp_size, p.kv_heads),
                decode: format!("{} for {} KV heads", d.tp_size, d.kv_heads),
            });
        }
        Ok(())
    }
}

/// One end's handshake settings.
#[derive(Clone)]
pub struct HandshakeConfig {
    /// Our role.
    pub role: Role,
    /// Lowest version we speak.
    pub min_version: u8,
    /// Highest version we speak.
    pub max_version: u8,
    /// Capabilities we support ([`Capabilities::AUTH`] is added or removed
    /// according to `secret`).
    pub capabilities: Capabilities,
    /// Our fingerprint.
    pub fingerprint: Fingerprint,
    /// Optional shared secret.
    pub secret: Option<Vec<u8>>,
    /// Largest frame payload we accept.
    pub max_frame_len: u32,
}

impl fmt::Debug for HandshakeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandshakeConfig")
            .field("role", &self.role)
            .field("min_version", &self.min_version)
            .field("max_version", &self.max_version)
            .field("capabilities", &self.capabilities)
            .field("fingerprint", &self.fingerprint)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("max_frame_len", &self.max_frame_len)
            .finish()
    }
}

impl HandshakeConfig {
    /// Current-version settings for `role` with `fingerprint`, no secret.
    pub fn new(role: Role, fingerprint: Fingerprint) -> Self {
        Self {
            role,
            min_version: PROTOCOL_VERSION_MIN,
            max_version: PROTOCOL_VERSION,
            capabilities: Capabilities::ALL,
            fingerprint,
            secret: None,
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
        }
    }

    fn advertised(&self) -> Capabilities {
        if self.secret.is_some() {
            self.capabilities.union(Capabilities::AUTH)
        } else {
            self.capabilities.without(Capabilities::AUTH)
        }
    }
}

/// What a completed handshake agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Protocol version for every later frame header.
    pub version: u8,
    /// Capabilities both ends have; pass to encode/decode.
    pub capabilities: Capabilities,
    /// The peer's role.
    pub peer_role: Role,
    /// The peer's fingerprint (TP rank and size for the rank mapping).
    pub peer_fingerprint: Fingerprint,
    /// Largest payload we may send the peer.
    pub peer_max_frame_len: u32,
}

#[derive(Debug)]
enum State {
    /// Waiting for the peer's `Register`.
    ExpectRegister,
    /// We are decode and sent our proof; waiting for prefill's proof.
    ExpectPeerProof {
        result: Negotiated,
        peer_nonce: [u8; NONCE_LEN],
    },
    /// We are prefill; waiting for decode's proof before we prove anything.
    ExpectFirstProof {
        result: Negotiated,
        peer_nonce: [u8; NONCE_LEN],
    },
    Done(Negotiated),
    Failed,
}

/// One connection's handshake, sans-IO.
#[derive(Debug)]
pub struct Handshake {
    config: HandshakeConfig,
    nonce: [u8; NONCE_LEN],
    state: State,
    out: VecDeque<Message>,
}

const AUTH_LABEL: &[u8] = b"handoff-auth-v1";

fn role_byte(role: Role) -> u8 {
    match role {
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

fn auth_mac(
    secret: &[u8],
    prover: Role,
    prover_nonce: &[u8; NONCE_LEN],
    verifier_nonce: &[u8; NONCE_LEN],
) -> Option<Hmac<Sha256>> {
    // HMAC takes keys of any length; `new_from_slice` cannot fail, but a
    // failure is handled as "no proof" rather than a panic.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    mac.update(AUTH_LABEL);
    mac.update(&[role_byte(prover)]);
    mac.update(prover_nonce);
    mac.update(verifier_nonce);
    Some(mac)
}

/// The proof `prover` sends: `HMAC-SHA256(secret, label ‖ role ‖ prover
/// nonce ‖ verifier nonce)`. Public for tests and fuzzing.
pub fn auth_proof(
    secret: &[u8],
    prover: Role,
    prover_nonce: &[u8; NONCE_LEN],
    verifier_nonce: &[u8; NONCE_LEN],
) -> [u8; NONCE_LEN] {
    let mut out = [0u8; NONCE_LEN];
    if let Some(mac) = auth_mac(secret, prover, prover_nonce, verifier_nonce) {
        out.copy_from_slice(&mac.finalize().into_bytes());
    }
    out
}

impl Handshake {
    /// Start a handshake; our `Register` is queued for [`Self::poll_transmit`].
    /// `nonce` must be fresh random bytes from the caller (sans-IO: no RNG here).
    pub fn new(config: HandshakeConfig, nonce: [u8; NONCE_LEN]) -> Self {
        let register = Register {
            role: config.role,
            min_version: config.min_version,
            max_version: config.max_version,
            capabilities: config.advertised(),
            fingerprint: config.fingerprint.clone(),
            nonce,
            max_frame_len: Some(config.max_frame_len),
        };
        let mut out = VecDeque::new();
        out.push_back(Message::Register(register));
        Self {
            config,
            nonce,
            state: State::ExpectRegister,
            out,
        }
    }

    /// Next handshake message to send, if any. Call after `new` and after
    /// every `handle`.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.out.pop_front()
    }

    /// The agreed parameters once the handshake is complete.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        match &self.state {
            State::Done(n) => Some(n),
            _ => None,
        }
    }

    /// Whether the handshake failed (the connection must be closed).
    pub fn is_failed(&self) -> bool {
        matches!(self.state, State::Failed)
    }

    /// Feed one received message. On error the handshake is dead: close the
    /// connection. Nothing more is ever queued for the peer after an error.
    pub fn handle(&mut self, msg: Message) -> Result<(), HandshakeError> {
        let state = std::mem::replace(&mut self.state, State::Failed);
        match self.step(state, msg) {
            Ok(next) => {
                self.state = next;
                Ok(())
            }
            Err(e) => {
                self.out.clear();
                Err(e)
            }
        }
    }

    fn step(&mut self, state: State, msg: Message) -> Result<State, HandshakeError> {
        let role = self.config.role;
        match (state, msg) {
            (State::ExpectRegister, Message::Register(peer)) => {
                let negotiated = self.negotiate(&peer)?;
                let Some(secret) = &self.config.secret else {
                    self.config
                        .fingerprint
                        .check_compatible(role, &peer.fingerprint)?;
                    return Ok(State::Done(negotiated));
                };
                match role {
                    Role::Decode => {
                        let mac = auth_proof(secret, role, &self.nonce, &peer.nonce);
                        self.out.push_back(Message::AuthProof(AuthProof { mac }));
                        Ok(State::ExpectPeerProof {
                            result: negotiated,
                            peer_nonce: peer.nonce,
                        })
                    }
                    Role::Prefill => Ok(State::ExpectFirstProof {
                        result: negotiated,
                        peer_nonce: peer.nonce,
                    }),
                }
            }
            (State::ExpectFirstProof { result, peer_nonce }, Message::AuthProof(p)) => {
                self.check_proof(&result, &peer_nonce, &p)?;
                if let Some(secret) = &self.config.secret {
                    let mac = auth_proof(secret, role, &self.nonce, &peer_nonce);
                    self.out.push_back(Message::AuthProof(AuthProof { mac }));
                }
                Ok(State::Done(result))
            }
            (State::ExpectPeerProof { result, peer_nonce }, Message::AuthProof(p)) => {
                self.check_proof(&result, &peer_nonce, &p)?;
                Ok(State::Done(result))
            }
            (state, msg) => Err(HandshakeError::Unexpected {
                kind: msg.kind().name(),
                expecting: match state {
                    State::ExpectRegister => "Register",
                    State::ExpectPeerProof { .. } | State::ExpectFirstProof { .. } => "AuthProof",
                    State::Done(_) => "nothing (handshake complete)",
                    State::Failed => "nothing (handshake failed)",
                },
            }),
        }
    }

    /// Verify the peer's proof (constant time), then the fingerprint.
    fn check_proof(
        &self,
        result: &Negotiated,
        peer_nonce: &[u8; NONCE_LEN],
        p: &AuthProof,
    ) -> Result<(), HandshakeError> {
        let secret = self
            .config
            .secret
            .as_deref()
            .ok_or(HandshakeError::AuthFailed)?;
        let mac = auth_mac(secret, result.peer_role, peer_nonce, &self.nonce)
            .ok_or(HandshakeError::AuthFailed)?;
        mac.verify_slice(&p.mac)
            .map_err(|_| HandshakeError::AuthFailed)?;
        self.config
            .fingerprint
            .check_compatible(self.config.role, &result.peer_fingerprint)
    }

    fn negotiate(&self, peer: &Register) -> Result<Negotiated, HandshakeError> {
        let role = self.config.role;
        if peer.role == role {
            return Err(HandshakeError::SameRole(role));
        }
        let low = self.config.min_version.max(peer.min_version);
        let high = self.config.max_version.min(peer.max_version);
        if low > high {
            return Err(HandshakeError::VersionMismatch {
                ours_role: role,
                ours_min: self.config.min_version,
                ours_max: self.config.max_version,
                theirs_role: peer.role,
                theirs_min: peer.min_version,
                theirs_max: peer.max_version,
            });
        }
        let ours = self.config.advertised();
        let ours_auth = ours.contains(Capabilities::AUTH);
        let theirs_auth = peer.capabilities.contains(Capabilities::AUTH);
        if ours_auth != theirs_auth {
            let (with_secret, without) = if ours_auth {
                (role, peer.role)
            } else {
                (peer.role, role)
            };
            return Err(HandshakeError::AuthMismatch {
                with_secret,
                without,
            });
        }
        Ok(Negotiated {
            version: high,
            capabilities: ours
                .intersect(peer.capabilities)
                .intersect(Capabilities::ALL),
            peer_role: peer.role,
            peer_fingerprint: peer.fingerprint.clone(),
            peer_max_frame_len: peer.max_frame_len.unwrap_or(DEFAULT_MAX_FRAME_LEN),
        })
    }
}
