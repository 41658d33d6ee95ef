"""The routed expert FFN in grouped loops: gather, SwiGLU FFN and weighted scatter-add per tile.

`routed_ffn(x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X)` computes, for the M routed rows of
the local experts (sorted by expert, `sizes_X` rows each; rows past `sum(sizes_X)` are not
routed), `out[idx[m]] += weight[m] * ffn_x(x[idx[m]])` with
`ffn_x(v) = glu(v @ wi_0[x], v @ wi_1[x]) @ wo[x]`. It is what the row gather (`rows.py`), the
three grouped matmuls (`gmm.py`) and the weighted scatter-back compute one after the other, in
two loops over the tiled gmm's work items instead of five, and without their `[M, D]` buffers:

- `gate_up` (forward): each item gathers its tile of rows from `x_ND` by `idx` and writes both
  projections to the `[M, F]` gate and up buffers, the residuals the backward pass needs (the
  remat names `moe_mlpwi_0` and `moe_mlpwi_1`: a policy keeps, offloads or recomputes them).
- `down_scatter`: each item computes the SwiGLU and the down projection of its tile and adds the
  weighted rows into the `[N, D]` output by `idx`. Its VJP is one loop too: per item the output
  gradient of the tile's rows is gathered by `idx`, turned into the hidden gradient, then the
  gate's and up's, the three weight gradients, the routing weights' gradient and the input
  rows' gradient, which is scatter-added into `[N, D]`. Neither the `[M, D]` expert outputs nor
  the `[M, F]` hidden or gate/up gradients are ever buffers.

When the remat policy recomputes both gate and up (`recomputes_gate_up`: every preset but
`none`), the two loops are one and nothing `[M, F]` is stored: `ffn_scatter`'s forward loop
projects, applies the SwiGLU and the down projection and scatter-adds per tile, and its VJP's
loop projects each tile's gathered rows again (two more dots per tile, the recomputation the
policy asks for, without the `[M, F]` buffers a replayed `gate_up` loop would fill).

The routing weight's gradient needs no expert output y: `d weight[m] = <dout[idx[m]], y[m]>`
= `<dout[idx[m]] @ wo[x]^T, h[m]>`, and `dout[idx[m]] @ wo[x]^T` is computed anyway.

On one device (`dispatch.sparse`) `x_ND` is the tokens and `idx` each sorted assignment's token
(`order // K`); in the ring (`ep.ring_dispatch`) `x_ND` is the all-gathered tokens and `idx`
each routed row's token; in the all-to-all (`ep.a2a_dispatch`) `x_ND` is the receive buffer,
`idx` each sorted row's place in it and `weight` the routing weights that came with the rows
(`injective`: each row is written once, weighted, in the compute dtype), so the output is the
buffer of weighted rows to send back, unsorted already; their home shard only sums them.
Per item there are as many dots as in the separate path (three forward, six backward; eight
with gate and up recomputed), and the cost of the gathers and scatter-adds follows the routed
rows, as the tiled gmm's does. Tiled backend only; a paged stash (stash.py), which stores the
expert outputs, uses the separate path (`use_fused`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.moe import gmm as gmm_mod
from expertax.nn.moe.gmm import glu, varying_like
from expertax.parallel import remat


def use_fused(c: Config, stash) -> bool:
    """Whether the sparse path runs `routed_ffn` (`moe_fused_routed_ffn`, the tiled gmm, no
    paged stash)."""
    return (
        c.moe_fused_routed_ffn and stash is None and gmm_mod.resolve_backend(c.gmm_impl) == "tiled"
    )


def recomputes_gate_up(c: Config) -> bool:
    """Whether the routed rows' gate and up are recomputed per tile in the backward loop (the
    remat policy places both `moe_mlpwi_0` and `moe_mlpwi_1` on `remat`: every preset but
    `none`) rather than kept as `[M, F]` residuals."""
    place = remat.config_placements(c)
    return place[remat.MOE_MLPWI_0] == remat.REMAT and place[remat.MOE_MLPWI_1] == remat.REMAT


def routed_ffn(
    x_ND,
    idx_M,
    weight_M,
    wi_0_XDF,
    wi_1_XDF,
    wo_XFD,
    sizes_X,
    c: Config,
    dtype,
    *,
    n,
    injective: bool = False,
):
    """`out[idx[m]] += weight[m] * ffn(x[idx[m]])` over the routed rows: `[n, D]`.

    The output is in float32 when `weight_M` is given and `float32_weight_sum` is set (the
    combine's accumulator, as `rows.scatter_rows`), else in `dtype`. `weight_M` None: weight 1
    (an unweighted scatter; for a permutation `idx`, the rows unsorted). `injective`: no two
    routed rows share an output row (the all-to-all's receive buffer): nothing is summed, so
    each weighted row (its product still in the accumulator's dtype) is written in `dtype`.
    """
    acc = jnp.float32 if (weight_M is not None and c.float32_weight_sum) else jnp.dtype(dtype)
    out_dtype = jnp.dtype(dtype) if injective else acc
    m = idx_M.shape[0]
    tiles = gmm_mod._tile_ladder(m, c.gmm_tile_rows, c.gmm_tile_rows_min)
    ws = (wi_0_XDF.astype(dtype), wi_1_XDF.astype(dtype), wo_XFD.astype(dtype))
    weight = jnp.ones((m,), acc) if weight_M is None else weight_M.astype(acc)
    args = (x_ND.astype(dtype), idx_M.astype(jnp.int32), weight, *ws, sizes_X.astype(jnp.int32))
    x, idx, weight, wi_0, wi_1, wo, sizes = (varying_like(a, *args) for a in args)
    unit = weight_M is None
    if recomputes_gate_up(c):
        return _ffn_scatter(x, idx, weight, wi_0, wi_1, wo, sizes, n, tiles, unit, out_dtype)
    # gate and up: values only (their gradients are computed by down_scatter's VJP, which
    # takes x and the weights as its own inputs), tagged so that remat policies see them.
    sg = jax.lax.stop_gradient
    gate, up = _gate_up(sg(x), sg(idx), sg(wi_0), sg(wi_1), sg(sizes), tiles)
    gate = remat.tag(gate, remat.MOE_MLPWI_0)
    up = remat.tag(up, remat.MOE_MLPWI_1)
    return _down_scatter(x, idx, weight, gate, up, wi_0, wi_1, wo, sizes, n, tiles, unit, out_dtype)


def _items(sizes_X, m: int, tiles):
    return gmm_mod._work_items(sizes_X, jnp.int32(0), sizes_X.shape[0], m, tiles)


def _dot(a, b, contract_b: int):
    """`a @ b` (contract_b=0) or `a @ b^T` (contract_b=1), float32 accumulation."""
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
    )


def _tile(idx_M, start, tile: int):
    return jax.lax.dynamic_slice_in_dim(idx_M, start, tile)


def _gate_up(x_ND, idx_M, wi_0_XDF, wi_1_XDF, sizes_X, tiles):
    """Both input projections of every routed row, `[M, F]` each (zero past the routed rows)."""
    m, f = idx_M.shape[0], wi_0_XDF.shape[2]
    refs = (x_ND, idx_M, wi_0_XDF, wi_1_XDF, sizes_X)
    zeros = varying_like(jnp.zeros((m, f), x_ND.dtype), *refs)

    tile_gate_up = _projected(x_ND, idx_M, wi_0_XDF, wi_1_XDF)

    def step(g, start, mask, tile, carry):
        gate, up = tile_gate_up(g, start, tile)
        return gmm_mod._put(carry[0], gate, start, mask), gmm_mod._put(carry[1], up, start, mask)

    return gmm_mod._for_items(_items(sizes_X, m, tiles), m, step, (zeros, zeros))


def _down_loop(idx_M, weight_M, gate_up_of, wo_XFD, sizes_X, n: int, tiles, dtype, out_dtype, refs):
    """`out[idx[m]] += weight[m] * glu(gate, up)[m] @ wo` (`[n, D]` in `out_dtype`; the product
    in the weights' dtype), `gate_up_of(g, start, tile)` giving a tile's gate and up (`[tile,
    F]` each, in `dtype`)."""
    m, d = idx_M.shape[0], wo_XFD.shape[2]
    acc = weight_M.dtype
    out = varying_like(jnp.zeros((n, d), out_dtype), *refs)

    def step(g, start, mask, tile, out):
        h = glu(*gate_up_of(g, start, tile))
        w = jax.lax.dynamic_index_in_dim(wo_XFD, g, keepdims=False)
        # y rounded to the compute dtype first, as the separate path stores it
        y = _dot(h, w, 0).astype(dtype).astype(acc)
        y = y * jax.lax.dynamic_slice_in_dim(weight_M, start, tile)[:, None]
        y = jnp.where(mask, y, jnp.zeros((), acc)).astype(out_dtype)
        return out.at[_tile(idx_M, start, tile)].add(y, mode="drop")

    return gmm_mod._for_items(_items(sizes_X, m, tiles), m, step, out)


def _stored(gate_MF, up_MF):
    """A tile's gate and up read from the `[M, F]` residuals (its gathered rows unused)."""
    return lambda g, start, tile, v=None: gmm_mod._tile_of((gate_MF, up_MF), start, tile)


def _projected(x_ND, idx_M, wi_0_XDF, wi_1_XDF):
    """A tile's gate and up computed from its gathered rows `v` (two dots; gathered here when
    not given), rounded to x's dtype as the stored residuals are."""

    def gate_up(g, start, tile, v=None):
        if v is None:
            v = jnp.take(x_ND, _tile(idx_M, start, tile), axis=0, mode="clip")
        w0 = jax.lax.dynamic_index_in_dim(wi_0_XDF, g, keepdims=False)
        w1 = jax.lax.dynamic_index_in_dim(wi_1_XDF, g, keepdims=False)
        return _dot(v, w0, 0).astype(x_ND.dtype), _dot(v, w1, 0).astype(x_ND.dtype)

    return gate_up


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _down_scatter(
    x_ND, idx_M, weight_M, gate_MF, up_MF, wi_0, wi_1, wo, sizes_X, n, tiles, unit, out_dtype
):
    """The SwiGLU, down projection and weighted scatter-add of every routed row from its stored
    gate and up: `[n, D]`.

    `x_ND`, `wi_0` and `wi_1` are not used by the value: they are here for the VJP, which
    returns their gradients (and none for gate and up, whose gradients it uses itself).
    `unit`: the weights are all one (no routing-weight gradient is computed).
    """
    return _down_scatter_fwd(
        x_ND, idx_M, weight_M, gate_MF, up_MF, wi_0, wi_1, wo, sizes_X, n, tiles, unit, out_dtype
    )[0]


def _down_scatter_fwd(
    x_ND, idx_M, weight_M, gate_MF, up_MF, wi_0, wi_1, wo, sizes_X, n, tiles, unit, out_dtype
):
    res = (x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, gate_MF, up_MF)
    tile_gate_up = _stored(gate_MF, up_MF)
    out = _down_loop(
        idx_M, weight_M, tile_gate_up, wo, sizes_X, n, tiles, gate_MF.dtype, out_dtype, res
    )
    return out, res


def _down_scatter_bwd(n, tiles, unit, out_dtype, res, dout_ND):
    *core, gate_MF, up_MF = res
    dx, dweight, dw0, dw1, dwo = _backward(core, _stored(gate_MF, up_MF), dout_ND, tiles, unit)
    return dx, None, dweight, None, None, dw0, dw1, dwo, None


_down_scatter.defvjp(_down_scatter_fwd, _down_scatter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _ffn_scatter(x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, n, tiles, unit, out_dtype):
    """The whole routed FFN of every routed row in one loop (gather, gate and up, SwiGLU, down
    projection, weighted scatter-add): `[n, D]`. Nothing `[M, F]` is stored: the backward loop
    computes each tile's gate and up again from its gathered rows."""
    return _ffn_scatter_fwd(
        x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, n, tiles, unit, out_dtype
    )[0]


def _ffn_scatter_fwd(x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, n, tiles, unit, out_dtype):
    res = (x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X)
    tile_gate_up = _projected(x_ND, idx_M, wi_0, wi_1)
    out = _down_loop(
        idx_M, weight_M, tile_gate_up, wo, sizes_X, n, tiles, x_ND.dtype, out_dtype, res
    )
    return out, res


def _ffn_scatter_bwd(n, tiles, unit, out_dtype, res, dout_ND):
    x_ND, idx_M, _, wi_0, wi_1, *_ = res
    tile_gate_up = _projected(x_ND, idx_M, wi_0, wi_1)
    dx, dweight, dw0, dw1, dwo = _backward(res, tile_gate_up, dout_ND, tiles, unit)
    return dx, None, dweight, dw0, dw1, dwo, None


_ffn_scatter.defvjp(_ffn_scatter_fwd, _ffn_scatter_bwd)


def _backward(core, gate_up_of, dout_ND, tiles, unit):
    """One loop over the work items: per tile the output gradient of its rows gathered by
    `idx`, the hidden, gate and up gradients, the three weight gradients, the routing weights'
    gradient (None when `unit`) and the input rows' gradient scatter-added into `[N, D]`.
    `core`: (x, idx, weight, wi_0, wi_1, wo, sizes); `gate_up_of(g, start, tile, v)` gives the
    tile's gate and up (stored, or recomputed from its gathered rows v, gathered once here)."""
    x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X = core
    refs = (*core, dout_ND)
    m, x_local = idx_M.shape[0], wo.shape[0]
    d, f = x_ND.shape[1], wo.shape[1]
    dx = varying_like(jnp.zeros_like(x_ND), *refs)
    dweight = varying_like(jnp.zeros_like(weight_M), *refs)
    dw_in = varying_like(jnp.zeros((x_local, d, f), jnp.float32), *refs)
    dw_out = varying_like(jnp.zeros((x_local, f, d), jnp.float32), *refs)
    dtype = x_ND.dtype

    def step(g, start, mask, tile, carry):
        dx, dweight, dw0, dw1, dwo = carry
        ids = _tile(idx_M, start, tile)
        gout = jnp.take(dout_ND, ids, axis=0, mode="clip")  # [tile, D], acc dtype
        v_rows = jnp.take(x_ND, ids, axis=0, mode="clip")  # [tile, D]
        h, pull = jax.vjp(glu, *gate_up_of(g, start, tile, v_rows))
        w_o = jax.lax.dynamic_index_in_dim(wo, g, keepdims=False)
        # the unweighted hidden gradient dout[idx] @ wo^T gives the routing weight's gradient
        # <dout[idx], h @ wo> = <dout[idx] @ wo^T, h> without the expert output
        gh = _dot(gout.astype(dtype), w_o, 1)  # [tile, F] float32
        wt = jax.lax.dynamic_slice_in_dim(weight_M, start, tile)[:, None]
        if not unit:
            dwt = jnp.sum(gh * h.astype(jnp.float32), axis=-1)
            old = jax.lax.dynamic_slice_in_dim(dweight, start, tile)
            new = jnp.where(mask[:, 0], dwt.astype(dweight.dtype), old)
            dweight = jax.lax.dynamic_update_slice_in_dim(dweight, new, start, 0)
        dy = jnp.where(mask, (gout * wt).astype(dtype), 0)  # the expert output's gradient
        dwo = gmm_mod._add_weight_grad(dwo, g, jnp.where(mask, h, 0), dy)
        dgate, dup = pull((gh * wt.astype(jnp.float32)).astype(dtype))
        v = jnp.where(mask, v_rows, 0)
        dw0 = gmm_mod._add_weight_grad(dw0, g, v, dgate)
        dw1 = gmm_mod._add_weight_grad(dw1, g, v, dup)
        w0 = jax.lax.dynamic_index_in_dim(wi_0, g, keepdims=False)
        w1 = jax.lax.dynamic_index_in_dim(wi_1, g, keepdims=False)
        dv = _dot(dgate, w0, 1) + _dot(dup, w1, 1)
        dx = dx.at[ids].add(jnp.where(mask, dv, 0).astype(dx.dtype), mode="drop")
        return dx, dweight, dw0, dw1, dwo

    carry = (dx, dweight, dw_in, dw_in, dw_out)
    dx, dweight, dw0, dw1, dwo = gmm_mod._for_items(_items(sizes_X, m, tiles), m, step, carry)
    return (
        dx,
        None if unit else dweight,
        dw0.astype(wi_0.dtype),
        dw1.astype(wi_1.dtype),
        dwo.astype(wo.dtype),
    )
