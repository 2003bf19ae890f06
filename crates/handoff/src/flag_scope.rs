//! Which flags each shape of a serving command reads (issue 33 item 9: no
//! flag is accepted and ignored). `handoff serve`, `handoff prefill` and
//! `handoff decode` share their engine, HTTP and transfer flags, but not
//! every shape reads every one: a prefill worker dials no prefill
//! (`--prefill-allow`), a decode worker opens no transfer endpoint
//! (`--disaggregation-bootstrap-port`), a colocated engine moves no KV.
//! A flag given on the command line (or through its environment variable)
//! to a shape that does not read it is refused with the shapes that do.
//!
//! [`READERS`] is the one table; a test walks every flag clap knows for the
//! three commands and fails on one the table does not place.

use clap::parser::ValueSource;
use clap::ArgMatches;

/// What a serving command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One engine, prefill and decode together (`serve --colocated`).
    Colocated,
    /// A prefill worker (`handoff prefill`, `serve --disaggregation-mode
    /// prefill`).
    Prefill,
    /// A decode worker.
    Decode,
    /// `handoff serve`'s own PD pair: its router and worker processes.
    LocalPd,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Colocated => "a colocated engine",
            Shape::Prefill => "a prefill worker",
            Shape::Decode => "a decode worker",
            Shape::LocalPd => "`handoff serve`'s own prefill/decode pair",
        }
    }
}

use Shape::{Colocated as C, Decode as D, LocalPd as L, Prefill as P};

const ALL: &[Shape] = &[C, P, D, L];
const PD: &[Shape] = &[P, D, L];

/// Flag id (clap's: the field name) → the shapes that read it, and what to
/// do instead when `handoff serve`'s own pair is given it (elsewhere, and
/// where this is empty: drop it).
pub const READERS: &[(&str, &[Shape], &str)] = &[
    // Engine, HTTP, process: every shape.
    ("model", ALL, ""),
    ("threads", ALL, ""),
    ("page_size", ALL, ""),
    ("kv_dtype", ALL, ""),
    ("kv_pages", ALL, ""),
    ("kv_memory_mb", ALL, ""),
    ("mem_fraction_static", ALL, ""),
    ("max_batch", ALL, ""),
    ("max_waiting", ALL, ""),
    ("prefill_chunk", ALL, ""),
    ("context_length", ALL, ""),
    ("served_model_name", ALL, ""),
    ("disable_radix_cache", ALL, ""),
    ("prefill_format", ALL, ""),
    ("decode_format", ALL, ""),
    ("weight_cache", ALL, ""),
    ("tp_size", ALL, ""),
    ("host", ALL, ""),
    ("port", ALL, ""),
    ("http_header_timeout_secs", ALL, ""),
    ("http_body_timeout_secs", ALL, ""),
    ("stream_write_timeout_secs", ALL, ""),
    ("max_connections", ALL, ""),
    ("drain_timeout_secs", ALL, ""),
    ("stream_stall_timeout_secs", ALL, ""),
    ("api_key", ALL, ""),
    ("api_key_file", ALL, ""),
    ("open_paths", ALL, ""),
    ("allow_origin", ALL, ""),
    ("exit_with_parent", &[C, P, D], ""),
    // The transfer: the PD shapes, each side its own.
    ("disaggregation_bootstrap_port", &[P, L], ""),
    ("disaggregation_transfer_backend", &[P, D, L], ""),
    ("transfer_secret_file", PD, ""),
    ("transfer_tcp_streams", &[D, L], ""),
    ("disable_delta_transfer", PD, ""),
    ("on_transfer_failure", &[D, L], ""),
    ("transfer_io_threads", PD, ""),
    (
        "prefill_allow",
        &[D],
        "`handoff serve`'s decode dials only its own prefills (signed by its router): run `handoff decode --prefill-allow ...`",
    ),
    (
        "discovery",
        &[P, D],
        "`handoff serve`'s own workers are not registered and its router does not watch etcd: run `handoff prefill|decode --discovery ...` and `handoff router --discovery ...` instead, or `handoff serve --disaggregation-mode prefill|decode --discovery ...` for one worker",
    ),
    ("discovery_ttl_secs", &[P, D], ""),
    ("advertise_host", &[P, D], ""),
    // `handoff serve` itself.
    ("colocated", ALL, ""),
    ("disaggregation_mode", ALL, ""),
    ("prefill_nice", &[L], ""),
    ("prefill_replicas", &[L], ""),
    ("decode_replicas", &[L], ""),
    ("queue_timeout_secs", &[L], ""),
    ("migration_limit", &[L], ""),
    ("local_prefill_below", &[L], ""),
    ("local_prefill_wait_ms", &[L], ""),
    ("slo_ttft_ms", &[L], ""),
];

