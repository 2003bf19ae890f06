//! The worker processes of `handoff serve` (issue 15 items 2 and 4): each a
//! supervised child on loopback, started again on its ports when it dies,
//! and replaced one at a time by a rolling restart (SIGHUP or
//! `POST /admin/restart`).
//!
//! A rolling restart replaces each worker *before* stopping it: the new
//! process starts on fresh ports, and once it answers `/health` the router
//! sends to it; then the router stops sending to the old one, which drains
//! (its standard input closes: it refuses new work with 503 `draining`,
//! finishes what it has, exits). So a role never has fewer workers than it
//! had, and no request is dropped, even with one replica of each role.

use std::io::{BufRead, BufReader};
use std::net::TcpListener as StdListener;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use handoff_proto::Role;
use handoff_server::http::auth::ApiKey;
use handoff_server::router::admin::RestartRequests;
use handoff_server::router::RouterControl;

use crate::engine_args::EngineArgs;

/// How long a worker may take to load the model.
const WORKER_START_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a worker may take to stop when `handoff serve` stops.
const WORKER_STOP_GRACE: Duration = Duration::from_secs(10);

/// Most restarts of one worker within [`RESTART_WINDOW`]; beyond that
/// `handoff serve` gives up and exits with an error.
const MAX_RESTARTS: usize = 5;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// A worker process; stopped (gracefully, then by force) when dropped.
pub(crate) struct Worker {
    role: Role,
    child: Child,
    stdin: Option<ChildStdin>,
    pub(crate) url: String,
}

