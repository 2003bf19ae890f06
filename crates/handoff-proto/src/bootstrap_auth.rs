//! Signed bootstrap fields: the router vouches for the
//! prefill endpoint it gives a decode worker, so that no client can make a
//! decode worker dial an address of its choosing. The signature is an
//! HMAC-SHA256, keyed with the transfer secret both workers and the router
//! share, over the room, the host, the port and the time of signing; a
//! decode worker dials only endpoints whose claim verifies and is fresh
//! (or that it was told to trust by name).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How far a claim's time may be from the verifier's clock (seconds).
pub const MAX_SKEW_SECS: u64 = 60;

/// What a router vouches for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootstrapClaim<'a> {
    /// The room pairing prefill and decode.
    pub room: u64,
    /// The prefill's host, as the request names it.
    pub host: &'a str,
    /// The prefill's bootstrap (transfer) port.
    pub port: u16,
    /// When the router signed, seconds since the Unix epoch.
    pub ts: u64,
}

/// Why a claim is not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// The signature is not 64 lowercase hex digits.
    #[error("the signature is not 64 lowercase hex digits")]
    Malformed,
    /// The signature does not match the claim under our secret.
    #[error("the signature does not match (another secret, or altered fields)")]
    Mismatch,
    /// The claim's time is too far from ours.
    #[error(
        "the claim was signed {0} s away from this worker's clock (at most {MAX_SKEW_SECS} s)"
    )]
    Stale(u64),
}

fn mac(secret: &[u8], c: &BootstrapClaim<'_>) -> Option<Hmac<Sha256>> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    m.update(b"handoff-bootstrap-v1\0");
    m.update(&c.room.to_be_bytes());
    m.update(&c.port.to_be_bytes());
    m.update(&c.ts.to_be_bytes());
    m.update(&(c.host.len() as u64).to_be_bytes());
    m.update(c.host.as_bytes());
    Some(m)
}

/// The signature of `claim` under `secret`, as 64 hex digits.
pub fn sign(secret: &[u8], claim: &BootstrapClaim<'_>) -> String {
    mac(secret, claim).map(hex).unwrap_or_default()
}

fn hex(m: Hmac<Sha256>) -> String {
    m.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One spelling per signature: 64 lowercase hex digits (found by the
/// `data_link` fuzz target: uppercase was accepted too).
fn parse_sig(sig: &str) -> Result<[u8; 32], ClaimError> {
    if sig.len() != 64 || !sig.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(ClaimError::Malformed);
    }
    let mut bytes = [0u8; 32];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(sig.get(2 * i..2 * i + 2).ok_or(ClaimError::Malformed)?, 16)
            .map_err(|_| ClaimError::Malformed)?;
    }
    Ok(bytes)
}

/// Check `sig` against `claim` under `secret` (in constant time), and the
/// claim's time against `now`.
pub fn verify(
    secret: &[u8],
    claim: &BootstrapClaim<'_>,
    sig: &str,
    now: u64,
) -> Result<(), ClaimError> {
    let bytes = parse_sig(sig)?;
    let m = mac(secret, claim).ok_or(ClaimError::Mismatch)?;
    m.verify_slice(&bytes).map_err(|_| ClaimError::Mismatch)?;
    let skew = now.abs_diff(claim.ts);
    if skew > MAX_SKEW_SECS {
        return Err(ClaimError::Stale(skew));
    }
    Ok(())
}

fn message_mac(secret: &[u8], domain: &str, parts: &[&[u8]]) -> Option<Hmac<Sha256>> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    m.update(domain.as_bytes());
    m.update(b"\0");
    for p in parts {
        m.update(&(p.len() as u64).to_be_bytes());
        m.update(p);
    }
    Some(m)
}

/// An HMAC-SHA256 under `secret` of `parts` (each length-prefixed, so no
/// two lists collide) in the namespace `domain`, as 64 hex digits: what
/// signs a discovery record.
pub fn sign_message(secret: &[u8], domain: &str, parts: &[&[u8]]) -> String {
    message_mac(secret, domain, parts)
        .map(hex)
        .unwrap_or_default()
}

/// Check a [`sign_message`] signature, in constant time.
pub fn verify_message(
    secret: &[u8],
    domain: &str,
    parts: &[&[u8]],
    sig: &str,
) -> Result<(), ClaimError> {
    let bytes = parse_sig(sig)?;
    message_mac(secret, domain, parts)
        .ok_or(ClaimError::Mismatch)?
        .verify_slice(&bytes)
        .map_err(|_| ClaimError::Mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_claim_verifies_and_every_altered_field_fails() {
        let claim = BootstrapClaim {
            room: 42,
            host: "10.0.0.7",
            port: 8998,
            ts: 1_000_000,
        };
        let sig = sign(b"secret", &claim);
        assert_eq!(sig.len(), 64);
        assert_eq!(verify(b"secret", &claim, &sig, 1_000_030), Ok(()));
        for altered in [
            BootstrapClaim { room: 43, ..claim },
            BootstrapClaim {
                host: "10.0.0.8",
                ..claim
            },
            BootstrapClaim {
                port: 8999,
                ..claim
            },
            BootstrapClaim {
                ts: 1_000_001,
                ..claim
            },
        ] {
            assert_eq!(
                verify(b"secret", &altered, &sig, 1_000_000),
                Err(ClaimError::Mismatch),
                "{altered:?}"
            );
        }
        assert_eq!(
            verify(b"other", &claim, &sig, 1_000_000),
            Err(ClaimError::Mismatch)
        );
        assert_eq!(
            verify(b"secret", &claim, &sig, 1_000_061),
            Err(ClaimError::Stale(61))
        );
        assert_eq!(
            verify(b"secret", &claim, &sig, 999_939),
            Err(ClaimError::Stale(61))
        );
        assert_eq!(
            verify(b"secret", &claim, "zz", 1_000_000),
            Err(ClaimError::Malformed)
        );
        assert_eq!(
            verify(b"secret", &claim, &sig.to_uppercase(), 1_000_000),
            Err(ClaimError::Malformed)
        );
        let not_hex = "g".repeat(64);
        assert_eq!(
            verify(b"secret", &claim, &not_hex, 1_000_000),
            Err(ClaimError::Malformed)
        );
        // Host and port cannot trade bytes: the host's length is signed.
        let a = BootstrapClaim {
            host: "h1",
            ..claim
        };
        let b = BootstrapClaim { host: "h", ..claim };
        assert_ne!(sign(b"s", &a), sign(b"s", &b));
    }
}
