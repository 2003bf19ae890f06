//! `handoff router`: the PD router in front of prefill and
//! decode workers, with SGLang's flags (`--prefill URL [BOOTSTRAP_PORT]`,
//! `--decode URL`), stopping gracefully on SIGTERM / ctrl-c.

use std::time::Duration;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::{ArgAction, Args, CommandFactory};
use handoff_server::router::{PolicyKind, PrefillSpec, DEFAULT_BOOTSTRAP_PORT};
use handoff_server::RouterConfig;

/// Flags of `handoff router`.
#[derive(Debug, Args)]
pub struct RouterArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    port: u16,
    /// A prefill worker: its HTTP URL and, optionally, its KV bootstrap port
    /// (default 8998, SGLang's). Repeat for more workers, e.g.
    /// `--prefill http://10.0.0.1:30001 8998 --prefill http://10.0.0.2:30001`.
    #[arg(
        long,
        required_unless_present = "discovery",
        num_args = 1..=2,
        action = ArgAction::Append,
        value_names = ["URL", "BOOTSTRAP_PORT"]
    )]
    prefill: Vec<String>,
    /// A decode worker's HTTP URL. Repeat for more workers.
    #[arg(long, required_unless_present = "discovery", value_name = "URL", action = ArgAction::Append)]
    decode: Vec<String>,
    /// Find workers in etcd (`etcd://HOST:PORT[/PREFIX]`, as the workers'
    /// `--discovery`): they join when they register and leave when their
    /// key goes (shutdown, or a lease that expired). Workers must all serve
    /// the model of the first one accepted; others are refused, with the
    /// reason in the log and in /workers. --prefill and --decode may be
    /// given too.
    #[arg(long, value_name = "etcd://HOST:PORT[/PREFIX]")]
    discovery: Option<handoff_server::discovery::EtcdEndpoint>,
    /// Pairing policy of both roles: round_robin, least_load, power_of_two
    /// or cache_aware [default: cache_aware for a role with more than one
    /// worker, round_robin otherwise].
    #[arg(long)]
    policy: Option<PolicyKind>,
    /// Policy for picking the prefill worker [default: --policy].
    #[arg(long)]
    prefill_policy: Option<PolicyKind>,
    /// Policy for picking the decode worker [default: --policy].
    #[arg(long)]
    decode_policy: Option<PolicyKind>,
    /// Longest a request may take (seconds).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    request_timeout_secs: u64,
    /// Period of the workers' health and load probes (seconds); a worker is
    /// unhealthy after 2 failed probes in a row, healthy again after one good one.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    health_check_interval_secs: u64,
    /// The transfer secret the workers share (also $HANDOFF_TRANSFER_SECRET):
    /// the router signs each request's bootstrap fields with it, so decode
    /// workers dial the prefill it picked. Without it, decode workers need
    /// `--prefill-allow` for every prefill.
    #[arg(long, value_name = "PATH")]
    transfer_secret_file: Option<std::path::PathBuf>,
    /// Seconds a request waits for a worker when a role has none healthy
    /// (restarting, or not registered yet) before a 503 with Retry-After.
    #[arg(long, default_value_t = 0)]
    queue_timeout_secs: u64,
    /// Retries of a request that failed before any byte reached the client
    /// (connection errors, 502, 503), each with a fresh room.
    #[arg(long, default_value_t = 2)]
    max_retries: u32,
    /// Migration, the per-request PD decision and shedding.
    #[command(flatten)]
    adapt: AdaptArgs,
    /// Accepted for SGLang's `sglang_router.launch_router` commands: this
    /// router always pairs a prefill and a decode worker per request.
    #[arg(long)]
    pd_disaggregation: bool,
    /// Connection hygiene of the router's port.
    #[command(flatten)]
    limits: crate::engine_args::HttpLimitArgs,
}

/// How the router adapts to failures and load (`handoff router` and
/// `handoff serve`'s router).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct AdaptArgs {
    /// Most times a stream is continued on another decode worker (or its
    /// restarted one) when its decode dies or stalls mid-stream (0: never;
    /// the client then gets an error event).
    #[arg(long, default_value_t = 2)]
    pub migration_limit: u32,
    /// Per-request PD decision: prompts whose part not yet sent to their
    /// decode worker (so likely not in its prefix cache) is shorter than
    /// this many tokens (exact for token ids, about 4 characters a token
    /// for text) are prefilled on that decode worker, with no transfer (0:
    /// every prompt goes through a prefill worker).
    #[arg(long, default_value_t = handoff_server::router::config::DEFAULT_LOCAL_PREFILL_BELOW)]
    pub local_prefill_below: usize,
    /// Per-request PD decision: a prompt whose prefill worker is predicted
    /// to keep it queued longer than this many ms (prompt tokens queued
    /// there ÷ the measured prefill rate) is prefilled on its decode worker
    /// [default: never for this reason].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub local_prefill_wait_ms: Option<u64>,
    /// TTFT SLO, ms, of a request that names none (`slo_ttft_ms` or the
    /// `x-slo-ttft-ms` header): one predicted to miss its SLO gets a 429
    /// with Retry-After at once [default: none].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub slo_ttft_ms: Option<u64>,
}

