#!/usr/bin/env bash
# Benchmark llama.cpp (pinned build from scripts/build-llamacpp.sh) on
# SmolLM2-135M-Instruct Q4_1 with llama-bench:
#   pp128, pp512 (prompt processing) and tg64 (generation), 2 threads, 3 reps.
# Prints llama-bench's JSON (an array with one object per test, fields such as
# n_prompt, n_gen, n_threads, avg_ts, stddev_ts, samples_ts, build_commit) on
# stdout; everything else goes to stderr.
#
# With MODE=batched it runs llama-batched-bench instead: PP (32) prompt
# tokens then TG (64) generated tokens for each of NPL (1,8) parallel
# sequences, and prints its JSONL (one object per batch size, fields pl,
# speed_tg, ...): llama.cpp's batched decode on the same workload as
# `handoff bench-model`'s decode cases.
#
# Env: MODEL (SmolLM2), THREADS (2), REPS (3), PP (128,512), TG (64),
#      REPACK (0) -- 0 passes `--repack 0` (no AMX / CPU_REPACK extra buffer
#      types). This llama.cpp segfaults in ggml_backend_amx_mul_mat on AMX
#      CPUs with this Q4_1 model (cf. ggml-org/llama.cpp#20824), so AMX is off
#      by default; the reference data is generated the same way.
# Extra arguments are passed to llama-bench.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
THREADS="${THREADS:-2}"
REPS="${REPS:-3}"
if [ "${MODE:-bench}" = batched ]; then PP="${PP:-32}"; else PP="${PP:-128,512}"; fi
TG="${TG:-64}"
REPACK="${REPACK:-0}"

# MODEL: the GGUF to run (default: SmolLM2, fetched). `handoff bench-model`
# passes its own --model (before 2026-12-06 it did not, and every model was
# compared with llama.cpp on SmolLM2).
MODEL="${MODEL:-$(scripts/fetch-model.sh)}"
scripts/build-llamacpp.sh >/dev/null
# shellcheck disable=SC1091
. .cache/llama.cpp/BUILD_INFO

echo "[bench-llamacpp] loadavg before: $(cut -d' ' -f1-3 /proc/loadavg) (nproc $(nproc)); results are only meaningful on an idle machine" >&2
if [ "${MODE:-bench}" = batched ]; then
    NO_REPACK=(); [ "$REPACK" = 0 ] && NO_REPACK=(--no-repack)
    "$bin/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c 2048 -b 512 -ub 512 \
        -npp "${PP:-32}" -ntg "$TG" -npl "${NPL:-1,8}" "${NO_REPACK[@]}" \
        --output-format jsonl "$@" 2>/dev/null | grep '^{'
else
    "$bin/llama-bench" -m "$MODEL" -t "$THREADS" -p "$PP" -n "$TG" -r "$REPS" --repack "$REPACK" -o json "$@"
fi
echo "[bench-llamacpp] loadavg after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
