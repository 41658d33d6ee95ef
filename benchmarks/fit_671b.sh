#!/usr/bin/env bash
# DeepSeek-V3 671B at production batch: `expertax memory --fit` on tpu:v5p-1024 (4 and 6 x 8,192
# tokens per chip, MaxText's published batch) and on gpu:h100x256 / gpu:h200x128, dropless,
# float32 master weights. Writes benchmarks/results/fit/<target>-<batch>.{json,txt} and the wall
# time of each search to wall.txt (with the load average before and after). Needs the tpu and
# gpu extras; about 10 minutes on a 2-core machine. Run alone: the wall times are the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/fit
mkdir -p "$out"
: > "$out/wall.txt"
uptime >> "$out/wall.txt"
run() {
  local name=$1; shift
  local start; start=$(date +%s)
  expertax memory model_name=deepseek3-671b "$@" --fit --json "$out/$name.json" > "$out/$name.txt" 2>&1 || true
  echo "$name $(( $(date +%s) - start )) s" >> "$out/wall.txt"
}
run tpu-v5p-1024-4x8192 per_device_batch_size=4 max_target_length=8192 --target tpu:v5p-1024
run tpu-v5p-1024-6x8192 per_device_batch_size=6 max_target_length=8192 --target tpu:v5p-1024
run gpu-h100x256-4x8192 per_device_batch_size=4 max_target_length=8192 --target gpu:h100x256
run gpu-h200x128-6x8192 per_device_batch_size=6 max_target_length=8192 --target gpu:h200x128
uptime >> "$out/wall.txt"
