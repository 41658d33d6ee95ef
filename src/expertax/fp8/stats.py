"""What the fp8 quantizers lose in a train step: counts of flushed and subnormal e4m3 values,
carried out of the GEMMs' custom VJPs by a zero-valued probe (config key `quantization`).

The counts, over the operands that change with the data (each product's activations and
output gradients; weights are not counted, see below), in each direction:
- `nonzero`: the operand's nonzero elements;
- `underflow`: nonzero elements whose scaled value rounds to zero in e4m3 (|x| / scale below
  2^-10 or at it: they flush, the GEMM sees 0);
- `subnormal`: elements whose e4m3 value is subnormal (0 < |q| < 2^-6: three or fewer mantissa
  bits, up to 50 % relative error), where a tile's small values lose precision before they flush.

Saturation is not counted: with current scaling (quant.scale_for: the amax of what is quantized
now over 448) no element is clipped, the tile's largest one maps to 448 and every other below
it. A delayed-scaling recipe would clip; it would count `|x| / scale > 448` here.

Forward: the fprop's input. Backward: the dgrad's output gradient and the wgrad's two operands
(the input re-tiled along the tokens, the output gradient). Weights are left out: their
quantization is a property of the parameters, the same for every use, while a count per use
would weigh each weight by the token shards and chunks that multiply by it and make the sums
depend on the layout. The routed experts count only the rows of their groups (an EP buffer's
unused rows are not data).

How the counts leave the GEMMs: each quantized GEMM takes a probe, float32 zeros [2, 3, 31]
(direction x count x bit), and its backward returns as the probe's cotangent its own counts,
those of the forward (computed there, kept as int32 residuals) and those of the backward, each
count in binary, one lane per bit. The train step differentiates the loss with respect to one
probe per layer (scanned with the layers' weights, so scan, remat and the paged stash's VJP
carry them as they carry weights); the gradient is the lane-wise sum over every GEMM, layer and
device. Every lane's sum is an integer below 2^24 (one per contribution), so float32 adds it
exactly in any order: the counts equal the one-device run's bit for bit under any layout whose
quantization is the same (blockwise tiles do not depend on the layout; a tensorwise scale inside
the expert-parallel `shard_map` is a shard's). Off (`quantization` unset) there is no probe and
the program is unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

COUNTS = ("nonzero", "underflow", "subnormal")
DIRECTIONS = ("fwd", "bwd")
BITS = 31  # an int32 count (of one group of an operand's elements: `counts`)
GROUP = 2**30  # elements per group: a group's int32 count cannot overflow
SHAPE = (len(DIRECTIONS), len(COUNTS), BITS)
SMALLEST_NORMAL = 2.0**-6  # e4m3's; below it (and above 0) its values are subnormal


class Probe(NamedTuple):
    """A layer's probe as its GEMMs take it: `lanes` (float32 zeros, SHAPE), and `model_lanes`
    for the routed experts' operands whose rows span the model dim D: the same array, except
    inside the expert-parallel `shard_map` with the experts' F split over mesh axes, where those
    rows are copies on every F shard and only the first one counts them (nn/moe/ep.py)."""

    lanes: jax.Array
    model_lanes: jax.Array

    @classmethod
    def of(cls, lanes: jax.Array) -> Probe:
        return cls(lanes, lanes)


def zeros(*lead: int) -> jax.Array:
    """Probes for `lead` layers: float32 zeros [*lead, *SHAPE]."""
    return jnp.zeros((*lead, *SHAPE), jnp.float32)


def bits(n) -> jax.Array:
    """Counts (int32 [..., 3], each below 2^31) as lanes: float32 [..., 3, BITS], lane b = bit
    b of the count."""
    n = n.astype(jnp.int32)[..., None]
    shifts = jnp.arange(BITS, dtype=jnp.int32).reshape((1,) * (n.ndim - 1) + (BITS,))
    return ((n >> shifts) & 1).astype(jnp.float32)


def counts(x, q, rows=None) -> jax.Array:
    """The lanes (float32 [3, BITS], `bits`) of the `COUNTS` of an operand `x` ([..., C], any
    float dtype) quantized to `q` (its e4m3 values, same shape); `rows` ([R, 1] bool,
    optional): the rows that count. An operand under GSPMD is the global one, and its counts
    may pass 2^31 (a 64 x 4096-token batch's [tokens, 14336] gradient): the rows are counted in
    groups of at most GROUP elements, each group's int32 count encoded, and the groups' lanes
    summed (exact while a lane sums fewer than 2^24 groups over the step's GEMMs and devices)."""
    nonzero = x != 0
    zero_q = q == 0
    subnormal = (~zero_q) & (jnp.abs(q.astype(jnp.float32)) < SMALLEST_NORMAL)
    masks = (nonzero, nonzero & zero_q, subnormal)
    if rows is not None:
        masks = tuple(m & rows for m in masks)
    cols = x.shape[-1]
    # one variadic reduction over the three masks (XLA fuses their comparisons into it; three
    # separate sums made it write the masks out whole, a byte per element each)
    ints = tuple(m.reshape(-1, cols).astype(jnp.int32) for m in masks)
    zero = jnp.int32(0)
    per_row = jnp.stack(
        jax.lax.reduce(
            ints, (zero,) * len(ints), lambda a, b: tuple(u + v for u, v in zip(a, b)), (1,)
        )
    )
    group = max(1, GROUP // cols)  # rows per group: at most GROUP elements
    r = per_row.shape[1]
    n_groups = -(-r // group)
    per_row = jnp.pad(per_row, ((0, 0), (0, n_groups * group - r)))
    per_group = jnp.sum(per_row.reshape(len(COUNTS), n_groups, group), axis=-1, dtype=jnp.int32)
    return jnp.sum(bits(per_group.T), axis=0)  # [3, BITS]


def total(*pairs, rows=None) -> jax.Array:
    """`counts` summed over (operand, e4m3 values) pairs (lanes, float32 [3, BITS])."""
    return sum((counts(x, q, rows) for x, q in pairs), jnp.zeros((len(COUNTS), BITS)))


def encode(fwd, bwd) -> jax.Array:
    """The probe's cotangent: forward and backward counts (lanes [3, BITS] each, `counts`) as
    float32 SHAPE."""
    return jnp.stack([fwd, bwd]).astype(jnp.float32)


def decode(lanes) -> jax.Array:
    """float32 [..., 2, 3] counts from summed lanes [..., *SHAPE] (exact below 2^24)."""
    weights = np.ldexp(np.float32(1), np.arange(BITS)).astype(np.float32)  # exact powers of 2
    return jnp.sum(lanes * weights.reshape((1,) * (lanes.ndim - 1) + (BITS,)), axis=-1)


def metrics(lanes) -> dict[str, jax.Array]:
    """Train metrics from a step's probe gradient (any [..., *SHAPE] tree of them, summed):
    `fp8_{fwd,bwd}_underflow` and `fp8_{fwd,bwd}_subnormal`, each a fraction of that direction's
    nonzero operand elements."""
    summed = sum(jnp.sum(a.reshape(-1, *SHAPE), axis=0) for a in jax.tree.leaves(lanes))
    n_23 = decode(summed)
    out = {}
    for i, d in enumerate(DIRECTIONS):
        nonzero = jnp.maximum(n_23[i, 0], 1.0)
        for j, name in enumerate(COUNTS[1:], start=1):
            out[f"fp8_{d}_{name}"] = n_23[i, j] / nonzero
    return out
