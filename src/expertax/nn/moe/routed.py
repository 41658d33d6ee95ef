"""The routed expert FFN in grouped loops: gather, SwiGLU FFN and weighted scatter-add per tile.

`routed_ffn(x_ND, idx_M, weight_M, (wi_0, wi_1, wo), sizes_X)` computes, for the M routed rows of
the local experts (sorted by expert, `sizes_X` rows each; rows past `sum(sizes_X)` are not
routed), `out[idx[m]] += weight[m] * ffn_x(x[idx[m]])` with
`ffn_x(v) = act(v @ wi_0[x], v @ wi_1[x]) @ wo[x]` (`act`: `activation.of(c)`). It is what the
row gather (`rows.py`), the three grouped matmuls (`gmm.py`) and the weighted scatter-back
compute one after the other, in two loops over the tiled gmm's work items (tiles.py) instead of
five, and without their `[M, D]` buffers:

- `gate_up` (forward): each item gathers its tile of rows from `x_ND` by `idx` and writes both
  projections to the `[M, F]` gate and up buffers, the residuals the backward pass needs (the
  remat names `moe_mlpwi_0` and `moe_mlpwi_1`: a policy keeps, offloads or recomputes them).
- `scatter`: each item computes the SwiGLU and the down projection of its tile and adds the
  weighted rows into the `[N, D]` output by `idx`. Its VJP is one loop too: per item the output
  gradient of the tile's rows is gathered by `idx`, turned into the hidden gradient, then the
  gate's and up's, the three weight gradients, the routing weights' gradient and the input
  rows' gradient, which is scatter-added into `[N, D]`. Neither the `[M, D]` expert outputs nor
  the `[M, F]` hidden or gate/up gradients are ever buffers.

When the remat policy recomputes both gate and up (`recomputes_gate_up`: every preset but
`none`), the two loops are one and nothing `[M, F]` is stored: `scatter`'s forward loop
projects, applies the SwiGLU and the down projection and scatter-adds per tile, and its VJP's
loop projects each tile's gathered rows again (two more dots per tile, the recomputation the
policy asks for, without the `[M, F]` buffers a replayed `gate_up` loop would fill).

The routing weight's gradient needs no expert output y: `d weight[m] = <dout[idx[m]], y[m]>`
= `<dout[idx[m]] @ wo[x]^T, h[m]>`, and `dout[idx[m]] @ wo[x]^T` is computed anyway. So y is
kept only when the policy asks for it (`moe_mlpwo` on `device` or `offload`, e.g. `minimal`,
`none`; `keeps_expert_output`): then `expert_out`, a loop of its own, writes every tile's
output to an `[M, D]` buffer tagged `moe_mlpwo`, `scatter` only weights and adds its rows, and
the backward loop reads the routing weight's gradient from it. The price is the buffer (device
or host memory, as placed) and one more pass over the rows in the forward; the backward's dots
are the same (the down projection is never recomputed either way). With `moe_mlpwo` on
`remat` (the default) nothing changes: no `[M, D]` buffer, no extra loop.

On one device (`dispatch.sparse`) `x_ND` is the tokens and `idx` each sorted assignment's token
(`order // K`); in the ring (`ep.ring_dispatch`) `x_ND` is the all-gathered tokens and `idx`
each routed row's token; in the all-to-all (`ep.a2a_dispatch`) `x_ND` is the receive buffer,
`idx` each sorted row's place in it and `weight` the routing weights that came with the rows
(`injective`: each row is written once, weighted, in the compute dtype), so the output is the
buffer of weighted rows to send back, unsorted already; their home shard only sums them.
Per item there are as many dots as in the separate path (three forward, six backward; eight
with gate and up recomputed), and the cost of the gathers and scatter-adds follows the routed
rows, as the tiled gmm's does. Tiled backend only (`use_fused`). A paged stash (stash.py)
holds the kept `[M, *]` values (`routed_ffn(..., stash=)`): in its read mode they are taken from it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn import activation
from expertax.nn.activation import GatedActivation
from expertax.nn.moe import gmm as gmm_mod
from expertax.nn.moe import tiles
from expertax.nn.moe.stash import Stash, run_ffn
from expertax.nn.moe.vma import varying_like
from expertax.parallel import remat


def use_fused(c: Config) -> bool:
    """Whether the sparse path runs `routed_ffn` (`moe_fused_routed_ffn` and the tiled gmm;
    experts without biases, not under an fp8 `quantization`: bias.py adds the biases between
    the separate grouped matmuls, fp8/matmul.py quantizes them)."""
    tiled = gmm_mod.resolve_backend(c.gmm_impl) == "tiled"
    return c.moe_fused_routed_ffn and tiled and not c.moe_expert_bias and not c.quantization


def recomputes_gate_up(c: Config) -> bool:
    """Whether the routed rows' gate and up are recomputed per tile in the backward loop (the
    remat policy places both `moe_mlpwi_0` and `moe_mlpwi_1` on `remat`: every preset but
    `none`) rather than kept as `[M, F]` residuals."""
    place = remat.config_placements(c)
    return place[remat.MOE_MLPWI_0] == remat.REMAT and place[remat.MOE_MLPWI_1] == remat.REMAT


def keeps_expert_output(c: Config) -> bool:
    """Whether the policy keeps the expert outputs (`moe_mlpwo` on `device` or `offload`): the
    loops then store them as an `[M, D]` residual that the backward loop reads for the routing
    weights' gradient."""
    return remat.config_placements(c)[remat.MOE_MLPWO] != remat.REMAT