impl AdaptArgs {
    /// Set them on `c`.
    pub fn apply(&self, c: &mut RouterConfig) {
        c.migration_limit = self.migration_limit;
        c.local_prefill_below = self.local_prefill_below;
        c.local_prefill_wait = self.local_prefill_wait_ms.map(Duration::from_millis);
        c.default_slo_ttft = self.slo_ttft_ms.map(Duration::from_millis);
    }
}

fn usage_error(kind: ErrorKind, message: String) -> clap::Error {
    let mut cmd = crate::Cli::command();
    cmd.build();
    match cmd.find_subcommand_mut("router") {
        Some(router) => router.error(kind, message),
        None => cmd.error(kind, message),
    }
}

/// The `--prefill` occurrences, each `[URL]` or `[URL, BOOTSTRAP_PORT]`
/// (clap's derive flattens them; the matches keep them apart).
pub fn prefill_groups(args: &RouterArgs, matches: Option<&clap::ArgMatches>) -> Vec<Vec<String>> {
    match matches.and_then(|m| m.get_occurrences::<String>("prefill")) {
        Some(occ) => occ.map(|o| o.cloned().collect()).collect(),
        None => args.prefill.iter().map(|u| vec![u.clone()]).collect(),
    }
}

/// The router's configuration, or a clap-style error naming the bad value.
pub fn config(
    args: &RouterArgs,
    prefill_groups: &[Vec<String>],
) -> Result<RouterConfig, clap::Error> {
    let mut prefill = Vec::with_capacity(prefill_groups.len());
    for occurrence in prefill_groups {
        let (url, port) = match occurrence.as_slice() {
            [url] => (url, None),
            [url, port] => {
                let p = port
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        usage_error(
                            ErrorKind::ValueValidation,
                            format!(
                                "invalid bootstrap port '{port}' for '--prefill {url}': expected an integer from 1 to 65535"
                            ),
                        )
                    })?;
                (url, Some(p))
            }
            _ => {
                return Err(usage_error(
                    ErrorKind::WrongNumberOfValues,
                    "--prefill takes a URL and an optional bootstrap port".to_string(),
                ))
            }
        };
        prefill.push(PrefillSpec {
            url: url.clone(),
            bootstrap_port: port,
        });
    }
    let prefill_workers = prefill.len();
    let mut c = RouterConfig::new(prefill, args.decode.clone());
    let default = |workers: usize| args.policy.unwrap_or(PolicyKind::default_for(workers));
    // With discovery, a role may have several workers.
    let many = if args.discovery.is_some() { 2 } else { 0 };
    c.prefill_policy = args
        .prefill_policy
        .unwrap_or(default(prefill_workers.max(many)));
    c.decode_policy = args
        .decode_policy
        .unwrap_or(default(args.decode.len().max(many)));
    c.discovery = args.discovery.clone();
    c.request_timeout = Duration::from_secs(args.request_timeout_secs);
    c.health_interval = Duration::from_secs(args.health_check_interval_secs);
    c.max_retries = args.max_retries;
    args.adapt.apply(&mut c);
    c.queue_timeout = Duration::from_secs(args.queue_timeout_secs);
    c.http = args.limits.limits();
    c.allow_origins = args.limits.allow_origin.clone();
    c.stall_timeout = args.limits.stall_timeout();
    c.transfer_secret = crate::worker::transfer_secret(args.transfer_secret_file.as_deref())
        .map_err(|e| usage_error(ErrorKind::ValueValidation, format!("{e:#}")))?
        .and_then(handoff_server::worker::trust::TransferSecret::new);
    c.api_key = args
        .limits
        .api_key()
        .map_err(|e| usage_error(ErrorKind::ValueValidation, format!("{e:#}")))?;
    c.validate()
        .map_err(|e| usage_error(ErrorKind::ValueValidation, e.to_string()))?;
    Ok(c)
}

