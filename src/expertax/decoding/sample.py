"""Choosing the next token: greedy at temperature 0, else sampling with top-k and top-p.

The log-probability reported for a token is the model's own (log-softmax of the raw logits),
whatever the temperature and filters were: it is what the model assigns to the text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def log_prob(logits_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """log p(token) under the model's distribution, float32 [B]."""
    lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp_BV, tokens_B[:, None], axis=-1)[:, 0]


def filtered(logits_BV: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Logits / temperature with the tokens outside the top k (k > 0) and outside the smallest
    set whose probability reaches top_p (top_p < 1) set to -inf. The most likely token is
    always kept."""
    x = logits_BV.astype(jnp.float32) / jnp.float32(temperature)
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if top_p < 1.0:
        sorted_BV = jnp.sort(x, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BV, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        keep = before < jnp.float32(top_p)  # the first token always (before = 0)
        cutoff = jnp.min(jnp.where(keep, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= cutoff, x, -jnp.inf)
    return x


def choose(logits_BV, key, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """The next tokens int32 [B]: argmax at temperature 0, else a draw from the filtered
    distribution with `key`."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    x = filtered(logits_BV, temperature, top_k, top_p)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