def routed_ffn(
    x_ND,
    idx_M,
    weight_M,
    w,
    sizes_X,
    c: Config,
    dtype,
    *,
    n,
    injective: bool = False,
    stash: Stash | None = None,
):
    """`out[idx[m]] += weight[m] * ffn(x[idx[m]])` over the routed rows (`w`: wi_0 [X, D, F],
    wi_1, wo [X, F, D]): (out `[n, D]`, stash).

    The output is in float32 when `weight_M` is given and `float32_weight_sum` is set (the
    combine's accumulator, as `rows.scatter_rows`), else in `dtype`. `weight_M` None: weight 1
    (an unweighted scatter; for a permutation `idx`, the rows unsorted). `injective`: no two
    routed rows share an output row (the all-to-all's receive buffer): nothing is summed, so
    each weighted row (its product still in the accumulator's dtype) is written in `dtype`.
    `stash` (stash.py, optional): the kept names' `[M, *]` values (sorted rows, the routed ones
    first: the valid rows are `[0, sum(sizes))`) are written to it, or, in its read mode, taken
    from it instead of computed.
    """
    acc = jnp.float32 if (weight_M is not None and c.float32_weight_sum) else jnp.dtype(dtype)
    out_dtype = jnp.dtype(dtype) if injective else acc
    m = idx_M.shape[0]
    ladder = tiles.ladder(m, c.gmm_tile_rows, c.gmm_tile_rows_min)
    ws = tuple(a.astype(dtype) for a in w)
    weight = jnp.ones((m,), acc) if weight_M is None else weight_M.astype(acc)
    args = (x_ND.astype(dtype), idx_M.astype(jnp.int32), weight, *ws, sizes_X.astype(jnp.int32))
    x, idx, weight, wi_0, wi_1, wo, sizes = (varying_like(a, *args) for a in args)
    unit = weight_M is None
    # The kept values are computed from stopped inputs and tagged, so that remat policies see
    # them; `_scatter`'s VJP takes x and the weights as its own inputs and gives their gradients.
    sg = jax.lax.stop_gradient
    keep_gate_up = not recomputes_gate_up(c)
    keep_y = keeps_expert_output(c) and not unit  # unit weights: no routing-weight gradient
    act = activation.of(c)

    def ffn(given):
        gate = up = y = None
        if keep_gate_up:
            gate, up = given.get(remat.MOE_MLPWI_0), given.get(remat.MOE_MLPWI_1)
            if gate is None or up is None:
                computed = _gate_up(sg(x), sg(idx), sg(wi_0), sg(wi_1), sg(sizes), ladder)
                gate = computed[0] if gate is None else gate
                up = computed[1] if up is None else up
            gate = remat.tag(gate, remat.MOE_MLPWI_0)
            up = remat.tag(up, remat.MOE_MLPWI_1)
        if keep_y:
            y = given.get(remat.MOE_MLPWO)
            if y is None:
                stopped = (sg(x), sg(idx), sg(wi_0), sg(wi_1), sg(wo), sg(sizes))
                y = _expert_out(*stopped, None if gate is None else (gate, up), ladder, act)
            y = remat.tag(y, remat.MOE_MLPWO)
        out = _scatter(
            x, idx, weight, wi_0, wi_1, wo, sizes, gate, up, y, n, ladder, unit, out_dtype, act
        )
        values = {remat.MOE_MLPWI_0: gate, remat.MOE_MLPWI_1: up, remat.MOE_MLPWO: y}
        return out, {k: v for k, v in values.items() if v is not None}

    return run_ffn(stash, m, sizes, None, sizes.shape[0], ffn)


def _items(sizes_X, m: int, ladder):
    return tiles.work_items(sizes_X, jnp.int32(0), sizes_X.shape[0], m, ladder)


def _dot(a, b, contract_b: int):
    """`a @ b` (contract_b=0) or `a @ b^T` (contract_b=1), float32 accumulation."""
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
    )


