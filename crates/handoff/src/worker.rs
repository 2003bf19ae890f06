//! `handoff prefill` and `handoff decode` (also `handoff serve
//! --disaggregation-mode prefill|decode`): one side of a PD pair, serving
//! the worker HTTP API. Requests carry SGLang's bootstrap fields, set by a
//! PD router (`handoff router`, or SGLang's).

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use handoff_engine::pd::{DecodeEngine, PdConfig, PrefillEngine, TransportChoice, TransportKind};
use handoff_engine::Engine;
use handoff_server::Backend;

use crate::engine_args::{EngineArgs, HttpArgs};

/// SGLang's default bootstrap port.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Transfer flags of a PD worker.
#[derive(Debug, Clone, Args)]
pub struct PdArgs {
    /// Prefill: port of the KV transfer endpoint that decode workers connect
    /// to (give it to the router: `--prefill URL PORT`); 8998 (SGLang's) if
    /// not given, 0 picks a free port. Under the disaggregated `handoff
    /// serve`, the port its prefill worker listens on (a free loopback port
    /// if not given).
    #[arg(long, value_name = "PORT")]
    pub disaggregation_bootstrap_port: Option<u16>,
    /// KV transport: auto (shm for a prefill on a loopback address, tcp
    /// otherwise), shm, tcp or nixl (decode READs over NIXL/UCX; a build
    /// with `--features nixl` and NIXL's libraries on LD_LIBRARY_PATH,
    /// checked at start). Decode picks; a prefill given nixl makes its NIXL
    /// agent at start, any prefill serves what decode asks for.
    #[arg(long, alias = "transfer", default_value = "auto")]
    pub disaggregation_transfer_backend: TransportChoice,
    /// A file holding a shared secret; prefill and decode then authenticate
    /// each other at the transfer handshake (the secret never crosses the
    /// wire). Both sides must use the same file content. Also read from
    /// $HANDOFF_TRANSFER_SECRET. A prefill whose transfer endpoint binds an
    /// address other hosts can reach refuses to start without one;
    /// `handoff serve` makes a fresh one for its own pair at every start.
    #[arg(long, value_name = "PATH")]
    pub transfer_secret_file: Option<PathBuf>,
    /// Decode: a prefill transfer endpoint (HOST:PORT, as requests name
    /// it) this worker dials without a router's signature; repeat for
    /// several. For routers that cannot sign (SGLang's). Every other
    /// endpoint a request names needs `bootstrap_sig` from a router holding
    /// the same transfer secret, else the request gets a 403.
    #[arg(long = "prefill-allow", value_name = "HOST:PORT")]
    pub prefill_allow: Vec<handoff_server::worker::trust::AllowedPrefill>,
    /// Decode: TCP streams per data link to each prefill (tcp transport
    /// only). Concurrent requests' KV is spread over the streams; one
    /// request's KV travels on one stream. Pays with as many I/O threads
    /// on both sides and cores to run them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub transfer_tcp_streams: u8,
    /// Do not offer delta transfer in the transfer handshake: a decode that
    /// holds a cached prefix of a prompt then still receives the whole
    /// prompt's KV (for peers or tests that need the full transfer; off on
    /// either side turns it off for the pair).
    #[arg(long)]
    pub disable_delta_transfer: bool,
    /// Decode: what a request whose KV transfer fails (the prefill died,
    /// timed out or cannot be reached) gets: `recompute` prefills its prompt
    /// on this decode worker and carries on, so the client sees no error;
    /// `fail` ends it with the transfer's typed error. A request's
    /// `on_transfer_failure` field overrides it.
    #[arg(long, default_value = "recompute", value_name = "recompute|fail")]
    pub on_transfer_failure: handoff_engine::pd::OnTransferFailure,
    /// Threads of the worker's KV transfer runtime.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub transfer_io_threads: u16,
    /// Register this worker in etcd (`etcd://HOST:PORT[/PREFIX]`, prefix
    /// `/handoff` by default) under a lease kept alive while it runs and
    /// revoked when it shuts down, so routers started with the same
    /// `--discovery` find it: its role, URL, transfer port, model and KV
    /// layout.
    #[arg(long, value_name = "etcd://HOST:PORT[/PREFIX]")]
    pub discovery: Option<handoff_server::discovery::EtcdEndpoint>,
    /// Seconds the discovery lease lives without a renewal (renewed every
    /// third of it): how long a worker that died stays listed.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=300), requires = "discovery")]
    pub discovery_ttl_secs: u64,
    /// The host routers reach this worker at, registered in discovery
    /// [default: --host; required when --host is 0.0.0.0 or ::].
    #[arg(long, value_name = "HOST", requires = "discovery")]
    pub advertise_host: Option<String>,
    /// Exit when standard input closes (set by `handoff serve` for its
    /// worker processes, so they never outlive it).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
}

/// Flags of `handoff prefill` / `handoff decode`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub pd: PdArgs,
}

