#!/usr/bin/env bash
# Paged stash: stored MoE activation bytes per device with and without `moe_paged_stash`, from
# `expertax memory --json` (its `stash` entry: buffer, routed rows, worst case), for a
# deepseek3-tiny with 8 MoE layers at EP=4 and EP=8 (all-to-all and ring, 8 simulated devices),
# and for DeepSeek-V3 671B on 128 devices (the layout of BENCHMARKS.md's step 5, keeping
# moe_mlpwo). Writes JSON and reports to benchmarks/results/stash/.
set -euo pipefail
out=benchmarks/results/stash
mkdir -p "$out"
keep=(remat_policy=custom decoder_layer_input=device moe_mlpwi_0=device moe_mlpwi_1=device moe_mlpwo=device)
tiny=(model_name=deepseek3-tiny base_num_decoder_layers=9 max_target_length=256 per_device_batch_size=2)
for ep in 4 8; do
  for ring in false true; do
    name="tiny-ep$ep-ring_$ring"
    expertax memory "${tiny[@]}" "${keep[@]}" ici_expert_parallelism=$ep ici_fsdp_parallelism=$((8 / ep)) \
      use_ring_of_experts=$ring moe_paged_stash=true --devices 8 --json "$out/$name.json" > "$out/$name.txt"
  done
done
big=(model_name=deepseek3-671b ici_expert_parallelism=8 ici_fsdp_parallelism=-1 attention_impl=blockwise
     num_vocab_tiling=16 num_moe_token_chunks=8 mu_dtype=bfloat16 nu_dtype=bfloat16
     remat_policy=custom decoder_layer_input=device moe_mlpwo=device)
for stash in false true; do
  expertax memory "${big[@]}" moe_paged_stash=$stash --devices 128 --hbm 141 --top 10 \
    --json "$out/671b-stash_$stash.json" > "$out/671b-stash_$stash.txt"
done
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
gib = 2**30
print("| case | buffer | real rows | worst case | buffer / real | worst / buffer |")
print("|---|---:|---:|---:|---:|---:|")
for f in sorted(out.glob("*stash_true.json")) + sorted(out.glob("tiny-*.json")):
    s = json.loads(f.read_text())["stash"]
    b, r, w = s["buffer_bytes"], s["routed_bytes"], s["worst_case_bytes"]
    unit, div = ("GiB", gib) if b > gib / 8 else ("MiB", 2**20)
    print(f"| {f.stem} | {b/div:.2f} {unit} | {r/div:.2f} {unit} | {w/div:.2f} {unit} | {b/r:.3f} | {w/b:.2f} |")
for stash in ("false", "true"):
    r = json.loads((out / f"671b-stash_{stash}.json").read_text())
    print(f"671b stash={stash}: peak {r['peak_device_bytes']/gib:.2f} GiB, "
          f"residuals device {r['residual_bytes_device']/gib:.2f} GiB")
PY
