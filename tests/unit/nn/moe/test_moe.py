"""MoE layer: sparse = dense (dropless) = loop reference, outputs and gradients; routing rules."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn import param
from expertax.nn.moe import layer, router
from expertax.nn.moe.reference import moe_reference
from expertax.preflight import load_config
from tests.tolerances import tol

ROUTINGS = {
    "softmax": {"model_name": "mixtral-tiny"},
    "deepseek": {"model_name": "deepseek3-tiny"},
}


def setup(routing: str, **extra):
    return case({**ROUTINGS[routing], **extra})


def case(overrides: dict):
    """(config, layer parameters with a random routing bias where there is one, inputs)."""
    c = load_config(overrides=overrides)
    p = param.initialize(layer.spec(c), jax.random.key(1), jnp.float32)
    if p.router.bias is not None:  # exercise the selection-only bias
        bias = 0.05 * jax.random.normal(jax.random.key(2), p.router.bias.shape)
        p = dataclasses.replace(p, router=dataclasses.replace(p.router, bias=bias))
    x = jax.random.normal(jax.random.key(3), (2, 16, c.base_emb_dim), jnp.float32)
    return c, p, x


@jax.jit(static_argnums=(0, 3))
def run(c, p, x, path: str):
    if path == "reference":
        return moe_reference(p, x, c)
    cc = c.model_copy(update={"sparse_matmul": path == "sparse", "capacity_factor": -1.0})
    return layer.apply(p, x, cc, jnp.float32)[0]


@jax.jit(static_argnums=(0, 3))
def grads(c, p, x, path):
    ct = jax.random.normal(jax.random.key(4), x.shape)
    return jax.grad(lambda p, x: jnp.sum(run(c, p, x, path) * ct), argnums=(0, 1))(p, x)


def assert_trees_close(a, b, **kw):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


def assert_paths_agree(c, p, x):
    """The sparse and dense paths equal the loop reference, outputs and gradients; returns the
    reference's (output, gradients)."""
    ref = run(c, p, x, "reference")
    for path in ("sparse", "dense"):
        np.testing.assert_allclose(run(c, p, x, path), ref, **tol())
    g_ref = grads(c, p, x, "reference")
    for path in ("sparse", "dense"):
        assert_trees_close(grads(c, p, x, path), g_ref, **tol())
    return ref, g_ref


@pytest.mark.parametrize("routing", ROUTINGS)
def test_sparse_dense_reference_agree_forward_and_backward(routing):
    c, p, x = setup(routing)
    assert_paths_agree(c, p, x)


def test_perturbed_expert_weight_fails_the_comparison():
    c, p, x = setup("softmax")
    routing = router.route(p.router, x.reshape(-1, c.base_emb_dim), c)
    used = int(np.bincount(np.asarray(routing.experts_NK).ravel()).argmax())
    bad = dataclasses.replace(p, wi_0=p.wi_0.at[used].add(1e-3))
    diff = np.max(np.abs(run(c, bad, x, "sparse") - run(c, p, x, "reference")))
    assert diff > 10 * tol()["atol"]


@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_expert_without_rows_gets_exactly_zero_gradient(path):
    c, p, x = setup("deepseek", n_routing_groups=-1, topk_routing_group=-1)
    silent = 3
    bias = p.router.bias.at[silent].set(-100.0)  # never selected, by selection alone
    p = dataclasses.replace(p, router=dataclasses.replace(p.router, bias=bias))
    routing = router.route(p.router, x.reshape(-1, c.base_emb_dim), c)
    assert not np.any(np.asarray(routing.experts_NK) == silent)
    g, _ = grads(c, p, x, path)
    for name in ("wi_0", "wi_1", "wo"):
        arr = np.asarray(getattr(g, name))
        assert np.all(arr[silent] == 0.0)
        assert np.any(arr[(silent + 1) % c.num_experts] != 0.0)


def test_capacity_drops_are_counted():
    c, p, x = setup("softmax", sparse_matmul=False, capacity_factor=0.5)
    _, stats, _ = layer.apply(p, x, c, jnp.float32)
    b, t, _ = x.shape
    routing = router.route(p.router, x.reshape(b * t, -1), c)
    counts = np.zeros((b, c.num_experts), int)
    for bi, row in enumerate(np.asarray(routing.experts_NK).reshape(b, -1)):
        counts[bi] = np.bincount(row, minlength=c.num_experts)
    cap = int(np.ceil(t * c.num_experts_per_tok / c.num_experts * 0.5))
    expected = np.maximum(counts - cap, 0).sum()
    assert expected > 0 and float(stats.dropped) == expected
    c2 = c.model_copy(update={"capacity_factor": -1.0})
    assert float(layer.apply(p, x, c2, jnp.float32)[1].dropped) == 0


