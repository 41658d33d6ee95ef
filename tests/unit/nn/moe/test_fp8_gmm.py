"""The routed experts' fp8 grouped GEMM (fp8/matmul.py): fprop, dgrad and wgrad equal a
loop over experts of float32 products of the recipe's quantized operands (re-derived here from
the tiles), padding rows and EP's foreign groups kept out of the wgrad's row tiles, the paged
stash's `given` value with the same backward, and e4m3 residuals; the second GEMM with its
gated activation (`gmm_glu`) keeping the activation's inputs in fp8 under their remat names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # (public: print_saved_residuals only)

from expertax.fp8 import matmul as fp8_matmul
from expertax.fp8 import products as fp8_products
from expertax.fp8 import quant
from expertax.fp8 import recipes as fp8_recipes
from expertax.nn.activation import swiglu
from expertax.nn.moe import tiles
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


# each recipe with one expert range by default, the other two cases on demand (CI's budget):
# an on-demand case is covered by the default cases of its recipe and of its expert range (the
# foreign groups' masking does not depend on the recipe)
_RANGES = (("all", (0, 1, 2, 3)), ("ep-offset1", (1, 2)))
_HERE = "tests/unit/nn/moe/test_fp8_gmm.py::test_products_are_the_quantized_operands_products"


def _products_case(i, recipe, j, name, local):
    if not (i + j) % 2:
        return pytest.param(recipe, local, id=f"{name}-{recipe}")
    other_range = _RANGES[1 - j][0]
    other_recipe = fp8_recipes.RECIPES[1 - i]
    cover = pytest.mark.covered_by(
        f"{_HERE}[{other_range}-{recipe}]", f"{_HERE}[{name}-{other_recipe}]"
    )
    return pytest.param(recipe, local, marks=[pytest.mark.full_grid, cover], id=f"{name}-{recipe}")


@pytest.mark.parametrize(
    "recipe, local",
    [
        _products_case(i, recipe, j, name, local)
        for i, recipe in enumerate(fp8_recipes.RECIPES)
        for j, (name, local) in enumerate(_RANGES)
    ],
)
def test_products_are_the_quantized_operands_products(recipe, local):
    x, w, dy = _operands()
    w = w[jnp.array(local)]
    offset = None if len(local) == E else local[0]

    def f(x, w):
        return fp8_matmul.grouped(
            x, w, jnp.array(SIZES), recipe, group_offset=offset, backend="tiled"
        )

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
        f = lambda x, w, b=backend: fp8_matmul.grouped(
            x, w, jnp.array(SIZES), "fp8_blockwise", backend=b
        )
        y, vjp = jax.vjp(f, x, w)
        out[backend] = (y[: sum(SIZES)], vjp(dy)[0][: sum(SIZES)], vjp(dy)[1])
    for a, b in zip(out["tiled"], out["ragged_dot"], strict=True):
        np.testing.assert_allclose(a, b, **tol(jnp.float32))


def test_hopper_row_tile_from_the_expected_rows():
    """The Hopper kernel's fprop/dgrad row tile from the balanced rows per group the program
    names: 64 where it names none or fewer than 1,024 (half a tile of padding per group), 128
    from 1,024 on (each weight tile reused for twice the rows)."""
    args = (jnp.ones((8, K)), jnp.ones((E, K, N)), jnp.asarray(SIZES))
    for expected, want in ((None, 64), (512.0, 64), (1023.0, 64), (1024.0, 128), (4096.0, 128)):
        with tiles.expected_group_rows(expected):
            spec = fp8_matmul._prepare("fp8_blockwise", None, {}, None, None, (), *args)[0]
        assert fp8_products.hopper_tile_rows(spec) == want, expected


def test_given_value_keeps_the_backward():
    x, w, dy = _operands()
    sizes, given = jnp.array(SIZES), jnp.full((M, N), 3.0)
    f = lambda x, w, g=None: fp8_matmul.grouped(
        x, w, sizes, "fp8_blockwise", given=g, backend="tiled"
    )
    y, vjp = jax.vjp(lambda x, w: f(x, w, given), x, w)
    _, vjp0 = jax.vjp(f, x, w)
    np.testing.assert_array_equal(y, given)
    for a, b in zip(vjp(dy), vjp0(dy), strict=True):
        np.testing.assert_array_equal(a, b)


def test_residuals_are_fp8():
    x, w, _ = _operands()
    spec = fp8_products.Spec("fp8_blockwise", True, False, backend=(("backend", "tiled"),))
    sizes, zero = jnp.array(SIZES, jnp.int32), jnp.int32(0)
    args = ((x.astype(jnp.bfloat16),), w, sizes, zero, (None,), None, spec)
    _, ((qx,), qw, *_) = fp8_matmul._matmul_fwd(*args)
    assert qx[0].dtype == qw[0].dtype == quant.E4M3
    assert qx[1].shape == (M, K // 128) and qw[1].shape == (E, K // 128, N // 128 + 1)


@pytest.mark.parametrize("recipe", fp8_recipes.RECIPES)
def test_glu_products_and_activation_gradient_from_fp8_inputs(recipe):
    """gmm_glu: the forward multiplies the tiles of act(gate, up) from the exact inputs; the
    backward recomputes the hidden rows and the activation's gradient from gate and up in
    1 x 128 e4m3 tiles (what it saves)."""
    ks = jax.random.split(jax.random.key(4), 3)
    gate, up = (jax.random.normal(k, (M, K)) for k in ks[:2])
    w, dy = _operands()[1], jax.random.normal(ks[2], (M, N))
    sizes = jnp.array(SIZES)
    names = ("moe_mlpwi_0", "moe_mlpwi_1")
    f = lambda g, u, w: fp8_matmul.grouped_glu(
        g, u, w, sizes, recipe, swiglu, names, backend="tiled"
    )
    y, vjp = jax.vjp(f, gate, up, w)
    dg, du, dw = vjp(dy)
    h_exact = swiglu(gate, up)
    g8, u8 = _deq(recipe, gate, 1, 128), _deq(recipe, up, 1, 128)
    h8, act_vjp = jax.vjp(swiglu, g8, u8)
    mask = (np.arange(M) < sum(SIZES))[:, None]
    h_m = _deq(recipe, jnp.where(mask, _deq(recipe, h8, 1, 128), 0), 128, 1)
    dy_m = _deq(recipe, jnp.where(mask, dy, 0), 128, 1)
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    want_y, dh = jnp.zeros((M, N)), jnp.zeros((M, K))
    for e in range(E):
        rows, we = slice(starts[e], starts[e + 1]), _deq(recipe, w[e], 128, 128)
        want_y = want_y.at[rows].set(_deq(recipe, h_exact, 1, 128)[rows] @ we)
        dh = dh.at[rows].set(_deq(recipe, dy, 1, 128)[rows] @ we.T)
        np.testing.assert_allclose(dw[e], h_m[rows].T @ dy_m[rows], **tol(jnp.float32))
    want_dg, want_du = act_vjp(dh)
    routed = slice(0, sum(SIZES))
    np.testing.assert_allclose(y[routed], want_y[routed], **tol(jnp.float32))
    np.testing.assert_allclose(dg[routed], want_dg[routed], **tol(jnp.float32))
    np.testing.assert_allclose(du[routed], want_du[routed], **tol(jnp.float32))


def test_glu_keeps_gate_and_up_as_fp8_under_their_names():
    """A remat policy that keeps gate's and up's names keeps their e4m3 tiles and scales, not
    the bfloat16 arrays."""
    x, w, _ = _operands()
    gate, up = x.astype(jnp.bfloat16), (x * 0.5).astype(jnp.bfloat16)
    names = ("moe_mlpwi_0", "moe_mlpwi_1")

    def f(g, u, w):
        y = fp8_matmul.grouped_glu(jnp.sin(g), jnp.sin(u), w, jnp.array(SIZES), "fp8_blockwise",
                            swiglu, names, backend="tiled")  # fmt: skip
        return jnp.sum(jnp.sin(y))

    policy = jax.checkpoint_policies.save_only_these_names(*names)
    wt = w[:, :, :K].astype(jnp.bfloat16)
    saved = saved_residuals(jax.checkpoint(f, policy=policy), gate, up, wt)
    named = [(a.dtype, a.shape) for a, why in saved if "named" in why]
    assert sorted(named, key=str) == sorted(
        [(quant.E4M3, (M, K)), (jnp.float32, (M, K // 128))] * 2, key=str
    )
