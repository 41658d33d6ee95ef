"""QK-clip's measurement: each head's largest attention logit in a layer, carried out of it.

Kimi-K2's QK-clip (`use_qk_clip`; the update is train/qk_clip.py) needs, per layer and head,
the largest logit `scale x q . k` over the step's (query, key) pairs that attention reads
(causal, same document). It is measured here beside the attention kernel rather than inside
it, so that every kernel (dot, blockwise, splash, cuDNN) is measured the same way: one more
Q K^T in the forward, a block of queries at a time (`BLOCK`), without gradient.

How the value leaves the layer: the layer takes a probe (float32 zeros [H], one per layer,
scanned with the weights as the fp8 probes are: models/decoder.py), and `emit` adds zero
times the probe to the attention's output through a custom VJP whose backward returns the
measured maxima as the probe's cotangent. The train step differentiates the loss with respect
to the probes; their gradient is the maxima [L, H]. The maxima are global (`jnp.max` over the
batch and sequence, whatever their split), so the cotangent is the same on every device; what
would add several cotangents of one layer (a pipeline's microbatches, context shards, query
chunks) is refused by the config checks (config/checks/run.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 256  # queries per block of the measurement


def max_logits(
    q_BTHQ: jax.Array,
    k_BSHQ: jax.Array,
    scale: float,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None,
) -> jax.Array:
    """[H] float32: each head's largest `scale x q . k` over the causal, same-document pairs."""
    q = jax.lax.stop_gradient(q_BTHQ).astype(jnp.float32)
    k = jax.lax.stop_gradient(k_BSHQ).astype(jnp.float32)
    b, t, h, _ = q.shape
    block = min(BLOCK, t)
    pad = -t % block
    kv_seg_BS = jnp.zeros_like(positions_BT) if segment_ids_BT is None else segment_ids_BT
    q_pos, q_seg = positions_BT, kv_seg_BS
    if pad:  # padded queries read nothing (position -1 is before every key, segment -1 none)
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
        q_seg = jnp.pad(q_seg, ((0, 0), (0, pad)), constant_values=-1)
    blocks = lambda a: jnp.moveaxis(a.reshape(b, -1, block, *a.shape[2:]), 1, 0)

    def one(args):
        q_BCHQ, pos_BC, seg_BC = args
        logits_BHCS = jnp.einsum("bchq,bshq->bhcs", q_BCHQ, k) * scale
        ok_BCS = (positions_BT[:, None, :] <= pos_BC[:, :, None]) & (
            kv_seg_BS[:, None, :] == seg_BC[:, :, None]
        )
        return jnp.max(jnp.where(ok_BCS[:, None], logits_BHCS, -jnp.inf), axis=(0, 2, 3))

    return jnp.max(jax.lax.map(one, (blocks(q), blocks(q_pos), blocks(q_seg))), axis=0)


@jax.custom_vjp
def emit(out: jax.Array, probe_H: jax.Array, value_H: jax.Array) -> jax.Array:
    """`out`, unchanged; the backward gives `value_H` as `probe_H`'s cotangent."""
    return out


def _emit_fwd(out, probe_H, value_H):
    return out, value_H


def _emit_bwd(value_H, g):
    return g, value_H.astype(jnp.float32), jnp.zeros_like(value_H)


emit.defvjp(_emit_fwd, _emit_bwd)