/// Refuse every flag of `matches` that was given (on the command line or
/// through its environment variable) but that `shape` does not read.
pub fn refuse_unread(shape: Shape, matches: &ArgMatches) -> anyhow::Result<()> {
    for id in matches.ids() {
        let id = id.as_str();
        let given = matches!(
            matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        if !given {
            continue;
        }
        let Some((_, readers, instead)) = READERS.iter().find(|(f, _, _)| *f == id) else {
            continue;
        };
        if !readers.contains(&shape) {
            let flag = format!("--{}", id.replace('_', "-"));
            let read_by: Vec<&str> = readers.iter().map(|s| s.name()).collect();
            anyhow::bail!(
                "{flag} is not read by {} (only by {}): {}",
                shape.name(),
                read_by.join(", "),
                if shape == Shape::LocalPd && !instead.is_empty() {
                    instead
                } else {
                    "drop it"
                }
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn matches(args: &[&str]) -> (String, ArgMatches) {
        let m = crate::Cli::command()
            .try_get_matches_from(std::iter::once("handoff").chain(args.iter().copied()))
            .unwrap();
        let (name, sub) = m.subcommand().unwrap();
        (name.to_string(), sub.clone())
    }

    /// Every flag clap knows for the serving commands has its readers in
    /// the table: a new flag fails this test until someone says which
    /// shapes read it (and so which refuse it).
    #[test]
    fn every_serving_flag_has_its_readers() {
        let cmd = crate::Cli::command();
        for name in ["serve", "prefill", "decode"] {
            let sub = cmd.find_subcommand(name).unwrap();
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if ["help", "version"].contains(&id) {
                    continue;
                }
                assert!(
                    READERS.iter().any(|(f, _, _)| *f == id),
                    "`handoff {name} --{}` is not in flag_scope::READERS: say which shapes read it",
                    arg.get_long().unwrap_or(id)
                );
            }
        }
        // And the table names no flag that does not exist.
        let known: Vec<String> = ["serve", "prefill", "decode"]
            .iter()
            .flat_map(|n| {
                cmd.find_subcommand(n)
                    .unwrap()
                    .get_arguments()
                    .map(|a| a.get_id().as_str().to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        for (f, _, _) in READERS {
            assert!(known.iter().any(|k| k == f), "READERS names no flag {f}");
        }
    }

    /// Each shape refuses, by name and with the shapes that read it, a flag
    /// it does not read, and takes the ones it does.
    #[test]
    fn a_flag_a_shape_does_not_read_is_refused_by_name() {
        let refused = [
            (P, &["prefill", "--prefill-allow", "127.0.0.1:8998"][..], "--prefill-allow is not read by a prefill worker (only by a decode worker)"),
            (P, &["prefill", "--on-transfer-failure", "fail"], "--on-transfer-failure is not read by a prefill worker"),
            (P, &["prefill", "--transfer-tcp-streams", "4"], "--transfer-tcp-streams is not read by a prefill worker"),
            (D, &["decode", "--disaggregation-bootstrap-port", "9000"], "--disaggregation-bootstrap-port is not read by a decode worker"),
            (C, &["serve", "--colocated", "--transfer-io-threads", "2"], "--transfer-io-threads is not read by a colocated engine"),
            (C, &["serve", "--colocated", "--prefill-replicas", "2"], "--prefill-replicas is not read by a colocated engine (only by `handoff serve`'s own prefill/decode pair): drop it"),
            (P, &["serve", "--disaggregation-mode", "prefill", "--migration-limit", "0"], "--migration-limit is not read by a prefill worker"),
            (L, &["serve", "--discovery", "etcd://127.0.0.1:2379"], "--discovery is not read by `handoff serve`'s own prefill/decode pair (only by a prefill worker, a decode worker): `handoff serve`'s own workers are not registered"),
            (L, &["serve", "--prefill-allow", "127.0.0.1:8998"], "--prefill-allow is not read by `handoff serve`'s own prefill/decode pair"),
        ];
        for (shape, args, want) in refused {
            let (_, m) = matches(args);
            let e = refuse_unread(shape, &m).expect_err(&format!("{args:?}"));
            assert!(e.to_string().contains(want), "{args:?}: {e}");
        }
        let taken = [
            (
                D,
                &[
                    "decode",
                    "--prefill-allow",
                    "127.0.0.1:8998",
                    "--transfer",
                    "tcp",
                ][..],
            ),
            // (A prefill reads --transfer only for nixl; worker.rs refuses
            // the other values at start: tests/cli.rs.)
            (P, &["prefill", "--transfer", "nixl"][..]),
            (
                P,
                &[
                    "prefill",
                    "--disaggregation-bootstrap-port",
                    "9000",
                    "--transfer-io-threads",
                    "2",
                ],
            ),
            (
                L,
                &[
                    "serve",
                    "--prefill-replicas",
                    "2",
                    "--on-transfer-failure",
                    "fail",
                    "--transfer-tcp-streams",
                    "2",
                ],
            ),
            (
                C,
                &["serve", "--colocated", "--threads", "2", "--port", "1234"],
            ),
            // Defaults are not "given": every shape takes a bare command.
            (P, &["prefill"]),
            (C, &["serve", "--colocated"]),
        ];
        for (shape, args) in taken {
            let (_, m) = matches(args);
            refuse_unread(shape, &m).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
    }
}
