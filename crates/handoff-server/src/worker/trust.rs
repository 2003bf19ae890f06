//! Which prefill endpoints a decode worker dials. A
//! request's `bootstrap_host` and `bootstrap_port` name where decode
//! connects, so a client of a decode worker must not choose them: decode
//! dials an endpoint only when the request carries a fresh signature of it
//! by a router holding the transfer secret (`bootstrap_sig`,
//! `bootstrap_ts`; [`handoff_proto::bootstrap_auth`]), or when the worker
//! was started with that endpoint on its allow-list (`--prefill-allow`,
//! how SGLang's router, which cannot sign, is supported). Anything else is
//! a 403 before any name is resolved or any socket opened.

use std::sync::Arc;

use handoff_proto::bootstrap_auth::{verify, BootstrapClaim, ClaimError};

use crate::http::errors::ApiError;
use crate::worker::backend::Bootstrap;

/// The transfer secret a router signs bootstrap fields with (never
/// printed).
#[derive(Clone)]
pub struct TransferSecret(Arc<[u8]>);

impl TransferSecret {
    /// A secret; `None` if empty.
    pub fn new(bytes: Vec<u8>) -> Option<Self> {
        (!bytes.is_empty()).then(|| TransferSecret(bytes.into()))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for TransferSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferSecret(<redacted>)")
    }
}

/// A prefill transfer endpoint named on the allow-list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedPrefill {
    /// The host as requests name it (compared without case).
    pub host: String,
    /// The bootstrap port.
    pub port: u16,
}

impl std::str::FromStr for AllowedPrefill {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("`{s}` is not HOST:PORT"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("`{s}` names no host"));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| format!("`{s}`: `{port}` is not a port"))?;
        Ok(AllowedPrefill {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

/// What a decode worker trusts.
#[derive(Clone, Default)]
pub struct BootstrapTrust {
    secret: Option<Arc<[u8]>>,
    allow: Arc<[AllowedPrefill]>,
    any: bool,
}

impl std::fmt::Debug for BootstrapTrust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapTrust")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("allow", &self.allow)
            .field("any", &self.any)
            .finish()
    }
}

impl BootstrapTrust {
    /// Trust what the router holding `secret` signed, and the endpoints
    /// in `allow`. With neither, every request is refused.
    pub fn new(secret: Option<Vec<u8>>, allow: Vec<AllowedPrefill>) -> Self {
        BootstrapTrust {
            secret: secret.filter(|s| !s.is_empty()).map(Into::into),
            allow: allow.into(),
            any: false,
        }
    }

    /// Trust every endpoint a request names: for embedders that vet
    /// requests before they reach the worker (and tests). No flag of the
    /// binary gives this.
    pub fn any() -> Self {
        BootstrapTrust {
            any: true,
            ..Default::default()
        }
    }

    /// Whether decode may dial the endpoint `b` names, at `now` (seconds
    /// since the Unix epoch); a 403 naming what is missing otherwise.
    pub fn check(&self, b: &Bootstrap, now: u64) -> Result<(), ApiError> {
        if self.any {
            return Ok(());
        }
        let (Some(host), Some(port), Some(room)) = (b.host.as_deref(), b.port, b.room) else {
            // The engine's own check names the missing fields.
            return Ok(());
        };
        let lower = host.to_ascii_lowercase();
        if self.allow.iter().any(|a| a.host == lower && a.port == port) {
            return Ok(());
        }
        let refuse = |why: String| {
            let mut e = ApiError::new(
                403,
                "untrusted_bootstrap",
                format!(
                    "this decode worker does not dial {host}:{port}: {why}; it dials only prefill endpoints a router signed with the shared transfer secret (--transfer-secret-file) or that --prefill-allow names"
                ),
            );
            e.param = Some("bootstrap_host".into());
            e
        };
        let Some(secret) = &self.secret else {
            return Err(refuse(
                "it has no transfer secret to check a signature with".into(),
            ));
        };
        let (Some(sig), Some(ts)) = (b.sig.as_deref(), b.ts) else {
            return Err(refuse(
                "the request carries no bootstrap_sig and bootstrap_ts".into(),
            ));
        };
        let claim = BootstrapClaim {
            room,
            host,
            port,
            ts,
        };
        verify(secret, &claim, sig, now).map_err(|e| match e {
            ClaimError::Stale(_) => refuse(format!("{e}")),
            _ => refuse(format!("bootstrap_sig: {e}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_proto::bootstrap_auth::sign;

    fn bootstrap(host: &str, port: u16, sig: Option<String>, ts: Option<u64>) -> Bootstrap {
        Bootstrap {
            host: Some(host.into()),
            port: Some(port),
            room: Some(7),
            sig,
            ts,
            ..Default::default()
        }
    }

    #[test]
    fn decode_dials_only_signed_or_allowed_endpoints() {
        let now = 1_700_000_000;
        let claim = BootstrapClaim {
            room: 7,
            host: "10.1.2.3",
            port: 8998,
            ts: now,
        };
        let sig = sign(b"k", &claim);
        let trust = BootstrapTrust::new(
            Some(b"k".to_vec()),
            vec!["Prefill.Local:9000".parse().unwrap()],
        );
        assert!(trust
            .check(
                &bootstrap("10.1.2.3", 8998, Some(sig.clone()), Some(now)),
                now
            )
            .is_ok());
        assert!(trust
            .check(&bootstrap("prefill.local", 9000, None, None), now)
            .is_ok());
        for (b, why) in [
            (
                bootstrap("10.1.2.3", 8998, None, None),
                "carries no bootstrap_sig",
            ),
            (
                bootstrap("10.1.2.3", 22, Some(sig.clone()), Some(now)),
                "does not match",
            ),
            (
                bootstrap("10.1.2.3", 8998, Some(sig.clone()), Some(now + 1)),
                "does not match",
            ),
            (
                bootstrap("prefill.local", 9001, None, None),
                "carries no bootstrap_sig",
            ),
        ] {
            let e = trust.check(&b, now).unwrap_err();
            assert_eq!((e.status, e.code), (403, "untrusted_bootstrap"));
            assert!(e.message.contains(why), "{}", e.message);
        }
        let e = trust
            .check(
                &bootstrap("10.1.2.3", 8998, Some(sig), Some(now)),
                now + 120,
            )
            .unwrap_err();
        assert!(e.message.contains("120 s away"), "{}", e.message);
        let none = BootstrapTrust::new(None, vec![]);
        let e = none
            .check(&bootstrap("127.0.0.1", 8998, None, None), now)
            .unwrap_err();
        assert!(e.message.contains("no transfer secret"), "{}", e.message);
        assert!(BootstrapTrust::any()
            .check(&bootstrap("x", 1, None, None), now)
            .is_ok());
        assert!("a:b".parse::<AllowedPrefill>().is_err());
        assert!(":80".parse::<AllowedPrefill>().is_err());
        assert_eq!(
            "[::1]:8998".parse::<AllowedPrefill>(),
            Ok(AllowedPrefill {
                host: "::1".into(),
                port: 8998
            })
        );
    }
}
