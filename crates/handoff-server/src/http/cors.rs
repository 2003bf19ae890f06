//! Cross-origin access (CORS), off unless asked for.
//!
//! By default no response carries `Access-Control-Allow-Origin`, so a web
//! page on another origin cannot read an answer, and (with POST bodies
//! required to be `application/json`, [`crate::http::extract`]) cannot send a
//! request without a preflight this server does not grant. `--allow-origin`
//! names the origins whose pages may call the API.

use axum::http::{header, HeaderValue, Method};
use axum::Router;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// Why an `--allow-origin` value is not an origin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not an origin: {reason} (write e.g. https://chat.example.com or http://localhost:3000)")]
pub struct BadOrigin {
    /// The value given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// One allowed origin: `http(s)://host[:port]` exactly as a browser sends
/// it in `Origin` (no path, no trailing slash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin(HeaderValue);

impl std::str::FromStr for Origin {
    type Err = BadOrigin;

    fn from_str(s: &str) -> Result<Self, BadOrigin> {
        let bad = |reason| BadOrigin {
            value: s.to_string(),
            reason,
        };
        let rest = s
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("https://"))
            .ok_or_else(|| bad("it does not start with http:// or https://"))?;
        if rest.is_empty() {
            return Err(bad("it has no host"));
        }
        if rest.contains(['/', '?', '#', '@', '*']) || rest.chars().any(char::is_whitespace) {
            return Err(bad(
                "an origin is a scheme, a host and a port only (no path, slash, query or wildcard)",
            ));
        }
        HeaderValue::from_str(s)
            .map(Origin)
            .map_err(|_| bad("it holds characters a header cannot carry"))
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.to_str().unwrap_or_default())
    }
}

/// `app` answering CORS preflights and reads from `origins` only; `app`
/// unchanged when `origins` is empty (no cross-origin access at all).
pub fn allow_origins(app: Router, origins: &[Origin]) -> Router {
    if origins.is_empty() {
        return app;
    }
    let list: Vec<HeaderValue> = origins.iter().map(|o| o.0.clone()).collect();
    app.layer(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(list))
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_scheme_host_and_port_only() {
        for ok in [
            "http://localhost:3000",
            "https://chat.example.com",
            "http://[::1]:8080",
        ] {
            let o: Origin = ok.parse().unwrap();
            assert_eq!(o.to_string(), ok);
        }
        for (bad, why) in [
            ("chat.example.com", "does not start with"),
            ("https://", "no host"),
            ("https://a.example/", "no path"),
            ("*", "does not start with"),
            ("http://*.example.com", "wildcard"),
            ("http://a b", "no path"),
        ] {
            let e = bad.parse::<Origin>().unwrap_err();
            assert!(e.to_string().contains(why), "{bad}: {e}");
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
    }
}
