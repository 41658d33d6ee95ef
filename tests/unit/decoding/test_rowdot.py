"""Our CPU kernel for decode-step products (decoding/rowdot.cc, rowdot.py) against oracles:
float64 numpy products, XLA's products, training's MoE layer; and where decoding uses it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config
from expertax.decoding import joint, rowdot
from expertax.nn import linear
from expertax.nn.moe import layer as moe_layer
from expertax.nn.moe import unstacked as decode_moe
from tests.tolerances import tol

pytestmark = pytest.mark.skipif(not rowdot.available(), reason=f"{rowdot.reason()}")


# (rows, matrices per operand, operands, K, N): one row to 40 (blocks of 8 and a remainder), K
# not a multiple of 4, N not of 16, tiny and large enough to be cut by rows or by columns.
@pytest.mark.parametrize(
    "r, g, ops, k, n",
    [
        (1, 1, 1, 1024, 512),
        (3, 1, 1, 1023, 517),
        (8, 1, 1, 2048, 1024),
        (16, 1, 1, 512, 672),
        (5, 4, 1, 257, 33),
        (40, 6, 2, 384, 256),
        (12, 16, 1, 64, 256),
        (1, 1, 1, 7, 5),
        (2, 1, 1, 256, 9000),
    ],  # fmt: skip
)
def test_rows_equal_float64_products(r, g, ops, k, n):
    rng = np.random.default_rng(r * 1000 + k)
    x = (rng.standard_normal((r, k)) / np.sqrt(k)).astype(np.float32)  # outputs of order 1
    ws = [rng.standard_normal((g, k, n), np.float32) for _ in range(ops)]
    ids = rng.integers(0, g * ops, r).astype(np.int32)
    got = jax.jit(lambda x, ws, i: rowdot.rows(x, [w if g > 1 else w[0] for w in ws], i))(
        x, ws, ids
    )
    every = np.concatenate(ws).astype(np.float64)
    want = np.einsum("rk,rkn->rn", x.astype(np.float64), every[ids])
    np.testing.assert_allclose(np.asarray(got), want, **tol(jnp.float32))


def test_project_and_per_head_follow_the_switch():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 64), np.float32) / 16)
    w = jnp.asarray(rng.standard_normal((4, 64, 96), np.float32))
    lowered = []
    for on in (True, False):
        with rowdot.use(on):
            f = jax.jit(lambda x, w: (linear.project(x, w, 2), linear.per_head(x, w)))
            lowered.append(f.lower(x, w).as_text())
            y, per = f(x, w)
        np.testing.assert_allclose(
            np.asarray(y), np.einsum("bthi,hio->bto", x, w), **tol(jnp.float32)
        )
        want = np.einsum("bthi,hio->btho", np.asarray(x), np.asarray(w))
        np.testing.assert_allclose(np.asarray(per), want, **tol(jnp.float32))
    assert rowdot.TARGET in lowered[0] and rowdot.TARGET not in lowered[1]
    with rowdot.use(True):  # bfloat16, and more rows than MAX_ROWS: XLA's products
        xb = jnp.ones((rowdot.MAX_ROWS + 1, 64), jnp.float32)
        assert rowdot.TARGET not in jax.jit(linear.project).lower(xb, w[0]).as_text()
        bf = jnp.ones((2, 64), jnp.bfloat16)
        assert (
            rowdot.TARGET not in jax.jit(linear.project).lower(bf, w[0].astype(bf.dtype)).as_text()
        )


@pytest.mark.parametrize("model_name", ["deepseek3-tiny", "mixtral-tiny"])
@pytest.mark.parametrize("tokens", [(1, 1), (3, 1), (2, 2)])
def test_kernel_moe_layer_equals_training_layer(model_name, tokens, monkeypatch):
    c = load_config(overrides=dict(model_name=model_name, dtype="float32", weight_dtype="float32"))
    p = jax.tree.map(lambda a: a[0], init_params(c).moe_layers.moe)
    if p.router.bias is not None:
        bias = jax.random.normal(jax.random.key(3), p.router.bias.shape) * 0.1
        p = dataclasses.replace(p, router=dataclasses.replace(p.router, bias=bias))
    ran = []
    real = decode_moe._by_kernel
    monkeypatch.setattr(decode_moe, "_by_kernel", lambda *a: (ran.append(a[6]), real(*a))[1])
    x = jax.random.normal(jax.random.key(1), (*tokens, c.base_emb_dim), jnp.float32)
    want, *_ = jax.jit(lambda p, x: moe_layer.apply(p, x, c, jnp.float32))(p, x)
    unstacked = joint.unstack(p)
    if p.shared is not None:  # joined as decoding holds it on one device
        unstacked = dataclasses.replace(unstacked, shared=joint.mlp(unstacked.shared))
    with rowdot.use(True):
        got = jax.jit(lambda p, x: decode_moe.apply(p, x, c, jnp.float32)[0])(unstacked, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(jnp.float32))
    assert len(ran) == 1
    # deepseek3-tiny's one shared expert has a routed expert's shapes: it rides in the same calls
    assert (ran[0] is not None) == (c.shared_experts == 1 and p.shared is not None)


def test_wanted_only_for_one_cpu_device(monkeypatch):
    one = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    two = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    assert rowdot.wanted(one) and not rowdot.wanted(two)
    monkeypatch.setenv(rowdot.SWITCH, "0")
    assert not rowdot.wanted(one)


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(RuntimeError, match="failed"):
        rowdot.library_path()
    assert not list((tmp_path / "expertax").glob("*.so"))  # no partial library left behind


def test_greedy_tokens_with_and_without_the_kernel(monkeypatch):
    from expertax.decoding import generate, prepare

    c = load_config(
        overrides=dict(model_name="deepseek3-tiny", dtype="float32", weight_dtype="float32")
    )
    dev = jax.devices()[:1]
    p = prepare(init_params(c), c, devices=dev)
    prompts = [[5, 7, 11], [3, 1, 4, 1, 5, 9]]
    on = generate(p, c, prompts, max_new_tokens=6, devices=dev)
    monkeypatch.setenv(rowdot.SWITCH, "0")
    off = generate(p, c, prompts, max_new_tokens=6, devices=dev)
    assert on.tokens == off.tokens
    np.testing.assert_allclose(on.logprobs, off.logprobs, **tol(jnp.float32))
