"""DeepSeek-V3 multi-token prediction (MTP): D modules after the main stack.

Module k (k = 1..D) sees, at position i, the previous depth's hidden state h^(k-1)_i and the
embedding of the token k positions ahead, t_(i+k), and predicts t_(i+k+1):

    h'_i  = eh_proj [RMSNorm_e(Emb(t_(i+k))); RMSNorm_h(h^(k-1)_i)]
    h^k_i = Block_k(h')            (the model's decoder block, own weights, same positions)
    P_k   = softmax(head(RMSNorm_k(h^k)))      (the main model's output head)

h^0 is the main model's final-normed hidden state, the one its output head reads; h^k (k >= 1)
is module k's block output. The embedding and the head are shared with the main model. The
concatenation puts the embedding first, the order of the published checkpoint's `eh_proj` (as
vLLM, SGLang and Megatron-Core read it; the technical report writes the hidden state first).

Targets: position i contributes to depth k when t_(i+k+1) is a target of the batch (its weight,
i.e. not padding) and positions i and i+k are in the same packed document (equal segment ids):
no prediction crosses a document boundary or the end of the sequence.

The block's MoE layer is a routed layer like the main stack's: its load-balance loss joins the
main layers' mean, and its routing bias is updated from its own load (train/step.py), as the
published checkpoint's MTP layer carries its own `e_score_correction_bias`. It runs unscanned
and without the paged stash (the stash serves the scanned MoE stack), under the remat policy
of the main layers (its activations carry the same names).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.models import decoder
from expertax.nn import norm
from expertax.nn.linear import project
from expertax.nn.moe.router import MoEStats
from expertax.parallel import remat
from expertax.sharding import constrain


class Depth(NamedTuple):
    """One depth's head input and targets."""

    x_BTD: jax.Array  # RMSNorm_k(h^k) in `dtype`: what the output head reads
    targets_BT: jax.Array  # int32: t_(i+k+1)
    weights_BT: jax.Array  # float32: 0 where position i has no target at this depth


def shift_left(a_BT: jax.Array, k: int, fill) -> jax.Array:
    """a[:, k:] followed by k columns of `fill` (position i gets position i+k's value)."""
    pad = jnp.full((a_BT.shape[0], k, *a_BT.shape[2:]), fill, a_BT.dtype)
    return jnp.concatenate([a_BT[:, k:], pad], axis=1)


def depth_targets(batch: dict, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens t_(i+k), targets t_(i+k+1), weights) of depth k for a batch of inputs, targets,
    weights and optional segment_ids."""
    tokens_BT = shift_left(batch["inputs"], k, 0)
    targets_BT = shift_left(batch["targets"], k, 0)
    weights_BT = shift_left(batch["weights"].astype(jnp.float32), k, 0.0)
    segments = batch.get("segment_ids")
    if segments is not None:
        same_BT = shift_left(segments, k, -1) == segments
        weights_BT = weights_BT * same_BT.astype(jnp.float32)
    return tokens_BT, targets_BT, weights_BT


def module_input(params: decoder.Decoder, layer, h_BTD, tokens_BT, c: Config) -> jax.Array:
    """An MTP module's block input: its normed token embeddings and normed incoming hidden
    states side by side, through `eh_proj` (training's depths and decoding's drafts)."""
    dtype, eps = jnp.dtype(c.dtype), c.normalization_layer_epsilon
    e_BTD = norm.rms_norm(layer.enorm, decoder.embed_tokens(params, tokens_BT, c), eps)
    hn_BTD = norm.rms_norm(layer.hnorm, h_BTD, eps)
    cat_BTX = jnp.concatenate([e_BTD.astype(dtype), hn_BTD.astype(dtype)], axis=-1)
    return constrain(project(cat_BTX, layer.eh_proj.astype(dtype)), decoder.ACT_BTD)


def forward(
    params: decoder.Decoder, h_BTD: jax.Array, batch: dict, c: Config, probes=None
) -> tuple[list[Depth], MoEStats | None]:
    """Every depth's head input and targets from the main model's final-normed hidden states
    `h_BTD`, and the modules' MoE stats ([D, ...] leaves; None for a dense model). `probes`:
    each depth's fp8 probe ([D, ...], fp8/stats.py), or None."""
    assert params.mtp is not None, "forward needs a model with mtp_num_layers > 0"
    dtype = jnp.dtype(c.dtype)
    eps = c.normalization_layer_epsilon
    b, t, _ = h_BTD.shape
    positions_BT = batch.get("positions")
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    segment_ids_BT = batch.get("segment_ids")

    def block(x_BTD, layer: decoder.Block, probe):
        return decoder.block_apply(
            layer, x_BTD, c, positions_BT, segment_ids_BT, dtype, probe=probe
        )[:2]

    block = remat.wrap_layer(block, c, prevent_cse=True)
    depths, all_stats = [], []
    for k in range(1, c.mtp_num_layers + 1):
        layer = jax.tree.map(lambda a, k=k: a[k - 1], params.mtp)
        if "mtp_depths" in batch:  # computed before a reorder of the sequence (context.py)
            tokens_BT, targets_BT, weights_BT = batch["mtp_depths"][k - 1]
        else:
            tokens_BT, targets_BT, weights_BT = depth_targets(batch, k)
        x_BTD = module_input(params, layer, h_BTD, tokens_BT, c)
        probe = None if probes is None else jax.tree.map(lambda a, k=k: a[k - 1], probes)
        h_BTD, stats = block(x_BTD, layer.block, probe)
        out_BTD = norm.rms_norm(layer.head_norm, h_BTD, eps)
        depths.append(Depth(out_BTD, targets_BT, weights_BT))
        all_stats.append(stats)
    if all_stats[0] is None:
        return depths, None
    return depths, jax.tree.map(lambda *s: jnp.stack(s), *all_stats)


def accepted(params: decoder.Decoder, depth: Depth, c: Config) -> tuple[jax.Array, jax.Array]:
    """(positions whose depth's top-1 token equals its target, positions with a target): the
    agreement speculative decoding would accept (MaxText's MTP "acceptance rate"), float32."""
    head_DV = decoder.output_head(params, c)
    n = c.num_vocab_tiling
    b, t, d = depth.x_BTD.shape

    def tile_hits(x_BSD, targets_BS, weights_BS):
        logits_BSV = project(x_BSD, head_DV, preferred_element_type=jnp.float32)
        hit_BS = (jnp.argmax(logits_BSV, axis=-1) == targets_BS).astype(jnp.float32)
        return jnp.sum(hit_BS * weights_BS)

    if n == 1:
        hits = tile_hits(depth.x_BTD, depth.targets_BT, depth.weights_BT)
    else:  # a sequence tile of logits at a time, as the loss (nn/vocab_loss.py)

        def tiles(a):
            return jnp.moveaxis(a.reshape(b, n, t // n, *a.shape[2:]), 1, 0)

        def body(total, tile):
            return total + tile_hits(*tile), None

        xs = (tiles(depth.x_BTD), tiles(depth.targets_BT), tiles(depth.weights_BT))
        hits, _ = jax.lax.scan(body, jnp.float32(0), xs)
    return hits, jnp.sum(depth.weights_BT)
