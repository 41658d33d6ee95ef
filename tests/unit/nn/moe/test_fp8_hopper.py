"""The Hopper fp8 grouped GEMM (fp8/hopper/).

- numerics on CPU in Pallas's Mosaic GPU interpreter: the fprop and the dgrad against the
  recipe's dequantized operands multiplied per group in float32 (uneven groups, one smaller than
  a 64-row tile, an empty one, rows past the groups, a group offset), in 64- and 128-row tiles;
  the interpreter reads the weight tiles untransposed (the module docstring), the rest is the
  GPU's code;
- compiled for `gpu:h100x8` without a GPU, in both row tiles: Mosaic GPU's pipeline runs in the
  compile and ptxas accepts its PTX for sm_90a, whose products are `wgmma ... e4m3.e4m3` with
  float32 accumulators.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from expertax import platform, targets
from expertax.fp8 import kernel as fp8_kernel
from expertax.fp8 import matmul as fp8_matmul
from expertax.fp8 import quant
from expertax.fp8 import recipes as fp8_recipes
from expertax.fp8.hopper import gmm as hopper_gmm
from expertax.fp8.hopper import layout as hopper_layout
from expertax.nn.activation import swiglu
from tests.unit.nn.moe.test_fp8_hopper_wgrad import _reference as wgrad_reference
from tests.unit.nn.moe.test_fp8_hopper_wgrad import _within as wgrad_within

TILE = hopper_layout.TILE
M, K, N = 256, 256, 128


def _operands(g, k=K, n=N, seed=0, width=None):
    """Rows [M, width or k] and weights [g, k, n], float32."""
    rng = np.random.default_rng(seed)
    # rows of very different magnitudes: the 1 x 128 tiles' scales differ along K and rows
    x = rng.standard_normal((M, width or k)) * np.exp(rng.uniform(-4, 4, (M, 1)))
    w = rng.standard_normal((g, k, n)) * np.exp(rng.uniform(-3, 3, (g, 1, n)))
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


def _reference(x_q, w_q, sizes, offset=0):
    """Per group in float32 on the dequantized operands (rows outside the groups: zero)."""
    x = np.asarray(fp8_recipes.dequantize(x_q, jnp.float32, 1, TILE))
    w = np.asarray(fp8_recipes.dequantize(w_q, jnp.float32, TILE, TILE))
    out = np.zeros((x.shape[0], w.shape[2]), np.float32)
    start = int(np.sum(sizes[:offset]))
    for g in range(w.shape[0]):
        end = start + int(sizes[offset + g])
        out[start:end] = x[start:end].astype(np.float64) @ w[g].astype(np.float64)
        start = end
    return out


def _assert_close(got, want, rounding=0.0):
    """Within float32 accumulation of the row's largest value (128 products per step, promoted
    per step: ~1e-6 of it), plus `rounding` of each value (the output dtype's)."""
    got = np.asarray(got, np.float32)
    row = np.abs(want).max(axis=1, keepdims=True)
    np.testing.assert_array_less(np.abs(got - want), 2e-6 * row + rounding * np.abs(want) + 1e-30)


# each tile and case once in the default run, the other pairs on demand (CI's budget), each
# covered by the default runs of its case and of its tile
_HERE = "tests/unit/nn/moe/test_fp8_hopper.py::"
_FPROP = _HERE + "test_fprop_in_the_interpreter_matches_the_dequantized_product"
_FPROP_DEFAULT = pytest.mark.covered_by(
    f"{_FPROP}[uneven_small_empty_tail-64]", f"{_FPROP}[offset-128]"
)


@pytest.mark.parametrize(
    "sizes, offset, tile_rows",
    [
        pytest.param((100, 0, 30, 90), None, 64, id="uneven_small_empty_tail-64"),
        pytest.param((40, 90, 0, 126), 1, 128, id="offset-128"),
        pytest.param(
            (100, 0, 30, 90),
            None,
            128,
            marks=[pytest.mark.full_grid, _FPROP_DEFAULT],
            id="uneven-128",
        ),
        pytest.param(
            (40, 90, 0, 126), 1, 64, marks=[pytest.mark.full_grid, _FPROP_DEFAULT], id="offset-64"
        ),
    ],
)
def test_fprop_in_the_interpreter_matches_the_dequantized_product(sizes, offset, tile_rows):
    g = len(sizes) - (offset or 0)
    x, w = _operands(g)
    x_q = fp8_recipes.quantize(x, "fp8_blockwise", 1, TILE)
    w_q = fp8_recipes.quantize(w, "fp8_blockwise", TILE, TILE)
    sizes_arr = jnp.asarray(sizes, jnp.int32)
    got = hopper_gmm.gmm(
        *x_q, *w_q, sizes_arr, group_offset=offset, out_dtype=jnp.float32, tile_rows=tile_rows,
        interpret=True,
    )  # fmt: skip
    want = _reference(x_q, w_q, np.asarray(sizes), offset or 0)
    _assert_close(got, want)
    assert not np.any(np.asarray(got)[sum(sizes) :])  # rows past the groups: exact zeros


# 128-row tiles: by default in the narrow-tile test's dgrad case
_NARROW = _HERE + "test_narrow_tiles_in_the_interpreter_match_the_dequantized_product"


@pytest.mark.parametrize(
    "tile_rows",
    [
        64,
        pytest.param(
            128,
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    f"{_HERE}test_dgrad_in_the_interpreter_matches_the_dequantized_product[64]",
                    f"{_NARROW}[dgrad-128]",
                ),
            ],
        ),
    ],
)
def test_dgrad_in_the_interpreter_matches_the_dequantized_product(tile_rows):
    """dy [M, N] in 1 x 128 tiles along N times each expert's weight transposed."""
    sizes = np.array([130, 0, 40])
    dy, w = _operands(3, k=128, n=256, seed=1, width=256)
    dy_q = fp8_recipes.quantize(dy, "fp8_blockwise", 1, TILE)
    w_q = fp8_recipes.quantize(w, "fp8_blockwise", TILE, TILE)
    got = hopper_gmm.dgrad(
        *dy_q, *w_q, jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32, tile_rows=tile_rows,
        interpret=True,
    )  # fmt: skip
    # the reference: the weight transposed with its blocks, through the same per-group product
    wt_q = (jnp.swapaxes(w_q[0], 1, 2), jnp.swapaxes(w_q[1], 1, 2))
    _assert_close(got, _reference(dy_q, wt_q, sizes))


