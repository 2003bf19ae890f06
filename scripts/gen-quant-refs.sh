#!/usr/bin/env bash
# Reference outputs of the pinned llama.cpp for one seeded test model in every
# quant type llama-quantize makes that handoff loads:
# crates/handoff-model/tests/data/quant/<type>.json, checked by
# crates/handoff-model/tests/arch_llamacpp.rs (quant_* tests).
#
# For each type: `llama-quantize --pure` turns the F32 file of the model into
# that type (every matrix and the embedding table; no imatrix), and
# llamacpp-greedy runs it (2 prompts, 16 greedy tokens each, flash attention
# off). The JSON records the sha256 of the quantized file's tensor data
# (names and bytes, `tensor_data_sha256`). Where handoff-testmodels' writer
# (`write-test-gguf llama OUT --set types=TYPE` with the same knobs) makes the
# same tensor data, the test writes the file itself and checks that hash; where
# it does not (the writer quantizes through candle, whose K-quant quantizers
# are not this llama.cpp's), llama-quantize's file is kept beside the JSON
# (llama-<type>.gguf, a few hundred KB each) and the test reads it.
#
# Usage: scripts/gen-quant-refs.sh [TYPE...]   (default: all)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DATA=crates/handoff-model/tests/data/quant
WORK=.cache/quant-models
KNOBS=(--set layers=1 --set ffn=256)
TYPES=("$@")
[ ${#TYPES[@]} -gt 0 ] || TYPES=(q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k)

scripts/build-llamacpp.sh >/dev/null
# shellcheck disable=SC1091
. .cache/llama.cpp/BUILD_INFO
GREEDY="${bin#"$ROOT/"}/llamacpp-greedy"
QUANTIZE="${bin#"$ROOT/"}/llama-quantize"
GGUF_PY="$source/gguf-py"

cargo build --quiet -p handoff-testmodels --bin write-test-gguf
WRITER="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/write-test-gguf"

mkdir -p "$DATA" "$WORK"
PROMPTS="$WORK/prompts.jsonl"
python3 scripts/llamacpp-greedy/make_arch_inputs.py "$("$WRITER" --vocab-size)" > "$WORK/all-prompts.jsonl"
head -n 2 "$WORK/all-prompts.jsonl" > "$PROMPTS"   # the 16- and 100-token prompts
"$WRITER" llama "$WORK/f32.gguf" "${KNOBS[@]}" --set types=f32

for t in "${TYPES[@]}"; do
    up="$(echo "$t" | tr a-z A-Z)"
    lq="$WORK/llama-$t.gguf"
    ours="$WORK/ours-$t.gguf"
    "$QUANTIZE" --pure "$WORK/f32.gguf" "$lq" "$up" 2 >"$WORK/quantize-$t.log" 2>&1
    "$WRITER" llama "$ours" "${KNOBS[@]}" --set "types=$t"
    want="$(PYTHONPATH="$GGUF_PY" python3 scripts/llamacpp-greedy/tensor_data_sha.py "$lq")"
    have="$(PYTHONPATH="$GGUF_PY" python3 scripts/llamacpp-greedy/tensor_data_sha.py "$ours")"
    rm -f "$DATA/llama-$t.gguf"
    if [ "$want" = "$have" ]; then
        source_note="write-test-gguf llama OUT ${KNOBS[*]} --set types=$t (tensor data identical to llama-quantize's)"
    else
        cp "$lq" "$DATA/llama-$t.gguf"
        source_note="llama-$t.gguf, kept: write-test-gguf's tensor data differs"
    fi
    cmd=("$GREEDY" generate -m "$lq" -f "$PROMPTS" -n 16 -t 2 -c 512 --fa off)
    echo "[gen-quant] ${cmd[*]}" >&2
    "${cmd[@]}" > "$WORK/raw-$t.json"
    python3 scripts/llamacpp-greedy/finalize_arch.py \
        --raw "$WORK/raw-$t.json" --out "$DATA/$t.json" --preset "llama ${KNOBS[*]} types=$t" \
        --sha256 "$(sha256sum "$lq" | cut -d' ' -f1)" --bytes "$(stat -c %s "$lq")" \
        --command "${cmd[*]}" \
        --write-command "$QUANTIZE --pure f32.gguf llama-$t.gguf $up 2 (f32.gguf: write-test-gguf llama f32.gguf ${KNOBS[*]} --set types=f32)" \
        --llama-cpp-commit "$llama_cpp_commit" --llama-cpp-python "$llama_cpp_python" \
        --inputs "$PROMPTS"
    python3 - "$DATA/$t.json" "$want" "$source_note" <<'PY'
import json, sys
path, sha, note = sys.argv[1:]
d = json.load(open(path))
d["model"]["writer"] = "the pinned llama.cpp's llama-quantize --pure (write_command)"
d["model"]["tensor_data_sha256"] = sha
d["model"]["test_file"] = note
d["regenerate"] = "scripts/gen-quant-refs.sh"
sys.path.insert(0, "scripts/llamacpp-greedy")
from finalize import dump
open(path, "w").write(dump(d) + "\n")
PY
    echo "[gen-quant] $t: $source_note" >&2
done
