"""fp8 training GEMMs (fp8/matmul.py): the quantizers (tiles, blocks, the hub's weight format bit
for bit), each recipe's products against an exact emulation and against float32, the tiles'
worth with token magnitudes spread over 1e-3..1e3, the fp8 residuals, and, compile-only for an
H100, the three cuBLASLt fp8 GEMMs of a tensorwise linear."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from expertax import platform, targets
from expertax.convert import fp8 as hub_fp8
from expertax.fp8 import kernel as fp8_kernel
from expertax.fp8 import matmul as fp8_matmul
from expertax.fp8 import products as fp8_products
from expertax.fp8 import quant
from expertax.fp8 import recipes as fp8_recipes
from expertax.fp8.hopper import gmm as hopper_gmm
from expertax.fp8.hopper import layout as hopper_layout
from expertax.fp8.hopper import wgrad as hopper_wgrad
from expertax.planner.flops import count_flops
from tests.tolerances import tol

M, K, N = 64, 384, 256


def _operands(seed=0, spread=False):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (M, K))
    if spread:  # token magnitudes over six decades
        x = x * jnp.logspace(-3, 3, M)[:, None]
    return x, jax.random.normal(ks[1], (K, N)) * 0.05, jax.random.normal(ks[2], (M, N))


def _rel(a, b, axis=None):
    return np.linalg.norm(np.asarray(a - b), axis=axis) / np.linalg.norm(np.asarray(b), axis=axis)


def _fp8_and_exact(recipe, x, w, dy):
    (y, vjp) = jax.vjp(lambda x, w: fp8_matmul.dense(x, w, recipe), x, w)
    y0, vjp0 = jax.vjp(jnp.matmul, x, w)
    return (y, *vjp(dy)), (y0, *vjp0(dy))


def test_weight_blocks_are_the_hub_format_bit_for_bit():
    """The training quantizer (jax) and the converter (NumPy) give the same e4m3 bytes and
    scales, edge blocks included (300 x 200: partial blocks on both axes)."""
    w = np.asarray(jax.random.normal(jax.random.key(3), (300, 200))) * 0.02
    q_hub, s_hub = hub_fp8.quantize(w)
    q, s = quant.quantize_blocks(jnp.asarray(w), 128, 128)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_hub.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s), s_hub)


def test_activation_tiles_fill_e4m3_per_token_and_128_channels():
    x, _, _ = _operands(spread=True)
    q, s = quant.quantize_blocks(x, 1, 128)
    assert s.shape == (M, K // 128)
    amax = np.abs(np.asarray(q, np.float32)).reshape(M, K // 128, 128).max(-1)
    np.testing.assert_array_equal(amax, np.full_like(amax, quant.E4M3_MAX))


@pytest.mark.parametrize("recipe", fp8_recipes.RECIPES)
def test_products_are_the_dequantized_operands_products(recipe):
    """fprop, dgrad and wgrad equal float32 products of the quantized operands (each re-derived
    here from the recipe's tiles), i.e. what an fp8 GEMM with float32 accumulation computes."""
    x, w, dy = _operands()
    (y, dx, dw), _ = _fp8_and_exact(recipe, x, w, dy)
    rows, cols = (M, K) if recipe == "fp8_tensorwise" else (1, 128)

    def deq(a, r, c):
        if recipe == "fp8_tensorwise":
            r, c = a.shape
        q, s = quant.quantize_blocks(a, r, c)
        return q.astype(jnp.float32) * quant.expand(s, r, c, a.shape)

    np.testing.assert_allclose(y, deq(x, rows, cols) @ deq(w, 128, 128), **tol(jnp.float32))
    np.testing.assert_allclose(dx, deq(dy, 1, 128) @ deq(w, 128, 128).T, **tol(jnp.float32))
    x_seen = deq(x, 1, 128)  # the saved input, re-tiled along the tokens for the wgrad
    np.testing.assert_allclose(dw, deq(x_seen, 128, 1).T @ deq(dy, 128, 1), **tol(jnp.float32))


@pytest.mark.parametrize("recipe", fp8_recipes.RECIPES)
def test_error_against_float32_within_the_recipe_bound(recipe):
    x, w, dy = _operands()
    got, want = _fp8_and_exact(recipe, x, w, dy)
    errors = [_rel(g, e) for g, e in zip(got, want, strict=True)]
    assert all(0.005 < err <= 0.05 for err in errors), errors  # fp8, not float32


def test_tiles_keep_small_tokens_that_one_scale_flushes():
    x, w, _ = _operands(spread=True)
    want = np.asarray(x @ w)
    worst = {r: _rel(fp8_matmul.dense(x, w, r), want, axis=1).max() for r in fp8_recipes.RECIPES}
    assert worst["fp8_blockwise"] <= 0.06
    assert worst["fp8_tensorwise"] > 0.5  # the smallest tokens round to zero


def test_residuals_are_fp8():
    x, w, _ = _operands()
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    spec = fp8_products.Spec("fp8_blockwise", grouped=False, hopper=False)
    _, res = fp8_matmul._matmul_fwd((xb,), wb, None, None, (None,), None, spec)
    ((qx, sx),), (qw, sw), *_, counts = res
    assert counts is None  # (no probe: nothing counted)
    assert qx.dtype == qw.dtype == quant.E4M3 and qx.shape == (M, K) and qw.shape == (K, N)
    assert sx.dtype == sw.dtype == jnp.float32 and sx.shape == (M, K // 128)


# 16-30 s each in the interpreter on 2 cores: the smallest unpadded case in the default run (the
# dense linear's path onto the kernels: its padding, its split over the rows, the wgrad's sum
# over the devices), the padded one in the extended run, 448 on demand (CI's budget)
@pytest.mark.parametrize(
    "n, n_kernel, k",
    [
        pytest.param(192, 192, 128, marks=pytest.mark.slow, id="192_unpadded"),
        # on demand: the same unpadded 64-wide path as 192's
        pytest.param(
            448,
            448,
            256,
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    "tests/unit/nn/test_fp8_gemm.py::"
                    "test_blockwise_linear_on_the_hopper_kernel_matches_the_dequantized_one[192_unpadded]"
                ),
            ],
            id="448_unpadded",
        ),
        # extended: the zero padding around the kernels (fp8_kernel.PAD_LIMIT) runs only here
        pytest.param(300, 320, 256, marks=pytest.mark.extended, id="300_padded_to_320"),
    ],
)
def test_blockwise_linear_on_the_hopper_kernel_matches_the_dequantized_one(
    n, n_kernel, k, monkeypatch
):
    """Under `fp8_kernel.interpret()` (a CPU standing in for a Hopper GPU: Pallas's Mosaic GPU
    interpreter) the blockwise fprop, dgrad and wgrad run on the kernels as one group: within
    float32 accumulation of each row's largest value of the dequantized products (the per-128
    promotion sums in another order; the wgrad's 100 rows are one tile, padded with zeros),
    and not equal to them bit for bit (the control: the kernels ran). N = 192 and 448 (1.5 and
    3.5 x 128; 448 is the small model's wkv_a width, as 576 is DeepSeek-V3's) run unpadded in
    64-wide tiles along N (the fprop's output tiles, the dgrad's K steps, the wgrad's [K, N]
    tiles); N = 300 is zero-padded to 320 around the kernels (fp8_kernel.PAD_LIMIT)."""
    m = 100  # 100 rows: one group padded to the tile; K / 128 K steps for the fprop
    ks = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(ks[0], (m, k)) * jnp.logspace(-2, 2, m)[:, None]
    w, dy = jax.random.normal(ks[1], (k, n)) * 0.05, jax.random.normal(ks[2], (m, n))
    seen = []  # (contraction, output width, column tile, K step) of each fprop / dgrad call
    kernel, wgrad_kernel = hopper_gmm._kernel, hopper_wgrad._wgrad_kernel

    def spy(x_pad, xs_t, w, w_scale, tile_group, n, *args, **tiles):
        seen.append((x_pad.shape[1], n, tiles["tile_cols"], tiles["k_step"]))
        return kernel(x_pad, xs_t, w, w_scale, tile_group, n, *args, **tiles)

    def wgrad_spy(xt, xs, dy_kernel, dys, *args):
        seen.append((xt.shape[0], dys.shape[1]))
        return wgrad_kernel(xt, xs, dy_kernel, dys, *args)

    monkeypatch.setattr(hopper_gmm, "_kernel", spy)
    monkeypatch.setattr(hopper_wgrad, "_wgrad_kernel", wgrad_spy)

    def run():
        y, vjp = jax.vjp(lambda x, w: fp8_matmul.dense(x, w, "fp8_blockwise"), x, w)
        return tuple(np.asarray(a) for a in (y, *vjp(dy)))

    want = run()
    assert not seen
    with fp8_kernel.interpret():
        got = run()
    narrow = hopper_layout.tile_for(n_kernel)
    assert seen == [(k, n_kernel, narrow, 128), (n_kernel, k, 128, narrow), (k, n_kernel)]
    for g, r in zip(got, want, strict=True):  # fprop, dgrad, wgrad
        row = np.abs(r).max(axis=1, keepdims=True)
        np.testing.assert_array_less(np.abs(g - r), np.broadcast_to(2e-6 * row, r.shape))
        assert not np.array_equal(g, r)


