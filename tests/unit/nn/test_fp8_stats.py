"""fp8 quantizer statistics (fp8/stats.py): the counts against a NumPy oracle (ml_dtypes'
e4m3) for both recipes on tokens spread over 1e-12..1e3, the exact sum of the probe's binary
lanes, and a linear's and a grouped GEMM's probe gradients (their operands' counts; the
unused rows of a grouped GEMM's buffer not counted)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from expertax.fp8 import matmul as fp8_matmul
from expertax.fp8 import recipes as fp8_recipes
from expertax.fp8 import stats as fp8_stats

M, K, N = 64, 256, 128


def _spread(seed=0):
    """[M, K]: row r's magnitudes around 10^e_r, e_r from -12 to 3; in each row one value
    1e-9 of the row's (it flushes in a 1 x 128 tile too) and one 5e-5 of it (subnormal)."""
    x = np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32)
    x[:, 7], x[:, 9] = 1e-9, 5e-5
    return x * np.logspace(-12, 3, M, dtype=np.float32)[:, None]


def _oracle(x, recipe):
    """(nonzero, underflow, subnormal) of x quantized by `recipe`'s activation rule (tensorwise:
    one scale; blockwise: 1 x 128 tiles along the last axis), scale = amax / 448."""
    if recipe == "fp8_tensorwise":
        amax = np.full_like(x, np.abs(x).max())
    else:
        tiles = np.abs(x).reshape(x.shape[0], -1, 128).max(-1, keepdims=True)
        amax = np.broadcast_to(tiles, (x.shape[0], x.shape[1] // 128, 128)).reshape(x.shape)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    q = (x * (np.float32(1) / scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nonzero, subnormal = x != 0, (q != 0) & (abs(q) < 2**-6)
    return np.array([nonzero.sum(), (nonzero & (q == 0)).sum(), subnormal.sum()])


@pytest.mark.parametrize("recipe", fp8_recipes.RECIPES)
def test_counts_equal_a_numpy_oracle(recipe):
    x = _spread()
    q, _ = fp8_recipes.quantize(jnp.asarray(x), recipe, 1, fp8_recipes.TILE)
    got = np.asarray(fp8_stats.decode(fp8_stats.counts(jnp.asarray(x), q)))
    want = _oracle(x, recipe)
    np.testing.assert_array_equal(got, want)
    assert want[0] == M * K and want[1] >= M and want[2] >= M  # (the known tiny values)


def test_counts_in_groups_equal_the_oracle(monkeypatch):
    """An operand counted in groups of rows (as one beyond 2^30 elements would be): groups of
    two rows of K, the last one partial, give the oracle's counts."""
    monkeypatch.setattr(fp8_stats, "GROUP", 2 * K + 1)
    x = _spread()[: 2 * 7 + 1]
    q, _ = fp8_recipes.quantize(jnp.asarray(x), "fp8_blockwise", 1, fp8_recipes.TILE)
    got = np.asarray(fp8_stats.decode(fp8_stats.counts(jnp.asarray(x), q)))
    np.testing.assert_array_equal(got, _oracle(x, "fp8_blockwise"))


def test_one_scale_flushes_the_small_tokens_that_tiles_keep():
    x = jnp.asarray(_spread(1))

    def underflows(recipe):
        q = fp8_recipes.quantize(x, recipe, 1, fp8_recipes.TILE)[0]
        return int(fp8_stats.decode(fp8_stats.counts(x, q))[1])

    under = {r: underflows(r) for r in fp8_recipes.RECIPES}
    # one scale for the tensor: every token below about 1e3 * 2^-10 / 448 flushes (~3/4 of them)
    assert under["fp8_tensorwise"] > M * K // 2
    assert under["fp8_tensorwise"] > 50 * under["fp8_blockwise"]


def test_binary_lanes_sum_exactly():
    rng = np.random.default_rng(0)
    n = rng.integers(0, 2**31 - 1, size=(40, 2, 3))
    lanes = jnp.stack([fp8_stats.encode(*fp8_stats.bits(a)) for a in jnp.asarray(n, jnp.int32)])
    summed = np.asarray(jnp.sum(lanes, 0), np.float64)  # float32 sums of integers below 2^24
    bits = (summed * 2.0 ** np.arange(fp8_stats.BITS)).sum(-1)
    np.testing.assert_array_equal(bits, n.sum(0).astype(np.float64))
    # the float32 decode rounds only the final sum
    np.testing.assert_allclose(fp8_stats.decode(jnp.sum(lanes, 0)), n.sum(0), rtol=1e-7)


def _probe_grad(f, *args):
    return jax.jit(jax.grad(lambda probe: jnp.sum(f(probe, *args))))(fp8_stats.zeros())


def test_a_linear_counts_its_input_and_its_output_gradient():
    x = jnp.asarray(_spread(2)).at[:, :3].set(0)  # some zeros: not counted as nonzero
    w = jax.random.normal(jax.random.key(0), (K, N)) * 0.05
    recipe = "fp8_blockwise"
    lanes = _probe_grad(lambda p, x, w: fp8_matmul.dense(x, w, recipe, p), x, w)
    fwd, bwd = np.asarray(fp8_stats.decode(lanes))
    np.testing.assert_array_equal(fwd, _oracle(np.asarray(x), recipe))
    # backward: dy (ones) twice, the dequantized input re-tiled along the tokens once
    x_deq = fp8_recipes.dequantize(fp8_recipes.quantize(x, recipe, 1, 128), jnp.float32, 1, 128)
    assert bwd[0] == 2 * M * N + int(jnp.sum(x_deq != 0))
    # no probe: the same products and gradients, bit for bit
    y = lambda x, w, p=None: jnp.sum(fp8_matmul.dense(x, w, recipe, p) ** 2)  # noqa: E731
    g0 = jax.jit(jax.grad(y, argnums=(0, 1)))(x, w)
    g1 = jax.jit(jax.grad(y, argnums=(0, 1)))(x, w, fp8_stats.zeros())
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_grouped_gemm_counts_only_its_groups_rows():
    e, m = 2, 48
    rows = jax.random.normal(jax.random.key(1), (m, K))
    rows = rows.at[40:].set(1e-30)  # the buffer's unused rows (tiny: they would flush)
    w = jax.random.normal(jax.random.key(2), (e, K, N)) * 0.05
    sizes = jnp.array([30, 10], jnp.int32)

    def f(probes, rows, w):
        return fp8_matmul.grouped(rows, w, sizes, "fp8_blockwise", probes=probes)

    kp, np_ = jax.jit(jax.grad(lambda ps: jnp.sum(f(ps, rows, w))))((fp8_stats.zeros(),) * 2)
    fwd_k, bwd_k = np.asarray(fp8_stats.decode(kp))
    fwd_n, bwd_n = np.asarray(fp8_stats.decode(np_))
    np.testing.assert_array_equal(fwd_k, _oracle(np.asarray(rows[:40]), "fp8_blockwise"))
    assert fwd_n.tolist() == [0, 0, 0]  # (the output gradient has no forward)
    assert bwd_k[0] == 40 * K and bwd_n[0] == 2 * 40 * N  # dgrad's dy and wgrad's dy