def _tile(idx_M, start, tile: int):
    return jax.lax.dynamic_slice_in_dim(idx_M, start, tile)


def _gate_up(x_ND, idx_M, wi_0_XDF, wi_1_XDF, sizes_X, ladder):
    """Both input projections of every routed row, `[M, F]` each (zero past the routed rows)."""
    m, f = idx_M.shape[0], wi_0_XDF.shape[2]
    refs = (x_ND, idx_M, wi_0_XDF, wi_1_XDF, sizes_X)
    zeros = varying_like(jnp.zeros((m, f), x_ND.dtype), *refs)

    tile_gate_up = _projected(x_ND, idx_M, wi_0_XDF, wi_1_XDF)

    def step(g, start, mask, tile, carry):
        gate, up = tile_gate_up(g, start, tile)
        return tiles.put(carry[0], gate, start, mask), tiles.put(carry[1], up, start, mask)

    return tiles.for_items(_items(sizes_X, m, ladder), m, step, (zeros, zeros))


def _tile_out(gate_up_of, wo_XFD, g, start, tile: int, dtype, act: GatedActivation):
    """A tile's expert outputs `act(gate, up) @ wo[g]` in `dtype` (`[tile, D]`), as the
    separate path stores them."""
    w = jax.lax.dynamic_index_in_dim(wo_XFD, g, keepdims=False)
    return _dot(act(*gate_up_of(g, start, tile)), w, 0).astype(dtype)


def _gate_up_of(x_ND, idx_M, wi_0, wi_1, gate_MF, up_MF):
    """A tile's gate and up: read from the stored `[M, F]` residuals, or (None) projected."""
    if gate_MF is None:
        return _projected(x_ND, idx_M, wi_0, wi_1)
    return _stored(gate_MF, up_MF)


def _expert_out(x_ND, idx_M, wi_0, wi_1, wo_XFD, sizes_X, gate_up, ladder, act):
    """The expert output of every routed row, `[M, D]` in x's dtype (zero past the routed
    rows), from the stored gate and up (`gate_up`) or from projecting each tile's rows."""
    m, d = idx_M.shape[0], wo_XFD.shape[2]
    gate_up_of = _gate_up_of(x_ND, idx_M, wi_0, wi_1, *(gate_up or (None, None)))
    refs = (x_ND, idx_M, wi_0, wi_1, wo_XFD, sizes_X)
    zeros = varying_like(jnp.zeros((m, d), x_ND.dtype), *refs)

    def step(g, start, mask, tile, y):
        y_tile = _tile_out(gate_up_of, wo_XFD, g, start, tile, y.dtype, act)
        return tiles.put(y, y_tile, start, mask)

    return tiles.for_items(_items(sizes_X, m, ladder), m, step, zeros)


def _down_loop(idx_M, weight_M, y_of, sizes_X, n: int, d: int, ladder, out_dtype, refs):
    """`out[idx[m]] += weight[m] * y[m]` (`[n, d]` in `out_dtype`; the product in the weights'
    dtype), `y_of(g, start, tile)` giving a tile's expert outputs (`[tile, d]`)."""
    m = idx_M.shape[0]
    acc = weight_M.dtype
    out = varying_like(jnp.zeros((n, d), out_dtype), *refs)

    def step(g, start, mask, tile, out):
        y = y_of(g, start, tile).astype(acc)
        y = y * jax.lax.dynamic_slice_in_dim(weight_M, start, tile)[:, None]
        y = jnp.where(mask, y, jnp.zeros((), acc)).astype(out_dtype)
        return out.at[_tile(idx_M, start, tile)].add(y, mode="drop")

    return tiles.for_items(_items(sizes_X, m, ladder), m, step, out)


def _stored(gate_MF, up_MF):
    """A tile's gate and up read from the `[M, F]` residuals (its gathered rows unused)."""
    return lambda g, start, tile, v=None: tiles.tile_of((gate_MF, up_MF), start, tile)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13, 14))
def _scatter(
    x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, gate, up, y, n, ladder, unit, out_dtype, act
):
    """The weighted scatter-add of every routed row's expert output: `[n, D]`.

    `gate`, `up` (`[M, F]`) and `y` (`[M, D]`) are the kept residuals, or None: without `y`
    the loop computes each tile's output (from the stored gate and up, or, without them, by
    projecting its gathered rows: the whole FFN in one loop); with `y` it only scatters. The
    VJP is one loop too (`_backward`) and returns no gradient for the kept values (their
    inputs are stopped): x's, the weights' and the routing weights' gradients are its own.
    `unit`: the weights are all one (no routing-weight gradient is computed). `act`: the gated
    activation (`activation.of`).
    """
    args = (x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, gate, up, y)
    return _scatter_fwd(*args, n, ladder, unit, out_dtype, act)[0]


