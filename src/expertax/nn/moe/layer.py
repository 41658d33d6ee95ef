"""The MoE layer: route -> dispatch -> expert FFN -> combine, plus shared experts."""

from __future__ import annotations

import dataclasses
import math

import jax

from expertax.config.schema import Config
from expertax.nn import activation, mlp
from expertax.nn.moe import bias, chunks, dispatch, ep, router, strategy, tiles
from expertax.nn.moe.side import Side
from expertax.nn.moe.side import of as side_of
from expertax.nn.param import Param, optional, params_dataclass, projection
from expertax.sharding import constrain
from expertax.sharding.rules import current_rules


@params_dataclass
class MoE:
    router: router.Router
    wi_0: Param  # [E, D, F]
    wi_1: Param  # [E, D, F]
    wo: Param  # [E, F, D]
    shared: mlp.MLP | None
    bi_0: Param = optional()  # [E, F] gate bias (moe_expert_bias; bias.py)
    bi_1: Param = optional()  # [E, F] up bias
    bo: Param = optional()  # [E, D] down bias


def spec(c: Config) -> MoE:
    e, d, f = c.num_experts, c.base_emb_dim, c.base_moe_mlp_dim
    shared = mlp.spec(d, f * c.shared_experts) if c.shared_experts else None
    return MoE(
        router=router.spec(c),
        wi_0=projection((e, d, f), ("exp", "exp_embed", "exp_mlp"), d),
        wi_1=projection((e, d, f), ("exp", "exp_embed", "exp_mlp"), d),
        wo=projection((e, f, d), ("exp", "exp_mlp", "exp_embed"), f),
        shared=shared,
        **(bias.specs(e, d, f) if c.moe_expert_bias else {}),
    )


def apply(
    p: MoE, x_BTD: jax.Array, c: Config, dtype, side: Side | None = None
) -> tuple[jax.Array, router.MoEStats, Side]:
    """MoE output [B, T, D], stats and the side it leaves; the sparse path under a mesh is
    expert-parallel (ep.py).

    `side` (side.py, optional): a paged stash threaded through the sparse paths (the one-hot
    einsum path, `sparse_matmul=false`, has none: config checks) and an imposed routing
    (int32 [B, T, K], `router.route`), whose stats then carry the router's own choice
    (`MoEStats.chosen_BTK`). The routed tokens are cast to `dtype` once here, so the sorted,
    exchanged and gathered rows are in `dtype`; `num_moe_token_chunks` runs route -> dispatch
    -> combine a chunk at a time. Traced under the name scope `moe`, with the grouped matmuls
    told the rows per expert balanced routing gives."""
    with jax.named_scope("moe"), tiles.expected_group_rows(balanced_group_rows(x_BTD.shape, c)):
        return _apply(p, x_BTD, c, dtype, side_of(side))


def balanced_group_rows(shape_BTD, c: Config) -> float:
    """Rows each expert's grouped matmul gets on one device when routing is balanced: a chunk's
    tokens x K / E, over the token shards, times the expert shards a device gathers or
    receives rows from (tokens split over `expert`: the all-to-all or the ring brings them)."""
    tokens = shape_BTD[0] * shape_BTD[1] / c.num_moe_token_chunks
    rows = tokens * c.num_experts_per_tok / c.num_experts
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not strategy.uses_shard_map(c, mesh.size):
        return rows
    axes = strategy.token_axes(current_rules())
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    shards = math.prod(sizes.get(a, 1) for a in axes)
    gathered = sizes.get(strategy.EXPERT, 1) if strategy.EXPERT in axes else 1
    return rows * gathered / shards


def _apply(p: MoE, x_BTD: jax.Array, c: Config, dtype, side: Side):
    b, t, d = x_BTD.shape
    x_in_BTD = x_BTD.astype(dtype)
    if strategy.uses_shard_map(c, ep.mesh_size()):
        out_BTD, stats, out_side = ep.apply(
            p.router, p.wi_0, p.wi_1, p.wo, x_in_BTD, c, dtype, side, bias.of(p)
        )
        return finish(p, x_BTD, out_BTD, c, dtype), stats, out_side
    if c.sparse_matmul:
        (out_ND, chosen_NK), sums, rows_side = chunks.over_rows(
            lambda rows, s: _sparse_chunk(p, rows, c, dtype, s), x_in_BTD.reshape(b * t, d), c, side
        )
        out_BTD = out_ND.reshape(b, t, d)
        chosen_BTK = None if chosen_NK is None else chosen_NK.reshape(b, t, -1)
        side = side.with_stash(rows_side.stash)
    else:
        (out_BTD, chosen_BTK), sums = chunks.over_positions(
            lambda chunk, s: _einsum_chunk(p, chunk, c, dtype, s), x_in_BTD, c, side
        )
    counts_E, prob_sum_E, dropped = sums
    stats = router.balance_stats(counts_E, prob_sum_E, b * t, c, dropped)
    stats = dataclasses.replace(stats, chosen_BTK=chosen_BTK)
    return finish(p, x_BTD, out_BTD, c, dtype), stats, side


def _sparse_chunk(p: MoE, x_ND, c: Config, dtype, side: Side):
    """One chunk of the one-device sorted path: rows x [N, D] and their side (imposed [N, K] or
    None) -> ((out [N, D], the router's own choice [N, K] or None), (counts_E, prob_sum_E,
    dropped), side)."""
    routing = router.route(p.router, x_ND, c, side.imposed)
    out_ND, dropped, stash = dispatch.sparse(x_ND, routing, p, c, dtype, side.stash)
    sums = (routing.counts_E, routing.prob_sum_E, dropped)
    return (out_ND, routing.chosen_NK), sums, side.with_stash(stash)


def _einsum_chunk(p: MoE, x_BTD, c: Config, dtype, side: Side):
    """One chunk (of every sequence) of the one-hot einsum path, like `_sparse_chunk`."""
    b, t, d = x_BTD.shape
    k = c.num_experts_per_tok
    routing = router.route(p.router, x_BTD.reshape(b * t, d), c, side.rows().imposed)
    out_BTD, dropped = dispatch.capacity_einsum(
        x_BTD,
        routing.experts_NK.reshape(b, t, k),
        routing.weights_NK.reshape(b, t, k),
        p,
        c,
        dtype,
    )
    chosen_BTK = None if routing.chosen_NK is None else routing.chosen_NK.reshape(b, t, k)
    return (out_BTD, chosen_BTK), (routing.counts_E, routing.prob_sum_E, dropped)


def finish(p: MoE, x_BTD, out_BTD, c: Config, dtype):
    """Constrain the routed experts' output and add the shared experts."""
    out_BTD = constrain(out_BTD, ("batch", "length", "act_embed"))
    if p.shared is not None:
        out_BTD = out_BTD + mlp.apply(p.shared, x_BTD, dtype, activation.of(c))
    return out_BTD
