"""Next-token cross-entropy from the last hidden states, the logits computed a tile at a time.

The float32 logits of a whole batch, [B, T, V], are the largest activation of a large-vocabulary
model (DeepSeek-V3: 4096 x 129280 x 4 bytes = 2 GiB per sequence) and, with their log-softmax and
its gradient, several such buffers live at once. `num_vocab_tiling` (MaxText's name) splits the
sequence into that many tiles; a scan computes each tile's logits, log-sum-exp and target logit,
and `jax.checkpoint` on the tile makes the backward pass recompute the tile's logits instead of
saving them. Only one tile's [B, T / tiles, V] logits exist at a time, forward or backward. The
sequence axis is tiled (not the batch), so the batch sharding of the hidden states is kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.nn.linear import project


def _tile_nll_sum(x_BSD, head_DV, targets_BS, weights_BS):
    """Sum over the tile of weight x (log-sum-exp - target logit), in float32."""
    logits_BSV = project(x_BSD, head_DV, preferred_element_type=jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    target_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return jnp.sum((lse_BS - target_BS) * weights_BS)


def tiled_nll_sum(
    x_BTD: jax.Array,
    head_DV: jax.Array,
    targets_BT: jax.Array,
    weights_BT: jax.Array,
    num_tiles: int,
) -> jax.Array:
    """Sum of weights x negative log-likelihood of `targets` under softmax(x @ head), float32.

    x_BTD and head_DV in the compute dtype; T must be divisible by `num_tiles` (a config check).
    """
    b, t, d = x_BTD.shape
    if t % num_tiles:
        raise ValueError(f"sequence length {t} is not divisible by num_vocab_tiling={num_tiles}")
    s = t // num_tiles
    weights_BT = weights_BT.astype(jnp.float32)
    if num_tiles == 1:
        return _tile_nll_sum(x_BTD, head_DV, targets_BT, weights_BT)

    def tiles(a):  # [B, T, ...] -> [tiles, B, T / tiles, ...]
        return jnp.moveaxis(a.reshape(b, num_tiles, s, *a.shape[2:]), 1, 0)

    tile_fn = jax.checkpoint(_tile_nll_sum)

    def body(total, tile):
        return total + tile_fn(*tile[:1], head_DV, *tile[1:]), None

    total, _ = jax.lax.scan(
        body, jnp.float32(0), (tiles(x_BTD), tiles(targets_BT), tiles(weights_BT))
    )
    return total
