"""A layer's key/value cache, as the attention layers take and return it (gqa.py, mla.py).

Two forms, each its own type, so that a cache says what it holds:
- `KV`: keys [B, S, G, Q] and values [B, S, G, O] per kv head: GQA (Mixtral, Llama), and MLA's
  per-head form (`plain`, a debugging switch that must give the compressed form's logits);
- `Latent`: MLA's compressed form (DeepSeek's design): the normed KV latent [B, S, Rkv] and the
  one RoPE key shared by all heads [B, S, Qr], already rotated; the up-projection `wkv_b` is
  absorbed into the query side and the output side (mla.py).

Slot j of a sequence holds position j: a layer writes its T new tokens at the slots of their
positions (the first new token's position on: they are consecutive) and its queries read every
slot, masked by position (mask.py: a slot past a query's position is not read, so the slots a
longer prompt or a later step fills cost nothing but their reads).
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from expertax.sharding import constrain


class KV(NamedTuple):
    k: jax.Array  # [B, S, G, Q]
    v: jax.Array  # [B, S, G, O]


class Latent(NamedTuple):
    latent: jax.Array  # [B, S, Rkv]
    rope_key: jax.Array  # [B, S, Qr]


LayerCache = KV | Latent
C = TypeVar("C", KV, Latent)


def write(cache_BS: jax.Array, new_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """`new_BT` written into each sequence's slots from its first new position on."""

    def one(cache_S, new_T, start):
        index = (start,) + (0,) * (cache_S.ndim - 1)
        return jax.lax.dynamic_update_slice(cache_S, new_T.astype(cache_S.dtype), index)

    return jax.vmap(one)(cache_BS, new_BT, positions_BT[:, 0])


def slot_positions(length: int) -> jax.Array:
    """[1, S]: the position each slot holds."""
    return jnp.arange(length, dtype=jnp.int32)[None]


def constrain_layer(cache: C, heads: str | None = None) -> C:
    """A layer's cache in the activations' layout: batch-sharded, per-head arrays' heads over
    the logical axis `heads` (the latent form's per-token arrays have no head axis)."""

    def one(a):
        return constrain(a, ("batch", None, None) if a.ndim == 3 else ("batch", None, heads, None))

    return type(cache)(*(one(a) for a in cache))
