#!/usr/bin/env bash
# Regenerate the llama.cpp reference data in crates/handoff-model/tests/data/:
#   llamacpp_greedy.json         (greedy continuations, from llamacpp_prompts.jsonl;
#                                 llama.cpp defaults: flash attention "auto" = on for CPU)
#   llamacpp_greedy_fa_off.json  (same, flash attention off: plain softmax attention)
#   llamacpp_tokenize.json  (tokenizer ids, from llamacpp_tokenize_inputs.jsonl)
# Usage: scripts/gen-llamacpp-refs.sh      (from any cwd)
# Env: N_PREDICT (48), N_THREADS (2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
N_PREDICT="${N_PREDICT:-48}"
N_THREADS="${N_THREADS:-2}"
DATA=crates/handoff-model/tests/data

scripts/fetch-model.sh >/dev/null
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
scripts/build-llamacpp.sh >/dev/null
# shellcheck disable=SC1091
. .cache/llama.cpp/BUILD_INFO
GREEDY="${bin#"$ROOT/"}/llamacpp-greedy"

python3 scripts/llamacpp-greedy/make_inputs.py >/dev/null
git diff --quiet -- "$DATA"/*.jsonl 2>/dev/null || echo "[gen] note: input .jsonl files changed" >&2

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

GEN_CMD=("$GREEDY" generate -m "$MODEL" -f "$DATA/llamacpp_prompts.jsonl" -n "$N_PREDICT" -t "$N_THREADS" -c 2048 --fa auto)
GEN_OFF_CMD=("$GREEDY" generate -m "$MODEL" -f "$DATA/llamacpp_prompts.jsonl" -n "$N_PREDICT" -t "$N_THREADS" -c 2048 --fa off)
TOK_CMD=("$GREEDY" tokenize -m "$MODEL" -f "$DATA/llamacpp_tokenize_inputs.jsonl")
echo "[gen] ${GEN_CMD[*]}" >&2
"${GEN_CMD[@]}" > "$TMP/greedy.json"
echo "[gen] ${GEN_OFF_CMD[*]}" >&2
"${GEN_OFF_CMD[@]}" > "$TMP/greedy_fa_off.json"
echo "[gen] ${TOK_CMD[*]}" >&2
"${TOK_CMD[@]}" > "$TMP/tokenize.json"

python3 scripts/llamacpp-greedy/finalize.py \
    --sha256 "$(sha256sum "$MODEL" | cut -d' ' -f1)" \
    --model "$MODEL" \
    --llama-cpp-commit "$llama_cpp_commit" \
    --llama-cpp-python "$llama_cpp_python" \
    --greedy "$TMP/greedy.json" "$DATA/llamacpp_greedy.json" "${GEN_CMD[*]}" \
    --greedy "$TMP/greedy_fa_off.json" "$DATA/llamacpp_greedy_fa_off.json" "${GEN_OFF_CMD[*]}" \
    --tokenize "$TMP/tokenize.json" "$DATA/llamacpp_tokenize.json" "${TOK_CMD[*]}"
