"""The grouped matmul's kernel backends (nn/moe/gmm_kernels.py): on CPU, and compiled for targets.

- megablox runs on CPU in Pallas's interpreter: its numerics (forward, input and weight
  gradients through expertax's custom VJP) against the loop-over-experts oracle;
- tokamax's kernels cannot run on CPU (no interpreter for Triton or Mosaic GPU kernels): the
  wrapper is tested with a stand-in that computes with `jax.lax.ragged_dot_general` and, like the
  kernels, leaves the rows outside the groups unwritten (NaN), so the masking, the row roll for
  `group_offset`, the dimension numbers, dtypes and gradients are checked; the kernels are covered
  by the compile-only tests for the targets below;
- platform and library refusals name the key, the value and what is valid.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from expertax import platform, targets
from expertax.config import ConfigError
from expertax.nn.activation import swiglu as glu
from expertax.nn.moe import gmm_kernels, tiles
from expertax.nn.moe.gmm import gmm, gmm_glu
from tests.tolerances import tol
from tests.unit.nn.moe.test_gmm import CASES, _glu_inputs, _inputs, _value_and_grads, oracle

TOKAMAX = ("tokamax_triton", "tokamax_mosaic_gpu")
# The megablox interpreter costs seconds per case: two in the default run (the second in
# bfloat16), every case in the extended one.
MEGABLOX_CASES = ("rows_beyond_sum", "offset_middle")
# The stand-in is plain XLA: the cases with an offset, empty groups and rows past the groups.
STAND_IN_CASES = ("empty_groups", "rows_beyond_sum", "offset_middle", "offset_last_empty")


def _check_against_oracle(backend, case, dtype=jnp.float32):
    sizes_list, e_local, offset = CASES[case]
    lhs, rhs, cot = (a.astype(dtype) for a in _inputs(e_local))
    sizes = jnp.asarray(sizes_list, jnp.int32)
    off = None if offset is None else jnp.int32(offset)
    fn = lambda x, w, s, o: gmm(x, w, s, group_offset=o, backend=backend)
    got = jax.jit(lambda *a: _value_and_grads(fn, *a))(lhs, rhs, sizes, off, cot)
    up = lambda a: a.astype(jnp.float32)
    want = _value_and_grads(oracle, up(lhs), up(rhs), sizes, offset, up(cot))
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        assert g.dtype == dtype, (name, g.dtype)
        np.testing.assert_allclose(up(g), w, **tol(dtype), err_msg=f"{backend} {case} {name}")
    # Negative control: a perturbed weight of a group with rows fails the comparison.
    local = np.asarray(sizes_list)[(offset or 0) : (offset or 0) + e_local]
    bad = oracle(up(lhs), up(rhs).at[int(np.argmax(local > 0))].add(0.1), sizes, offset)
    assert np.abs(np.asarray(bad) - np.asarray(up(got[0]))).max() > 1e-3


@pytest.mark.parametrize("case", MEGABLOX_CASES)
def test_megablox_matches_the_oracle(case):
    dtype = jnp.bfloat16 if case == "offset_middle" else jnp.float32
    with gmm_kernels.interpret():
        _check_against_oracle("megablox", case, dtype)


@pytest.mark.extended
@pytest.mark.parametrize("case", list(CASES))
def test_megablox_matches_the_oracle_every_case(case):
    with gmm_kernels.interpret():
        _check_against_oracle("megablox", case)


def test_megablox_glu():
    """gmm_glu through megablox: the SwiGLU on all rows, then the kernel; the value and the
    gate's, up's and weights' gradients equal the oracle's on `silu(gate) * up`."""
    sizes_list, e_local, offset = CASES["tile_edges_offset"]
    gate, up, rhs, cot = _glu_inputs(e_local)
    sizes, off = jnp.asarray(sizes_list, jnp.int32), jnp.int32(offset)
    fn = lambda g, u, w: gmm_glu(g, u, w, sizes, group_offset=off, backend="megablox")
    with gmm_kernels.interpret():
        out, vjp = jax.vjp(jax.jit(fn), gate, up, rhs)
        got = (out, *vjp(cot))
    ref = lambda g, u, w: oracle(glu(g, u), w, sizes, offset)
    want_out, want_vjp = jax.vjp(ref, gate, up, rhs)
    for name, g, w in zip(("out", "d_gate", "d_up", "d_rhs"), got, (want_out, *want_vjp(cot))):
        np.testing.assert_allclose(g, w, **tol(), err_msg=name)


# ---------------------------------------------------------------------------------------------
# tokamax: the wrapper with a stand-in kernel


def _stand_in(calls):
    """A tokamax implementation (a callable, as tokamax accepts) computing with XLA's ragged dot
    and leaving rows outside the groups NaN, as the kernels leave them unwritten."""

    def impl(lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers, preferred_element_type, **_):
        dims = ragged_dot_dimension_numbers
        calls.append((dims.dot_dimension_numbers, jnp.dtype(preferred_element_type)))
        out = jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32
        )
        if dims.rhs_group_dimensions:  # rows out: rows past the groups are never written
            rows = jnp.arange(out.shape[0])[:, None]
            out = jnp.where(rows < jnp.sum(group_sizes), out, jnp.nan)
        return out.astype(preferred_element_type)

    return impl


@pytest.fixture
def tokamax_on_cpu(monkeypatch):
    """The tokamax backends allowed on CPU, their kernels replaced by the stand-in."""
    if importlib.util.find_spec("tokamax") is None:
        pytest.skip("tokamax (expertax[gpu]) is not installed")
    calls: list = []
    for name in TOKAMAX:
        monkeypatch.setitem(
            gmm_kernels.KERNELS, name, (("gpu", "cpu"), *gmm_kernels.KERNELS[name][1:])
        )
        monkeypatch.setitem(gmm_kernels.TOKAMAX_IMPLEMENTATION, name, _stand_in(calls))
    return calls


@pytest.mark.parametrize("case", STAND_IN_CASES)
def test_tokamax_wrapper_matches_the_oracle(tokamax_on_cpu, case):
    _check_against_oracle("tokamax_triton", case)
    # forward, input gradient (weights contracted on their last dim), weight gradient
    dims = [jax.tree.leaves(d) for d, _ in tokamax_on_cpu]  # contracted (lhs, rhs) dims
    assert dims == [[1, 1], [1, 2], [0, 0]]


def test_tokamax_wrapper_bfloat16(tokamax_on_cpu):
    _check_against_oracle("tokamax_mosaic_gpu", "offset_middle", jnp.bfloat16)
    assert [t for _, t in tokamax_on_cpu] == [jnp.dtype(jnp.bfloat16)] * 3


def test_tokamax_wrapper_with_a_given_output(tokamax_on_cpu):
    """The paged stash's read mode: the output is the given one (a perturbed copy here, to tell
    it apart), the gradients are the kernels' own, as without it."""
    sizes_list, e_local, _ = CASES["rows_beyond_sum"]
    lhs, rhs, cot = _inputs(e_local)
    sizes = jnp.asarray(sizes_list, jnp.int32)
    given = oracle(lhs, rhs, sizes, None) + 1.0
    fn = lambda x, w, s, o: gmm(x, w, s, backend="tokamax_triton", given=given)
    out, d_lhs, d_rhs = jax.jit(lambda *a: _value_and_grads(fn, *a))(lhs, rhs, sizes, None, cot)
    _, *want = _value_and_grads(oracle, lhs, rhs, sizes, None, cot)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(given))
    np.testing.assert_allclose(d_lhs, want[0], **tol())
    np.testing.assert_allclose(d_rhs, want[1], **tol())


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ("megablox", "tokamax_triton"))
def test_kernels_in_shard_map_with_group_offset_from_axis_index(backend, request):
    """Ring-of-experts use inside a vma-checked shard_map: E/4 experts per device, offset =
    axis_index * E/4; the kernels run in a nested unchecked shard_map (gmm_kernels._unchecked)
    and their gradients, the replicated rows' included, equal the oracle's."""
    if backend.startswith("tokamax"):
        request.getfixturevalue("tokamax_on_cpu")
    devices, e = 4, 8
    sizes = jnp.asarray([9, 3, 17, 0, 22, 11, 5, 3], jnp.int32)
    lhs, rhs, cot = _inputs(e, seed=3)
    mesh = jax.make_mesh(
        (devices,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
    )

    def local(x, w_local, s):
        off = jax.lax.axis_index("expert") * w_local.shape[0]
        return jax.lax.psum(gmm(x, w_local, s, group_offset=off, backend=backend), "expert")

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P())
    )
    with gmm_kernels.interpret():
        got = _value_and_grads(lambda x, w, s, _o: sharded(x, w, s), lhs, rhs, sizes, None, cot)
    want = _value_and_grads(oracle, lhs, rhs, sizes, None, cot)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **tol())


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    "backend, on", [("megablox", "cpu"), ("megablox", "gpu"), ("tokamax_triton", "tpu")]
)
def test_kernel_backend_refused_off_its_platform(backend, on):
    with pytest.raises(ConfigError) as e:
        gmm_kernels.check(backend, on)
    msg = str(e.value)
    assert f"gmm_impl={backend}" in msg and f"not on the {on} devices" in msg
    assert "valid here: auto, tiled, ragged_dot" in msg
    if on == "gpu":
        assert "tokamax_triton" in msg and "megablox" not in msg.split("valid here")[1]


