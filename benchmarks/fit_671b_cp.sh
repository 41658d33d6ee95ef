#!/usr/bin/env bash
# DeepSeek-V3 671B at long context: `expertax memory --fit` with the context axis searched, on
# tpu:v5p-1024 and gpu:h100x256 at max_target_length 32,768 (0.5 sequence per chip) and 131,072
# (0.25 sequence per chip), dropless, float32 master weights. Writes
# benchmarks/results/fit-cp/<target>-<T>.{json,txt} and each search's wall time to wall.txt (with
# the load average before and after). Needs the tpu and gpu extras. Run alone: the wall times
# are the figures. One case: bash benchmarks/fit_671b_cp.sh tpu-v5p-1024-131072
# An MLA context answer is compiled with both context strategies (ring, all_gather), the smaller kept.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/fit-cp
mkdir -p "$out"
run() {
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [ "$ONLY" != "$name" ]; then return; fi
  echo "$name start $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/wall.txt"
  local start; start=$(date +%s)
  expertax memory model_name=deepseek3-671b weight_dtype=float32 "$@" --fit \
    --json "$out/$name.json" > "$out/$name.txt" 2>&1 || true
  echo "$name $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/wall.txt"
}
ONLY=${1:-}
run tpu-v5p-1024-131072 per_device_batch_size=0.25 max_target_length=131072 --target tpu:v5p-1024
run gpu-h100x256-131072 per_device_batch_size=0.25 max_target_length=131072 --target gpu:h100x256
run tpu-v5p-1024-32768 per_device_batch_size=0.5 max_target_length=32768 --target tpu:v5p-1024
run gpu-h100x256-32768 per_device_batch_size=0.5 max_target_length=32768 --target gpu:h100x256
