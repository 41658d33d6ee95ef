"""The decoder run over a KV cache: the main stacks, the output head and the MTP module.

The same parameters and the same layers as `models/decoder.py`: the attention layers of nn/attention
with their caches (reading and writing them by position), the MoE layer through `nn/moe/layer.py`
(its dispatch, routing bias and expert parallelism are training's). Each stack runs unrolled over
its layers' own weights and cache buffers (decoding/weights.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from expertax.config.schema import Config
from expertax.decoding.cache import Cache
from expertax.fp8 import quant
from expertax.models import decoder, layer_pattern, mtp
from expertax.nn import norm
from expertax.nn.attention.cache import LayerCache
from expertax.nn.linear import project
from expertax.nn.moe.side import Side
from expertax.sharding.rules import current_rules, logical_to_spec


def block_step(p: decoder.Block, x_BTD, c: Config, positions_BT, lc: LayerCache, dtype,
               slots=None, window: int | None = None, record: bool = False):  # fmt: skip
    """One decoder layer (training's, `decoder.block_apply`) over its cache: (x, the updated
    cache, the experts its router chose [B, T, K] or None). `window`: the layer's sliding window
    (None: full; the cache keeps every slot and the mask reads the window's). `slots` (static):
    only the first `slots` slots are read and written (a prefill: the prompt's), the rest of the
    cache kept as it is. `record` (an MoE layer): the routing is asked for as the parity probe
    asks (nn/moe/side.py: every entry imposed -1 keeps the router's own choice, and the stats
    return it), so the experts returned are the ones this step computed with."""
    view = lc if slots is None else type(lc)(*(a[:, :slots] for a in lc))
    side = None
    if record and p.moe is not None:
        b, t = x_BTD.shape[:2]
        side = Side(imposed=jnp.full((b, t, c.num_experts_per_tok), -1, jnp.int32))
    x_BTD, stats, _, view = decoder.block_apply(
        p, x_BTD, c, positions_BT, None, dtype, side, cache=view, window=window
    )
    chosen_BTK = None if stats is None else stats.chosen_BTK
    if slots is None:
        return x_BTD, view, chosen_BTK
    new = type(lc)(*(a.at[:, :slots].set(w) for a, w in zip(lc, view, strict=True)))
    return x_BTD, new, chosen_BTK


def _layers(layers, caches: list[LayerCache], x_BTD, c: Config, positions_BT, slots,
            record: bool = False):  # fmt: skip
    """A layer stack unrolled (decoding/weights.py): (x, the layers' updated caches, the MoE
    layers' chosen experts [B, T, L, K] when `record`, else None)."""
    dtype = jnp.dtype(c.dtype)
    new, chosen = [], []
    for i, (p, lc) in enumerate(zip(layers or [], caches, strict=True)):
        window = layer_pattern.window_of(c, i)
        x_BTD, lc, chosen_BTK = block_step(
            p, x_BTD, c, positions_BT, lc, dtype, slots, window, record
        )
        new.append(lc)
        if chosen_BTK is not None:
            chosen.append(chosen_BTK)
    return x_BTD, new, jnp.stack(chosen, axis=2) if chosen else None


def positions(start_B: jax.Array, t: int) -> jax.Array:
    """[B, T] positions of T new tokens written from slot start_b."""
    return start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def main_step(params: decoder.Decoder, tokens_BT, start_B, cache: Cache, c: Config, slots=None):
    """The main model over T new tokens per sequence at positions start_b ..: the final-normed
    hidden states [B, T, D] (what the output head and MTP module 1 read) and the cache."""
    h_BTD, cache, _ = routed_step(params, tokens_BT, start_B, cache, c, slots, record=False)
    return h_BTD, cache


def routed_step(params: decoder.Decoder, tokens_BT, start_B, cache: Cache, c: Config, slots=None,
                *, record: bool = True):  # fmt: skip
    """`main_step`, and with `record` the experts each MoE layer's router chose for the T tokens
    and used, int32 [B, T, L_moe, K] (None without MoE layers or `record`)."""
    positions_BT = positions(start_B, tokens_BT.shape[1])
    x_BTD = decoder.embed_tokens(params, tokens_BT, c)
    x_BTD, dense, _ = _layers(params.dense_layers, cache.dense, x_BTD, c, positions_BT, slots)
    x_BTD, moe, chosen_BTLK = _layers(
        params.moe_layers, cache.moe, x_BTD, c, positions_BT, slots, record
    )
    h_BTD = norm.rms_norm(params.final_norm, x_BTD, c.normalization_layer_epsilon)
    return h_BTD, cache._replace(dense=dense, moe=moe), chosen_BTLK


def head_spec(mesh, rules, shape_DV) -> PartitionSpec:
    """How decoding holds the output head `lm_head` [D, V] on `mesh`: whole along D, its
    vocabulary over the mesh axes training's rules shard either axis over (those that divide V).

    Training's rules shard the head's embedding axis (FSDP, or the expert axis under expert
    parallelism); the decode step then gathers the whole head on every device for each token's
    logits (DeepSeek-V3 671B on tpu:v5p-16: two 1.73 GiB copies among the temporaries, and 1.5 GiB
    moved per step). Held over V, each device multiplies the (small) hidden states by its own
    slice of the vocabulary."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    axes: list[str] = []
    for part in logical_to_spec(("embed", "vocab"), rules, mesh, shape_DV):
        axes += [part] if isinstance(part, str) else list(part or ())
    kept: list[str] = []
    for a in axes:
        if shape_DV[1] % (math.prod(sizes[k] for k in kept) * sizes[a]) == 0:
            kept.append(a)
    return PartitionSpec(None, tuple(kept) if len(kept) > 1 else kept[0] if kept else None)


def logits(params: decoder.Decoder, h_BXD, c: Config) -> jax.Array:
    """Float32 logits [..., V] of final-normed hidden states; under a mesh, with the vocabulary
    sharded as `head_spec` holds the head (the hidden states gathered whole first)."""
    head_DV = decoder.output_head(params, c)
    mesh, rules = jax.sharding.get_abstract_mesh(), current_rules()
    spec = None
    if params.lm_head is not None and not mesh.empty and rules is not None:
        spec = head_spec(mesh, rules, head_DV.shape)
    if spec is None or spec[1] is None:
        return project(h_BXD, head_DV, preferred_element_type=jnp.float32)
    h_BXD = jax.lax.with_sharding_constraint(h_BXD, PartitionSpec())
    head_DV = jax.lax.with_sharding_constraint(head_DV, spec)
    out = project(h_BXD, head_DV, preferred_element_type=jnp.float32)
    return jax.lax.with_sharding_constraint(out, PartitionSpec(*[None] * (out.ndim - 1), spec[1]))


def mtp_step(params: decoder.Decoder, h_BTD, next_BT, start_B, cache: Cache, c: Config,
             slots=None):  # fmt: skip
    """MTP module 1 (models/mtp.py) over T positions: at position i it reads the main model's
    hidden state h_i and the embedding of t_(i+1) (`next_BT`) and its head input predicts
    t_(i+2). Returns the head input [B, T, D] and the cache."""
    assert params.mtp is not None and cache.mtp is not None
    dtype = jnp.dtype(c.dtype)
    eps = c.normalization_layer_epsilon
    layer, h_BTD = quant.dequantize(params.mtp, dtype, h_BTD)  # module 1 (decoding/weights.py)
    lc = cache.mtp
    x_BTD = mtp.module_input(params, layer, h_BTD, next_BT, c)
    positions_BT = positions(start_B, next_BT.shape[1])
    x_BTD, lc, _ = block_step(layer.block, x_BTD, c, positions_BT, lc, dtype, slots)
    return norm.rms_norm(layer.head_norm, x_BTD, eps), cache._replace(mtp=lc)
