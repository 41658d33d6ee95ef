"""The layout the Hopper kernels take the rows of their groups in.

Groups and tiles: the wrapper pads each group to a multiple of the row tile (`tile_rows`, 64 or
128: a gather of the e4m3 rows and their scales into `M + G * (tile_rows - 1)` rows rounded up
to the tile), so that each row tile belongs to one group; the kernel reads the tile's group
from a table and skips the tiles past the last group; a second gather takes the output rows
back (zero past the groups). The cost: two gathers (the rows at 1 + 4/128 bytes per value, the
output in `out_dtype`) and at most one tile of wasted rows per group, half a tile on average,
the same work a megablox-like schedule of (tile, group) items would spend on a tile that two
groups share. Hopper's `wgmma` multiplies 64 rows per instruction (m64nNk32), so a 64-row tile
(one instruction high) halves that waste, which matters where groups hold few rows; a 128-row
tile reuses each 128 x 128 weight tile it loads for twice the rows (`fp8/matmul.py` picks by the
balanced rows per group; the dense linears, one group, keep 128). Along K and N the tiles are
the recipe's 128 (the weight's blocks, the per-128-K promotion) wherever the dim is a multiple
of 128, whatever the row tile. A dim that is a multiple of 64 and not of 128 (DeepSeek-V3's MLA
wkv_a, 7168 -> 576 = 4.5 x 128) takes 64-wide output tiles or K steps instead of being
zero-padded to whole 128s (11 % more work for wkv_a): `wgmma` takes N in multiples of 8 and K
in steps of 32, so 64 is as native; a 64-wide tile or step reads the scale of the 128-block it
lies in (block `index * 64 // 128`), so the products are the recipe's, the promotion running
every 64 values of K instead of 128. The kernel call is traced under the named scope
`fp8_tile~{tile_rows}` (`tile_scope`), from which the planner counts its padded rows
(planner/flops.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax import scopes
from expertax.fp8 import kernel

TILE = kernel.TILE  # rows per tile, output columns per tile, K per step: the recipe's block
NARROW = kernel.NARROW  # the narrow tile along K and N (fp8/kernel.py)
# the fprop's and dgrad's row tiles: `wgmma` multiplies 64 rows per instruction (m64nNk32), so a
# 64-row tile is one instruction high; the wgrad's rows are its contraction, tiled at TILE
TILE_ROWS = (64, TILE)


def tile_for(dim: int) -> int:
    """The kernel's tile along an output width or a contraction of `dim` values: the recipe's
    128 where it divides `dim` (each tile or K step one scale block), else 64 (two tiles or
    steps per block, each promoted by the block's scale: the same products, the promotion
    every 64 values of K instead of 128)."""
    return TILE if dim % TILE == 0 else NARROW


def blocks(dim: int) -> int:
    """The scale blocks along a dim of `dim` values: the last one partial (64 wide) where `dim`
    is not a multiple of 128 (`fp8.quant.quantize_blocks`'s edge blocks)."""
    return -(-dim // TILE)


def local_groups(sizes, group_offset, g: int):
    """(the sizes [G] of the `g` local groups from `group_offset` on, the row where the first
    starts: the rows of the groups before it)."""
    sizes = sizes.astype(jnp.int32)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    first = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0))
    return jax.lax.dynamic_slice_in_dim(sizes, offset, g), first


def padded_rows(m: int, g: int, tile: int = TILE) -> int:
    """The rows of the padded operand: every group rounded up to the row tile `tile`, at most
    `g * (tile - 1)` rows more than `m`, a whole number of tiles."""
    return -(-(m + g * (tile - 1)) // tile) * tile


class Padding(NamedTuple):
    """Where the rows of the groups go when each group starts at a row tile (`padding`)."""

    src: jax.Array  # [Mp] int32: each padded row's source row (0 outside the groups)
    valid: jax.Array  # [Mp] bool: whether the padded row holds one of the groups' rows
    first_tile: jax.Array  # [G] int32: each group's first row tile (in `padding`'s tiles)
    tiles: jax.Array  # [G] int32: its row tiles (0 for an empty group)
    rows: jax.Array  # [M] int32: each row's padded row (-1 outside the groups)


def padding(m: int, sizes, first, tile: int = TILE) -> Padding:
    """The padded layout of `m` rows whose local groups of `sizes` [G] rows start at row `first`
    (groups cut at row `m`): `padded_rows(m, G, tile)` rows, each group's rows from its first
    row tile on, zero-filled up to its next (`tile` rows: the fprop's and dgrad's `tile_rows`;
    the wgrad's quantization tile is the recipe's 128, the default)."""
    g = sizes.shape[0]
    mp = padded_rows(m, g, tile)
    bounds = jnp.minimum(first + jnp.cumsum(sizes), m)
    sizes = bounds - jnp.minimum(bounds - sizes, m)
    ends = first + jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = -(-sizes // tile)
    tile_ends = jnp.cumsum(tiles)
    pad_starts = (tile_ends - tiles) * tile
    # each padded row's source row
    p = jnp.arange(mp, dtype=jnp.int32)
    pg = jnp.searchsorted(tile_ends * tile, p, side="right")  # the group of padded row p
    pgc = jnp.minimum(pg, g - 1)
    src = starts[pgc] + p - pad_starts[pgc]
    valid = (pg < g) & (src < ends[pgc])
    # each original row's padded row
    r = jnp.arange(m, dtype=jnp.int32)
    rg = jnp.minimum(jnp.searchsorted(ends, r, side="right"), g - 1)
    rows = jnp.where((r >= first) & (r < ends[-1]), pad_starts[rg] + r - starts[rg], -1)
    first_tile = (tile_ends - tiles).astype(jnp.int32)
    return Padding(jnp.where(valid, src, 0), valid, first_tile, tiles.astype(jnp.int32), rows)


def pad(x, layout: Padding):
    """The rows `x` [M, C] in the padded layout [Mp, C], zero outside the groups."""
    return jnp.where(layout.valid[:, None], x[layout.src], jnp.zeros((), x.dtype))


def pad_groups(x, x_scale, sizes, first, tile: int):
    """(x with each group's rows (from row `first` on) starting at a row tile of `tile` rows, its
    scales likewise (rows outside the groups zero), the group of each row tile (-1 past the
    groups), and for each of the M rows its row in the padded operand (-1 outside the groups))."""
    layout = padding(x.shape[0], sizes, first, tile)
    g = sizes.shape[0]
    t = jnp.arange(layout.valid.shape[0] // tile, dtype=jnp.int32)
    tile_group = jnp.searchsorted(layout.first_tile + layout.tiles, t, side="right")
    tile_group = jnp.where(tile_group < g, tile_group, -1).astype(jnp.int32)
    xs_pad = pad(x_scale, layout).astype(jnp.float32)
    return pad(x, layout), xs_pad, tile_group, layout.rows


def tile_scope(tile_rows: int) -> str:
    """The named scope a kernel call is traced under: its row tile, which the planner's FLOP
    count reads from the custom call's op_name (planner/flops.py: each group's padding is half
    a row tile on average)."""
    return scopes.FP8_TILE.label(tile_rows)
