"""Expert parallelism: the sparse MoE path inside one `shard_map` (docs/design/ep.md).

Mesh axes: tokens are sharded over the batch axes (data, fsdp, expert); routed-expert weights
over `expert` on E and over `tensor` on F. Two strategies, both dropless by default:

- all-to-all (`use_ring_of_experts=false`): each shard routes its own tokens and sorts the N*K
  assignments by expert; the per-expert counts are all-gathered over `expert` so that every shard
  knows the whole exchange (`ExchangePlan`); rows travel to the shard that owns their expert with a
  ragged all-to-all, are sorted by local expert, go through the grouped matmuls of the local
  experts, are unsorted and sent back with the reverse all-to-all, then combined.
  `jax.lax.ragged_all_to_all` where the backend has it (GPU, TPU); `padded_all_to_all` elsewhere
  (XLA:CPU has no ragged all-to-all): the same semantics from `jax.lax.all_to_all` over per-peer
  blocks padded to a static size.
- ring of experts (`use_ring_of_experts=true`): all-gather tokens and their assignments over
  `expert`, run the local experts on the assignments that are theirs (gmm with `group_offset`),
  combine locally, reduce-scatter over `expert`.

With tensor parallelism F is sharded and each shard's combined output is a partial sum, reduced
with one psum over `tensor` after the combine (the combine is linear, so this equals a psum after
`wo` on fewer rows). Balancing statistics are psum-reduced over the batch axes so that the
returned `MoEStats` is the same on every shard.

Shape letters (docs/notation.md): N local tokens, K top-k, M routed rows (the N*K rows this
shard sorts and sends; the rows of its receive buffer), P shards on the expert axis (EP), E
experts, X = E/P local experts, D model dim, F MLP dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from expertax.config.schema import Config
from expertax.fp8 import stats as fp8_stats
from expertax.nn import linear
from expertax.nn.moe import bias as bias_mod
from expertax.nn.moe import chunks, dispatch, routed, router, rows
from expertax.nn.moe import stash as stash_mod
from expertax.nn.moe.bias import ExpertBias
from expertax.nn.moe.exchange import (
    ExchangePlan,
    all_to_all,
    buffer_rows,
    exclusive_cumsum,
    make_plan,
    padded_block_rows,
)
from expertax.nn.moe.side import Side
from expertax.nn.moe.side import of as side_of
from expertax.nn.moe.side import specs as side_specs
from expertax.nn.moe.stash import Stash
from expertax.nn.moe.strategy import EXPERT, moe_specs, resolve_a2a_impl
from expertax.nn.moe.vma import varying_over
from expertax.nn.param import params_dataclass
from expertax.sharding.rules import current_rules


def mesh_size() -> int:
    """Devices in the active mesh (1 without one): `strategy.uses_shard_map` decides with it."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.size


# ---------------------------------------------------------------------------------------------
# The all-to-all strategy, step by step.


def sort_and_send(x_ND, experts_NK, c: Config, impl: str):
    """Sort this shard's (already routed) assignments by expert, send the rows to their experts.

    Returns (received rows [M, D], plan, send order [N*K]); received rows are grouped by source.
    """
    ep = jax.lax.axis_size(EXPERT)
    n, k = experts_NK.shape
    rows_MD, send_order_M, sizes_E = dispatch.permute(x_ND, experts_NK, c.num_experts)
    counts_PE = jax.lax.all_gather(sizes_E, EXPERT)
    m = buffer_rows(c, n * k, n, ep)
    plan = make_plan(counts_PE, jax.lax.axis_index(EXPERT), m)
    recv_MD = send(rows_MD, plan, m, impl, padded_block_rows(c, n, ep, m))
    return recv_MD, plan, send_order_M


