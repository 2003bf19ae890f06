//! `handoff`: the binary (DESIGN.md §1). `handoff serve` runs the colocated
//! server: the engine on the given GGUF and the HTTP API in front of it;
//! `handoff router` runs the PD router in front of prefill and decode workers.
#![forbid(unsafe_code)]

mod bench_model;
mod bench_transfer;
mod router_cmd;
mod serve;
mod signal;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Prefill/decode disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "handoff", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model with an OpenAI- and SGLang-compatible HTTP API (colocated).
    Serve(serve::ServeArgs),
    /// Route requests to prefill/decode worker pairs (PD disaggregation),
    /// relaying decode's answer as it is generated.
    Router(router_cmd::RouterArgs),
    /// Prefill and decode throughput of the model runner next to llama.cpp's
    /// llama-bench on the same GGUF, printed as ratios.
    BenchModel(bench_model::BenchModelArgs),
    /// KV transfer bandwidth and latency (shm, tcp) next to memcpy and raw
    /// loopback TCP, measured in one run.
    BenchTransfer(bench_transfer::BenchTransferArgs),
    /// The decode-side process of bench-transfer (started by it).
    #[command(hide = true)]
    BenchPeer(bench_transfer::BenchPeerArgs),
}

/// candle's CPU kernels run on a process-wide pool sized by this variable,
/// read once at first use: set it from `--threads` before any model work.
fn set_compute_threads(threads: u16) {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    }
}

fn main() -> anyhow::Result<()> {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Serve(args) => {
            set_compute_threads(args.threads);
            serve::run(args)
        }
        Command::Router(args) => router_cmd::run(args, matches.subcommand_matches("router")),
        Command::BenchTransfer(args) => bench_transfer::run(args),
        Command::BenchPeer(args) => bench_transfer::peer(args),
        Command::BenchModel(args) => {
            set_compute_threads(args.threads);
            bench_model::run(args)
        }
    }
}
