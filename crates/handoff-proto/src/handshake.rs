//! Connection handshake.
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
use crate::ids::Role;
use crate::message::{AuthProof, Message, Register, NONCE_LEN};
use crate::version::{DEFAULT_MAX_FRAME_LEN, PROTOCOL_VERSION, PROTOCOL_VERSION_MIN};

pub use crate::capabilities::Capabilities;
pub use crate::fingerprint::{Fingerprint, KvLayoutKind};

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

impl Negotiated {}

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
    /// The peer proved the shared secret: our own proof may go out even if
    /// the fingerprint check then fails, so both ends log the same reason.
    peer_authenticated: bool,
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
            peer_authenticated: false,
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
    /// connection after sending what [`Self::poll_transmit`] still returns,
    /// which is nothing unless the peer proved the shared secret (then our
    /// own proof goes out, so an incompatible but authenticated peer learns
    /// the same reason we did).
    pub fn handle(&mut self, msg: Message) -> Result<(), HandshakeError> {
        let state = std::mem::replace(&mut self.state, State::Failed);
        match self.step(state, msg) {
            Ok(next) => {
                self.state = next;
                Ok(())
            }
            Err(e) => {
                if !self.peer_authenticated {
                    self.out.clear();
                }
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
                self.config
                    .fingerprint
                    .check_compatible(role, &result.peer_fingerprint)?;
                Ok(State::Done(result))
            }
            (State::ExpectPeerProof { result, peer_nonce }, Message::AuthProof(p)) => {
                self.check_proof(&result, &peer_nonce, &p)?;
                self.config
                    .fingerprint
                    .check_compatible(role, &result.peer_fingerprint)?;
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

    /// Verify the peer's proof (constant time).
    fn check_proof(
        &mut self,
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
        self.peer_authenticated = true;
        Ok(())
    }

    fn negotiate(&self, peer: &Register) -> Result<Negotiated, HandshakeError> {
        let role = self.config.role;
        if peer.role == role {
            return Err(HandshakeError::SameRole(role));
        }
        let low = self.config.min_version.max(peer.min_version);
        let high = self.config.max_version.min(peer.max_version);
        if low > high {
            let ours = (self.config.min_version, self.config.max_version);
            let theirs = (peer.min_version, peer.max_version);
            let (p, d) = match role {
                Role::Prefill => (ours, theirs),
                Role::Decode => (theirs, ours),
            };
            return Err(HandshakeError::VersionMismatch {
                prefill_min: p.0,
                prefill_max: p.1,
                decode_min: d.0,
                decode_max: d.1,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FailureKind;
    use crate::frame::{encode_frame, FrameDecoder, HANDSHAKE_FRAME_VERSION};
    use crate::fuzz::sample_fingerprint;
    use crate::ids::RoomId;
    use crate::layout::KvDtype;
    use crate::message::{Outcome, Status};

    /// Move one message through the real codec.
    fn wire(m: &Message) -> Message {
        let mut buf = Vec::new();
        encode_frame(
            m,
            HANDSHAKE_FRAME_VERSION,
            Capabilities::NONE,
            DEFAULT_MAX_FRAME_LEN,
            &mut buf,
        )
        .unwrap();
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.push(&buf);
        d.poll().unwrap().unwrap()
    }

    /// Run both ends to completion; returns each end's result. Like a real
    /// shell, each end sends what it has queued (its Register, at connect)
    /// before it reads anything.
    #[allow(clippy::type_complexity)]
    fn run(
        p: HandshakeConfig,
        d: HandshakeConfig,
    ) -> (
        Handshake,
        Result<(), HandshakeError>,
        Handshake,
        Result<(), HandshakeError>,
        usize,
    ) {
        let mut hp = Handshake::new(p, [1; 32]);
        let mut hd = Handshake::new(d, [2; 32]);
        let (mut rp, mut rd) = (Ok(()), Ok(()));
        let mut sent_by_prefill = 0;
        for _ in 0..10 {
            let to_p: Vec<Message> = std::iter::from_fn(|| hd.poll_transmit()).collect();
            let to_d: Vec<Message> = std::iter::from_fn(|| hp.poll_transmit()).collect();
            sent_by_prefill += to_d.len();
            if to_p.is_empty() && to_d.is_empty() {
                break;
            }
            for m in to_p {
                if rp.is_ok() {
                    rp = hp.handle(wire(&m));
                }
            }
            for m in to_d {
                if rd.is_ok() {
                    rd = hd.handle(wire(&m));
                }
            }
        }
        (hp, rp, hd, rd, sent_by_prefill)
    }

    fn cfg(role: Role) -> HandshakeConfig {
        HandshakeConfig::new(role, sample_fingerprint())
    }

    #[test]
    fn plain_handshake_negotiates_current_version() {
        let (hp, rp, hd, rd, _) = run(cfg(Role::Prefill), cfg(Role::Decode));
        assert_eq!((rp, rd), (Ok(()), Ok(())));
        let n = hp.negotiated().unwrap();
        assert_eq!(n.version, PROTOCOL_VERSION);
        assert_eq!(
            n.capabilities,
            Capabilities::FAILURE_DETAIL
                .union(Capabilities::DESTINATION_PREFIX)
                .union(Capabilities::REJECT_CODE)
                .union(Capabilities::AUX_TOP)
        );
        assert_eq!(n.peer_role, Role::Decode);
        assert_eq!(hd.negotiated().unwrap().peer_role, Role::Prefill);
        assert_eq!(n.peer_fingerprint.tp_rank, 0);
    }

    #[test]
    fn shared_secret_authenticates_both_ways() {
        let mut p = cfg(Role::Prefill);
        let mut d = cfg(Role::Decode);
        p.secret = Some(b"s3cret".to_vec());
        d.secret = Some(b"s3cret".to_vec());
        let (hp, rp, hd, rd, sent) = run(p, d);
        assert_eq!((rp, rd), (Ok(()), Ok(())));
        assert!(hp
            .negotiated()
            .unwrap()
            .capabilities
            .contains(Capabilities::AUTH));
        assert!(hd.negotiated().is_some());
        assert_eq!(sent, 2, "prefill sends Register and its proof");
    }

    #[test]
    fn wrong_secret_gets_nothing_from_prefill() {
        let mut p = cfg(Role::Prefill);
        let mut d = cfg(Role::Decode);
        p.secret = Some(b"right".to_vec());
        d.secret = Some(b"wrong".to_vec());
        let (hp, rp, hd, rd, sent) = run(p, d);
        assert_eq!(rp, Err(HandshakeError::AuthFailed));
        assert_eq!(rd, Ok(()), "decode is still waiting: it never got a proof");
        assert!(hp.is_failed() && hp.negotiated().is_none() && hd.negotiated().is_none());
        assert_eq!(sent, 1, "prefill sent only its Register, never a proof");
    }

    #[test]
    fn the_secret_never_crosses_the_wire() {
        let secret = b"do-not-leak-this-secret";
        let mut d = cfg(Role::Decode);
        d.secret = Some(secret.to_vec());
        let mut hd = Handshake::new(d, [2; 32]);
        let mut p = cfg(Role::Prefill);
        p.secret = Some(secret.to_vec());
        let mut hp = Handshake::new(p, [1; 32]);
        let mut bytes = Vec::new();
        let reg = hp.poll_transmit().unwrap();
        hd.handle(reg).unwrap();
        while let Some(m) = hd.poll_transmit() {
            encode_frame(&m, 1, Capabilities::NONE, DEFAULT_MAX_FRAME_LEN, &mut bytes).unwrap();
        }
        assert!(!bytes.windows(secret.len()).any(|w| w == secret));
        // The proof is bound to the prover's role: decode's proof is not prefill's.
        assert_ne!(
            auth_proof(secret, Role::Decode, &[2; 32], &[1; 32]),
            auth_proof(secret, Role::Prefill, &[2; 32], &[1; 32])
        );
    }

    #[test]
    fn page_size_mismatch_names_both_values_on_both_sides() {
        let p = cfg(Role::Prefill);
        let mut d = cfg(Role::Decode);
        d.fingerprint.page_size = 64;
        let (_, rp, _, rd, _) = run(p, d);
        let msg = "page size: prefill has 16, decode has 64";
        assert_eq!(rp.unwrap_err().to_string(), msg);
        assert_eq!(rd.unwrap_err().to_string(), msg);
    }

    #[test]
    fn authenticated_but_incompatible_peers_both_learn_why() {
        let mut p = cfg(Role::Prefill);
        let mut d = cfg(Role::Decode);
        p.secret = Some(b"k".to_vec());
        d.secret = Some(b"k".to_vec());
        d.fingerprint.page_size = 64;
        let (_, rp, _, rd, sent) = run(p, d);
        let msg = "page size: prefill has 16, decode has 64";
        assert_eq!(rp.unwrap_err().to_string(), msg);
        assert_eq!(rd.unwrap_err().to_string(), msg);
        assert_eq!(
            sent, 2,
            "prefill's proof went out: decode had proved the secret"
        );
    }

    #[test]
    fn every_fingerprint_field_is_checked() {
        let base = sample_fingerprint();
        let mut cases: Vec<(Fingerprint, &str)> = Vec::new();
        let mut f = base.clone();
        f.model_id = "other".into();
        cases.push((
            f,
            "model: prefill has SmolLM2-135M-Instruct-Q4_1, decode has other",
        ));
        let mut f = base.clone();
        f.model_hash = [8; 32];
        cases.push((f, "model hash"));
        let mut f = base.clone();
        f.layers = 31;
        cases.push((f, "layers: prefill has 30, decode has 31"));
        let mut f = base.clone();
        f.kv_heads = 4;
        cases.push((f, "KV heads: prefill has 3, decode has 4"));
        let mut f = base.clone();
        f.head_dim = 128;
        cases.push((f, "head dim: prefill has 64, decode has 128"));
        let mut f = base.clone();
        f.dtype = KvDtype::F16;
        cases.push((f, "KV dtype: prefill has f32, decode has f16"));
        let mut f = base.clone();
        f.tp_size = 2;
        cases.push((f, "TP size"));
        for (decode_fp, expect) in cases {
            let err = base
                .check_compatible(Role::Prefill, &decode_fp)
                .unwrap_err();
            assert!(err.to_string().starts_with(expect), "{err} vs {expect}");
        }
        let mut tp = base.clone();
        tp.tp_size = 3;
        tp.tp_rank = 2;
        assert_eq!(
            base.check_compatible(Role::Prefill, &tp),
            Ok(()),
            "TP 3 over 3 heads is fine"
        );
    }

    #[test]
    fn version_n_minus_one_interoperates() {
        // An old decode: protocol 1 only, v1 capabilities.
        let p = cfg(Role::Prefill);
        let mut d = cfg(Role::Decode);
        d.max_version = 1;
        d.capabilities = Capabilities::V1;
        let (hp, rp, hd, rd, _) = run(p, d);
        assert_eq!((rp, rd), (Ok(()), Ok(())));
        let np = hp.negotiated().unwrap().clone();
        let nd = hd.negotiated().unwrap().clone();
        assert_eq!((np.version, nd.version), (1, 1));
        assert_eq!(np.capabilities, Capabilities::NONE);
        assert_eq!(np.capabilities, nd.capabilities);
        // New prefill reports a 400 rejection; the old decode gets kind and
        // reason, and its default status for the kind is the same 400.
        let status = Message::Status(Status {
            room: RoomId::new(5).unwrap(),
            outcome: Outcome::Failed {
                kind: FailureKind::Rejected,
                reason: "prompt too long".into(),
                http_status: Some(400),
                code: None,
            },
        });
        let mut buf = Vec::new();
        encode_frame(
            &status,
            np.version,
            np.capabilities,
            np.peer_max_frame_len,
            &mut buf,
        )
        .unwrap();
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        dec.set_capabilities(nd.capabilities);
        dec.push(&buf);
        let Some(Ok(Message::Status(Status {
            outcome:
                Outcome::Failed {
                    kind,
                    reason,
                    http_status,
                    ..
                },
            ..
        }))) = dec.poll()
        else {
            panic!("old decode could not read the new prefill's status");
        };
        assert_eq!(
            (kind, reason.as_str(), http_status),
            (FailureKind::Rejected, "prompt too long", None)
        );
        assert_eq!(kind.default_http_status(), 400);
    }

    #[test]
    fn unknown_register_extensions_are_skipped() {
        let mut hs = Handshake::new(cfg(Role::Decode), [2; 32]);
        let Some(Message::Register(reg)) = hs.poll_transmit() else {
            panic!()
        };
        let mut payload = Vec::new();
        Message::Register(reg.clone()).encode_payload(Capabilities::NONE, &mut payload);
        // Rewrite the extension list: one known (max_frame_len) plus a future tag.
        let ext_at = payload.len() - (2 + 2 + 2 + 4);
        payload.truncate(ext_at);
        payload.extend(2u16.to_le_bytes());
        payload.extend(0x7777u16.to_le_bytes());
        payload.extend(3u16.to_le_bytes());
        payload.extend([9, 9, 9]);
        payload.extend(1u16.to_le_bytes());
        payload.extend(4u16.to_le_bytes());
        payload.extend(65_536u32.to_le_bytes());
        let back = Message::decode(
            crate::message::MessageKind::Register,
            &payload,
            Capabilities::NONE,
        )
        .unwrap();
        let Message::Register(back) = back else {
            panic!()
        };
        assert_eq!(back.max_frame_len, Some(65_536));
        assert_eq!(back.fingerprint, reg.fingerprint);
    }

    #[test]
    fn disjoint_versions_fail() {
        let p = cfg(Role::Prefill);
        let mut d = cfg(Role::Decode);
        d.min_version = 3;
        d.max_version = 4;
        let (_, rp, _, _, _) = run(p, d);
        assert_eq!(
            rp.unwrap_err().to_string(),
            "protocol version: prefill speaks 1..=2, decode speaks 3..=4"
        );
    }

    #[test]
    fn role_and_auth_mismatches_fail() {
        let (_, rp, _, _, _) = run(cfg(Role::Prefill), cfg(Role::Prefill));
        assert_eq!(rp, Err(HandshakeError::SameRole(Role::Prefill)));
        let mut p = cfg(Role::Prefill);
        p.secret = Some(b"x".to_vec());
        let (_, rp, _, rd, _) = run(p, cfg(Role::Decode));
        let e = HandshakeError::AuthMismatch {
            with_secret: Role::Prefill,
            without: Role::Decode,
        };
        assert_eq!((rp, rd), (Err(e.clone()), Err(e)));
    }

    #[test]
    fn out_of_order_messages_fail() {
        let mut hs = Handshake::new(cfg(Role::Prefill), [1; 32]);
        let err = hs
            .handle(Message::AuthProof(AuthProof { mac: [0; 32] }))
            .unwrap_err();
        assert_eq!(
            err,
            HandshakeError::Unexpected {
                kind: "AuthProof",
                expecting: "Register"
            }
        );
        assert!(
            hs.poll_transmit().is_none(),
            "a failed handshake sends nothing, not even Register"
        );
    }
}
