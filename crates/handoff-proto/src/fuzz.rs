//! Entry points for the cargo-fuzz targets in `fuzz/`. They
//! live here so the regular test suite runs them over the committed corpus
//! and random inputs on the stable toolchain. Compiled only with the `fuzz`
//! feature (fuzz/Cargo.toml and this crate's tests turn it on). Each panics only on a real bug
//! (a decoded message that does not re-encode to the same message).

use crate::error::{AbortOrigin, FailureKind};
use crate::frame::{
    encode_frame, FrameDecoder, DEFAULT_MAX_FRAME_LEN, HANDSHAKE_FRAME_VERSION, PROTOCOL_VERSION,
};
use crate::handshake::{
    auth_proof, Capabilities, Fingerprint, Handshake, HandshakeConfig, KvLayoutKind,
};
use crate::ids::{AuxSlot, PageIndex, Role, RoomId};
use crate::layout::KvDtype;
use crate::message::{
    Abort, AbortAck, AuthProof, Destination, Heartbeat, Message, Outcome, Register, Status,
};

/// Feed `data` to a frame decoder (whole, then again in small chunks under
/// the v1 capability set) and check every decoded message round-trips.
/// Returns how many messages decoded.
pub fn decode_frames(data: &[u8]) -> usize {
    let mut ok = 0;
    for (caps, chunk) in [
        (Capabilities::ALL, data.len().max(1)),
        (Capabilities::V1, 7),
    ] {
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.set_capabilities(caps);
        let mut seen = 0u64;
        for part in data.chunks(chunk) {
            d.push(part);
            while let Some(r) = d.poll() {
                seen += 1;
                if let Ok(m) = r {
                    ok += 1;
                    check_round_trip(&m, caps);
                }
            }
        }
        assert_eq!(
            seen,
            d.stats().frames + d.stats().errors,
            "every result is counted"
        );
        assert!(d.buffered() <= DEFAULT_MAX_FRAME_LEN as usize + crate::frame::HEADER_LEN);
    }
    ok
}

fn check_round_trip(m: &Message, caps: Capabilities) {
    let mut buf = Vec::new();
    if encode_frame(m, PROTOCOL_VERSION, caps, DEFAULT_MAX_FRAME_LEN, &mut buf).is_err() {
        return;
    }
    let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
    d.set_capabilities(caps);
    d.push(&buf);
    match d.poll() {
        Some(Ok(back)) => assert_eq!(&back, m, "re-encoded message differs"),
        other => panic!("re-encoded message does not decode: {other:?}"),
    }
}

/// A fixed fingerprint used by the handshake target and tests.
pub fn sample_fingerprint() -> Fingerprint {
    Fingerprint {
        model_id: "SmolLM2-135M-Instruct-Q4_1".into(),
        model_hash: [7; 32],
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        page_size: 16,
        dtype: KvDtype::F32,
        layout: KvLayoutKind::LayerPageKv,
        tp_rank: 0,
        tp_size: 1,
    }
}

