"""fp8 training GEMMs: a linear whose three products (fprop, dgrad, wgrad) multiply e4m3 operands
with float32 accumulation, under one of two recipes (config key `quantization`).

- `fp8_tensorwise`: one float32 scale per tensor (current scaling: the tensor's amax / 448),
  for activations, weights and output gradients alike. Each operand enters its product as
  `convert(e4m3) * scalar`, the pattern XLA:GPU rewrites into a cuBLASLt fp8 GEMM
  (`__cublas$lt$matmul$f8`) on Hopper.
- `fp8_blockwise`: DeepSeek-V3's recipe (arXiv:2412.19437, Sec. 3.3): activations and output
  gradients in 1 x 128 tiles (one scale per token per 128 channels of the contraction axis),
  weights in 128 x 128 blocks (the hub checkpoint's `weight_scale_inv` layout, the same
  quantizer as `convert/fp8.py`: `quant.quantize_blocks`). The wgrad contracts over tokens, so
  its operands are re-tiled along the token axis (1 x 128 over tokens, per channel). XLA has no
  block-scaled fp8 GEMM: on a Hopper GPU all three products of a linear whose K and N are
  multiples of 64 (or zero-padded to them at little cost) run on `moe/fp8_hopper.py`'s kernels
  as one group (e4m3 `wgmma`, per-128 promotion, or per-64 along a dim that is not a multiple
  of 128; `nn/fp8_kernel.py` decides); every other product is dequantized and multiplied in
  the operands' dtype (fp8's bytes saved, not its tensor-core time).

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

from expertax import quant
from expertax.nn import fp8_kernel, fp8_stats
from expertax.nn.moe import fp8_hopper
from expertax.sharding.rules import current_rules, logical_to_spec

RECIPES = ("fp8_tensorwise", "fp8_blockwise")
# XLA:GPU's Triton GEMM emitter claims a dot before the cuBLASLt fp8 rewrite sees it (jax 0.10.2):
# a program of fp8 GEMMs compiles with it off.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
TILE = quant.BLOCK  # 128: the tile along a contraction axis, and the weight block


def quantize(x_RC, recipe: str, rows: int, cols: int):
    """`x_RC` ([..., R, C]: each matrix of the leading axes on its own) as (e4m3 values,
    scales) under `recipe`; the blockwise grid in `rows` x `cols` blocks (a whole axis when it
    is shorter than the block), the tensorwise scale one per matrix (a scalar for a 2-D x)."""
    if recipe == "fp8_tensorwise":
        amax = jnp.max(jnp.abs(x_RC.astype(jnp.float32)), axis=(-2, -1))
        scale = quant.scale_for(amax)[..., None, None] if x_RC.ndim > 2 else quant.scale_for(amax)
        inverse = 1.0 / jax.lax.optimization_barrier(scale)
        return (x_RC.astype(jnp.float32) * inverse).astype(quant.E4M3), scale
    r, c = x_RC.shape[-2:]
    return quant.quantize_blocks(x_RC, min(rows, r), min(cols, c))


def dequantize(operand, dtype, rows: int, cols: int):
    """The operand (e4m3 values, scales) in `dtype`: `convert(e4m3) * scale` (one per matrix,
    or the block grid expanded)."""
    q_RC, scale = operand
    if scale.ndim == 0 or scale.shape[-2:] == (1, 1):  # one scale per matrix
        return q_RC.astype(dtype) * scale.astype(dtype)
    r, c = q_RC.shape[-2:]
    rows, cols = min(rows, r), min(cols, c)
    return q_RC.astype(dtype) * quant.expand(scale.astype(dtype), rows, cols, q_RC.shape)


def _product(a, b, dtype, contract):
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), preferred_element_type=jnp.float32
    ).astype(dtype)


def _to_tiles(a):
    """`a` [..., R, C] zero-padded to multiples of 64 (the kernel's narrowest tile) in its last
    two dims: nothing where they are (MLA's wkv_a, 576 wide); the scale grids are already
    whole (a partial block's scale is its real values' amax, which zeros keep)."""
    r, c = a.shape[-2:]
    pad = [(0, 0)] * (a.ndim - 2) + [(0, fp8_kernel.padded(r) - r), (0, fp8_kernel.padded(c) - c)]
    return jnp.pad(a, pad)


def _kernel(product, dtype, out_axis, rows_MC, scales_MC, w_KN, w_scales):
    """`product` (`fp8_hopper.gmm` or `.dgrad`) of the rows (e4m3, 1 x 128 scales along the
    contraction C) with the weight as the kernel's one group ([1, K, N]: all rows its group);
    K and N zero-padded to multiples of 64 (`fp8_kernel.padded`: most dims are already), the
    output's padding cut to the weight's dim `out_axis` (gmm: N, 1; dgrad: K, 0). The kernel's
    default 128-row tile: with one group the padding is under one tile in all, and a 128-row
    tile reuses each weight tile for twice the rows of a 64-row one."""
    sizes = jnp.full((1,), rows_MC.shape[0], jnp.int32)
    c, out = rows_MC.shape[1], w_KN.shape[out_axis]
    rows = jnp.pad(rows_MC, ((0, 0), (0, fp8_kernel.padded(c) - c)))
    y = product(
        rows, scales_MC, _to_tiles(w_KN)[None], w_scales[None], sizes, out_dtype=dtype,
        interpret=fp8_kernel.interpreting(),
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
    qx = quantize(x_MK, recipe, 1, TILE)  # 1 x 128 along K (tensorwise: one scale)
    qw = quantize(w_KN, recipe, TILE, TILE)
    with jax.named_scope(SCOPES[0]):
        return _fprop(x_MK, qx, qw, w_KN.dtype, hopper), (qx, qw)


def _fprop(x_MK, qx, qw, w_dtype, hopper: bool):
    dtype = x_MK.dtype
    if hopper:  # fp8_kernel.dense: the e4m3 tiles on Hopper's tensor cores
        return _over_rows(functools.partial(_kernel, fp8_hopper.gmm, dtype, 1), qx, qw)
    return _product(
        dequantize(qx, dtype, 1, TILE), dequantize(qw, w_dtype, TILE, TILE), dtype, ((1,), (0,))
    )


def _dgrad(qdy_n, qw, w_dtype, x_dtype, hopper: bool):
    """dx = dy w^T, contracting N: `qdy_n` the output gradient in 1 x 128 tiles along N."""
    if hopper:
        return _over_rows(functools.partial(_kernel, fp8_hopper.dgrad, x_dtype, 0), qdy_n, qw)
    w_deq = dequantize(qw, w_dtype, TILE, TILE)
    return _product(dequantize(qdy_n, x_dtype, 1, TILE), w_deq, x_dtype, ((1,), (1,)))


def _wgrad(x_deq, dy_MN, recipe: str, w_dtype, hopper: bool = False):
    """dw = x^T dy, contracting M (tokens): both re-tiled along M, 128 tokens per scale,
    dequantized; on Hopper under `fp8_blockwise`, `fp8_hopper.wgrad` with one group (each
    device's rows in 128-row tiles, the [K, N] sums added over the devices). Returns (dw, the
    re-tiled operands' e4m3 values, for the counts)."""
    if hopper and recipe == "fp8_blockwise":

        def kernel(x, dy):
            sizes = jnp.full((1,), x.shape[0], jnp.int32)
            (k, n), pad = (x.shape[1], dy.shape[1]), fp8_kernel.padded
            x_p, dy_p = (jnp.pad(a, ((0, 0), (0, pad(d) - d))) for a, d in ((x, k), (dy, n)))
            dw, q_x, q_dy = fp8_hopper.wgrad_counted(
                x_p, dy_p, sizes, num_groups=1, interpret=fp8_kernel.interpreting()
            )
            return dw[0, :k, :n], q_x[:, :k], q_dy[:, :n]

        dw, q_x_m, q_dy_m = _over_rows(kernel, (x_deq, dy_MN), (), summed=(True, False, False))
        return dw.astype(w_dtype), q_x_m, q_dy_m
    qx_m = quantize(x_deq, recipe, TILE, 1)
    qdy_m = quantize(dy_MN, recipe, TILE, 1)
    dw = _product(
        dequantize(qx_m, x_deq.dtype, TILE, 1), dequantize(qdy_m, dy_MN.dtype, TILE, 1), w_dtype,
        ((0,), (0,)),
    )  # fmt: skip
    return dw, qx_m[0], qdy_m[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gemm(x_MK, w_KN, probe, recipe: str, hopper: bool):
    return _forward(x_MK, w_KN, recipe, hopper)[0]


def _gemm_fwd(x_MK, w_KN, probe, recipe: str, hopper: bool):
    y, (qx, qw) = _forward(x_MK, w_KN, recipe, hopper)
    # the forward's counts for the probe (nn/fp8_stats.py), when there is one
    fwd = None if probe is None else fp8_stats.counts(x_MK, qx[0])
    # residuals: the operands' e4m3 values and scales; the weight's dtype rides on an empty array
    return y, (qx, qw, jnp.zeros((0,), w_KN.dtype), fwd)


def _gemm_bwd(recipe: str, hopper: bool, res, dy_MN):
    qx, qw, w_dtype_tag, fwd = res
    x_dtype, w_dtype = dy_MN.dtype, w_dtype_tag.dtype
    # dgrad: dy in 1 x 128 tiles along N, the weight's blocks as held
    qdy_n = quantize(dy_MN, recipe, 1, TILE)
    with jax.named_scope(SCOPES[1]):
        dx = _dgrad(qdy_n, qw, w_dtype, x_dtype, hopper)
    x_deq = dequantize(qx, x_dtype, 1, TILE)
    with jax.named_scope(SCOPES[2]):
        dw, q_x_m, q_dy_m = _wgrad(x_deq, dy_MN, recipe, w_dtype, hopper)
    if fwd is None:
        return dx, dw, None
    bwd = fp8_stats.total((dy_MN, qdy_n[0]), (x_deq, q_x_m), (dy_MN, q_dy_m))
    return dx, dw, fp8_stats.encode(fwd, bwd)


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"quantization={recipe!r}: an fp8 GEMM recipe is one of {RECIPES}")


def matmul(x: jax.Array, w_KN: jax.Array, recipe: str, probe=None) -> jax.Array:
    """`x @ w_KN` ([..., K] x [K, N] -> [..., N]) with fp8 operands in all three GEMMs under
    `recipe` (one of `RECIPES`); its fprop and dgrad on Hopper's kernel where
    `fp8_kernel.dense` says. `probe` (float32 zeros `fp8_stats.SHAPE`, optional): its
    cotangent is this GEMM's quantizer counts (nn/fp8_stats.py)."""
    check_recipe(recipe)
    lead, k = x.shape[:-1], x.shape[-1]
    if w_KN.ndim != 2 or w_KN.shape[0] != k:
        raise ValueError(f"fp8 matmul: x {x.shape} and w {w_KN.shape} do not contract")
    hopper = fp8_kernel.dense(recipe, k, w_KN.shape[1])
    y = _gemm(x.reshape(-1, k), w_KN, probe, recipe, hopper)
    return y.reshape(*lead, w_KN.shape[1])
