//! `handoff serve` in its default, disaggregated form: prefill and decode
//! workers (one each, or `--prefill-replicas` / `--decode-replicas`) as
//! child processes on loopback (KV over shared memory), and handoff's
//! router in this process on the public address. The workers
//! exit with `handoff serve` (their standard input is a pipe from it); a
//! worker that dies (killed, crashed) is started again on the same ports,
//! and the router's health checks take it back once it answers.

use std::io::{BufRead, BufReader};
use std::net::TcpListener as StdListener;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use handoff_server::router::{run_router, PrefillSpec, RouterConfig};

use crate::engine_args::{EngineArgs, HttpArgs};
use crate::worker::PdArgs;

/// How long the workers may take to load the model.
const WORKER_START_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a worker may take to drain after `handoff serve` stops.
const WORKER_STOP_GRACE: Duration = Duration::from_secs(10);

/// Most restarts of one worker within [`RESTART_WINDOW`]; beyond that
/// `handoff serve` gives up and exits with an error.
const MAX_RESTARTS: usize = 5;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// A worker process; stopped (gracefully, then by force) when dropped.
struct Worker {
    role: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    url: String,
}

/// How to start one worker again.
#[derive(Clone)]
struct Spec {
    role: &'static str,
    model: std::path::PathBuf,
    engine: EngineArgs,
    port: u16,
    extra: Vec<String>,
    nice: u8,
    /// The API key the worker requires (given through its environment, not
    /// its command line).
    api_key: Option<String>,
    /// The transfer secret of this run, if serve made one (environment too).
    transfer_secret: Option<String>,
}