/// Which engine a worker process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Colocated: prefill and decode in one engine (SGLang's `null`).
    Null,
    /// The prefill side of PD serving.
    Prefill,
    /// The decode side of PD serving.
    Decode,
}

/// The environment variable that may hold the transfer secret (how
/// `handoff serve` hands its per-run secret to its workers).
pub const TRANSFER_SECRET_ENV: &str = "HANDOFF_TRANSFER_SECRET";

/// The transfer secret: the file's content, else `$HANDOFF_TRANSFER_SECRET`,
/// else none.
pub fn transfer_secret(file: Option<&std::path::Path>) -> anyhow::Result<Option<Vec<u8>>> {
    if let Some(path) = file {
        let secret = std::fs::read(path)
            .with_context(|| format!("reading --transfer-secret-file {}", path.display()))?;
        if secret.is_empty() {
            bail!("--transfer-secret-file {} is empty", path.display());
        }
        return Ok(Some(secret));
    }
    match std::env::var_os(TRANSFER_SECRET_ENV) {
        Some(s) if s.is_empty() => bail!("${TRANSFER_SECRET_ENV} is set but empty"),
        Some(s) => Ok(Some(s.into_encoded_bytes())),
        None => Ok(None),
    }
}

/// Refuse a prefill transfer endpoint that other hosts can reach without a
/// secret: anyone who reaches it could pose as a decode worker.
fn check_transfer_exposure(pd: &PdConfig) -> anyhow::Result<()> {
    if pd.secret.is_none() && !pd.listen.ip().is_loopback() {
        bail!(
            "the transfer endpoint would listen on {}, which other hosts can reach, without a secret: \
             give prefill and decode the same --transfer-secret-file (or ${TRANSFER_SECRET_ENV}), \
             or bind a loopback --host",
            pd.listen
        );
    }
    Ok(())
}

impl PdArgs {
    fn config(&self, host: &str, secret: Option<Vec<u8>>) -> anyhow::Result<PdConfig> {
        let mut pd = PdConfig::new(handoff_engine::pd::TransportKind::Tcp);
        pd.transport_choice = self.disaggregation_transfer_backend;
        if let TransportChoice::Fixed(kind) = pd.transport_choice {
            // A worker that cannot move KV the way it was told refuses to
            // start, naming what is missing (for NIXL: the feature, the
            // library path searched, UCX_TLS).
            handoff_transfer::check_transport(kind)
                .with_context(|| format!("--transfer {}", kind.name()))?;
        }
        pd.tcp_streams = self.transfer_tcp_streams;
        pd.io_threads = usize::from(self.transfer_io_threads);
        pd.delta_transfer = !self.disable_delta_transfer;
        pd.on_transfer_failure = self.on_transfer_failure;
        let ip: std::net::IpAddr = match host {
            "localhost" => [127, 0, 0, 1].into(),
            h => h.parse().with_context(|| {
                format!("--host {h} is not an IP address (the transfer endpoint binds it)")
            })?,
        };
        pd.listen = SocketAddr::new(
            ip,
            self.disaggregation_bootstrap_port
                .unwrap_or(DEFAULT_BOOTSTRAP_PORT),
        );
        pd.secret = secret;
        Ok(pd)
    }
}

/// Start the engine for `mode` (loads the model); a PD engine
/// authenticates its transfer handshakes with `secret`.
pub fn start_backend(
    mode: Mode,
    args: &WorkerArgs,
    secret: Option<Vec<u8>>,
) -> anyhow::Result<Backend> {
    let config = args.engine.config()?;
    let model = config.model_path.display().to_string();
    tracing::info!(model = %model, mode = ?mode, threads = config.threads, page_size = config.page_size, "loading model");
    let backend = match mode {
        Mode::Null => Backend::from(
            Engine::start(config).with_context(|| format!("starting the engine on {model}"))?,
        ),
        Mode::Prefill => {
            // A prefill serves whatever transport each decode asks for; of
            // the choices only nixl means something to it (its agent is
            // made, or refused, at start).
            if let TransportChoice::Fixed(k @ (TransportKind::Shm | TransportKind::Tcp)) =
                args.pd.disaggregation_transfer_backend
            {
                bail!(
                    "--transfer {} on a prefill worker: a prefill serves the transport each decode asks for; it takes only --transfer nixl (to make its NIXL agent at start)",
                    k.name()
                );
            }
            let pd = args.pd.config(&args.http.host, secret)?;
            check_transfer_exposure(&pd)?;
            let listen = pd.listen;
            let p = PrefillEngine::start(config, pd).with_context(|| {
                format!("starting the prefill engine on {model} (transfer endpoint {listen})")
            })?;
            tracing::info!(bootstrap = %p.bootstrap_addr(), "prefill transfer endpoint listening");
            Backend::from(p)
        }
        Mode::Decode => {
            let pd = args.pd.config(&args.http.host, secret)?;
            Backend::from(
                DecodeEngine::start(config, pd)
                    .with_context(|| format!("starting the decode engine on {model}"))?,
            )
        }
    };
    let info = backend.model();
    tracing::info!(
        served_model_name = %info.served_name,
        context_length = info.context_length,
        kv_pages = backend.load().pages_total,
        mode = backend.mode(),
        "engine ready"
    );
    Ok(backend)
}

