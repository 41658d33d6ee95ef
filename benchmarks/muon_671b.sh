#!/usr/bin/env bash
# DeepSeek-V3 671B with Muon against AdamW, compiled (not run) for the plans `--fit` found:
# tpu:v5p-1024 at 6 x 8,192 tokens per chip and gpu:h100x256 at 4 x 8,192
# (benchmarks/results/steptime/fit-*-chunk-traffic.txt). Per plan and optimizer: the compiled
# peak per device and the compiled FLOPs, of which Muon's Newton-Schulz (op names under
# `newton_schulz`, planner/flops.py). Writes JSON to benchmarks/results/muon-671b/ and prints a
# table. Run on a quiet machine: four compiles of a few minutes each. On the GPU target Muon's
# Newton-Schulz multiplies in bfloat16 (muon_ns_dtype, Keller Jordan's and Moonlight's recipe):
# in float32 the deviceless GPU compiler (no autotuning) stops at "Couldn't find output tile
# sizes" for a 7168 x 7168 Gram product (gpu-h100x256-muon-float32-ns.error.txt).
set -euo pipefail
out=benchmarks/results/muon-671b
mkdir -p "$out"
tpu=(model_name=deepseek3-671b remat_policy=custom decoder_layer_input=offload out_proj=offload
  per_device_batch_size=6.0 max_target_length=8192 mu_dtype=bfloat16 nu_dtype=bfloat16
  num_vocab_tiling=16 ici_fsdp_parallelism=64 ici_expert_parallelism=8 num_moe_token_chunks=32)
gpu=(model_name=deepseek3-671b remat_policy=custom decoder_layer_input=offload out_proj=offload
  per_device_batch_size=4.0 max_target_length=8192 mu_dtype=bfloat16 nu_dtype=bfloat16
  num_vocab_tiling=4 ici_fsdp_parallelism=64 ici_expert_parallelism=4 sharding_rules=exp-fsdp
  num_moe_token_chunks=8)
for opt in adamw muon; do
  expertax memory "${tpu[@]}" opt_type=$opt --target tpu:v5p-1024 --overwrite \
    --json "$out/tpu-v5p-1024-$opt.json" | tee "$out/tpu-v5p-1024-$opt.txt"
done
expertax memory "${gpu[@]}" opt_type=adamw --target gpu:h100x256 --overwrite \
  --json "$out/gpu-h100x256-adamw.json" | tee "$out/gpu-h100x256-adamw.txt"
expertax memory "${gpu[@]}" opt_type=muon muon_ns_dtype=bfloat16 --target gpu:h100x256 \
  --overwrite --json "$out/gpu-h100x256-muon.json" | tee "$out/gpu-h100x256-muon.txt"
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| target | optimizer | peak GiB (compiled) | headroom | optimizer state GiB | "
      "compiled PFLOP | Newton-Schulz PFLOP | share |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for target in ("tpu-v5p-1024", "gpu-h100x256"):
    for opt in ("adamw", "muon"):
        r = json.loads((out / f"{target}-{opt}.json").read_text())
        peak, hbm = r["peak_device_bytes"] / 2**30, r["hbm_gib"]
        state = r["optimizer_state_bytes"] / 2**30
        total, ns = r["compiled_flops"], r.get("newton_schulz_flops") or 0
        print(f"| {target} | {opt} | {peak:.2f} | {100 * (1 - peak / hbm):.1f}% | {state:.2f} | "
              f"{total / 1e15:.2f} | {ns / 1e15:.3f} | {100 * ns / total:.2f}% |")
PY
