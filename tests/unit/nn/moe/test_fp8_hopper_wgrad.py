"""The Hopper fp8 grouped GEMM's weight gradient (`hopper_wgrad.wgrad`).

- numerics on CPU in Pallas's Mosaic GPU interpreter against a float64 reference built here in
  NumPy from the same quantization: each group's rows padded to 128-row tiles on their own,
  quantized per tile and channel, dequantized and multiplied `x^T dy` (uneven groups, groups of
  one to three tiles, an empty one, rows outside the groups holding large values, a group
  offset, bfloat16 rows); the negative control: the rows tiled globally (a tile straddling two
  groups shares their amax, `fp8/matmul.py`'s tiling) is far outside the tolerance;
- compiled for `gpu:h100x8` without a GPU: e4m3 x e4m3 `wgmma` with float32 accumulators.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from expertax import platform, targets
from expertax.fp8 import quant
from expertax.fp8.hopper import layout as hopper_layout
from expertax.fp8.hopper import wgrad as hopper_wgrad

TILE = hopper_layout.TILE
M = 384


def _rows(width, sizes, offset, seed, dtype):
    """[M, width] rows whose groups have different magnitudes (so that a tile shared by two
    groups would take the larger one's scale); the rows outside the local groups are large."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, width)) * np.exp(rng.uniform(-2, 2, (1, width)))
    edges = np.cumsum([0, *sizes])
    for g in range(len(sizes)):
        x[edges[g] : edges[g + 1]] *= 4.0**g
    x[: edges[offset]] = 1e4
    x[edges[-1] :] = -1e4
    return jnp.asarray(x, dtype)


def _dequantized(rows_RC, tiled):
    """`rows_RC` quantized in 128-row tiles per channel (the project's quantizer, in NumPy) and
    dequantized, float64; `tiled=False`: the rows are padded to a whole tile first."""
    r = rows_RC.shape[0]
    padded = np.zeros((-(-r // TILE) * TILE, rows_RC.shape[1]), np.float32)
    padded[:r] = rows_RC
    q, scale = quant.quantize_blocks(padded, TILE, 1, xp=np)
    return q.astype(np.float64) * np.repeat(scale, TILE, axis=0).astype(np.float64)


def _reference(x, dy, sizes, offset, num_groups, per_group=True, rows=M):
    """(float64 [G, K, N] of each local group's `x^T dy` on its dequantized rows, the same
    product of the magnitudes: the float32 accumulation's error scale). `per_group`: each group
    padded to whole tiles on its own (the kernel's layout); else the local groups' rows tiled
    as they lie in the buffer, the other rows zeroed (a tile may straddle two groups)."""
    x, dy = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    edges = np.cumsum([0, *sizes])
    local = slice(edges[offset], edges[offset + num_groups])
    if not per_group:
        keep = np.zeros((rows, 1), bool)
        keep[local] = True
        x, dy = _dequantized(np.where(keep, x, 0), True), _dequantized(np.where(keep, dy, 0), True)
    out = np.zeros((2, num_groups, x.shape[1], dy.shape[1]))
    for g in range(num_groups):
        rows = slice(edges[offset + g], edges[offset + g + 1])
        xg, dyg = x[rows], dy[rows]
        if per_group and len(xg):
            xg, dyg = _dequantized(xg, False), _dequantized(dyg, False)
        out[:, g] = xg.T @ dyg, np.abs(xg).T @ np.abs(dyg)
    return out


def _within(got, want, scale):
    """Within float32 accumulation: each 128-row step's partial and its promotion rounded,
    ~1e-6 of the step's summed magnitudes (the interpreter multiplies in NumPy float32)."""
    return np.all(np.abs(np.asarray(got, np.float64) - want) <= 2e-6 * scale + 1e-30)


_WGRAD = (
    "tests/unit/nn/moe/test_fp8_hopper_wgrad.py::"
    "test_wgrad_in_the_interpreter_matches_the_per_group_tiles"
)


@pytest.mark.parametrize(
    "sizes, offset, num_groups, dtype, k, n",
    [
        pytest.param((100, 0, 200, 30), 0, 4, jnp.float32, 256, 128, id="uneven_empty"),
        # K and N multiples of 64, not of 128: the [K, N] tiles 64 x 64 (`tile_for`)
        pytest.param((100, 0, 150), 0, 3, jnp.float32, 192, 192, id="narrow_tiles"),
        # on demand (CI's budget): test_fp8_hopper.py's fp8_gmm case takes a group offset too
        pytest.param(
            (40, 150, 0, 60, 90),
            1,
            3,
            jnp.bfloat16,
            256,
            128,
            id="offset_bfloat16",
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    "tests/unit/nn/moe/test_fp8_hopper.py::"
                    "test_fp8_gmm_on_the_kernel_matches_the_dequantized_backend[fp8_blockwise-256]",
                    f"{_WGRAD}[uneven_empty]",
                ),
            ],
        ),
    ],
)
def test_wgrad_in_the_interpreter_matches_the_per_group_tiles(
    sizes, offset, num_groups, dtype, k, n
):
    """Each local group's `x^T dy` [K, N] on its own 128-row tiles (groups of 1 to 3 tiles: the
    kernel's loop length per group); the empty group's matrix is exact zeros; the large rows
    outside the local groups do not reach it. The negative control: the globally tiled
    quantization's product differs by far more than the tolerance."""
    x = _rows(k, sizes, offset, 0, dtype)
    dy = _rows(n, sizes, offset, 1, dtype)
    sizes_arr = jnp.asarray(sizes, jnp.int32)
    got = hopper_wgrad.wgrad(
        x, dy, sizes_arr, group_offset=offset, num_groups=num_groups, interpret=True
    )
    assert got.shape == (num_groups, k, n) and got.dtype == jnp.float32
    want, scale = _reference(x, dy, sizes, offset, num_groups)
    assert _within(got, want, scale)
    empty = [g for g in range(num_groups) if sizes[offset + g] == 0]
    assert empty and not np.any(np.asarray(got)[empty])
    global_tiles = _reference(x, dy, sizes, offset, num_groups, per_group=False)[0]
    assert not _within(global_tiles, want, scale)
    # the schedule: each group from its own first tile, ceil(size / 128) tiles
    ops = hopper_wgrad.wgrad_operands(x, dy, sizes_arr, group_offset=offset, num_groups=num_groups)
    tiles = -(-np.asarray(sizes[offset : offset + num_groups]) // TILE)
    np.testing.assert_array_equal(ops.tiles, tiles)
    np.testing.assert_array_equal(ops.first_tile, np.cumsum(tiles) - tiles)


def test_refusals():
    x, dy = jnp.ones((M, 160)), jnp.ones((M, 128))  # K = 160: not a multiple of 64
    sizes = jnp.array([10, 20], jnp.int32)
    with pytest.raises(ValueError, match=r"x \(384, 160\) and dy \(384, 128\)"):
        hopper_wgrad.wgrad(x, dy, sizes, num_groups=2)
    with pytest.raises(ValueError, match=r"x \(384, 256\) and dy \(383, 128\)"):
        hopper_wgrad.wgrad(jnp.ones((M, 256)), dy[1:], sizes, num_groups=2)
    mp = hopper_layout.padded_rows(M, 2)
    xq, dyq = jnp.zeros((mp, 256), quant.E4M3), jnp.zeros((mp, 128), quant.E4M3)
    xs, dys = jnp.ones((mp // TILE, 256)), jnp.ones((mp // TILE, 128))
    with pytest.raises(ValueError, match="e4m3"):
        hopper_wgrad.wgrad_quantized(xq.astype(jnp.bfloat16), xs, dyq, dys, sizes, sizes)
    with pytest.raises(ValueError, match="x scales"):
        hopper_wgrad.wgrad_quantized(xq, xs[:, :128], dyq, dys, sizes, sizes)


@pytest.mark.skipif(
    not targets.compiler_available("gpu"), reason="the GPU compiler (expertax[gpu]) is missing"
)
@pytest.mark.parametrize(
    "k, n",
    [
        (384, 256),
        # on demand: the same kernel, other tiles (their numerics by default: narrow_tiles)
        pytest.param(
            192,
            320,
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    "tests/unit/nn/moe/test_fp8_hopper_wgrad.py::"
                    "test_wgrad_compiles_for_h100_to_e4m3_wgmma[384-256]",
                    f"{_WGRAD}[narrow_tiles]",
                ),
            ],
            id="narrow",
        ),
    ],
)
def test_wgrad_compiles_for_h100_to_e4m3_wgmma(k, n, tmp_path, monkeypatch):
    """Deviceless compile for an H100 from bfloat16 rows (padding, quantization and the
    transposes in XLA around the kernel): the kernel's PTX multiplies e4m3 by e4m3 into float32
    on the tensor cores (`wgmma.mma_async`), 8 instructions per 128-row step (two m64 halves of
    the K tile, four k32 slices of the step), and no product on other types; with K and N
    multiples of 64 and not of 128 (`narrow`), 64 x 64 tiles of [K, N]: four `m64n64k32`."""
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    dev = targets.parse_target("gpu:h100x8").devices()[0]
    sharding = SingleDeviceSharding(dev)
    g, m = 4, 640  # shapes of their own: a fresh kernel, not a cached one

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def f(x, dy, sizes):
        return hopper_wgrad.wgrad(x, dy, sizes, num_groups=g)

    args = (arg((m, k), jnp.bfloat16), arg((m, n), jnp.bfloat16), arg((g,), jnp.int32))
    with platform.use("gpu", dev):
        lowered = jax.jit(f).lower(*args)
    assert "mosaic_gpu_v2" in lowered.as_text()
    lowered.compile()
    ptx = "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ".target sm_90a" in ptx
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.(\w+)\.(\w+)", ptx)
    tk, tn = hopper_layout.tile_for(k), hopper_layout.tile_for(n)
    assert len(mmas) == tk // 64 * 4 and set(mmas) == {(str(tn), "e4m3", "e4m3")}, mmas
    assert "sm_90a" in "\n".join(p.read_text() for p in tmp_path.glob("*.ptxas"))
