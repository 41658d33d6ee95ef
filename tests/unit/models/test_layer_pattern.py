"""Per-layer attention kinds (`attention_layer_pattern`, `sliding_window_size`): refusals, the
cycle scan equal to the unrolled stack, each layer's window read (a control per kind), the
parameter tree unchanged by the keys, decoding from the cache equal to the forward, and the
pipelined stack (stages, repeats, the layers after it) and the paged-stash stack giving the
plain stack's loss and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config, logits
from expertax.decoding import generate
from expertax.errors import ConfigError
from expertax.train import step as step_lib
from tests.tolerances import tol
from tests.unit.decoding.test_generate import oracle
from tests.unit.models.test_decoder import lm_batch
from tests.unit.nn.moe.test_stash import SMALL, assert_bitwise, configs, loss_grads_stats

OVER = dict(model_name="mixtral-tiny", dtype="float32", weight_dtype="float32",
            max_target_length=16, base_num_decoder_layers=2)  # fmt: skip
PATTERN = dict(sliding_window_size=3, attention_layer_pattern="sliding,full")


@pytest.mark.parametrize(
    "over, says",
    [
        ({"attention_layer_pattern": "sliding,local"}, "'local' is not a layer kind"),
        ({"attention_layer_pattern": "sliding,full"}, "sliding_window_size=0"),
        ({**PATTERN, "base_num_decoder_layers": 3}, "does not divide the 3 MoE layers"),
        (  # a stage visit of one layer: its kind would depend on the stage
            {**PATTERN, "ici_pipeline_parallelism": 2},
            r"attention_layer_pattern='sliding,full' \(a cycle of 2 layers\) with "
            r"ici_pipeline_parallelism.*num_pipeline_repeats=1: a stage visit runs 1 of the 2 "
            r"pipelined MoE layers \(pipeline_parallel_layers=-1; base_num_decoder_layers=2, "
            r"first_num_dense_layers=0\), not whole cycles.*no num_pipeline_repeats fits",
        ),
        (
            {
                **PATTERN,
                "base_num_decoder_layers": 8,
                "ici_pipeline_parallelism": 2,
                "num_pipeline_repeats": 4,
                "num_pipeline_microbatches": 2,
            },
            r"num_pipeline_repeats=4: a stage visit runs 1 of the 8 .*valid "
            r"num_pipeline_repeats with 2 stages: 1, 2$",
        ),  # fmt: skip
        ({"sliding_window_size": 4, "model_name": "deepseek3-tiny"}, "attention_type=mla"),
    ],
)
def test_refusals(over, says):
    with pytest.raises(ConfigError, match=says):
        load_config(overrides={**OVER, **over})


def test_cycle_scan_equals_unrolled_and_each_window_is_read():
    """On the dense stack (num_experts=1: the attention kinds do not depend on the MLP, and
    four programs of a dense model compile in a fifth of the MoE model's time); the MoE stack's
    cycle scan is the decoding test's and GPT-OSS's parity test's."""
    dense = {**OVER, "num_experts": 1}
    c = load_config(overrides={**dense, **PATTERN})
    plain = load_config(overrides=dense)
    p = init_params(c)
    assert c.num_dense_layers == 2
    assert jax.tree.structure(p) == jax.tree.structure(init_params(plain))
    toks = jax.random.randint(jax.random.key(0), (2, 16), 0, c.vocab_size)
    forward = jax.jit(logits, static_argnums=2)  # one program per config, none op by op
    out = forward(p, toks, c)
    unrolled = load_config(overrides={**dense, **PATTERN, "scan_layers": False})
    np.testing.assert_allclose(out, forward(p, toks, unrolled), **tol(jnp.float32))
    # controls: the first positions see no difference, later ones do, and each layer's kind counts
    full = forward(p, toks, plain)
    np.testing.assert_allclose(out[:, :3], full[:, :3], **tol(jnp.float32))
    assert not np.allclose(out[:, 3:], full[:, 3:], atol=1e-4)
    swapped = load_config(overrides={**dense, **PATTERN, "attention_layer_pattern": "full,sliding"})
    assert not np.allclose(out[:, 3:], forward(p, toks, swapped)[:, 3:], atol=1e-4)


def test_decoding_with_sliding_layers_equals_the_forward():
    c = load_config(overrides={**OVER, **PATTERN, "attention_sinks": True})
    p = init_params(c)
    attn = dataclasses.replace(p.moe_layers.attn, sinks=p.moe_layers.attn.sinks + 0.5)
    p = dataclasses.replace(p, moe_layers=dataclasses.replace(p.moe_layers, attn=attn))
    prompt = [3, 1, 4, 1, 5, 9, 2]
    out = generate(p, c, [prompt], max_new_tokens=4, devices=jax.devices()[:1])
    tokens, lps = oracle(c, p, [prompt], 4)
    assert out.tokens == tokens
    np.testing.assert_allclose(out.logprobs, lps, **tol(jnp.float32))


def _loss_and_grads(c, p, batch):
    return jax.jit(jax.value_and_grad(lambda p: step_lib.loss_fn(p, batch, c)[0]))(p)


PIPELINED = {
    "ici_pipeline_parallelism": 2,
    "num_pipeline_repeats": 2,
    "num_pipeline_microbatches": 2,
}


@pytest.mark.parametrize(
    "layers, over",
    [
        (8, PIPELINED),
        # four layers after the pipelined eight: a second scan's compile, twice the pipeline's;
        # on demand: the kinds in the pipeline above, a partial pipeline in the extended run
        pytest.param(
            12,
            {**PIPELINED, "pipeline_parallel_layers": 8},
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    "tests/unit/models/test_layer_pattern.py::"
                    "test_pipelined_stack_gives_the_plain_stacks_loss_and_gradients[pp2-r2]",
                    "tests/distributed/test_pipeline.py::"
                    "test_pipeline_trains_like_no_pipeline[mixtral-l4-partial2-pp2]",
                ),
            ],
        ),
    ],
    ids=["pp2-r2", "pp2-r2-rest4"],
)
def test_pipelined_stack_gives_the_plain_stacks_loss_and_gradients(layers, over):
    """Two stages, two repeats (layer l of stage s's r-th visit is (2r + s) * 2 + j, of kind j),
    on demand four more layers after the pipeline, against the stack without a pipeline; on one
    device (the kinds do not depend on the mesh; tests/distributed/test_pipeline.py has the
    pattern on 8 devices on demand) and on the dense stack (the pipeline's stage loop is the
    MoE stack's; a dense model compiles in a fraction of the time). Control: the loss with the
    kinds swapped differs beyond the tolerance."""
    base = {**OVER, **PATTERN, "num_experts": 1, "base_num_decoder_layers": layers}
    plain = load_config(overrides=base)
    piped = load_config(overrides={**base, **over})
    assert piped.pipelined_layers == 8 and piped.pipeline_stages == 2
    p = init_params(plain)
    batch = lm_batch(plain, 2)
    l0, g0 = _loss_and_grads(plain, p, batch)
    l1, g1 = _loss_and_grads(piped, p, batch)
    t = tol(jnp.float32)
    np.testing.assert_allclose(l1, l0, **t)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, **t)
    # control: the loss with the kinds swapped (each layer's kind its neighbour's)
    swapped = load_config(overrides={**base, "attention_layer_pattern": "full,sliding"})
    _assert_differs(jax.jit(lambda p: step_lib.loss_fn(p, batch, swapped)[0])(p), l1)


