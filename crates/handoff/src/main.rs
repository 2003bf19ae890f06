//! `handoff`: the binary (DESIGN.md §1). `handoff serve` runs the colocated
//! server: the engine on the given GGUF and the HTTP API in front of it.
#![forbid(unsafe_code)]

mod serve;

use clap::{Parser, Subcommand};

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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Serve(args) => serve::run(args),
    }
}
