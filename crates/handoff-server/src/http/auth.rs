//! API keys (`--api-key`, `--api-key-file`): with a key set, every route
//! but the open ones (`--open-path`, by default `/health`, `/readiness` and
//! `/metrics`, for probes and scrapers) needs `Authorization: Bearer KEY`;
//! anything else is a 401 with an OpenAI-style JSON error. Keys are compared
//! in constant time.
//!
//! A key file may hold several keys, one per line: `NAME KEY`, optionally
//! followed by the highest `priority` that key's requests may ask (`#`
//! starts a comment). Each key is a tenant: the name is what fair sharing
//! between tenants goes by ([`crate::http::tenancy`]). The first key is the
//! cluster's own: the router sends it to its workers, and a request made
//! with it may name the tenant it is made for (`x-handoff-tenant`). A file
//! holding one bare key is that key alone, named `default`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::http::errors::ApiError;
use crate::http::tenancy::{MAX_PRIORITY_HEADER, TENANT_HEADER};

/// The paths open without a key by default.
pub const DEFAULT_OPEN_PATHS: &[&str] = &["/health", "/readiness", "/metrics"];

/// The name of a key given alone (`--api-key`, a one-key file).
pub const DEFAULT_TENANT: &str = "default";

/// One key of the set.
#[derive(Clone)]
struct Named {
    name: Arc<str>,
    key: Arc<str>,
    max_priority: Option<i32>,
}

/// The keys (the first the cluster's own) and the paths that need none.
#[derive(Clone)]
pub struct ApiKey {
    keys: Arc<[Named]>,
    open_paths: Arc<[String]>,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.keys.iter().map(|k| &*k.name).collect();
        f.debug_struct("ApiKey")
            .field("names", &names)
            .field("key", &"<redacted>")
            .field("open_paths", &self.open_paths)
            .finish()
    }
}

/// Why a key cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApiKeyError {
    /// The key is empty (or only white space).
    #[error("the API key is empty")]
    Empty,
    /// The key holds characters an HTTP header cannot carry.
    #[error("the API key holds characters an HTTP header cannot carry (use printable ASCII)")]
    NotPrintable,
    /// An open path does not start with `/`.
    #[error("open path {0:?} does not start with /")]
    BadPath(String),
    /// A line of a key file is not `NAME KEY [MAX_PRIORITY]`.
    #[error("line {line}: {why}")]
    BadLine {
        /// 1-based.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
}

impl ApiKey {
    /// A key (surrounding white space, such as a key file's newline, is
    /// dropped), named `default`, and the paths open without it.
    pub fn new(key: &str, open_paths: &[String]) -> Result<Self, ApiKeyError> {
        let key = checked_key(key)?;
        Self::of(
            vec![Named {
                name: DEFAULT_TENANT.into(),
                key,
                max_priority: None,
            }],
            open_paths,
        )
    }

