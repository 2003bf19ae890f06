#!/usr/bin/env bash
# The chaos suite (tests/chaos/chaos.py): prefill, decode and router in
# three network namespaces, a seeded schedule of faults under a bounded
# load, then a verdict (0 garbage, 0 hangs, 0 leaked pages or rooms).
# Root only. Full run: scripts/chaos.sh (1000 requests); CI runs a bounded
# one: scripts/chaos.sh --requests 300. Other flags: tests/chaos/chaos.py -h.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v tc >/dev/null || ! command -v ip >/dev/null; then
    apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null
fi
MODEL="${HANDOFF_MODEL:-$("$ROOT/scripts/fetch-model.sh")}"
BIN="${HANDOFF_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/handoff}"
[ -x "$BIN" ] || (cd "$ROOT" && cargo build -p handoff)
exec python3 "$ROOT/tests/chaos/chaos.py" --bin "$BIN" --model "$MODEL" "$@"
