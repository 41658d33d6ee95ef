"""Per-head RMSNorm of queries and keys (`attention_qk_norm`; Qwen3).

Each query head and each key head is normalized over its own head dim Q, after the projections
and before RoPE, with a learned scale [Q] for the queries and another for the keys (shared by
all heads, like the projections' head dim: logical axis `kv`). It bounds the attention logits
whatever the projections' scale (Qwen3 technical report, arXiv:2505.09388, section 2; the
same idea as "Scaling Vision Transformers to 22 Billion Parameters", arXiv:2302.05442). A model
without it has no such parameters (`gqa.GQA`'s optional fields, absent from its tree) and skips
the step.
"""

from __future__ import annotations

import jax

from expertax.config.schema import Config
from expertax.nn import norm
from expertax.nn.param import ParamSpec


def spec(c: Config) -> ParamSpec:
    """One head's scale [Q]: ones at init, never weight-decayed."""
    return norm.spec(c.head_dim, "kv")


def apply(scale_Q: jax.Array | None, x_BTHQ: jax.Array, c: Config) -> jax.Array:
    """x [B, T, heads, Q] with each head RMS-normalized over Q and scaled; x as it is when the
    model has no q/k norm (`scale_Q` None)."""
    if scale_Q is None:
        return x_BTHQ
    return norm.rms_norm(scale_Q, x_BTHQ, c.normalization_layer_epsilon)
