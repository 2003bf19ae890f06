#!/usr/bin/env bash
# Regenerate the Gemma 3 llama.cpp reference data in crates/handoff-model/tests/data/:
#   gemma3_prompts.jsonl        (input; written by scripts/llamacpp-greedy/make_gemma3_inputs.py)
#   gemma3_greedy_fa_off.json   (greedy continuations + top-5 logits per step,
#                                flash attention off: plain softmax attention, KV f16)
# Model: models/gemma-3-270m-q4_k_m.gguf (scripts/fetch-gemma3.sh).
# Usage: scripts/gen-gemma3-refs.sh      (from any cwd)
# Env: N_PREDICT (32), N_THREADS (2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
N_PREDICT="${N_PREDICT:-32}"
N_THREADS="${N_THREADS:-2}"
DATA=crates/handoff-model/tests/data

scripts/fetch-gemma3.sh >/dev/null
MODEL=models/gemma-3-270m-q4_k_m.gguf
scripts/build-llamacpp.sh >/dev/null
# shellcheck disable=SC1091
. .cache/llama.cpp/BUILD_INFO
GREEDY="${bin#"$ROOT/"}/llamacpp-greedy"

python3 scripts/llamacpp-greedy/make_gemma3_inputs.py >/dev/null
git diff --quiet -- "$DATA/gemma3_prompts.jsonl" 2>/dev/null || echo "[gen-gemma3] note: input .jsonl changed" >&2

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

GEN_OFF_CMD=("$GREEDY" generate -m "$MODEL" -f "$DATA/gemma3_prompts.jsonl" -n "$N_PREDICT" -t "$N_THREADS" -c 2048 --fa off)
echo "[gen-gemma3] ${GEN_OFF_CMD[*]}" >&2
"${GEN_OFF_CMD[@]}" > "$TMP/greedy_fa_off.json"

# Exactly one BOS at the start of every prompt (raw prompts: added by
# llama_tokenize because add_bos_token=true; chat prompts: the template's
# literal `<bos>`, with add_special=false).
python3 - "$TMP/greedy_fa_off.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1], encoding="utf-8"))
bos = g["bos_id"]
for c in g["cases"]:
    ids = c["prompt_ids"]
    assert ids[0] == bos and bos not in ids[1:], f"{c['name']}: BOS count wrong: {ids[:4]}"
    print(f"[gen-gemma3] {c['name']:<20} {c['kind']:<4} {len(ids):5d} prompt tokens, "
          f"{len(c['output_ids']):2d} generated, min margin {c['min_logit_margin']:.4f}", file=sys.stderr)
PY

python3 scripts/llamacpp-greedy/finalize.py \
    --sha256 "$(sha256sum "$MODEL" | cut -d' ' -f1)" \
    --model "$MODEL" \
    --llama-cpp-commit "$llama_cpp_commit" \
    --llama-cpp-python "$llama_cpp_python" \
    --regenerate scripts/gen-gemma3-refs.sh \
    --greedy "$TMP/greedy_fa_off.json" "$DATA/gemma3_greedy_fa_off.json" "${GEN_OFF_CMD[*]}"
