"""The paged stash under expert parallelism (8 simulated devices): gradients bitwise those of the
plain stack for the all-to-all and the ring at EP=2/4/8 with FSDP, balanced and skewed routing,
with layers that overflow, with sliding and full attention layers; a run with the stash resumes
bitwise.

The grid covers every pair of (strategy, mesh, routing) values (`CASES`). The default run keeps
one case, the extended run some layers overflowing under the all-to-all; the rest (the grid's
other cases, the fp8 stash, the fused routed FFN and the layer kinds under EP, every layer
overflowing on the ring, the resume) runs on demand (`-m full_grid`), each naming the default
or extended tests that cover it (`covered_by`; tests/unit/nn/moe/test_stash.py holds the same
stash code without EP).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params
from expertax.preflight import load_config
from expertax.train.loop import train
from tests.sharded import on_mesh
from tests.unit.models.test_decoder import lm_batch
from tests.unit.nn.moe.test_stash import (
    SAVE_MOE,
    SMALL,
    STASH_SIZES,
    assert_bitwise,
    loss_grads_stats,
)
from tests.unit.train.test_resume import assert_bitwise_equal

pytestmark = pytest.mark.distributed

MESHES = {
    "ep2-fsdp2-data2": {
        "ici_expert_parallelism": 2,
        "ici_fsdp_parallelism": 2,
        "ici_data_parallelism": 2,
    },
    "ep4-fsdp2": {"ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2},
    "ep8": {"ici_expert_parallelism": 8, "ici_fsdp_parallelism": 1},
}
DEFAULT = {("mixtral-tiny", "a2a", "ep4-fsdp2", "balanced")}
# The grid of (strategy, mesh, routing) pairwise: mixtral-tiny runs each strategy on each mesh
# (a compile each), the routing alternating so that every strategy and every mesh meets both
# routings (a second routing on the same compile would cost little but add no code path);
# deepseek3-tiny (shared experts, a dense first layer, group-limited sigmoid routing: the same
# stash code, three times the compile) runs the all-to-all on the mesh with every axis, skewed.
# Its ring runs under the stash in the overflow and fused-FFN tests below.
CASES = [
    ("mixtral-tiny", "a2a", "ep4-fsdp2", "balanced"),
    ("mixtral-tiny", "ring", "ep4-fsdp2", "skewed"),
    ("mixtral-tiny", "a2a", "ep2-fsdp2-data2", "balanced"),
    ("mixtral-tiny", "ring", "ep2-fsdp2-data2", "skewed"),
    ("mixtral-tiny", "a2a", "ep8", "skewed"),
    ("mixtral-tiny", "ring", "ep8", "balanced"),
    ("deepseek3-tiny", "a2a", "ep2-fsdp2-data2", "skewed"),
]


def skewed(p):
    """Router weights that send most rows to the first experts (a hot expert shard)."""
    moe = p.moe_layers.moe
    router = dataclasses.replace(moe.router, w=moe.router.w.at[..., :2].multiply(8.0))
    moe = dataclasses.replace(moe, router=router)
    return dataclasses.replace(p, moe_layers=dataclasses.replace(p.moe_layers, moe=moe))


def compare(model, strategy, mesh, routing, **extra):
    base = {
        "model_name": model,
        **SMALL,
        **SAVE_MOE,
        **MESHES[mesh],
        "use_ring_of_experts": strategy == "ring",
        **extra,
    }
    plain = load_config(overrides={k: v for k, v in base.items() if k not in STASH_SIZES})
    stashed = load_config(overrides={**base, "moe_paged_stash": True})
    one = load_config(overrides={"model_name": model, **SMALL})
    p = init_params(one)
    if routing == "skewed":
        p = skewed(p)
    batch = lm_batch(one, 8)
    (l0, g0, _), _ = on_mesh(plain, p, batch, loss_grads_stats)
    (l1, g1, s1), _ = on_mesh(stashed, p, batch, loss_grads_stats)
    assert float(l0) == float(l1)
    assert_bitwise(g0, g1)
    return np.asarray(s1.stash_overflow), np.asarray(s1.stash_factor)


# The grid's other cases (deepseek3-tiny's skewed routing among them) run on demand
# (-m full_grid), each naming the CI tests that cover it. The default case covers them (the
# same stash write and read in the all-to-all's receive buffer); the ring passes the same stash
# to the same routed FFN (its EP numerics: test_ep_routed.py's default case), deepseek's layers
# are stashed on one device in the default run.
_HERE = "tests/distributed/test_stash.py::"
_GRID_DEFAULT = (
    f"{_HERE}test_stash_gradients_bitwise_under_expert_parallelism"
    "[mixtral-tiny-a2a-ep4-fsdp2-balanced]"
)
_RING_EP = (
    "tests/distributed/test_ep_routed.py::"
    "test_routed_paths_equal_the_argsort_paths[ring-ep8-all-to-experts-0-3]"
)
_UNIT = "tests/unit/nn/moe/test_stash.py::"
_DEEPSEEK_ONE_DEVICE = (
    f"{_UNIT}test_stash_gradients_are_bitwise_the_plain_stacks[deepseek3-tiny-fused]"
)
_FP8_ONE_DEVICE = (
    f"{_UNIT}test_fp8_stash_holds_e4m3_and_its_gradients_are_bitwise_the_plain_fp8_stack"
    "[fp8_blockwise]"
)


def _grid_cover(model, strategy):
    ids = [_GRID_DEFAULT]
    if strategy == "ring":
        ids.append(_RING_EP)
    if model == "deepseek3-tiny":
        ids.append(_DEEPSEEK_ONE_DEVICE)
    return pytest.mark.covered_by(*ids)


def _cases():
    for case in CASES:
        if case in DEFAULT:
            marks = ()
        else:
            marks = (pytest.mark.full_grid, _grid_cover(*case[:2]))
        yield pytest.param(*case, marks=marks, id="-".join(case))


@pytest.mark.parametrize("model, strategy, mesh, routing", list(_cases()))
@pytest.mark.default_codegen
def test_stash_gradients_bitwise_under_expert_parallelism(model, strategy, mesh, routing):
    # a factor of 8 holds the worst case (a device receives at most EP x its own rows)
    over, factor = compare(model, strategy, mesh, routing, moe_paged_stash_capacity_factor=8.0)
    assert over.sum() == 0
    assert factor[-1] > 0


# on demand (about a minute each): test_stash.py has one device's fp8 case (the same encoding)
@pytest.mark.full_grid
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("a2a", marks=pytest.mark.covered_by(_FP8_ONE_DEVICE, _GRID_DEFAULT)),
        pytest.param(
            "ring", marks=pytest.mark.covered_by(_FP8_ONE_DEVICE, _GRID_DEFAULT, _RING_EP)
        ),
    ],
)
def test_fp8_stash_gradients_bitwise_under_expert_parallelism(strategy):
    """The e4m3 gate and up with their scales (fp8_blockwise) in each device's buffer, rows of
    the all-to-all's receive buffer or the ring's compacted rows, skewed routing."""
    over, _ = compare(
        "mixtral-tiny", strategy, "ep4-fsdp2", "skewed",
        quantization="fp8_blockwise", moe_paged_stash_capacity_factor=8.0,
    )  # fmt: skip
    assert over.sum() == 0


# on demand: tests/unit/models/test_layer_pattern.py has it on one device, the overflow under EP
# is extended
@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/unit/models/test_layer_pattern.py::"
    "test_stashed_stack_gives_the_plain_stacks_loss_and_gradients[ragged_dot]",
    f"{_HERE}test_overflowing_layers_under_expert_parallelism[a2a-0.6-some]",
)
def test_stash_with_sliding_and_full_layers_under_expert_parallelism():
    """Each layer kind's block in the stashed scan and its backward (`attention_layer_pattern`),
    the last layers overflowing."""
    over, _ = compare(
        "mixtral-tiny",
        "a2a",
        "ep4-fsdp2",
        "skewed",
        attention_layer_pattern="sliding,full",
        sliding_window_size=5,
        moe_paged_stash_capacity_factor=0.6,
    )
    assert 0 < over.sum() < len(over)


@pytest.mark.parametrize(
    "strategy, factor, overflowing",
    [
        # each strategy and each factor once (tests/unit/nn/moe/test_stash.py overflows
        # every layer and some without expert parallelism); the all-to-all's case is extended
        # (the decision over every device's `fits` and the recompute under EP run nowhere
        # else), the ring's on demand
        pytest.param("a2a", 0.6, "some", marks=pytest.mark.extended),
        pytest.param(
            "ring",
            0.01,
            "all",
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    f"{_HERE}test_overflowing_layers_under_expert_parallelism[a2a-0.6-some]",
                    f"{_UNIT}test_layers_that_overflow_are_recomputed_exactly[0.6-some]",
                    _RING_EP,
                ),
            ],
        ),
    ],
)
def test_overflowing_layers_under_expert_parallelism(strategy, factor, overflowing):
    over, _ = compare(
        "deepseek3-tiny",
        strategy,
        "ep4-fsdp2",
        "balanced",
        moe_paged_stash_capacity_factor=factor,
    )
    if overflowing == "all":
        assert over.sum() == len(over)
    else:
        assert 0 < over.sum() < len(over)


# on demand: ~110 s on 2 cores; the stash adds no train state, and the default run resumes
# train() bitwise and stashes bitwise under EP
@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/unit/train/test_resume.py::test_stop_and_resume_is_bitwise_an_uninterrupted_run",
    _GRID_DEFAULT,
)
def test_a_stash_run_resumes_bitwise_and_trains_like_the_plain_one(tmp_path):
    base = {
        "model_name": "deepseek3-tiny",
        **SMALL,
        **SAVE_MOE,
        **MESHES["ep4-fsdp2"],
        "steps": 6,
        "checkpoint_period": 3,
        "base_output_directory": str(tmp_path),
        "enable_tensorboard": False,
    }
    quiet = dict(echo=lambda *_: None)
    stash = {**base, "moe_paged_stash": True}
    plain = train(load_config(overrides={**base, "run_name": "plain"}), **quiet)
    straight = train(load_config(overrides={**stash, "run_name": "straight"}), **quiet)
    train(load_config(overrides={**stash, "run_name": "resumed"}), stop_after_step=3, **quiet)
    resumed = train(load_config(overrides={**stash, "run_name": "resumed"}), **quiet)
    assert resumed["resumed_from"] == 3
    assert_bitwise_equal(resumed["state"], straight["state"])
    assert_bitwise_equal(straight["state"], plain["state"])
    assert not np.array_equal(
        np.asarray(jax.device_get(straight["state"].params.embed)),
        np.asarray(jnp.zeros_like(straight["state"].params.embed)),
    )


# on demand (CI's budget: the default run's stash-under-EP case above runs the all-to-all; the
# fused FFN with the stash runs on one device in the default run)
@pytest.mark.full_grid
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("a2a", marks=pytest.mark.covered_by(_DEEPSEEK_ONE_DEVICE, _GRID_DEFAULT)),
        pytest.param(
            "ring", marks=pytest.mark.covered_by(_DEEPSEEK_ONE_DEVICE, _GRID_DEFAULT, _RING_EP)
        ),
    ],
)
def test_stash_with_the_fused_routed_ffn_under_expert_parallelism(strategy):
    """The fused routed FFN (nn/moe/routed.py) writes its kept gate, up and expert outputs to
    the stash and reads them back: gradients bitwise those of the fused plain stack."""
    keys = {"moe_fused_routed_ffn": True, "moe_paged_stash_capacity_factor": 8.0}
    over, _ = compare("deepseek3-tiny", strategy, "ep4-fsdp2", "balanced", **keys)
    assert over.sum() == 0  # every layer read back from the stash, none recomputed
