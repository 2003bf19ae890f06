#!/usr/bin/env bash
# EleutherAI's lm-eval (`local-completions`, PyPI lm-eval[api]) scores the
# multiple-choice task in this directory through `handoff serve`'s
# /v1/completions (echo + logprobs, batched prompts); check.py then
# recomputes every loglikelihood and greedy flag through handoff's own
# /generate (input_token_logprobs) and requires them equal, and the
# accuracy above chance. Extra arguments go to `handoff serve`.
#   HANDOFF_BIN    the binary (default: target/release/handoff, built if missing)
#   HANDOFF_MODEL  the GGUF (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   LMEVAL_VENV    a venv with requirements.txt (default: .venv-lmeval, made if missing)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="${HANDOFF_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/handoff}"
[ -x "$BIN" ] || cargo build --release -p handoff
MODEL="${HANDOFF_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
VENV="${LMEVAL_VENV:-$ROOT/.venv-lmeval}"
if [ ! -x "$VENV/bin/lm_eval" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -r tests/lmeval/requirements.txt
fi
WORK="$(mktemp -d)"
# lm-eval counts tokens with a Hugging Face tokenizer: the model's own,
# written from the GGUF by handoff's tokenizer (no download). Built as
# `cargo test --workspace` builds it (the same features: nothing rebuilt
# after the test step).
cargo build -q --workspace --examples
"${CARGO_TARGET_DIR:-$ROOT/target}/debug/examples/tokenizer_json" "$MODEL" "$WORK/tokenizer"
ON_EXIT='rm -rf "$WORK"'
. tests/serve_on_free_port.sh
serve_on_free_port "$BIN" "$VENV/bin/python" --model "$MODEL" "$@"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$VENV/bin/lm_eval" \
    --model local-completions \
    --model_args "model=handoff,base_url=$URL/v1/completions,tokenizer=$WORK/tokenizer,tokenizer_backend=huggingface,num_concurrent=2,max_retries=1" \
    --tasks handoff_mc --include_path tests/lmeval \
    --batch_size 4 --log_samples --output_path "$WORK/out"
"$VENV/bin/python" tests/lmeval/check.py "$URL" "$WORK/out"
