#!/usr/bin/env bash
# DeepSeek-V3 671B on 128 simulated devices x 141 GiB (expert=8, fsdp=16): the compiled peak per
# device after each memory lever, cumulative, with the top buffers at XLA's peak; then the layout
# `expertax memory --fit` finds for 128 x 141 GiB and 256 x 80 GiB. Writes JSON and the reports
# to benchmarks/results/memory-671b/. Run on a quiet machine (the --fit wall times are reported).
set -euo pipefail
out=benchmarks/results/memory-671b
mkdir -p "$out"
base=(model_name=deepseek3-671b ici_expert_parallelism=8 ici_fsdp_parallelism=-1)
steps=(
  "1-sharded attention_impl=dot num_vocab_tiling=1 num_moe_token_chunks=1"
  "2-blockwise attention_impl=blockwise num_vocab_tiling=1 num_moe_token_chunks=1"
  "3-vocab-tiling attention_impl=blockwise num_vocab_tiling=16 num_moe_token_chunks=1"
  "4-token-chunks attention_impl=blockwise num_vocab_tiling=16 num_moe_token_chunks=8"
  "5-bf16-moments attention_impl=blockwise num_vocab_tiling=16 num_moe_token_chunks=8 mu_dtype=bfloat16 nu_dtype=bfloat16"
)
for step in "${steps[@]}"; do
  read -r name keys <<<"$step"
  # shellcheck disable=SC2086
  expertax memory "${base[@]}" $keys --devices 128 --hbm 141 --top 15 \
    --json "$out/$name.json" | tee "$out/$name.txt"
done
for budget in "128 141" "256 80"; do
  read -r n hbm <<<"$budget"
  start=$(date +%s)
  expertax memory model_name=deepseek3-671b --fit --devices "$n" --hbm "$hbm" \
    --json "$out/fit-$n-$hbm.json" 2> >(tee "$out/fit-$n-$hbm.progress" >&2) \
    | tee "$out/fit-$n-$hbm.txt" || true
  echo "wall seconds: $(( $(date +%s) - start ))" | tee -a "$out/fit-$n-$hbm.txt"
done
