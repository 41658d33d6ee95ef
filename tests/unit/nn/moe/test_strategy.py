"""The dispatch decision and its log line: what the line says is what `moe.layer.apply` runs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from expertax.config import ConfigError, config_rules
from expertax.nn import param
from expertax.nn.moe import dispatch, ep, layer, strategy
from expertax.preflight import load_config
from expertax.sharding import make_mesh, use_rules


def describe(c, mesh_shape, **kwargs) -> str:
    return strategy.describe_dispatch(c, mesh_shape, config_rules(c), **kwargs)


def mesh(expert: int = 1, fsdp: int = 1, data: int = 1) -> dict[str, int]:
    return {"pipeline": 1, "data": data, "fsdp": fsdp, "expert": expert, "tensor": 1}


def cfg(**overrides):
    return load_config(overrides={"model_name": "mixtral-tiny", **overrides})


def test_auto_impl_per_backend():
    c = cfg()
    assert strategy.resolve_a2a_impl(c, "cpu") == "padded"
    assert strategy.resolve_a2a_impl(c, "gpu") == "ragged"
    assert strategy.resolve_a2a_impl(c, "tpu") == "ragged"
    assert strategy.resolve_a2a_impl(cfg(a2a_impl="ragged"), "cpu") == "ragged"


def test_one_device_is_the_plain_sorted_path():
    line = describe(cfg(), mesh(), backend="cpu")
    assert line == (
        "MoE dispatch: sparse, sorted grouped matmuls on one device (dropless, no exchange)"
    )
    assert not strategy.uses_shard_map(cfg(), 1)


def test_expert_mesh_all_to_all():
    line = describe(cfg(), mesh(expert=8), backend="cpu")
    assert line == (
        "MoE dispatch: sparse, shard_map (tokens over expert), expert=8: all-to-all "
        "a2a_impl=auto -> padded on cpu, worst-case receive buffer (dropless)"
    )
    capped = describe(cfg(ragged_buffer_factor=2), mesh(expert=8), backend="gpu")
    assert "-> ragged on gpu, receive buffer 2.0 x routed rows" in capped


def test_expert_mesh_ring():
    line = describe(cfg(use_ring_of_experts=True), mesh(expert=4, fsdp=2))
    assert line == (
        "MoE dispatch: sparse, shard_map (tokens over fsdp,expert), expert=4: ring of experts "
        "(all-gather, local experts, reduce-scatter)"
    )
    assert "buffer" not in line and "all-to-all" not in line  # negative control
    tp = cfg(use_ring_of_experts=True, sharding_rules="ep-tp")
    assert describe(tp, mesh(expert=4, fsdp=2)).endswith(
        "(tokens over fsdp), expert=4: ring of experts (local experts, psum)"
    )


def test_mesh_without_expert_axis_has_no_exchange():
    line = describe(cfg(), mesh(fsdp=8), backend="cpu")
    assert line == (
        "MoE dispatch: sparse, shard_map (tokens over fsdp), expert=1: "
        "all 8 experts on every shard, no exchange"
    )
    assert "buffer" not in line and "ring" not in line


def test_einsum_dispatch_and_dense_model():
    c = cfg(sparse_matmul=False)
    assert describe(c, mesh(fsdp=8)) == (
        "MoE dispatch: one-hot einsum (capacity_einsum) under GSPMD (dropless)"
    )
    capped = cfg(sparse_matmul=False, capacity_factor=1.5)
    assert describe(capped, mesh()) == (
        "MoE dispatch: one-hot einsum (capacity_einsum) on one device (capacity_factor=1.5)"
    )
    dense_model = load_config(overrides={"model_name": "llama-tiny"})
    assert describe(dense_model, mesh(expert=8)) == ("MoE dispatch: none (dense model)")


@pytest.mark.parametrize("devices, uses", [(1, False), (8, True)])
def test_layer_runs_the_shard_map_exactly_when_described(monkeypatch, devices, uses):
    """The decision the line states is the one layer.apply takes (ep.apply called or not)."""
    c = cfg(ici_fsdp_parallelism=devices)
    p = param.initialize(layer.spec(c), jax.random.key(0), jnp.float32)
    x = jnp.ones((8, 4, c.base_emb_dim), jnp.float32)
    calls = []
    real = ep.apply
    monkeypatch.setattr(ep, "apply", lambda *a: calls.append("ep") or real(*a))
    real_sparse = dispatch.sparse
    monkeypatch.setattr(dispatch, "sparse", lambda *a: calls.append("sorted") or real_sparse(*a))
    m = make_mesh(c, jax.devices()[:devices])
    with jax.set_mesh(m), use_rules(config_rules(c)):
        jax.eval_shape(lambda p, x: layer.apply(p, x, c, jnp.float32), p, x)
    line = describe(c, dict(m.shape), backend="cpu")
    assert calls == (["ep"] if uses else ["sorted"])
    assert ("shard_map" in line) == uses


def test_moe_specs_come_from_the_rules():
    """The `shard_map` specs follow the rules table; a table the layer cannot compute is refused
    with the key, its value and what is valid (before anything compiles: build_trainer)."""
    rules = config_rules(cfg())
    specs = strategy.moe_specs(rules)
    # `pipeline` is a batch axis outside a pipeline's stages (inside them the rules drop it)
    assert specs.x == P(("data", "fsdp", "expert", "pipeline"), "context")
    assert specs.wi == P("expert", None, "tensor") and specs.wo == P("expert", "tensor", None)
    tp = strategy.moe_specs(config_rules(cfg(sharding_rules="ep-tp")))
    assert tp.tokens == ("data", "fsdp", "pipeline") and tp.mlp == ("tensor",)
    assert strategy.moe_specs({**rules, "exp_mlp": ()}).wi == P("expert", None, None)
    with pytest.raises(ConfigError, match=r"batch -> \['data', 'tensor'\].*valid: a subset"):
        strategy.moe_specs({**rules, "batch": ("data", "tensor")})
    with pytest.raises(ConfigError, match=r"act_exp -> \['fsdp'\].*valid: \[expert\]"):
        strategy.moe_specs({**rules, "act_exp": ("fsdp",)})
    with pytest.raises(ConfigError, match=r"exp_mlp -> \['fsdp'\]: \['fsdp'\] already shard"):
        strategy.moe_specs({**rules, "exp_mlp": ("fsdp",)})


def test_build_trainer_refuses_rules_the_moe_layer_cannot_compute(monkeypatch):
    from expertax.train import trainer

    bad = {**config_rules(cfg()), "act_exp": ("tensor",)}
    monkeypatch.setattr(trainer, "config_rules", lambda c: bad)
    with pytest.raises(ConfigError, match="act_exp"):
        trainer.build_trainer(cfg(ici_expert_parallelism=2), devices=jax.devices()[:2])
