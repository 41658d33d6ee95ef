"""RMSNorm: scale applied as a broadcast multiply (seed 3922: no einsum temporaries)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.nn.param import ParamSpec


def spec(dim: int, axis: str | None = None) -> ParamSpec:
    return ParamSpec((dim,), (axis,), "ones")


def rms_norm(scale_D: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale, computed in float32 and returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale_D.shape)
    return (x32 * inv * scale).astype(x.dtype)
