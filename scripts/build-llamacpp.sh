#!/usr/bin/env bash
# Build llama.cpp (CPU only) into .cache/llama.cpp/ from the llama-cpp-python
# sdist on PyPI (its vendor/llama.cpp is the llama.cpp source tree), plus the
# reference tool scripts/llamacpp-greedy/greedy.cpp linked against libllama.
#
# Idempotent: re-running only rebuilds what changed.
# Env: JOBS (default 2) = parallel build jobs;
#      LLAMACPP_FETCH_ONLY=1 = only fetch/extract the source, print its path.
#
# Pinned: llama-cpp-python 0.3.36  ==> llama.cpp ggml-org/llama.cpp@0c1e57098
# (commit taken from llama-cpp-python's CHANGELOG.md for 0.3.36; the sdist has
# no git metadata, so the build number is unknown and we set it to 0 and inject
# the commit via -DLLAMA_BUILD_COMMIT).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_COMMIT=0c1e57098
JOBS="${JOBS:-2}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache/llama.cpp"
SRC_PARENT="$CACHE/src"
SRC="$SRC_PARENT/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
BUILD="$CACHE/build-$LLAMA_CPP_PYTHON_VERSION"
BIN="$BUILD/bin"
GREEDY_SRC="$ROOT/scripts/llamacpp-greedy/greedy.cpp"

log() { echo "[build-llamacpp] $*" >&2; }

# 1. toolchain
if ! command -v cmake >/dev/null 2>&1; then
    log "cmake not found; installing with apt"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update >&2
    $SUDO apt-get install -y cmake >&2
fi
for t in c++ cc make; do
    command -v "$t" >/dev/null 2>&1 || { log "missing '$t' (install build-essential)"; exit 1; }
done
PIP=(python3 -m pip)
"${PIP[@]}" --version >/dev/null 2>&1 || PIP=(pip)

# 2. source
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    log "fetching llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    "${PIP[@]}" download --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$TMP" >&2
    SDIST="$(ls "$TMP"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz)"
    mkdir -p "$SRC_PARENT"
    rm -rf "$SRC_PARENT/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    tar -xzf "$SDIST" -C "$SRC_PARENT" "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/CHANGELOG.md"
    [ -f "$SRC/CMakeLists.txt" ] || { log "sdist has no vendor/llama.cpp"; exit 1; }
fi

if [ "${LLAMACPP_FETCH_ONLY:-0}" = 1 ]; then
    echo "$SRC"
    exit 0
fi

# 3. configure (once per build dir; again if an older run built no server or
# kept AMX). AMX is compiled out: at this pin, with -march=native on a CPU
# that has it (Sapphire Rapids), llama-server dies of SIGILL on `tilezero`
# in an OpenMP worker (tinygemm_kernel_amx) during its warm-up, though the
# process holds the AMX permission. -U drops the macros -march=native
# defines, which is what turns ggml's AMX kernels on.
NO_AMX="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
if [ ! -f "$BUILD/CMakeCache.txt" ] \
   || ! grep -q '^LLAMA_BUILD_SERVER:BOOL=ON' "$BUILD/CMakeCache.txt" \
   || ! grep -qxF "CMAKE_CXX_FLAGS:STRING=$NO_AMX" "$BUILD/CMakeCache.txt"; then
    log "configuring in $BUILD"
    cmake -S "$SRC" -B "$BUILD" \
        -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENCL=OFF \
        -DGGML_BACKEND_DL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_COMMON=ON \
        -DLLAMA_BUILD_NUMBER=0 \
        -DLLAMA_BUILD_COMMIT="$LLAMA_CPP_COMMIT" >&2
fi

# 4. build only the needed targets
log "building llama llama-bench llama-batched-bench llama-simple llama-tokenize llama-server llama-quantize (-j$JOBS)"
cmake --build "$BUILD" --config Release -j "$JOBS" \
    --target llama llama-bench llama-batched-bench llama-simple llama-tokenize llama-server llama-quantize >&2

# 5. the greedy reference tool, linked statically against libllama + ggml
GREEDY_BIN="$BIN/llamacpp-greedy"
if [ ! -x "$GREEDY_BIN" ] || [ "$GREEDY_SRC" -nt "$GREEDY_BIN" ] \
   || [ "$(find "$BUILD" -name 'libllama.a' -newer "$GREEDY_BIN" | head -1)" != "" ]; then
    log "building $GREEDY_BIN"
    LIBLLAMA="$(find "$BUILD" -name libllama.a | head -1)"
    LIBGGML="$(find "$BUILD" -name libggml.a | head -1)"
    LIBGGML_CPU="$(find "$BUILD" -name libggml-cpu.a | head -1)"
    LIBGGML_BASE="$(find "$BUILD" -name libggml-base.a | head -1)"
    OMP=""
    grep -q '^GGML_OPENMP_ENABLED:INTERNAL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null && OMP="-fopenmp"
    grep -q '^OpenMP_CXX_FLAGS:STRING=-fopenmp' "$BUILD/CMakeCache.txt" 2>/dev/null && OMP="-fopenmp"
    mkdir -p "$BIN"
    c++ -std=c++17 -O2 $OMP -I"$SRC/include" -I"$SRC/ggml/include" -I"$SRC/vendor" \
        "$GREEDY_SRC" -o "$GREEDY_BIN" \
        "$LIBLLAMA" "$LIBGGML" "$LIBGGML_CPU" "$LIBGGML_BASE" \
        -lpthread -ldl -lm
fi

# 6. record what was built
cat > "$CACHE/BUILD_INFO" <<INFO
llama_cpp_python=$LLAMA_CPP_PYTHON_VERSION
llama_cpp_commit=$LLAMA_CPP_COMMIT
source=$SRC
bin=$BIN
INFO

echo "llama.cpp $LLAMA_CPP_COMMIT (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION) binaries:"
for b in llama-bench llama-simple llama-tokenize llama-server llamacpp-greedy; do
    echo "  $BIN/$b"
done