def send(rows_MD, plan: ExchangePlan, num_rows: int, impl: str, block_rows: int):
    """Send rows in this shard's expert-sorted order (`[N*K, ...]`) to their experts' shards by
    the plan: `[num_rows, ...]`, grouped by source."""
    return all_to_all(
        impl,
        rows_MD,
        rows.own_zeros((num_rows, *rows_MD.shape[1:]), rows_MD.dtype, rows_MD),
        plan.fwd_in_off,
        plan.fwd_send,
        plan.fwd_out_off,
        plan.fwd_recv,
        block_rows=block_rows,
        longest=plan.longest,
        recv_off=plan.rev_in_off,  # where each source's rows start in this receive buffer
    )


@params_dataclass
class LocalOrder:
    """The receive buffer's rows in local-expert order, as two inverse index lists over the
    first `total` rows (the rows received; they fill the buffer's head, packed by source).

    `src_M[r]`: buffer row of sorted row r; `dst_M[b]`: sorted row of buffer row b.
    """

    src_M: jax.Array  # [M] int32
    dst_M: jax.Array  # [M] int32
    total: jax.Array  # scalar int32


def _segment_map(sizes_S, starts_S, m: int):
    """For positions 0..m-1 laid out as consecutive segments of `sizes_S`: the position
    `starts_S[segment] + offset in segment` (positions past the last segment map to 0)."""
    ends = jnp.cumsum(sizes_S)
    pos = jnp.arange(m, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(ends, pos, side="right"), sizes_S.shape[0] - 1)
    mapped = starts_S[seg] + pos - (ends[seg] - sizes_S[seg])
    return jnp.where(pos < ends[-1], mapped, 0).astype(jnp.int32)


def local_expert_order(recv_counts_PX, m: int) -> tuple[LocalOrder, jax.Array]:
    """Where each received row goes when sorted by local expert, and the group sizes [X].

    Index work only (O(M) int32 over P*X segments, no argsort): the buffer holds segments
    (source i, local expert x) in that order; the sorted rows hold them in (x, i) order.
    """
    counts_PX = recv_counts_PX.astype(jnp.int32)
    p, x = counts_PX.shape
    by_src = counts_PX.reshape(-1)  # buffer order (i, x)
    by_exp = counts_PX.T.reshape(-1)  # sorted order (x, i)
    buf_start_PX = exclusive_cumsum(by_src, 0).reshape(p, x)
    sorted_start_PX = exclusive_cumsum(by_exp, 0).reshape(x, p).T
    order = LocalOrder(
        src_M=_segment_map(by_exp, buf_start_PX.T.reshape(-1), m),
        dst_M=_segment_map(by_src, sorted_start_PX.reshape(-1), m),
        total=jnp.sum(by_src),
    )
    return order, counts_PX.sum(0)


def sort_by_local_expert(recv_MD, recv_counts_PX):
    """The received rows sorted by local expert (rows past the received ones are zero), the
    order (its `dst_M` undoes the sort) and the local group sizes [X]; O(rows received x D)."""
    order, sizes_X = local_expert_order(recv_counts_PX, recv_MD.shape[0])
    return rows.gather_rows(recv_MD, order.src_M, order.total), order, sizes_X


def local_expert_ffn(
    rows_MD,
    wi_0_XDF,
    wi_1_XDF,
    wo_XFD,
    group_sizes_X,
    c: Config,
    dtype,
    stash: Stash | None,
    bias=None,
):
    """The grouped matmuls of this shard's X experts over rows sorted by local expert:
    (y, stash)."""
    return dispatch.expert_ffn_sorted(
        rows_MD, wi_0_XDF, wi_1_XDF, wo_XFD, group_sizes_X, c, dtype, stash=stash, bias=bias
    )


