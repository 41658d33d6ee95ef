"""The decode-time MoE layer on one device (nn/moe/unstacked.py) against training's MoE layer.

The per-row path (one token: each routed row through its expert's own arrays, a `lax.switch`
per row) and the grouped path (more tokens: each expert's rows in tiles) must compute what
`nn.moe.layer.apply` computes with the stacked weights: the same routing (sigmoid with groups
and bias, softmax), the same weights and shared experts; fp8 experts dequantized per branch
must match the dequantized stacked layer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config
from expertax.decoding import joint, quantized
from expertax.fp8 import quant
from expertax.nn.moe import layer as moe_layer
from expertax.nn.moe import unstacked as decode_moe
from expertax.nn.moe.side import Side
from tests.tolerances import tol


def _layer(model_name: str):
    c = load_config(overrides=dict(model_name=model_name, dtype="float32", weight_dtype="float32"))
    p = init_params(c).moe_layers
    one = jax.tree.map(lambda a: a[0], p.moe)
    if one.router.bias is not None:  # a balancing bias that moves the choice
        bias = jax.random.normal(jax.random.key(3), one.router.bias.shape) * 0.1
        one = dataclasses.replace(one, router=dataclasses.replace(one.router, bias=bias))
    return c, one


@pytest.mark.parametrize("model_name", ["deepseek3-tiny", "mixtral-tiny"])
# decode at batch 1 and 3, speculative, prefill
@pytest.mark.parametrize("tokens", [(1, 1), (3, 1), (2, 2), (4, 40)])
def test_unstacked_layer_equals_training_layer(model_name, tokens, monkeypatch):
    c, p = _layer(model_name)
    b, t = tokens
    ran = []
    for path in ("_per_row", "_grouped"):
        real = getattr(decode_moe, path)
        monkeypatch.setattr(
            decode_moe, path, lambda *a, real=real, path=path: (ran.append(path), real(*a))[1]
        )
    x = jax.random.normal(jax.random.key(1), (b, t, c.base_emb_dim), jnp.float32)
    want, *_ = jax.jit(lambda p, x: moe_layer.apply(p, x, c, jnp.float32))(p, x)
    unstacked = joint.unstack(p)
    assert decode_moe.is_unstacked(unstacked) and len(unstacked.wi_0) == c.num_experts
    got = jax.jit(lambda p, x: decode_moe.apply(p, x, c, jnp.float32)[0])(unstacked, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(jnp.float32))
    assert ran == ["_per_row" if b * t == 1 else "_grouped"]


def test_unstacked_layer_returns_and_takes_the_routing_as_the_training_layer():
    """Decoding records its routing through the stats (`imposed` -1: the router's own choice),
    and an imposed routing is used, as in training's layer."""
    c, p = _layer("deepseek3-tiny")
    x = jax.random.normal(jax.random.key(4), (3, 2, c.base_emb_dim), jnp.float32)
    k = c.num_experts_per_tok
    none = jnp.full((3, 2, k), -1, jnp.int32)
    forced = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (3, 2, k))

    def train(p, x, imposed):
        out, stats, _ = moe_layer.apply(p, x, c, jnp.float32, Side(imposed=imposed))
        return out, stats.chosen_BTK

    def decode(p, x, imposed):
        out, stats = decode_moe.apply(p, x, c, jnp.float32, imposed)
        return out, stats.chosen_BTK

    unstacked = joint.unstack(p)
    assert decode_moe.apply(unstacked, x, c, jnp.float32)[1] is None  # nothing asked
    for imposed in (none, forced):
        want_out, want_chosen = jax.jit(train)(p, x, imposed)
        got_out, got_chosen = jax.jit(decode)(unstacked, x, imposed)
        np.testing.assert_array_equal(np.asarray(got_chosen), np.asarray(want_chosen))
        np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), **tol(jnp.float32))
    # the forced experts are not the router's: the outputs differ
    assert not np.allclose(jax.jit(decode)(unstacked, x, none)[0], got_out)


def test_fp8_experts_dequantized_per_branch():
    c, p = _layer("deepseek3-tiny")
    q = quantized.quantize(p, prefix=("moe_layers", "moe"))
    assert quant.is_fp8(q.wi_0) and quant.is_fp8(q.shared.wo) and not quant.is_fp8(q.router.w)
    deq = quant.dequantize(q, jnp.float32, None)[0]
    x = jax.random.normal(jax.random.key(2), (3, 1, c.base_emb_dim), jnp.float32)
    want, *_ = jax.jit(lambda p, x: moe_layer.apply(p, x, c, jnp.float32))(deq, x)
    got = jax.jit(lambda p, x: decode_moe.apply(p, x, c, jnp.float32)[0])(joint.unstack(q), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(jnp.float32))


def test_one_device_decoding_holds_experts_unstacked():
    from expertax.decoding import prepare

    c = load_config(
        overrides=dict(model_name="deepseek3-tiny", dtype="float32", weight_dtype="float32")
    )
    one = prepare(init_params(c), c, devices=jax.devices()[:1])
    assert all(decode_moe.is_unstacked(b.moe) for b in one.moe_layers)
    two = prepare(init_params(c), c, devices=jax.devices()[:2])
    assert not any(decode_moe.is_unstacked(b.moe) for b in two.moe_layers)
