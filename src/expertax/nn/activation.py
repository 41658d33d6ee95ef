"""The gated MLPs' activation: the one place the row-wise part of a gated feed-forward is written.

A gated MLP computes `act(x @ wi_0, x @ wi_1) @ wo`; `act` is what this module holds. The dense
MLP (nn/mlp.py), every grouped-matmul path of the routed experts (the tiled backend's per-tile
prologue, the dense einsum, the fused routed FFN: nn/moe/), the loop-over-experts oracle and the
decode step's joined and per-expert products (decoding/) call it; none writes its own.

`swiglu` (Shazeer 2020, "GLU Variants Improve Transformer"): `silu(gate) * up`, the activation
of every model family expertax trains today. A new variant (a clamped or biased gate, as
GPT-OSS's) is a function of the same signature here, passed where `swiglu` is passed today.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

GatedActivation = Callable[[jax.Array, jax.Array], jax.Array]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(gate) * up`, in the inputs' dtype."""
    return jax.nn.silu(gate) * up


def joined(h: jax.Array, act: GatedActivation = swiglu) -> jax.Array:
    """`act` of gate and up held side by side along the last axis, [..., 2F] -> [..., F] (the
    decode step's joined `wi_0 | wi_1` product, decoding/joint.py)."""
    f = h.shape[-1] // 2
    return act(h[..., :f], h[..., f:])