def send_back(y_MD, plan: ExchangePlan, num_rows: int, impl: str, block_rows: int):
    """Send each received row's output (`y_MD`, in receive-buffer order) back to its source
    shard (reverse all-to-all).

    Returns [N*K, D] rows in this shard's expert-sorted order; rows that were dropped are zero.
    """
    block = min(block_rows, num_rows)
    return all_to_all(
        impl,
        y_MD,
        rows.own_zeros((num_rows, y_MD.shape[1]), y_MD.dtype, y_MD),
        plan.rev_in_off,
        plan.rev_send,
        plan.rev_out_off,
        plan.rev_recv,
        block_rows=block,
        longest=plan.longest,
        recv_off=plan.fwd_in_off,  # rows come home where they left
    )


def a2a_dispatch(x_ND, routing: router.Routing, w, c: Config, dtype, impl: str, stash,
                 bias=None):  # fmt: skip
    """The all-to-all strategy on one shard: (partial output [N, D], dropped rows, stash).
    `bias`: the local experts' biases (bias.py), or None."""
    wi_0, wi_1, wo = w
    recv_MD, plan, send_order_M = sort_and_send(x_ND, routing.experts_NK, c, impl)
    m, n = recv_MD.shape[0], x_ND.shape[0]
    block = padded_block_rows(c, n, jax.lax.axis_size(EXPERT), m)
    home_weights_NK = routing.weights_NK
    if routed.use_fused(c):
        # The routing weights travel with their rows ([N*K, 1], the same plan) and the grouped
        # loop weights each expert output where it is computed; its VJP gives the weights'
        # gradient from the hidden gradient. The home shard only sums its K rows, so nothing
        # of the combine's backward needs the expert outputs: under remat the expert FFN's
        # forward loop and the return exchange are not replayed in the backward pass.
        w_sorted = dispatch.take_rows(routing.weights_NK.reshape(-1, 1), send_order_M, 1)
        w_recv = send(w_sorted, plan, m, impl, block)
        # sorted row r is received row src[r] and goes back there: gather and unsort by src
        order, sizes_X = local_expert_order(plan.recv_counts_PX, m)
        w_rows = rows.gather_rows(w_recv, order.src_M, order.total)[:, 0]
        y_MD, stash = routed.routed_ffn(
            recv_MD, order.src_M, w_rows, w, sizes_X, c, dtype, n=m, injective=True, stash=stash
        )
        home_weights_NK = jnp.ones_like(routing.weights_NK)
    else:
        sorted_MD, recv_order, sizes_X = sort_by_local_expert(recv_MD, plan.recv_counts_PX)
        y_sorted, stash = local_expert_ffn(
            sorted_MD, wi_0, wi_1, wo, sizes_X, c, dtype, stash, bias
        )
        y_MD = rows.gather_rows(y_sorted, recv_order.dst_M, recv_order.total)
    back_MD = send_back(y_MD, plan, send_order_M.shape[0], impl, block)
    out_ND = dispatch.unpermute_combine(back_MD, send_order_M, home_weights_NK, c, dtype)
    return out_ND, plan.dropped, stash


# ---------------------------------------------------------------------------------------------
# The ring-of-experts strategy.


@params_dataclass
class LocalRows:
    """The assignments of this shard's local experts, compacted in local-expert order.

    Rows `[0, count)` of the [R]-sized lists are real (R: the worst case, every token's
    min(K, X) assignments local); `sizes_X` are the local experts' group sizes.
    """

    token_R: jax.Array  # [R] int32: the row's token
    weight_R: jax.Array  # [R]: its routing weight (zero past count)
    sizes_X: jax.Array  # [X] int32
    count: jax.Array  # scalar int32


