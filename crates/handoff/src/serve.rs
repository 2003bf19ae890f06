//! `handoff serve`: the one command that serves a model. By default
//! disaggregated: handoff's router on `--host/--port`, one prefill and one
//! decode worker process behind it on loopback. `--colocated` serves the
//! baseline (one engine, no transfer); `--disaggregation-mode
//! prefill|decode` runs one side of a PD pair only (as `handoff
//! prefill|decode`).

use clap::Args;

use crate::engine_args::{EngineArgs, HttpArgs};
use crate::worker::{self, Mode, PdArgs, WorkerArgs};

/// Flags of `handoff serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    pd: PdArgs,
    /// Serve colocated: one engine runs prefill and decode, no KV transfer
    /// (the baseline PD is measured against).
    #[arg(long, conflicts_with = "disaggregation_mode")]
    colocated: bool,
    /// Run one side of a PD pair only, as `handoff prefill|decode` (`null`
    /// is `--colocated`).
    #[arg(long, value_enum)]
    disaggregation_mode: Option<Mode>,
    /// Disaggregated serve: niceness of the prefill worker process (0-19;
    /// 0 = none). Where prefill and decode share the cores, decode steps
    /// then preempt prefill compute, keeping inter-token latency low while
    /// long prompts prefill (BENCHMARKS.md: ITL p50 0.64x, p90 0.19x of
    /// niceness 0 under mixed load on 2 cores).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=19))]
    prefill_nice: u8,
    /// Disaggregated serve: prefill worker processes (each supervised,
    /// each with its own KV pool of --kv-pages).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    prefill_replicas: u16,
    /// Disaggregated serve: decode worker processes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    decode_replicas: u16,
    /// Disaggregated serve: seconds a request waits for a worker of a role
    /// with none healthy (one being restarted) before a 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 30)]
    queue_timeout_secs: u64,
    /// Disaggregated serve: migration, the per-request PD decision and
    /// shedding in its router.
    #[command(flatten)]
    adapt: crate::router_cmd::AdaptArgs,
}

impl ServeArgs {
    /// What it runs.
    pub fn shape(&self) -> crate::flag_scope::Shape {
        use crate::flag_scope::Shape;
        match (self.colocated, self.disaggregation_mode) {
            (true, _) | (false, Some(Mode::Null)) => Shape::Colocated,
            (false, Some(Mode::Prefill)) => Shape::Prefill,
            (false, Some(Mode::Decode)) => Shape::Decode,
            (false, None) => Shape::LocalPd,
        }
    }

    /// Its service name in traces: the router of a PD serve, else the
    /// worker it runs.
    pub fn service_name(&self) -> &'static str {
        match (self.colocated, self.disaggregation_mode) {
            (true, _) | (false, Some(Mode::Null)) => "handoff",
            (false, Some(Mode::Prefill)) => "handoff-prefill",
            (false, Some(Mode::Decode)) => "handoff-decode",
            (false, None) => "handoff-router",
        }
    }
}

/// Run `handoff serve` until SIGTERM / ctrl-c.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mode = match (args.colocated, args.disaggregation_mode) {
        (true, _) => Some(Mode::Null),
        (false, m) => m,
    };
    let Some(mode) = mode else {
        let replicas = crate::local_pd::Replicas {
            prefill: usize::from(args.prefill_replicas),
            decode: usize::from(args.decode_replicas),
            queue_timeout: std::time::Duration::from_secs(args.queue_timeout_secs),
            adapt: args.adapt,
        };
        return crate::local_pd::run(
            &args.engine,
            &args.http,
            &args.pd,
            args.prefill_nice,
            replicas,
        );
    };
    let worker = WorkerArgs {
        engine: args.engine,
        http: args.http,
        pd: args.pd,
    };
    worker::run(mode, worker)
}
