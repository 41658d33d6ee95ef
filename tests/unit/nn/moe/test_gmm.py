"""gmm backends against a dense oracle: forward, input and weight gradients, HLO shapes, memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from expertax.nn.activation import swiglu as glu
from expertax.nn.moe import gmm as gmm_lib
from expertax.nn.moe import tiles as tile_lib
from expertax.nn.moe.gmm import gmm, gmm_glu

TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
N, D, F = 70, 16, 24
TILES = dict(tile_rows=16, tile_rows_min=4)  # full chunks and remainder tiles 4, 8, 16
BACKENDS = ("ragged_dot", "tiled")

# name: (group_sizes over all experts, E_local, group_offset)
CASES = {
    "random": ([9, 3, 17, 0, 22, 11, 5, 3], 8, None),
    "empty_groups": ([0, 30, 0, 0, 33, 0, 7, 0], 8, None),
    "one_group_all_rows": ([0, 0, N, 0], 4, None),
    "not_tile_multiple": ([17, 1, 33, 19], 4, None),
    # sizes 0, 1, tile - 1, tile, tile + 1 (sum <= N = 70): a group's weight gradient summed over
    # items of several tile lists (full chunks + remainder) into the same [D, F] slice
    "tile_edges": ([0, 1, 15, 16, 17, 3, 0, 17], 8, None),
    "tile_edges_offset": ([2, 0, 1, 15, 16, 17, 17, 2], 5, 2),
    "rows_beyond_sum": ([5, 0, 12, 9], 4, None),
    "offset_middle": ([9, 3, 17, 0, 22, 11, 5, 3], 3, 2),
    "offset_first": ([20, 15, 0, 35], 2, 0),
    "offset_last_empty": ([20, 15, 35, 0], 2, 2),
}


def oracle(lhs_MD, rhs_EDF, group_sizes_E, group_offset):
    """Every row times every local expert's weights, masked to its own group (test-size only)."""
    n, e_local = lhs_MD.shape[0], rhs_EDF.shape[0]
    ends_E = jnp.minimum(jnp.cumsum(group_sizes_E), n)
    starts_E = ends_E - jnp.minimum(group_sizes_E, ends_E)
    off = 0 if group_offset is None else group_offset
    rows_M = jnp.arange(n)
    out_MF = jnp.zeros((n, rhs_EDF.shape[2]), jnp.float32)
    for e in range(e_local):
        in_group_M = (rows_M >= starts_E[off + e]) & (rows_M < ends_E[off + e])
        out_MF = out_MF + jnp.where(in_group_M[:, None], lhs_MD @ rhs_EDF[e], 0.0)
    return out_MF


def _inputs(e_local, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (N, D), jnp.float32)
    rhs = jax.random.normal(k2, (e_local, D, F), jnp.float32)
    cot = jax.random.normal(k3, (N, F), jnp.float32)
    return lhs, rhs, cot


def _value_and_grads(fn, lhs, rhs, sizes, offset, cot):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes, offset), lhs, rhs)
    return (out, *vjp(cot))


# `auto` is one of the concrete backends; three cases check the dispatch end to end.
AUTO_CASES = ("random", "rows_beyond_sum", "offset_middle")


@pytest.mark.parametrize(
    "backend,case", [(b, c) for b in BACKENDS for c in CASES] + [("auto", c) for c in AUTO_CASES]
)
def test_matches_dense_oracle(backend, case):
    sizes_list, e_local, offset = CASES[case]
    lhs, rhs, cot = _inputs(e_local)
    sizes = jnp.asarray(sizes_list, jnp.int32)
    off = None if offset is None else jnp.int32(offset)

    # group_sizes and group_offset are traced, as inside a jitted shard_map body.
    @jax.jit
    def run(x, w, s, o):
        return gmm(x, w, s, group_offset=o, backend=backend, **TILES)

    got = _value_and_grads(run, lhs, rhs, sizes, off, cot)
    want = _value_and_grads(oracle, lhs, rhs, sizes, offset, cot)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
        np.testing.assert_allclose(g, w, **TOL[jnp.float32], err_msg=f"{backend} {case} {name}")
    # Negative control: a perturbed weight must fail the comparison when its group has rows.
    local = np.asarray(sizes_list)[(offset or 0) : (offset or 0) + e_local]
    e_hit = int(np.argmax(local > 0))
    bad = oracle(lhs, rhs.at[e_hit].add(0.1), sizes, offset)
    assert np.abs(np.asarray(bad) - np.asarray(got[0])).max() > 1e-3