/// Feed the frames in `data` to handshakes of both roles, with and without a
/// secret. Must never panic; returns how many handshakes completed (with a
/// secret, random bytes must never complete one). After a failure the
/// handshake may send only what [`Handshake::handle`] documents: nothing,
/// or, if the failing message was the peer's correct proof, prefill's own.
pub fn handshake(data: &[u8]) -> usize {
    const OUR_NONCE: [u8; 32] = [1; 32];
    let mut done = 0;
    for role in [Role::Prefill, Role::Decode] {
        for secret in [None, Some(FUZZ_SECRET.to_vec())] {
            let mut cfg = HandshakeConfig::new(role, sample_fingerprint());
            let with_secret = secret.is_some();
            cfg.secret = secret;
            let mut hs = Handshake::new(cfg, OUR_NONCE);
            while hs.poll_transmit().is_some() {}
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
            d.push(data);
            // The accepted peer Register's (role, nonce).
            let mut peer: Option<(Role, [u8; 32])> = None;
            while let Some(r) = d.poll() {
                let Ok(m) = r else { continue };
                let expecting_proof = hs.negotiated().is_none();
                let proof_ok = match (&m, peer) {
                    (Message::AuthProof(p), Some((peer_role, peer_nonce)))
                        if with_secret && expecting_proof =>
                    {
                        p.mac == auth_proof(FUZZ_SECRET, peer_role, &peer_nonce, &OUR_NONCE)
                    }
                    _ => false,
                };
                let register = match &m {
                    Message::Register(r) => Some((r.role, r.nonce)),
                    _ => None,
                };
                if hs.handle(m).is_err() {
                    let sent: Vec<Message> = std::iter::from_fn(|| hs.poll_transmit()).collect();
                    let allowed = match (proof_ok, peer, role) {
                        (true, Some((_, peer_nonce)), Role::Prefill) => {
                            vec![Message::AuthProof(AuthProof {
                                mac: auth_proof(FUZZ_SECRET, role, &OUR_NONCE, &peer_nonce),
                            })]
                        }
                        _ => Vec::new(),
                    };
                    assert_eq!(
                        sent, allowed,
                        "after a failure only prefill's proof, to a peer that proved the secret"
                    );
                    break;
                }
                if peer.is_none() {
                    peer = register;
                }
                while hs.poll_transmit().is_some() {}
            }
            if let Some(n) = hs.negotiated() {
                assert_ne!(
                    n.peer_role, role,
                    "a completed handshake pairs opposite roles"
                );
                assert_eq!(n.capabilities.contains(Capabilities::AUTH), with_secret);
                done += 1;
            }
        }
    }
    done
}

/// The shared secret the handshake target tries.
pub const FUZZ_SECRET: &[u8] = b"fuzz-secret";

fn frames(msgs: &[Message], version: u8) -> Vec<u8> {
    let mut out = Vec::new();
    for m in msgs {
        // Seeds are small; encoding cannot exceed the limit.
        let _ = encode_frame(
            m,
            version,
            Capabilities::ALL,
            DEFAULT_MAX_FRAME_LEN,
            &mut out,
        );
    }
    out
}

fn register(role: Role, nonce: [u8; 32], with_secret: bool) -> Message {
    let mut fingerprint = sample_fingerprint();
    if role == Role::Decode {
        fingerprint.tp_rank = 0;
    }
    Message::Register(Register {
        role,
        min_version: 1,
        max_version: PROTOCOL_VERSION,
        capabilities: if with_secret {
            Capabilities::ALL
        } else {
            Capabilities::ALL.without(Capabilities::AUTH)
        },
        fingerprint,
        nonce,
        max_frame_len: Some(DEFAULT_MAX_FRAME_LEN),
    })
}

/// Seed inputs for the `frame_decoder` target: `(file name, bytes)`. The
/// committed corpus under `fuzz/corpus/frame_decoder/` is exactly these
/// (checked by a test).
pub fn frame_decoder_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let Some(room) = RoomId::new(0x1234_5678_9abc_def0) else {
        return Vec::new();
    };
    let all = vec![
        register(Role::Decode, [2; 32], false),
        Message::AuthProof(AuthProof { mac: [9; 32] }),
        Message::Destination(Destination {
            room,
            pages: vec![PageIndex(3), PageIndex(17), PageIndex(4)],
            aux_slot: AuxSlot(2),
            required_destinations: 2,
            prefix_tokens: Some(16),
        }),
        Message::Abort(Abort {
            room,
            reason: "client disconnected".into(),
            http_status: Some(499),
            origin: Some(AbortOrigin::Client),
        }),
        Message::AbortAck(AbortAck {
            room,
            drained: true,
        }),
        Message::Status(Status {
            room,
            outcome: Outcome::Success,
        }),
        Message::Status(Status {
            room,
            outcome: Outcome::Failed {
                kind: FailureKind::Rejected,
                reason: "prompt too long".into(),
                http_status: Some(400),
                code: None,
            },
        }),
        Message::Heartbeat(Heartbeat { seq: 42 }),
    ];
    let names = [
        "valid_register",
        "valid_auth_proof",
        "valid_destination",
        "valid_abort",
        "valid_abort_ack",
        "valid_status_success",
        "valid_status_failed",
        "valid_heartbeat",
    ];
    let mut out: Vec<(&'static str, Vec<u8>)> = names
        .iter()
        .zip(&all)
        .map(|(n, m)| (*n, frames(std::slice::from_ref(m), PROTOCOL_VERSION)))
        .collect();
    let stream = frames(&all, PROTOCOL_VERSION);
    out.push(("valid_stream_all_kinds", stream.clone()));
    let mut truncated = frames(&all[2..3], PROTOCOL_VERSION);
    truncated.pop();
    out.push(("truncated_destination", truncated));
    let mut garbage = b"GET / HTTP/1.1\r\n\r\n".to_vec();
    garbage.extend(frames(&all[7..8], PROTOCOL_VERSION));
    out.push(("garbage_then_heartbeat", garbage));
    let mut trailing = frames(&all[7..8], PROTOCOL_VERSION);
    trailing[8] += 1;
    trailing.push(0);
    out.push(("trailing_byte_heartbeat", trailing));
    out
}

