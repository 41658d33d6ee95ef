"""num_moe_token_chunks on one device: chunked = unchunked (outputs, gradients, global stats).

The expert-parallel paths (all-to-all, ring) are checked in tests/distributed/test_ep.py.
"""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.config import ConfigError
from expertax.nn.moe import layer, router
from expertax.parallel import remat
from expertax.preflight import load_config
from tests.tolerances import tol
from tests.unit.nn.moe.test_moe import case as moe_case

ROUTINGS = {
    "mixtral": {"model_name": "mixtral-tiny"},
    "deepseek": {"model_name": "deepseek3-tiny"},  # sigmoid + bias + groups
}
CHUNKS = 4


def setup(routing: str, chunks: int, **extra):
    """test_moe's layer case (router bias exercised) with `chunks` token chunks."""
    keys = dict(num_moe_token_chunks=chunks, load_balance_loss_weight=0.01, max_target_length=16)
    return moe_case({**ROUTINGS[routing], **keys, **extra})


@jax.jit(static_argnums=0)
def value_and_grads(c, p, x):
    ct = jax.random.normal(jax.random.key(4), x.shape)

    def loss(p, x):
        y, st, _ = layer.apply(p, x, c, jnp.float32)
        return jnp.sum(y * ct) + st.lb_loss, (y, st)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)


def assert_same_layer(a, b):
    (la, (ya, sa)), ga = a
    (lb, (yb, sb)), gb = b
    np.testing.assert_allclose(ya, yb, **tol())
    np.testing.assert_allclose(la, lb, **tol())
    for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol())
    np.testing.assert_array_equal(sa.load_E, sb.load_E)  # integer counts: exact
    np.testing.assert_allclose(sa.lb_loss, sb.lb_loss, **tol())
    assert int(sa.dropped) == int(sb.dropped) == 0


