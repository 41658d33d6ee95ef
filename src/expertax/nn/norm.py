"""RMSNorm: scale applied as a broadcast multiply (seed 3922: no einsum temporaries).

The scale is multiplied elementwise (an einsum "...d,d->...d" can lower to a larger
intermediate inside scan bodies), and a constant offset (scale + offset, as in Gemma-style
norms) is added only when it is non-zero, so the plain RMSNorm HLO has no extra add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.nn.param import ParamSpec


def spec(dim: int, axis: str | None = None) -> ParamSpec:
    """An RMSNorm scale [dim]: initialized to ones, never weight-decayed."""
    return ParamSpec((dim,), (axis,), "ones", weight_decay=False)


def rms_norm(scale_D: jax.Array, x: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x / rms(x) * (scale + offset), computed in float32 and returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32)
    if offset != 0.0:
        scale = scale + jnp.float32(offset)
    scale = scale.reshape((1,) * (x.ndim - 1) + scale.shape)  # explicit rank (no promotion)
    return (x32 * inv * scale).astype(x.dtype)
