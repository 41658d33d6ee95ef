"""The fp8 quantizers' counts (fp8/stats.py) under a layout with expert, tensor (the experts'
F split) and FSDP parallelism against one device: every operand element counted once (the
nonzero counts equal in both directions) and the blockwise forward's counts equal bit for bit.
The backward's underflow counts of the routed experts follow the layout as their wgrad tiles do
(128 rows of a shard's buffer per scale), so they are not compared."""

import jax
import numpy as np
import pytest

from expertax import init_params, load_config
from expertax.fp8 import stats as fp8_stats
from expertax.train import step as step_lib
from tests.conftest import TINY_MOE
from tests.sharded import on_mesh
from tests.unit.models.test_decoder import lm_batch

pytestmark = [pytest.mark.distributed, pytest.mark.extended]  # no other test counts on a mesh

# F / 2 = 128 per tensor shard: the same 1 x 128 tiles as one device's
TINY = {**TINY_MOE, "base_moe_mlp_dim": 256, "max_target_length": 16}
TINY["quantization"] = "fp8_blockwise"
LAYOUT = {"ici_tensor_parallelism": 2, "ici_expert_parallelism": 2, "ici_fsdp_parallelism": 2}


def _counts(c, params, batch):
    def loss(p, probes):
        return step_lib.loss_fn(p, batch, c, fp8_probes=probes)[0]

    lanes = jax.jit(jax.grad(loss, argnums=1))(params, step_lib.fp8_probes(c))
    return np.asarray(fp8_stats.decode(lanes["moe"]).sum(0))  # [direction, count]


def test_counts_under_a_layout_equal_one_device():
    one = load_config(overrides=TINY)
    params = init_params(one)
    batch = lm_batch(one, 8)
    want = _counts(one, params, batch)
    got, _ = on_mesh(load_config(overrides={**TINY, **LAYOUT}), params, batch, _counts)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1, 0] == want[1, 0] > 0


# four layers over two stages (two microbatches), and a partial pipeline: two stage layers and
# two plain ones after them; the custom pipeline VJP and plain autodiff (remat_policy=none)
PIPELINES = {
    "pp2-mb2": dict(ici_pipeline_parallelism=2, num_pipeline_microbatches=2),
    "pp2-partial-remat-none": dict(
        ici_pipeline_parallelism=2, pipeline_parallel_layers=2, remat_policy="none"
    ),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_counts_under_a_pipeline_equal_one_device(name):
    """The probes ride with the stages' weights and are zero in the bubbles (whose slots compute
    on stale data, which would add to every count): the elements counted equal one device's
    in both directions, and the forward's underflow and subnormal counts are within a few
    elements (the microbatched program rounds a few float32 activations differently, and an
    element at the subnormal boundary moves: 332 against 331 of 557,056)."""
    over = {**TINY, "base_num_decoder_layers": 4}
    one = load_config(overrides=over)
    params = init_params(one)
    batch = lm_batch(one, 8)
    want = _counts(one, params, batch)
    c = load_config(overrides={**over, "ici_fsdp_parallelism": 4, **PIPELINES[name]})
    got, _ = on_mesh(c, params, batch, _counts)
    assert got[0, 0] == want[0, 0] > 0 and got[1, 0] == want[1, 0] > 0
    np.testing.assert_allclose(got[0, 1:], want[0, 1:], atol=3)
