//! API keys (`--api-key`, `--api-key-file`): with a key set, every route
//! but the open ones (`--open-path`, by default `/health`, `/readiness` and
//! `/metrics`, for probes and scrapers) needs `Authorization: Bearer KEY`;
//! anything else is a 401 with an OpenAI-style JSON error. The router sends
//! the same key to its workers. Keys are compared in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::errors::ApiError;

/// The paths open without a key by default.
pub const DEFAULT_OPEN_PATHS: &[&str] = &["/health", "/readiness", "/metrics"];

/// A key and the paths that need none.
#[derive(Clone)]
pub struct ApiKey {
    key: Arc<str>,
    open_paths: Arc<[String]>,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
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
}

impl ApiKey {
    /// A key (surrounding white space, such as a key file's newline, is
    /// dropped) and the paths open without it.
    pub fn new(key: &str, open_paths: &[String]) -> Result<Self, ApiKeyError> {
        let key = key.trim();
        if key.is_empty() {
            return Err(ApiKeyError::Empty);
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiKeyError::NotPrintable);
        }
        if let Some(p) = open_paths.iter().find(|p| !p.starts_with('/')) {
            return Err(ApiKeyError::BadPath(p.clone()));
        }
        Ok(ApiKey {
            key: key.into(),
            open_paths: open_paths.to_vec().into(),
        })
    }

    /// The key itself (to hand to a worker process through its
    /// environment).
    pub fn secret(&self) -> &str {
        &self.key
    }

    /// The `Authorization` header value that carries this key.
    pub fn bearer(&self) -> HeaderValue {
        // Checked printable ASCII in `new`.
        HeaderValue::from_str(&format!("Bearer {}", self.key))
            .unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    fn open(&self, path: &str) -> bool {
        self.open_paths.iter().any(|p| p == path)
    }

    /// Whether `header` (an `Authorization` value) carries this key.
    pub(crate) fn admits(&self, header: Option<&HeaderValue>) -> bool {
        let Some(given) = header.and_then(|h| h.to_str().ok()).and_then(|h| {
            h.strip_prefix("Bearer ")
                .or_else(|| h.strip_prefix("bearer "))
        }) else {
            return false;
        };
        constant_time_eq(given.trim().as_bytes(), self.key.as_bytes())
    }
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

async fn check(State(key): State<ApiKey>, req: Request, next: Next) -> Response {
    if key.open(req.uri().path()) || key.admits(req.headers().get(AUTHORIZATION)) {
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
        assert!(k.admits(Some(&h("Bearer s3cret"))));
        assert!(!k.admits(Some(&h("Bearer s3cre"))));
        assert!(!k.admits(Some(&h("Bearer s3cretX"))));
        assert!(!k.admits(Some(&h("Basic s3cret"))));
        assert!(!k.admits(None));
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
}
