"""`linear.project`: the same values and gradients as the einsum it replaces, and a weight
gradient that XLA:CPU computes without a transposed copy of the cotangent (the einsum's does)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.linear import project

SHAPES = {  # einsum, x shape, w shape, n_in
    "mlp": ("btd,df->btf", (2, 16, 8), (8, 24), 1),
    "heads": ("btd,dhq->bthq", (2, 16, 8), (8, 3, 4), 1),
    "out": ("btho,hod->btd", (2, 16, 3, 4), (3, 4, 8), 2),
}


def _inputs(xs, ws, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, xs), jax.random.normal(kw, ws)


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_project_equals_einsum_values_and_gradients(case):
    eq, xs, ws, n_in = SHAPES[case]
    x, w = _inputs(xs, ws)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    ref = lambda x, w: jnp.einsum(eq, x, w)
    new = lambda x, w: project(x, w, n_in)
    np.testing.assert_allclose(new(x, w), ref(x, w), rtol=1e-6, atol=1e-6)
    g_ref = jax.grad(loss(ref), argnums=(0, 1))(x, w)
    g_new = jax.grad(loss(new), argnums=(0, 1))(x, w)
    for a, b in zip(g_new, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # negative control: a different weight gives a different projection (the check can fail)
    assert not np.allclose(new(x, w * 1.001), ref(x, w), rtol=1e-6, atol=1e-6)


def test_project_refuses_mismatched_axes():
    x, w = _inputs((2, 4, 8), (6, 3))
    with pytest.raises(ValueError, match="disagree"):
        project(x, w)


def _transposed_copies(f, *args) -> int:
    """Transpose or copy instructions of a rank >= 2 array in the compiled (CPU) HLO of `f`."""
    hlo = jax.jit(f).lower(*args).compile().as_text()
    return len(re.findall(r"= f32\[\d+,\d+[,\d]*\]\{[\d,]+\} (?:transpose|copy)\(", hlo))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU layout property")
def test_weight_gradient_needs_no_transposed_copy():
    """The SwiGLU-like backward of the issue: with project, no layout copy; with the 3D einsum
    (negative control) XLA:CPU transposes the [B, T, F] cotangent before the weight-grad dot."""
    x, w = _inputs((4, 64, 32), (32, 128))

    def grads(f):
        return jax.grad(lambda x, w: jnp.sum(jax.nn.silu(f(x, w)) * f(x, w)), argnums=(0, 1))

    assert _transposed_copies(grads(lambda x, w: project(x, w)), x, w) == 0
    assert _transposed_copies(grads(lambda x, w: jnp.einsum("btd,df->btf", x, w)), x, w) > 0