/// Seed inputs for the `handshake` target (see [`handshake`]): a peer's
/// Register, with and without a correct proof for [`FUZZ_SECRET`].
pub fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let peer_nonce = [5u8; 32];
    let our_nonce = [1u8; 32];
    let decode_proof = auth_proof(FUZZ_SECRET, Role::Decode, &peer_nonce, &our_nonce);
    let prefill_proof = auth_proof(FUZZ_SECRET, Role::Prefill, &peer_nonce, &our_nonce);
    let v = HANDSHAKE_FRAME_VERSION;
    let mut mismatch = register(Role::Decode, peer_nonce, false);
    if let Message::Register(r) = &mut mismatch {
        r.fingerprint.page_size = 64;
    }
    let mut mismatch_with_auth = register(Role::Decode, peer_nonce, true);
    if let Message::Register(r) = &mut mismatch_with_auth {
        r.fingerprint.page_size = 64;
    }
    vec![
        (
            "decode_register_plain",
            frames(&[register(Role::Decode, peer_nonce, false)], v),
        ),
        (
            "prefill_register_plain",
            frames(&[register(Role::Prefill, peer_nonce, false)], v),
        ),
        (
            "decode_register_with_proof",
            frames(
                &[
                    register(Role::Decode, peer_nonce, true),
                    Message::AuthProof(AuthProof { mac: decode_proof }),
                ],
                v,
            ),
        ),
        (
            "prefill_register_with_proof",
            frames(
                &[
                    register(Role::Prefill, peer_nonce, true),
                    Message::AuthProof(AuthProof { mac: prefill_proof }),
                ],
                v,
            ),
        ),
        ("decode_register_page_size_64", frames(&[mismatch], v)),
        // Authenticated but incompatible: prefill's proof still goes out
        // (found by the first coverage-guided run).
        (
            "decode_register_with_proof_page_size_64",
            frames(
                &[
                    mismatch_with_auth,
                    Message::AuthProof(AuthProof { mac: decode_proof }),
                ],
                v,
            ),
        ),
    ]
}

