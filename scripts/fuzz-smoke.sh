#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of the cargo-fuzz targets in fuzz/,
# on the stable toolchain; scripts/test.sh runs it.
#
# Builds fuzz/ with the instrumentation flags cargo-fuzz passes (SanitizerCoverage
# via stable -C flags; no AddressSanitizer, which needs nightly and which
# handoff-proto, #![forbid(unsafe_code)], does not need); libfuzzer-sys compiles
# libFuzzer from its C++ source with g++. Then runs each target for
# FUZZ_SECONDS (default 30) over a temporary copy of fuzz/corpus/<target>/, so
# new inputs never land in the git tree. A panic in a target is a crash: the
# script prints the input's path and a hex dump and exits non-zero.
#
# Usage: scripts/fuzz-smoke.sh [target...]     (default: every target)
# Reproduce a crash: fuzz/target/x86_64-unknown-linux-gnu/release/<target> <file>
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SECONDS_PER_TARGET="${FUZZ_SECONDS:-30}"
TRIPLE="x86_64-unknown-linux-gnu"
# fuzz/ is its own workspace; fuzz/target is git-ignored.
export CARGO_TARGET_DIR="$ROOT/fuzz/target"
BIN_DIR="$CARGO_TARGET_DIR/$TRIPLE/release"

if [ "$#" -gt 0 ]; then
    TARGETS=("$@")
else
    TARGETS=(frame_decoder handshake data_link)
fi

log() { printf '[fuzz-smoke] %s\n' "$*"; }

# The flags `cargo fuzz build -s none` passes on Linux, all stable, plus
# -max-loads-per-memcmp=0: without it LLVM inlines short slice comparisons
# (`starts_with(b"ABCD")`) after the coverage pass, so libFuzzer sees neither
# the compared bytes nor its memcmp hook, and never guesses a 4-byte magic.
# RUSTFLAGS replaces the target-cpu flag from .cargo/config.toml (not needed
# here); --target keeps the flags off build scripts, as cargo-fuzz does.
RUSTFLAGS="-Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
-Cllvm-args=-sanitizer-coverage-stack-depth \
-Cllvm-args=-simplifycfg-branch-fold-threshold=0 \
-Cllvm-args=-max-loads-per-memcmp=0 \
--cfg fuzzing -Clink-dead-code -Cdebug-assertions -Ccodegen-units=1"
export RUSTFLAGS

log "build (${TARGETS[*]})"
build_start=$(date +%s)
bins=()
for t in "${TARGETS[@]}"; do bins+=(--bin "$t"); done
cargo build --manifest-path fuzz/Cargo.toml --locked --release --target "$TRIPLE" \
    --config 'profile.release.debug="line-tables-only"' "${bins[@]}"
log "build took $(($(date +%s) - build_start)) s"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/handoff-fuzz.XXXXXX")"
failed=()
for t in "${TARGETS[@]}"; do
    corpus="$WORK/$t/corpus"
    artifacts="$WORK/$t/artifacts"
    logfile="$WORK/$t/libfuzzer.log"
    mkdir -p "$corpus" "$artifacts"
    cp fuzz/corpus/"$t"/* "$corpus"/
    log "$t: ${SECONDS_PER_TARGET} s from $(ls "$corpus" | wc -l) corpus inputs"
    rc=0
    RUST_BACKTRACE=1 "$BIN_DIR/$t" "$corpus" \
        -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$artifacts/" -print_final_stats=1 >"$logfile" 2>&1 || rc=$?
    crashes=("$artifacts"/*)
    if [ "$rc" -ne 0 ] || [ -e "${crashes[0]}" ]; then
        failed+=("$t")
        log "$t: FAILED (exit $rc); libFuzzer's log ($logfile) ends:"
        tail -n 60 "$logfile"
        for f in "${crashes[@]}"; do
            [ -e "$f" ] || continue
            log "$t: crashing input $f ($(stat -c %s "$f") bytes):"
            od -A x -t x1z -v "$f" | head -n 64
            log "reproduce: $BIN_DIR/$t $f"
        done
    else
        grep -E '^stat::(number_of_executed_units|new_units_added):' "$logfile" |
            sed "s/^/[fuzz-smoke] $t: /"
        grep -E '^#[0-9]+[[:space:]]+DONE' "$logfile" | sed "s/^/[fuzz-smoke] $t: /" || true
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    log "crashes in: ${failed[*]} (inputs and logs kept in $WORK)"
    exit 1
fi
rm -rf "$WORK"
log "no crashes"
