"""The three products of an fp8 matmul (fp8/matmul.py), each where fp8/kernel.py puts it.

A product takes the recipe's quantized operands (fp8/recipes.py) and runs on one of:
- the dequantized operands in their dtype: a dense linear's `dot_general` (under
  `fp8_tensorwise` a scalar-scaled dot, which XLA:GPU rewrites into cuBLASLt's fp8 GEMM), or the
  routed experts' configured grouped-matmul backend (`gmm_impl`, nn/moe/gmm.py: its kernels for
  all three products, its VJP giving the dgrad and the wgrad; no backend multiplies e4m3, so
  fp8's bytes without its tensor cores: docs/design/fp8.md, "Grouped GEMM");
- Hopper's kernels (fp8/hopper/, imported here only when a product runs on them): the routed
  experts' fprop, dgrad and wgrad under either recipe (tensorwise scales broadcast to the
  block grids), and a dense linear's three products under `fp8_blockwise` as the kernels' one
  group, on each device's share of the rows (`_over_rows`), K and N zero-padded to multiples of
  64 where they are not (`kernel.padded`).

Each product runs under a named scope (in the compiled program's op names: which kernel
multiplies what, fp8/compiled.py): `scopes.FP8_DENSE` for a dense linear's, `scopes.FP8_GROUPED`
for the routed experts'.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from expertax import scopes
from expertax.fp8 import kernel, recipes
from expertax.nn.moe import gmm as gmm_mod
from expertax.nn.moe import tiles
from expertax.nn.moe.vma import varying_like
from expertax.sharding.rules import current_rules, logical_to_spec

TILE = recipes.TILE
# The Hopper kernel's fprop and dgrad pad each group's rows to whole row tiles: the waste is
# half a tile per group on average, a large share of the work where groups are small, which a
# 64-row tile (one `wgmma` high) halves. A 128-row tile reuses each weight tile it loads for
# twice the rows; from 1,024 rows per group on, its waste (64 rows: 6%) is small enough for
# that to pay. Where the program names no balanced rows per group (None): 64.
HOPPER_TILE_128_FROM_ROWS = 1024


class Spec(NamedTuple):
    """An fp8 matmul's static options (hashable: a custom VJP's nondiff argument)."""

    recipe: str
    grouped: bool  # the routed experts' grouped GEMM; False: a dense linear, [K, N], one group
    hopper: bool  # its products on Hopper's kernels (fp8/kernel.py)
    has_offset: bool = False  # grouped: a group offset (the local experts of an EP shard)
    backend: tuple = ()  # grouped: the backend's keywords (sorted items: backend, tile_rows, ...)
    expected: float | None = None  # grouped: the balanced rows per group (tiles.py)
    act: Any = None  # a gated activation whose output the rows are (`act(*xs)`), or None
    names: tuple[str, ...] = ()  # with `act`: the checkpoint names of its saved inputs

    def scope(self, i: int):
        return jax.named_scope((scopes.FP8_GROUPED if self.grouped else scopes.FP8_DENSE)[i])

    def offset(self, offset):
        return offset if self.has_offset else None


def hopper_tile_rows(spec: Spec) -> int:
    """The kernel's row tile (hopper/layout.TILE_ROWS) for the balanced rows per group
    `spec.expected` (`tiles.current_expected_rows()` where the products were traced)."""
    expected = spec.expected
    return 64 if expected is None or expected < HOPPER_TILE_128_FROM_ROWS else 128


def _rows_scope(spec: Spec):
    """The Hopper kernel's call traced under `rows~R` (R: the balanced rows per group, where
    named), as gmm_kernels.py names the bfloat16 kernels: the compiled FLOPs count both at the
    tiles those groups fill (planner/flops.py)."""
    expected = spec.expected
    return (
        jax.named_scope(scopes.ROWS.label(round(expected)))
        if expected
        else contextlib.nullcontext()
    )


def _grid(scale, shape):
    """A scale as the blockwise grid of `shape` (a tensorwise scale broadcast to it)."""
    return jnp.broadcast_to(scale.astype(jnp.float32), shape)


def _dot(a, b, dtype, contract):
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), preferred_element_type=jnp.float32
    ).astype(dtype)


def _backend(x_MK, w_EKN, sizes_E, offset, spec: Spec):
    """The grouped matmul on the configured backend (backend=HOPPER: its products in the
    operands' dtype are `auto`'s, gmm.py)."""
    with tiles.expected_group_rows(spec.expected):
        return gmm_mod.gmm(
            x_MK, w_EKN, sizes_E, group_offset=spec.offset(offset),
            preferred_element_type=x_MK.dtype, **dict(spec.backend),
        )  # fmt: skip


def fprop(spec: Spec, qx, qw, sizes, offset, dtype, w_dtype):
    """rows @ w (per group) from the quantized operands (rows in 1 x 128 tiles along K), in
    `dtype` (the rows'; `w_dtype`: the weight's)."""
    with spec.scope(0):
        if spec.hopper:
            return _hopper_product("gmm", spec, qx, qw, sizes, offset, dtype)
        x = recipes.dequantize(qx, dtype, 1, TILE)
        w = recipes.dequantize(qw, w_dtype, TILE, TILE)
        if not spec.grouped:
            return _dot(x, w, dtype, ((1,), (0,)))
        return _backend(x, w, sizes, offset, spec)


def dgrad(spec: Spec, q_dy, qw, x, w, sizes, offset):
    """dy @ w^T (per group): `q_dy` in 1 x 128 tiles along N; `x`, `w`: the fprop's operands
    dequantized, in the output's dtype (x: the primal of the backend's VJP)."""
    with spec.scope(1):
        if spec.hopper:
            return _hopper_product("dgrad", spec, q_dy, qw, sizes, offset, x.dtype)
        dy = recipes.dequantize(q_dy, x.dtype, 1, TILE)
        if not spec.grouped:
            return _dot(dy, w, x.dtype, ((1,), (1,)))
        _, pull = jax.vjp(lambda a: _backend(a, w, sizes, offset, spec), x)
        return pull(dy)[0]


def wgrad(spec: Spec, x, dy, w, sizes, offset):
    """dw = x^T dy (per group, over its rows; foreign rows already zeroed): both operands
    re-tiled along the rows (128 rows per scale, per channel), dequantized, multiplied on the
    dense dot or the backend's VJP; on Hopper the kernels' wgrad (blockwise: each group's rows
    padded to whole 128-row tiles, so a tile's scale is one group's; tensorwise: one scale per
    operand, as here). Returns (dw in w's dtype, the re-tiled operands' e4m3 values, for the
    counts)."""
    with spec.scope(2):
        if spec.hopper and (spec.grouped or spec.recipe == "fp8_blockwise"):
            return _hopper_wgrad(spec, x, dy, w, sizes, offset)
        qx_m = recipes.quantize(x, spec.recipe, TILE, 1)
        qdy_m = recipes.quantize(dy, spec.recipe, TILE, 1)
        x_m = recipes.dequantize(qx_m, x.dtype, TILE, 1)
        dy_m = recipes.dequantize(qdy_m, dy.dtype, TILE, 1)
        if not spec.grouped:
            return _dot(x_m, dy_m, w.dtype, ((0,), (0,))), qx_m[0], qdy_m[0]
        _, pull_w = jax.vjp(lambda b: _backend(x_m, b, sizes, offset, spec), w)
        return pull_w(dy_m)[0].astype(w.dtype), qx_m[0], qdy_m[0]


def _hopper_product(which: str, spec: Spec, q_rows, qw, sizes, offset, dtype):
    """The Hopper kernel's fprop (`which="gmm"`) or dgrad of the quantized rows with the
    weight: a dense linear's as one group over each device's rows, the routed experts' with the
    row tile for their balanced rows."""
    from expertax.fp8.hopper import gmm as hopper_gmm

    product = getattr(hopper_gmm, which)
    if not spec.grouped:
        out_axis = 1 if which == "gmm" else 0
        return _over_rows(lambda *a: _dense_kernel(product, dtype, out_axis, *a), q_rows, qw)
    (rows, rows_scale), (wq, ws) = q_rows, qw
    g, k, n = wq.shape
    c = k if which == "gmm" else n  # the contraction
    blocks = hopper_gmm.blocks  # a 64-wide last block where a dim is not a multiple of 128
    with _rows_scope(spec):
        return product(
            rows, _grid(rows_scale, (rows.shape[0], blocks(c))), wq,
            _grid(ws, (g, blocks(k), blocks(n))), sizes, group_offset=spec.offset(offset),
            out_dtype=dtype, tile_rows=hopper_tile_rows(spec), interpret=kernel.interpreting(),
        )  # fmt: skip


def _hopper_wgrad(spec: Spec, x, dy, w, sizes, offset):
    from expertax.fp8.hopper import wgrad as hopper_wgrad

    if spec.grouped:
        with _rows_scope(spec):
            dw, q_x_m, q_dy_m = hopper_wgrad.wgrad_counted(
                x, dy, sizes, group_offset=spec.offset(offset), num_groups=w.shape[0],
                interpret=kernel.interpreting(), tensorwise=spec.recipe == "fp8_tensorwise",
            )  # fmt: skip
        # the Pallas call's output declares no varying axes: it varies as the weight's cotangent
        return varying_like(dw.astype(w.dtype), w), q_x_m, q_dy_m

    def one_group(x, dy):
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        (k, n), pad = (x.shape[1], dy.shape[1]), kernel.padded
        x_p, dy_p = (jnp.pad(a, ((0, 0), (0, pad(d) - d))) for a, d in ((x, k), (dy, n)))
        dw, q_x, q_dy = hopper_wgrad.wgrad_counted(
            x_p, dy_p, sizes, num_groups=1, interpret=kernel.interpreting()
        )
        return dw[0, :k, :n], q_x[:, :k], q_dy[:, :n]

    dw, q_x_m, q_dy_m = _over_rows(one_group, (x, dy), (), summed=(True, False, False))
    return dw.astype(w.dtype), q_x_m, q_dy_m


def _to_tiles(a):
    """`a` [..., R, C] zero-padded to multiples of 64 (the kernel's narrowest tile) in its last
    two dims: nothing where they are (MLA's wkv_a, 576 wide); the scale grids are already
    whole (a partial block's scale is its real values' amax, which zeros keep)."""
    r, c = a.shape[-2:]
    pad = [(0, 0)] * (a.ndim - 2) + [(0, kernel.padded(r) - r), (0, kernel.padded(c) - c)]
    return jnp.pad(a, pad)


def _dense_kernel(product, dtype, out_axis, rows_MC, scales_MC, w_KN, w_scales):
    """`product` (hopper/gmm's `gmm` or `dgrad`) of the rows (e4m3, 1 x 128 scales along the
    contraction C) with the weight as the kernel's one group ([1, K, N]: all rows its group);
    K and N zero-padded to multiples of 64 (`kernel.padded`: most dims are already), the
    output's padding cut to the weight's dim `out_axis` (gmm: N, 1; dgrad: K, 0). The kernel's
    default 128-row tile: with one group the padding is under one tile in all, and a 128-row
    tile reuses each weight tile for twice the rows of a 64-row one."""
    sizes = jnp.full((1,), rows_MC.shape[0], jnp.int32)
    c, out = rows_MC.shape[1], w_KN.shape[out_axis]
    rows = jnp.pad(rows_MC, ((0, 0), (0, kernel.padded(c) - c)))
    y = product(
        rows, scales_MC, _to_tiles(w_KN)[None], w_scales[None], sizes, out_dtype=dtype,
        interpret=kernel.interpreting(),
    )  # fmt: skip
    return y[:, :out]


def _over_rows(fn, rows: tuple, whole: tuple, summed: tuple[bool, ...] | None = None):
    """`fn(*rows, *whole)` ([M, ...] each of `rows` -> [M, ...]) on each device's share of the
    rows: the kernel is a custom call that XLA's partitioner cannot split, and would run on the
    gathered rows of the whole batch on every device. The rows are the layer's [B, T] tokens
    flattened, split as the rules split (batch, length) over the mesh axes not already manual
    (a `shard_map` around); `whole` (the weight's e4m3 values and scales) replicated, which
    gathers a sharded weight in e4m3 as its dot gathers it in its dtype. `summed`: `fn` returns
    a tuple, and the outputs marked True are sums over the rows (the wgrad's [K, N]), summed
    over the devices' shares."""
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return fn(*rows, *whole)
    auto = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != AxisType.Manual
    }
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    axes: list[str] = []
    for entry in logical_to_spec(("batch", "length"), rules, mesh):
        for a in (entry,) if isinstance(entry, str) else entry or ():
            if a in auto and rows[0].shape[0] % math.prod(sizes[b] for b in (*axes, a)) == 0:
                axes.append(a)
    if not axes:
        return fn(*rows, *whole)
    split, rep = PartitionSpec(tuple(axes)), PartitionSpec()
    out_specs: Any = split
    body = fn
    if summed is not None:
        out_specs = tuple(rep if s else split for s in summed)

        def body(*args):
            outs = fn(*args)
            return tuple(jax.lax.psum(o, tuple(axes)) if s else o for o, s in zip(outs, summed))

    return jax.shard_map(
        body, mesh=mesh, in_specs=(*(split for _ in rows), *(rep for _ in whole)),
        out_specs=out_specs, axis_names=frozenset(axes), check_vma=False,
    )(*rows, *whole)  # fmt: skip