def _assert_differs(wrong, loss):
    """A loss that a test of `loss` within the float32 tolerance would tell apart (by 100x)."""
    t = tol(jnp.float32)
    assert abs(float(wrong) - float(loss)) > 100 * (t["atol"] + t["rtol"] * abs(float(loss)))


@pytest.mark.parametrize(
    "gmm",
    # ragged_dot: a third of the tiled grouped matmul's compile time (the default on CPU); the
    # tiled one on demand: the same stash and kinds, and its given output's gradient by default
    [
        "ragged_dot",
        pytest.param(
            "tiled",
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    "tests/unit/models/test_layer_pattern.py::"
                    "test_stashed_stack_gives_the_plain_stacks_loss_and_gradients[ragged_dot]",
                    "tests/unit/nn/moe/test_stash.py::"
                    "test_gmm_with_a_given_output_has_the_gmm_gradient[None-tiled]",
                    "tests/unit/nn/moe/test_stash.py::"
                    "test_gmm_with_a_given_output_has_the_gmm_gradient[1-tiled]",
                ),
            ],
        ),
    ],
)
@pytest.mark.default_codegen
def test_stashed_stack_gives_the_plain_stacks_loss_and_gradients(gmm):
    """The paged stash with sliding and full layers: bitwise the plain stack's loss and
    gradients (as tests/unit/nn/moe/test_stash.py without kinds), the first two layers' rows
    stashed (a sliding and a full layer read back), the last two overflowing (recomputed).
    Control: the loss with all layers full differs beyond the tolerance."""
    plain, stashed = configs(
        "mixtral-tiny", **PATTERN, dtype="float32", weight_dtype="float32", gmm_impl=gmm,
        moe_paged_stash_capacity_factor=0.6,
    )  # fmt: skip
    assert plain.attention_windows == (3, None) and plain.num_moe_layers == 4
    p = init_params(plain)
    batch = lm_batch(plain, 2)
    l0, g0, _ = loss_grads_stats(plain, p, batch)
    l1, g1, s1 = loss_grads_stats(stashed, p, batch)
    np.testing.assert_array_equal(np.asarray(s1.stash_overflow), [0, 0, 1, 1])
    assert float(l0) == float(l1)
    assert_bitwise(g0, g1)
    full = load_config(
        overrides={"model_name": "mixtral-tiny", **SMALL, "dtype": "float32", "gmm_impl": gmm}
    )
    _assert_differs(jax.jit(lambda p: step_lib.loss_fn(p, batch, full)[0])(p), l1)
