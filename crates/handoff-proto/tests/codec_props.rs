//! Property tests for the wire codec (CONVENTIONS.md "Tests"): every message
//! round-trips through a frame in any chunking, arbitrary bytes never panic
//! the decoder, truncated or extended payloads are rejected, and a corrupted
//! frame never takes the next one down with it.

use handoff_proto::error::{AbortOrigin, CodecError, FailureKind, RejectCode};
use handoff_proto::frame::{
    encode_frame, FrameDecoder, DEFAULT_MAX_FRAME_LEN, HEADER_LEN, PROTOCOL_VERSION,
};
use handoff_proto::handshake::{Capabilities, Fingerprint, KvLayoutKind};
use handoff_proto::layout::KvDtype;
use handoff_proto::message::{
    Abort, AbortAck, AuthProof, Destination, Heartbeat, Message, MessageKind, Outcome, Register,
    Status,
};
use handoff_proto::{AuxSlot, PageIndex, Role, RoomId};
use proptest::prelude::*;

fn arb_room() -> impl Strategy<Value = RoomId> {
    (1u64..=u64::MAX).prop_map(|n| RoomId::new(n).unwrap())
}

fn arb_reason() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 é😀:/._-]{0,40}"
}

fn arb_fingerprint() -> impl Strategy<Value = Fingerprint> {
    (
        "[a-zA-Z0-9._-]{0,24}",
        any::<[u8; 32]>(),
        1u32..100,
        1u32..64,
        1u32..512,
        1u32..256,
        0usize..5,
        1u32..16,
    )
        .prop_flat_map(
            |(model_id, model_hash, layers, kv_heads, head_dim, page_size, dtype, tp_size)| {
                (0..tp_size).prop_map(move |tp_rank| Fingerprint {
                    model_id: model_id.clone(),
                    model_hash,
                    layers,
                    kv_heads,
                    head_dim,
                    page_size,
                    dtype: KvDtype::ALL[dtype],
                    layout: KvLayoutKind::LayerPageKv,
                    tp_rank,
                    tp_size,
                })
            },
        )
}

/// A message as a peer with `full` capabilities (or none) would send it.
fn arb_message(full: bool) -> impl Strategy<Value = Message> {
    let status = 100u16..=599;
    let opt_status = if full {
        status.clone().prop_map(Some).boxed()
    } else {
        Just(None).boxed()
    };
    let reject_code = if full {
        prop::option::of(0usize..RejectCode::ALL.len()).boxed()
    } else {
        Just(None).boxed()
    };
    let origin = if full {
        prop_oneof![Just(None), (0u8..5).prop_map(AbortOrigin::from_code)].boxed()
    } else {
        Just(None).boxed()
    };
    let prefix = if full {
        any::<u32>().prop_map(Some).boxed()
    } else {
        Just(None).boxed()
    };
    prop_oneof![
        (
            any::<bool>(),
            1u8..=2,
            0u8..=2,
            any::<u64>(),
            arb_fingerprint(),
            any::<[u8; 32]>(),
            prop::option::of(4096u32..)
        )
            .prop_map(
                |(prefill, min, extra, caps, fingerprint, nonce, max_frame_len)| Message::Register(
                    Register {
                        role: if prefill { Role::Prefill } else { Role::Decode },
                        min_version: min,
                        max_version: min + extra,
                        capabilities: Capabilities::from_bits(caps),
                        fingerprint,
                        nonce,
                        max_frame_len,
                    }
                )
            ),
        any::<[u8; 32]>().prop_map(|mac| Message::AuthProof(AuthProof { mac })),
        (
            arb_room(),
            prop::collection::vec(any::<u32>(), 0..64),
            any::<u32>(),
            1u16..,
            prefix
        )
            .prop_map(
                |(room, pages, aux, required, prefix_tokens)| Message::Destination(Destination {
                    room,
                    pages: pages.into_iter().map(PageIndex).collect(),
                    aux_slot: AuxSlot(aux),
                    required_destinations: required,
                    prefix_tokens,
                })
            ),
        (arb_room(), arb_reason(), opt_status.clone(), origin).prop_map(
            |(room, reason, http_status, origin)| Message::Abort(Abort {
                room,
                reason,
                http_status,
                origin
            })
        ),
        (arb_room(), any::<bool>())
            .prop_map(|(room, drained)| Message::AbortAck(AbortAck { room, drained })),
        arb_room().prop_map(|room| Message::Status(Status {
            room,
            outcome: Outcome::Success
        })),
        (
            arb_room(),
            0usize..FailureKind::ALL.len(),
            arb_reason(),
            opt_status,
            reject_code
        )
            .prop_map(|(room, k, reason, http_status, code)| {
                Message::Status(Status {
                    room,
                    outcome: Outcome::Failed {
                        kind: FailureKind::ALL[k],
                        reason,
                        http_status,
                        code: code.map(|c| RejectCode::ALL[c]),
                    },
                })
            }),
        any::<u64>().prop_map(|seq| Message::Heartbeat(Heartbeat { seq })),
    ]
}