def select_local(experts_NK, weights_NK, first_expert, num_local: int) -> LocalRows:
    """A counting sort of the N*K assignments onto the local experts: no argsort, no row data.

    Each local assignment's row is its expert's start (exclusive prefix sum of the local group
    sizes) plus its rank among that expert's assignments (an inclusive prefix sum over a one-hot
    [N*K, X] key, int32); token ids and weights are scattered to those rows, the others are
    dropped. Stable: within an expert, rows keep the (token, slot) order `permute` gives them,
    so the grouped matmuls see the same rows in the same order as the argsort path.
    """
    n, k = experts_NK.shape
    key = experts_NK.reshape(-1).astype(jnp.int32) - first_expert  # [N*K]
    local = (key >= 0) & (key < num_local)
    onehot = (key[:, None] == jnp.arange(num_local, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    sizes_X = jnp.sum(onehot, axis=0)
    starts_X = exclusive_cumsum(sizes_X, 0)
    r = n * min(k, num_local)
    dest = jnp.where(local, starts_X[jnp.clip(key, 0, num_local - 1)] + rank, r)
    token = jnp.arange(n * k, dtype=jnp.int32) // k
    return LocalRows(
        token_R=jnp.zeros((r,), jnp.int32).at[dest].set(token, mode="drop"),
        weight_R=jnp.zeros((r,), weights_NK.dtype)
        .at[dest]
        .set(weights_NK.reshape(-1), mode="drop"),
        sizes_X=sizes_X,
        count=jnp.sum(sizes_X),
    )


def ring_dispatch(
    x_ND, routing: router.Routing, w, c: Config, dtype, stash, *, gathered: bool, bias=None
):
    """All-gather over `expert`, local experts only, combine, reduce-scatter: (out [N, D], 0,
    stash).

    `gathered`: the tokens are already replicated over `expert` (expert-as-TP rules, `ep-tp`):
    no all-gather, and a psum instead of the reduce-scatter.

    After the all-gather only the local experts' assignments are touched: `select_local` (index
    work over the P*N*K assignments), then the row gather, the grouped matmuls and the weighted
    scatter-back over those `count` rows only (rows.py), forward and backward.
    """
    wi_0, wi_1, wo = w
    x_local = wi_0.shape[0]
    experts_NK, weights_NK = routing.experts_NK, routing.weights_NK
    if not gathered:
        x_ND = jax.lax.all_gather(x_ND, EXPERT, tiled=True)  # [P*N, D]
        experts_NK = jax.lax.all_gather(experts_NK, EXPERT, tiled=True)
        weights_NK = jax.lax.all_gather(weights_NK, EXPERT, tiled=True)
    sel = select_local(experts_NK, weights_NK, jax.lax.axis_index(EXPERT) * x_local, x_local)
    n_all = x_ND.shape[0]
    if routed.use_fused(c):  # gather, FFN and weighted scatter in the grouped loops
        out_all, stash = routed.routed_ffn(
            x_ND, sel.token_R, sel.weight_R, w, sel.sizes_X, c, dtype, n=n_all, stash=stash
        )
    else:
        rows_RD = rows.gather_rows(x_ND, sel.token_R, sel.count)
        y, stash = dispatch.expert_ffn_sorted(
            rows_RD, wi_0, wi_1, wo, sel.sizes_X, c, dtype, stash=stash, bias=bias
        )
        acc = jnp.float32 if c.float32_weight_sum else dtype
        out_all = rows.scatter_rows(y, sel.token_R, sel.weight_R.astype(acc), sel.count, n_all)
    out_all = out_all.astype(dtype)  # the local experts' part of every token's output
    if gathered:
        return jax.lax.psum(out_all, EXPERT), jnp.int32(0), stash
    out_ND = jax.lax.psum_scatter(out_all, EXPERT, scatter_dimension=0, tiled=True)
    return out_ND, jnp.int32(0), stash


# ---------------------------------------------------------------------------------------------
# The shard_map.


def global_stats(counts_E, prob_sum_E, num_tokens: int, dropped, c: Config, axes):
    """MoEStats from sums over the shards whose routed tokens differ (`axes`), on every shard.

    `counts_E`, `prob_sum_E`: this shard's sums over its `num_tokens` routed tokens (all chunks).
    `dropped` (int32) is already the total of an expert group (the same on each of its shards).
    """
    counts_E = _psum_all(counts_E, axes)
    prob_sum_E = _psum_all(prob_sum_E, axes)
    groups = jax.lax.axis_size(EXPERT) if EXPERT in axes else 1
    total_dropped = _psum_all(dropped.astype(jnp.int32), axes) // groups
    shards = jax.lax.axis_size(axes)
    return router.balance_stats(counts_E, prob_sum_E, num_tokens * shards, c, total_dropped)


def _psum_all(x, axes):
    """psum over `axes` of a value that may vary over only some of them (e.g. with
    use_random_routing the counts do not depend on the shard's tokens): each shard adds its own."""
    return jax.lax.psum(varying_over(x, axes), axes)


def _chunk(x_ND, side: Side, router_p, w, *, c, dtype, impl, split, bias=None):
    """One token chunk on one shard, rows x [N, D] and their side (imposed routing [N, K] or
    None, the stash): ((partial out [N, D], the router's own choice [N, K] or None),
    (counts_E, prob_sum_E, dropped), side)."""
    routing = router.route(router_p, x_ND, c, side.imposed)
    if c.use_ring_of_experts:
        out_ND, dropped, stash = ring_dispatch(
            x_ND, routing, w, c, dtype, side.stash, gathered=not split, bias=bias
        )
    else:
        out_ND, dropped, stash = a2a_dispatch(x_ND, routing, w, c, dtype, impl, side.stash, bias)
    sums = (routing.counts_E, routing.prob_sum_E, dropped)
    return (out_ND, routing.chosen_NK), sums, side.with_stash(stash)


def _probe_once_over(lanes, axes: tuple[str, ...]) -> fp8_stats.Probe:
    """The layer's fp8 probe inside the shard_map whose expert MLP dim is split over `axes`:
    the D-wide rows (gate's and up's input, the down projection's output gradient) are the same
    on every F shard, so only the first counts them; the F-wide ones are each shard's own."""
    if not axes:
        return fp8_stats.Probe.of(lanes)
    first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes]))
    return fp8_stats.Probe(lanes, lanes * first.astype(lanes.dtype))


