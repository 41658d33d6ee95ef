"""fp8 quantization: e4m3 values with float32 block scales, the one module that checkpoint
conversion (convert/fp8.py: the hub's 128 x 128 blocks), decoding (fp8 weights on the devices) and
training use.

Shared by every format: the e4m3 type and its largest value (448), and the scale rule: a block's
scale is its largest magnitude over 448 (1 for a block of zeros), so that the block's values fill
e4m3's range; a weight is `q * scale`, broadcast over each block (`scale_for`).

The device layout (`Fp8`, `quantize_array`, `dequantize_array`): a weight [..., K, N] held as
e4m3 with one float32 scale per 128 values along its input axis K, the second to last (the whole
axis when it is not a multiple of 128): finer blocks than the hub's 128 x 128, so the rounding
error is at most the hub format's. Its scales [..., K / 128, N] keep the weight's minor axis:
blocks along N would give the scales a minor axis of N / 128 (16 for a routed expert of
DeepSeek-V3), which a TPU pads to 128 in every buffer that holds them.

Decoding's fp8 weights (`fp8_weights=True`): DeepSeek-V3's 671B parameters take 1.34 TB in
bfloat16, more than 8 H200s (1.13 TB) or a v5p-16 slice (8 chips, 760 GiB) hold; in fp8 they
take half. Every matrix of the decoder layers and the MTP modules (attention projections, dense
and shared MLPs, routed experts, `eh_proj`) is held in the device layout (`quantized`, `spec`,
`quantize`); embeddings, the output head, norms and the router (and its bias) stay in their own
dtype, as in the hub checkpoint. Each layer's weights are dequantized to `dtype` where the layer
runs (`dequantize`, decoding/model.py). The quantization runs on the devices after the
parameters are loaded in their own dtype: a model whose bfloat16 weights do not fit the devices
cannot be loaded this way yet (the compiled figures of such a model, benchmarks/generate_671b.py,
take the fp8 tree as given).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from expertax.nn.param import ParamSpec, is_spec

E4M3 = jnp.float8_e4m3fn  # ml_dtypes' type: numpy arrays (convert/) and jax arrays alike
E4M3_MAX = 448.0  # the largest finite e4m3 value
BLOCK = 128
# Parameter containers whose matrices are quantized (norm scales and the router never are).
QUANTIZED_PARENTS = ("attn", "mlp", "moe", "shared", "mtp")


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


def _names(path) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "key", ""))) for k in path]


def quantized(path, shape: tuple[int, ...], prefix: tuple[str, ...] = ()) -> bool:
    """Whether the parameter at `path` (a key path into the Decoder tree, or into a layer's tree
    that sits at `prefix` in it, e.g. ("mtp",) for an MTP module) is held in fp8."""
    names = [*prefix, *_names(path)]
    if not names or names[-1].endswith("norm") or "router" in names:
        return False
    return len(shape) >= 2 and any(n in QUANTIZED_PARENTS for n in names[:-1])


def spec(tree, prefix: tuple[str, ...] = ()):
    """The parameter declaration tree with each quantized ParamSpec replaced by an Fp8 of two
    ParamSpecs (values, scales; the scales keep the weight's logical axes)."""
    if tree is None:
        return None

    def one(path, s: ParamSpec):
        if not quantized(path, s.shape, prefix):
            return s
        k, n = s.shape[-2:]
        scale_shape = (*s.shape[:-2], k // block(k), n)
        return Fp8(s, ParamSpec(scale_shape, s.axes, "ones", weight_decay=False))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_spec)


def abstract(tree, dtype) -> Any:
    """ShapeDtypeStructs of an `spec` tree: fp8 values, float32 scales, the rest in `dtype`."""

    def leaf(s, dt):
        return jax.ShapeDtypeStruct(s.shape, dt)

    def one(x):
        if is_fp8(x):
            return Fp8(leaf(x.q, E4M3), leaf(x.scale, jnp.float32))
        return leaf(x, jnp.dtype(dtype))

    return jax.tree.map(one, tree, is_leaf=lambda x: is_fp8(x) or is_spec(x))


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


def quantize(params, prefix: tuple[str, ...] = ()):
    """The parameters with every quantized weight (`quantized`) as Fp8."""

    def one(path, w):
        return quantize_array(w) if quantized(path, w.shape, prefix) else w

    return jax.tree_util.tree_map_with_path(one, params)


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