/// Register's capability bits round-trip raw, including unknown ones.
fn caps_for(full: bool) -> Capabilities {
    if full {
        Capabilities::ALL
    } else {
        Capabilities::NONE
    }
}

fn frame(m: &Message, caps: Capabilities) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_frame(m, PROTOCOL_VERSION, caps, DEFAULT_MAX_FRAME_LEN, &mut buf).unwrap();
    buf
}

fn payload(m: &Message, caps: Capabilities) -> Vec<u8> {
    let mut buf = Vec::new();
    m.encode_payload(caps, &mut buf);
    buf
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_in_any_chunking(full in any::<bool>(), msgs in prop::collection::vec(arb_message(true), 1..6), cut in 1usize..40) {
        let caps = caps_for(full);
        // Strip optional fields the capability set cannot carry.
        let expected: Vec<Message> = msgs.iter().map(|m| {
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
            d.set_capabilities(caps);
            d.push(&frame(m, caps));
            d.poll().unwrap().unwrap()
        }).collect();
        if full {
            prop_assert_eq!(&expected, &msgs);
        }
        let bytes: Vec<u8> = msgs.iter().flat_map(|m| frame(m, caps)).collect();
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.set_capabilities(caps);
        let mut got = Vec::new();
        for chunk in bytes.chunks(cut) {
            d.push(chunk);
            while let Some(r) = d.poll() {
                got.push(r.unwrap());
            }
        }
        prop_assert_eq!(got, expected);
        prop_assert_eq!(d.buffered(), 0);
        prop_assert_eq!(d.stats().errors, 0);
    }

    #[test]
    fn old_peer_form_round_trips_exactly(m in arb_message(false)) {
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.push(&frame(&m, Capabilities::NONE));
        prop_assert_eq!(d.poll(), Some(Ok(m)));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), cut in 1usize..64, full in any::<bool>()) {
        let mut d = FrameDecoder::new(4096);
        d.set_capabilities(caps_for(full));
        let mut results = 0u64;
        for chunk in bytes.chunks(cut) {
            d.push(chunk);
            while let Some(_r) = d.poll() {
                results += 1;
            }
        }
        prop_assert_eq!(results, d.stats().frames + d.stats().errors);
        prop_assert!(d.buffered() <= 4096 + HEADER_LEN);
        for kind in MessageKind::ALL {
            let _ = Message::decode(kind, &bytes, caps_for(full));
        }
    }

    #[test]
    fn truncated_and_extended_payloads_are_rejected(m in arb_message(true), cut in any::<prop::sample::Index>(), extra in prop::collection::vec(any::<u8>(), 1..8)) {
        let caps = Capabilities::ALL;
        let p = payload(&m, caps);
        let short = &p[..cut.index(p.len())];
        prop_assert!(Message::decode(m.kind(), short, caps).is_err(), "a strict prefix decoded");
        let mut long = p.clone();
        long.extend(&extra);
        let err = Message::decode(m.kind(), &long, caps).unwrap_err();
        // Register's extension list is last: extra bytes there read as a
        // (truncated) extension, anything else is trailing.
        prop_assert!(
            matches!(err, CodecError::TrailingBytes { .. }) || m.kind() == MessageKind::Register,
            "unexpected error {:?}", err
        );
    }

    #[test]
    fn a_corrupted_payload_does_not_take_the_next_frame_down(a in arb_message(true), b in arb_message(true), pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let caps = Capabilities::ALL;
        let mut fa = frame(&a, caps);
        let payload_len = fa.len() - HEADER_LEN;
        prop_assume!(payload_len > 0);
        let at = HEADER_LEN + pos.index(payload_len);
        fa[at] = byte;
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.set_capabilities(caps);
        d.push(&fa);
        d.push(&frame(&b, caps));
        let first = d.poll().unwrap();
        // The corrupted frame either still decodes (the byte was a free
        // value) or is one counted error; then b arrives intact.
        if first.is_err() {
            prop_assert_eq!(d.stats().errors, 1);
        }
        prop_assert_eq!(d.poll(), Some(Ok(b)));
        prop_assert_eq!(d.poll(), None);
    }
}