def test_refuses_an_unknown_recipe():
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="quantization='fp8'"):
        fp8_matmul.dense(x, w, "fp8")


needs_gpu = pytest.mark.skipif(
    not targets.compiler_available("gpu"), reason="the GPU compiler (expertax[gpu]) is missing"
)


@needs_gpu
def test_tensorwise_linear_is_three_cublaslt_fp8_gemms_on_h100():
    """[4096 x 7168] x [7168 x 2048] forward and backward in bfloat16: fprop, dgrad and wgrad
    each `__cublas$lt$matmul$f8` once XLA's Triton GEMMs are off; blockwise scales are not a
    pattern cuBLASLt takes (the control: no fp8 GEMM)."""
    t = targets.parse_target("gpu:h100x8")
    one = NamedSharding(Mesh(t.devices()[:1], ("one",)), PartitionSpec())
    shapes = ((4096, 7168), (7168, 2048), (4096, 2048))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one) for s in shapes]

    def text(recipe):
        def step(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: fp8_matmul.dense(x, w, recipe), x, w)
            return y, vjp(dy)

        with platform.use("gpu"):
            lowered = jax.jit(step).lower(*args)
            return lowered.compile(compiler_options=fp8_kernel.GPU_COMPILER_OPTIONS).as_text()

    calls = re.findall(r'custom_call_target="([^"]+)"', text("fp8_tensorwise"))
    assert calls.count("__cublas$lt$matmul$f8") == 3 and "__cublas$lt$matmul" not in calls
    assert "__cublas$lt$matmul$f8" not in text("fp8_blockwise")


