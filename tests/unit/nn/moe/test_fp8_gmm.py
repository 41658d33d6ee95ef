"""The routed experts' fp8 grouped GEMM (nn/moe/fp8_gmm.py): fprop, dgrad and wgrad equal a
loop over experts of float32 products of the recipe's quantized operands (re-derived here from
the tiles), padding rows and EP's foreign groups kept out of the wgrad's row tiles, the paged
stash's `given` value with the same backward, and e4m3 residuals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import quant
from expertax.nn import fp8_gemm
from expertax.nn.moe import fp8_gmm
from tests.tolerances import tol

E, M, K, N = 4, 300, 256, 160
SIZES = (100, 60, 0, 120)  # 280 routed rows of 300: 20 padding rows


def _operands():
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (M, K))
    x = x.at[sum(SIZES) :].set(1e4)  # padding rows: large, so a shared row tile would show it
    return x, jax.random.normal(ks[1], (E, K, N)) * 0.05, jax.random.normal(ks[2], (M, N))


def _deq(recipe, a, rows, cols):
    if recipe == "fp8_tensorwise":
        rows, cols = a.shape
    q, s = quant.quantize_blocks(a, rows, cols)
    return q.astype(jnp.float32) * quant.expand(s, rows, cols, a.shape)


def _oracle(recipe, x, w, dy, local):
    """Loop over the local experts (`local`: their ids, in order) of the quantized operands."""
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    lo, hi = starts[local[0]], starts[local[-1] + 1]
    mask = (np.arange(M) >= lo) & (np.arange(M) < hi)
    xq, dyq = _deq(recipe, x, 1, 128), _deq(recipe, dy, 1, 128)
    x_m = _deq(recipe, jnp.where(mask[:, None], xq, 0), 128, 1)
    dy_m = _deq(recipe, jnp.where(mask[:, None], dy, 0), 128, 1)
    y, dx = jnp.zeros((M, N)), jnp.zeros((M, K))
    dws = []
    for j, e in enumerate(local):
        rows = slice(starts[e], starts[e + 1])
        we = _deq(recipe, w[j], 128, 128)
        y = y.at[rows].set(xq[rows] @ we)
        dx = dx.at[rows].set(dyq[rows] @ we.T)
        dws.append(x_m[rows].T @ dy_m[rows])
    return y, dx, jnp.stack(dws)


@pytest.mark.parametrize("recipe", fp8_gemm.RECIPES)
@pytest.mark.parametrize("local", [(0, 1, 2, 3), (1, 2)], ids=["all", "ep-offset1"])
def test_products_are_the_quantized_operands_products(recipe, local):
    x, w, dy = _operands()
    w = w[jnp.array(local)]
    offset = None if len(local) == E else local[0]

    def f(x, w):
        return fp8_gmm.gmm(x, w, jnp.array(SIZES), recipe, group_offset=offset, backend="tiled")

    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(dy)
    want = _oracle(recipe, x, w, dy, local)
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    routed = slice(starts[local[0]], starts[local[-1] + 1])
    for got, exp in zip((y[routed], dx[routed], dw), (want[0][routed], want[1][routed], want[2])):
        np.testing.assert_allclose(got, exp, **tol(jnp.float32))
    assert not np.any(np.asarray(y[sum(SIZES) :]))  # padding rows: zeros, as gmm's


def test_backends_agree():
    """The tiled loop and ragged_dot run the same quantized products."""
    x, w, dy = _operands()
    out = {}
    for backend in ("tiled", "ragged_dot"):
        f = lambda x, w, b=backend: fp8_gmm.gmm(x, w, jnp.array(SIZES), "fp8_blockwise", backend=b)
        y, vjp = jax.vjp(f, x, w)
        out[backend] = (y[: sum(SIZES)], vjp(dy)[0][: sum(SIZES)], vjp(dy)[1])
    for a, b in zip(out["tiled"], out["ragged_dot"], strict=True):
        np.testing.assert_allclose(a, b, **tol(jnp.float32))


def test_given_value_keeps_the_backward():
    x, w, dy = _operands()
    sizes, given = jnp.array(SIZES), jnp.full((M, N), 3.0)
    f = lambda x, w, g=None: fp8_gmm.gmm(x, w, sizes, "fp8_blockwise", given=g, backend="tiled")
    y, vjp = jax.vjp(lambda x, w: f(x, w, given), x, w)
    _, vjp0 = jax.vjp(f, x, w)
    np.testing.assert_array_equal(y, given)
    for a, b in zip(vjp(dy), vjp0(dy), strict=True):
        np.testing.assert_array_equal(a, b)


def test_residuals_are_fp8():
    x, w, _ = _operands()
    opts = ("fp8_blockwise", False, (("backend", "tiled"),), None)
    sizes, zero = jnp.array(SIZES, jnp.int32), jnp.int32(0)
    _, (qx, qw, *_) = fp8_gmm._gmm_fwd(x.astype(jnp.bfloat16), w, sizes, zero, opts)
    assert qx[0].dtype == qw[0].dtype == quant.E4M3
    assert qx[1].shape == (M, K // 128) and qw[1].shape == (E, K // 128, N // 128 + 1)