@pytest.mark.parametrize("backend", ("tiled", "ragged_dot"))
def test_unrouted_rows_and_empty_experts_get_exact_zeros(backend):
    sizes = jnp.asarray([6, 0, 11, 0, 9, 0], jnp.int32)  # 26 of 70 rows routed
    lhs, rhs, cot = _inputs(4)
    fn = jax.jit(lambda x, w, s, o: gmm(x, w, s, group_offset=o, backend=backend, **TILES))
    out, d_lhs, d_rhs = _value_and_grads(fn, lhs, rhs, sizes, jnp.int32(1), cot)
    # local groups 1..4 = sizes [0, 11, 0, 9] covering rows [6, 26); group 0's rows are remote.
    assert np.all(np.asarray(d_rhs[0]) == 0) and np.all(np.asarray(d_rhs[2]) == 0)
    assert np.all(np.asarray(out[:6]) == 0) and np.all(np.asarray(out[26:]) == 0)
    assert np.all(np.asarray(d_lhs[:6]) == 0) and np.all(np.asarray(d_lhs[26:]) == 0)
    # The routed rows: group 1 (11 rows from 6) and group 3 (9 rows from 17), by hand in numpy.
    x, w, g = (np.asarray(a, np.float64) for a in (lhs, rhs, cot))
    for e, rows in ((1, slice(6, 17)), (3, slice(17, 26))):
        np.testing.assert_allclose(out[rows], x[rows] @ w[e], **TOL[jnp.float32])
        np.testing.assert_allclose(d_rhs[e], x[rows].T @ g[rows], **TOL[jnp.float32])
        np.testing.assert_allclose(d_lhs[rows], g[rows] @ w[e].T, **TOL[jnp.float32])
    # Negative control: the weight gradient over rows shifted by one is not the same.
    assert np.abs(np.asarray(d_rhs[1]) - x[5:16].T @ g[5:16]).max() > 1e-2


GLU_CASES = ("random", "empty_groups", "tile_edges_offset", "rows_beyond_sum", "offset_middle")


