"""Context parallelism's layout: the load-balanced chunk order, the batch reorder (MTP targets
computed before it), the MoE token spec, and the refusals before anything compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from expertax.config import ConfigError, load_rules
from expertax.config.schema import MESH_AXES
from expertax.models import mtp
from expertax.nn.attention import context
from expertax.nn.moe import strategy
from expertax.preflight import load_config
from expertax.sharding import check_mesh_fit, use_rules
from expertax.sharding.mesh import check_context_rules


def _shape(**sizes) -> dict[str, int]:
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def test_chunk_order_gives_each_device_equal_causal_work():
    assert context.chunk_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]
    index = context.balanced_index(16, 2)
    assert index.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    # causal work of a chunk k of 2cp: k + 1 key chunks; each device's two chunks sum to 2cp + 1
    cp = 8
    order = context.chunk_order(cp)
    work = [order[2 * i] + order[2 * i + 1] + 2 for i in range(cp)]
    assert len(set(work)) == 1


def test_balance_reorders_every_field_and_computes_mtp_targets_first():
    c = load_config(overrides=["model_name=deepseek3-tiny", "mtp_num_layers=1"])
    t = 16
    ids = jnp.arange(2 * t, dtype=jnp.int32).reshape(2, t)
    batch = {"inputs": ids, "targets": ids + 1, "weights": jnp.ones((2, t), jnp.float32)}
    batch["segment_ids"] = jnp.ones((2, t), jnp.int32)
    mesh = AbstractMesh((1, 1, 1, 2, 1, 1), MESH_AXES)
    with jax.sharding.use_abstract_mesh(mesh), use_rules(load_rules("default")):
        out = context.balance(batch, c, mtp.depth_targets)
    index = context.balanced_index(t, 2)
    np.testing.assert_array_equal(out["inputs"], ids[:, index])
    np.testing.assert_array_equal(out["positions"][0], index)  # positions move with the tokens
    tokens, targets, weights = out["mtp_depths"][0]
    # depth 1 at original position i: token i+1, target i+2 (not the reordered neighbour)
    np.testing.assert_array_equal(tokens[0], np.append(np.arange(1, t), 0)[index])
    np.testing.assert_array_equal(targets[0], np.append(np.arange(2, t + 1), 0)[index])
    assert float(weights[0][list(index).index(t - 1)]) == 0.0
    with use_rules(load_rules("default")):  # no mesh: as it is
        assert context.balance(batch, c) is batch


def test_moe_tokens_keep_the_context_split():
    specs = strategy.moe_specs(load_rules("default"))
    assert specs.x == PartitionSpec(("data", "fsdp", "expert", "pipeline"), ("context",))
    assert strategy.token_axes(load_rules("default"))[-1] == "context"
    with pytest.raises(ConfigError, match="length -> \\['tensor'\\]"):
        strategy.moe_specs({**load_rules("default"), "length": ("tensor",)})


def test_refusals_name_the_keys():
    c = load_config(overrides=["ici_context_parallelism=4", "max_target_length=36"])
    with pytest.raises(ConfigError, match="max_target_length=36 does not split into 8"):
        check_mesh_fit(c, _shape(context=4, fsdp=2))
    off = load_config(
        overrides=[
            "ici_context_parallelism=4",
            "max_target_length=36",
            "context_parallel_load_balance=false",
        ]
    )
    check_mesh_fit(off, _shape(context=4, fsdp=2))  # 36 splits into 4
    with pytest.raises(ConfigError, match="attention_impl=cudnn with ici_context_parallelism=2"):
        over = ["ici_context_parallelism=2", "attention_impl=cudnn", "dtype=bfloat16"]
        load_config(overrides=over)
    # splash takes permuted rows, in chunks of whole 128-row tiles: 4 chunks of 8 rows are not
    with pytest.raises(ConfigError, match="max_target_length=32 must split into 4 chunks"):
        load_config(overrides=["ici_context_parallelism=2", "attention_impl=splash",
                               "max_target_length=32"])  # fmt: skip
    load_config(overrides=["ici_context_parallelism=2", "attention_impl=splash",
                           "max_target_length=512"])  # fmt: skip
    with pytest.raises(ConfigError, match="num_attention_token_chunks=2 with ici_context"):
        load_config(overrides=["ici_context_parallelism=2", "num_attention_token_chunks=2"])


def test_a_context_axis_the_rules_do_not_split_over_is_refused():
    """A rules table whose `length` rule leaves out `context` would run every context shard on
    the same tokens (a silent no-op): refused before anything compiles."""
    c = load_config(overrides=["ici_context_parallelism=2", "max_target_length=32"])
    rules = load_rules("default")
    check_context_rules(c, _shape(context=2, fsdp=4), rules)
    with pytest.raises(ConfigError, match="maps length -> \\[\\]: the sequence would not"):
        check_context_rules(c, _shape(context=2, fsdp=4), {**rules, "length": ()})
    check_context_rules(c, _shape(fsdp=8), {**rules, "length": ()})  # no context axis: fine
