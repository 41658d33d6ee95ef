"""The paged stash on one device: gradients bitwise those of the plain stack (also when layers
overflow), the buffer is what the stack saves, the page copies, gmm with a given output, and the
config errors. The expert-parallel paths are in tests/distributed/test_stash.py."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params
from expertax.config import ConfigError
from expertax.fp8 import experts as fp8_experts
from expertax.models import stashed_stack
from expertax.nn.moe import stash as stash_mod
from expertax.nn.moe.gmm import gmm
from expertax.parallel import remat
from expertax.planner.residuals import residual_sources
from expertax.preflight import load_config
from expertax.train import step as step_lib
from tests.unit.models.test_decoder import lm_batch

# Keep exactly the stashable names (and the layer input): the plain stack then saves the same
# names as the stashed one, so the two programs compute the same values in the same order.
SAVE_MOE = {
    "remat_policy": "custom",
    "decoder_layer_input": "device",
    "moe_mlpwi_0": "device",
    "moe_mlpwi_1": "device",
    "moe_mlpwo": "device",
}
# The separate sparse path (row gather, grouped matmuls, combine) by default here; the plain stack
# a stashed one is compared with bitwise runs the same path (the fused routed FFN sums in another
# order), and the fused routed FFN with a stash is compared with the fused plain stack.
SMALL = {
    "max_target_length": 16,
    "per_device_batch_size": 1,
    "base_num_decoder_layers": 4,
    "moe_fused_routed_ffn": False,
}


def loss_grads_stats(c, p, batch):
    """(loss, grads, MoE stats) of the train step's loss."""

    def loss(p):
        total, parts = step_lib.loss_fn(p, batch, c)
        stats = parts.stats
        return total, stats

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
    return value, grads, stats


def assert_bitwise(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_HERE = "tests/unit/nn/moe/test_stash.py::"


# the stash's sizes: given only with the stash on (a size without it is refused)
STASH_SIZES = ("moe_paged_stash_page_rows", "moe_paged_stash_capacity_factor")


def configs(model: str, **extra):
    base = {"model_name": model, **SMALL, **SAVE_MOE, **extra}
    plain = {k: v for k, v in base.items() if k not in STASH_SIZES}
    return load_config(overrides=plain), load_config(overrides={**base, "moe_paged_stash": True})


@pytest.mark.parametrize(
    "model, fused",
    [
        # on demand (-m full_grid, 42 s): the sorted path runs in mixtral-tiny's case and
        # deepseek3-tiny's layers (MLA, shared experts, sigmoid routing) in the fused one
        pytest.param(
            "deepseek3-tiny",
            False,
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    f"{_HERE}test_stash_gradients_are_bitwise_the_plain_stacks[mixtral-tiny]",
                    f"{_HERE}test_stash_gradients_are_bitwise_the_plain_stacks[deepseek3-tiny-fused]",
                ),
            ],
        ),
        ("mixtral-tiny", False),
        ("deepseek3-tiny", True),
    ],
    ids=["deepseek3-tiny", "mixtral-tiny", "deepseek3-tiny-fused"],
)
@pytest.mark.default_codegen
def test_stash_gradients_are_bitwise_the_plain_stacks(model, fused):
    """Also with the fused routed FFN (nn/moe/routed.py), whose kept gate, up and expert
    outputs are the stashed values."""
    plain, stashed = configs(  # pages that do not divide
        model, moe_paged_stash_page_rows=5, moe_fused_routed_ffn=fused
    )
    p = init_params(plain)
    batch = lm_batch(plain, 2)
    l0, g0, s0 = loss_grads_stats(plain, p, batch)
    l1, g1, s1 = loss_grads_stats(stashed, p, batch)
    assert float(l0) == float(l1)
    assert_bitwise(g0, g1)
    assert s0.stash_overflow is None
    assert int(jnp.sum(s1.stash_overflow)) == 0
    # one device: every sorted row is real, so the rows needed are exactly N*K per layer
    np.testing.assert_allclose(np.asarray(s1.stash_factor)[-1], 1.0)
    # negative control: other parameters give other gradients
    other = jax.tree.map(lambda a: a * 1.01 if a.dtype == jnp.float32 else a, p)
    assert not np.array_equal(
        np.asarray(loss_grads_stats(stashed, other, batch)[1].embed), g1.embed
    )


