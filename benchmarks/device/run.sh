#!/usr/bin/env bash
# On the GPU machine (no network): install the carried wheels beside the image's packages, then
# run the check; its results go to $OUT (or ./device-check). Arguments pass to check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
site=/tmp/expertax-device-site
rm -rf "$site"
python -m pip install --quiet --no-index --no-deps --target "$site" benchmarks/device/wheels/*.whl
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
exec python benchmarks/device/check.py --out "${OUT:-device-check}" "$@"
