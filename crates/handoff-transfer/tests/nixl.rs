//! NIXL's library and backend, as a worker finds them at start (feature
//! `nixl`; the transport's behaviour is the conformance suite's `nixl`
//! module). Run with scripts/fetch-nixl.sh's folder on LD_LIBRARY_PATH.
#![cfg(feature = "nixl")]

use std::process::Command;

use handoff_transfer::{check_transport, TransportKind};

/// The real library is loaded, not nixl-sys's stub (which would let a
/// transport report success while moving nothing): the agent comes up and
/// the library it runs is mapped into this process.
#[test]
fn the_real_nixl_library_is_loaded_not_the_stub() {
    check_transport(TransportKind::Nixl).expect("NIXL usable in this test process");
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(
        maps.contains("/libnixl_capi.so") && maps.contains("/libplugin_UCX.so"),
        "libnixl_capi.so and the UCX plugin are not mapped: the stub answered"
    );
}

/// A process that names NIXL and gets only the stub (the library not on
/// the loader path) refuses to start, saying which path was searched.
#[test]
fn a_nixl_process_that_finds_only_the_stub_refuses_naming_the_path_searched() {
    let out = Command::new(env!("CARGO_BIN_EXE_handoff-transfer-peer"))
        .args(["prefill", "nixl", "ready"])
        .env("LD_LIBRARY_PATH", "/nonexistent/nixl")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(
        err.contains("libnixl_capi.so was not found")
            && err.contains("LD_LIBRARY_PATH=/nonexistent/nixl")
            && err.contains("UCX_TLS="),
        "{err}"
    );
    // Nothing was printed as if it were listening.
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The library is there but UCX cannot make the backend (shared memory
/// alone gives UCX no peer failure handling): refused, naming UCX_TLS.
#[test]
fn a_nixl_backend_ucx_cannot_make_is_refused_naming_ucx_tls() {
    let out = Command::new(env!("CARGO_BIN_EXE_handoff-transfer-peer"))
        .args(["prefill", "nixl", "ready"])
        .env("UCX_TLS", "posix")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(
        err.contains("creating NIXL's UCX backend") && err.contains("UCX_TLS=posix"),
        "{err}"
    );
}