def test_group_limited_routing_stays_in_the_kept_groups():
    c, p, x = setup("deepseek")
    routing = router.route(p.router, x.reshape(-1, c.base_emb_dim), c)
    per_group = c.num_experts // c.n_routing_groups
    groups = np.asarray(routing.experts_NK) // per_group
    assert max(len(set(row)) for row in groups) <= c.topk_routing_group
    # and the limit binds: without groups some token would pick from more groups
    free = c.model_copy(update={"n_routing_groups": -1, "topk_routing_group": -1})
    free_groups = (
        np.asarray(router.route(p.router, x.reshape(-1, c.base_emb_dim), free).experts_NK)
        // per_group
    )
    assert max(len(set(row)) for row in free_groups) > c.topk_routing_group


def test_bias_changes_selection_but_not_weights():
    c, p, x = setup("deepseek", n_routing_groups=-1, topk_routing_group=-1)
    x_ND = x.reshape(-1, c.base_emb_dim)
    favoured = 5
    biased = dataclasses.replace(p.router, bias=jnp.zeros(c.num_experts).at[favoured].set(10.0))
    r = router.route(biased, x_ND, c)
    assert np.all(np.any(np.asarray(r.experts_NK) == favoured, axis=1))
    scores = jax.nn.sigmoid(x_ND @ p.router.w)
    w = np.take_along_axis(np.asarray(scores), np.asarray(r.experts_NK), 1)
    w = w / w.sum(1, keepdims=True) * c.routed_scaling_factor
    np.testing.assert_allclose(r.weights_NK, w, **tol())


def test_bias_update_moves_towards_balance():
    load = jnp.array([[10.0, 0.0, 5.0, 5.0]])
    new = router.updated_bias(jnp.zeros((1, 4)), load, 0.1)
    np.testing.assert_allclose(new, [[-0.1, 0.1, 0.0, 0.0]])


def test_load_balance_loss_is_one_when_balanced_and_larger_when_skewed():
    c = load_config(overrides={"model_name": "mixtral-tiny"})
    e, k, n = c.num_experts, c.num_experts_per_tok, 64
    even = router.balance_stats(jnp.full(e, n * k / e), jnp.full(e, n / e), n, c, 0)
    np.testing.assert_allclose(even.lb_loss, 1.0, rtol=1e-6)
    skew_counts = jnp.zeros(e).at[0].set(n).at[1].set(n)
    skew = router.balance_stats(skew_counts, jnp.zeros(e).at[0].set(n), n, c, 0)
    assert float(skew.lb_loss) > 1.5


GPT_OSS = {"model_name": "mixtral-tiny", "router_logit_bias": True, "moe_expert_bias": True,
           "mlp_activation": "swiglu_clamped", "mlp_activation_limit": 1.0}  # fmt: skip


def with_random_biases(p, scale=0.3):
    """GPT-OSS's router logit bias and expert biases, random (they start at zero)."""
    keys = iter(jax.random.split(jax.random.key(5), 4))
    rnd = {f: scale * jax.random.normal(next(keys), getattr(p, f).shape) for f in ("bi_0", "bi_1")}
    rnd["bo"] = scale * jax.random.normal(next(keys), p.bo.shape)
    logit_bias = jax.random.normal(next(keys), p.router.logit_bias.shape)
    routed = dataclasses.replace(p.router, logit_bias=logit_bias)
    return dataclasses.replace(p, router=routed, **rnd)


def test_expert_and_router_biases_on_every_path_and_read():
    c, p, x = setup("softmax", **{k: v for k, v in GPT_OSS.items() if k != "model_name"})
    e, d, f = c.num_experts, c.base_emb_dim, c.base_moe_mlp_dim
    assert (p.bi_0.shape, p.bi_1.shape, p.bo.shape) == ((e, f), (e, f), (e, d))
    p = with_random_biases(p)
    ref, g_ref = assert_paths_agree(c, p, x)
    assert all(float(jnp.max(jnp.abs(getattr(g_ref[0], f)))) > 1e-6 for f in ("bi_0", "bi_1", "bo"))
    assert float(jnp.max(jnp.abs(g_ref[0].router.logit_bias))) > 1e-6
    # controls: each bias is read (zeroing any one of them changes the output)
    zero_router = dataclasses.replace(p.router, logit_bias=jnp.zeros_like(p.router.logit_bias))
    for changed in [{"router": zero_router}, *({f: jnp.zeros_like(getattr(p, f))} for f in
                                               ("bi_0", "bi_1", "bo"))]:  # fmt: skip
        out = run(c, dataclasses.replace(p, **changed), x, "sparse")
        assert not np.allclose(out, ref, atol=1e-4), changed.keys()