/// How to start one worker (again).
#[derive(Clone)]
pub(crate) struct Spec {
    pub(crate) role: Role,
    pub(crate) model: PathBuf,
    pub(crate) engine: EngineArgs,
    /// Its HTTP port on loopback.
    pub(crate) port: u16,
    /// A prefill worker's bootstrap (transfer) port.
    pub(crate) bootstrap_port: Option<u16>,
    pub(crate) extra: Vec<String>,
    pub(crate) nice: u8,
    /// The API key the worker requires (given through its environment, not
    /// its command line).
    pub(crate) api_key: Option<String>,
    /// The transfer secret of this run, if serve made one (environment too).
    pub(crate) transfer_secret: Option<String>,
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
        tracing::warn!(
            role = self.role.name(),
            "worker did not stop in time: killing it"
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Worker {
    /// Its process id.
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Close its standard input (it drains: refuses new work, finishes what
    /// it has, exits) and wait up to `grace` for it to exit, then kill it.
    async fn stop(mut self, grace: Duration) {
        drop(self.stdin.take());
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::warn!(
            role = self.role.name(),
            pid = self.pid(),
            "worker did not drain within {} s: killing it",
            grace.as_secs()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port (bound and released: the worker binds it next).
pub(crate) fn free_port() -> anyhow::Result<u16> {
    let l = StdListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Start the worker process `spec` describes.
pub(crate) fn spawn_worker(spec: &Spec) -> anyhow::Result<Worker> {
    let role = spec.role.name();
    let exe = std::env::current_exe().context("locating the handoff binary")?;
    // `nice` execs the worker: the pid stays the worker's.
    let mut cmd = if spec.nice > 0 {
        let mut c = Command::new("nice");
        c.args(["-n", &spec.nice.to_string()]).arg(exe);
        c
    } else {
        Command::new(exe)
    };
    cmd.env_remove("HANDOFF_API_KEY");
    if let Some(k) = &spec.api_key {
        cmd.env("HANDOFF_API_KEY", k);
    }
    cmd.env_remove(crate::worker::TRANSFER_SECRET_ENV);
    if let Some(s) = &spec.transfer_secret {
        cmd.env(crate::worker::TRANSFER_SECRET_ENV, s);
    }
    cmd.arg(role);
    if let Some(port) = spec.bootstrap_port {
        cmd.args(["--disaggregation-bootstrap-port", &port.to_string()]);
    }
    let mut child = cmd
        .args(spec.engine.to_args(&spec.model))
        .args(["--host", "127.0.0.1", "--port", &spec.port.to_string()])
        .args(&spec.extra)
        .arg("--exit-with-parent")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the {role} worker"))?;
    tracing::info!(
        role,
        pid = child.id(),
        port = spec.port,
        "worker process started"
    );
    // Its log, prefixed with its role, on our standard error.
    let stderr = child.stderr.take().context("worker stderr")?;
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[{role}] {line}");
        }
    });
    Ok(Worker {
        role: spec.role,
        stdin: child.stdin.take(),
        child,
        url: format!("http://127.0.0.1:{}", spec.port),
    })
}

/// Wait until `w` answers `/health`, or fail if it exits first.
pub(crate) async fn wait_healthy(w: &mut Worker, key: Option<&ApiKey>) -> anyhow::Result<()> {
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
                w.role.name()
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
                w.role.name(),
                WORKER_START_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every worker of `handoff serve`, with how to start each again.
pub(crate) struct Fleet {
    slots: Vec<(Spec, Worker)>,
    restarts: Vec<Vec<Instant>>,
    key: Option<ApiKey>,
    /// How long a replaced worker may take to drain.
    drain_grace: Duration,
}

impl Fleet {
    /// Start every worker of `specs` (not waiting for them).
    pub(crate) fn start(
        specs: Vec<Spec>,
        key: Option<ApiKey>,
        drain_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let mut slots = Vec::with_capacity(specs.len());
        for spec in specs {
            let w = spawn_worker(&spec)?;
            slots.push((spec, w));
        }
        Ok(Fleet {
            restarts: vec![Vec::new(); slots.len()],
            slots,
            key,
            drain_grace: drain_timeout
                + handoff_server::http::drain::DRAIN_LINGER
                + Duration::from_secs(5),
        })
    }

    /// Wait until every worker answers `/health`.
    pub(crate) async fn wait_all_healthy(&mut self) -> anyhow::Result<()> {
        for (_, w) in &mut self.slots {
            wait_healthy(w, self.key.as_ref()).await?;
        }
        Ok(())
    }

    /// The workers of `role`: their URLs and bootstrap ports.
    pub(crate) fn of(&self, role: Role) -> Vec<(String, Option<u16>)> {
        self.slots
            .iter()
            .filter(|(s, _)| s.role == role)
            .map(|(s, w)| (w.url.clone(), s.bootstrap_port))
            .collect()
    }

    /// Start the workers that exited again, on their ports; fails once one
    /// keeps dying.
    fn check(&mut self) -> anyhow::Result<()> {
        for (i, (spec, w)) in self.slots.iter_mut().enumerate() {
            let status = match w.child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(e) => bail!("watching the {} worker: {e}", spec.role.name()),
            };
            let now = Instant::now();
            self.restarts[i].retain(|t| now.duration_since(*t) < RESTART_WINDOW);
            if self.restarts[i].len() >= MAX_RESTARTS {
                bail!(
                    "the {} worker exited ({status}) {} times within {} s: giving up",
                    spec.role.name(),
                    MAX_RESTARTS + 1,
                    RESTART_WINDOW.as_secs()
                );
            }
            self.restarts[i].push(now);
            tracing::error!(role = spec.role.name(), %status, "worker exited: starting it again");
            *w = spawn_worker(spec)
                .with_context(|| format!("restarting the {} worker", spec.role.name()))?;
        }
        Ok(())
    }

    /// Replace worker `i`: a new process on fresh ports joins the router,
    /// then the old one leaves it and drains.
    async fn replace(&mut self, i: usize, router: &RouterControl) -> anyhow::Result<()> {
        let mut spec = self.slots[i].0.clone();
        spec.port = free_port()?;
        if spec.bootstrap_port.is_some() {
            spec.bootstrap_port = Some(free_port()?);
        }
        let role = spec.role;
        let mut fresh = spawn_worker(&spec)?;
        // A new worker that never becomes healthy is stopped; the old one
        // keeps serving.
        wait_healthy(&mut fresh, self.key.as_ref())
            .await
            .with_context(|| format!("the new {} worker", role.name()))?;
        router
            .add_worker(&fresh.url, role, spec.bootstrap_port.unwrap_or(0))
            .context("adding the new worker to the router")?;
        let (_, old) = std::mem::replace(&mut self.slots[i], (spec, fresh));
        self.restarts[i].clear();
        router.remove_worker(&old.url, role);
        tracing::info!(
            role = role.name(),
            old = %old.url,
            new = %self.slots[i].1.url,
            "replaced a worker: the old one drains"
        );
        old.stop(self.drain_grace).await;
        Ok(())
    }

    /// Replace every worker, one at a time.
    async fn rolling_restart(
        &mut self,
        router: &RouterControl,
        progress: &RestartRequests,
    ) -> anyhow::Result<()> {
        for i in 0..self.slots.len() {
            self.check()?;
            self.replace(i, router).await?;
            progress.replaced_one();
        }
        Ok(())
    }

    /// Supervise the workers and run the rolling restarts asked for, until
    /// a worker keeps dying (the error).
    pub(crate) async fn run(
        &mut self,
        router: RouterControl,
        mut restarts: RestartRequests,
    ) -> anyhow::Error {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if let Err(e) = self.check() {
                        return e;
                    }
                }
                Some(()) = restarts.next() => {
                    tracing::info!(workers = self.slots.len(), "rolling restart: replacing the workers one at a time");
                    let t0 = Instant::now();
                    let r = self.rolling_restart(&router, &restarts).await;
                    match &r {
                        Ok(()) => tracing::info!(secs = t0.elapsed().as_secs_f64(), "rolling restart done"),
                        Err(e) => tracing::error!("rolling restart stopped: {e:#}"),
                    }
                    restarts.finished(r.map_err(|e| format!("{e:#}")));
                }
            }
        }
    }
}