@pytest.mark.parametrize(
    "product, tile_rows",
    [
        ("gmm", 64),
        ("dgrad", 128),
        # on demand: gmm and dgrad share the kernel, and each tile size runs by default
        pytest.param(
            "gmm",
            128,
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(f"{_NARROW}[gmm-64]", f"{_NARROW}[dgrad-128]"),
            ],
        ),
    ],
)
def test_narrow_tiles_in_the_interpreter_match_the_dequantized_product(product, tile_rows):
    """K = N = 192, multiples of 64 and not of 128: the kernel's output tiles are 64 columns
    wide and its K steps 64 (`tile_for`), each promoted by the scale of the 128-block it lies
    in (the scale grids' last column a 64-wide block). Within float32 accumulation of the
    dequantized product per group, as for whole 128-tiles."""
    assert hopper_layout.tile_for(192) == hopper_layout.tile_for(576) == 64
    assert hopper_layout.tile_for(256) == TILE
    sizes = np.array([100, 0, 30, 90])
    k = n = 192
    x, w = _operands(len(sizes), k=k, n=n, seed=7)
    x_q = fp8_recipes.quantize(x, "fp8_blockwise", 1, TILE)
    w_q = fp8_recipes.quantize(w, "fp8_blockwise", TILE, TILE)
    assert x_q[1].shape == (M, 2) and w_q[1].shape == (len(sizes), 2, 2)  # last blocks: 64
    got = getattr(hopper_gmm, product)(
        *x_q, *w_q, jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32, tile_rows=tile_rows,
        interpret=True,
    )  # fmt: skip
    assert got.shape == (M, 192)
    if product == "dgrad":  # the reference: the weight transposed with its blocks
        w_q = (jnp.swapaxes(w_q[0], 1, 2), jnp.swapaxes(w_q[1], 1, 2))
    _assert_close(got, _reference(x_q, w_q, sizes))
    # the control: a product that read the first block's scales for the last (64-wide) column
    # of blocks is far outside the tolerance
    wrong = (w_q[0], w_q[1].at[:, :, -1].set(w_q[1][:, :, 0]))
    with pytest.raises(AssertionError):
        _assert_close(got, _reference(x_q, wrong, sizes))