@pytest.mark.parametrize(
    "recipe",
    [
        "fp8_blockwise",
        # on demand: the same stash encoding, one scale column instead of F / 128
        pytest.param(
            "fp8_tensorwise",
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    f"{_HERE}test_fp8_stash_holds_e4m3_and_its_gradients_are_bitwise_the_plain_fp8_stack"
                    "[fp8_blockwise]"
                ),
            ],
        ),
    ],
)
@pytest.mark.default_codegen
def test_fp8_stash_holds_e4m3_and_its_gradients_are_bitwise_the_plain_fp8_stack(recipe):
    """Under an fp8 recipe the stash holds gate and up as the activation saves them (e4m3 bytes
    and float32 row scales, nn/moe/stash.py) and hands them back as its residuals: the loss and
    the gradients are bitwise those of the plain fp8 stack keeping the same names."""
    plain, stashed = configs("mixtral-tiny", quantization=recipe, moe_paged_stash_page_rows=5)
    f = plain.base_moe_mlp_dim
    layout = stash_mod.buffers(stashed, {}, jnp.float32)
    scale_cols = 1 if recipe == "fp8_tensorwise" else -(-f // min(128, f))
    assert layout == {
        remat.MOE_MLPWI_0: (f, jnp.dtype(jnp.float8_e4m3fn)),
        remat.MOE_MLPWI_0 + fp8_experts.SCALE: (scale_cols, jnp.dtype(jnp.float32)),
        remat.MOE_MLPWI_1: (f, jnp.dtype(jnp.float8_e4m3fn)),
        remat.MOE_MLPWI_1 + fp8_experts.SCALE: (scale_cols, jnp.dtype(jnp.float32)),
        remat.MOE_MLPWO: (plain.base_emb_dim, jnp.dtype(jnp.float32)),
    }
    # a row costs (1 + 4 scale_cols / f) bytes per gate or up value, not 4 (float32 here)
    d = plain.base_emb_dim
    assert stash_mod.row_bytes(stashed, {}, jnp.float32) == 2 * (f + 4 * scale_cols) + 4 * d
    p = init_params(plain)
    batch = lm_batch(plain, 2)
    l0, g0, _ = loss_grads_stats(plain, p, batch)
    l1, g1, s1 = loss_grads_stats(stashed, p, batch)
    assert int(jnp.sum(s1.stash_overflow)) == 0
    assert float(l0) == float(l1)
    assert_bitwise(g0, g1)
    # what the stashed stack saves: the e4m3 bytes and scale bits, no gate or up in float32
    loss = lambda p: step_lib.loss_fn(p, batch, stashed)[0]
    saved = Counter((tuple(r.aval.shape), r.aval.dtype.name) for r in residual_sources(loss, p))
    rows = stash_mod.capacity_rows(stashed, plain.num_moe_layers, 2 * plain.max_target_length, {})
    rows += stashed.moe_paged_stash_page_rows
    assert saved[((rows, f), "uint8")] == 2 and saved[((rows, scale_cols), "uint32")] == 2
    assert saved[((rows, f), "uint32")] == (f == d)  # only the output's buffer, if as wide
    assert saved[((rows, d), "uint32")] == 1


@pytest.mark.parametrize(
    "factor, overflowing",
    [
        (0.6, "some"),
        # on demand: some layers overflowing run the same recompute branch by default
        pytest.param(
            0.01,
            "all",
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    f"{_HERE}test_layers_that_overflow_are_recomputed_exactly[0.6-some]"
                ),
            ],
        ),
    ],
)
@pytest.mark.default_codegen
def test_layers_that_overflow_are_recomputed_exactly(factor, overflowing):
    plain, stashed = configs("deepseek3-tiny", moe_paged_stash_capacity_factor=factor)
    p = init_params(plain)
    batch = lm_batch(plain, 2)
    _, g0, _ = loss_grads_stats(plain, p, batch)
    _, g1, s1 = loss_grads_stats(stashed, p, batch)
    over = np.asarray(s1.stash_overflow)
    num_moe = plain.num_moe_layers
    if overflowing == "all":
        assert over.sum() == num_moe
    else:
        assert 0 < over.sum() < num_moe and over[0] == 0  # the first layer fits, later ones not
    assert_bitwise(g0, g1)


