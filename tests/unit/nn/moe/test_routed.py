"""The fused routed FFN (nn/moe/routed.py): gather, grouped SwiGLU FFN and weighted scatter-add in
the tiled gmm's loops equal a loop over experts on gathered rows, value and every gradient (the
input, the routing weights, the three weight stacks), with empty groups, remainder tiles, no
routed rows at all, and rows past the routed ones that point anywhere; with gate and up kept as
residuals (`remat_policy=none`) and recomputed per tile in the backward loop (every preset)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.activation import swiglu as glu
from expertax.nn.moe import routed
from expertax.preflight import load_config
from tests.tolerances import tol

N, D, F, X = 11, 6, 10, 3


# what the policy keeps -> its keys: gate and up recomputed (full), kept with the expert output
# y (none), and y kept with gate and up recomputed (moe_mlpwo alone)
GATE_UP = {
    "recomputed": {"remat_policy": "full"},
    "kept": {"remat_policy": "none"},
    "y-kept": {"remat_policy": "custom", "moe_mlpwo": "device"},
}


def _config(gate_up="recomputed", **kw):
    over = {
        "model_name": "mixtral-tiny",
        "gmm_tile_rows": 8,
        "gmm_tile_rows_min": 2,
        **GATE_UP[gate_up],
        **kw,
    }
    c = load_config(overrides=over)
    assert routed.recomputes_gate_up(c) == (gate_up != "kept")
    assert routed.keeps_expert_output(c) == (gate_up != "recomputed")
    return c


def _inputs(sizes, m, dtype, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    routed_rows = int(sum(sizes))
    idx = rng.integers(0, N, size=m)  # rows past the routed ones: any index (never read)
    return dict(
        x=normal(N, D),
        idx=jnp.asarray(idx, jnp.int32),
        weight=jnp.asarray(np.where(np.arange(m) < routed_rows, rng.random(m), 7.0), jnp.float32),
        wi_0=normal(X, D, F) * 0.3,
        wi_1=normal(X, D, F) * 0.3,
        wo=normal(X, F, D) * 0.3,
        sizes=jnp.asarray(sizes, jnp.int32),
    )


def _reference(x, weight, wi_0, wi_1, wo, idx, sizes, dtype, acc):
    """Loop over experts: each group's rows gathered, its FFN, weighted, scatter-added."""
    out = jnp.zeros((N, D), acc)
    start = 0
    for e, size in enumerate(np.asarray(sizes)):
        ids = idx[start : start + size]
        v = x[ids].astype(dtype)
        h = glu(v @ wi_0[e].astype(dtype), v @ wi_1[e].astype(dtype))
        y = (h @ wo[e].astype(dtype)).astype(acc)
        w = jnp.ones((size,), acc) if weight is None else weight[start : start + size].astype(acc)
        out = out.at[ids].add(y * w[:, None])
        start += size
    return out


def _value_and_grads(fn, a, weighted):
    def loss(x, weight, wi_0, wi_1, wo):
        out = fn(x, weight if weighted else None, wi_0, wi_1, wo)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    argnums = (0, 1, 2, 3, 4) if weighted else (0, 2, 3, 4)
    (_, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(
        a["x"], a["weight"], a["wi_0"], a["wi_1"], a["wo"]
    )
    return (out, *grads)


SIZES = [
    ((5, 0, 13), 24),  # an empty group, a full tile plus a remainder, padding rows
    ((0, 0, 0), 16),  # nothing routed: zero output, zero gradients
    ((1, 1, 1), 3),  # one row per group, no padding
    ((17, 9, 6), 32),  # every row routed; clamped remainder tiles overlap full ones
]


# Every pair of (sizes, gate_up) by default with `weighted` alternating (each pair of values of
# any two parameters appears); the other half of the product on demand (-m full_grid): CI's budget.
# An on-demand case is covered by the default case of the same sizes and gate_up (pytest's id
# numbers the parameter sets: sizes{index}).
_LOOP = "tests/unit/nn/moe/test_routed.py::test_routed_ffn_equals_a_loop_over_experts"


def _loop_case(i, case, w, weighted, g, gate_up):
    if not (i + g + weighted) % 2:
        return pytest.param(*case, weighted, gate_up)
    other = (i * 2 + 1 - w) * len(GATE_UP) + g  # the same sizes and gate_up, `weighted` flipped
    cover = f"{_LOOP}[sizes{other}-{case[1]}-{not weighted}-{gate_up}]"
    return pytest.param(
        *case, weighted, gate_up, marks=[pytest.mark.full_grid, pytest.mark.covered_by(cover)]
    )


@pytest.mark.parametrize(
    "sizes, m, weighted, gate_up",
    [
        _loop_case(i, case, w, weighted, g, gate_up)
        for i, case in enumerate(SIZES)
        for w, weighted in enumerate((True, False))
        for g, gate_up in enumerate(GATE_UP)
    ],
)
def test_routed_ffn_equals_a_loop_over_experts(sizes, m, weighted, gate_up):
    c = _config(gate_up)
    a = _inputs(sizes, m, jnp.float32)

    def fused(x, weight, wi_0, wi_1, wo):
        return routed.routed_ffn(
            x, a["idx"], weight, (wi_0, wi_1, wo), a["sizes"], c, jnp.float32, n=N
        )[0]

    def ref(x, weight, wi_0, wi_1, wo):
        return _reference(x, weight, wi_0, wi_1, wo, a["idx"], sizes, jnp.float32, jnp.float32)

    got = _value_and_grads(fused, a, weighted)
    want = _value_and_grads(ref, a, weighted)
    assert got[0].dtype == want[0].dtype
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol(jnp.float32))
    if sum(sizes) == 0:
        assert not np.any(np.asarray(got[0])) and not np.any(np.asarray(got[1]))


