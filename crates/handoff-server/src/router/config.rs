//! The router's configuration: the prefill and decode workers,
//! the pairing policies and every timer of the router, with its default.

use std::time::Duration;

use crate::router::policy::PolicyKind;

/// SGLang's default bootstrap port of a prefill worker, used when
/// `--prefill URL` names none.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// One prefill worker: its HTTP URL and the port of its KV bootstrap server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillSpec {
    /// `http://host:port` of the worker's HTTP API.
    pub url: String,
    /// The bootstrap port sent to decode workers ([`DEFAULT_BOOTSTRAP_PORT`] when `None`).
    pub bootstrap_port: Option<u16>,
}

/// Everything the router needs; build with [`RouterConfig::new`] and adjust fields.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Prefill workers (at least one).
    pub prefill: Vec<PrefillSpec>,
    /// Decode workers' HTTP URLs (at least one).
    pub decode: Vec<String>,
    /// How a prefill worker is picked.
    pub prefill_policy: PolicyKind,
    /// How a decode worker is picked.
    pub decode_policy: PolicyKind,
    /// Longest a request may take, first byte to last (default 600 s):
    /// before the first relayed byte the client gets 504, after it an SSE
    /// error event.
    pub request_timeout: Duration,
    /// Connect timeout towards a worker (default 5 s).
    pub connect_timeout: Duration,
    /// Period of the background health and load probes (default 5 s).
    /// `Duration::ZERO` disables them: workers then stay in the state that
    /// requests leave them in (for tests of the request path).
    pub health_interval: Duration,
    /// Timeout of one probe (`/health`, `/get_load`; default 2 s).
    pub health_timeout: Duration,
    /// Consecutive failed probes that make a healthy worker unhealthy
    /// (default 2). A worker never seen healthy is unhealthy after its first
    /// failed probe; one good probe makes any worker healthy again; a request
    /// that cannot reach a worker marks it unhealthy at once.
    pub unhealthy_after: u32,
    /// Retries of a request that failed before any byte reached the client
    /// (connection errors, 502, 503 only; default 2).
    pub max_retries: u32,
    /// Most times one stream is continued on another decode worker after
    /// its decode died or stalled mid-stream (0: never; the client then gets
    /// an error event). Each continuation prefills the prompt and the output
    /// so far on the new decode worker and streams on from there.
    pub migration_limit: u32,
    /// Per-request PD decision: a prompt of fewer uncached tokens than this
    /// (counted exactly for token-id prompts, estimated at 4 characters a
    /// token for text; less the share of its prompt blocks the router sent
    /// the decode worker before, which its prefix cache likely holds) is
    /// prefilled on its decode worker, with no prefill worker and no
    /// transfer (0: every prompt goes through a prefill worker).
    pub local_prefill_below: usize,
    /// Per-request PD decision: a prompt whose prefill worker is predicted
    /// to hold it queued longer than this (prompt tokens queued there ÷ the
    /// learned prefill rate, [`super::admission`]) is prefilled on its
    /// decode worker instead (`None`: never for this reason).
    pub local_prefill_wait: Option<Duration>,
    /// The TTFT SLO of a request that names none (`slo_ttft_ms`, the
    /// `x-slo-ttft-ms` header): one predicted to miss it gets a 429 at once.
    pub default_slo_ttft: Option<Duration>,
    /// Connection hygiene on the router's own port.
    pub http: crate::http::listen::HttpLimits,
    /// Origins whose web pages may call the router (CORS); none by default.
    pub allow_origins: Vec<crate::http::cors::Origin>,
    /// A stream whose decode brings no byte for this long ends as
    /// `stalled`: before its first byte with a 504, after it with an SSE
    /// error event; both workers' requests are cancelled (default 120 s;
    /// `None`: only the request timeout bounds it).
    pub stall_timeout: Option<Duration>,
    /// The API key clients must send (and the router sends its workers);
    /// `None`: no key.
    pub api_key: Option<crate::http::auth::ApiKey>,
    /// The transfer secret the decode workers share: the router signs each
    /// request's bootstrap fields with it, so a decode worker dials the
    /// prefill it names (`None`: unsigned; decode workers then need
    /// `--prefill-allow`).
    pub transfer_secret: Option<crate::worker::trust::TransferSecret>,
    /// How long a request waits for a worker of a role that has none
    /// dispatchable (all down, restarting, or not registered yet) before a
    /// 503 with `Retry-After` (default 0: at once).
    pub queue_timeout: Duration,
    /// Where workers register (etcd): the router adds and removes them
    /// live, beside any given on its command line.
    pub discovery: Option<crate::discovery::EtcdEndpoint>,
    /// Whoever runs the workers and restarts them one at a time on
    /// `POST /admin/restart` (`handoff serve`); `None`: the route answers
    /// 404.
    pub restart: Option<crate::router::admin::RestartHook>,
}

