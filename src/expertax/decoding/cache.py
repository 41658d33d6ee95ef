"""KV caches for decoding: the layers' caches (nn/attention/cache.py) of the whole model, their
allocation and their sizes.

One cache per layer (a list per layer stack, and one for MTP module 1 when it drafts): its own
buffers, updated in place by the unrolled decode step (decoding/weights.py says why not stacked).
Its type follows the attention and the cache form (`mla_cache`):

- GQA (Mixtral, Llama): `KV`, keys [B, S, G, Q] and values [B, S, G, O] per kv head.
- MLA `compressed` (DeepSeek's design): `Latent`, the normed KV latent [B, S, Rkv] and the one
  RoPE key shared by all heads [B, S, Qr], already rotated; `wkv_b` absorbed (nn/attention/mla.py).
- MLA `plain`: `KV`, per-head keys [B, S, H, Qn+Qr] and values [B, S, H, O], as training
  computes them; a debugging switch that must give the same logits.

Slot j of a sequence holds position j. A step writes its T new tokens at the slots of their
positions and its queries read the slots up to their own position: slots past a prompt's end
(right padding) are overwritten by the decoded tokens before any query reads them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.attention.cache import KV, Latent, LayerCache, constrain_layer

FORMS = ("compressed", "plain")


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


def allocate(c: Config, batch: int, length: int, form: str, *, mtp: bool) -> Cache:
    """A zero cache of `length` slots for `batch` sequences in `dtype`."""
    dtype = jnp.dtype(c.dtype)
    k_shape, v_shape = token_shapes(c, form)

    latent = c.attention_type == "mla" and form == "compressed"
    heads = "act_heads" if c.attention_type == "mla" else "act_kv_heads"

    def layer() -> LayerCache:
        k = jnp.zeros((batch, length, *k_shape), dtype)
        v = jnp.zeros((batch, length, *v_shape), dtype)
        return constrain_layer(Latent(k, v)) if latent else constrain_layer(KV(k, v), heads)

    return Cache(
        dense=[layer() for _ in range(c.num_dense_layers)],
        moe=[layer() for _ in range(c.num_moe_layers)],
        mtp=layer() if mtp else None,  # module 1 drafts (speculative decoding)
    )
