"""`planner.comm`: the fit search's estimate of a layout's collectives on a target's links:
what each mesh axis moves and how long its span of the torus or the GPU nodes takes."""

from __future__ import annotations

import pytest

from expertax import targets
from expertax.planner import comm
from expertax.preflight import load_config

needs_tpu = pytest.mark.skipif(
    not targets.compiler_available("tpu"), reason="the TPU compiler (expertax[tpu]) is missing"
)
needs_gpu = pytest.mark.skipif(
    not targets.compiler_available("gpu"), reason="the GPU compiler (expertax[gpu]) is missing"
)
DSV3 = {"model_name": "deepseek3-671b", "per_device_batch_size": 6, "max_target_length": 8192}


def test_each_axis_moves_what_the_layout_exchanges():
    c = load_config(overrides=DSV3)
    dense, experts = comm.weights(c)
    assert 600e9 < dense + experts < 700e9  # DeepSeek-V3: 671B, MTP aside
    moves = comm.axis_bytes(c, {"fsdp": 32, "expert": 16}, recompute_share=0.5)
    assert set(moves) == {"fsdp", "expert"}
    (_, gathered), (_, scattered) = moves["fsdp"]
    assert gathered == pytest.approx(2 * 2 * (dense + experts / 16))  # bf16, forward + backward
    (_, routed) = moves["expert"][0]
    rows = 6 * 8192 * c.num_experts_per_tok * c.base_emb_dim * 2
    assert routed == pytest.approx(2 * (1 + 2 + 1) * rows * c.num_moe_layers)
    assert comm.axis_bytes(c, {"fsdp": 512}, 0.5).keys() == {"fsdp"}
    assert comm.estimate(c, {"fsdp": 8}, [], None, 0.0) is None  # the CPU: nothing to time


@needs_tpu
def test_a_wide_expert_axis_costs_more_than_fsdp_on_the_torus():
    """DeepSeek-V3 at 6 x 8,192 tokens per chip on v5p-1024: every routed row crossing 256
    chips of the torus takes longer than gathering the weights over all 512 (why MaxText's
    TPU recipes run pure FSDP)."""
    c = load_config(overrides=DSV3)
    t = targets.parse_target("tpu:v5p-1024")
    devices = t.devices()
    wide = comm.estimate(c, {"expert": 256, "fsdp": 2}, devices, t, 0.5)
    narrow = comm.estimate(c, {"expert": 16, "fsdp": 32}, devices, t, 0.5)
    fsdp = comm.estimate(c, {"fsdp": 512}, devices, t, 0.5)
    assert wide.by_axis["expert"] > narrow.by_axis["expert"] > 0
    assert fsdp.seconds < narrow.seconds < wide.seconds
    assert set(fsdp.by_axis) == {"fsdp"}


@needs_gpu
def test_an_expert_axis_inside_a_node_is_cheaper_than_across_nodes():
    c = load_config(overrides=DSV3)
    t = targets.parse_target("gpu:h100x256")
    devices = t.devices()
    inside = comm.estimate(c, {"expert": 8, "fsdp": 32}, devices, t, 0.5)
    across = comm.estimate(c, {"expert": 64, "fsdp": 4}, devices, t, 0.5)
    assert inside.by_axis["expert"] < across.by_axis["expert"]