/// Run a worker of `mode` until SIGTERM / ctrl-c (or, with
/// `--exit-with-parent`, until standard input closes).
pub fn run(mode: Mode, args: WorkerArgs) -> anyhow::Result<()> {
    let api_key = args.http.limits.api_key()?;
    // A decode worker dials what a router holding the transfer secret
    // signed, and the endpoints --prefill-allow names.
    let secret = transfer_secret(args.pd.transfer_secret_file.as_deref())?;
    let trust = handoff_server::worker::trust::BootstrapTrust::new(
        secret.clone(),
        args.pd.prefill_allow.clone(),
    );
    let record_secret = secret.clone();
    let warn_untrusting =
        mode == Mode::Decode && args.pd.prefill_allow.is_empty() && secret.is_none();
    // Checks the model first: a model handoff cannot serve is refused
    // before anything else is said.
    let backend = start_backend(mode, &args, secret)?;
    if warn_untrusting {
        tracing::warn!(
            "decode worker without a transfer secret or --prefill-allow: it refuses every request (403); give it and the router the same --transfer-secret-file, or name prefills with --prefill-allow"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let exit_with_parent = args.pd.exit_with_parent;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.http.host.as_str(), args.http.port))
            .await
            .with_context(|| format!("binding {}:{}", args.http.host, args.http.port))?;
        let addr = listener.local_addr()?;
        tracing::info!("listening on http://{addr}");
        // Discovery: registered before serving; on shutdown the lease is
        // revoked first (routers stop sending at once), then in-flight
        // requests drain.
        let (deregister, deregistered) = tokio::sync::oneshot::channel::<()>();
        let registration = match &args.pd.discovery {
            Some(ep) => {
                let url = advertised_url(&args, addr)?;
                let mut record = backend
                    .discovery_record(&url)
                    .context("only prefill and decode workers register in discovery")?;
                match &record_secret {
                    Some(s) => record.sign(s),
                    None => tracing::warn!(
                        "registering an unsigned discovery record (no transfer secret): a router with a secret refuses it, and one without cannot tell it from an impostor's"
                    ),
                }
                let ttl = std::time::Duration::from_secs(args.pd.discovery_ttl_secs);
                let r = handoff_server::discovery::Registrar::new(ep, &record, ttl)
                    .context("discovery")?;
                let lease = r
                    .start()
                    .await
                    .with_context(|| format!("registering in discovery at {}", ep.base))?;
                tracing::info!(key = r.key(), %url, "registered in discovery");
                Some(tokio::spawn(r.run(lease, async move {
                    let _ = deregistered.await;
                })))
            }
            None => None,
        };
        // Stopping: leave discovery, refuse new work (503 draining) while
        // routers catch up, then stop accepting and let in-flight requests
        // finish (handoff_server::http::drain).
        let gate = handoff_server::http::drain::DrainGate::new();
        let closing = gate.clone();
        let stop = async move {
            if exit_with_parent {
                tokio::select! {
                    _ = crate::signal::shutdown_signal() => {}
                    _ = stdin_closed() => tracing::info!("parent went away: draining"),
                }
            } else {
                crate::signal::shutdown_signal().await
            }
            if let Some(task) = registration {
                let _ = deregister.send(());
                let _ = tokio::time::timeout(std::time::Duration::from_secs(3), task).await;
            }
            closing.close();
            tokio::time::sleep(handoff_server::http::drain::DRAIN_LINGER).await;
        };
        let app = handoff_server::app_with_state(
            handoff_server::AppState::new(backend)
                .with_stall_timeout(args.http.limits.stall_timeout())
                .with_bootstrap_trust(trust),
        );
        let app = handoff_server::http::auth::require_api_key(gate.guard(app), api_key);
        handoff_server::serve(
            listener,
            handoff_server::http::cors::allow_origins(app, &args.http.limits.allow_origin),
            args.http.limits.limits(),
            stop,
        )
        .await
        .context("serving HTTP")?;
        tracing::info!("shut down");
        Ok::<_, anyhow::Error>(())
    })
}

/// The URL routers reach this worker at: `--advertise-host`, else
/// `--host`, with the port it listens on.
fn advertised_url(args: &WorkerArgs, addr: SocketAddr) -> anyhow::Result<String> {
    let host = match &args.pd.advertise_host {
        Some(h) => h.clone(),
        None if addr.ip().is_unspecified() => bail!(
            "--host {} is every address: give --advertise-host, the address routers reach this worker at",
            args.http.host
        ),
        None => args.http.host.clone(),
    };
    Ok(if host.contains(':') && !host.starts_with('[') {
        format!("http://[{host}]:{}", addr.port())
    } else {
        format!("http://{host}:{}", addr.port())
    })
}

/// Resolves when standard input reaches end of file.
async fn stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
    })
    .await;
}