def test_missing_library_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tokamax" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"tokamax_triton needs the tokamax package: .*expertax\[gpu\]"
    ):
        gmm_kernels.check("tokamax_triton", "gpu")


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None, reason="needs expertax[gpu]")
def test_the_private_tokamax_name_is_where_expertax_reads_it():
    """gmm_kernels.tokamax_op reads tokamax's private table of op objects (its docstring says
    why): when tokamax moves it, this fails, not a user's compile."""
    import tokamax

    for name in gmm_kernels.TOKAMAX_IMPLEMENTATION.values():
        op = gmm_kernels.tokamax_op(name)
        assert isinstance(op, tokamax.Op) and callable(op.bind)
        assert hasattr(op, "config") and callable(op.replace)


def test_train_config_refused_before_compiling():
    """A mesh of CPU devices cannot run megablox: build_trainer refuses it (no compile)."""
    from expertax.preflight import load_config
    from expertax.train.trainer import build_trainer

    c = load_config(overrides={"model_name": "mixtral-tiny", "gmm_impl": "megablox"})
    with pytest.raises(ConfigError, match="gmm_impl=megablox: its kernels run on tpu"):
        build_trainer(c, jax.devices()[:1])


def test_gmm_impl_values_are_the_backends():
    import typing

    from expertax.config.schema import Config
    from expertax.nn.moe.gmm import CONFIG_VALUES

    assert typing.get_args(Config.model_fields["gmm_impl"].annotation) == CONFIG_VALUES