# the recomputed case by default, the kept ones on demand (-m full_grid): CI's budget; the combine
# does not depend on gate_up, and the kept variants run in float32 in the loop test by default
def _bf16_case(g):
    if g == "recomputed":
        return g
    cover = pytest.mark.covered_by(
        "tests/unit/nn/moe/test_routed.py::"
        "test_routed_ffn_bfloat16_accumulates_the_combine_in_float32[recomputed]",
        f"{_LOOP}[sizes1-24-True-kept]" if g == "kept" else f"{_LOOP}[sizes5-24-False-y-kept]",
    )
    return pytest.param(g, marks=[pytest.mark.full_grid, cover])


@pytest.mark.parametrize("gate_up", [_bf16_case(g) for g in GATE_UP])
def test_routed_ffn_bfloat16_accumulates_the_combine_in_float32(gate_up):
    """bfloat16 compute, float32 combine (`float32_weight_sum`) as in the separate path."""
    sizes, m = (6, 3, 9), 20
    a = _inputs(sizes, m, jnp.bfloat16, seed=3)
    for f32_sum, acc in ((True, jnp.float32), (False, jnp.bfloat16)):
        c = _config(gate_up, float32_weight_sum=f32_sum)

        def fused(x, weight, wi_0, wi_1, wo, c=c):
            return routed.routed_ffn(
                x, a["idx"], weight, (wi_0, wi_1, wo), a["sizes"], c, jnp.bfloat16, n=N
            )[0]

        def ref(x, weight, wi_0, wi_1, wo, acc=acc):
            return _reference(x, weight, wi_0, wi_1, wo, a["idx"], sizes, jnp.bfloat16, acc)

        got = _value_and_grads(fused, a, True)
        want = _value_and_grads(ref, a, True)
        assert got[0].dtype == acc
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), **tol(jnp.bfloat16)
            )


@pytest.mark.parametrize("gate_up", list(GATE_UP))
def test_negative_control_a_wrong_group_is_seen(gate_up):
    """The comparison catches rows sent to the wrong expert (group sizes off by one row)."""
    c = _config(gate_up)
    sizes, m = (5, 0, 13), 24
    a = _inputs(sizes, m, jnp.float32)
    shifted = jnp.asarray((6, 0, 12), jnp.int32)
    w = (a["wi_0"], a["wi_1"], a["wo"])
    got = routed.routed_ffn(a["x"], a["idx"], a["weight"], w, shifted, c, jnp.float32, n=N)[0]
    want = _reference(
        a["x"],
        a["weight"],
        a["wi_0"],
        a["wi_1"],
        a["wo"],
        a["idx"],
        sizes,
        jnp.float32,
        jnp.float32,
    )
    assert not np.allclose(np.asarray(got), np.asarray(want), **tol(jnp.float32))


def test_use_fused_needs_the_tiled_gmm():
    assert routed.use_fused(_config())
    assert routed.use_fused(_config("y-kept", moe_paged_stash=True))
    assert not routed.use_fused(_config(gmm_impl="ragged_dot"))
    assert not routed.use_fused(_config(moe_fused_routed_ffn=False))


def _out_shapes(jaxpr) -> set[tuple[int, ...]]:
    """Shapes of every array a jaxpr makes, its nested jaxprs (loop bodies, VJPs) included."""
    shapes = {tuple(v.aval.shape) for e in jaxpr.eqns for v in e.outvars if hasattr(v, "aval")}
    for sub in jax.extend.core.subjaxprs(jaxpr):
        shapes |= _out_shapes(sub)
    return shapes


@pytest.mark.parametrize("gate_up", list(GATE_UP))
def test_recomputed_gate_and_up_are_never_a_routed_rows_buffer(gate_up):
    """With gate and up recomputed, the value and gradients make no `[M, F]` array (only tiles);
    with them kept, the two residuals are `[M, F]` (the negative control). The `[M, D]` expert
    outputs are a buffer exactly when `moe_mlpwo` is kept."""
    c = _config(gate_up)
    sizes, m = (5, 0, 13), 24
    a = _inputs(sizes, m, jnp.float32)

    def loss(x, weight, wi_0, wi_1, wo):
        out = routed.routed_ffn(
            x, a["idx"], weight, (wi_0, wi_1, wo), a["sizes"], c, jnp.float32, n=N
        )[0]
        return jnp.sum(out * out)

    f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    jaxpr = jax.make_jaxpr(f)(a["x"], a["weight"], a["wi_0"], a["wi_1"], a["wo"]).jaxpr
    shapes = _out_shapes(jaxpr)
    assert (c.gmm_tile_rows, F) in shapes  # the tiles are there, and seen
    assert ((m, F) in shapes) == (gate_up == "kept"), sorted(shapes)
    assert ((m, D) in shapes) == (gate_up != "recomputed"), sorted(shapes)