@needs_gpu
def test_blockwise_linear_is_the_hopper_kernel_on_h100():
    """[512 x 256] x [256 x 384] on one H100 (its device named, as a trainer's context names
    it): the blockwise fprop, dgrad and wgrad are Pallas Mosaic GPU calls (fp8/hopper/'s
    e4m3 wgmma kernels, one group), no cuBLAS GEMM; so are they at N = 576 (MLA's wkv_a width,
    4.5 x 128: unpadded, in 64-wide tiles along N); a linear of N = 200 (padded to 256 it would
    be 28 % more work) stays dequantized (the control). The planner counts the three calls'
    FLOPs from their shapes: those of the three products, unpadded (planner/flops.py)."""
    t = targets.parse_target("gpu:h100x8")
    dev = t.devices()[0]
    one = NamedSharding(Mesh([dev], ("one",)), PartitionSpec())

    def calls(n):
        shapes = ((512, 256), (256, n), (512, n))
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one) for s in shapes]

        def step(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: fp8_matmul.dense(x, w, "fp8_blockwise"), x, w)
            return y, vjp(dy)

        with platform.use("gpu", dev):
            lowered = jax.jit(step).lower(*args)
            text = lowered.compile(compiler_options=fp8_kernel.GPU_COMPILER_OPTIONS).as_text()
        return re.findall(r'custom_call_target="([^"]+)"', text), text

    for n in (384, 576):
        kernel, text = calls(n)
        assert kernel.count("mosaic_gpu_v2") == 3 and "__cublas$lt$matmul" not in kernel, n
        # N = 576 is multiplied as it is, no padding
        assert count_flops(text).flops == 3 * 2 * 512 * 256 * n, n
    assert "mosaic_gpu_v2" not in calls(200)[0]
