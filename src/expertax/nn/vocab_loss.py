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


@jax.custom_vjp
def nll_sum(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> jax.Array:
    """Sum of weights x (log-sum-exp - target logit): the weighted cross-entropy, float32 logits.

    Its own VJP because the derivation JAX makes of log_softmax + take_along_axis costs several
    [B, T, V] passes in the backward (a zeros broadcast and a scatter-add for the target, the exp
    of the log-probabilities, a multiply-add), the largest elementwise work of a small model's
    step. The gradient is written once, in one pass: weight x (softmax - one-hot target).
    """
    return _nll_fwd(logits_BTV, targets_BT, weights_BT)[0]


def _nll_terms(logits_BTV, targets_BT):
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return lse_BT, lse_BT - target_BT


def _nll_fwd(logits_BTV, targets_BT, weights_BT):
    lse_BT, nll_BT = _nll_terms(logits_BTV, targets_BT)
    return jnp.sum(nll_BT * weights_BT), (logits_BTV, lse_BT, nll_BT, targets_BT, weights_BT)


def _nll_bwd(res, g):
    logits_BTV, lse_BT, nll_BT, targets_BT, weights_BT = res
    vocab_V = jax.lax.broadcasted_iota(targets_BT.dtype, logits_BTV.shape, logits_BTV.ndim - 1)
    onehot_BTV = (vocab_V == targets_BT[..., None]).astype(logits_BTV.dtype)
    probs_BTV = jnp.exp(logits_BTV - lse_BT[..., None])
    d_logits = (g * weights_BT)[..., None].astype(logits_BTV.dtype) * (probs_BTV - onehot_BTV)
    return d_logits, None, (g * nll_BT).astype(weights_BT.dtype)


nll_sum.defvjp(_nll_fwd, _nll_bwd)


def _tile_nll_sum(x_BSD, head_DV, targets_BS, weights_BS):
    """Sum over the tile of weight x (log-sum-exp - target logit), in float32."""
    logits_BSV = project(x_BSD, head_DV, preferred_element_type=jnp.float32)
    return nll_sum(logits_BSV, targets_BS, weights_BS)


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
