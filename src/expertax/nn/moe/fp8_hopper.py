"""A block-scaled fp8 grouped GEMM for Hopper: e4m3 `wgmma` with per-128-K float32 promotion.

`gmm(x, x_scale, w, w_scale, sizes)` multiplies the rows of each group by its expert's
weight, both operands e4m3 in the `fp8_blockwise` recipe's layout (DeepSeek-V3, Sec. 3.3):
- `x` [M, K] e4m3, `x_scale` [M, K / 128] float32: 1 x 128 tiles along K;
- `w` [G, K, N] e4m3, `w_scale` [G, K / 128, N / 128] float32: 128 x 128 blocks;
  K and N multiples of 64; where one is not a multiple of 128 its last block is 64 wide (the
  grids' K / 128 and N / 128 rounded up, as `quant.quantize_blocks` cuts an edge block);
- `sizes` [G] int32, rows sorted by group, `sum(sizes) <= M`; the rows past the sum are zero
  (`group_offset`: the local groups of an expert-parallel shard, as `moe/gmm.py` takes them).
The output is [M, N] in `out_dtype`.

The kernel (Pallas Mosaic GPU, one CTA per output tile of `tile_rows` (64 or 128) rows by
`tile_cols` columns, one warpgroup) runs a K loop of `k_step`-wide steps, TMA-pipelined (both
128, or 64 along a dim that is not a multiple of 128, `tile_for`: below): each step is one `wgmma`
over the step's e4m3 tiles into a fresh float32 accumulator, then the promotion `out += partial *
x_scale[row, k] * w_scale[g, k, n]` in float32 registers (DeepSeek's per-128-K promotion: the tensor
cores' accumulation never runs past 128 values of K). Hopper's fp8 `wgmma` reads both operands
K-major from shared memory (mosaic/gpu/wgmma.py: only 16-bit types may be transposed), so the kernel
takes the weight [G, N, K] (`gmm` transposes it; `dgrad`'s contraction is N, the weight's minor axis
as held) and multiplies its tile's transposed view.

Groups and tiles: the wrapper pads each group to a multiple of the row tile (`tile_rows`, 64 or
128: a gather of the e4m3 rows and their scales into `M + G * (tile_rows - 1)` rows rounded up
to the tile), so that each row tile belongs to one group; the kernel reads the tile's group
from a table and skips the tiles past the last group; a second gather takes the output rows
back (zero past the groups). The cost: two gathers (the rows at 1 + 4/128 bytes per value, the
output in `out_dtype`) and at most one tile of wasted rows per group, half a tile on average,
the same work a megablox-like schedule of (tile, group) items would spend on a tile that two
groups share. Hopper's `wgmma` multiplies 64 rows per instruction (m64nNk32), so a 64-row tile
(one instruction high) halves that waste, which matters where groups hold few rows; a 128-row
tile reuses each 128 x 128 weight tile it loads for twice the rows (`fp8_gmm.py` picks by the
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

`dgrad(dy, dy_scale, w, w_scale, sizes)` is the same kernel on the output gradient in 1 x 128
tiles along N with each expert's weight as held ([G, K, N]: N minor, the dgrad's contraction)
and its scale grid transposed.

The interpreter (`interpret=True`: Pallas's Mosaic GPU interpreter on CPU, jax 0.10.2) cannot
read a transposed shared-memory view in `wgmma` (it accepts only index transforms there), nor run
`plgpu.load` or `plgpu.layout_cast`; interpreted, the kernel takes the weight [G, K, N] (the
contraction first: tiles used as they are), reads the row scales through a plain ref read and
starts from an unlaid-out zero. Everything else (the schedule, the TMA pipeline, `wgmma` into a
float32 accumulator, the promotion, the stores) is the code the GPU runs. The interpreter
multiplies e4m3 in NumPy with float32 results, not bit for bit the tensor cores' accumulation
order.

Compiled for an H100 (no GPU needed: the CUDA plugin runs Mosaic GPU's pipeline and ptxas in
XLA's compile), a step is `wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3` for sm_90a,
four per 64 rows of the tile (eight at 128). The float32 tile is held twice (the partial and
the promoted sum): at 128 rows ptxas reports 255 registers and a small spill (96 bytes of
stores, 88 of loads); at 64 rows 143 registers (144 for the dgrad) and no spill. Two consumer
warpgroups of 64 rows each would give a 128-row tile the 64-row tile's registers (not done).
A 64-column tile is `m64n64k32` (64 x 64 at 64-wide K steps: two per step, 83 registers; 128
x 64 at 128-wide steps, the dense wkv_a's fprop: eight, 156 registers; no spill in either).

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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from expertax import quant

TILE = 128  # rows per tile, output columns per tile, K per step: the recipe's block
# the narrow tile along K and N for dims that are multiples of 64 but not of 128 (MLA's wkv_a,
# 576 wide): `wgmma` takes N in multiples of 8 and K in steps of 32, so 64 is as native as 128;
# a 128 x 128 scale block then covers two tiles or steps (`tile_for`)
NARROW = 64
# the fprop's and dgrad's row tiles: `wgmma` multiplies 64 rows per instruction (m64nNk32), so a
# 64-row tile is one instruction high; the wgrad's rows are its contraction, tiled at TILE
TILE_ROWS = (64, TILE)
E4M3 = jnp.float8_e4m3fn


def tile_for(dim: int) -> int:
    """The kernel's tile along an output width or a contraction of `dim` values: the recipe's
    128 where it divides `dim` (each tile or K step one scale block), else 64 (two tiles or
    steps per block, each promoted by the block's scale: the same products, the promotion
    every 64 values of K instead of 128)."""
    return TILE if dim % TILE == 0 else NARROW


def blocks(dim: int) -> int:
    """The scale blocks along a dim of `dim` values: the last one partial (64 wide) where `dim`
    is not a multiple of 128 (`quant.quantize_blocks`'s edge blocks)."""
    return -(-dim // TILE)


def gmm(
    x, x_scale, w, w_scale, sizes, *, group_offset=None, out_dtype=jnp.bfloat16,
    tile_rows: int = TILE, interpret=False,
):  # fmt: skip
    """The fprop `x @ w[g]` per group: `x` [M, K] e4m3, `x_scale` [M, K / 128] (1 x 128 tiles),
    `w` [G, K, N] e4m3 as the experts' weights are held, `w_scale` [G, K / 128, N / 128];
    returns [M, N] in `out_dtype`. `sizes` [G_all] with `group_offset` (EP: the G local groups
    are `sizes[offset:offset + G]`, their rows follow the earlier groups'; the rows outside them
    are zero). `tile_rows` (64 or 128): the rows of an output tile, each group padded to a
    multiple of it (the module docstring). `interpret`: run in Pallas's Mosaic GPU interpreter
    on CPU.

    The GPU kernel reads each expert's matrix K-major ([G, N, K]): the weight is transposed here,
    a copy of its e4m3 bytes (under jit XLA fuses it into the quantizer that makes `w`)."""
    _check(x, x_scale, w, w_scale, contraction=1, tile_rows=tile_rows)
    w_kernel = w if interpret else jnp.swapaxes(w, 1, 2)
    return _product(
        x, x_scale, w_kernel, w_scale, sizes, group_offset, out_dtype, tile_rows, interpret
    )


def dgrad(
    dy, dy_scale, w, w_scale, sizes, *, group_offset=None, out_dtype=jnp.bfloat16,
    tile_rows: int = TILE, interpret=False,
):  # fmt: skip
    """The dgrad `dy @ w[g]^T` per group: `dy` [M, N] e4m3 with `dy_scale` [M, N / 128] (1 x 128
    tiles along N, the contraction), `w` [G, K, N] and `w_scale` [G, K / 128, N / 128] as for
    `gmm` (the fprop's operands), `tile_rows` as for `gmm`; returns [M, K]. The GPU kernel reads
    `w` as it is held (N, the contraction, minor): no copy; its 128 x 128 scale grid is
    transposed (G K N / 128^2 floats)."""
    _check(dy, dy_scale, w, w_scale, contraction=2, tile_rows=tile_rows)
    w_kernel = jnp.swapaxes(w, 1, 2) if interpret else w
    ws_t = jnp.swapaxes(w_scale, 1, 2)
    return _product(
        dy, dy_scale, w_kernel, ws_t, sizes, group_offset, out_dtype, tile_rows, interpret
    )


def _product(x, x_scale, w_kernel, w_scale, sizes, group_offset, out_dtype, tile_rows, interpret):
    """The kernel's product of the rows `x` [M, C] (C the contraction) with `w_kernel`: [G, O, C]
    for the GPU, [G, C, O] interpreted; `w_scale` [G, C / 128, O / 128] (whole blocks rounded
    up); in row tiles of `tile_rows`, output columns and K steps of `tile_for` O and C."""
    g, n = w_kernel.shape[0], w_kernel.shape[2 if interpret else 1]
    local, first = _local_groups(sizes, group_offset, g)
    x_pad, xs_pad, tile_group, rows = _pad_groups(x, x_scale, local, first, tile_rows)
    args = (x_pad, xs_pad.T, w_kernel, w_scale, tile_group, n, out_dtype, interpret)
    tiles = {"tile_cols": tile_for(n), "k_step": tile_for(x.shape[1])}
    out = _kernel(*args, tile_rows=tile_rows, **tiles)
    return jnp.where(rows[:, None] >= 0, out[jnp.maximum(rows, 0)], 0).astype(out_dtype)


def _local_groups(sizes, group_offset, g: int):
    """(the sizes [G] of the `g` local groups from `group_offset` on, the row where the first
    starts: the rows of the groups before it)."""
    sizes = sizes.astype(jnp.int32)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    first = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0))
    return jax.lax.dynamic_slice_in_dim(sizes, offset, g), first


