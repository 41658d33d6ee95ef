"""Expert-parallel work in O(routed rows) (issue 11 items 1 and 2): the ring's counting-sort
selection and chunked row loops, and the all-to-all receive side without an argsort, equal the
argsort paths they replaced (kept here as references), outputs and gradients, including routing
where one device receives every row and devices receive none; and the ring's program has no
sort, moves no D-wide rows outside the chunked loops and computes the SwiGLU only on the grouped
matmul's tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.config import config_rules
from expertax.nn import param
from expertax.nn.activation import swiglu
from expertax.nn.moe import dispatch, ep, exchange, gmm, layer, router, rows
from expertax.preflight import load_config
from expertax.sharding import make_mesh, use_rules

pytestmark = pytest.mark.distributed

# ---------------------------------------------------------------------------------------------
# The replaced paths (argsort over every assignment / the whole receive buffer), as references.


def argsort_ring_dispatch(x_ND, routing, w, c, dtype, stash, *, gathered, bias=None):
    wi_0, wi_1, wo = w
    experts_NK, weights_NK = routing.experts_NK, routing.weights_NK
    if not gathered:
        x_ND = jax.lax.all_gather(x_ND, ep.EXPERT, tiled=True)
        experts_NK = jax.lax.all_gather(experts_NK, ep.EXPERT, tiled=True)
        weights_NK = jax.lax.all_gather(weights_NK, ep.EXPERT, tiled=True)
    rows_MD, order, sizes_E = dispatch.permute(x_ND, experts_NK, c.num_experts)
    offset = jax.lax.axis_index(ep.EXPERT) * wi_0.shape[0]
    y, stash = dispatch.expert_ffn_sorted(
        rows_MD, wi_0, wi_1, wo, sizes_E, c, dtype, group_offset=offset, stash=stash, bias=bias
    )
    out_all = dispatch.unpermute_combine(y, order, weights_NK, c, dtype)
    if gathered:
        return jax.lax.psum(out_all, ep.EXPERT), jnp.int32(0), stash
    return jax.lax.psum_scatter(out_all, ep.EXPERT, tiled=True), jnp.int32(0), stash


def argsort_a2a_dispatch(x_ND, routing, w, c, dtype, impl, stash, bias=None):
    wi_0, wi_1, wo = w
    recv_MD, plan, send_order_M = ep.sort_and_send(x_ND, routing.experts_NK, c, impl)
    m = recv_MD.shape[0]
    x = plan.recv_counts_PX.shape[1]
    ends = jnp.cumsum(plan.recv_counts_PX.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right")
    order_M = jnp.argsort(jnp.where(segment < ends.shape[0], segment % x, x), stable=True)
    sizes_X = plan.recv_counts_PX.sum(0)
    y_sorted, stash = dispatch.expert_ffn_sorted(
        jnp.take(recv_MD, order_M, axis=0),
        wi_0,
        wi_1,
        wo,
        sizes_X,
        c,
        dtype,
        stash=stash,
        bias=bias,
    )
    y_MD = jnp.zeros_like(y_sorted).at[order_M].set(y_sorted)
    n, nk = x_ND.shape[0], send_order_M.shape[0]
    block = min(exchange.padded_block_rows(c, n, jax.lax.axis_size(ep.EXPERT), m), nk)
    back = exchange.all_to_all(
        impl,
        y_MD,
        jnp.zeros((nk, y_MD.shape[1]), y_MD.dtype),
        plan.rev_in_off,
        plan.rev_send,
        plan.rev_out_off,
        plan.rev_recv,
        block_rows=block,
    )
    out = dispatch.unpermute_combine(back, send_order_M, routing.weights_NK, c, dtype)
    return out, plan.dropped, stash


# ---------------------------------------------------------------------------------------------
# The row loops alone, against dense numpy references.


@pytest.mark.parametrize("count", [0, 1, 7, 40])
def test_chunked_gather_and_weighted_scatter_match_dense_with_gradients(count):
    """R = 40 rows in chunks of 16 (the last chunk clamped and masked), any count."""
    rng = np.random.default_rng(count)
    n, r, d = 13, 40, 5
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, n, size=r), jnp.int32)
    w = jnp.asarray(rng.normal(size=r), jnp.float32)
    live = (np.arange(r) < count)[:, None]

    def new(x, w):
        g = rows.gather_rows(x, idx, count, chunk=16)
        return rows.scatter_rows(jnp.sin(g), idx, w, count, n, chunk=16), g

    def ref(x, w):
        g = jnp.where(live, x[idx], 0)
        return jnp.zeros((n, d)).at[idx].add(jnp.where(live, jnp.sin(g) * w[:, None], 0)), g

    def results(f):
        grads = jax.grad(lambda x, w: jnp.sum(jnp.cos(f(x, w)[0])), (0, 1))(x, w)
        return (*f(x, w), *grads)

    got, want = results(new), results(ref)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The MoE layer on meshes: new paths vs the argsort references.

LAYOUTS = {
    "ring-ep2-data4": ["ici_expert_parallelism=2", "ici_data_parallelism=4"],
    "ring-ep4-fsdp2": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
    "ring-ep8": ["ici_expert_parallelism=8"],
    "a2a-ep2-data4": ["ici_expert_parallelism=2", "ici_data_parallelism=4"],
    "a2a-ep4-fsdp2": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
    "a2a-ep8": ["ici_expert_parallelism=8"],
}
# deepseek3-tiny: E=16, K=4, groups of 4 experts; the selection bias steers routing.
ROUTINGS = {
    "random": None,
    "all-to-experts-0-3": (slice(0, 4), 10.0),  # expert shard 0 gets every row (EP 2, 4)
    "none-to-experts-4-7": (slice(4, 8), -10.0),  # at EP 4 and 8 some shards get none
}
# One default case (two compiles, ~10-20 s on the CI machine); the a2a receive side is also
# covered by test_ep.py's layer tests against no mesh.
DEFAULT = {("ring-ep8", "all-to-experts-0-3")}
# What covers an on-demand case (covered_by): the default case's variant (the ring's other
# meshes only resize axes; kept and unfused are the same routed.py / row-loop code on the a2a);
# for the a2a, test_ep.py's layer test on a like mesh (the receive side against no mesh: outputs,
# gradients, exact loads) and its hot and empty receivers; the separate FFN on one device.
_HERE = "tests/distributed/test_ep_routed.py::test_routed_paths_equal_the_argsort_paths"
_TEST_EP = "tests/distributed/test_ep.py::"
_A2A_LAYER = {
    "a2a-ep2-data4": "a2a-ep2-tp2-data2-gptoss",
    "a2a-ep4-fsdp2": "a2a-ep4-fsdp2-expfsdp",
    "a2a-ep8": "a2a-ep8",
}


def _covered_by(layout, variant):
    ids = [f"{_HERE}[ring-ep8-all-to-experts-0-3{variant}]"]
    if layout in _A2A_LAYER:
        ids += [
            f"{_TEST_EP}test_layer_forward_gradients_and_stats_match_no_mesh[{_A2A_LAYER[layout]}]",
            f"{_TEST_EP}test_roundtrip_exact_uniform_and_skewed",
        ]
        if variant == "-unfused":
            ids.append(
                "tests/unit/nn/test_activation.py::test_moe_paths_equal_the_oracle[tiled_prologue]"
            )
    return pytest.mark.covered_by(*ids)


def _case(layout, routing, *extra):
    c = load_config(
        overrides=[
            "model_name=deepseek3-tiny",
            "per_device_batch_size=1",
            "max_target_length=8",
            "ici_fsdp_parallelism=1",
            f"use_ring_of_experts={layout.startswith('ring')}",
            "gmm_tile_rows=8",
            *LAYOUTS[layout],
            *extra,
        ]
    )
    p = param.initialize(layer.spec(c), jax.random.key(0), jnp.float32)
    bias = 0.1 * jax.random.normal(jax.random.key(2), (c.num_experts,))
    if ROUTINGS[routing] is not None:
        sl, value = ROUTINGS[routing]
        bias = bias.at[sl].add(value)
    p = dataclasses.replace(p, router=router.Router(p.router.w, bias))
    x = jax.random.normal(jax.random.key(1), (8, c.max_target_length, c.base_emb_dim))
    return c, p, x


def _loss(p, x, c):
    y, st, _ = layer.apply(p, x, c, jnp.float32)
    return jnp.sum(jnp.sin(y)), (y, st.load_E, st.dropped)


def _run(c, p, x):
    mesh = make_mesh(c)
    f = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    with jax.set_mesh(mesh), use_rules(config_rules(c)):
        return f(jax.device_put(p, param.shardings(layer.spec(c), mesh, config_rules(c))), x, c)


# routed FFN variant -> overrides: fused (the default; gate and up recomputed under the
# default remat policy), fused with gate and up kept as residuals, separate
VARIANTS = {
    "": ("moe_fused_routed_ffn=true",),
    "-kept": ("moe_fused_routed_ffn=true", "remat_policy=none"),
    "-unfused": ("moe_fused_routed_ffn=false",),
}


def _cases():
    """Every variant for the default case; otherwise one variant per (layout, routing), chosen
    by a Latin square per implementation, so that each layout and each routing meets every
    variant on both the ring and the all-to-all (17 cases where the full product has 51, at ~14 s
    each on the CI machine): the default case's variants in the default run, the others on
    demand (`-m full_grid`: CI's budget)."""
    variants = list(VARIANTS.items())
    for i, layout in enumerate(LAYOUTS):
        for j, routing in enumerate(ROUTINGS):
            default = (layout, routing) in DEFAULT
            for k, (variant, keys) in enumerate(variants):
                if not default and k != (i + j) % len(variants):
                    continue
                if default:
                    marks = ()
                else:  # on demand (CI's budget)
                    marks = (pytest.mark.full_grid, _covered_by(layout, variant))
                yield pytest.param(
                    layout, routing, keys, marks=marks, id=f"{layout}-{routing}{variant}"
                )


@pytest.mark.parametrize("layout, routing, keys", list(_cases()))
def test_routed_paths_equal_the_argsort_paths(layout, routing, keys, monkeypatch):
    """The fused routed FFN (routed.py, the default) with gate and up recomputed and kept, and
    the separate row loops and grouped matmuls (`moe_fused_routed_ffn=false`)."""
    c, p, x = _case(layout, routing, *keys)
    got = _run(c, p, x)
    monkeypatch.setattr(ep, "ring_dispatch", argsort_ring_dispatch)
    monkeypatch.setattr(ep, "a2a_dispatch", argsort_a2a_dispatch)
    want = _run(c, p, x)
    (_, (_, load, dropped)), _ = got
    if routing == "all-to-experts-0-3":
        assert np.asarray(load)[4:].sum() == 0  # shards past the first receive nothing
    assert int(dropped) == int(want[0][1][2]) == 0
    np.testing.assert_array_equal(np.asarray(load), np.asarray(want[0][1][1]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-6 * max(np.abs(b).max(), 1))


# ---------------------------------------------------------------------------------------------
# The ring's program: no sort, D-wide rows move only in chunks.


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


# Rows per chunk in the program checks: below the ring-ep8 case's worst case (128 rows), so a
# whole-buffer op is told from a chunked one (the default, 256, would hold the whole buffer).
CHECK_CHUNK = 32


def _layer_jaxpr(layout, fused):
    """(config, input, mesh, jaxpr of the value and gradients) of the random-routing case."""
    c, p, x = _case(layout, "random", f"moe_fused_routed_ffn={fused}")
    mesh = make_mesh(c)
    f = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)
    with jax.set_mesh(mesh), use_rules(config_rules(c)):
        p = jax.device_put(p, param.shardings(layer.spec(c), mesh, config_rules(c)))
        jaxpr = jax.make_jaxpr(f, static_argnums=2)(p, x, c).jaxpr
    return c, x, mesh, jaxpr


def _row_ops(layout, monkeypatch, fused=True):
    """(primitive names, [(primitive, rows, row shape)] of gathers and scatters (index rows,
    slice) and of the SwiGLU's sigmoid (operand rows)) of the layer's value and gradients, and
    (P*N*K assignments, D), with row loops of `CHECK_CHUNK` rows."""
    monkeypatch.setattr(rows, "ROW_CHUNK", CHECK_CHUNK)
    c, x, mesh, jaxpr = _layer_jaxpr(layout, fused)
    names, moves = set(), []
    for eqn in _eqns(jaxpr):
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "logistic":  # the SwiGLU's sigmoid, on [rows, F]
            moves.append(("logistic", eqn.invars[0].aval.shape[0], eqn.invars[0].aval.shape[1:]))
        if eqn.primitive.name in ("gather", "scatter-add", "scatter", "scatter_add"):
            operand, indices = eqn.invars[0].aval, eqn.invars[1].aval
            moves.append((eqn.primitive.name, indices.shape[0], operand.shape[1:]))
    ep_size = mesh.shape["expert"]
    assignments = ep_size * x.size // x.shape[-1] // mesh.size * c.num_experts_per_tok
    return names, moves, assignments, c.base_emb_dim


def _wide_moves(moves, d, limit):
    return [m for m in moves if m[2] == (d,) and m[1] > limit]


def _activations(moves, limit):
    return [m for m in moves if m[0] == "logistic" and m[1] > limit]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_ring_program_has_no_sort_and_moves_rows_only_in_chunks(fused, monkeypatch):
    """Every gather or scatter of D-wide rows (forward and backward) handles at most the loops'
    chunk (here `CHECK_CHUNK` rows, < P*N*K); what remains over the P*N*K assignments is index
    work on int32 ids and scalar weights (the counting sort, the weights' gradient). The SwiGLU
    between the grouped matmuls (its sigmoid, forward and in its VJP) runs inside the second
    one, on its work items' tiles only (`gmm_tile_rows=8` here), not on the worst-case row
    buffer."""
    names, moves, assignments, d = _row_ops("ring-ep8", monkeypatch, fused)
    limit = CHECK_CHUNK
    assert "sort" not in names
    assert any(m[2] == (d,) for m in moves)  # the row loops are there, and seen
    assert not _wide_moves(moves, d, limit), moves
    assert any(m[0] == "logistic" for m in moves)
    assert not _activations(moves, limit), moves


def test_negative_control_the_argsort_ring_is_seen(monkeypatch):
    monkeypatch.setattr(ep, "ring_dispatch", argsort_ring_dispatch)
    names, moves, assignments, d = _row_ops("ring-ep8", monkeypatch)
    assert "sort" in names
    assert _wide_moves(moves, d, assignments - 1)


def test_negative_control_a_whole_buffer_swiglu_is_seen(monkeypatch):
    def whole_buffer(gate, up, wo, sizes, act=swiglu, **kw):
        return gmm.gmm(act(gate, up), wo, sizes, **kw)

    monkeypatch.setattr(gmm, "gmm_glu", whole_buffer)  # what GroupedProducts.glu calls
    names, moves, _, d = _row_ops("ring-ep8", monkeypatch, fused=False)
    assert not _wide_moves(moves, d, CHECK_CHUNK)  # the row loops stay chunked
    assert _activations(moves, CHECK_CHUNK)


# ---------------------------------------------------------------------------------------------
# The fused routed FFN: no buffer of the worst-case routed rows that is D wide.


def _buffer_shapes(layout, fused):
    """Shapes of every array the layer's value-and-gradient program makes (loop bodies
    included), the worst-case routed rows M = P*N*min(K, X) of the ring, and D."""
    c, x, mesh, jaxpr = _layer_jaxpr(layout, fused)
    shapes = {
        tuple(v.aval.shape) for e in _eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")
    }
    p_ep = mesh.shape["expert"]
    n_local = x.size // x.shape[-1] // mesh.size
    k, x_local = c.num_experts_per_tok, c.num_experts // p_ep
    return shapes, p_ep * n_local * min(k, x_local), c.base_emb_dim


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "negative-control-unfused"])
def test_fused_ring_makes_no_routed_rows_buffer(fused):
    """With the fused routed FFN the gathered rows, the expert outputs and their gradients
    ([M, D] each, M the worst case) are never arrays: only tiles are. The separate path has
    them (the negative control)."""
    shapes, m, d = _buffer_shapes("ring-ep8", fused)
    assert any(s[:1] == (m,) for s in shapes)  # the [M] index lists and [M, F] gate/up are
    assert ((m, d) in shapes) == (not fused), sorted(s for s in shapes if s[:1] == (m,))