def test_the_stack_saves_the_shared_buffer_not_per_layer_rows():
    plain, stashed = configs("mixtral-tiny")
    p = init_params(plain)
    batch = lm_batch(plain, 2)
    n_rows = 2 * plain.max_target_length * plain.num_experts_per_tok  # M = N*K on one device
    f, layers = plain.base_moe_mlp_dim, plain.num_moe_layers

    def shapes(c):
        loss = lambda p: step_lib.loss_fn(p, batch, c)[0]
        return [tuple(s.aval.shape) for s in residual_sources(loss, p)]

    per_layer_rows = (layers, n_rows, f)
    assert per_layer_rows in shapes(plain)  # the plain scan stacks [L, M, F] per name
    got = shapes(stashed)
    assert per_layer_rows not in got and (layers, n_rows, plain.base_emb_dim) not in got
    cap = stash_mod.capacity_rows(stashed, layers, 2 * plain.max_target_length, {})
    page = stashed.moe_paged_stash_page_rows
    assert (cap + page, f) in got and (cap + page, plain.base_emb_dim) in got


def test_pages_round_trip_and_overflow_writes_nothing():
    page, cap = 4, 20
    value = jnp.arange(13 * 3, dtype=jnp.float32).reshape(13, 3) + 1
    s = stash_mod.Stash(
        bufs={"v": jnp.zeros((cap + page, 3), jnp.uint32)},
        offset=jnp.array([2], jnp.int32),
        fits=jnp.array([True]),
        rows=jnp.zeros((1,), jnp.int32),
        mode=stash_mod.WRITE,
        capacity=cap,
        page=page,
        dtypes=(("v", "float32"),),
    )
    w = jax.jit(lambda s: s.write({"v": value}, 3, 9))(s)  # rows 3..11, 3 pages (last partial)
    assert int(w.offset[0]) == 11 and bool(w.fits[0]) and int(w.rows[0]) == 9
    np.testing.assert_array_equal(w.bufs["v"][2:11].view(np.float32), value[3:12])
    assert not np.any(w.bufs["v"][:2])
    back = jax.jit(lambda s: s.read("v", 3, 9, 13))(s.with_fields(bufs=w.bufs, mode="read"))
    want = jnp.zeros_like(value).at[3:12].set(value[3:12])
    np.testing.assert_array_equal(back, want)
    # 10 more rows do not fit in the 9 left: nothing is written, fits is cleared
    w2 = jax.jit(lambda s: s.write({"v": value}, 0, 10))(w)
    assert int(w2.offset[0]) == 11 and not bool(w2.fits[0]) and int(w2.rows[0]) == 19
    np.testing.assert_array_equal(w2.bufs["v"], w.bufs["v"])


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("offset", [None, 1])
def test_gmm_with_a_given_output_has_the_gmm_gradient(backend, offset):
    k = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k[0], (24, 8))
    rhs = jax.random.normal(k[1], (2 if offset else 4, 8, 6))
    sizes = jnp.array([5, 7, 0, 9], jnp.int32)
    ct = jax.random.normal(k[2], (24, 6))
    kw = dict(group_offset=offset, backend=backend, tile_rows=4, tile_rows_min=2)
    ref = gmm(lhs, rhs, sizes, **kw)
    f = lambda lhs, rhs, given=None: jnp.sum(gmm(lhs, rhs, sizes, given=given, **kw) * ct)
    g_ref = jax.grad(f, argnums=(0, 1))(lhs, rhs)
    g_given = jax.grad(lambda a, b: f(a, b, ref), argnums=(0, 1))(lhs, rhs)
    assert_bitwise(g_ref, g_given)
    # the value is the one given (a wrong one is returned as is: nothing is recomputed)
    np.testing.assert_array_equal(gmm(lhs, rhs, sizes, given=ref + 1, **kw), ref + 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sparse_matmul": False}, "moe_paged_stash=true needs the sparse"),
        ({"moe_paged_stash_capacity_factor": 0}, "moe_paged_stash_capacity_factor=0"),
        (
            {"moe_paged_stash_page_rows": 0},
            "moe_paged_stash_page_rows=0: input should be",
        ),
        ({"remat_policy": "full"}, "remat_policy=full saves none of moe_mlpwi_0"),
    ],
)
def test_bad_stash_settings_are_refused_before_compiling(overrides, message):
    base = {"model_name": "deepseek3-tiny", "moe_paged_stash": True, **SAVE_MOE}
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={**base, **overrides})


def test_the_overflow_note_names_a_factor_that_fits():
    c = load_config(overrides={"model_name": "deepseek3-tiny"})
    note = stashed_stack.capacity_factor_note(1.2301, c)
    assert ">= 1.24" in note and "(set 1.1)" in note