def _body(
    x_BTD_local, router_p, wi_0_local, wi_1_local, wo_local, side: Side, bias_local, *, c, dtype,
    impl, specs,
):  # fmt: skip
    """One shard. The tokens are sharded over `specs.tokens`; when those do not include `expert`
    (expert-as-TP rules) they are replicated over it.

    The shard's tokens go through `_chunk` `num_moe_token_chunks` at a time (chunks.py).
    """
    b, t, d = x_BTD_local.shape
    x_ND, side = x_BTD_local.reshape(b * t, d), side.rows()
    w = (wi_0_local, wi_1_local, wo_local)
    bias_local = bias_mod.once_over(bias_local, specs.mlp)
    ring = c.use_ring_of_experts
    split = EXPERT in specs.tokens
    stat_axes = specs.tokens + specs.seq  # every axis whose shards route other tokens
    if not split and not ring:  # replicated tokens: each expert shard routes and sends 1/EP
        stat_axes = (*stat_axes, EXPERT)
        n = b * t // jax.lax.axis_size(EXPERT)
        mine = lambda a: jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(EXPERT) * n, n)  # noqa: E731
        x_ND = mine(x_ND)
        side = Side(side.stash, jax.tree.map(mine, side.imposed))
    routed_tokens = x_ND.shape[0]
    (out_ND, chosen_NK), (counts_E, prob_sum_E, dropped), side = chunks.over_rows(
        lambda x, s: _chunk(
            x, s, router_p, w, c=c, dtype=dtype, impl=impl, split=split, bias=bias_local
        ),
        x_ND,
        c,
        side,
    )
    if not split and not ring:
        out_ND, chosen_NK = jax.tree.map(
            lambda a: jax.lax.all_gather(a, EXPERT, tiled=True, to="invarying"), (out_ND, chosen_NK)
        )
    if specs.mlp:
        out_ND = jax.lax.psum(out_ND, specs.mlp)  # partial sums over the F shards
    stats = global_stats(counts_E, prob_sum_E, routed_tokens, dropped, c, stat_axes)
    if chosen_NK is not None:  # an imposed routing: the router's own choice goes out too
        stats = dataclasses.replace(stats, chosen_BTK=chosen_NK.reshape(b, t, -1))
    return out_ND.reshape(b, t, d), stats, side.stash


