"""The MoE layer stack with a paged stash (`moe_paged_stash=true`): a custom VJP over the scan.

Forward: one `lax.scan` over the layers whose carry is the hidden state and the stash
(nn/moe/stash.py): every layer writes the valid rows of its stashed grouped-matmul outputs at the
running offset. Per layer the scan keeps only the layer input, the offset it started at and
whether its rows fit (decided over all devices, because the backward pass below runs collectives
and every device must take the same branch); a layer that did not fit rewinds the offset and
leaves its rows out.

Backward: a reverse scan. A layer that fit runs its VJP with the stash in read mode: every
stashed matmul gets its output back from the buffer (`gmm(..., given=...)`, whose backward is the
grouped matmul's own), everything else of the layer is recomputed. A layer that did not fit runs
the plain layer's VJP (a full recomputation). Either way the gradients are those of the plain
stack. The stack owns its residuals: besides the per-layer inputs only the shared buffers are
saved, never a layer's worst-case tensors. docs/design/stash.md.

Layer kinds (`attention_layer_pattern`): one block function per kind of the n-layer cycle, both
scans running one cycle per step (`layer_pattern.scan`), layer l with `blocks[l % n]`; the stash
is written and read in layer order as with one kind.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from expertax.config.schema import Config
from expertax.models import layer_pattern
from expertax.nn.moe import ep, strategy
from expertax.nn.moe import stash as stash_mod
from expertax.nn.moe.router import MoEStats

# block(p, x, stash) -> (x, stats, stash): one decoder layer (models/decoder.py)
BlockFn = Callable[..., tuple[jax.Array, MoEStats, stash_mod.Stash | None]]


def axis_sizes(c: Config) -> dict[str, int]:
    """Mesh axis sizes of the MoE layer's devices: the mesh when it runs in `shard_map`, else {}."""
    if not strategy.uses_shard_map(c, ep.mesh_size()):
        return {}
    return dict(jax.sharding.get_abstract_mesh().shape)


def run(stacked, x_BTD, positions_BT, segment_ids_BT, c: Config, blocks: Sequence[BlockFn]):
    """The MoE stack `stacked` ([L, ...] leaves) over x: (x, per-layer MoEStats [L, ...]).

    `blocks`: the block function of each layer kind of the stack's cycle, layer l running
    `blocks[l % len(blocks)]` (L a multiple of the cycle's length)."""
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    b, t, _ = x_BTD.shape
    sizes = axis_sizes(c)
    expected = stash_mod.expected_rows(c, b * t, sizes) * num_layers

    def forward(stacked, x_BTD, positions_BT, segment_ids_BT):
        def body(block, carry, p):
            x_BTD, stash = carry
            start = stash.offset
            stash = stash.with_fields(fits=jnp.ones_like(stash.fits))
            y_BTD, stats, stash = block(p, x_BTD, positions_BT, segment_ids_BT, stash)
            fits = jnp.all(stash.fits)  # one decision for all devices
            stash = stash.with_fields(offset=jnp.where(fits, stash.offset, start))
            stats = dataclasses.replace(
                stats,
                stash_overflow=(~fits).astype(jnp.int32),
                stash_factor=jnp.max(stash.rows).astype(jnp.float32) / expected,
            )
            return (y_BTD, stash), (stats, x_BTD, start, fits)

        stash = stash_mod.empty(c, num_layers, b * t, x_BTD.dtype, sizes)
        bodies = [functools.partial(body, block) for block in blocks]
        (y_BTD, stash), (stats, xs, starts, fits) = layer_pattern.scan(
            bodies, (x_BTD, stash), stacked
        )
        return (y_BTD, stats), (stacked, xs, stash, starts, fits, positions_BT, segment_ids_BT)

    @jax.custom_vjp
    def stack(stacked, x_BTD, positions_BT, segment_ids_BT):
        return forward(stacked, x_BTD, positions_BT, segment_ids_BT)[0]

    def backward(res, cts):
        stacked, xs, stash, starts, fits, positions_BT, segment_ids_BT = res
        dy_BTD, dstats = cts
        read = stash.with_fields(mode=stash_mod.READ)

        def layer_vjp(block, p, x_BTD, layer_stash, dy_BTD, dstat):
            def f(p, x_BTD):
                y_BTD, stats, _ = block(p, x_BTD, positions_BT, segment_ids_BT, layer_stash)
                return y_BTD, stats

            _, vjp = jax.vjp(f, p, x_BTD)
            return vjp((dy_BTD, dstat))

        def body(block, dy_BTD, inp):
            p, x_BTD, start, fit, d_load, d_lb, d_prob = inp
            dstat = MoEStats(
                load_E=d_load,
                lb_loss=d_lb,
                dropped=np.zeros((), jax.dtypes.float0),
                prob_sum_E=d_prob,
            )
            dp, dx = jax.lax.cond(
                fit,
                lambda: layer_vjp(block, p, x_BTD, read.with_fields(offset=start), dy_BTD, dstat),
                lambda: layer_vjp(block, p, x_BTD, None, dy_BTD, dstat),
            )
            return dx, dp

        inputs = (stacked, xs, starts, fits, dstats.load_E, dstats.lb_loss, dstats.prob_sum_E)
        bodies = [functools.partial(body, block) for block in blocks]
        dx_BTD, dstacked = layer_pattern.scan(bodies, dy_BTD, inputs, reverse=True)
        return dstacked, dx_BTD, None, None

    stack.defvjp(forward, backward)
    return stack(stacked, x_BTD, positions_BT, segment_ids_BT)


def capacity_factor_note(factor_needed: float, c: Config) -> str:
    """The console's note for a step in which some layer's rows did not fit."""
    fit = math.ceil(factor_needed * 100) / 100
    return (
        f"paged stash overflow: the MoE rows needed moe_paged_stash_capacity_factor >= {fit:.2f} "
        f"(set {c.moe_paged_stash_capacity_factor}); the layers that did not fit were recomputed"
    )