/// Restart workers that exit; fails once one keeps dying.
async fn supervise(
    workers: Vec<(Spec, std::sync::Arc<std::sync::Mutex<Worker>>)>,
) -> anyhow::Error {
    let mut restarts: Vec<Vec<Instant>> = vec![Vec::new(); workers.len()];
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        for (i, (spec, w)) in workers.iter().enumerate() {
            let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
            let status = match w.child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(e) => return anyhow::anyhow!("watching the {} worker: {e}", spec.role),
            };
            let now = Instant::now();
            restarts[i].retain(|t| now.duration_since(*t) < RESTART_WINDOW);
            if restarts[i].len() >= MAX_RESTARTS {
                return anyhow::anyhow!(
                    "the {} worker exited ({status}) {} times within {} s: giving up",
                    spec.role,
                    MAX_RESTARTS + 1,
                    RESTART_WINDOW.as_secs()
                );
            }
            restarts[i].push(now);
            tracing::error!(role = spec.role, %status, "worker exited: starting it again");
            match spawn_worker(spec) {
                Ok(fresh) => *w = fresh,
                Err(e) => return e.context(format!("restarting the {} worker", spec.role)),
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // End of its standard input: the worker drains and exits.
        drop(self.stdin.take());
        let deadline = Instant::now() + WORKER_STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(role = self.role, "worker did not stop in time: killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port (bound and released: the worker binds it next).
fn free_port() -> anyhow::Result<u16> {
    let l = StdListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Start the worker process `spec` describes.
fn spawn_worker(spec: &Spec) -> anyhow::Result<Worker> {
    let Spec {
        role,
        model,
        engine,
        port,
        extra,
        nice,
        api_key,
        transfer_secret,
    } = spec;
    let (role, port, nice) = (*role, *port, *nice);
    let exe = std::env::current_exe().context("locating the handoff binary")?;
    // `nice` execs the worker: the pid stays the worker's.
    let mut cmd = if nice > 0 {
        let mut c = Command::new("nice");
        c.args(["-n", &nice.to_string()]).arg(exe);
        c
    } else {
        Command::new(exe)
    };
    cmd.env_remove("HANDOFF_API_KEY");
    if let Some(k) = api_key {
        cmd.env("HANDOFF_API_KEY", k);
    }
    cmd.env_remove(crate::worker::TRANSFER_SECRET_ENV);
    if let Some(s) = transfer_secret {
        cmd.env(crate::worker::TRANSFER_SECRET_ENV, s);
    }
    let mut child = cmd
        .arg(role)
        .args(engine.to_args(model))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(extra)
        .arg("--exit-with-parent")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the {role} worker"))?;
    tracing::info!(role, pid = child.id(), port, "worker process started");
    // Its log, prefixed with its role, on our standard error.
    let stderr = child.stderr.take().context("worker stderr")?;
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[{role}] {line}");
        }
    });
    Ok(Worker {
        role,
        stdin: child.stdin.take(),
        child,
        url: format!("http://127.0.0.1:{port}"),
    })
}

/// Wait until `w` answers `/health`, or fail if it exits first.
async fn wait_healthy(
    w: &mut Worker,
    key: Option<&handoff_server::auth::ApiKey>,
) -> anyhow::Result<()> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(k) = key {
        headers.insert(reqwest::header::AUTHORIZATION, k.bearer());
    }
    let client = reqwest::Client::builder()
        .default_headers(headers)
        .timeout(Duration::from_secs(2))
        .build()?;
    let deadline = Instant::now() + WORKER_START_TIMEOUT;
    loop {
        if let Some(status) = w.child.try_wait()? {
            bail!(
                "the {} worker exited ({status}) before it was healthy: see its log above",
                w.role
            );
        }
        if let Ok(r) = client.get(format!("{}/health", w.url)).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the {} worker was not healthy within {} s",
                w.role,
                WORKER_START_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many workers of each role `handoff serve` runs, and how long a
/// request waits for one of a role that has none healthy.
#[derive(Debug, Clone, Copy)]
pub struct Replicas {
    /// Prefill worker processes.
    pub prefill: usize,
    /// Decode worker processes.
    pub decode: usize,
    /// The router's queue timeout.
    pub queue_timeout: Duration,
}

/// Run router + prefill + decode until SIGTERM / ctrl-c.
/// `prefill_nice`: the prefill worker's scheduling niceness (0 = as this
/// process). On a host where both workers share the cores, a positive value
/// lets decode steps preempt prefill compute, which keeps inter-token
/// latency low while long prompts prefill (BENCHMARKS.md).
pub fn run(
    engine: &EngineArgs,
    http: &HttpArgs,
    pd: &PdArgs,
    prefill_nice: u8,
    replicas: Replicas,
) -> anyhow::Result<()> {
    let api_key = http.limits.api_key()?;
    let api_key_text = api_key.as_ref().map(|k| k.secret().to_string());
    // Fetch the default model once, before the workers start.
    let model = engine.model_path()?;
    // The prefill worker's transfer endpoint: the port asked for, or a free
    // one (the router must know it, so 0 is resolved here too).
    // Further prefill replicas take free ports.
    let bootstrap = match pd.disaggregation_bootstrap_port {
        Some(port) if port != 0 => port,
        _ => free_port()?,
    };
    let mut bootstraps = vec![bootstrap];
    for _ in 1..replicas.prefill {
        bootstraps.push(free_port()?);
    }
    let transfer = pd.disaggregation_transfer_backend.to_string();
    // Transfer flags both workers take.
    let mut common = vec![
        "--transfer-io-threads".to_string(),
        pd.transfer_io_threads.to_string(),
    ];
    common.extend(http.limits.to_args());
    if pd.disable_delta_transfer {
        common.push("--disable-delta-transfer".into());
    }
    // The pair authenticates its transfer handshakes, and the router signs
    // bootstrap fields, with one secret: the file's, else a fresh one of
    // this run, handed to the workers through their environment.
    let (secret, run_secret) = match &pd.transfer_secret_file {
        Some(path) => {
            common.push("--transfer-secret-file".into());
            common.push(path.display().to_string());
            (crate::worker::transfer_secret(Some(path))?, None)
        }
        None => {
            tracing::info!("transfer handshakes authenticated with a fresh secret of this run");
            let s = format!(
                "{:032x}{:032x}",
                rand::random::<u128>(),
                rand::random::<u128>()
            );
            (Some(s.clone().into_bytes()), Some(s))
        }
    };
    let router_secret = secret.and_then(handoff_server::trust::TransferSecret::new);
    let mut prefill_specs = Vec::with_capacity(replicas.prefill);
    for port in &bootstraps {
        prefill_specs.push(Spec {
            role: "prefill",
            model: model.clone(),
            engine: engine.clone(),
            port: free_port()?,
            extra: [
                vec!["--disaggregation-bootstrap-port".into(), port.to_string()],
                common.clone(),
            ]
            .concat(),
            nice: prefill_nice,
            api_key: api_key_text.clone(),
            transfer_secret: run_secret.clone(),
        });
    }
    let mut decode_specs = Vec::with_capacity(replicas.decode);
    for _ in 0..replicas.decode {
        decode_specs.push(Spec {
            role: "decode",
            model: model.clone(),
            engine: engine.clone(),
            port: free_port()?,
            extra: [
                vec![
                    "--transfer".into(),
                    transfer.clone(),
                    "--transfer-tcp-streams".into(),
                    pd.transfer_tcp_streams.to_string(),
                ],
                common.clone(),
            ]
            .concat(),
            nice: 0,
            api_key: api_key_text.clone(),
            transfer_secret: run_secret.clone(),
        });
    }
    let specs: Vec<Spec> = prefill_specs.into_iter().chain(decode_specs).collect();
    let mut started = Vec::with_capacity(specs.len());
    for spec in &specs {
        started.push(spawn_worker(spec)?);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(async {
        for w in &mut started {
            wait_healthy(w, api_key.as_ref()).await?;
        }
        let listener = tokio::net::TcpListener::bind((http.host.as_str(), http.port))
            .await
            .with_context(|| format!("binding {}:{}", http.host, http.port))?;
        let addr = listener.local_addr()?;
        let prefills: Vec<PrefillSpec> = started
            .iter()
            .filter(|w| w.role == "prefill")
            .zip(&bootstraps)
            .map(|(w, port)| PrefillSpec {
                url: w.url.clone(),
                bootstrap_port: Some(*port),
            })
            .collect();
        let decodes: Vec<String> = started
            .iter()
            .filter(|w| w.role == "decode")
            .map(|w| w.url.clone())
            .collect();
        let policy = handoff_server::router::PolicyKind::default_for;
        let mut config = RouterConfig::new(prefills.clone(), decodes.clone());
        config.prefill_policy = policy(prefills.len());
        config.decode_policy = policy(decodes.len());
        config.health_interval = Duration::from_secs(1);
        config.queue_timeout = replicas.queue_timeout;
        config.http = http.limits.limits();
        config.allow_origins = http.limits.allow_origin.clone();
        config.stall_timeout = http.limits.stall_timeout();
        config.api_key = api_key.clone();
        config.transfer_secret = router_secret.clone();
        tracing::info!(
            prefill = ?prefills.iter().map(|p| p.url.as_str()).collect::<Vec<_>>(),
            decode = ?decodes,
            bootstrap,
            bootstraps = ?bootstraps,
            %transfer,
            "disaggregated: router -> prefill + decode"
        );
        tracing::info!("listening on http://{addr}");
        let workers: Vec<std::sync::Arc<std::sync::Mutex<Worker>>> = started
            .drain(..)
            .map(|w| std::sync::Arc::new(std::sync::Mutex::new(w)))
            .collect();
        let supervisor = supervise(specs.iter().cloned().zip(workers.iter().cloned()).collect());
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let stop = async move {
            tokio::select! {
                _ = crate::signal::shutdown_signal() => {}
                _ = stop_rx => {}
            }
        };
        let router = run_router(listener, config, stop);
        tokio::pin!(router);
        let failed = tokio::select! {
            r = &mut router => {
                r.context("serving the router")?;
                None
            }
            e = supervisor => Some(e),
        };
        if let Some(e) = failed {
            let _ = stop_tx.send(());
            let _ = router.await;
            return Err(e);
        }
        tracing::info!("router stopped; stopping the workers");
        Ok::<_, anyhow::Error>(workers)
    })
    .map(drop)?;
    tracing::info!("shut down");
    Ok(())
}
