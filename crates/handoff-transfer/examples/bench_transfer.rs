//! `bench-transfer`: KV transfer bandwidth and latency per transport and
//! page size, with memcpy and raw loopback TCP measured in the same run.
//!
//! `cargo run --release -p handoff-transfer --example bench_transfer -- [--json] [--bytes N] [--runs N] [--tcp-streams N] [--latency-iters N] [--only latency]`
//!
//! The same executable is the decode process (`bench-peer ...`).

use handoff_transfer::bench::{self, BenchConfig};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runtime: {e}");
            std::process::exit(1);
        }
    };
    if args.get(1).map(String::as_str) == Some("bench-peer") {
        if let Err(e) = rt.block_on(bench::peer_main(&args[2..], None)) {
            eprintln!("bench peer: {e}");
            std::process::exit(1);
        }
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("current_exe: {e}");
            std::process::exit(1);
        }
    };
    let mut cfg = BenchConfig::standard(exe);
    let mut json = false;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = true,
            "--bytes" => cfg.bytes = it.next().and_then(|x| x.parse().ok()).unwrap_or(cfg.bytes),
            "--runs" => cfg.runs = it.next().and_then(|x| x.parse().ok()).unwrap_or(cfg.runs),
            "--tcp-streams" => {
                cfg.tcp_streams = it.next().and_then(|x| x.parse().ok()).unwrap_or(1)
            }
            "--only" => match it.next().map(String::as_str) {
                Some("latency") => cfg.latency_only = true,
                other => {
                    eprintln!("--only takes `latency`, not {other:?}");
                    std::process::exit(2);
                }
            },
            "--latency-iters" => {
                cfg.latency_iters = it.next().and_then(|x| x.parse().ok()).unwrap_or(200)
            }
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    match rt.block_on(bench::run(&cfg)) {
        Ok(r) => {
            if json {
                match serde_json::to_string_pretty(&r) {
                    Ok(s) => println!("{s}"),
                    Err(e) => eprintln!("json: {e}"),
                }
            } else {
                print!("{}", bench::render(&r));
            }
        }
        Err(e) => {
            eprintln!("bench-transfer failed: {e}");
            std::process::exit(1);
        }
    }
}
