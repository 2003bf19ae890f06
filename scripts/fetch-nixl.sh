#!/usr/bin/env bash
# Fetch NIXL's shared libraries (libnixl, libnixl_capi, the UCX plugin and the
# UCX libraries they ship with) from the PyPI wheel nixl-cu12==1.5.1 into
# .cache/nixl/ (git-ignored). Nothing in these libraries needs CUDA; the
# wheel's torch and numpy requirements are for its Python module only, so it
# is downloaded with --no-deps and never installed. Idempotent.
# Prints the library folder on stdout (logs go to stderr): put it on
# LD_LIBRARY_PATH for a handoff built with `--features nixl`.
set -euo pipefail

PKG="nixl-cu12==1.5.1"
SHA256="341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.cache/nixl/1.5.1"
LIB="$DEST/.nixl_cu12.mesonpy.libs"

log() { echo "[fetch-nixl] $*" >&2; }

if [ ! -f "$LIB/libnixl_capi.so" ] || [ ! -f "$LIB/plugins/libplugin_UCX.so" ]; then
    PIP=(python3 -m pip)
    "${PIP[@]}" --version >/dev/null 2>&1 || PIP=(pip)
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    log "downloading $PKG from PyPI (--no-deps)"
    "${PIP[@]}" download -q --no-deps "$PKG" -d "$TMP" >&2
    WHEEL="$(ls "$TMP"/*.whl | head -1)"
    got="$(sha256sum "$WHEEL" | cut -d' ' -f1)"
    if [ "$got" != "$SHA256" ]; then
        log "ERROR: sha256 mismatch for $WHEEL: expected $SHA256, got $got"
        exit 1
    fi
    rm -rf "$DEST"
    mkdir -p "$DEST"
    # The libraries and their bundled dependencies (two folders the wheel
    # keeps side by side: the first finds the second by relative RUNPATH).
    python3 - "$WHEEL" "$DEST" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for n in z.namelist():
        if n.startswith((".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")):
            z.extract(n, dest)
PY
    log "extracted into $DEST"
fi
echo "$LIB"
