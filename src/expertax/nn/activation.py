"""The gated MLPs' activation: the one place the row-wise part of a gated feed-forward is written.

A gated MLP computes `act(x @ wi_0, x @ wi_1) @ wo`; `act` is what this module holds. The dense
MLP (nn/mlp.py), every grouped-matmul path of the routed experts (the tiled backend's per-tile
prologue, the dense einsum, the fused routed FFN: nn/moe/), the loop-over-experts oracle and the
decode step's joined and per-expert products (decoding/) call it; none writes its own.

`swiglu` (Shazeer 2020, "GLU Variants Improve Transformer"): `silu(gate) * up`, the activation
of DeepSeek, Mixtral, Qwen and Llama. `swiglu_clamped`: GPT-OSS's, both inputs clamped and the
up branch shifted by one. `of(c)` is the one the config names (`mlp_activation`); a new variant
is a function of the same signature here, named in that key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from expertax.config.schema import Config

GatedActivation = Callable[[jax.Array, jax.Array], jax.Array]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(gate) * up`, in the inputs' dtype."""
    return jax.nn.silu(gate) * up


# GPT-OSS's gate sharpness: gate * sigmoid(1.702 gate) is the sigmoid approximation of GELU
# (Hendrycks and Gimpel 2016, section 2), as transformers' GptOssExperts writes it.
GPT_OSS_ALPHA = 1.702


def swiglu_clamped(gate: jax.Array, up: jax.Array, limit: float = 7.0) -> jax.Array:
    """GPT-OSS's activation: gate clamped to <= `limit`, up to [-`limit`, `limit`], then
    `(up + 1) * gate * sigmoid(1.702 gate)`, in the inputs' dtype."""
    gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
    up = jnp.clip(up, jnp.asarray(-limit, up.dtype), jnp.asarray(limit, up.dtype))
    glu = gate * jax.nn.sigmoid(gate * jnp.asarray(GPT_OSS_ALPHA, gate.dtype))
    return (up + jnp.asarray(1, up.dtype)) * glu


def of(c: Config) -> GatedActivation:
    """The activation `mlp_activation` names (a hashable function: it is a static argument of
    the custom VJPs that apply it)."""
    if c.mlp_activation == "swiglu_clamped":
        return _clamped(float(c.mlp_activation_limit))
    return swiglu


@functools.cache
def _clamped(limit: float) -> GatedActivation:
    """One function per limit, so that programs traced twice see the same static argument."""
    return functools.partial(swiglu_clamped, limit=limit)


def joined(h: jax.Array, act: GatedActivation = swiglu) -> jax.Array:
    """`act` of gate and up held side by side along the last axis, [..., 2F] -> [..., F] (the
    decode step's joined `wi_0 | wi_1` product, decoding/joint.py)."""
    f = h.shape[-1] // 2
    return act(h[..., :f], h[..., f:])
