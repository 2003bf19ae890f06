#!/usr/bin/env bash
# One run of the same seeded workload against handoff serve (PD), handoff
# serve --colocated and llama.cpp's llama-server on the same GGUF, 2 threads
# each, the same number of parallel slots as handoff's --max-batch; printed
# as ratios by `handoff bench` (PD / llama-server, colocated / llama-server).
#
# Usage: scripts/bench-vs-llama-server.sh [handoff bench flags...]
#   default workload: --shared-prefix 2:256:8:4 --prompt-len 32 --output-len 32 --concurrency 8
# Env: SLOTS (default 8) = llama-server -np and handoff --max-batch;
#      MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf).
# Needs scripts/build-llamacpp.sh (llama-server) and a release build of handoff.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SLOTS="${SLOTS:-8}"
MODEL="${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
HANDOFF="$ROOT/target/release/handoff"
LLAMA_SERVER="$(bash scripts/build-llamacpp.sh 2>/dev/null | awk '/llama-server/ {print $1}')"
[ -x "$HANDOFF" ] || { echo "build handoff first: cargo build --release -p handoff" >&2; exit 1; }
[ -x "$LLAMA_SERVER" ] || { echo "llama-server missing: run scripts/build-llamacpp.sh" >&2; exit 1; }

if [ "$#" -eq 0 ]; then
    set -- --shared-prefix 2:256:8:4 --prompt-len 32 --output-len 32 --concurrency "$SLOTS"
fi

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_up() {
    for _ in $(seq 1 180); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "server on port $1 did not come up" >&2
    exit 1
}

"$HANDOFF" serve --port 31000 --model "$MODEL" --max-batch "$SLOTS" >/tmp/bench-pd.log 2>&1 &
PIDS+=($!)
"$HANDOFF" serve --colocated --port 31001 --model "$MODEL" --max-batch "$SLOTS" >/tmp/bench-colocated.log 2>&1 &
PIDS+=($!)
# Continuous batching and the per-slot prompt cache are llama-server's
# defaults; -c is shared by the slots. A fresh llama-server per comparison,
# so neither run finds the other's prompts in its cache.
start_llama_server() {
    "$LLAMA_SERVER" -m "$MODEL" -t 2 -tb 2 -np "$SLOTS" -c $((SLOTS * 2048)) --port 31002 \
        --host 127.0.0.1 >/tmp/bench-llama-server.log 2>&1 &
    LLAMA_PID=$!
    PIDS+=("$LLAMA_PID")
    wait_up 31002
}
for p in 31000 31001; do wait_up "$p"; done

echo "== handoff serve (PD) vs llama-server"
start_llama_server
"$HANDOFF" bench --url http://127.0.0.1:31000 --label pd \
    --baseline-url http://127.0.0.1:31002 --baseline-label llama-server "$@"
kill "$LLAMA_PID"; wait "$LLAMA_PID" 2>/dev/null || true
echo "== handoff serve --colocated vs llama-server"
start_llama_server
"$HANDOFF" bench --url http://127.0.0.1:31001 --label colocated \
    --baseline-url http://127.0.0.1:31002 --baseline-label llama-server "$@"