/// Bytes off a data link and a router's bootstrap signature, the other
/// decoders of untrusted input: `data` cut into records, acks, stream setups
/// and a preface, each decoded; whatever decodes re-encodes to bytes that
/// decode to the same bytes. Then a bootstrap claim built from `data` with
/// the signature taken from it: it verifies only if it is the signature the
/// key makes. Returns how many pieces decoded or verified.
pub fn data_link(data: &[u8]) -> usize {
    use crate::bootstrap_auth::{sign, verify, BootstrapClaim};
    use crate::datalink::{
        decode_preface, encode_preface, Ack, Record, TcpStreamSetup, ACK_LEN, PREFACE_LEN,
        RECORD_LEN,
    };
    let mut ok = 0;
    for c in data.chunks_exact(RECORD_LEN) {
        let b: &[u8; RECORD_LEN] = c.try_into().unwrap_or(&[0; RECORD_LEN]);
        if let Ok(r) = Record::decode(b) {
            let e = r.encode();
            assert_eq!(Record::decode(&e).map(|r| r.encode()), Ok(e));
            if let Record::Segment(h) = r {
                ok += usize::from(placement_holds(&h, data));
            }
            ok += 1;
        }
    }
    for c in data.chunks_exact(ACK_LEN) {
        let b: &[u8; ACK_LEN] = c.try_into().unwrap_or(&[0; ACK_LEN]);
        if let Ok(a) = Ack::decode(b) {
            assert_eq!(Ack::decode(&a.encode()), Ok(a));
            ok += 1;
        }
    }
    for c in data.chunks_exact(TcpStreamSetup::LEN) {
        let b: &[u8; TcpStreamSetup::LEN] = c.try_into().unwrap_or(&[0; TcpStreamSetup::LEN]);
        if let Ok(s) = TcpStreamSetup::decode(b) {
            assert_eq!(TcpStreamSetup::decode(&s.encode()), Ok(s));
            ok += 1;
        }
    }
    if let Some(p) = data.get(..PREFACE_LEN) {
        let b: &[u8; PREFACE_LEN] = p.try_into().unwrap_or(&[0; PREFACE_LEN]);
        let (kind, endpoint, connect) = decode_preface(b);
        assert_eq!(&encode_preface(kind, endpoint, connect), b);
    }
    // A claim: room, port and time from the first 18 bytes, the host and
    // signature from the rest, split at the first `|`.
    if data.len() >= 18 {
        let n = |r: std::ops::Range<usize>| {
            data[r]
                .iter()
                .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
        };
        let rest = String::from_utf8_lossy(&data[18..]);
        let (host, sig) = rest.split_once('|').unwrap_or((&rest, ""));
        let claim = BootstrapClaim {
            room: n(0..8),
            port: n(8..10) as u16,
            ts: n(10..18),
            host,
        };
        if verify(b"fuzz key", &claim, sig, claim.ts).is_ok() {
            assert_eq!(sig, sign(b"fuzz key", &claim));
            ok += 1;
        }
    }
    ok
}

/// Decode's placement of a segment (`placement::place`) against a sample
/// pool, a room whose pages are the bits of the input's first 8 bytes and,
/// by the input's 9th byte, a whole-span or a head-sliced link: a placed
/// range lies in the pool and in the blocks of the segment's layer of the
/// room's own pages (in the one block its head slice names). Whether the
/// segment was placed.
pub fn placement_holds(h: &crate::datalink::SegmentHeader, data: &[u8]) -> bool {
    use crate::ids::{PageIndex, RankId};
    use crate::layout::PageLayout;
    use crate::rank::{PairPlan, SliceTransfer};
    let pool = PageLayout {
        layers: 4,
        local_heads: 2,
        page_size: 2,
        head_dim: 4,
        dtype_bytes: 2,
        num_pages: 64,
    };
    let len = pool.pool_bytes().unwrap_or(0);
    let bits = data
        .iter()
        .take(8)
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    let room: Vec<u32> = (0..64).filter(|p| bits >> p & 1 == 1).collect();
    let room_set = crate::placement::RoomPages::new(&room);
    let plan = if data.get(8).is_some_and(|b| b & 1 == 1) {
        PairPlan::Sliced(vec![SliceTransfer {
            prefill_rank: RankId(0),
            decode_rank: RankId(0),
            heads: 1..2,
            src_head_offset: 0,
            dst_head_offset: 1,
        }])
    } else {
        PairPlan::Whole
    };
    let Some(r) = crate::placement::place(&pool, 2, &plan, Some(&room_set), h, len) else {
        return false;
    };
    assert!(
        !r.is_empty() && r.end <= len,
        "{r:?} outside a pool of {len}"
    );
    let block = pool.block_bytes();
    let in_room = |p: u32| room.binary_search(&p).is_ok();
    match h.heads {
        None => {
            // Every byte in a span (K and V block) of the segment's layer
            // of a page of the room.
            let mut at = r.start;
            while at < r.end {
                let b = at / block;
                let (layer, page) = ((b / 2) as u32 / 64, (b / 2) as u32 % 64);
                assert!(
                    layer == h.layer && in_room(page),
                    "{r:?} reaches layer {layer} page {page}"
                );
                at = (b + 1) * block;
            }
            assert!(matches!(plan, PairPlan::Whole));
        }
        Some(s) => {
            let part = pool
                .block_offset(h.layer, PageIndex(h.dst_page), s.part)
                .unwrap_or(usize::MAX);
            assert!(in_room(h.dst_page) && part <= r.start && r.end <= part + block);
            assert!(s.first >= 1 || matches!(plan, PairPlan::Whole));
        }
    }
    true
}

