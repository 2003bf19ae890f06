#!/usr/bin/env bash
# Benchmark llama.cpp (pinned build from scripts/build-llamacpp.sh) on
# SmolLM2-135M-Instruct Q4_1 with llama-bench:
#   pp128, pp512 (prompt processing) and tg64 (generation), 2 threads, 3 reps.
# Prints llama-bench's JSON (an array with one object per test, fields such as
# n_prompt, n_gen, n_threads, avg_ts, stddev_ts, samples_ts, build_commit) on
# stdout; everything else goes to stderr.
#
# Env: THREADS (2), REPS (3), PP (128,512), TG (64),
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
PP="${PP:-128,512}"
TG="${TG:-64}"
REPACK="${REPACK:-0}"

MODEL="$(scripts/fetch-model.sh)"
scripts/build-llamacpp.sh >/dev/null
# shellcheck disable=SC1091
. .cache/llama.cpp/BUILD_INFO

echo "[bench-llamacpp] loadavg before: $(cut -d' ' -f1-3 /proc/loadavg) (nproc $(nproc)); results are only meaningful on an idle machine" >&2
"$bin/llama-bench" -m "$MODEL" -t "$THREADS" -p "$PP" -n "$TG" -r "$REPS" --repack "$REPACK" -o json "$@"
echo "[bench-llamacpp] loadavg after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
