#!/usr/bin/env bash
# The estimate (at the priors, and calibrated in each search's compile order) against the
# compiled peak for every compiled candidate of the saved DeepSeek-V3 671B searches
# (benchmarks/fit_estimates.py on each report; no compile). Run from the repository root;
# prints one markdown table per search.
set -euo pipefail
R=benchmarks/results
run() {
    PYTHONPATH=src python benchmarks/fit_estimates.py "$@" 2>/dev/null | grep "^|"
}
m="model_name=deepseek3-671b max_target_length=8192"
run $R/fit-v5p-256/search-before.json $m per_device_batch_size=4
run $R/fit-v5p-256/search.json $m per_device_batch_size=4
run $R/fit-v5p-256/search-whole-state.json $m per_device_batch_size=4
run $R/fit/tpu-v5p-1024-4x8192.json $m per_device_batch_size=4
run $R/steptime/fit-tpu-v5p-1024-6x8192-chunk-traffic.json $m per_device_batch_size=6
run $R/fit/gpu-h100x256-4x8192.json $m per_device_batch_size=4
run $R/fit/gpu-h200x128-6x8192.json $m per_device_batch_size=6