def _scatter_fwd(
    x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, gate, up, y, n, ladder, unit, out_dtype, act
):
    res = (x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X, gate, up, y)
    if y is not None:
        y_of = lambda g, start, tile: jax.lax.dynamic_slice_in_dim(y, start, tile)
    else:
        gate_up_of = _gate_up_of(x_ND, idx_M, wi_0, wi_1, gate, up)
        y_of = functools.partial(_tile_out, gate_up_of, wo, dtype=x_ND.dtype, act=act)
    refs = tuple(a for a in res if a is not None)
    d = wo.shape[2]
    return _down_loop(idx_M, weight_M, y_of, sizes_X, n, d, ladder, out_dtype, refs), res


def _scatter_bwd(n, ladder, unit, out_dtype, act, res, dout_ND):
    *core, gate, up, y = res
    gate_up_of = _gate_up_of(*core[:2], *core[3:5], gate, up)
    dx, dweight, dw0, dw1, dwo = _backward(core, gate_up_of, y, dout_ND, ladder, unit, act)
    return dx, None, dweight, dw0, dw1, dwo, None, None, None, None


_scatter.defvjp(_scatter_fwd, _scatter_bwd)


def _backward(core, gate_up_of, y_MD, dout_ND, ladder, unit, act):
    """One loop over the work items: per tile the output gradient of its rows gathered by
    `idx`, the hidden, gate and up gradients, the three weight gradients, the routing weights'
    gradient (None when `unit`) and the input rows' gradient scatter-added into `[N, D]`.
    `core`: (x, idx, weight, wi_0, wi_1, wo, sizes); `gate_up_of(g, start, tile, v)` gives the
    tile's gate and up (stored, or recomputed from its gathered rows v, gathered once here);
    `y_MD`: the kept expert outputs, or None. The routing weight's gradient is
    `<dout[idx], y>` read from y when kept, else `<dout[idx] @ wo^T, h>` (computed anyway)."""
    x_ND, idx_M, weight_M, wi_0, wi_1, wo, sizes_X = core
    refs = (*core, dout_ND) if y_MD is None else (*core, y_MD, dout_ND)
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
        h, pull = jax.vjp(act, *gate_up_of(g, start, tile, v_rows))
        w_o = jax.lax.dynamic_index_in_dim(wo, g, keepdims=False)
        # the unweighted hidden gradient dout[idx] @ wo^T gives the routing weight's gradient
        # <dout[idx], h @ wo> = <dout[idx] @ wo^T, h> without the expert output
        gh = _dot(gout.astype(dtype), w_o, 1)  # [tile, F] float32
        wt = jax.lax.dynamic_slice_in_dim(weight_M, start, tile)[:, None]
        if not unit:
            if y_MD is None:
                dwt = jnp.sum(gh * h.astype(jnp.float32), axis=-1)
            else:
                y = jax.lax.dynamic_slice_in_dim(y_MD, start, tile).astype(jnp.float32)
                dwt = jnp.sum(gout.astype(jnp.float32) * y, axis=-1)
            old = jax.lax.dynamic_slice_in_dim(dweight, start, tile)
            new = jnp.where(mask[:, 0], dwt.astype(dweight.dtype), old)
            dweight = jax.lax.dynamic_update_slice_in_dim(dweight, new, start, 0)
        dy = jnp.where(mask, (gout * wt).astype(dtype), 0)  # the expert output's gradient
        dwo = tiles.add_weight_grad(dwo, g, jnp.where(mask, h, 0), dy)
        dgate, dup = pull((gh * wt.astype(jnp.float32)).astype(dtype))
        v = jnp.where(mask, v_rows, 0)
        dw0 = tiles.add_weight_grad(dw0, g, v, dgate)
        dw1 = tiles.add_weight_grad(dw1, g, v, dup)
        w0 = jax.lax.dynamic_index_in_dim(wi_0, g, keepdims=False)
        w1 = jax.lax.dynamic_index_in_dim(wi_1, g, keepdims=False)
        dv = _dot(dgate, w0, 1) + _dot(dup, w1, 1)
        dx = dx.at[ids].add(jnp.where(mask, dv, 0).astype(dx.dtype), mode="drop")
        return dx, dweight, dw0, dw1, dwo

    carry = (dx, dweight, dw_in, dw_in, dw_out)
    dx, dweight, dw0, dw1, dwo = tiles.for_items(_items(sizes_X, m, ladder), m, step, carry)
    return (
        dx,
        None if unit else dweight,
        dw0.astype(wi_0.dtype),
        dw1.astype(wi_1.dtype),
        dwo.astype(wo.dtype),
    )