def _glu_inputs(e_local, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    gate, up = (jax.random.normal(a, (N, D), jnp.float32) for a in k[:2])
    return gate, up, jax.random.normal(k[2], (e_local, D, F)), jax.random.normal(k[3], (N, F))


def _glu_value_and_grads(fn, gate, up, rhs, cot):
    out, vjp = jax.vjp(fn, gate, up, rhs)
    return (out, *vjp(cot))


@pytest.mark.parametrize("backend,case", [(b, c) for b in BACKENDS for c in GLU_CASES])
def test_glu_matches_dense_oracle(backend, case):
    """gmm_glu = the oracle on `silu(gate) * up`: value and the gate's, up's and weights'
    gradients (the SwiGLU's VJP applied per tile, for `tiled`)."""
    sizes_list, e_local, offset = CASES[case]
    gate, up, rhs, cot = _glu_inputs(e_local)
    sizes = jnp.asarray(sizes_list, jnp.int32)
    off = None if offset is None else jnp.int32(offset)
    run = jax.jit(
        lambda g, u, w: gmm_glu(g, u, w, sizes, group_offset=off, backend=backend, **TILES)
    )
    got = _glu_value_and_grads(run, gate, up, rhs, cot)
    want = _glu_value_and_grads(
        lambda g, u, w: oracle(glu(g, u), w, sizes, offset), gate, up, rhs, cot
    )
    for name, g, w in zip(("out", "d_gate", "d_up", "d_rhs"), got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL[jnp.float32], err_msg=f"{backend} {case} {name}")
    # Negative control: the SwiGLU's gate and up are not interchangeable.
    swapped = oracle(glu(up, gate), rhs, sizes, offset)
    assert np.abs(np.asarray(swapped) - np.asarray(got[0])).max() > 1e-3


@pytest.mark.parametrize("given", (False, True))
@pytest.mark.default_codegen
def test_tiled_glu_equals_the_unfused_tiled_path_bitwise(given):
    """The fused SwiGLU is the unfused `gmm(glu(gate, up))` of the tiled backend bit for bit,
    forward and backward, and with a given output (the paged stash's read mode) its gradients
    are the same too; rows outside the local groups get exact zero gradients."""
    sizes = jnp.asarray([9, 3, 17, 0, 22, 11, 5, 3], jnp.int32)
    gate, up, rhs, cot = _glu_inputs(3, seed=4)
    kw = dict(group_offset=jnp.int32(2), backend="tiled", **TILES)
    ref = gmm(glu(gate, up), rhs, sizes, **kw)
    out = ref if given else None
    fused = jax.jit(lambda g, u, w: gmm_glu(g, u, w, sizes, given=out, **kw))
    unfused = jax.jit(lambda g, u, w: gmm(glu(g, u), w, sizes, **kw))
    got = _glu_value_and_grads(fused, gate, up, rhs, cot)
    want = _glu_value_and_grads(unfused, gate, up, rhs, cot)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    local = slice(12, 12 + 17 + 0 + 22)  # groups 2, 3, 4
    for d in got[1:3]:
        assert np.all(np.asarray(d[: local.start]) == 0) and np.all(
            np.asarray(d[local.stop :]) == 0
        )


def test_tiled_glu_computes_the_swiglu_on_tiles_only():
    """In the tiled fused program, forward and backward, every sigmoid of the SwiGLU is on one
    work item's tile (<= tile_rows rows), never on the `[M, F]` buffer; the unfused one has it."""
    n, f_in, d, e = 96, 56, 40, 4
    sizes = jnp.asarray([30, 0, 41, 25], jnp.int32)
    args = (jnp.zeros((n, f_in)), jnp.zeros((n, f_in)), jnp.zeros((e, f_in, d)))

    def sigmoid_rows(fn):
        loss = lambda g, u, w: jnp.sum(fn(g, u, w) ** 2)
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
        # XLA writes the sigmoid as an exponential (in fusions, loop bodies included)
        found = re.findall(rf"f32\[(\d+),{f_in}\]{{[\d,]*}} exponential\(", hlo)
        return [int(r) for r in found]

    kw = dict(backend="tiled", **TILES)
    fused = sigmoid_rows(lambda g, u, w: gmm_glu(g, u, w, sizes, **kw))
    assert fused and max(fused) <= TILES["tile_rows"], fused
    unfused = sigmoid_rows(lambda g, u, w: gmm(glu(g, u), w, sizes, **kw))
    assert n in unfused, unfused


@pytest.mark.distributed
def test_tiled_group_offset_from_axis_index_in_shard_map():
    """Ring-of-experts use: each device holds E/4 experts, offset = axis_index * E/4."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    devices, e = 4, 8
    sizes = jnp.asarray([9, 3, 17, 0, 22, 11, 5, 3], jnp.int32)
    lhs, rhs, cot = _inputs(e, seed=3)
    mesh = jax.make_mesh(
        (devices,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
    )

    def local(x, w_local, s):
        off = jax.lax.axis_index("expert") * w_local.shape[0]
        out = gmm(x, w_local, s, group_offset=off, backend="tiled", **TILES)
        return jax.lax.psum(out, "expert")

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P())
    )
    got = _value_and_grads(lambda x, w, s, _o: sharded(x, w, s), lhs, rhs, sizes, None, cot)
    want = _value_and_grads(oracle, lhs, rhs, sizes, None, cot)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL[jnp.float32])


def test_tiled_check_grads():
    lhs, rhs, _ = _inputs(4, seed=1)
    sizes = jnp.asarray([13, 0, 21, 9], jnp.int32)
    fn = lambda x, w: gmm(x, w, sizes, backend="tiled", **TILES)
    check_grads(fn, (lhs, rhs), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_tiled_bfloat16_accumulates_in_float32():
    sizes = jnp.asarray([13, 0, 21, 9], jnp.int32)
    lhs, rhs, _ = _inputs(4, seed=2)
    lhs16, rhs16 = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    out = gmm(lhs16, rhs16, sizes, backend="tiled", preferred_element_type=jnp.float32, **TILES)
    want = oracle(lhs16.astype(jnp.float32), rhs16.astype(jnp.float32), sizes, None)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, **TOL[jnp.float32])  # exact products, f32 sums
    out16 = gmm(lhs16, rhs16, sizes, backend="tiled", **TILES)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(jnp.float32), want, **TOL[jnp.bfloat16])


def _shapes(hlo_text):
    return [tuple(int(d) for d in m.split(",")) for m in re.findall(r"f32\[([\d,]+)\]", hlo_text)]


def _has_expert_by_rows(shapes, e, n):
    return any(len(s) >= 3 and e in s and n in s for s in shapes)


@pytest.mark.parametrize("backend", ("tiled", "auto"))
def test_no_experts_by_rows_intermediate(backend):
    e, n, d, f = 24, 320, 40, 56
    args = (jnp.zeros((n, d)), jnp.zeros((e, d, f)), jnp.zeros((e,), jnp.int32))
    loss = lambda x, w, s, b: jnp.sum(gmm(x, w, s, backend=b, tile_rows=64) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
    shapes = _shapes(grad.lower(*args, backend).compile().as_text())
    assert shapes and not _has_expert_by_rows(shapes, e, n)
    # Negative control: XLA:CPU's ragged_dot expansion does hold [E, N, ...] (issue #5).
    if jax.default_backend() == "cpu":
        ragged = _shapes(grad.lower(*args, "ragged_dot").compile().as_text())
        assert _has_expert_by_rows(ragged, e, n)


def test_tiled_temp_memory_independent_of_experts():
    n, d, f = 512, 64, 128

    def temp_bytes(e, backend):
        args = (jnp.zeros((n, d)), jnp.zeros((e, d, f)), jnp.zeros((e,), jnp.int32))
        loss = lambda x, w, s: jnp.sum(gmm(x, w, s, backend=backend, **TILES) ** 2)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(4, "tiled"), temp_bytes(64, "tiled")
    # Work-item tables hold O(N / tile + E) int32s; one expert's weights alone are 32 KiB.
    assert abs(large - small) <= 16 * 1024, (small, large)
    # Negative control: ragged_dot's expansion on CPU grows with E (by > 60 x N x F floats).
    if jax.default_backend() == "cpu":
        assert temp_bytes(64, "ragged_dot") - temp_bytes(4, "ragged_dot") > 60 * n * f * 4


@pytest.mark.default_codegen
def test_tiled_weight_grad_updates_one_buffer_in_place():
    """The weight gradient is one `[E, D, F]` loop carry: zero-filled once, updated in place.

    Guards against a second `[E, D, F]` buffer (as the former `scan` over groups stacked its
    per-group accumulators into) and against a copy of the carry, which XLA:CPU inserts when
    it cannot update a while-loop carry in place.
    """
    e, n, d, f = 6, 96, 40, 56
    args = (jnp.zeros((n, d)), jnp.zeros((e, d, f)), jnp.zeros((e,), jnp.int32))
    loss = lambda x, w, s: jnp.sum(gmm(x, w, s, backend="tiled", **TILES) ** 2)
    hlo = jax.jit(jax.grad(loss, argnums=1)).lower(*args).compile().as_text()
    edf = rf"%[\w.-]+ = f32\[{e},{d},{f}\]{{[\d,]*}}"
    assert not re.search(rf"{edf} copy\(", hlo), "copy of the [E, D, F] gradient"
    fills = re.findall(rf"{edf} fusion\(%constant[.\d]*\), kind=kLoop", hlo)
    assert len(fills) == 1, fills
    updates = re.findall(rf"%[\w.-]*dynamic-update-slice_fusion[.\d]* = f32\[{e},{d},{f}\]", hlo)
    assert updates, "no in-place update of the gradient carry"


def _library_dots(hlo_text):
    """(dots XLA:CPU hands to its dot library, all dots) in a compiled module's text."""
    return hlo_text.count('"__ynn_fusion"'), len(re.findall(r" dot\(", hlo_text))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot library (issue #5)")
def test_tiled_weight_grad_dots_run_in_the_dot_library():
    """Every per-item dot of the weight gradient is a library fusion, not XLA's generic dot.

    `x_tile^T @ dy_tile` written as a dot contracting dim 0 of both compiles to the generic
    (several times slower) dot; gmm transposes the small x tile first (docs/design/gmm.md).
    """
    e, n, d, f = 6, 96, 40, 56
    args = (jnp.zeros((n, d)), jnp.zeros((e, d, f)), jnp.zeros((e,), jnp.int32))
    loss = lambda x, w, s: jnp.sum(gmm(x, w, s, backend="tiled", **TILES) ** 2)
    library, dots = _library_dots(
        jax.jit(jax.grad(loss, argnums=1)).lower(*args).compile().as_text()
    )
    assert dots > 0 and library == dots, (library, dots)
    # Negative control: the direct formulation is a generic dot.
    direct = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ()))))
    hlo = direct.lower(jnp.zeros((16, d)), jnp.zeros((16, f))).compile().as_text()
    assert _library_dots(hlo) == (0, 1)