def apply(
    router_p: router.Router,
    wi_0_EDF,
    wi_1_EDF,
    wo_EFD,
    x_BTD,
    c: Config,
    dtype,
    side: Side | None = None,
    bias: ExpertBias | None = None,
) -> tuple[jax.Array, router.MoEStats, Side]:
    """Routed experts' output [B, T, D], global MoEStats and the side left, under the active mesh.

    Global shapes in, global shapes out. Per device: x [B/(data*fsdp*expert), T, D] (or
    [B/(data*fsdp), T, D] under expert-as-TP rules, where `batch` does not use `expert`),
    weights [E/expert, D, F/tensor]; weights stored over `fsdp` are all-gathered by the in_specs.
    The in/out specs come from the rules table (`strategy.moe_specs`: `batch`, `act_exp`,
    `exp_mlp`), so a rules preset and the layer cannot disagree silently.
    The side (side.py): a paged stash holds one buffer per device, split over every mesh axis;
    an imposed routing (int32 [B, T, K]) is sharded like x (`router.route`), and the stats
    then carry the router's own choice (`MoEStats.chosen_BTK`).
    """
    side = side_of(side)
    impl = resolve_a2a_impl(c)
    specs = moe_specs(current_rules())
    router_spec = jax.tree.map(lambda _: P(), router_p)

    # A stash in write mode comes back filled; one in read mode is only read (returns None).
    writes = side.stash is not None and side.stash.mode == stash_mod.WRITE

    # the fp8 probe goes in whole; the GEMMs inside count into the shard's copy, whose
    # cotangents the shard_map's transpose sums over the shards (fp8/stats.py)
    recipe, probe = linear.current_fp8(), linear.current_fp8_probe()
    lanes = None if probe is None else probe.lanes

    def body(x, rp, wi_0, wi_1, wo, side, b, lanes):
        inner = None if lanes is None else _probe_once_over(lanes, specs.mlp)
        with linear.fp8(recipe, inner):
            out, stats, stash = _body(
                x, rp, wi_0, wi_1, wo, side, b, c=c, dtype=dtype, impl=impl, specs=specs
            )
        return out, stats, stash if writes else None

    chosen_spec = None if side.imposed is None else specs.x
    lanes_spec = None if lanes is None else P()
    stats_spec = router.MoEStats(
        load_E=P(), lb_loss=P(), dropped=P(), prob_sum_E=P(), chosen_BTK=chosen_spec
    )
    side_spec = side_specs(side, specs.x, jax.sharding.get_abstract_mesh().axis_names)
    gate_up = P(specs.expert, specs.mlp or None)  # [E, F], the expert biases (bias.py)
    down = P(specs.expert, None)  # [E, D]
    bias_spec = None if bias is None else ExpertBias._make([gate_up, gate_up, down])
    fn = jax.shard_map(
        body,
        in_specs=(
            specs.x,
            router_spec,
            specs.wi,
            specs.wi,
            specs.wo,
            side_spec,
            bias_spec,
            lanes_spec,
        ),
        out_specs=(specs.x, stats_spec, side_spec.stash if writes else None),
        check_vma=c.pipeline_stages == 1,
    )
    out, stats, stash = fn(x_BTD, router_p, wi_0_EDF, wi_1_EDF, wo_EFD, side, bias, lanes)
    return out, stats, side.with_stash(stash)
