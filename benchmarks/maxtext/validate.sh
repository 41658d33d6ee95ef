#!/usr/bin/env bash
# The step-time model against MaxText's published TPU figures: compile MaxText's own train step
# for each published recipe (MaxText 0.2.5 from PyPI, its jax 0.12.1 and libtpu 0.0.52; no TPU
# needed), predict its step time with `expertax steptime`, and compare the predicted MFU with
# the published one. Then expertax's own program for DeepSeek-V3 671B at the same batch on the
# same slice (the plan `expertax memory --fit` found). Writes the programs, reports and plots to
# $OUT (default /tmp/steptime-validation) and the JSON reports to benchmarks/results/steptime/.
#
#   bash benchmarks/maxtext/validate.sh            # about 25 minutes on a 2-core machine
set -euo pipefail
OUT=${OUT:-/tmp/steptime-validation}
MT=${MT:-$OUT/maxtext-venv}
mkdir -p "$OUT" benchmarks/results/steptime
if [ ! -x "$MT/bin/python" ]; then
  python3.12 -m venv "$MT"
  "$MT/bin/pip" install -q "maxtext[tpu]==0.2.5"
fi
compile() {  # OUT_NAME TARGET LIBTPU_FLAGS KEY=VALUE...
  local name=$1 target=$2 flags=$3
  shift 3
  JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 LIBTPU_INIT_ARGS="$flags" \
    "$MT/bin/python" benchmarks/maxtext/compile_program.py "$OUT/$name.hlo" "$target" "$@" \
    >"$OUT/$name.log" 2>&1
  expertax steptime "$OUT/$name.hlo" --json "benchmarks/results/steptime/$name.json" \
    --plot "$OUT/$name.png" --overwrite | tee "$OUT/$name.txt"
}
# Mixtral 8x7B on v5p-128: tpu-recipes training/v5p/Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh
# (published: 251.94 TFLOP/s, 54.89 % MFU, maxtext end_to_end/tpu/mixtral/Run_Mixtral.md). Its
# continuation-fusion flags are refused for v5p by today's libtpu ("not supported/recommended on
# platforms other than TPU v5e"): the others are kept.
MIX="--xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true \
--xla_tpu_enable_ag_backward_pipelining=true --xla_tpu_enable_data_parallel_all_reduce_opt=true \
--xla_tpu_data_parallel_opt_different_sized_ops=true --xla_tpu_overlap_compute_collective_tc=true \
--xla_enable_async_all_gather=true --xla_tpu_scoped_vmem_limit_kib=81920"
compile mixtral-8x7b_v5p-128 tpu:v5p-128 "$MIX" model_name=mixtral-8x7b per_device_batch_size=36 \
  max_target_length=4096 dtype=bfloat16 weight_dtype=bfloat16 attention=flash steps=10 \
  base_output_directory=/tmp/mt_out run_name=mixtral
# DeepSeek-V3 671B on v5p-1024: maxtext@3eb77db benchmarks/maxtext_v5p_model_configs.py
# deepseek3_671b_v5p_1024 and its xla_flags_library flags (published: 152.415 TFLOP/s, 542.108
# tokens/s per chip, tpu-recipes training/v5p/DeepSeek3-671B-MaxText). At 6 x 8,192 tokens per
# chip MaxText 0.2.5 with libtpu 0.0.52 is refused (97.19 G of temporaries for 95.73 G of HBM):
# compiled at 5 x 8,192, the nearest batch that fits; MFU compared (the tokens differ).
DS=$(tr -d '\n' <benchmarks/maxtext/deepseek3_671b_flags.txt)
TILES=""
for w in wi wo; do for k in fwd dlhs drhs; do
  TILES="$TILES ${w}_tile_${k}_batch_seq=512 ${w}_tile_${k}_embed_dim=1024 ${w}_tile_${k}_mlp_dim=1024"
done; done
SA=""
for k in q kv kv_compute q_dkv kv_dkv kv_dkv_compute q_dq kv_dq; do SA="$SA sa_block_$k=2048"; done
# shellcheck disable=SC2086
compile deepseek3-671b_v5p-1024_b5 tpu:v5p-1024 "$DS" model_name=deepseek3-671b \
  ici_fsdp_parallelism=-1 ici_tensor_parallelism=1 per_device_batch_size=5 max_target_length=8192 \
  dtype=bfloat16 weight_dtype=float32 megablox=True sparse_matmul=True scan_layers=True \
  use_custom_sort_vjp=True $SA remat_policy=custom decoder_layer_input=offload out_proj=offload \
  $TILES sa_use_fused_bwd_kernel=False steps=20 base_output_directory=/tmp/mt_out run_name=ds
# expertax's own program: the --fit plan for 6 x 8,192 on v5p-1024 (benchmarks/results/fit/)
# shellcheck disable=SC2046
expertax memory $(tail -1 benchmarks/results/fit/tpu-v5p-1024-6x8192.txt | sed 's/^expertax train //') \
  --target tpu:v5p-1024 --top 0 --save-program "$OUT/expertax-671b_v5p-1024_b6.hlo" \
  --json "$OUT/expertax-671b_v5p-1024_b6.memory.json" --overwrite | tee "$OUT/expertax-671b.txt"
expertax steptime "$OUT/expertax-671b_v5p-1024_b6.hlo" \
  --json benchmarks/results/steptime/expertax-671b_v5p-1024_b6.json --overwrite
