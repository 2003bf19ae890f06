//! `handoff serve` in its default, disaggregated form: prefill and decode
//! workers (one each, or `--prefill-replicas` / `--decode-replicas`) as
//! child processes on loopback (KV over shared memory), and handoff's
//! router in this process on the public address. The workers
//! exit with `handoff serve` (their standard input is a pipe from it); a
//! worker that dies (killed, crashed) is started again on the same ports,
//! and the router's health checks take it back once it answers. SIGHUP or
//! `POST /admin/restart` replaces them one at a time ([`crate::fleet`]).

use std::time::Duration;

use anyhow::Context;
use handoff_proto::Role;
use handoff_server::router::{PrefillSpec, RouterConfig};

use crate::engine_args::{EngineArgs, HttpArgs};
use crate::fleet::{free_port, Fleet, Spec};
use crate::worker::PdArgs;

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
    /// Migration, the per-request PD decision and shedding.
    pub adapt: crate::router_cmd::AdaptArgs,
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
    // Flags of a lone worker that `handoff serve`'s own pair would not
    // honour (`--discovery`, `--prefill-allow`) were refused before this
    // (`flag_scope::refuse_unread`).
    let api_key = http.limits.api_key()?;
    let api_key_text = api_key.as_ref().map(|k| k.secret().to_string());
    // Fetch the default model once, before the workers start.
    let (model, checked) = engine.model()?;
    // Every worker's KV pool planned here, for all of them together: each
    // is started with that many pages (a worker started alone would size
    // its default pool as if it had the machine to itself).
    let workers = replicas.prefill + replicas.decode;
    let mut planned = engine.clone();
    planned.set_kv_pages(engine.plan_memory(&checked, workers)?);
    let engine = &planned;
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
    let router_secret = secret.and_then(handoff_server::worker::trust::TransferSecret::new);
    let spec = |role: Role, port: u16, bootstrap_port: Option<u16>, extra: Vec<String>| Spec {
        role,
        model: model.clone(),
        engine: engine.clone(),
        port,
        bootstrap_port,
        extra,
        nice: if role == Role::Prefill {
            prefill_nice
        } else {
            0
        },
        api_key: api_key_text.clone(),
        transfer_secret: run_secret.clone(),
    };
    let mut specs = Vec::with_capacity(replicas.prefill + replicas.decode);
    let mut prefill_extra = common.clone();
    if transfer == "nixl" {
        // Its NIXL agent is made (or refused) at start, not on the first
        // link.
        prefill_extra.extend(["--transfer".into(), transfer.clone()]);
    }
    for port in &bootstraps {
        specs.push(spec(
            Role::Prefill,
            free_port()?,
            Some(*port),
            prefill_extra.clone(),
        ));
    }
    let decode_extra = [
        vec![
            "--transfer".into(),
            transfer.clone(),
            "--transfer-tcp-streams".into(),
            pd.transfer_tcp_streams.to_string(),
            "--on-transfer-failure".into(),
            pd.on_transfer_failure.name().into(),
        ],
        common.clone(),
    ]
    .concat();
    for _ in 0..replicas.decode {
        specs.push(spec(Role::Decode, free_port()?, None, decode_extra.clone()));
    }
    let mut fleet = Fleet::start(specs, api_key.clone(), http.limits.limits().drain_timeout)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(async {
        fleet.wait_all_healthy().await?;
        let listener = tokio::net::TcpListener::bind((http.host.as_str(), http.port))
            .await
            .with_context(|| format!("binding {}:{}", http.host, http.port))?;
        let addr = listener.local_addr()?;
        let prefills: Vec<PrefillSpec> = fleet
            .of(Role::Prefill)
            .into_iter()
            .map(|(url, bootstrap_port)| PrefillSpec {
                url,
                bootstrap_port,
            })
            .collect();
        let decodes: Vec<String> = fleet
            .of(Role::Decode)
            .into_iter()
            .map(|(url, _)| url)
            .collect();
        let policy = handoff_server::router::PolicyKind::default_for;
        let mut config = RouterConfig::new(prefills.clone(), decodes.clone());
        config.prefill_policy = policy(prefills.len());
        config.decode_policy = policy(decodes.len());
        config.health_interval = Duration::from_secs(1);
        config.queue_timeout = replicas.queue_timeout;
        replicas.adapt.apply(&mut config);
        config.http = http.limits.limits();
        config.allow_origins = http.limits.allow_origin.clone();
        config.stall_timeout = http.limits.stall_timeout();
        config.api_key = api_key.clone();
        config.transfer_secret = router_secret.clone();
        let (hook, restarts) = handoff_server::router::admin::restart_hook();
        config.restart = Some(hook.clone());
        tracing::info!(
            prefill = ?prefills.iter().map(|p| p.url.as_str()).collect::<Vec<_>>(),
            decode = ?decodes,
            bootstrap,
            bootstraps = ?bootstraps,
            %transfer,
            "disaggregated: router -> prefill + decode"
        );
        tracing::info!("listening on http://{addr}");
        tracing::info!(
            "SIGHUP or POST /admin/restart (with the API key) restarts the workers one at a time"
        );
        let limits = config.http;
        let (app, handle) = handoff_server::router::build_router(config)?;
        let control = handle.control();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let stop = async move {
            tokio::select! {
                _ = crate::signal::shutdown_signal() => {}
                _ = stop_rx => {}
            }
        };
        let hup = tokio::spawn(crate::signal::on_hangup(move || match hook.request() {
            Ok(n) => tracing::info!(restart = n, "SIGHUP: rolling restart"),
            Err(e) => tracing::warn!("SIGHUP: no restart started ({e:?})"),
        }));
        let router = handoff_server::router::serve_router(listener, app, handle, limits, stop);
        tokio::pin!(router);
        let failed = tokio::select! {
            r = &mut router => {
                r.context("serving the router")?;
                None
            }
            e = fleet.run(control, restarts) => Some(e),
        };
        hup.abort();
        if let Some(e) = failed {
            let _ = stop_tx.send(());
            let _ = router.await;
            return Err(e);
        }
        tracing::info!("router stopped; stopping the workers");
        Ok::<_, anyhow::Error>(())
    })?;
    drop(fleet);
    tracing::info!("shut down");
    Ok(())
}
