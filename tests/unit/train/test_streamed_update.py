"""The layer-streamed AdamW update (optimizer state in pinned host memory) computes optax's
update: on CPU, which has no pinned host memory, the same loop runs with the state in device
memory (`host=False`); the TPU compile of the streamed step is tests/unit/planner/
test_offload_update.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol

from expertax.nn import norm, param
from expertax.preflight import load_config
from expertax.train import optimizer, streamed_update


def _tree():
    """Stacked matrices and expert stacks (streamed by layer), stacked vectors and unstacked
    leaves (moved whole), and a frozen leaf."""
    block = {
        "scale": norm.spec(4),
        "w": param.projection((4, 8), ("embed", "mlp"), 4),
        "experts": param.ParamSpec((3, 4, 8), ("exp", "embed", "mlp"), "normal"),
    }
    return {
        "layers": param.stack(block, 5),
        "few": param.stack({"w": param.projection((8, 4), ("mlp", "embed"), 8)}, 2),
        "embed": param.projection((16, 4), ("vocab", "embed"), 4),
        "frozen_bias": param.ParamSpec((4,), (None,), "zeros", trainable=False, weight_decay=False),
    }


def _steps(c, tree, params, n=5):
    """(streamed, optax) (params, opt_state) after `n` steps whose gradients grow, the third
    non-finite."""
    tx = optimizer.make(c, tree)
    ref = got = (params, tx.init(params))
    update = jax.jit(lambda g, s, p, f: streamed_update.apply(c, tree, g, s, p, f, host=False))
    for i in range(n):
        key = jax.random.key(i)
        grads = jax.tree.map(lambda p, k=key, s=i + 1.0: s * jax.random.normal(k, p.shape), params)
        finite = jnp.bool_(i != 2)
        ref = optimizer.optax_update(tx, grads, ref[1], ref[0], finite)
        got = update(grads, got[1], got[0], finite)
    return got, ref


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["no-clip", "clipped"])
def test_streamed_update_equals_the_optax_chain(clip, moments):
    base = dict(model_name="llama-tiny", learning_rate=0.05, adam_weight_decay=0.3, steps=10)
    base |= dict(mu_dtype=moments, nu_dtype=moments, gradient_clipping_threshold=clip)
    c = load_config(overrides=base)
    tree = _tree()
    params = param.initialize(tree, jax.random.key(0), jnp.float32)
    got, ref = _steps(c, tree, params)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if moments == "float32":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        else:  # a moment rounded to bfloat16 may round the other way after a float32 ulp
            np.testing.assert_allclose(a, b, **tol(jnp.bfloat16))
    np.testing.assert_array_equal(got[0]["frozen_bias"], params["frozen_bias"])
    # Negative control: every trained leaf moved, the streamed ones included.
    for name in ("w", "experts", "scale"):
        assert not np.allclose(got[0]["layers"][name], params["layers"][name], **tol())


def test_a_non_finite_step_leaves_the_streamed_state_bitwise_unchanged():
    c = load_config(overrides={"model_name": "llama-tiny", "mu_dtype": "bfloat16"})
    tree = _tree()
    params = param.initialize(tree, jax.random.key(0), jnp.float32)
    state = optimizer.make(c, tree).init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    run = lambda f: streamed_update.apply(c, tree, grads, state, params, jnp.bool_(f), host=False)
    for a, b in zip(jax.tree.leaves(run(False)), jax.tree.leaves((params, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isnan(np.asarray(run(True)[0]["layers"]["experts"])).all()  # negative control
