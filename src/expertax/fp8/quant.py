"""The fp8 format: e4m3 values with float32 block scales, what checkpoint conversion
(convert/fp8.py: the hub's 128 x 128 blocks), decoding (fp8 weights on the devices) and
training (fp8/recipes.py) share.

Shared by every use: the e4m3 type and its largest value (448), and the scale rule: a block's
scale is its largest magnitude over 448 (1 for a block of zeros), so that the block's values fill
e4m3's range; a weight is `q * scale`, broadcast over each block (`scale_for`); the block
quantizer (`quantize_blocks`), in NumPy (the converter's streaming) and in JAX alike.

The device layout of an fp8 weight (`Fp8`, `quantize_array`, `dequantize_array`): a weight
[..., K, N] held as e4m3 with one float32 scale per 128 values along its input axis K, the
second to last (the whole axis when it is not a multiple of 128): finer blocks than the hub's
128 x 128, so the rounding error is at most the hub format's. Its scales [..., K / 128, N] keep
the weight's minor axis: blocks along N would give the scales a minor axis of N / 128 (16 for a
routed expert of DeepSeek-V3), which a TPU pads to 128 in every buffer that holds them. Which
parameters decoding holds this way: decoding/quantized.py. A layer that finds Fp8 leaves in its
parameters dequantizes them where it runs (`dequantize`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # ml_dtypes' type: numpy arrays (convert/) and jax arrays alike
E4M3_MAX = 448.0  # the largest finite e4m3 value
BLOCK = 128


def _exactly(divisor, xp):
    """`divisor` such that a division by it stays a division: XLA rewrites a division by a
    constant or a broadcast into a product with the reciprocal, one float32 ulp off the
    quotient in about half the cases; NumPy divides. A barrier hides the value from XLA."""
    return divisor if xp is not jnp else jax.lax.optimization_barrier(divisor)


def scale_for(amax, xp=jnp):
    """A block's scale from its largest magnitude `amax` (float32, any shape; `xp`: numpy or
    jax.numpy): `amax / 448`, 1 for an all-zero block; the same float32 bits from both."""
    amax = xp.asarray(amax, xp.float32)
    scale = amax / _exactly(xp.full(amax.shape, E4M3_MAX, xp.float32), xp)
    return xp.where(amax > 0, scale, xp.float32(1.0)).astype(xp.float32)


def block_amax(w_RC, rows: int, cols: int, xp=jnp):
    """The largest magnitude of each `rows` x `cols` block of `w_RC` ([..., R, C]: the last two
    axes blocked, leading axes kept; float32; `xp`: numpy or jax.numpy), edge blocks padded with
    zeros: [..., ceil(R / rows), ceil(C / cols)]."""
    *lead, r, c = w_RC.shape
    gr, gc = -(-r // rows), -(-c // cols)
    a = xp.abs(w_RC.astype(xp.float32))
    if (gr * rows, gc * cols) != (r, c):
        a = xp.pad(a, ((0, 0),) * len(lead) + ((0, gr * rows - r), (0, gc * cols - c)))
    return a.reshape(*lead, gr, rows, gc, cols).max(axis=(-3, -1))


def expand(scale_GH, rows: int, cols: int, shape: tuple[int, ...], xp=jnp):
    """A block-scale grid ([..., G, H]) as an array of `shape` (each scale over its `rows` x
    `cols` block of the last two axes, edge blocks cut)."""
    full = xp.repeat(xp.repeat(scale_GH, rows, axis=-2), cols, axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def quantize_blocks(w_RC, rows: int, cols: int, xp=jnp, scale_GH=None):
    """(e4m3 values, float32 scale grid) of `w_RC` ([..., R, C]: each matrix of the leading
    axes on its own) in `rows` x `cols` blocks, by the scale rule (`scale_for` of each block's
    amax) unless `scale_GH` is given. DeepSeek-V3's weights: 128 x 128; its activations and
    output gradients: 1 x 128 along the contraction axis."""
    if scale_GH is None:
        scale_GH = scale_for(block_amax(w_RC, rows, cols, xp), xp)
    # w times the scale's reciprocal, in NumPy and XLA alike (XLA would turn `w / scale` over
    # the expanded grid into this product anyway; the reciprocals are one division per block)
    inverse = xp.float32(1.0) / _exactly(scale_GH, xp)
    w32 = w_RC.astype(xp.float32)
    q = (w32 * expand(inverse, rows, cols, w_RC.shape, xp)).astype(E4M3)
    return q, scale_GH


class Fp8(NamedTuple):
    """One quantized weight."""

    q: Any  # float8_e4m3fn, the weight's shape
    scale: Any  # float32 [*shape[:-2], blocks of the second to last axis, shape[-1]]


def is_fp8(x) -> bool:
    return isinstance(x, Fp8)


def block(rows: int) -> int:
    """The block length along an input axis of `rows` values."""
    return BLOCK if rows % BLOCK == 0 else rows


def quantize_array(w: jax.Array) -> Fp8:
    """`w` [..., K, N] as e4m3 values and a scale per block of `block(K)` values of its K axis."""
    *lead, k, n = w.shape
    blk = block(k)
    w_KBN = w.astype(jnp.float32).reshape(*lead, k // blk, blk, n)
    scale = scale_for(jnp.max(jnp.abs(w_KBN), axis=-2))
    q = (w_KBN / scale[..., None, :]).astype(E4M3).reshape(w.shape)
    return Fp8(q, scale)


def dequantize_array(f: Fp8, dtype) -> jax.Array:
    """The weight in `dtype`, computed in `dtype` (e4m3 values are exact in bfloat16; the
    scale is rounded to it): no float32 copy of the weight is made on the way."""
    blk = block(f.q.shape[-2])
    # The scales repeated along the K axis (a broadcast that keeps the minor axis), not the
    # weight reshaped into blocks.
    return f.q.astype(dtype) * jnp.repeat(f.scale.astype(dtype), blk, axis=-2)


def dequantize(tree, dtype, anchor):
    """(every Fp8 leaf of `tree` (a layer's parameters) as an array in `dtype`, `anchor`).

    The fp8 values pass an optimization barrier with `anchor` (the layer's input activations)
    first: the weights do not change inside the decode loop, and without the barrier XLA hoists
    their dequantization out of the loop, holding every layer's weights in `dtype` at once.
    A tree without Fp8 leaves is returned as it is."""
    if not any(is_fp8(x) for x in jax.tree.leaves(tree, is_leaf=is_fp8)):
        return tree, anchor
    tree, anchor = jax.lax.optimization_barrier((tree, anchor))
    deq = jax.tree.map(
        lambda x: dequantize_array(x, dtype) if is_fp8(x) else x, tree, is_leaf=is_fp8
    )
    return deq, anchor
