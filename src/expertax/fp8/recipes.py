"""The fp8 training recipes (config key `quantization`): how an operand of a GEMM is quantized.

- `fp8_tensorwise`: one float32 scale per tensor (current scaling: the tensor's amax / 448),
  for activations, weights and output gradients alike. Each operand enters its product as
  `convert(e4m3) * scalar`, the pattern XLA:GPU rewrites into a cuBLASLt fp8 GEMM
  (`__cublas$lt$matmul$f8`) on Hopper.
- `fp8_blockwise`: DeepSeek-V3's recipe (arXiv:2412.19437, Sec. 3.3): activations and output
  gradients in 1 x 128 tiles (one scale per token per 128 channels of the contraction axis),
  weights in 128 x 128 blocks (the hub checkpoint's `weight_scale_inv` layout, the same
  quantizer as `convert/fp8.py`: `quant.quantize_blocks`). The wgrad contracts over tokens, so
  its operands are re-tiled along the token axis (1 x 128 over tokens, per channel).

On every backend the quantizers are the same (ml_dtypes' e4m3): on a CPU the products of the
dequantized operands are the accelerator's fp8 products up to float32 summation order, so the
recipes' numerics are tested here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.fp8 import quant

RECIPES = ("fp8_tensorwise", "fp8_blockwise")
TILE = quant.BLOCK  # 128: the tile along a contraction axis, and the weight block


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"quantization={recipe!r}: an fp8 GEMM recipe is one of {RECIPES}")


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
