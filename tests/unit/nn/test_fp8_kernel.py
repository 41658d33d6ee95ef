"""Where the fp8 products run (fp8/kernel.py): Hopper's kernel on Hopper GPUs for the recipes
and shapes it takes, the dequantized products elsewhere; `gmm_impl=fp8_hopper` refused before
any compilation where it cannot run, naming the devices or the dims."""

import types

import pytest

from expertax import platform, targets
from expertax.config import ConfigError
from expertax.fp8 import kernel as fp8_kernel

HOPPER = fp8_kernel.HOPPER
H100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
A100 = types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
B200 = types.SimpleNamespace(device_kind="NVIDIA B200", compute_capability="10.0")
CPU = types.SimpleNamespace(device_kind="cpu")


def test_hopper_is_compute_capability_9():
    assert [fp8_kernel.is_hopper(d) for d in (H100, A100, B200, CPU)] == [1, 0, 0, 0]
    assert fp8_kernel.hopper("gpu", H100) and not fp8_kernel.hopper("gpu", A100)
    assert not fp8_kernel.hopper("tpu", H100)
    assert not fp8_kernel.hopper("cpu")
    with fp8_kernel.interpret():  # a CPU stands in for a Hopper GPU (tests)
        assert fp8_kernel.hopper("cpu") and not fp8_kernel.hopper("gpu", A100)


@pytest.mark.skipif(not targets.compiler_available("gpu"), reason="expertax[gpu] is missing")
@pytest.mark.parametrize("spec", ["gpu:h100x8", "gpu:h200x8"])
def test_the_hopper_targets_devices_are_hopper(spec):
    assert fp8_kernel.is_hopper(targets.parse_target(spec).devices()[0])


def test_routed_auto_takes_the_kernel_on_hopper_where_the_dims_fit():
    with platform.use("gpu", H100):
        assert fp8_kernel.routed("auto", "fp8_blockwise", 256, 128) == HOPPER
        assert fp8_kernel.routed("auto", "fp8_tensorwise", 256, 128) == HOPPER
        assert fp8_kernel.routed("auto", "fp8_blockwise", 128, 64) == HOPPER  # 64-wide tiles
        assert fp8_kernel.routed("auto", "fp8_blockwise", 128, 96) == "auto"  # F=96
        assert fp8_kernel.routed("tiled", "fp8_blockwise", 256, 128) == "tiled"  # chosen
        assert fp8_kernel.routed("auto", "", 256, 128) == "auto"  # no recipe
    with platform.use("gpu", A100):
        assert fp8_kernel.routed("auto", "fp8_blockwise", 256, 128) == "auto"
    with platform.use("tpu"):
        assert fp8_kernel.routed("auto", "fp8_blockwise", 256, 128) == "auto"


def test_dense_takes_blockwise_only_and_whole_tiles():
    with platform.use("gpu", H100):
        assert fp8_kernel.dense("fp8_blockwise", 256, 384)
        assert not fp8_kernel.dense("fp8_tensorwise", 256, 384)  # cuBLASLt's fp8 GEMM
        assert fp8_kernel.dense("fp8_blockwise", 256, 192)  # MLA's wkv_a: 128 + 64, unpadded
        assert fp8_kernel.dense("fp8_blockwise", 7168, 576)  # DeepSeek-V3's wkv_a
        assert fp8_kernel.dense("fp8_blockwise", 256, 300)  # padded to 320: 7 % more
        assert not fp8_kernel.dense("fp8_blockwise", 256, 200)  # padded to 256: 28 % more
    assert [fp8_kernel.padded(d) for d in (576, 448, 300, 64)] == [576, 448, 320, 64]
    assert not fp8_kernel.dense("fp8_blockwise", 256, 384)  # the CPU: numerics as they were


def test_routed_choice_says_why_and_refuses_an_explicit_kernel_it_cannot_run():
    choice = fp8_kernel.routed_choice
    assert choice("auto", "fp8_blockwise", "gpu", H100, 256, 128)[0] == HOPPER
    assert choice("auto", "fp8_blockwise", "gpu", H100, 128, 64)[0] == HOPPER
    backend, why = choice("auto", "fp8_blockwise", "gpu", H100, 128, 96)
    assert backend == "auto" and "F per shard=96" in why and "dequantized" in why
    backend, why = choice("auto", "fp8_blockwise", "gpu", A100, 256, 128)
    assert backend == "auto" and "A100" in why
    assert choice(HOPPER, "fp8_tensorwise", "gpu", H100, 256, 128)[0] == HOPPER
    with pytest.raises(ConfigError, match=r"gmm_impl=fp8_hopper: .*Hopper.*A100.*gmm_impl=auto"):
        choice(HOPPER, "fp8_blockwise", "gpu", A100, 256, 128)
    with pytest.raises(ConfigError, match=r"gmm_impl=fp8_hopper: .*not on the tpu devices"):
        choice(HOPPER, "fp8_blockwise", "tpu", None, 256, 128)
    with pytest.raises(ConfigError, match=r"not on the cpu devices"):
        choice(HOPPER, "fp8_blockwise", "cpu", CPU, 256, 128)
    with pytest.raises(ConfigError, match=r"base_emb_dim=256\) and MLP dim per shard \(F=96\)"):
        choice(HOPPER, "fp8_blockwise", "gpu", H100, 256, 96)
    with fp8_kernel.interpret():
        assert choice(HOPPER, "fp8_blockwise", "cpu", CPU, 256, 128)[0] == HOPPER
