#!/usr/bin/env bash
# Regenerate llama.cpp's reference outputs for the seeded test models of
# crates/handoff-testmodels: crates/handoff-model/tests/data/arch/<preset>.json
# (one per preset: llama llama3 llama-linear llama-yarn qwen2 qwen3 mistral
# gemma3), checked by crates/handoff-model/tests/arch_llamacpp.rs.
#
# For each preset: write the GGUF with `write-test-gguf` (Rust, deterministic:
# the JSON records its sha256), run the pinned llama.cpp's llamacpp-greedy on
# 4 seeded random-token prompts (16, 100, 600, 1500 tokens; given as ids),
# flash attention off, 2 threads, n_ctx 2048, 24 greedy tokens each, and wrap
# the output (finalize_arch.py). For llama3 also runs the same file without
# rope_freqs.weight and records which cases' tokens change ("ablation").
#
# Usage: scripts/gen-arch-refs.sh [PRESET...]   (from any cwd; default: all)
# Env: N_PREDICT (24), N_THREADS (2), N_CTX (2048)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
N_PREDICT="${N_PREDICT:-24}"
N_THREADS="${N_THREADS:-2}"
N_CTX="${N_CTX:-2048}"
DATA=crates/handoff-model/tests/data/arch
WORK=.cache/arch-models
PRESETS=("$@")
[ ${#PRESETS[@]} -gt 0 ] || PRESETS=(llama llama3 llama-linear llama-yarn qwen2 qwen3 mistral gemma3)

scripts/build-llamacpp.sh >/dev/null
# shellcheck disable=SC1091
. .cache/llama.cpp/BUILD_INFO
GREEDY="${bin#"$ROOT/"}/llamacpp-greedy"

cargo build --quiet -p handoff-testmodels --bin write-test-gguf
WRITER="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/write-test-gguf"

mkdir -p "$DATA" "$WORK"
PROMPTS="$WORK/prompts.jsonl"
python3 scripts/llamacpp-greedy/make_arch_inputs.py "$("$WRITER" --vocab-size)" > "$PROMPTS"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

run_greedy() {  # MODEL RAW_OUT -> prints the command
    local cmd=("$GREEDY" generate -m "$1" -f "$PROMPTS" -n "$N_PREDICT" -t "$N_THREADS" -c "$N_CTX" --fa off)
    echo "[gen-arch] ${cmd[*]}" >&2
    "${cmd[@]}" > "$2"
    echo "${cmd[*]}"
}

for p in "${PRESETS[@]}"; do
    model="$WORK/$p.gguf"
    "$WRITER" "$p" "$model"
    cmd="$(run_greedy "$model" "$TMP/$p.json")"
    extra=()
    if [ "$p" = llama3 ]; then
        "$WRITER" llama3-no-rope-freqs "$WORK/llama3-no-rope-freqs.gguf"
        acmd="$(run_greedy "$WORK/llama3-no-rope-freqs.gguf" "$TMP/llama3-no-rope-freqs.json")"
        extra=(--ablation "$TMP/llama3-no-rope-freqs.json" "llama3-no-rope-freqs (same file without rope_freqs.weight)" "$acmd")
    fi
    python3 scripts/llamacpp-greedy/finalize_arch.py \
        --raw "$TMP/$p.json" --out "$DATA/$p.json" --preset "$p" \
        --sha256 "$(sha256sum "$model" | cut -d' ' -f1)" --bytes "$(stat -c %s "$model")" \
        --command "$cmd" --write-command "write-test-gguf $p $model" \
        --llama-cpp-commit "$llama_cpp_commit" --llama-cpp-python "$llama_cpp_python" \
        --inputs "$PROMPTS" "${extra[@]}"
done