@pytest.mark.parametrize(
    "tile_rows, groups", [(64, [0, 1, 1, 2, 2]), (128, [0, 1, 2])], ids=["64", "128"]
)
def test_bfloat16_output_and_the_padded_schedule(tile_rows, groups):
    """bfloat16 out (the recipe's dtype) is the float32 product rounded once; a group of 1
    to `tile_rows` rows costs one row tile (`groups`: each row tile's group)."""
    sizes = np.array([1, 127, 128])
    x, w = _operands(3, seed=2)
    x_q = fp8_recipes.quantize(x, "fp8_blockwise", 1, TILE)
    w_q = fp8_recipes.quantize(w, "fp8_blockwise", TILE, TILE)
    sizes_arr = jnp.asarray(sizes, jnp.int32)
    got = hopper_gmm.gmm(*x_q, *w_q, sizes_arr, tile_rows=tile_rows, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = _reference(x_q, w_q, sizes)
    _assert_close(got, want, rounding=2**-8)
    tiles = hopper_layout.pad_groups(x_q[0], x_q[1], sizes_arr, 0, tile_rows)[2]
    assert len(tiles) == hopper_layout.padded_rows(M, 3, tile_rows) // tile_rows
    assert list(np.asarray(tiles)) == groups + [-1] * (len(tiles) - len(groups))


def test_refusals():
    x_q = fp8_recipes.quantize(jnp.ones((M, K)), "fp8_blockwise", 1, TILE)
    w = jnp.ones((2, K, N))
    w_q = fp8_recipes.quantize(w, "fp8_blockwise", TILE, TILE)
    sizes = jnp.array([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="e4m3"):
        hopper_gmm.gmm(x_q[0].astype(jnp.bfloat16), x_q[1], *w_q, sizes)
    with pytest.raises(ValueError, match="weight scales"):
        hopper_gmm.gmm(*x_q, w_q[0], w_q[1][:, :1], sizes)
    with pytest.raises(ValueError, match="rows"):
        hopper_gmm.dgrad(*x_q, *w_q, sizes)  # dgrad contracts over N = 128, not K = 256
    with pytest.raises(ValueError, match="tile_rows"):
        hopper_gmm.gmm(*x_q, *w_q, sizes, tile_rows=32)


needs_gpu = pytest.mark.skipif(
    not targets.compiler_available("gpu"), reason="the GPU compiler (expertax[gpu]) is missing"
)


def _on_demand_compile(*ids):
    name = _HERE + "test_compiles_for_h100_to_e4m3_wgmma"
    return [pytest.mark.full_grid, pytest.mark.covered_by(*(f"{name}[{i}]" for i in ids))]


@needs_gpu
@pytest.mark.parametrize(
    "product, tile_rows, narrow",
    [
        # each product and each tile once by default, the other pairs on demand (gmm and dgrad
        # are the same Mosaic kernel: the default cases of the same tile and width cover them)
        ("gmm", 128, False),
        ("dgrad", 64, False),
        ("gmm", 64, True),
        pytest.param("gmm", 64, False, marks=_on_demand_compile("dgrad-64-False", "gmm-128-False")),
        pytest.param(
            "dgrad", 128, False, marks=_on_demand_compile("gmm-128-False", "dgrad-64-False")
        ),
        pytest.param("dgrad", 64, True, marks=_on_demand_compile("gmm-64-True", "dgrad-64-False")),
    ],
)
def test_compiles_for_h100_to_e4m3_wgmma(product, tile_rows, narrow, tmp_path, monkeypatch):
    """Deviceless compile for an H100: the CUDA plugin runs Mosaic GPU's pipeline and ptxas; the
    PTX it dumps multiplies e4m3 by e4m3 into float32 on the tensor cores (`wgmma.mma_async`),
    and no product in the kernel is on other types. `narrow`: the contraction and the output
    width multiples of 64, not of 128 (gmm: K = 320 into N = 192; dgrad: N = 448 into K =
    192), so the output tile is 64 columns wide (`m64n64k32`) and a K step 64 deep (two k32
    instructions per 64 rows)."""
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    dev = targets.parse_target("gpu:h100x8").devices()[0]
    sharding = SingleDeviceSharding(dev)
    # distinct shapes: fresh kernels
    g, m, k, n = 4, 512 + tile_rows, 384, 256 if product == "gmm" else 512
    if narrow:
        k, n = (320, 192) if product == "gmm" else (192, 448)  # (not gmm's kernel again)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    c = k if product == "gmm" else n
    blocks = hopper_layout.blocks
    args = (
        arg((m, c), quant.E4M3),
        arg((m, blocks(c)), jnp.float32),
        arg((g, k, n), quant.E4M3),
        arg((g, blocks(k), blocks(n)), jnp.float32),
        arg((g,), jnp.int32),
    )
    with platform.use("gpu", dev):
        fn = functools.partial(getattr(hopper_gmm, product), tile_rows=tile_rows)
        lowered = jax.jit(fn).lower(*args)
    assert "mosaic_gpu_v2" in lowered.as_text()
    lowered.compile()
    ptx = "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ".target sm_90a" in ptx
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.(\w+)\.(\w+)", ptx)
    # a row tile is one m64 instruction per 64 rows; a K step one k32 one per 32 of its depth
    width = 64 if narrow else 128
    assert len(mmas) == tile_rows // 64 * width // 32, mmas
    assert set(mmas) == {(str(width), "e4m3", "e4m3")}, mmas
    ptxas = "\n".join(p.read_text() for p in tmp_path.glob("*.ptxas"))
    assert "sm_90a" in ptxas
    if tile_rows == 64:  # a 64 x 128 float32 tile, held twice, fits the registers (128 spills)
        assert "0 bytes spill stores" in ptxas, ptxas


# 15-35 s each in the interpreter on 2 cores: the blockwise case in the default run, the
# tensorwise one (scales broadcast to grids; wgrad_counted(tensorwise=True)) in the extended
# run, tensorwise at N = 192 on demand (its 64-wide tiles: the narrow-tile test by default)
_ON_KERNEL = _HERE + "test_fp8_gmm_on_the_kernel_matches_the_dequantized_backend"


@pytest.mark.parametrize(
    "recipe, n",
    [
        pytest.param("fp8_blockwise", 256, marks=pytest.mark.slow),
        pytest.param("fp8_tensorwise", 256, marks=pytest.mark.extended),
        pytest.param(
            "fp8_tensorwise",
            192,
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(f"{_ON_KERNEL}[fp8_tensorwise-256]", f"{_NARROW}[gmm-64]"),
            ],
            id="tensorwise-F192",
        ),
    ],
)
def test_fp8_gmm_on_the_kernel_matches_the_dequantized_backend(recipe, n):
    """`fp8_matmul.grouped(..., backend="fp8_hopper")` (here in the interpreter): the fprop and
    dgrad from the kernel equal the dequantized `tiled` products, the wgrad is the same code;
    with EP's group offset (the local groups 1 and 2 of four). Tensorwise scales go in broadcast
    to grids (of cdiv(N, 128) blocks at N = 192, the kernel's 64-wide tiles)."""
    sizes = jnp.array([40, 100, 0, 90], jnp.int32)
    x, w = _operands(2, n=n, seed=3)
    dy = jnp.asarray(np.random.default_rng(4).standard_normal((M, n)), jnp.float32)
    out = {}
    for backend in ("tiled", fp8_kernel.HOPPER):

        def f(x, w, b=backend):
            return fp8_matmul.grouped(x, w, sizes, recipe, group_offset=1, backend=b)

        y, vjp = jax.vjp(f, x, w)
        out[backend] = (y, *vjp(dy))
    for i in range(2):  # fprop, dgrad
        _assert_close(out[fp8_kernel.HOPPER][i], np.asarray(out["tiled"][i]))
    assert not np.any(np.asarray(out[fp8_kernel.HOPPER][0])[:40])  # the foreign group's rows
    if recipe == "fp8_tensorwise":  # the kernel's wgrad with one scale per operand: the same
        _assert_close(out[fp8_kernel.HOPPER][2], np.asarray(out["tiled"][2]))  # quantization
        return
    # blockwise: hopper_wgrad.wgrad on the rows the forward saved (its 1 x 128 tiles dequantized),
    # each group's rows in 128-row tiles of their own (the global tiling differs: the control)
    saved = fp8_recipes.dequantize(fp8_recipes.quantize(x, recipe, 1, 128), jnp.float32, 1, 128)
    want, scale = wgrad_reference(saved, dy, [40, 100, 0, 90], 1, 2, rows=M)
    got = out[fp8_kernel.HOPPER][2]
    assert wgrad_within(got, want, scale)
    assert not wgrad_within(out["tiled"][2], want, scale)


# on demand: gmm_glu's kernel path calls the same fprop, dgrad and wgrad (the blockwise case
# above), its own code runs on the dequantized backend by default
@pytest.mark.full_grid
@pytest.mark.covered_by(
    f"{_ON_KERNEL}[fp8_blockwise-256]",
    "tests/unit/nn/moe/test_fp8_gmm.py::"
    "test_glu_products_and_activation_gradient_from_fp8_inputs[fp8_blockwise]",
)
def test_fp8_gmm_glu_on_the_kernel_matches_the_dequantized_backend():
    sizes = jnp.array([100, 0, 120], jnp.int32)
    x, w = _operands(3, seed=5)
    rng = np.random.default_rng(6)
    up = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    names = ("gate", "up")
    out = {}
    for backend in ("tiled", fp8_kernel.HOPPER):

        def f(gate, up, w, b=backend):
            return fp8_matmul.grouped_glu(
                gate, up, w, sizes, "fp8_blockwise", swiglu, names, backend=b
            )

        y, vjp = jax.vjp(f, x, up, w)
        out[backend] = (y, *vjp(dy))
    for got, want in zip(out[fp8_kernel.HOPPER][:3], out["tiled"][:3], strict=True):
        _assert_close(got, np.asarray(want))
    # the weight gradient: hopper_wgrad.wgrad's per-group row tiles against the dequantized
    # backend's global ones: the same product up to that quantization's difference
    got, want = (np.asarray(out[b][3], np.float64) for b in (fp8_kernel.HOPPER, "tiled"))
    assert np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want)
