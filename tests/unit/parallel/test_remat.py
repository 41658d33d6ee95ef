"""Remat policies: what each saves, by name and placement; tags where produced; exact gradients."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.config import ConfigError
from expertax.config.schema import RematSection
from expertax.models import decoder, init_params
from expertax.nn import param
from expertax.parallel import remat
from expertax.planner import residuals
from expertax.planner.residuals import layer_residuals
from expertax.preflight import load_config
from expertax.train.step import loss_fn

DLI, Q, K, V = remat.DECODER_LAYER_INPUT, remat.QUERY_PROJ, remat.KEY_PROJ, remat.VALUE_PROJ
ATT, OUT = remat.ATTENTION_OUT, remat.OUT_PROJ
QA, KVA = remat.QUERY_WA_PROJ, remat.KV_WA_PROJ
MOE_WO = remat.MOE_MLPWO

# What each preset stores per layer, by model family and stack. A name whose tensor autodiff
# does not need is never stored (mla_q when query_proj is kept, mlpwo feeding only an add).
MLA_EXPECTED = {
    "full": {DLI},
    "minimal": {DLI, QA, KVA, Q, K, V, ATT, OUT},
    "save_qkv_proj": {DLI, Q, K, V},
    "save_dot_except_mlp": {DLI, QA, KVA, Q, K, V, OUT},
    "save_out_proj": {DLI, OUT},
}
GQA_EXPECTED = {
    "full": {DLI},
    "minimal": {DLI, Q, K, V, ATT, OUT},
    "save_qkv_proj": {DLI, Q, K, V},
    "save_dot_except_mlp": {DLI, Q, K, V, OUT},
    "save_out_proj": {DLI, OUT},
}
# The routed experts' output feeds the weighted combine (the separate path) or the fused
# routed FFN's routing-weight gradient when kept, so `minimal` keeps it in MoE layers.
MOE_EXTRA = {"minimal": {MOE_WO}}

SHORT = ["max_target_length=16"]
SEPARATE = "moe_fused_routed_ffn=false"


def _names(c, moe):
    res = layer_residuals(c, moe=moe, batch_local=2)
    assert all(r.placement == "device" for r in res)
    return [r.name for r in res]


def test_every_name_is_a_config_key_and_every_key_a_name():
    keys = set(RematSection.model_fields) - {
        "remat_policy",
        "optimizer_memory_host_offload",
        "parameter_memory_host_offload",
        "use_iota_embed",
    }
    assert keys == set(remat.ALL_NAMES)
    assert len(set(remat.ALL_NAMES)) == len(remat.ALL_NAMES)


@pytest.mark.parametrize("preset", sorted(remat.PRESETS))
@pytest.mark.parametrize(
    "model, expected, fused",
    [
        ("deepseek3-tiny", MLA_EXPECTED, True),
        ("deepseek3-tiny", MLA_EXPECTED, False),
        ("mixtral-tiny", GQA_EXPECTED, True),
        ("mixtral-tiny", GQA_EXPECTED, False),
        ("llama-tiny", GQA_EXPECTED, True),  # no MoE layer: the flag changes nothing
    ],
)
def test_preset_saves_exactly_its_names(model, expected, preset, fused):
    c = load_config(
        overrides=[
            f"model_name={model}",
            f"remat_policy={preset}",
            f"moe_fused_routed_ffn={fused}",
            *SHORT,
        ]
    )
    stacks = [m for m, n in ((False, c.num_dense_layers), (True, c.num_moe_layers)) if n]
    for moe in stacks:
        names = _names(c, moe)
        extra = MOE_EXTRA.get(preset, set()) if moe else set()
        want = expected[preset] | extra
        assert len(names) == len(set(names)), names  # one residual per name
        assert set(names) == want, (model, preset, moe)


def test_none_saves_unnamed_residuals_too():
    c = load_config(overrides=["model_name=deepseek3-tiny", "remat_policy=none", *SHORT])
    names = _names(c, True)
    assert any(n.startswith("unnamed:") for n in names)
    assert {DLI, remat.MOE_MLPWI_0, remat.MOE_MLPWI_1, QA} <= set(names)


def test_custom_placements_are_reported_by_name():
    c = load_config(
        overrides=[
            "model_name=deepseek3-tiny",
            "remat_policy=custom",
            "moe_mlpwo=offload",
            "query_wa_proj=device",
            "kv_wa_proj=offload",
            *SHORT,
        ]
    )
    got = {(r.name, r.placement) for r in layer_residuals(c, moe=True, batch_local=2)}
    assert got == {(DLI, "device"), (QA, "device"), (MOE_WO, "host"), (KVA, "host")}
    dense = {(r.name, r.placement) for r in layer_residuals(c, moe=False, batch_local=2)}
    assert dense == {(DLI, "device"), (QA, "device"), (KVA, "host")}


def test_custom_layer_input_remat_is_still_kept_as_the_layer_argument():
    c = load_config(
        overrides=[
            "model_name=llama-tiny",
            "remat_policy=custom",
            "decoder_layer_input=remat",
            *SHORT,
        ]
    )
    assert _names(c, False) == [DLI]


@pytest.mark.parametrize(
    "offloaded, path",
    [
        ("moe_mlpwo", SEPARATE),
        ("moe_mlpwo", "moe_fused_routed_ffn=true"),
        ("moe_mlpwi_0", "moe_fused_routed_ffn=true"),
    ],
)
def test_offloaded_residuals_really_live_on_the_host(offloaded, path):
    """The real policy (not the report's trace) moves exactly the offloaded names to host: the
    expert output of the separate and of the fused path, the gate of the fused routed FFN."""
    from jax._src.ad_checkpoint import saved_residuals

    c = load_config(
        overrides=[
            "model_name=deepseek3-tiny",
            "remat_policy=custom",
            f"{offloaded}=offload",
            "query_wa_proj=device",
            path,
            *SHORT,
        ]
    )
    block = param.abstract(decoder.block_spec(c, moe=True), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 16, c.base_emb_dim), jnp.float32)
    pos = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def f(p, x, pos):
        body = lambda x, p: decoder.block_apply(p, x, c, pos, None, jnp.float32)[:2]
        y, st = remat.wrap_layer(body, c, prevent_cse=False)(x, p)
        return y.sum() + st.lb_loss

    res = saved_residuals(f, block, x, pos)
    host = [a for a, _ in res if "<host>" in a.str_short()]
    rows = 2 * 16 * c.num_experts_per_tok
    width = c.base_emb_dim if offloaded == "moe_mlpwo" else c.base_moe_mlp_dim
    assert [tuple(a.shape) for a in host] == [(rows, width)]
    named = sorted(src.split("'")[1] for _, src in res if "named '" in src)
    assert named == [DLI, QA]


def _produced_names(c):
    """Checkpoint names tagged anywhere in the forward pass of `c`."""
    params = param.abstract(decoder.spec(c), jnp.float32)
    inputs = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, i: decoder.forward(p, i, c))(params, inputs)
    found = set()

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
        for sub in jax.extend.core.subjaxprs(jx):
            walk(sub)

    walk(jaxpr.jaxpr)
    return found


MLA_TAGS = {
    DLI,
    Q,
    K,
    V,
    ATT,
    OUT,
    QA,
    KVA,
    remat.MLA_Q,
    remat.MLA_KV,
    remat.MLPWI_0,
    remat.MLPWI_1,
    remat.MLPWO,
    remat.MOE_MLPWI_0,
    remat.MOE_MLPWI_1,
    MOE_WO,
}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model_name=deepseek3-tiny"], MLA_TAGS),
        (["model_name=deepseek3-tiny", SEPARATE], MLA_TAGS),
        (["model_name=deepseek3-tiny", "sparse_matmul=false"], MLA_TAGS),
        (["model_name=deepseek3-tiny", "q_lora_rank=0"], MLA_TAGS - {QA}),
        (
            ["model_name=mixtral-tiny"],
            {DLI, Q, K, V, ATT, OUT, remat.MOE_MLPWI_0, remat.MOE_MLPWI_1, MOE_WO},
        ),
        (
            ["model_name=llama-tiny"],
            {DLI, Q, K, V, ATT, OUT, remat.MLPWI_0, remat.MLPWI_1, remat.MLPWO},
        ),
    ],
)
def test_tags_are_produced_where_expected(overrides, expected):
    c = load_config(overrides=[*overrides, "remat_policy=none", *SHORT])
    assert _produced_names(c) == expected


def test_every_name_but_qkv_proj_is_produced_somewhere():
    """qkv_proj is reserved for a fused projection; no model here computes one."""
    c = load_config(overrides=["model_name=deepseek3-tiny", SEPARATE, *SHORT])
    assert _produced_names(c) | {remat.QKV_PROJ} == set(remat.ALL_NAMES)


def test_renamed_tag_is_caught(monkeypatch):
    """Negative control: a renamed tag changes the produced names and what a preset saves."""
    monkeypatch.setattr(remat, "OUT_PROJ", "out_projection")
    monkeypatch.setattr(residuals, "_TRACED", {})  # the traces of the real name are not reused
    c = load_config(overrides=["model_name=llama-tiny", "remat_policy=save_out_proj", *SHORT])
    assert "out_projection" in _produced_names(c)
    assert set(_names(c, False)) != GQA_EXPECTED["save_out_proj"]


def test_offload_without_pinned_host_is_an_error(monkeypatch):
    c = load_config(overrides=["model_name=llama-tiny", "remat_policy=custom", "mlpwi_0=offload"])
    monkeypatch.setattr(remat, "backend_has_pinned_host", lambda devices=None: False)
    with pytest.raises(ValueError, match="mlpwi_0=offload.*no pinned_host"):
        remat.wrap_layer(lambda x: x, c, prevent_cse=False)
    monkeypatch.undo()
    remat.wrap_layer(lambda x: x, c, prevent_cse=False)  # the CPU backend has pinned_host


def test_bad_placement_is_refused():
    with pytest.raises(ConfigError, match="moe_mlpwo"):
        load_config(overrides=["remat_policy=custom", "moe_mlpwo=disk"])
    with pytest.raises(ConfigError, match="remat_policy"):
        load_config(overrides=["remat_policy=fullest"])


# Every preset and a custom mix with offload, on the MLA + MoE model where the policy matters
# most and on a one-layer GQA model (cheaper to compile) for the attention-only presets.
GRAD_CASES = [
    (
        ["model_name=deepseek3-tiny", "base_num_decoder_layers=2"],
        [
            ["remat_policy=minimal"],
            [
                "remat_policy=custom",
                "moe_mlpwo=offload",
                "query_wa_proj=device",
                "mlpwi_0=offload",
                "attention_out=device",
            ],
        ],
    ),
    (
        ["model_name=llama-tiny", "base_num_decoder_layers=1"],
        [
            ["remat_policy=full"],
            ["remat_policy=save_qkv_proj"],
            ["remat_policy=save_dot_except_mlp"],
            ["remat_policy=save_out_proj"],
            ["remat_policy=full", "scan_layers=false"],
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("base, policies", GRAD_CASES, ids=["deepseek3-tiny", "llama-tiny"])
@pytest.mark.default_codegen
def test_gradients_under_every_policy_equal_no_remat_bitwise(base, policies):
    base = [*base, "max_target_length=16"]
    c_none = load_config(overrides=[*base, "remat_policy=none"])
    params = init_params(c_none)
    rng = np.random.default_rng(0)
    batch = {
        "inputs": jnp.asarray(rng.integers(0, c_none.vocab_size, (2, 16)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, c_none.vocab_size, (2, 16)), jnp.int32),
        "weights": jnp.ones((2, 16), jnp.float32),
    }

    def grads(c):
        return jax.jit(jax.grad(lambda p: loss_fn(p, batch, c)[0]))(params)

    ref = jax.tree.leaves(grads(c_none))
    assert all(float(jnp.abs(g).max()) > 0 for g in ref[:3])
    for overrides in policies:
        got = jax.tree.leaves(grads(load_config(overrides=[*base, *overrides])))
        for a, b in zip(ref, got, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(overrides))


def test_all_presets_are_covered_by_the_gradient_test():
    covered = {
        o.split("=")[1]
        for _, pols in GRAD_CASES
        for p in pols
        for o in p
        if o.startswith("remat_policy=")
    }
    assert covered | {"none"} == set(remat.POLICY_NAMES)