/// Run `handoff router` until SIGTERM / ctrl-c.
/// `matches` are the `router` subcommand's, for the grouping of `--prefill`.
pub fn run(args: RouterArgs, matches: Option<&clap::ArgMatches>) -> anyhow::Result<()> {
    let groups = prefill_groups(&args, matches);
    let config = config(&args, &groups).unwrap_or_else(|e| e.exit());
    for p in &config.prefill {
        tracing::info!(
            url = %p.url,
            bootstrap_port = p.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
            "prefill worker"
        );
    }
    for d in &config.decode {
        tracing::info!(url = %d, "decode worker");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        tracing::info!(
            prefill_policy = %config.prefill_policy,
            decode_policy = %config.decode_policy,
            max_retries = config.max_retries,
            "router configured"
        );
        tracing::info!("router listening on http://{}", listener.local_addr()?);
        handoff_server::run_router(listener, config, crate::signal::shutdown_signal())
            .await
            .context("running the router")?;
        tracing::info!("router shut down");
        Ok::<_, anyhow::Error>(())
    })
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    /// What `handoff router` runs with for `flags`: its listen address and
    /// its configuration.
    fn effective(flags: &[&str]) -> String {
        let line = [
            "handoff",
            "router",
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:1",
        ]
        .into_iter()
        .chain(flags.iter().copied());
        let m = crate::Cli::command().try_get_matches_from(line).unwrap();
        let sub = m.subcommand_matches("router").unwrap();
        let args = RouterArgs::from_arg_matches(sub).unwrap();
        let groups = prefill_groups(&args, Some(sub));
        let c = config(&args, &groups).unwrap();
        format!("{} {} {c:?}", args.host, args.port)
    }

    /// Every flag of `handoff router` changes what the router runs with
    /// (the walk covers every flag clap knows, so a new one fails this test
    /// until it is shown to change something), but `--pd-disaggregation`,
    /// which asks for what this router always does.
    #[test]
    fn every_router_flag_changes_the_router() {
        let dir = std::env::temp_dir().join(format!("handoff-router-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, "s3cret").unwrap();
        let keys = dir.join("keys");
        std::fs::write(&keys, "k1").unwrap();
        let (secret, keys) = (secret.to_str().unwrap(), keys.to_str().unwrap());
        // Flag id → (flags of the baseline, flags that must change it).
        let cases: &[(&str, &[&str], &[&str])] = &[
            ("host", &[], &["--host", "127.0.0.2"]),
            ("port", &[], &["--port", "31234"]),
            ("prefill", &[], &["--prefill", "http://p2:1", "9000"]),
            ("decode", &[], &["--decode", "http://d2:1"]),
            ("discovery", &[], &["--discovery", "etcd://127.0.0.1:2379"]),
            ("policy", &[], &["--policy", "least_load"]),
            ("prefill_policy", &[], &["--prefill-policy", "least_load"]),
            ("decode_policy", &[], &["--decode-policy", "least_load"]),
            (
                "request_timeout_secs",
                &[],
                &["--request-timeout-secs", "7"],
            ),
            (
                "health_check_interval_secs",
                &[],
                &["--health-check-interval-secs", "7"],
            ),
            (
                "transfer_secret_file",
                &[],
                &["--transfer-secret-file", secret],
            ),
            ("queue_timeout_secs", &[], &["--queue-timeout-secs", "7"]),
            ("max_retries", &[], &["--max-retries", "7"]),
            ("migration_limit", &[], &["--migration-limit", "7"]),
            ("local_prefill_below", &[], &["--local-prefill-below", "7"]),
            (
                "local_prefill_wait_ms",
                &[],
                &["--local-prefill-wait-ms", "7"],
            ),
            ("slo_ttft_ms", &[], &["--slo-ttft-ms", "7"]),
            (
                "http_header_timeout_secs",
                &[],
                &["--http-header-timeout-secs", "7"],
            ),
            (
                "http_body_timeout_secs",
                &[],
                &["--http-body-timeout-secs", "7"],
            ),
            (
                "stream_write_timeout_secs",
                &[],
                &["--stream-write-timeout-secs", "7"],
            ),
            ("max_connections", &[], &["--max-connections", "7"]),
            ("drain_timeout_secs", &[], &["--drain-timeout-secs", "7"]),
            (
                "stream_stall_timeout_secs",
                &[],
                &["--stream-stall-timeout-secs", "7"],
            ),
            ("api_key", &[], &["--api-key", "k"]),
            ("api_key_file", &[], &["--api-key-file", keys]),
            ("open_paths", &["--api-key", "k"], &["--open-path", "/x"]),
            (
                "allow_origin",
                &[],
                &["--allow-origin", "https://chat.example.com"],
            ),
        ];
        let same: &[(&str, &str)] = &[(
            "pd_disaggregation",
            "SGLang's launcher flag for the only mode this router has",
        )];
        let cmd = crate::Cli::command();
        let router = cmd.find_subcommand("router").unwrap();
        for arg in router.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" {
                continue;
            }
            assert!(
                cases.iter().any(|(f, _, _)| *f == id) || same.iter().any(|(f, _)| *f == id),
                "`handoff router --{}` is not walked: show that it changes the router",
                arg.get_long().unwrap_or(id)
            );
        }
        for (id, base, flag) in cases {
            let with: Vec<&str> = base.iter().chain(flag.iter()).copied().collect();
            assert_ne!(effective(base), effective(&with), "--{id} changed nothing");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
