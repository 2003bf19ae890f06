//! `handoff`: the binary. `handoff serve` serves a GGUF
//! disaggregated on one host (router + prefill + decode; `--colocated` for
//! the baseline); `handoff prefill`, `handoff decode` and `handoff router`
//! run the roles as separate processes on any hosts; `handoff bench` loads
//! any OpenAI-compatible endpoint.
#![forbid(unsafe_code)]

mod bench;
mod bench_model;
mod bench_transfer;
mod engine_args;
mod flag_scope;
mod fleet;
mod local_pd;
mod model_check;
mod model_fetch;
mod router_cmd;
mod serve;
mod signal;
mod worker;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Prefill/decode disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "handoff", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log level: error, warning (or warn), info, debug or trace (SGLang's
    /// spelling; `critical` is error). Overrides RUST_LOG, and reaches the
    /// worker processes `handoff serve` starts [default: RUST_LOG, else info].
    #[arg(long, global = true, value_parser = parse_log_level)]
    log_level: Option<&'static str>,
}

/// A `--log-level` as a tracing filter directive.
fn parse_log_level(s: &str) -> Result<&'static str, String> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "critical" | "error" => "error",
        "warning" | "warn" => "warn",
        "info" => "info",
        "debug" => "debug",
        "trace" => "trace",
        _ => {
            return Err(format!(
                "unknown log level {s:?}: use error, warning, info, debug or trace"
            ))
        }
    })
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model with an OpenAI- and SGLang-compatible HTTP API:
    /// router + prefill + decode on this host (--colocated for one engine).
    Serve(serve::ServeArgs),
    /// Run a prefill worker: computes prompts' KV and writes it into the
    /// pages a decode worker reserved (pair them with `handoff router`).
    Prefill(worker::WorkerArgs),
    /// Run a decode worker: reserves KV pages, receives a prefill's KV and
    /// generates (pair them with `handoff router`).
    Decode(worker::WorkerArgs),
    /// Load generator against an OpenAI-compatible endpoint: TTFT, ITL,
    /// latency, throughput, goodput.
    Bench(bench::BenchArgs),
    /// Route requests to prefill/decode worker pairs (PD disaggregation),
    /// relaying decode's answer as it is generated.
    Router(router_cmd::RouterArgs),
    /// Prefill and decode throughput of the model runner next to llama.cpp's
    /// llama-bench on the same GGUF, printed as ratios.
    BenchModel(bench_model::BenchModelArgs),
    /// KV transfer bandwidth and latency (shm, tcp) next to memcpy and raw
    /// loopback TCP, measured in one run.
    BenchTransfer(bench_transfer::BenchTransferArgs),
    /// Fetch the default model into the per-user cache ($HANDOFF_HOME,
    /// default ~/.cache/handoff) if it is not there, check its SHA-256, and
    /// print its path.
    FetchModel,
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

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line for a refused model (`{:#}` joins the causes).
            eprintln!("Error: {e:#}");
            std::process::ExitCode::from(model_check::exit_status(&e))
        }
    }
}

fn run() -> anyhow::Result<()> {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(level) = cli.log_level {
        // Still one thread: set before any is started, and inherited by the
        // worker processes of `handoff serve`.
        std::env::set_var("RUST_LOG", level);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    // One trace per request, exported over OTLP when an endpoint is
    // configured (the OTEL_EXPORTER_OTLP_* variables); flushed on return.
    let service = match &cli.command {
        Command::Serve(args) => args.service_name(),
        Command::Prefill(_) => "handoff-prefill",
        Command::Decode(_) => "handoff-decode",
        Command::Router(_) => "handoff-router",
        _ => "handoff",
    };
    let _export = match handoff_server::http::otel::init(service) {
        Ok(Some(e)) => {
            tracing::info!(endpoint = %e.endpoint, service, "exporting traces over OTLP");
            Some(e)
        }
        Ok(None) => None,
        Err(e) => anyhow::bail!("OTLP trace export: {e}"),
    };
    // A flag the command's shape does not read is refused, not ignored.
    let shape = match &cli.command {
        Command::Serve(args) => Some(("serve", args.shape())),
        Command::Prefill(_) => Some(("prefill", flag_scope::Shape::Prefill)),
        Command::Decode(_) => Some(("decode", flag_scope::Shape::Decode)),
        _ => None,
    };
    if let Some((name, shape)) = shape {
        if let Some(sub) = matches.subcommand_matches(name) {
            flag_scope::refuse_unread(shape, sub)?;
        }
    }
    match cli.command {
        Command::Serve(args) => {
            set_compute_threads(args.engine.threads);
            serve::run(args)
        }
        Command::Prefill(args) => {
            set_compute_threads(args.engine.threads);
            worker::run(worker::Mode::Prefill, args)
        }
        Command::Decode(args) => {
            set_compute_threads(args.engine.threads);
            worker::run(worker::Mode::Decode, args)
        }
        Command::Bench(args) => bench::run(args),
        Command::Router(args) => router_cmd::run(args, matches.subcommand_matches("router")),
        Command::BenchTransfer(args) => bench_transfer::run(args),
        Command::BenchPeer(args) => bench_transfer::peer(args),
        Command::FetchModel => {
            println!("{}", model_fetch::default_model()?.display());
            Ok(())
        }
        Command::BenchModel(args) => {
            set_compute_threads(args.threads);
            bench_model::run(args)
        }
    }
}