    /// The keys of a key file: one bare key, or lines of
    /// `NAME KEY [MAX_PRIORITY]` (blank lines and `#` comments skipped).
    pub fn from_file(text: &str, open_paths: &[String]) -> Result<Self, ApiKeyError> {
        let lines: Vec<(usize, Vec<&str>)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.split('#').next().unwrap_or("")))
            .map(|(n, l)| (n, l.split_whitespace().collect::<Vec<_>>()))
            .filter(|(_, words)| !words.is_empty())
            .collect();
        if let [(_, words)] = lines.as_slice() {
            if let [key] = words.as_slice() {
                return Self::new(key, open_paths);
            }
        }
        if lines.is_empty() {
            return Err(ApiKeyError::Empty);
        }
        let mut keys: Vec<Named> = Vec::new();
        for (line, words) in lines {
            let bad = |why: String| ApiKeyError::BadLine { line, why };
            let (name, key, max) = match words.as_slice() {
                [name, key] => (name, key, None),
                [name, key, max] => (name, key, Some(max)),
                _ => {
                    return Err(bad(format!(
                        "expected NAME KEY [MAX_PRIORITY], got {} words",
                        words.len()
                    )))
                }
            };
            let key = checked_key(key).map_err(|e| bad(e.to_string()))?;
            let max_priority = match max {
                None => None,
                Some(m) => Some(
                    m.parse::<i32>()
                        .ok()
                        .filter(|p| crate::http::tenancy::priority_in_range(*p))
                        .ok_or_else(|| {
                            bad(format!(
                                "the highest priority must be an integer in {}..={}, got {m:?}",
                                crate::http::tenancy::PRIORITY_MIN,
                                crate::http::tenancy::PRIORITY_MAX
                            ))
                        })?,
                ),
            };
            if keys.is_empty() && max_priority.is_some() {
                return Err(bad(
                    "the first key is the cluster's own (the router sends it to its workers): it cannot have a priority limit".into(),
                ));
            }
            if !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(bad(format!(
                    "key name {name:?}: use letters, digits, '-', '_' and '.'"
                )));
            }
            if keys.iter().any(|k| &*k.name == *name) {
                return Err(bad(format!("the key name {name:?} is used twice")));
            }
            if keys.iter().any(|k| k.key == key) {
                return Err(bad(format!("{name}'s key is also another name's")));
            }
            keys.push(Named {
                name: (*name).into(),
                key,
                max_priority,
            });
        }
        Self::of(keys, open_paths)
    }

    fn of(keys: Vec<Named>, open_paths: &[String]) -> Result<Self, ApiKeyError> {
        if let Some(p) = open_paths.iter().find(|p| !p.starts_with('/')) {
            return Err(ApiKeyError::BadPath(p.clone()));
        }
        Ok(ApiKey {
            keys: keys.into(),
            open_paths: open_paths.to_vec().into(),
        })
    }

    /// The cluster's key (to hand to a worker process through its
    /// environment).
    pub fn secret(&self) -> &str {
        &self.keys[0].key
    }

    /// The `Authorization` header value that carries the cluster's key.
    pub fn bearer(&self) -> HeaderValue {
        // Checked printable ASCII in `checked_key`.
        HeaderValue::from_str(&format!("Bearer {}", self.secret()))
            .unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    fn open(&self, path: &str) -> bool {
        self.open_paths.iter().any(|p| p == path)
    }

    /// Which key `header` (an `Authorization` value) carries, if any. Every
    /// key is compared, so the time depends on the keys' lengths only.
    fn admits(&self, header: Option<&HeaderValue>) -> Option<usize> {
        let given = header.and_then(|h| h.to_str().ok()).and_then(|h| {
            h.strip_prefix("Bearer ")
                .or_else(|| h.strip_prefix("bearer "))
        })?;
        let given = given.trim().as_bytes();
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            if constant_time_eq(given, k.key.as_bytes()) && found.is_none() {
                found = Some(i);
            }
        }
        found
    }

    /// Whether `header` carries the cluster's key (the first).
    pub(crate) fn is_cluster_key(&self, header: Option<&HeaderValue>) -> bool {
        self.admits(header) == Some(0)
    }
}

/// A key, trimmed, non-empty and printable.
fn checked_key(key: &str) -> Result<Arc<str>, ApiKeyError> {
    let key = key.trim();
    if key.is_empty() {
        return Err(ApiKeyError::Empty);
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiKeyError::NotPrintable);
    }
    Ok(key.into())
}

/// Equal bytes, in time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `app` with `key` required on every route but its open paths (no key:
/// `app` as it is).
pub fn require_api_key(app: Router, key: Option<ApiKey>) -> Router {
    match key {
        None => app,
        Some(k) => app.layer(middleware::from_fn_with_state(k, check)),
    }
}

