//! Version window (issue 14 item 9) against a *recorded* N-1 peer: the
//! bytes a protocol-1 decode sends (its `Register`, then a `Destination`, an
//! `Abort` and a `Heartbeat` framed at version 1 with no optional field)
//! are committed in `transcripts/decode_v1.hex`. The current prefill's
//! handshake and decoder must keep accepting them, whatever later versions
//! change in the encoder. Re-record only on purpose (the format of an old
//! version does not change): `HANDOFF_RECORD_TRANSCRIPTS=1 cargo test -p
//! handoff-proto --test n_minus_one`.

use handoff_proto::frame::{
    encode_frame, FrameDecoder, DEFAULT_MAX_FRAME_LEN, HANDSHAKE_FRAME_VERSION,
};
use handoff_proto::fuzz::sample_fingerprint;
use handoff_proto::handshake::{Capabilities, Handshake, HandshakeConfig};
use handoff_proto::message::{Abort, Destination, Heartbeat, Message};
use handoff_proto::HandshakeError;
use handoff_proto::{AuxSlot, PageIndex, Role, RoomId};

const TRANSCRIPT: &str = "tests/transcripts/decode_v1.hex";

/// What the recorded decode sent after its `Register`.
fn expected_messages() -> Vec<Message> {
    let room = RoomId::new(0x0102_0304_0506).unwrap();
    vec![
        Message::Destination(Destination {
            room,
            pages: vec![PageIndex(7), PageIndex(3), PageIndex(900)],
            aux_slot: AuxSlot(5),
            required_destinations: 1,
            prefix_tokens: None,
        }),
        Message::Abort(Abort {
            room,
            reason: "client went away".into(),
            http_status: None,
            origin: None,
        }),
        Message::Heartbeat(Heartbeat { seq: 42 }),
    ]
}

fn v1_decode() -> HandshakeConfig {
    let mut c = HandshakeConfig::new(Role::Decode, sample_fingerprint());
    c.max_version = 1;
    c.capabilities = Capabilities::V1;
    c
}

/// The transcript, as this build's encoder configured as a version-1
/// decode writes it (only used to record).
fn record() -> Vec<u8> {
    let mut hs = Handshake::new(v1_decode(), [7; 32]);
    let mut out = Vec::new();
    while let Some(m) = hs.poll_transmit() {
        encode_frame(
            &m,
            HANDSHAKE_FRAME_VERSION,
            Capabilities::NONE,
            DEFAULT_MAX_FRAME_LEN,
            &mut out,
        )
        .unwrap();
    }
    for m in expected_messages() {
        encode_frame(&m, 1, Capabilities::NONE, DEFAULT_MAX_FRAME_LEN, &mut out).unwrap();
    }
    out
}

fn transcript() -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(TRANSCRIPT);
    if std::env::var_os("HANDOFF_RECORD_TRANSCRIPTS").is_some() {
        let hex: String = record().iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(&path, hex + "\n").unwrap();
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let text = text.trim();
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// The current prefill reads the recorded decode's bytes: the handshake
/// settles on version 1 with no capability, and every later frame decodes
/// to exactly what the old decode meant.
#[test]
fn the_current_prefill_serves_a_recorded_version_1_decode() {
    let bytes = transcript();
    let mut prefill = Handshake::new(
        HandshakeConfig::new(Role::Prefill, sample_fingerprint()),
        [9; 32],
    );
    let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
    dec.push(&bytes);
    let Some(Ok(register @ Message::Register(_))) = dec.poll() else {
        panic!("the transcript does not start with a Register")
    };
    prefill.handle(register).unwrap();
    let n = prefill
        .negotiated()
        .expect("no handshake with the recorded decode")
        .clone();
    assert_eq!((n.version, n.capabilities), (1, Capabilities::NONE));
    assert!(
        matches!(prefill.poll_transmit(), Some(Message::Register(_))),
        "the prefill answers with its own Register"
    );
    dec.set_capabilities(n.capabilities);
    let got: Vec<Message> = std::iter::from_fn(|| dec.poll())
        .map(|m| m.expect("a recorded frame failed to decode"))
        .collect();
    assert_eq!(got, expected_messages());
}

/// A peer that speaks only versions below our window is refused, naming
/// both ranges (a prefill whose window starts at 2 meeting a version-1-only
/// decode stands for the next version meeting N-2).
#[test]
fn versions_older_than_the_window_are_refused_naming_both() {
    let mut old = HandshakeConfig::new(Role::Decode, sample_fingerprint());
    old.min_version = 1;
    old.max_version = 1;
    let mut current = HandshakeConfig::new(Role::Prefill, sample_fingerprint());
    current.min_version = 2;
    let mut d = Handshake::new(old, [1; 32]);
    let mut p = Handshake::new(current, [2; 32]);
    let m = d.poll_transmit().unwrap();
    let e = p.handle(m).unwrap_err();
    assert!(matches!(e, HandshakeError::VersionMismatch { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "protocol version: prefill speaks 2..=2, decode speaks 1..=1"
    );
}
