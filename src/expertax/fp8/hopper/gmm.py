"""A block-scaled fp8 grouped GEMM for Hopper: e4m3 `wgmma` with per-128-K float32 promotion.

`gmm(x, x_scale, w, w_scale, sizes)` multiplies the rows of each group by its expert's
weight, both operands e4m3 in the `fp8_blockwise` recipe's layout (DeepSeek-V3, Sec. 3.3):
- `x` [M, K] e4m3, `x_scale` [M, K / 128] float32: 1 x 128 tiles along K;
- `w` [G, K, N] e4m3, `w_scale` [G, K / 128, N / 128] float32: 128 x 128 blocks;
  K and N multiples of 64; where one is not a multiple of 128 its last block is 64 wide (the
  grids' K / 128 and N / 128 rounded up, as `fp8.quant.quantize_blocks` cuts an edge block);
- `sizes` [G] int32, rows sorted by group, `sum(sizes) <= M`; the rows past the sum are zero
  (`group_offset`: the local groups of an expert-parallel shard, as `nn/moe/gmm.py` takes them).
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

`dgrad(dy, dy_scale, w, w_scale, sizes)` is the same kernel on the output gradient in 1 x 128
tiles along N with each expert's weight as held ([G, K, N]: N minor, the dgrad's contraction)
and its scale grid transposed.

Compiled for an H100 (no GPU needed: the CUDA plugin runs Mosaic GPU's pipeline and ptxas in
XLA's compile), a step is `wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3` for sm_90a,
four per 64 rows of the tile (eight at 128). The float32 tile is held twice (the partial and
the promoted sum): at 128 rows ptxas reports 255 registers and a small spill (96 bytes of
stores, 88 of loads); at 64 rows 143 registers (144 for the dgrad) and no spill. Two consumer
warpgroups of 64 rows each would give a 128-row tile the 64-row tile's registers (not done).
A 64-column tile is `m64n64k32` (64 x 64 at 64-wide K steps: two per step, 83 registers; 128
x 64 at 128-wide steps, the dense wkv_a's fprop: eight, 156 registers; no spill in either).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from expertax.fp8.hopper import mosaic
from expertax.fp8.hopper.layout import (
    NARROW,
    TILE,
    TILE_ROWS,
    blocks,
    local_groups,
    pad_groups,
    tile_for,
    tile_scope,
)
from expertax.fp8.quant import E4M3


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
    local, first = local_groups(sizes, group_offset, g)
    x_pad, xs_pad, tile_group, rows = pad_groups(x, x_scale, local, first, tile_rows)
    args = (x_pad, xs_pad.T, w_kernel, w_scale, tile_group, n, out_dtype, interpret)
    tiles = {"tile_cols": tile_for(n), "k_step": tile_for(x.shape[1])}
    out = _kernel(*args, tile_rows=tile_rows, **tiles)
    return jnp.where(rows[:, None] >= 0, out[jnp.maximum(rows, 0)], 0).astype(out_dtype)


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
                partial = mosaic.mma(x_smem, w_smem, shape, interpret)
                x_s = mosaic.vector(xs_smem, row_layout, interpret)
                w_s = ws_gmem[g, ki * k_step // TILE, ni * tile_cols // TILE]
                promote = jax.lax.broadcast_in_dim(x_s * w_s, shape, (0,))
                return carry + partial * promote

            if interpret:  # [G, K, N]: the contraction first
                w_spec = plgpu.BlockSpec(
                    (k_step, tile_cols),
                    lambda ki: (ki, ni),
                    transforms=mosaic.transforms(E4M3, tile_cols),
                )
            else:  # [G, N, K]: K-major
                w_spec = plgpu.BlockSpec(
                    (tile_cols, k_step),
                    lambda ki: (ni, ki),
                    transforms=mosaic.transforms(E4M3, k_step),
                )
            x_spec = plgpu.BlockSpec(
                (tile_rows, k_step), lambda ki: (mi, ki), transforms=mosaic.transforms(E4M3, k_step)
            )
            # the row scales' block index is its row of xs_t: the step's 128-block
            xs_spec = plgpu.BlockSpec((1, tile_rows), lambda ki: (ki * k_step // TILE, mi))
            acc = plgpu.emit_pipeline(
                step,
                grid=(steps,),
                in_specs=[x_spec, xs_spec, w_spec],
                max_concurrent_steps=2,
                init_carry=mosaic.zero(shape, interpret),
            )(x_gmem, xs_gmem, w_g)
            rows, cols = pl.ds(mi * tile_rows, tile_rows), pl.ds(ni * tile_cols, tile_cols)
            mosaic.store(acc, out_gmem.at[rows, cols])

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // tile_rows, n // tile_cols),
        grid_names=("m", "n"),
        interpret=mosaic.interpreter() if interpret else None,
    )
    with jax.named_scope(tile_scope(tile_rows)):
        return kernel(tile_group, x_pad, xs_t, w, w_scale)