def _check(x, x_scale, w, w_scale, contraction, tile_rows):
    if tile_rows not in TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {TILE_ROWS}, got {tile_rows}")
    if x.dtype != E4M3 or w.dtype != E4M3:
        raise ValueError(f"operands must be e4m3, got {x.dtype} and {w.dtype}")
    g, k, n = w.shape
    if k % NARROW or n % NARROW:
        raise ValueError(f"the weight's K={k} and N={n} must be multiples of {NARROW}")
    c = (k, n)[contraction - 1]
    want = {
        "rows": (x.shape, (x.shape[0], c)),
        "row scales": (x_scale.shape, (x.shape[0], blocks(c))),
        "weight scales": (w_scale.shape, (g, blocks(k), blocks(n))),
    }
    for name, (got, shape) in want.items():
        if tuple(got) != shape:
            raise ValueError(f"{name} have shape {tuple(got)}, expected {shape}")


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


def _pad_groups(x, x_scale, sizes, first, tile: int):
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


# Pallas's Mosaic GPU interpreter: its parameters object (`InterpretGPUParams`), which jax
# 0.10.2 does not export from a public module, so the library never imports it: whoever runs
# the kernels interpreted sets it (tests/conftest.py). None: no interpreter.
INTERPRETER: Any = None


def _interpreter():
    if INTERPRETER is None:
        raise RuntimeError(
            "fp8_hopper: running the kernels interpreted needs Pallas's Mosaic GPU interpreter "
            "parameters, which jax 0.10.2 does not export: set fp8_hopper.INTERPRETER to an "
            "InterpretGPUParams (tests/conftest.py does); on a Hopper GPU nothing is needed"
        )
    return INTERPRETER