impl RouterConfig {
    /// A configuration with these workers and every default.
    pub fn new(prefill: Vec<PrefillSpec>, decode: Vec<String>) -> Self {
        RouterConfig {
            prefill,
            decode,
            prefill_policy: PolicyKind::RoundRobin,
            decode_policy: PolicyKind::RoundRobin,
            request_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(5),
            health_interval: Duration::from_secs(5),
            health_timeout: Duration::from_secs(2),
            unhealthy_after: 2,
            max_retries: 2,
            migration_limit: 2,
            local_prefill_below: DEFAULT_LOCAL_PREFILL_BELOW,
            local_prefill_wait: None,
            default_slo_ttft: None,
            http: crate::http::listen::HttpLimits::default(),
            allow_origins: Vec::new(),
            stall_timeout: Some(crate::http::app::DEFAULT_STALL_TIMEOUT),
            api_key: None,
            transfer_secret: None,
            queue_timeout: Duration::ZERO,
            discovery: None,
            restart: None,
        }
    }

    /// Check the worker lists and URLs.
    pub fn validate(&self) -> Result<(), RouterConfigError> {
        // With discovery, workers may all come from etcd.
        if self.prefill.is_empty() && self.discovery.is_none() {
            return Err(RouterConfigError::NoPrefill);
        }
        if self.decode.is_empty() && self.discovery.is_none() {
            return Err(RouterConfigError::NoDecode);
        }
        for p in &self.prefill {
            worker_host(&p.url)?;
        }
        for d in &self.decode {
            worker_host(d)?;
        }
        Ok(())
    }
}

/// Prompts shorter than this many tokens are prefilled on their decode
/// worker by default: none. On this 2-core machine a threshold of 64
/// took the short class's TTFT p99 of a mixed load from 0.75× to 0.09×
/// colocated's, but its prefills on the decode worker raised that class's
/// ITL p99 from 1.0× to 1.5–1.9× colocated's (BENCHMARKS.md, "Per-request
/// PD decision").
pub const DEFAULT_LOCAL_PREFILL_BELOW: usize = 0;

/// A configuration the router cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouterConfigError {
    /// No prefill worker was given.
    #[error(
        "at least one prefill worker is required (--prefill URL [BOOTSTRAP_PORT], or --discovery)"
    )]
    NoPrefill,
    /// No decode worker was given.
    #[error("at least one decode worker is required (--decode URL, or --discovery)")]
    NoDecode,
    /// A worker URL is not an absolute `http://` URL with a host.
    #[error("worker URL `{url}` is invalid: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// The host of an `http://` worker URL (the `bootstrap_host` sent for a
/// prefill worker). The router talks plain HTTP to workers (no TLS client is
/// built in), so `https://` is refused here rather than at the first request.
pub fn worker_host(url: &str) -> Result<String, RouterConfigError> {
    let bad = |reason: &str| RouterConfigError::BadUrl {
        url: url.to_string(),
        reason: reason.to_string(),
    };
    if url.starts_with("https://") {
        return Err(bad(
            "https:// is not supported: the router talks plain HTTP to its workers",
        ));
    }
    if !url.starts_with("http://") {
        return Err(bad(
            "it has no http:// scheme (write e.g. http://127.0.0.1:30001)",
        ));
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    match parsed.host_str() {
        Some(h) if !h.is_empty() => Ok(h.trim_start_matches('[').trim_end_matches(']').to_string()),
        _ => Err(bad("it has no host")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_need_a_scheme_and_host() {
        assert_eq!(worker_host("http://10.0.0.2:30001").unwrap(), "10.0.0.2");
        assert_eq!(worker_host("http://[::1]:30001/").unwrap(), "::1");
        let e = worker_host("localhost:30001").unwrap_err();
        assert!(e.to_string().contains("`localhost:30001`"), "{e}");
        assert!(e.to_string().contains("no http://"), "{e}");
        assert!(worker_host("http://").is_err());
        let e = worker_host("https://a:1").unwrap_err();
        assert!(e.to_string().contains("https:// is not supported"), "{e}");
    }

    #[test]
    fn empty_lists_are_refused() {
        let c = RouterConfig::new(vec![], vec!["http://a".into()]);
        assert_eq!(c.validate(), Err(RouterConfigError::NoPrefill));
        let c = RouterConfig::new(
            vec![PrefillSpec {
                url: "http://a".into(),
                bootstrap_port: None,
            }],
            vec![],
        );
        assert_eq!(c.validate(), Err(RouterConfigError::NoDecode));
    }
}
