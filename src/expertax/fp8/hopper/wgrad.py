"""The weight gradient of the fp8 grouped GEMM on Hopper.

`wgrad(x, dy, sizes, num_groups=G)` is the weight gradient, per group `x^T dy` [K, N] contracted
over the group's rows, from the unquantized rows: it pads them (the layout above, always in
128-row tiles: the recipe's quantization tile along the rows) and quantizes both in 128-row
tiles per channel, so that each contraction step's scales belong to one group (DeepSeek's
per-expert tiling). One CTA per group and 128 x 128 tile of [K, N] (64 along K or N where
it is not a multiple of 128) loops over its
group's row tiles, the trip count read from a table (`emit_pipeline`'s dynamic grid; zero steps
for an empty group): one `wgmma` per step on x^T [K, Mp] and dy^T [N, Mp] (both K-major: the
wrapper transposes them), promoted by the step's scale of each row of x^T and each column of
dy (`acc += partial * sx[step, k] * sdy[step, n]`, where `gmm` promotes by one scale per row
and block). Interpreted, it takes dy [Mp, N] untransposed and reads the scales through plain
ref reads, as `gmm` does. Compiled for an H100: the same eight e4m3 `wgmma` per step; ptxas
reports 255 registers and 196 bytes of spill stores, more than `gmm`'s 96 at 128 rows: besides
the two float32 tiles, a step's column scales are 32 values per thread (the WGMMA column
layout) where `gmm` has one block scale. A 64 x 64 tile: four `m64n64k32` per step, 96
registers, no spill; 128 x 64: eight, 145 registers, no spill.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from expertax.fp8.hopper import mosaic
from expertax.fp8.hopper.layout import (
    NARROW,
    TILE,
    local_groups,
    pad,
    padding,
    tile_for,
    tile_scope,
)
from expertax.fp8.quant import E4M3, quantize_blocks


class WgradOperands(NamedTuple):
    """The wgrad's quantized operands in the padded layout (`wgrad_operands`): Mp rows, each
    row tile in one group; scales per 128-row tile, per channel."""

    x: jax.Array  # [Mp, K] e4m3
    x_scale: jax.Array  # [Mp / 128, K] float32
    dy: jax.Array  # [Mp, N] e4m3
    dy_scale: jax.Array  # [Mp / 128, N] float32
    first_tile: jax.Array  # [G] int32: each group's first row tile
    tiles: jax.Array  # [G] int32: its row tiles


def wgrad(
    x, dy, sizes, *, group_offset=None, num_groups: int, out_dtype=jnp.float32, interpret=False
):
    """The weight gradient `x[rows of g]^T @ dy[rows of g]` of each local group g under the
    `fp8_blockwise` recipe: `x` [M, K] and `dy` [M, N] unquantized (float32 or bfloat16), rows
    sorted by group, `sizes` [G_all] with `group_offset` as for `gmm` (the `num_groups` local
    groups' rows; the other rows are ignored); returns [num_groups, K, N] in `out_dtype` (an
    empty group's matrix is zero). K and N are multiples of 64 (`tile_for`: the [K, N] tiles
    64 wide along a dim that is not a multiple of 128).

    Both operands are quantized along the rows, the wgrad's contraction (`wgrad_operands`), in
    the padded layout: each group's rows from a row tile on, zero-filled to the next, and one
    scale per 128-row tile per channel (`scale = amax / 448`, `quantize_blocks`). That is
    DeepSeek-V3's per-expert tiling: a tile never mixes two groups, as the per-128-row promotion
    needs (one scale per row of x^T and per column of dy over a contraction step). The
    dequantized grouped wgrad (fp8/products.py) tiles the rows globally instead (a tile may
    straddle two groups and share their amax): the same recipe, other scales where a group does
    not start on a multiple of 128."""
    operands = wgrad_operands(x, dy, sizes, group_offset=group_offset, num_groups=num_groups)
    return wgrad_quantized(*operands, out_dtype=out_dtype, interpret=interpret)


def wgrad_counted(
    x, dy, sizes, *, group_offset=None, num_groups: int, interpret=False, tensorwise=False
):
    """`wgrad` (float32) and the e4m3 values each of the M rows was multiplied as ([M, K] and
    [M, N], zero outside the groups), for the quantizer counts (fp8/stats.py); `tensorwise`:
    as `wgrad_operands`."""
    local, first = local_groups(sizes, group_offset, num_groups)
    layout = padding(x.shape[0], local, first)
    ops = wgrad_operands(
        x, dy, sizes, group_offset=group_offset, num_groups=num_groups, tensorwise=tensorwise
    )
    dw = wgrad_quantized(*ops, interpret=interpret)
    inside = (layout.rows >= 0)[:, None]

    def rows(q):
        return jnp.where(inside, q[jnp.maximum(layout.rows, 0)], jnp.zeros((), q.dtype))

    return dw, rows(ops.x), rows(ops.dy)


def wgrad_operands(
    x, dy, sizes, *, group_offset=None, num_groups: int, tensorwise=False
) -> WgradOperands:
    """`wgrad`'s padding and quantization: the rows of the local groups gathered into the padded
    layout (`padding`: `padded_rows(M, G)` rows, zero outside the groups) and quantized in
    128 x 1 blocks (per row tile, per channel); `tensorwise` (the `fp8_tensorwise` recipe):
    one scale per operand (the local groups' amax: the padding and the other rows are zeros),
    broadcast to the kernel's grid."""
    (m, k), n = x.shape, dy.shape[-1]
    if dy.shape != (m, n) or k % NARROW or n % NARROW:
        raise ValueError(
            f"wgrad takes x [M, K] and dy [M, N] with K and N multiples of {NARROW}: got x "
            f"{tuple(x.shape)} and dy {tuple(dy.shape)}"
        )
    local, first = local_groups(sizes, group_offset, num_groups)
    layout = padding(m, local, first)

    def tiles(a):
        a = pad(a, layout)
        if not tensorwise:
            return quantize_blocks(a, TILE, 1)
        q, scale = quantize_blocks(a, *a.shape)
        return q, jnp.broadcast_to(scale, (a.shape[0] // TILE, a.shape[1]))

    (x_q, x_s), (dy_q, dy_s) = tiles(x), tiles(dy)
    return WgradOperands(x_q, x_s, dy_q, dy_s, layout.first_tile, layout.tiles)


def wgrad_quantized(
    x, x_scale, dy, dy_scale, first_tile, tiles, *, out_dtype=jnp.float32, interpret=False
):
    """The kernel's wgrad from `WgradOperands` (e4m3 [Mp, K] and [Mp, N] whose row tiles
    `first_tile[g]` to `first_tile[g] + tiles[g]` hold group g, scales [Mp / 128, K] and
    [Mp / 128, N]): [G, K, N] in `out_dtype`.

    Hopper's fp8 `wgmma` reads both operands K-major (the contraction, here the rows, minor), so
    the GPU kernel takes x^T [K, Mp] and dy^T [N, Mp]: a transpose of the e4m3 values, one read
    and one write of Mp (K + N) bytes (under jit XLA can fuse it into the quantizer that writes
    them; not measured). The interpreter, which has no transposed views in `wgmma`, takes dy
    [Mp, N] as it is (the module docstring)."""
    (mp, k), n = x.shape, dy.shape[1]
    want = {"dy": (dy.shape, (mp, n)), "x scales": (x_scale.shape, (mp // TILE, k))}
    want["dy scales"] = (dy_scale.shape, (mp // TILE, n))
    if x.dtype != E4M3 or dy.dtype != E4M3 or mp % TILE or k % NARROW or n % NARROW:
        raise ValueError(
            f"wgrad_quantized takes e4m3 x [Mp, K] and dy [Mp, N], Mp a multiple of {TILE}, K "
            f"and N of {NARROW}: "
            f"got {x.dtype} {tuple(x.shape)} and {dy.dtype} {tuple(dy.shape)}"
        )
    for name, (got, shape) in want.items():
        if tuple(got) != shape:
            raise ValueError(f"{name} have shape {tuple(got)}, expected {shape}")
    dy_kernel = dy if interpret else dy.T
    table = (first_tile.astype(jnp.int32), tiles.astype(jnp.int32))
    return _wgrad_kernel(x.T, x_scale, dy_kernel, dy_scale, *table, out_dtype, interpret)


def _wgrad_kernel(xt, xs, dy_kernel, dys, first_tile, tiles, out_dtype, interpret):
    """[G, K, N]: one CTA per group and `tile_for(K)` x `tile_for(N)` tile of its [K, N] (128,
    or 64 along a dim that is not a multiple of 128: the scales here are per channel, so a
    narrow tile only shortens the scale vectors), a pipelined loop over the group's `tiles[g]`
    128-row tiles (a trip count read from the table: `emit_pipeline`'s dynamic grid, zero steps
    for an empty group). xt [K, Mp] e4m3; dy_kernel [N, Mp] ([Mp, N] interpreted); xs
    [Mp / 128, K], dys [Mp / 128, N]: a step's scales of a tile are one contiguous row for
    TMA."""
    k = xt.shape[0]
    n = dys.shape[1]
    g = first_tile.shape[0]
    tk, tn = tile_for(k), tile_for(n)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def body(first_gmem, tiles_gmem, xt_gmem, xs_gmem, dy_gmem, dys_gmem, out_gmem):
        gi = jax.lax.axis_index("g")
        ki = jax.lax.axis_index("k")
        ni = jax.lax.axis_index("n")
        start = first_gmem[gi]

        def step(idx, x_smem, xs_smem, dy_smem, dys_smem, carry):
            partial = mosaic.mma(x_smem, dy_smem, (tk, tn), interpret)
            x_s = mosaic.vector(xs_smem, row_layout, interpret)
            dy_s = mosaic.vector(dys_smem, col_layout, interpret)
            # the per-128-row promotion: x^T's row scale times dy's column scale
            rows = jax.lax.broadcast_in_dim(x_s, (tk, tn), (0,))
            cols = jax.lax.broadcast_in_dim(dy_s, (tk, tn), (1,))
            return carry + partial * rows * cols

        if interpret:  # dy [Mp, N] as it is
            dy_spec = plgpu.BlockSpec(
                (TILE, tn), lambda s: (start + s, ni), transforms=mosaic.transforms(E4M3, tn)
            )
        else:  # dy^T [N, Mp]: K-major
            dy_spec = plgpu.BlockSpec(
                (tn, TILE), lambda s: (ni, start + s), transforms=mosaic.transforms(E4M3)
            )
        acc = plgpu.emit_pipeline(
            step,
            grid=(tiles_gmem[gi],),
            in_specs=[
                plgpu.BlockSpec(
                    (tk, TILE), lambda s: (ki, start + s), transforms=mosaic.transforms(E4M3)
                ),
                plgpu.BlockSpec((1, tk), lambda s: (start + s, ki)),
                dy_spec,
                plgpu.BlockSpec((1, tn), lambda s: (start + s, ni)),
            ],
            max_concurrent_steps=2,
            init_carry=mosaic.zero((tk, tn), interpret),
        )(xt_gmem, xs_gmem, dy_gmem, dys_gmem)
        mosaic.store(acc, out_gmem.at[gi, pl.ds(ki * tk, tk), pl.ds(ni * tn, tn)])

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(g, k // tk, n // tn),
        grid_names=("g", "k", "n"),
        interpret=mosaic.interpreter() if interpret else None,
    )
    with jax.named_scope(tile_scope(TILE)):
        return kernel(first_tile, tiles, xt, xs, dy_kernel, dys)
