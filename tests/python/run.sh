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
. tests/serve_on_free_port.sh
serve_on_free_port "$BIN" "$PY" "$@"
HANDOFF_URL="$URL" "$PY" -m pytest -q tests/python
