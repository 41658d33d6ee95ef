"""The MoE layer with each expert's weights held apart: each routed row through its expert's own
weights (decode steps on one device; decoding/weights.py holds the experts so, `unstack`).

A decode step routes a handful of rows (batch x new tokens x K). Training's grouped matmul reads
an expert's weights out of the stacked `[E, D, F]` array with a dynamic slice, which XLA:CPU
copies before the dot (one copy of every chosen expert's three matrices per step: the copies
cost more than the matmuls, which only read the weights once), and its row tiles are at least 8
rows where a decode step has one or two per expert (XLA:CPU's 8-row product is several times
slower per row than its matrix-vector product at these shapes, its 2-row product about as fast
as one row). On one device decoding therefore holds each MoE layer's experts as separate arrays
and multiplies rows by them in place, in a `lax.switch` on the
expert whose branch reads that expert's arrays: each chosen expert's weights are read, not
copied, and only the chosen experts' fp8 weights are dequantized.

- One token (a batch-1 decode step: its K experts are distinct): one loop over its K routed
  rows, a `lax.switch` each (`_per_row`).
- More tokens (larger batches, speculative steps, prefills): the routed rows sorted by expert,
  each expert's rows in tiles of the rows per expert under balanced routing (a power of two,
  `MIN_TILE` to 128), one `lax.switch` per tile (`_grouped`): an expert that several rows chose
  is read once per tile, not once per row (deepseek3-small, batch 8: 128 -> 101 ms per step
  with 2-row tiles against a switch per row).

With a row kernel (`linear.row_kernel`: decoding's CPU kernel, decoding/rowdot.py: float32, one CPU
device, at most `rowdot.MAX_ROWS` tokens, i.e. decode steps), neither: two kernel calls take every
routed row with its expert's weights where they are (joined `wi`, then `wo`), the rows that chose
one expert read its weights together, and a shared expert of a routed expert's shapes rides in the
same calls as one more expert of weight 1 (`_by_kernel`; deepseek3-small, batch 1: 13 of 28 ms per
token in the branches' products before it).

Under a mesh of several devices the experts stay stacked and sharded, and every step runs
training's MoE layer (expert-parallel as configured).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.fp8 import quant
from expertax.nn import activation, linear, mlp
from expertax.nn.activation import joined, swiglu
from expertax.nn.linear import is_joint, project
from expertax.nn.moe import layer as moe_layer
from expertax.nn.moe import router

# The fewest rows per `_grouped` tile (decode steps of a few tokens: one or two rows per expert).
MIN_TILE = 2
EXPERTS = ("wi_0", "wi_1", "wo")
F32 = jnp.float32


def is_unstacked(p: moe_layer.MoE | None) -> bool:
    return p is not None and isinstance(p.wi_0, tuple) and not quant.is_fp8(p.wi_0)


def apply(p: moe_layer.MoE, x_BTD, c: Config, dtype, imposed_BTK=None):
    """The MoE layer's output [B, T, D] (`moe_layer.apply`'s, shared experts included) and its
    stats: None, or with `imposed_BTK` (int32 [B, T, K], `router.route`: -1 keeps the router's
    choice) the balancing sums and the router's own choice (`MoEStats.chosen_BTK`), which is
    how decoding records the routing it samples with (decoding/model.py)."""
    b, t, d = x_BTD.shape
    shared, x_BTD = quant.dequantize(p.shared, dtype, x_BTD)
    x_ND = x_BTD.reshape(b * t, d).astype(dtype)
    imposed_NK = None if imposed_BTK is None else imposed_BTK.reshape(b * t, -1)
    routing = router.route(p.router, x_ND, c, imposed_NK)
    stats = None
    if routing.chosen_NK is not None:
        stats = router.balance_stats(routing.counts_E, routing.prob_sum_E, b * t, c, 0)
        stats = dataclasses.replace(stats, chosen_BTK=routing.chosen_NK.reshape(b, t, -1))
    act = activation.of(c)
    branches = [_ffn(w, dtype, act) for w in zip(p.wi_0, p.wi_1, p.wo, strict=True)]
    wi = [w.w for w in p.wi_0] if all(is_joint(w) for w in p.wi_0) else None
    kernel = linear.current_row_kernel()
    if wi is not None and kernel is not None and kernel.applies(b * t, x_ND, *wi, *p.wo):
        same = shared is not None and is_joint(shared.wi_0)
        same = same and shared.wi_0.w.shape == wi[0].shape and shared.wo.shape == p.wo[0].shape
        with_shared = shared if same else None
        out_ND = _by_kernel(kernel, wi, p.wo, x_ND, routing, dtype, with_shared, act)
        shared = None if same else shared
    elif b * t == 1:
        out_ND = _per_row(branches, x_ND, routing.experts_NK, routing.weights_NK, dtype)
    else:
        out_ND = _grouped(branches, x_ND, routing.experts_NK, routing.weights_NK, dtype)
    out_BTD = out_ND.astype(dtype).reshape(b, t, d)
    if shared is not None and is_joint(shared.wi_0):
        out_BTD = out_BTD + mlp.apply(shared, x_BTD, dtype, act)
        shared = None
    out_BTD = moe_layer.finish(dataclasses.replace(p, shared=shared), x_BTD, out_BTD, c, dtype)
    return out_BTD, stats


def _ffn(w, dtype, act):
    """One expert's gated FFN (`act`) on rows [R, D] -> float32 [R, D], its fp8 weights (if
    any) dequantized where it runs."""

    if is_joint(w[0]):
        return lambda x_RD: _joined_ffn(w[0], w[2], x_RD, dtype, act)

    def ffn(x_RD):
        wi_0, wi_1, wo = (quant.dequantize_array(a, dtype) if quant.is_fp8(a) else a for a in w)
        gate = jnp.dot(x_RD, wi_0.astype(dtype), preferred_element_type=F32).astype(dtype)
        up = jnp.dot(x_RD, wi_1.astype(dtype), preferred_element_type=F32).astype(dtype)
        return jnp.dot(act(gate, up), wo.astype(dtype), preferred_element_type=F32)

    return ffn


def _joined_ffn(wi: linear.Joint, wo, x_RD, dtype, act):
    """One routed expert's FFN on rows [R, D] -> float32 [R, D], its `wi_0 | wi_1` joined."""
    h = project(x_RD, wi.w.astype(dtype), preferred_element_type=F32).astype(dtype)
    return project(joined(h, act), wo.astype(dtype), preferred_element_type=F32)