def _transforms(dtype, minor: int = TILE):
    """The shared-memory tiling and swizzle of a block whose minor dim holds `minor` values:
    the largest swizzle its rows take (128 bytes for 128 e4m3 values, 64 for 64)."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def _mma(a_smem, b_smem, shape, interpret):
    """A fresh float32 product of two e4m3 tiles in shared memory, `shape` [rows, columns] (64
    or 128 by 64 or 128), one `wgmma`: `a` [rows, contraction]; `b` [columns, contraction]
    (K-major, read through its transposed view) on the GPU, [contraction, columns]
    interpreted."""
    b_tile = b_smem if interpret else plgpu.transpose_ref(b_smem, (1, 0))

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_tile)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def _vector(smem, layout, interpret):
    """The float32 scales of a [1, 64 or 128] shared-memory block in registers, laid out to
    broadcast along a WGMMA tile's rows or columns (interpreted: a plain ref read)."""
    return smem[0, :] if interpret else plgpu.load(smem.at[0], (), layout=layout)


def _zero(shape, interpret):
    """A zero float32 accumulator of `shape` in the WGMMA layout (interpreted: unlaid-out)."""
    zero = jnp.zeros(shape, jnp.float32)
    return zero if interpret else plgpu.layout_cast(zero, plgpu.Layout.WGMMA)