# ---------------------------------------------------------------------------------------------
# compiled for the targets (nothing runs)

needs_tpu = pytest.mark.skipif(
    not targets.compiler_available("tpu"), reason="the TPU compiler (expertax[tpu]) is missing"
)
needs_gpu = pytest.mark.skipif(
    not targets.compiler_available("gpu") or importlib.util.find_spec("tokamax") is None,
    reason="the GPU compiler or tokamax (expertax[gpu]) is missing",
)


def _compile_for(spec: str, backend: str, m=512, d=256, f=512, e=8, per_expert=64, ep=1):
    """fwd + bwd of one grouped matmul compiled for `spec` (bf16): (FlopCount, routed, memory).
    With `ep` > 1 inside a vma-checked shard_map over `ep` devices (E/ep experts each)."""
    from jax.sharding import Mesh, NamedSharding

    from expertax.planner import flops

    devices = targets.parse_target(spec).devices()[:ep]
    mesh = Mesh(np.array(devices), ("expert",))
    row_spec = P("expert") if ep > 1 else P()
    sh = lambda s: NamedSharding(mesh, s)

    def one(x, w, sizes, dy):
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, sizes, backend=backend), x, w)
        return out, *vjp(dy)

    fn = one
    if ep > 1:
        specs = (row_spec, P("expert"), P(), row_spec)
        fn = jax.shard_map(
            one, mesh=mesh, in_specs=specs, out_specs=(row_spec,) * 2 + (P("expert"),)
        )
    args = (
        jax.ShapeDtypeStruct((m * ep, d), jnp.bfloat16, sharding=sh(row_spec)),
        jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16, sharding=sh(P("expert"))),
        jax.ShapeDtypeStruct((e // ep,), jnp.int32, sharding=sh(P())),
        jax.ShapeDtypeStruct((m * ep, f), jnp.bfloat16, sharding=sh(row_spec)),
    )
    with platform.use(spec.split(":")[0], devices[0]), tiles.expected_group_rows(per_expert):
        compiled = jax.jit(fn).lower(*args).compile()
    return flops.count_flops(compiled.as_text()), 3 * 2 * m * d * f, compiled.memory_analysis()


# Mosaic GPU (not `auto`) compiles slowest (3-15 s on 2 cores): in the extended run.
KERNEL_TARGETS = [
    pytest.param("gpu:h100x8", "tokamax_triton", "triton", marks=needs_gpu),
    pytest.param(
        "gpu:h100x8", "tokamax_mosaic_gpu", "mosaic_gpu", marks=[needs_gpu, pytest.mark.extended]
    ),
    pytest.param("tpu:v5p-16", "megablox", "megablox", marks=needs_tpu),
]
# Inside the shard_map: the real Pallas calls in the nested unchecked shard_map.
EP_TARGETS = KERNEL_TARGETS


@pytest.mark.parametrize("spec, backend, impl", KERNEL_TARGETS)
def test_kernels_compile_for_the_target(spec, backend, impl):
    """Forward and backward are three kernels of the library (two gmm, one tgmm), nothing
    multiplies all experts' weights by all rows, the work at balanced routing is within one
    row block per group of the routed rows', and the temporaries are small beside the
    outputs (metadata and the transposed operands some kernels need)."""
    count, routed, mem = _compile_for(spec, backend)
    kinds = sorted((k.impl, k.op) for k in count.kernels)
    assert kinds == [(impl, "gmm"), (impl, "gmm"), (impl, "tgmm")], kinds
    assert not count.opaque
    assert routed <= count.flops <= count.worst_flops
    # each kernel's work at most one block per group beyond the routed rows' (8 groups of 64)
    for k in count.kernels:
        assert k.expected_flops <= 2 * k.contracted * k.columns * (512 + 8 * k.block), k
    assert count.worst_flops < 8 * routed / 2  # far from E x the routed FLOPs of an expansion
    assert mem.temp_size_in_bytes <= 1.25 * mem.output_size_in_bytes  # the target


@pytest.mark.parametrize("per_expert", (16, 64))
@pytest.mark.parametrize(
    "spec, backend",
    [
        pytest.param("gpu:h100x8", "tokamax_triton", marks=needs_gpu),
        pytest.param("tpu:v5p-16", "megablox", marks=needs_tpu),
    ],
)
def test_auto_kernels_cost_the_routed_rows_at_few_rows_per_expert(spec, backend, per_expert):
    """`auto`'s kernels at 16 and 64 rows per expert: their row block follows the rows (not
    tokamax's default 128 rows, 8x the work at 16), compiled FLOPs within the issue's 1.1."""
    count, routed, _ = _compile_for(spec, backend, m=8 * per_expert, per_expert=per_expert)
    assert {k.block for k in count.kernels if k.op == "gmm"} == {per_expert}
    assert all(k.block <= max(per_expert, 16) for k in count.kernels)
    assert routed <= count.flops <= 1.1 * routed


@pytest.mark.distributed
@pytest.mark.parametrize("spec, backend, impl", EP_TARGETS)
def test_kernels_compile_inside_expert_parallel_shard_map(spec, backend, impl):
    """In a vma-checked shard_map over 4 devices (2 of 8 experts each): the same kernels."""
    count, _, _ = _compile_for(spec, backend, ep=4)
    assert sorted(k.op for k in count.kernels) == ["gmm", "gmm", "tgmm"]
    assert {k.groups for k in count.kernels} == {2}