/// Seeds of the `data_link` target: one valid piece of each kind, a claim
/// with its right signature, and garbage.
pub fn data_link_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use crate::bootstrap_auth::{sign, BootstrapClaim};
    use crate::datalink::{
        encode_preface, Ack, AuxData, HeadSlice, Record, SegmentHeader, TcpStreamSetup,
        PREFACE_DATA,
    };
    use crate::layout::KvPart;
    let room = RoomId::new(77).unwrap_or_else(|| unreachable!());
    let segment = Record::Segment(SegmentHeader {
        room,
        layer: 1,
        dst_page: 7,
        n_pages: 2,
        heads: Some(HeadSlice {
            part: KvPart::V,
            first: 2,
            count: 3,
        }),
    })
    .encode();
    let aux = Record::Aux {
        room,
        aux_slot: 4,
        written_room: 77,
        aux: AuxData {
            first_token: 42,
            logprob: -0.5,
            top: crate::datalink::TopLogprobs::NONE,
        },
    }
    .encode();
    let aux_top: Vec<u8> =
        crate::datalink::TopLogprobs::from_slice(&[(42, -0.5), (7, -1.25), (9, -3.0)])
            .records(room, 4)
            .iter()
            .flat_map(|r| r.encode())
            .collect();
    let end = Record::End {
        room,
        cancelled: false,
    }
    .encode();
    let ack = Ack { room, ok: true }.encode();
    let setup = TcpStreamSetup {
        nonce: 9,
        index: 1,
        count: 2,
    }
    .encode();
    let claim = BootstrapClaim {
        room: 77,
        host: "10.0.0.7",
        port: 8998,
        ts: 1_700_000_000,
    };
    let mut signed = Vec::new();
    signed.extend(77u64.to_be_bytes());
    signed.extend(8998u16.to_be_bytes());
    signed.extend(1_700_000_000u64.to_be_bytes());
    signed.extend(b"10.0.0.7|");
    signed.extend(sign(b"fuzz key", &claim).as_bytes());
    // Placed segments: the record's first 8 bytes (tag 1, room 5) put
    // pages 48, 50 and 56 in the room, its 9th byte (the room's top byte)
    // picks a whole-span (even) or head-sliced (odd) link.
    let placed = |room: u64, layer, dst_page, heads| {
        Record::Segment(SegmentHeader {
            room: RoomId::new(room).unwrap_or_else(|| unreachable!()),
            layer,
            dst_page,
            n_pages: 1,
            heads,
        })
        .encode()
        .to_vec()
    };
    let slice = HeadSlice {
        part: KvPart::V,
        first: 1,
        count: 1,
    };
    vec![
        ("placed_span", placed(5, 2, 56, None)),
        ("placed_slice", placed(1 << 56 | 5, 1, 50, Some(slice))),
        ("segment_record", segment.to_vec()),
        ("aux_record", aux.to_vec()),
        ("end_record", end.to_vec()),
        ("records_in_a_row", [segment, aux, end].concat()),
        ("aux_top_records", aux_top),
        ("ack", ack.to_vec()),
        ("stream_setup", setup.to_vec()),
        ("data_preface", encode_preface(PREFACE_DATA, 5, 6).to_vec()),
        ("signed_claim", signed),
        ("garbage", vec![0xA5; 64]),
    ]
}