async fn check(State(key): State<ApiKey>, mut req: Request, next: Next) -> Response {
    if key.open(req.uri().path()) {
        return next.run(req).await;
    }
    if let Some(i) = key.admits(req.headers().get(AUTHORIZATION)) {
        let k = &key.keys[i];
        let headers = req.headers_mut();
        // Only the cluster's key may speak for another tenant (the router
        // for its client); any other is its own tenant, with its limit.
        if i != 0 || !headers.contains_key(TENANT_HEADER) {
            if let Ok(v) = HeaderValue::from_str(&k.name) {
                headers.insert(TENANT_HEADER, v);
            }
        }
        headers.remove(MAX_PRIORITY_HEADER);
        if let Some(max) = k.max_priority {
            headers.insert(MAX_PRIORITY_HEADER, HeaderValue::from(max));
        }
        return next.run(req).await;
    }
    let why = if req.headers().contains_key(AUTHORIZATION) {
        "the API key is not valid"
    } else {
        "this server needs an API key: send `Authorization: Bearer KEY`"
    };
    let mut resp = ApiError::new(401, "invalid_api_key", why).into_response();
    resp.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_whole_and_in_constant_time() {
        let open = vec!["/health".to_string()];
        let k = ApiKey::new(" s3cret\n", &open).unwrap();
        let h = |v: &str| HeaderValue::from_str(v).unwrap();
        assert_eq!(k.admits(Some(&h("Bearer s3cret"))), Some(0));
        assert_eq!(k.admits(Some(&h("Bearer s3cre"))), None);
        assert_eq!(k.admits(Some(&h("Bearer s3cretX"))), None);
        assert_eq!(k.admits(Some(&h("Basic s3cret"))), None);
        assert_eq!(k.admits(None), None);
        assert!(k.open("/health") && !k.open("/healthz") && !k.open("/generate"));
        assert_eq!(k.bearer(), h("Bearer s3cret"));
        assert_eq!(ApiKey::new(" \n", &open).unwrap_err(), ApiKeyError::Empty);
        assert_eq!(
            ApiKey::new("a b", &open).unwrap_err(),
            ApiKeyError::NotPrintable
        );
        assert_eq!(
            ApiKey::new("k", &["health".to_string()]).unwrap_err(),
            ApiKeyError::BadPath("health".into())
        );
        assert!(!format!("{k:?}").contains("s3cret"));
    }

    #[test]
    fn a_key_file_names_its_keys_and_their_limits() {
        let open: Vec<String> = Vec::new();
        let one = ApiKey::from_file("  only-key \n", &open).unwrap();
        assert_eq!((one.keys.len(), one.secret()), (1, "only-key"));
        assert_eq!(&*one.keys[0].name, DEFAULT_TENANT);
        let text = "# tenants\nrouter r-key\n\nalice a-key 5  # paid\nbob b-key -10\ncarol c-key\n";
        let k = ApiKey::from_file(text, &open).unwrap();
        assert_eq!(k.keys.len(), 4);
        assert_eq!(k.secret(), "r-key", "the first key is the cluster's");
        let h = |v: &str| HeaderValue::from_str(v).unwrap();
        assert_eq!(k.admits(Some(&h("Bearer b-key"))), Some(2));
        assert_eq!(k.keys[1].max_priority, Some(5));
        assert_eq!(k.keys[2].max_priority, Some(-10));
        assert_eq!(k.keys[3].max_priority, None);
        let err = |t: &str| ApiKey::from_file(t, &open).unwrap_err().to_string();
        assert_eq!(err(""), "the API key is empty");
        assert_eq!(
            err("r k\na b c d"),
            "line 2: expected NAME KEY [MAX_PRIORITY], got 4 words"
        );
        assert_eq!(
            err("r k 3"),
            "line 1: the first key is the cluster's own (the router sends it to its workers): it cannot have a priority limit"
        );
        assert_eq!(
            err("r k\na b high"),
            "line 2: the highest priority must be an integer in -1000..=1000, got \"high\""
        );
        assert_eq!(err("r k\nr j"), "line 2: the key name \"r\" is used twice");
        assert_eq!(err("r k\na k"), "line 2: a's key is also another name's");
        assert_eq!(
            err("r k\na/b j"),
            "line 2: key name \"a/b\": use letters, digits, '-', '_' and '.'"
        );
        assert!(!format!("{k:?}").contains("a-key"));
    }
}
