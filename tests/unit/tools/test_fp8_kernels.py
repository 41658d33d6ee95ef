"""Which kernel runs each fp8 product of a compiled step (fp8/compiled.py): the op-name
scopes read back, and a whole deepseek3-tiny step compiled for `gpu:h100x8` whose routed and
dense fprops and dgrads are the Hopper kernel's Mosaic GPU calls."""

import pytest

from expertax import targets
from expertax.fp8 import compiled as fp8_kernels
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer


def _line(target: str, op: str) -> str:
    call = f'custom_call_target="{target}"'
    return f'  %c = bf16[8,8] custom-call(%a), {call}, metadata={{op_name="{op}"}}'


def test_scopes_and_targets_read_back():
    text = "\n".join(
        [
            _line("mosaic_gpu_v2", "jit(f)/jvp()/moe/shard_map/fp8_gmm_fprop/mpmd_map"),
            _line("mosaic_gpu_v2", "jit(f)/transpose(jvp())/moe/fp8_dgrad/shard_map/mpmd_map"),
            _line("__cublas$lt$matmul", "jit(f)/transpose(jvp())/fp8_wgrad/dot_general"),
            _line("__cublas$lt$matmul$f8", "jit(f)/jvp()/fp8_fprop/dot_general"),
            _line("__gpu$xla.gpu.triton", "jit(f)/transpose(jvp())/moe/fp8_gmm_wgrad/x"),
            _line("__cublas$lt$matmul", "jit(f)/jvp()/nd,de->ne/dot_general"),
            _line("__cudnn$fmhaScaleBiasSoftmax", "jit(f)/jvp()/fp8_fprop/attention"),
        ]
    )
    assert fp8_kernels.by_product(text) == {
        ("routed experts fprop", "mosaic_gpu_fp8"): 1,
        ("shared experts dgrad", "mosaic_gpu_fp8"): 1,
        ("dense linears wgrad", "cublas_bf16"): 1,
        ("dense linears fprop", "cublaslt_fp8"): 1,
        ("routed experts wgrad", "triton"): 1,
        ("other", "cublas_bf16"): 1,
    }  # the cuDNN attention call is no GEMM


# 115-200 s on 2 cores (the whole step, Mosaic GPU's kernels and ptxas): CI's extended run (the
# default run holds the kernels' own compile tests, test_fp8_hopper*.py and test_fp8_gemm.py;
# which kernel each product of a compiled step takes is checked only here)
@pytest.mark.extended
@pytest.mark.skipif(not targets.compiler_available("gpu"), reason="expertax[gpu] is missing")
def test_the_h100_step_runs_the_fp8_products_on_the_hopper_kernels():
    """`quantization=fp8_blockwise`, `gmm_impl=auto`, gpu:h100x8: the routed experts' fprop,
    dgrad and wgrad, and the dense linears' (MLA projections, wkv_a's 448 columns in 64-wide
    tiles among them, the dense MLP, the shared expert), are Mosaic GPU calls: no GEMM of the
    recipe's on cuBLAS."""
    devices = targets.parse_target("gpu:h100x8").devices()
    keys = {
        "model_name": "deepseek3-tiny",
        "quantization": "fp8_blockwise",
        "dtype": "bfloat16",
        "max_target_length": 256,
        **fp8_kernels.HOPPER_DIMS,
    }
    trainer = build_trainer(load_config(overrides=keys), devices)
    assert "fp8_hopper kernel" in trainer.fp8_experts
    counts = fp8_kernels.by_product(trainer.compile().as_text())
    kernels: dict[str, set] = {}
    for product, kernel in counts:
        kernels.setdefault(product, set()).add(kernel)
    for who in ("routed experts", "shared experts"):
        for what in ("fprop", "dgrad", "wgrad"):
            assert kernels[f"{who} {what}"] == {"mosaic_gpu_fp8"}, (who, what, counts)
    for what in ("fprop", "dgrad", "wgrad"):
        assert counts[(f"dense linears {what}", "mosaic_gpu_fp8")] >= 10, what  # 5 MLA + MLP
        assert kernels[f"dense linears {what}"] == {"mosaic_gpu_fp8"}, (what, counts)
