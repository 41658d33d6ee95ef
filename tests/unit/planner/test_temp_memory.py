"""Seed 3922's temp-memory reductions, each pinned by what it leaves in the jaxpr or the HLO.

(a) no sharding constraint for an all-None spec; (b) mesh axes of size one dropped from specs;
(c) RMSNorm as a broadcast multiply, offset added only when non-zero; (d) embedding by gather,
one-hot only below 2 GiB; (e) causal and document masks never materialized as [B, (1,) T, T];
(f) no casts of the expert outputs when the combine runs in `dtype`; (g) gradients cast only
when grad_dtype differs from weight_dtype; (h) float32_weight_sum's cost in the memory report.
Every check has a negative control showing the detector sees the thing it looks for.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec

from expertax.config.schema import MESH_AXES
from expertax.nn import embed, norm, param
from expertax.nn.attention.kernel import attend
from expertax.nn.moe import dispatch, router
from expertax.nn.moe.layer import spec as moe_spec
from expertax.planner.format import format_report
from expertax.planner.plan import _weight_sum_cost
from expertax.preflight import load_config
from expertax.sharding import constrain, logical_to_spec, use_rules


def _eqns(jaxpr):
    """All equations of a jaxpr, nested ones included."""
    out = list(jaxpr.eqns)
    for sub in jax.extend.core.subjaxprs(jaxpr):
        out += _eqns(sub)
    return out


def _prims(fn, *args) -> list:
    return _eqns(jax.make_jaxpr(fn)(*args).jaxpr)


def _mesh(sizes: dict[str, int]) -> Mesh:
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


RULES = {"batch": ("data", "fsdp", "expert"), "length": (), "act_embed": (), "embed": ("fsdp",)}


def _constraints(fn, x, mesh):
    with jax.set_mesh(mesh), use_rules(RULES):
        return [e for e in _prims(fn, x) if e.primitive.name == "sharding_constraint"]


# (a) ---------------------------------------------------------------------------------------
def test_a_all_none_spec_emits_no_constraint():
    x = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)
    mesh = _mesh({"fsdp": 8})
    assert _constraints(lambda x: constrain(x, (None, "length", "act_embed")), x, mesh) == []
    # Negative control: a sharded spec does emit one.
    assert len(_constraints(lambda x: constrain(x, ("batch", None, None)), x, mesh)) == 1
    with jax.set_mesh(mesh), use_rules(RULES):
        hlo = jax.jit(lambda x: constrain(x, (None, None, "act_embed")) * 2).lower(x).as_text()
    assert "sharding_constraint" not in hlo and "Sharding" not in hlo


# (b) ---------------------------------------------------------------------------------------
def test_b_size_one_mesh_axes_are_dropped():
    mesh = _mesh({"data": 1, "fsdp": 8, "expert": 1})
    assert logical_to_spec(("batch", None), RULES, mesh) == PartitionSpec("fsdp")
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    (eqn,) = _constraints(lambda x: constrain(x, ("batch", None)), x, mesh)
    assert eqn.params["sharding"].spec == PartitionSpec("fsdp")
    # A mesh with every axis of size one: nothing is left to constrain at all.
    assert _constraints(lambda x: constrain(x, ("batch", None)), x, _mesh({})) == []
    # Negative control: an axis of size two stays.
    mesh2 = _mesh({"data": 2, "fsdp": 4})
    assert logical_to_spec(("batch",), RULES, mesh2) == PartitionSpec(("data", "fsdp"))


# (c) ---------------------------------------------------------------------------------------
def test_c_rms_norm_is_a_broadcast_multiply_with_offset_only_when_nonzero():
    x = jnp.ones((2, 4, 8), jnp.float32)
    s = jnp.full((8,), 2.0, jnp.float32)
    plain = [e.primitive.name for e in _prims(lambda s, x: norm.rms_norm(s, x, 1e-6), s, x)]
    shifted = [e.primitive.name for e in _prims(lambda s, x: norm.rms_norm(s, x, 1e-6, 1.0), s, x)]
    assert "dot_general" not in plain
    assert plain.count("add") == 1  # + eps only
    assert shifted.count("add") == 2  # negative control: a non-zero offset adds
    np.testing.assert_allclose(norm.rms_norm(s, x, 1e-6), 2.0, rtol=1e-5)
    np.testing.assert_allclose(norm.rms_norm(s, x, 1e-6, 1.0), 3.0, rtol=1e-5)


# (d) ---------------------------------------------------------------------------------------
def test_d_embedding_gathers_and_uses_one_hot_only_below_two_gib():
    small = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    big = jax.ShapeDtypeStruct((8, 4096), jnp.int32)  # x 32768 vocab x 4 bytes = 4 GiB one-hot
    table = jax.ShapeDtypeStruct((32768, 64), jnp.float32)
    names = lambda ids, iota: {  # noqa: E731
        e.primitive.name
        for e in _prims(
            functools.partial(embed.lookup, dtype=jnp.float32, use_iota=iota), table, ids
        )
    }
    assert embed.one_hot_bytes(big, 32768, jnp.float32) > embed.ONE_HOT_LIMIT_BYTES
    assert "gather" in names(small, False) and "dot_general" not in names(small, False)
    assert "dot_general" in names(small, True)  # one-hot matmul below the limit
    assert "gather" in names(big, True) and "dot_general" not in names(big, True)
    t = jax.random.normal(jax.random.key(0), (50, 8))
    ids = jnp.arange(12).reshape(2, 6) * 3
    np.testing.assert_allclose(
        embed.lookup(t, ids, jnp.float32, use_iota=True),
        embed.lookup(t, ids, jnp.float32),
        rtol=1e-6,
    )


# (e) ---------------------------------------------------------------------------------------
def _unfused_shapes(hlo: str) -> set[str]:
    """Shapes of the instructions outside fusion bodies: the buffers XLA really allocates."""
    shapes, inside = set(), False
    for line in hlo.splitlines():
        if line.startswith("%") or line.startswith("ENTRY"):
            inside = line.startswith("%fused") or "fused_computation" in line.split("(")[0]
            continue
        if not inside:
            m = re.match(r"\s+(?:ROOT )?%\S+ = (\w+\[[\d,]*\])", line)
            if m:
                shapes.add(m.group(1))
    return shapes


def _mask_buffers(hlo: str, b: int, t: int) -> set[str]:
    pattern = re.compile(rf"^(pred|s32|f32|u8)\[{b},(1,)*({t},)?{t},{t}\]$")
    pattern2 = re.compile(rf"^(pred|s32|f32|u8)\[{b},(1,)*{t},{t}\]$")
    return {s for s in _unfused_shapes(hlo) if pattern.match(s) or pattern2.match(s)}


@pytest.mark.parametrize("with_segments", [False, True])
def test_e_attention_mask_is_never_materialized(with_segments):
    b, t, h, q = 2, 64, 4, 16
    qs = jax.ShapeDtypeStruct((b, t, h, q), jnp.float32)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, seg):
        out = attend(q, k, v, scale=0.25, segment_ids_BT=seg if with_segments else None)
        return jnp.sum(out)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(qs, qs, qs, seg).compile().as_text()
    assert _mask_buffers(hlo, b, t) == set()

    # Negative control: a mask that must exist in memory (it is also returned, as a mask built
    # once and passed to every layer would be) is seen by the same detector.
    def materialized(q, seg):
        same = seg[:, None, :, None] == seg[:, None, None, :]
        mask = jnp.logical_and(same, jnp.tril(jnp.ones((t, t), bool))[None, None])
        return jnp.sum(jnp.where(mask, jnp.einsum("bthq,bshq->bhts", q, q), 0.0)), mask

    hlo_bad = jax.jit(materialized).lower(qs, seg).compile().as_text()
    assert _mask_buffers(hlo_bad, b, t) == {f"pred[{b},1,{t},{t}]"}


def test_e_document_mask_blocks_other_documents():
    """The fused mask still masks: a key in another document gets no gradient from a query."""
    q = jax.random.normal(jax.random.key(0), (1, 6, 2, 4))
    seg = jnp.array([[1, 1, 1, 2, 2, 2]], jnp.int32)
    g = jax.jit(jax.grad(lambda k: attend(q, k, q, scale=0.5, segment_ids_BT=seg)[0, 4].sum()))(q)
    assert float(jnp.abs(g[0, :3]).max()) == 0.0 and float(jnp.abs(g[0, 3:5]).max()) > 0
    assert float(jnp.abs(g[0, 5]).max()) == 0.0  # causal: the future key


# (f) and (h) -------------------------------------------------------------------------------
def _expert_output_casts(float32_weight_sum: bool, sparse: bool, *extra: str) -> list[tuple]:
    """(input dtype, output dtype, input shape) of each cast of a bfloat16 tensor of expert
    outputs (last dim D, at least the [N, D] of 32 tokens), in one MoE layer of mixtral-tiny."""
    c = load_config(
        overrides=[
            "model_name=mixtral-tiny",
            "dtype=bfloat16",
            f"float32_weight_sum={float32_weight_sum}",
            f"sparse_matmul={sparse}",
            *extra,
        ]
    )
    p = param.abstract(moe_spec(c), jnp.float32)
    n, d, k = 32, c.base_emb_dim, c.num_experts_per_tok

    # The routing is an input: the router's own float32 logits (a cast of the input tokens) are
    # not what this counts.
    def layer(p, x, r):
        if sparse:
            return dispatch.sparse(x, r, p, c, jnp.bfloat16)[0]
        xb = x.reshape(2, n // 2, d)
        return dispatch.capacity_einsum(
            xb,
            r.experts_NK.reshape(2, n // 2, k),
            r.weights_NK.reshape(2, n // 2, k),
            p,
            c,
            jnp.bfloat16,
        )[0]

    x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    r = jax.eval_shape(lambda p, x: router.route(p.router, x, c), p, x)
    casts = [e for e in _prims(layer, p, x, r) if e.primitive.name == "convert_element_type"]
    big = lambda a: a.ndim >= 2 and a.shape[-1] == d and np.prod(a.shape) >= n * d  # noqa
    return [
        (str(e.invars[0].aval.dtype), str(e.outvars[0].aval.dtype), e.invars[0].aval.shape)
        for e in casts
        if big(e.invars[0].aval) and e.invars[0].aval.dtype == jnp.bfloat16
    ]


@pytest.mark.parametrize(
    "sparse, extra",
    [
        (True, ("moe_fused_routed_ffn=false",)),
        (True, ("moe_fused_routed_ffn=true", "gmm_tile_rows=16")),
        (False, ()),
    ],
    ids=["sparse-separate", "sparse-fused", "einsum"],
)
def test_f_no_casts_of_expert_outputs_without_float32_weight_sum(sparse, extra):
    assert _expert_output_casts(False, sparse, *extra) == []
    # (h) The float32 combine never upcasts all K outputs at once: the separate sparse path casts
    # one [N, D] slot at a time into its float32 accumulator (negative control: casts are seen),
    # the fused routed FFN one work item's tile of rows (gmm_tile_rows=16 here, fewer than the
    # N = 32 rows counted: none is seen; with the default tile, one tile holds all N*K = 64 rows
    # and that cast is seen), the einsum path accumulates in float32 inside its dot_general (no
    # cast of the outputs at all).
    casts = _expert_output_casts(True, sparse, *extra)
    if "moe_fused_routed_ffn=false" in extra:
        assert casts == [("bfloat16", "float32", (32, 128))] * 2  # K = 2 slots
    else:
        assert casts == []
    if "gmm_tile_rows=16" in extra:  # negative control: a tile of all 64 rows is counted
        wide = _expert_output_casts(True, sparse, "moe_fused_routed_ffn=true")
        assert ("bfloat16", "float32", (64, 128)) in wide


def test_h_float32_weight_sum_cost_is_the_float32_accumulator():
    """The report's cost is the [N, D] accumulator in float32 instead of bfloat16: N = 32 tokens
    (batch 1 x 32), D = 128, 2 more bytes each: 32 x 128 x 2 = 8192 bytes."""
    c = load_config(
        overrides=[
            "model_name=mixtral-tiny",
            "dtype=bfloat16",
            "float32_weight_sum=true",
            "max_target_length=32",
        ]
    )
    cost = _weight_sum_cost(c, batch_local=1)
    assert cost["extra_bytes_per_moe_layer"] == cost["extra_bytes_if_enabled"] == 8192
    off = _weight_sum_cost(c.model_copy(update={"float32_weight_sum": False}), batch_local=1)
    assert (off["extra_bytes_per_moe_layer"], off["extra_bytes_if_enabled"]) == (0, 8192)
    f32 = _weight_sum_cost(c.model_copy(update={"dtype": "float32"}), batch_local=1)
    assert f32["extra_bytes_if_enabled"] == 0  # nothing to upcast
    # Negative control: batch 2 doubles it.
    assert _weight_sum_cost(c, batch_local=2)["extra_bytes_if_enabled"] == 16384


# (g) ---------------------------------------------------------------------------------------
def _grad_casts(grad_dtype: str) -> int:
    from expertax.train.step import train_step
    from expertax.train.trainer import build_trainer

    c = load_config(
        overrides=[
            "model_name=llama-tiny",
            "base_num_decoder_layers=1",
            f"grad_dtype={grad_dtype}",
            "max_target_length=16",
        ]
    )
    tr = build_trainer(c, jax.devices()[:1])
    fn = functools.partial(train_step, c=c, tx=tr.tx)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tr.abstract_state())
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tr.abstract_batch())
    eqns = jax.make_jaxpr(fn)(state, batch).jaxpr.eqns  # the top level, where the cast lives
    return sum(
        1
        for e in eqns
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == jnp.float32
        and e.outvars[0].aval.dtype == jnp.dtype(grad_dtype) == jnp.bfloat16
    )


def test_g_gradients_cast_only_when_grad_dtype_differs():
    from expertax.models import decoder

    leaves = len(
        jax.tree.leaves(
            param.abstract(
                decoder.spec(
                    load_config(overrides=["model_name=llama-tiny", "base_num_decoder_layers=1"])
                ),
                jnp.float32,
            )
        )
    )
    assert _grad_casts("float32") == 0
    assert _grad_casts("bfloat16") >= leaves  # negative control


def test_report_format_mentions_weight_sum_cost():
    report = {
        "model_name": "m",
        "devices": 1,
        "backend": "cpu",
        "mesh": {},
        "global_batch": 1,
        "batch_per_device": 1,
        "max_target_length": 8,
        "remat_policy": "full",
        "parameter_bytes": 0,
        "optimizer_state_bytes": 0,
        "gradient_bytes": 0,
        "parameter_memory_host_offload": False,
        "optimizer_memory_host_offload": False,
        "residuals": [],
        "residual_bytes_device": 0,
        "residual_bytes_host": 0,
        "float32_weight_sum": {
            "enabled": True,
            "extra_bytes_per_moe_layer": 2048,
            "extra_bytes_if_enabled": 2048,
        },
        "xla": dict.fromkeys(
            ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_temp"), 0
        ),
        "offloaded_state_bytes": 0,
        "peak_device_bytes": 0,
        "hbm_gib": None,
        "fits": None,
    }
    assert "float32_weight_sum=true: 2.00 KiB" in format_report(report)
