//! `handoff serve`: one command that serves a model. Today: the colocated
//! engine and the HTTP API in front of it, or, with
//! `--disaggregation-mode prefill|decode`, one side of a PD pair (as
//! `handoff prefill` / `handoff decode`).

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
    /// Run one side of a PD pair instead (as `handoff prefill|decode`).
    #[arg(long, value_enum, default_value = "null")]
    disaggregation_mode: Mode,
}

/// Run `handoff serve` until SIGTERM / ctrl-c.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let worker = WorkerArgs {
        engine: args.engine,
        http: args.http,
        pd: args.pd,
    };
    worker::run(args.disaggregation_mode, worker)
}
