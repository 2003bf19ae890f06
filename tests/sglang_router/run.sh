#!/usr/bin/env bash
# SGLang's own PD router (sglang-router==0.3.2, from PyPI) in front of a
# handoff prefill process and a handoff decode process, checked against a
# colocated `handoff serve` on the same model (test_sglang_router.py).
#   HANDOFF_BIN  the binary (default: target/debug/handoff, built if missing)
#   extra arguments go to every handoff process (e.g. --model PATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="${HANDOFF_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/handoff}"
[ -x "$BIN" ] || cargo build -p handoff
VENV="$ROOT/.cache/sglang-router-venv"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sglang_router, pytest' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q sglang-router==0.3.2 pytest==8.3.4
fi
PY="$VENV/bin/python"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
P_PORT=$(free_port); D_PORT=$(free_port); C_PORT=$(free_port); R_PORT=$(free_port); BOOT=$(free_port)
# A second prefill with a 256-token context, reached through a proxy that
# delivers requests 0.5 s late, behind a second router: its refusals come
# after decode reserved pages.
SP_PORT=$(free_port); SX_PORT=$(free_port); R2_PORT=$(free_port); BOOT2=$(free_port)
LOGS="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
"$BIN" prefill --port "$P_PORT" --disaggregation-bootstrap-port "$BOOT" "$@" >"$LOGS/prefill.log" 2>&1 & PIDS+=($!)
# SGLang's router cannot sign bootstrap fields: the decode worker is told
# which prefill transfer endpoints it may dial.
"$BIN" decode --port "$D_PORT" --prefill-allow "127.0.0.1:$BOOT" --prefill-allow "127.0.0.1:$BOOT2" "$@" >"$LOGS/decode.log" 2>&1 & PIDS+=($!)
"$BIN" serve --colocated --port "$C_PORT" "$@" >"$LOGS/colocated.log" 2>&1 & PIDS+=($!)
"$BIN" prefill --port "$SP_PORT" --disaggregation-bootstrap-port "$BOOT2" --context-length 256 "$@" >"$LOGS/small-prefill.log" 2>&1 & PIDS+=($!)
"$PY" "$ROOT/tests/sglang_router/delay_proxy.py" "$SX_PORT" "$SP_PORT" 0.5 >"$LOGS/proxy.log" 2>&1 & PIDS+=($!)
wait_healthy() {
    for _ in $(seq 1 600); do
        if "$PY" -c "import urllib.request; urllib.request.urlopen('$1/health', timeout=1)" 2>/dev/null; then return 0; fi
        sleep 0.5
    done
    echo "$1 never became healthy; logs in $LOGS" >&2; tail -n 20 "$LOGS"/*.log >&2; exit 1
}
wait_healthy "http://127.0.0.1:$P_PORT"; wait_healthy "http://127.0.0.1:$D_PORT"; wait_healthy "http://127.0.0.1:$C_PORT"
wait_healthy "http://127.0.0.1:$SP_PORT"
"$PY" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$P_PORT" "$BOOT" --decode "http://127.0.0.1:$D_PORT" \
    --host 127.0.0.1 --port "$R_PORT" --prometheus-port "$(free_port)" >"$LOGS/router.log" 2>&1 & PIDS+=($!)
"$PY" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$SX_PORT" "$BOOT2" --decode "http://127.0.0.1:$D_PORT" \
    --host 127.0.0.1 --port "$R2_PORT" --prometheus-port "$(free_port)" >"$LOGS/router2.log" 2>&1 & PIDS+=($!)
for port in "$R_PORT" "$R2_PORT"; do
    for _ in $(seq 1 120); do
        if "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/readiness', timeout=2)" 2>/dev/null; then break; fi
        sleep 0.5
    done
done
ROUTER_URL="http://127.0.0.1:$R_PORT" COLOCATED_URL="http://127.0.0.1:$C_PORT" \
    ROUTER_SMALL_URL="http://127.0.0.1:$R2_PORT" \
    DECODE_URL="http://127.0.0.1:$D_PORT" PREFILL_URL="http://127.0.0.1:$P_PORT" \
    "$PY" -m pytest -q "$ROOT/tests/sglang_router" || { tail -n 30 "$LOGS"/*.log >&2; exit 1; }
