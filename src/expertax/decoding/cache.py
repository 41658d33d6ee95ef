"""KV caches for decoding: what each attention form keeps per token, and how it is written.

One `LayerCache` per layer (a list per layer stack, and one for MTP module 1 when it drafts):
its own buffers, updated in place by the unrolled decode step (decoding/weights.py says why
not stacked). Its two arrays depend on the attention and the cache form:

- GQA (Mixtral, Llama): keys [B, S, G, Q] and values [B, S, G, O] per kv head.
- MLA `compressed` (DeepSeek's design): the normed KV latent [B, S, Rkv] and the one RoPE key
  shared by all heads [B, S, Qr], already rotated. The up-projection `wkv_b` is absorbed into
  the query side (scores) and the output side (values) at decode time (decoding/attention.py).
- MLA `plain`: per-head keys [B, S, H, Qn+Qr] and values [B, S, H, O], as training computes
  them; a debugging switch that must give the same logits.

Slot j of a sequence holds position j. A step writes its T new tokens at slots start_b .. start_b
+ T - 1 of sequence b and its queries read slots 0 .. their own position: slots past a prompt's
end (right padding) are overwritten by the decoded tokens before any query reads them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.sharding import constrain

FORMS = ("compressed", "plain")


class LayerCache(NamedTuple):
    """One layer's cache; leaves [B, S, ...]."""

    k: jax.Array  # GQA keys | MLA latent (compressed) | MLA per-head keys (plain)
    v: jax.Array  # GQA values | MLA rotated RoPE key (compressed) | MLA per-head values (plain)


class Cache(NamedTuple):
    dense: list[LayerCache]
    moe: list[LayerCache]
    mtp: LayerCache | None


def check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"mla_cache={form!r}: valid forms are {list(FORMS)}")


def token_shapes(c: Config, form: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-token, per-layer shapes of the cache's two arrays."""
    if c.attention_type != "mla":
        g = c.base_num_kv_heads
        return (g, c.head_dim), (g, c.head_dim)
    if form == "compressed":
        return (c.kv_lora_rank,), (c.qk_rope_head_dim,)
    h = c.base_num_query_heads
    return (h, c.qk_head_dim), (h, c.v_head_dim)


def values_per_token(c: Config, form: str = "compressed") -> int:
    """Cached values per token and layer (MLA compressed: Rkv + Qr, 576 for DeepSeek-V3)."""
    k, v = token_shapes(c, form)
    return _prod(k) + _prod(v)


def bytes_per_token(c: Config, form: str = "compressed", *, mtp: bool = False) -> int:
    """Cache bytes per token of the main layer stack (and MTP module 1, which drafts for
    speculative decoding, when `mtp`) in `dtype`."""
    layers = c.base_num_decoder_layers + (1 if mtp else 0)
    return layers * values_per_token(c, form) * jnp.dtype(c.dtype).itemsize


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _axes(c: Config, ndim: int) -> tuple:
    """Logical axes of one layer's [B, S, ...] array: batch-sharded, heads over the tensor axis."""
    if ndim == 3:  # MLA compressed: one latent / one RoPE key per token, no head axis
        return ("batch", None, None)
    heads = "act_kv_heads" if c.attention_type != "mla" else "act_heads"
    return ("batch", None, heads, None)


def constrain_layer(cache: LayerCache, c: Config) -> LayerCache:
    """One layer's cache constrained to the activations' layout (batch shards, head shards)."""
    return LayerCache(
        constrain(cache.k, _axes(c, cache.k.ndim)),
        constrain(cache.v, _axes(c, cache.v.ndim)),
    )


def allocate(c: Config, batch: int, length: int, form: str, *, mtp: bool) -> Cache:
    """A zero cache of `length` slots for `batch` sequences in `dtype`."""
    dtype = jnp.dtype(c.dtype)
    k_shape, v_shape = token_shapes(c, form)

    def layer() -> LayerCache:
        k = jnp.zeros((batch, length, *k_shape), dtype)
        v = jnp.zeros((batch, length, *v_shape), dtype)
        return constrain_layer(LayerCache(k, v), c)

    return Cache(
        dense=[layer() for _ in range(c.num_dense_layers)],
        moe=[layer() for _ in range(c.num_moe_layers)],
        mtp=layer() if mtp else None,  # module 1 drafts (speculative decoding)
    )


def write(cache_BS: jax.Array, new_BT: jax.Array, start_B: jax.Array) -> jax.Array:
    """`new_BT` written into slots start_b .. start_b + T - 1 of each sequence's cache."""

    def one(cache_S, new_T, start):
        index = (start,) + (0,) * (cache_S.ndim - 1)
        return jax.lax.dynamic_update_slice(cache_S, new_T.astype(cache_S.dtype), index)

    return jax.vmap(one)(cache_BS, new_BT, start_B)


def visible(positions_BT: jax.Array, length: int) -> jax.Array:
    """[B, 1, T, S] mask: query (b, t) reads slot j when j <= its position."""
    slots_S = jnp.arange(length, dtype=jnp.int32)
    return (slots_S[None, None, :] <= positions_BT[:, :, None])[:, None]
