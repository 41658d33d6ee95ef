"""Loop-over-experts MoE: the test oracle. Every token runs through every expert, masked."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn import activation, mlp
from expertax.nn.moe import bias, router
from expertax.nn.moe.layer import MoE


def moe_reference(p: MoE, x_BTD: jax.Array, c: Config) -> jax.Array:
    """The MoE layer's output computed one expert at a time, in float32 routing."""
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    routing = router.route(p.router, x_ND, c)
    out = jnp.zeros_like(x_ND, dtype=jnp.float32)
    act = activation.of(c)
    eb = bias.of(p)
    for e in range(c.num_experts):
        gate, up = x_ND @ p.wi_0[e], x_ND @ p.wi_1[e]
        if eb is not None:
            gate, up = gate + eb.gate_EF[e][None], up + eb.up_EF[e][None]
        y = act(gate, up) @ p.wo[e]
        if eb is not None:
            y = y + eb.down_ED[e][None]
        w_N = jnp.sum(jnp.where(routing.experts_NK == e, routing.weights_NK, 0.0), axis=-1)
        out = out + w_N[:, None] * y
    out_BTD = out.reshape(b, t, d).astype(x_BTD.dtype)
    if p.shared is not None:
        out_BTD = out_BTD + mlp.apply(p.shared, x_BTD, x_BTD.dtype, act)
    return out_BTD