def _weighted(y_RD, weight_R, dtype):
    """An expert output in `dtype` (as training's), times its routing weight, in float32."""
    return y_RD.astype(dtype).astype(F32) * weight_R[:, None]


def _by_kernel(kernel: linear.RowKernel, wi, wo, x_ND, routing, dtype, shared=None, act=swiglu):
    """`_per_row`'s sum by the row kernel: every routed row multiplied by
    its expert's joined `wi` and its `wo` where they are, the rows that chose one expert
    together; with `shared` (a joined shared expert of a routed one's shapes), each token's row
    through it as one more expert of weight 1, in the same two calls."""
    experts_NK, weights_NK = routing.experts_NK, routing.weights_NK
    n, k = experts_NK.shape
    ids_M, weight_M = experts_NK.reshape(-1), weights_NK.reshape(-1)
    x_MD = jnp.repeat(x_ND, k, axis=0)
    if shared is not None:
        wi, wo = [*wi, shared.wi_0.w], [*wo, shared.wo]
        ids_M = jnp.concatenate([ids_M, jnp.full((n,), len(wo) - 1, ids_M.dtype)])
        weight_M = jnp.concatenate([weight_M, jnp.ones((n,), weight_M.dtype)])
        x_MD = jnp.concatenate([x_MD, x_ND])
    h_MF = kernel.rows(x_MD, wi, ids_M).astype(dtype)
    y_MD = _weighted(kernel.rows(joined(h_MF, act), wo, ids_M), weight_M, dtype)
    out_ND = y_MD[: n * k].reshape(n, k, -1).sum(axis=1)
    return out_ND if shared is None else out_ND + y_MD[n * k :]


def _per_row(branches, x_ND, experts_NK, weights_NK, dtype):
    """sum_k weight[n, k] * ffn_{expert[n, k]}(x[n]) for every row, float32 [N, D]: one
    matrix-vector product per routed row."""
    n, k = experts_NK.shape

    def body(i, out_ND):
        row, slot = i // k, i % k
        x_1D = jax.lax.dynamic_slice_in_dim(x_ND, row, 1)
        y_1D = jax.lax.switch(experts_NK[row, slot], branches, x_1D)
        y_1D = _weighted(y_1D, weights_NK[row, slot][None], dtype)
        return jax.lax.dynamic_update_slice_in_dim(
            out_ND, jax.lax.dynamic_slice_in_dim(out_ND, row, 1) + y_1D, row, 0
        )

    return jax.lax.fori_loop(0, n * k, body, jnp.zeros((n, x_ND.shape[1]), F32))


def _grouped(branches, x_ND, experts_NK, weights_NK, dtype):
    """`_per_row`'s sum for several tokens: the routed rows sorted by expert, each expert's rows
    in tiles of `tile` rows (the rows per expert under balanced routing as a power of two,
    `MIN_TILE` to 128), one `lax.switch` per tile; the outputs scatter-added back to their
    tokens."""
    n, k = experts_NK.shape
    e, m = len(branches), n * k
    tile = min(128, max(MIN_TILE, 1 << max(0, (m // e).bit_length() - 1)), m)
    flat = experts_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows_MD = x_ND[order // k]
    weight_M = weights_NK.reshape(-1)[order]
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    ends = jnp.cumsum(sizes)
    tiles = (sizes + tile - 1) // tile
    cum = jnp.cumsum(tiles)

    def body(i, out_MD):
        g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), e - 1).astype(jnp.int32)
        row0 = ends[g] - sizes[g] + (i - (cum[g] - tiles[g])) * tile
        start = jnp.minimum(row0, m - tile)
        r = start + jnp.arange(tile)
        mask = ((r >= row0) & (r < ends[g]))[:, None]
        x = jax.lax.dynamic_slice_in_dim(rows_MD, start, tile)
        y = _weighted(
            jax.lax.switch(g, branches, x),
            jax.lax.dynamic_slice(weight_M, (start,), (tile,)),
            dtype,
        )
        old = jax.lax.dynamic_slice_in_dim(out_MD, start, tile)
        return jax.lax.dynamic_update_slice_in_dim(out_MD, jnp.where(mask, y, old), start, 0)

    out_MD = jax.lax.fori_loop(0, cum[-1], body, jnp.zeros((m, x_ND.shape[1]), F32))
    return jnp.zeros((n, x_ND.shape[1]), F32).at[order // k].add(out_MD)