@pytest.mark.parametrize("sparse", [True, False], ids=["sorted", "einsum"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_chunks_equal_one_chunk(routing, sparse):
    c1, p, x = setup(routing, 1, sparse_matmul=sparse)
    c4, _, _ = setup(routing, CHUNKS, sparse_matmul=sparse)
    assert_same_layer(value_and_grads(c4, p, x), value_and_grads(c1, p, x))


def test_negative_control_perturbed_expert_weight_fails():
    c1, p, x = setup("deepseek", 1)
    c4, _, _ = setup("deepseek", CHUNKS)
    bad = dataclasses.replace(p, wo=p.wo.at[3].multiply(1.01))
    with pytest.raises(AssertionError):
        assert_same_layer(value_and_grads(c4, bad, x), value_and_grads(c1, p, x))


def test_lb_loss_is_global_not_a_mean_of_chunk_losses():
    """Skewed chunks (each chunk pushed towards other experts): the mean of per-chunk losses
    differs from the global loss, and the chunked layer returns the global one."""
    c4, p, x = setup("mixtral", CHUNKS)
    n, d = 2 * 16, c4.base_emb_dim
    x_ND = x.reshape(n, d)
    # chunk i's tokens lean towards expert i (a direction the router maps to its logit)
    w_DE = p.router.w
    lean_ND = jnp.repeat(
        3.0 * w_DE[:, :CHUNKS].T / jnp.linalg.norm(w_DE[:, :CHUNKS], axis=0)[:, None],
        n // CHUNKS,
        0,
    )
    x_skewed = (x_ND + lean_ND).reshape(x.shape)
    _, stats, _ = jax.jit(layer.apply, static_argnums=(2, 3))(p, x_skewed, c4, jnp.float32)

    whole = router.route(p.router, x_skewed.reshape(n, d), c4)
    global_lb = router.balance_stats(whole.counts_E, whole.prob_sum_E, n, c4, 0).lb_loss
    per_chunk = []
    for x_chunk in x_skewed.reshape(CHUNKS, n // CHUNKS, d):
        r = router.route(p.router, x_chunk, c4)
        per_chunk.append(router.balance_stats(r.counts_E, r.prob_sum_E, n // CHUNKS, c4, 0).lb_loss)
    mean_lb = float(np.mean(per_chunk))
    np.testing.assert_allclose(stats.lb_loss, global_lb, **tol())
    np.testing.assert_array_equal(stats.load_E, whole.counts_E)
    assert abs(mean_lb - float(global_lb)) > 0.05 * float(global_lb), (mean_lb, global_lb)


def _saved_residuals(c, p, x, placements):
    policy = remat.checkpoint_policy(placements)
    f = jax.checkpoint(lambda p, x: jnp.sum(layer.apply(p, x, c, jnp.float32)[0]), policy=policy)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, p, x)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


# the separate path's case on demand (-m full_grid): CI's budget; the chunk scan with names by
# default in the fused case, the separate path's names in test_names_kept.py
_SEPARATE = pytest.param(
    False,
    marks=[
        pytest.mark.full_grid,
        pytest.mark.covered_by(
            "tests/unit/nn/moe/test_chunks.py::test_checkpoint_names_work_inside_the_chunk_loop[fused]",
            "tests/unit/parallel/test_names_kept.py::"
            "test_a_name_placed_on_device_is_saved_or_refused[moe-separate-moe_mlpwo]",
        ),
    ],
)


@pytest.mark.parametrize("fused", [True, _SEPARATE], ids=["fused", "separate"])
def test_checkpoint_names_work_inside_the_chunk_loop(fused):
    """A kept name is saved once per chunk (M = N/chunks * K rows), stacked by the scan: the
    gate [M, F] (moe_mlpwi_0) of the fused routed FFN, the expert output [M, D] (moe_mlpwo, in
    `minimal`) of the separate path (the fused one makes it only when its config keeps it:
    tests/unit/parallel/test_names_kept.py); `full` saves nothing but
    the arguments. Gradients under each equal the plain ones. (The fused path reads the
    config's policy: with gate and up both recomputed it makes neither, so the config keeps
    the gate here.)"""
    over = {"remat_policy": "custom", "moe_mlpwi_0": "device"} if fused else {}
    c, p, x = setup("mixtral", CHUNKS, base_moe_mlp_dim=96, moe_fused_routed_ffn=fused, **over)
    m = 2 * 16 // CHUNKS * c.num_experts_per_tok
    kept = remat.config_placements(c) if fused else remat.placements("minimal")
    width = c.base_moe_mlp_dim if fused else c.base_emb_dim
    saved = _saved_residuals(c, p, x, kept)
    assert len(saved) == 1 and saved[0].startswith(f"f32[{CHUNKS},{m},{width}]"), saved
    assert _saved_residuals(c, p, x, remat.placements("full")) == []
    if fused:
        assert _saved_residuals(c, p, x, remat.placements("minimal")) == []
    plain = jax.grad(lambda p: jnp.sum(jnp.sin(layer.apply(p, x, c, jnp.float32)[0])))(p)
    for placements in (kept, remat.placements("full")):
        policy = remat.checkpoint_policy(placements)
        f = jax.checkpoint(
            lambda p: jnp.sum(jnp.sin(layer.apply(p, x, c, jnp.float32)[0])), policy=policy
        )
        for u, v in zip(jax.tree.leaves(jax.grad(f)(p)), jax.tree.leaves(plain), strict=True):
            np.testing.assert_allclose(u, v, **tol())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["num_moe_token_chunks=0"], "num_moe_token_chunks"),
        (
            ["sparse_matmul=false", "max_target_length=12", "num_moe_token_chunks=8"],
            "num_moe_token_chunks=8 does not divide max_target_length=12",
        ),
        (
            ["sparse_matmul=false", "capacity_factor=1.5", "num_moe_token_chunks=2"],
            "capacity_factor=1.5",
        ),
        (["ragged_buffer_factor=2", "num_moe_token_chunks=2"], "ragged_buffer_factor=2"),
    ],
)
def test_bad_chunk_configs_are_refused(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config(overrides=["model_name=mixtral-tiny", *overrides])


def test_indivisible_rows_raise_naming_the_key():
    c, p, x = setup("mixtral", 3)
    with pytest.raises(ValueError, match="num_moe_token_chunks=3 does not divide the 32"):
        layer.apply(p, x, c, jnp.float32)
