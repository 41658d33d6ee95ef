"""The sort and unsort of the sorted MoE path: gathers both ways, equal to plain JAX autodiff."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.moe import dispatch
from tests.tolerances import tol

N, K, D, E = 48, 3, 16, 8


def _inputs(seed=0):
    key = jax.random.key(seed)
    x = jax.random.normal(key, (N, D), jnp.float32)
    experts = jax.random.randint(jax.random.fold_in(key, 1), (N, K), 0, E)
    weights = jax.random.uniform(jax.random.fold_in(key, 2), (N, K), jnp.float32)
    return x, experts, weights


def _ffn(rows):  # a row-wise stand-in for the expert FFN, nonlinear so gradients differ per row
    return jnp.sin(rows) * 2.0 + rows**2


def _plain(x, weights, experts):
    """The path as autodiff sees it without custom VJPs: take, then a scatter to unsort."""
    order = jnp.argsort(experts.reshape(-1), stable=True)
    y = _ffn(jnp.take(x, order // K, axis=0))
    y_NKD = jnp.zeros_like(y).at[order].set(y).reshape(N, K, D)
    return jnp.sum(y_NKD * weights[..., None], axis=1)


CONFIG = types.SimpleNamespace(float32_weight_sum=True)


def _ours(x, weights, experts):
    rows, order, _ = dispatch.permute(x, experts, E)
    return dispatch.unpermute_combine(_ffn(rows), order, weights, CONFIG, jnp.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_permute_and_unpermute_equal_plain_autodiff(seed):
    x, experts, weights = _inputs(seed)
    cot = jax.random.normal(jax.random.key(9), (N, D))
    want, vjp_want = jax.vjp(lambda a, b: _plain(a, b, experts), x, weights)
    got, vjp_got = jax.vjp(lambda a, b: _ours(a, b, experts), x, weights)
    np.testing.assert_allclose(got, want, **tol())
    for g, w in zip(vjp_got(cot), vjp_want(cot), strict=True):
        np.testing.assert_allclose(g, w, **tol())


def test_a_backward_without_the_inverse_fails_the_comparison(monkeypatch):
    """Negative control: the same comparison catches a backward pass that gathers by the
    sort order itself instead of its inverse (the forward pass is unchanged)."""
    x, experts, _ = _inputs()
    order = jnp.argsort(experts.reshape(-1), stable=True)
    cot = jax.random.normal(jax.random.key(9), (N * K, D))
    _, vjp_want = jax.vjp(lambda a: jnp.take(a, order // K, axis=0), x)
    monkeypatch.setattr(dispatch, "inverse_permutation", lambda o: o)
    got, vjp_bad = jax.vjp(lambda a: dispatch.take_rows(a, order, K), x)
    np.testing.assert_array_equal(got, jnp.take(x, order // K, axis=0))
    assert not np.allclose(vjp_bad(cot)[0], vjp_want(cot)[0], **tol())


def test_inverse_permutation():
    order = jax.random.permutation(jax.random.key(3), 37)
    inv = dispatch.inverse_permutation(order)
    np.testing.assert_array_equal(np.asarray(inv)[np.asarray(order)], np.arange(37))


def _scatter_shapes(fn, *args):
    """Operand shapes of every scatter primitive in fn's jaxpr, nested jaxprs included."""
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("scatter"):
                shapes.append(eqn.invars[0].aval.shape)
            for v in eqn.params.values():
                for j in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):  # a ClosedJaxpr
                        walk(j.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


def test_no_scatter_of_rows_in_the_forward_or_backward_pass():
    """Autodiff of a gather scatter-adds rows; here both directions are gathers, and the only
    scatters left are over [N*K] or [E] integers (inverse permutation, group sizes)."""
    x, experts, weights = _inputs()

    def grad_of(f):
        return jax.grad(lambda a, b: jnp.sum(f(a, b, experts) ** 2), argnums=(0, 1))

    ours = _scatter_shapes(grad_of(_ours), x, weights)
    assert ours and all(len(shape) == 1 for shape in ours), ours
    plain = _scatter_shapes(grad_of(_plain), x, weights)
    assert any(len(shape) == 2 for shape in plain), "negative control: autodiff scatters rows"
