"""Dot-product attention with the causal and document masks computed inside.

The mask is never materialized as [B, 1, T, T]: it is a comparison of iotas (causal) and of
segment ids, fused by XLA into the select on the scores (seed 3922, item "causal mask").
Keys/values may have fewer heads than queries (GQA): the H query heads are viewed as G groups
of J = H/G heads, keys never repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def attend(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """Causal attention; returns [B, T, H, O]. Scores and softmax in float32."""
    b, t, h, q = q_BTHQ.shape
    g = k_BSGQ.shape[2]
    q_BTGJQ = q_BTHQ.reshape(b, t, g, h // g, q)
    scores = jnp.einsum(
        "btgjq,bsgq->bgjts", q_BTGJQ, k_BSGQ, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    s = k_BSGQ.shape[1]
    causal_TS = jax.lax.broadcasted_iota(jnp.int32, (t, s), 0) >= jax.lax.broadcasted_iota(
        jnp.int32, (t, s), 1
    )
    mask = causal_TS[None, None, None]
    if segment_ids_BT is not None:
        same_doc_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
        mask = jnp.logical_and(mask, same_doc_BTS[:, None, None])
    scores = jnp.where(mask, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGO.dtype)
    out = jnp.einsum("bgjts,bsgo->btgjo", probs, v_BSGO)
    return out.reshape(b, t, h, v_BSGO.shape[-1])