def test_invalid_arguments():
    lhs, rhs, _ = _inputs(2)
    sizes = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="backend"):
        gmm(lhs, rhs, sizes, backend="nope")
    with pytest.raises(ValueError, match="tile_rows"):
        gmm(lhs, rhs, sizes, backend="tiled", tile_rows=0)
    assert gmm_lib.resolve_backend("auto") in gmm_lib.BACKENDS[1:]


def _computed_rows(sizes, tiles, n):
    """Rows computed per group (sum of its items' tiles) and rows covered, from the work lists."""
    items = tile_lib.work_items(jnp.asarray(sizes, jnp.int32), jnp.int32(0), len(sizes), n, tiles)
    computed, covered = np.zeros(len(sizes), int), np.zeros(len(sizes), int)
    for item in items:
        for i in range(int(item["count"])):
            g = int(item["g"][i])
            computed[g] += item["tile"]
            covered[g] += int(item["row1"][i]) - int(item["row0"][i])
    return computed.tolist(), covered.tolist()


def test_tiled_splits_large_remainders():
    """A remainder far from a ladder tile runs as two items (300 rows: 256 + 64, not 512)."""
    sizes, n, d, f = [300, 130, 200, 17, 384, 0], 1100, 8, 12
    tiles = tile_lib.ladder(n, 512, 8)  # 512; remainders 8, 16, ..., 256, 512
    computed, covered = _computed_rows(sizes, tiles, n)
    assert covered == sizes
    # 130 -> 128 + 8; 200 stays one 256 tile (128 + 128 saves nothing); 17 -> 32 (split saves
    # 8 rows, less than SPLIT_MIN_SAVED_ROWS); 384 -> 256 + 128.
    assert computed == [320, 136, 256, 32, 384, 0]
    # Negative control: without the split the same remainders take one tile each.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tile_lib, "SPLIT_MIN_SAVED_ROWS", 10**6)
        assert _computed_rows(sizes, tiles, n)[0] == [512, 256, 256, 32, 512, 0]
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    lhs = jax.random.normal(k1, (n, d), jnp.float32)
    rhs = jax.random.normal(k2, (len(sizes), d, f), jnp.float32)
    cot = jax.random.normal(k3, (n, f), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)
    fn = jax.jit(lambda x, w, s_, o: gmm(x, w, s_, backend="tiled", tile_rows=512))
    got = _value_and_grads(fn, lhs, rhs, s, None, cot)
    want = _value_and_grads(oracle, lhs, rhs, s, None, cot)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
        np.testing.assert_allclose(g, w, **TOL[jnp.float32], err_msg=name)


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 100, 300, 512, 700, 1500])
@pytest.mark.parametrize("e_local, n", [(1, 4096), (4, 4096), (8, 2048), (3, 500)])
def test_expected_item_counts_are_what_the_work_items_count(rows, e_local, n):
    """The static count per tile list at balanced routing (the trips~N scope of the tile loops)
    is what `tiles.work_items` counts at run time for equal group sizes."""
    tiles = tile_lib.Tiles(tile_lib.ladder(n, 512, 8), rows)
    static = tile_lib._expected_counts(e_local, n, tiles)
    sizes = jnp.full((e_local,), rows, jnp.int32)
    lists = tile_lib.work_items(sizes, jnp.int32(0), e_local, n, tuple(tiles))
    assert static == [int(x["count"]) for x in lists]
