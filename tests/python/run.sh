#!/usr/bin/env bash
# Start `handoff serve` on a free port, run the openai-client tests against it,
# then stop the server. Extra arguments go to `handoff serve` (e.g. --model PATH).
#   HANDOFF_BIN  the binary   (default: target/release/handoff, built if missing)
#   PYTHON       interpreter with tests/python/requirements.txt installed
#                (default: .venv/bin/python, created and filled if missing)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="${HANDOFF_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/handoff}"
if [ ! -x "$BIN" ]; then
    cargo build --release -p handoff
fi
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$PY" ]; then
    python3 -m venv "$ROOT/.venv"
    "$ROOT/.venv/bin/pip" install -q -r tests/python/requirements.txt
    PY="$ROOT/.venv/bin/python"
fi
PORT="${HANDOFF_TEST_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
URL="http://127.0.0.1:$PORT"
"$BIN" serve --port "$PORT" "$@" &
PID=$!
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if "$PY" -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=1)" 2>/dev/null; then
        break
    fi
    kill -0 "$PID" 2>/dev/null || { echo "handoff serve exited before becoming healthy" >&2; exit 1; }
    sleep 0.5
done
HANDOFF_URL="$URL" "$PY" -m pytest -q tests/python
