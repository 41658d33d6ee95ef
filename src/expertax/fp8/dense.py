"""fp8 training GEMMs: a linear whose three products (fprop, dgrad, wgrad) multiply e4m3 operands
with float32 accumulation, under one of two recipes (config key `quantization`).

The recipes (fp8/recipes.py): `fp8_tensorwise` leaves each product a scalar-scaled dot, which
XLA:GPU rewrites into cuBLASLt's fp8 GEMM on Hopper. XLA has no block-scaled fp8 GEMM: under
`fp8_blockwise` on a Hopper GPU all three products of a linear whose K and N are multiples of 64
(or zero-padded to them at little cost) run on `fp8/hopper/`'s kernels as one group (e4m3
`wgmma`, per-128 promotion, or per-64 along a dim that is not a multiple of 128; `fp8/kernel.py`
decides); every other product is dequantized and multiplied in the operands' dtype (fp8's bytes
saved, not its tensor-core time).

The forward saves the fp8 values and scales of its input and of the weight for the backward
(what the named-remat placements then hold), never the input in its own dtype. On every backend
the quantizers are the same (ml_dtypes' e4m3): on a CPU the products of the dequantized operands
are the accelerator's fp8 products up to float32 summation order, so the recipe's numerics are
tested here.

Shapes: `x` [..., K] (rows M = the product of the leading dims), `w` [K, N]; the result
[..., N] in x's dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from expertax.fp8 import kernel, recipes, stats
from expertax.sharding.rules import current_rules, logical_to_spec

TILE = recipes.TILE


def _product(a, b, dtype, contract):
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), preferred_element_type=jnp.float32
    ).astype(dtype)


def _to_tiles(a):
    """`a` [..., R, C] zero-padded to multiples of 64 (the kernel's narrowest tile) in its last
    two dims: nothing where they are (MLA's wkv_a, 576 wide); the scale grids are already
    whole (a partial block's scale is its real values' amax, which zeros keep)."""
    r, c = a.shape[-2:]
    pad = [(0, 0)] * (a.ndim - 2) + [(0, kernel.padded(r) - r), (0, kernel.padded(c) - c)]
    return jnp.pad(a, pad)


def _kernel(product, dtype, out_axis, rows_MC, scales_MC, w_KN, w_scales):
    """`product` (`hopper/gmm.py` or `.dgrad`) of the rows (e4m3, 1 x 128 scales along the
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


# Each product runs under a named scope (in the compiled program's op names: which kernel
# multiplies what, tools/fp8_kernels.py): fprop, dgrad, wgrad
SCOPES = ("fp8_fprop", "fp8_dgrad", "fp8_wgrad")


def _forward(x_MK, w_KN, recipe: str, hopper: bool):
    qx = recipes.quantize(x_MK, recipe, 1, TILE)  # 1 x 128 along K (tensorwise: one scale)
    qw = recipes.quantize(w_KN, recipe, TILE, TILE)
    with jax.named_scope(SCOPES[0]):
        return _fprop(x_MK, qx, qw, w_KN.dtype, hopper), (qx, qw)


def _fprop(x_MK, qx, qw, w_dtype, hopper: bool):
    dtype = x_MK.dtype
    if hopper:  # kernel.dense: the e4m3 tiles on Hopper's tensor cores
        from expertax.fp8.hopper import gmm as hopper_gmm

        return _over_rows(functools.partial(_kernel, hopper_gmm.gmm, dtype, 1), qx, qw)
    return _product(
        recipes.dequantize(qx, dtype, 1, TILE),
        recipes.dequantize(qw, w_dtype, TILE, TILE),
        dtype,
        ((1,), (0,)),
    )


def _dgrad(qdy_n, qw, w_dtype, x_dtype, hopper: bool):
    """dx = dy w^T, contracting N: `qdy_n` the output gradient in 1 x 128 tiles along N."""
    if hopper:
        from expertax.fp8.hopper import gmm as hopper_gmm

        return _over_rows(functools.partial(_kernel, hopper_gmm.dgrad, x_dtype, 0), qdy_n, qw)
    w_deq = recipes.dequantize(qw, w_dtype, TILE, TILE)
    return _product(recipes.dequantize(qdy_n, x_dtype, 1, TILE), w_deq, x_dtype, ((1,), (1,)))


def _wgrad(x_deq, dy_MN, recipe: str, w_dtype, hopper: bool = False):
    """dw = x^T dy, contracting M (tokens): both re-tiled along M, 128 tokens per scale,
    dequantized; on Hopper under `fp8_blockwise`, `hopper/wgrad.py` with one group (each
    device's rows in 128-row tiles, the [K, N] sums added over the devices). Returns (dw, the
    re-tiled operands' e4m3 values, for the counts)."""
    if hopper and recipe == "fp8_blockwise":
        from expertax.fp8.hopper import wgrad as hopper_wgrad

        def on_kernel(x, dy):
            sizes = jnp.full((1,), x.shape[0], jnp.int32)
            (k, n), pad = (x.shape[1], dy.shape[1]), kernel.padded
            x_p, dy_p = (jnp.pad(a, ((0, 0), (0, pad(d) - d))) for a, d in ((x, k), (dy, n)))
            dw, q_x, q_dy = hopper_wgrad.wgrad_counted(
                x_p, dy_p, sizes, num_groups=1, interpret=kernel.interpreting()
            )
            return dw[0, :k, :n], q_x[:, :k], q_dy[:, :n]

        dw, q_x_m, q_dy_m = _over_rows(on_kernel, (x_deq, dy_MN), (), summed=(True, False, False))
        return dw.astype(w_dtype), q_x_m, q_dy_m
    qx_m = recipes.quantize(x_deq, recipe, TILE, 1)
    qdy_m = recipes.quantize(dy_MN, recipe, TILE, 1)
    x_m = recipes.dequantize(qx_m, x_deq.dtype, TILE, 1)
    dw = _product(x_m, recipes.dequantize(qdy_m, dy_MN.dtype, TILE, 1), w_dtype, ((0,), (0,)))
    return dw, qx_m[0], qdy_m[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gemm(x_MK, w_KN, probe, recipe: str, hopper: bool):
    return _forward(x_MK, w_KN, recipe, hopper)[0]


def _gemm_fwd(x_MK, w_KN, probe, recipe: str, hopper: bool):
    y, (qx, qw) = _forward(x_MK, w_KN, recipe, hopper)
    # the forward's counts for the probe (nn/stats.py), when there is one
    fwd = None if probe is None else stats.counts(x_MK, qx[0])
    # residuals: the operands' e4m3 values and scales; the weight's dtype rides on an empty array
    return y, (qx, qw, jnp.zeros((0,), w_KN.dtype), fwd)


def _gemm_bwd(recipe: str, hopper: bool, res, dy_MN):
    qx, qw, w_dtype_tag, fwd = res
    x_dtype, w_dtype = dy_MN.dtype, w_dtype_tag.dtype
    # dgrad: dy in 1 x 128 tiles along N, the weight's blocks as held
    qdy_n = recipes.quantize(dy_MN, recipe, 1, TILE)
    with jax.named_scope(SCOPES[1]):
        dx = _dgrad(qdy_n, qw, w_dtype, x_dtype, hopper)
    x_deq = recipes.dequantize(qx, x_dtype, 1, TILE)
    with jax.named_scope(SCOPES[2]):
        dw, q_x_m, q_dy_m = _wgrad(x_deq, dy_MN, recipe, w_dtype, hopper)
    if fwd is None:
        return dx, dw, None
    bwd = stats.total((dy_MN, qdy_n[0]), (x_deq, q_x_m), (dy_MN, q_dy_m))
    return dx, dw, stats.encode(fwd, bwd)


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def matmul(x: jax.Array, w_KN: jax.Array, recipe: str, probe=None) -> jax.Array:
    """`x @ w_KN` ([..., K] x [K, N] -> [..., N]) with fp8 operands in all three GEMMs under
    `recipe` (one of `RECIPES`); its fprop and dgrad on Hopper's kernel where
    `kernel.dense` says. `probe` (float32 zeros `stats.SHAPE`, optional): its
    cotangent is this GEMM's quantizer counts (nn/stats.py)."""
    recipes.check_recipe(recipe)
    lead, k = x.shape[:-1], x.shape[-1]
    if w_KN.ndim != 2 or w_KN.shape[0] != k:
        raise ValueError(f"fp8 matmul: x {x.shape} and w {w_KN.shape} do not contract")
    hopper = kernel.dense(recipe, k, w_KN.shape[1])
    y = _gemm(x.reshape(-1, k), w_KN, probe, recipe, hopper)
    return y.reshape(*lead, w_KN.shape[1])