def _store(acc, out_gmem):
    """The tile `acc` ([64 or 128, 64 or 128]) into the tile `out_gmem` of global memory (its
    shape, in its dtype), through shared memory and TMA."""
    dtype = out_gmem.dtype

    @functools.partial(
        pl.run_scoped,
        out_smem=plgpu.SMEM(acc.shape, dtype, transforms=_transforms(dtype, acc.shape[1])),
    )
    def _(out_smem):
        out_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)


def _kernel(
    x_pad, xs_t, w, w_scale, tile_group, n, out_dtype, interpret, *, tile_rows, tile_cols, k_step
):
    """The padded product [Mp, N] in tiles of `tile_rows` x `tile_cols` (64 or 128 each), over
    K steps of `k_step` (64 or 128): x_pad [Mp, K] e4m3, xs_t [K / 128, Mp] its scales
    transposed (a step's scales of a tile are one contiguous row for TMA); each row tile's
    group from `tile_group` [Mp / tile_rows]. A 64-wide tile or step takes the scale of the
    128-block it lies in (`index * width // 128`): two consecutive K steps of 64 read the same
    row of xs_t, the per-1 x 128 tile scales as quantized."""
    mp, k = x_pad.shape
    steps = k // k_step
    shape = (tile_rows, tile_cols)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(tile_group_gmem, x_gmem, xs_gmem, w_gmem, ws_gmem, out_gmem):
        mi = jax.lax.axis_index("m")
        ni = jax.lax.axis_index("n")
        g = tile_group_gmem[mi]

        @pl.when(g >= 0)
        def _():
            w_g = w_gmem.at[g]

            def step(idx, x_smem, xs_smem, w_smem, carry):
                (ki,) = idx
                partial = _mma(x_smem, w_smem, shape, interpret)
                x_s = _vector(xs_smem, row_layout, interpret)
                w_s = ws_gmem[g, ki * k_step // TILE, ni * tile_cols // TILE]
                promote = jax.lax.broadcast_in_dim(x_s * w_s, shape, (0,))
                return carry + partial * promote

            if interpret:  # [G, K, N]: the contraction first
                w_spec = plgpu.BlockSpec(
                    (k_step, tile_cols),
                    lambda ki: (ki, ni),
                    transforms=_transforms(E4M3, tile_cols),
                )
            else:  # [G, N, K]: K-major
                w_spec = plgpu.BlockSpec(
                    (tile_cols, k_step), lambda ki: (ni, ki), transforms=_transforms(E4M3, k_step)
                )
            x_spec = plgpu.BlockSpec(
                (tile_rows, k_step), lambda ki: (mi, ki), transforms=_transforms(E4M3, k_step)
            )
            # the row scales' block index is its row of xs_t: the step's 128-block
            xs_spec = plgpu.BlockSpec((1, tile_rows), lambda ki: (ki * k_step // TILE, mi))
            acc = plgpu.emit_pipeline(
                step,
                grid=(steps,),
                in_specs=[x_spec, xs_spec, w_spec],
                max_concurrent_steps=2,
                init_carry=_zero(shape, interpret),
            )(x_gmem, xs_gmem, w_g)
            rows, cols = pl.ds(mi * tile_rows, tile_rows), pl.ds(ni * tile_cols, tile_cols)
            _store(acc, out_gmem.at[rows, cols])

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // tile_rows, n // tile_cols),
        grid_names=("m", "n"),
        interpret=_interpreter() if interpret else None,
    )
    with jax.named_scope(tile_scope(tile_rows)):
        return kernel(tile_group, x_pad, xs_t, w, w_scale)


def tile_scope(tile_rows: int) -> str:
    """The named scope a kernel call is traced under: its row tile, which the planner's FLOP
    count reads from the custom call's op_name (planner/flops.py: each group's padding is half
    a row tile on average)."""
    return f"fp8_tile~{tile_rows}"


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
    scale per 128-row tile per channel (`scale = amax / 448`, `quant.quantize_blocks`). That is
    DeepSeek-V3's per-expert tiling: a tile never mixes two groups, as the per-128-row promotion
    needs (one scale per row of x^T and per column of dy over a contraction step).
    `fp8_gmm.py`'s dequantized wgrad tiles the rows globally instead (a tile may straddle two
    groups and share their amax): the same recipe, other scales where a group does not start on
    a multiple of 128."""
    operands = wgrad_operands(x, dy, sizes, group_offset=group_offset, num_groups=num_groups)
    return wgrad_quantized(*operands, out_dtype=out_dtype, interpret=interpret)


def wgrad_counted(
    x, dy, sizes, *, group_offset=None, num_groups: int, interpret=False, tensorwise=False
):
    """`wgrad` (float32) and the e4m3 values each of the M rows was multiplied as ([M, K] and
    [M, N], zero outside the groups), for the quantizer counts (nn/fp8_stats.py); `tensorwise`:
    as `wgrad_operands`."""
    local, first = _local_groups(sizes, group_offset, num_groups)
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
    local, first = _local_groups(sizes, group_offset, num_groups)
    layout = padding(m, local, first)

    def tiles(a):
        a = pad(a, layout)
        if not tensorwise:
            return quant.quantize_blocks(a, TILE, 1)
        q, scale = quant.quantize_blocks(a, *a.shape)
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
            partial = _mma(x_smem, dy_smem, (tk, tn), interpret)
            x_s = _vector(xs_smem, row_layout, interpret)
            dy_s = _vector(dys_smem, col_layout, interpret)
            # the per-128-row promotion: x^T's row scale times dy's column scale
            rows = jax.lax.broadcast_in_dim(x_s, (tk, tn), (0,))
            cols = jax.lax.broadcast_in_dim(dy_s, (tk, tn), (1,))
            return carry + partial * rows * cols

        if interpret:  # dy [Mp, N] as it is
            dy_spec = plgpu.BlockSpec(
                (TILE, tn), lambda s: (start + s, ni), transforms=_transforms(E4M3, tn)
            )
        else:  # dy^T [N, Mp]: K-major
            dy_spec = plgpu.BlockSpec(
                (tn, TILE), lambda s: (ni, start + s), transforms=_transforms(E4M3)
            )
        acc = plgpu.emit_pipeline(
            step,
            grid=(tiles_gmem[gi],),
            in_specs=[
                plgpu.BlockSpec(
                    (tk, TILE), lambda s: (ki, start + s), transforms=_transforms(E4M3)
                ),
                plgpu.BlockSpec((1, tk), lambda s: (start + s, ki)),
                dy_spec,
                plgpu.BlockSpec((1, tn), lambda s: (start + s, ni)),
            ],
            max_concurrent_steps=2,
            init_carry=_zero((tk, tn), interpret),
        )(xt_gmem, xs_gmem, dy_gmem, dys_gmem)
        _store(acc, out_gmem.at[gi, pl.ds(ki * tk, tk), pl.ds(ni * tn, tn)])

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(g, k // tk, n // tn),
        grid_names=("g", "k", "n"),
        interpret=_interpreter() if interpret else None,
    )
    with jax.named_scope(tile_scope(TILE)):
        return kernel(first_tile, tiles, xt, xs, dy_kernel, dys)
