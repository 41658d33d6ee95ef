"""Models: the decoder stack and helpers to declare, initialize and run it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.models import decoder
from expertax.nn import param


def init_params(c: Config, key: jax.Array | None = None, shardings=None) -> decoder.Decoder:
    """Initialize parameters (in `weight_dtype`); with `shardings`, created already sharded."""
    key = jax.random.key(c.init_weights_seed) if key is None else key
    tree = decoder.spec(c)
    dtype = jnp.dtype(c.weight_dtype)
    init = jax.jit(lambda k: param.initialize(tree, k, dtype), out_shardings=shardings)
    return init(key)


def abstract_params(c: Config):
    return param.abstract(decoder.spec(c), jnp.dtype(c.weight_dtype))


def logits(params: decoder.Decoder, tokens, config: Config, *, positions=None, segment_ids=None):
    """Float32 logits [B, T, V] for integer tokens [B, T]."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(
            f"tokens must be a [batch, length] integer array, got shape {tokens.shape}"
        )
    out, _ = decoder.forward(
        params, tokens, config, positions_BT=positions, segment_ids_BT=segment_ids
    )
    return out
