//! Entry points for the cargo-fuzz targets in `fuzz/` (DESIGN.md §9). They
//! live here so the regular test suite runs them over the committed corpus
//! and random inputs on the stable toolchain. Each panics only on a real bug
//! (a decoded message that does not re-encode to the same message).

use crate::frame::{encode_frame, FrameDecoder, DEFAULT_MAX_FRAME_LEN, PROTOCOL_VERSION};
use crate::handshake::{
    Capabilities, Fingerprint, Handshake, HandshakeConfig, KvDtype, KvLayoutKind,
};
use crate::ids::Role;
use crate::message::Message;

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
/// secret, random bytes must never complete one).
pub fn handshake(data: &[u8]) -> usize {
    let mut done = 0;
    for role in [Role::Prefill, Role::Decode] {
        for secret in [None, Some(b"fuzz-secret".to_vec())] {
            let mut cfg = HandshakeConfig::new(role, sample_fingerprint());
            let with_secret = secret.is_some();
            cfg.secret = secret;
            let mut hs = Handshake::new(cfg, [1; 32]);
            while hs.poll_transmit().is_some() {}
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
            d.push(data);
            while let Some(r) = d.poll() {
                let Ok(m) = r else { continue };
                if hs.handle(m).is_err() {
                    assert!(
                        hs.poll_transmit().is_none(),
                        "nothing is sent after a failure"
                    );
                    break;
                }
                while hs.poll_transmit().is_some() {}
            }
            if hs.negotiated().is_some() {
                assert!(!with_secret || role == Role::Prefill || role == Role::Decode);
                done += 1;
            }
        }
    }
    done
}
