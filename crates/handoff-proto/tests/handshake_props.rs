//! Property test for the handshake: for random pairs of configurations both
//! ends reach the same verdict — the same negotiated version and
//! capabilities, or the same error — and the handshake succeeds exactly when
//! versions overlap, fingerprints are compatible and the secrets agree.

use handoff_proto::connection::{Connection, ConnectionEvent};
use handoff_proto::error::HandshakeError;
use handoff_proto::fuzz::sample_fingerprint;
use handoff_proto::handshake::{Capabilities, Fingerprint, HandshakeConfig};
use handoff_proto::Role;
use proptest::prelude::*;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Side {
    versions: (u8, u8),
    caps: u64,
    page_size: u32,
    tp_size: u32,
    secret: Option<&'static [u8]>,
}

fn side() -> impl Strategy<Value = Side> {
    (
        1u8..=3,
        0u8..=2,
        any::<u64>(),
        prop::sample::select(vec![16u32, 64]),
        prop::sample::select(vec![1u32, 3, 2]),
        prop::sample::select(vec![None, Some(&b"alpha"[..]), Some(&b"beta"[..])]),
    )
        .prop_map(|(min, extra, caps, page_size, tp_size, secret)| Side {
            versions: (min, min + extra),
            caps,
            page_size,
            tp_size,
            secret,
        })
}

fn config(role: Role, s: &Side) -> HandshakeConfig {
    let fingerprint = Fingerprint {
        page_size: s.page_size,
        tp_size: s.tp_size,
        tp_rank: 0,
        ..sample_fingerprint()
    };
    let mut c = HandshakeConfig::new(role, fingerprint);
    c.min_version = s.versions.0;
    c.max_version = s.versions.1;
    c.capabilities = Capabilities::from_bits(s.caps);
    c.secret = s.secret.map(<[u8]>::to_vec);
    c
}

fn run(p: &Side, d: &Side) -> (Vec<ConnectionEvent>, Vec<ConnectionEvent>) {
    let now = Instant::now();
    let mut a = Connection::new(
        config(Role::Prefill, p),
        [1; 32],
        Duration::from_secs(5),
        now,
    );
    let mut b = Connection::new(
        config(Role::Decode, d),
        [2; 32],
        Duration::from_secs(5),
        now,
    );
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    for _ in 0..8 {
        let to_b = a.take_output();
        let to_a = b.take_output();
        if to_a.is_empty() && to_b.is_empty() {
            break;
        }
        b.handle_bytes(&to_b, now);
        a.handle_bytes(&to_a, now);
        ea.extend(std::iter::from_fn(|| a.poll_event()));
        eb.extend(std::iter::from_fn(|| b.poll_event()));
    }
    (ea, eb)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn both_ends_agree(p in side(), d in side()) {
        let (ep, ed) = run(&p, &d);
        let overlap = p.versions.0.max(d.versions.0) <= p.versions.1.min(d.versions.1);
        // 3 KV heads: TP 2 is invalid on either side.
        let compatible = p.page_size == d.page_size && p.tp_size != 2 && d.tp_size != 2;
        let secrets_agree = p.secret == d.secret;
        let should_succeed = overlap && compatible && secrets_agree;
        match (ep.as_slice(), ed.as_slice()) {
            ([ConnectionEvent::Established(np)], [ConnectionEvent::Established(nd)]) => {
                prop_assert!(should_succeed, "succeeded but should not: {:?} {:?}", p, d);
                prop_assert_eq!(np.version, p.versions.1.min(d.versions.1));
                prop_assert_eq!(np.version, nd.version);
                prop_assert_eq!(np.capabilities, nd.capabilities);
                let expected = Capabilities::from_bits(p.caps & d.caps & Capabilities::ALL.bits()).without(Capabilities::AUTH);
                let expected = if p.secret.is_some() { expected.union(Capabilities::AUTH) } else { expected };
                prop_assert_eq!(np.capabilities, expected);
            }
            ([ConnectionEvent::Failed(a)], [ConnectionEvent::Failed(b)]) => {
                prop_assert!(!should_succeed);
                prop_assert_eq!(a.to_string(), b.to_string(), "both ends log the same reason");
            }
            ([ConnectionEvent::Failed(HandshakeError::AuthFailed)], []) => {
                // Wrong secret: prefill refuses and decode hears nothing more.
                prop_assert!(p.secret.is_some() && d.secret.is_some() && !secrets_agree);
                prop_assert!(overlap);
            }
            other => prop_assert!(false, "unexpected outcome {:?} for {:?} {:?}", other, p, d),
        }
    }
}
