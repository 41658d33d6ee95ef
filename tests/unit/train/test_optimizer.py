"""Weight decay is declared per parameter: matrices and embeddings decay, norms and biases never."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol

from expertax.models import decoder
from expertax.nn import norm, param
from expertax.nn.moe import router
from expertax.preflight import load_config
from expertax.train import optimizer

PRESETS = sorted(p.stem for p in (Path(__file__).parents[3] / "configs" / "models").glob("*.yml"))
NO_DECAY_NAMES = {"attn_norm", "ffn_norm", "final_norm", "q_norm", "k_norm", "kv_norm", "bias"}
NO_DECAY_NAMES |= {"bq", "bk", "bv", "bo", "sinks"}  # GQA's biases and sinks (glm4.5: q/k/v)
NO_DECAY_NAMES |= {"bi_0", "bi_1", "logit_bias"}  # GPT-OSS: expert biases, trained router bias
DECAY_NAMES = {"embed", "lm_head", "w", "wq", "wq_a", "wq_b", "wk", "wv", "wkv_a", "wkv_b"}
DECAY_NAMES |= {"wo", "wi_0", "wi_1"}


def leaf_name(path) -> str:
    return path[-1].name


def test_presets_found():
    assert {"deepseek3-tiny", "mixtral-tiny", "llama-tiny", "deepseek3-671b"} <= set(PRESETS)


@pytest.mark.parametrize("model", PRESETS)
def test_decay_mask_follows_the_parameter_names(model):
    spec = decoder.spec(load_config(overrides={"model_name": model}))
    mask = param.weight_decay_mask(spec)
    flat = jax.tree_util.tree_flatten_with_path(mask)[0]
    specs = jax.tree.leaves(spec, is_leaf=param.is_spec)
    names = {leaf_name(path) for path, _ in flat}
    assert names <= NO_DECAY_NAMES | DECAY_NAMES, names - NO_DECAY_NAMES - DECAY_NAMES
    for (path, decays), s in zip(flat, specs, strict=True):
        name = jax.tree_util.keystr(path)
        assert decays == (leaf_name(path) in DECAY_NAMES), name
        if not decays:  # norm scales and biases: ones/zeros, never decayed
            assert s.init in ("ones", "zeros"), name
    # The old shape rule (ndim >= 2) decayed the stacked per-layer norms [L, D]: they exist here.
    stacked_norms = [
        s
        for (path, _), s in zip(flat, specs, strict=True)
        if leaf_name(path) in NO_DECAY_NAMES and len(s.shape) >= 2
    ]
    assert stacked_norms, "no stacked norm: the ndim rule would not be distinguished"
    assert any(flag for _, flag in flat) and not all(flag for _, flag in flat)


def test_router_bias_is_neither_trained_nor_decayed():
    c = load_config(overrides={"model_name": "deepseek3-tiny"})
    bias = router.spec(c).bias
    assert bias is not None and not bias.trainable and not bias.weight_decay


def test_a_step_decays_matrices_but_not_norm_scales():
    """Two AdamW steps with zero gradients (step 0 has learning rate 0 under warmup)."""
    c = load_config(
        overrides={
            "model_name": "llama-tiny",
            "learning_rate": 0.1,
            "adam_weight_decay": 0.5,
            "steps": 10,
        }
    )
    tree = {
        "layers": param.stack(
            {"scale": norm.spec(4), "w": param.projection((4, 4), ("embed", "mlp"), 4)}, 3
        ),
        "final_norm": norm.spec(4),
        "frozen_bias": param.ParamSpec((4,), (None,), "zeros", trainable=False, weight_decay=False),
    }
    params = jax.tree.map(lambda a: a + 1.0, param.initialize(tree, jax.random.key(0), jnp.float32))
    tx = optimizer.make(c, tree)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    new = params
    for _ in range(2):
        updates, state = tx.update(zeros, state, new)
        new = jax.tree.map(lambda p, u: p + u, new, updates)
    np.testing.assert_array_equal(new["layers"]["scale"], params["layers"]["scale"])  # [L, D]
    np.testing.assert_array_equal(new["final_norm"], params["final_norm"])
    np.testing.assert_array_equal(new["frozen_bias"], params["frozen_bias"])
    # Negative control: the matrices moved, by lr * wd * p (decoupled decay, zero gradient).
    lr = float(optimizer.schedule(c)(1))
    assert lr > 0
    expected = params["layers"]["w"] * (1 - lr * 0.5)
    np.testing.assert_allclose(new["layers"]["w"], expected, **tol())
    assert not np.allclose(new["layers"]["w"], params["layers"]["w"], **tol())


def test_second_moment_stored_in_bfloat16_follows_the_float32_update():
    """nu_dtype=bfloat16 (DeepSeek-V3's recipe with mu_dtype=bfloat16): moments stored in
    bfloat16, parameters still float32, and the update close to the all-float32 one."""
    base = dict(model_name="llama-tiny", steps=10, learning_rate=1e-2)
    exact = load_config(overrides=base)
    lowp = load_config(overrides={**base, "mu_dtype": "bfloat16", "nu_dtype": "bfloat16"})
    spec = decoder.spec(exact)
    params = param.initialize(spec, jax.random.key(0), jnp.float32)
    grads = jax.tree.map(
        lambda p: jnp.cos(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape), params
    )
    results = {}
    for name, c in (("exact", exact), ("lowp", lowp)):
        tx = optimizer.make(c, spec)
        state = tx.init(params)
        p = params
        for _ in range(3):
            updates, state = tx.update(grads, state, p)
            p = jax.tree.map(lambda a, u: a + u, p, updates)
        results[name] = (p, state)
    moments = lambda st: [x for x in jax.tree.leaves(st) if x.ndim > 0]
    assert {x.dtype for x in moments(results["lowp"][1])} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in moments(results["exact"][1])} == {jnp.dtype(jnp.float32)}
    for a, b in zip(jax.tree.leaves(results["exact"][0]), jax.tree.leaves(results["lowp"][0])):
        assert b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), **tol(jnp.bfloat16))
    # Negative control: the bfloat16 moments really are rounded (not float32 in disguise).
    diffs = [
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(results["exact"][0]), jax.tree.leaves(results["lowp"][0]))
    ]
    assert max(diffs) > 0


@pytest.mark.parametrize("steps", [1, 2, 9, 40])
def test_schedule_is_valid_for_short_runs(steps):
    """`steps=1` used to raise inside optax (a cosine decay of zero steps); every run length
    gets a warmup of at least one step and a decay that ends at the final fraction."""
    from expertax.train import optimizer

    c = load_config(overrides={"model_name": "llama-tiny", "steps": steps})
    lr = optimizer.schedule(c)
    assert float(lr(0)) == 0.0
    assert float(lr(10_000)) == pytest.approx(
        c.learning_rate * c.cosine_learning_rate_final_fraction
    )


def _small_tree():
    return {
        "layers": param.stack(
            {"scale": norm.spec(4), "w": param.projection((4, 8), ("embed", "mlp"), 4)}, 3
        ),
        "embed": param.projection((16, 4), ("vocab", "embed"), 4),
        "frozen_bias": param.ParamSpec((4,), (None,), "zeros", trainable=False, weight_decay=False),
    }


def _five_steps(c, tree, params):
    """(fused, optax) (params, opt_state) after five steps whose gradients grow (so that the
    clip scale differs between steps), the third one non-finite."""
    tx = optimizer.make(c, tree)
    ref = got = (params, tx.init(params))
    for i in range(5):
        key = jax.random.key(i)
        grads = jax.tree.map(lambda p, k=key, s=i + 1.0: s * jax.random.normal(k, p.shape), params)
        finite = jnp.bool_(i != 2)
        ref = optimizer.optax_update(tx, grads, ref[1], ref[0], finite)
        got = optimizer.apply(c, tx, tree, grads, got[1], got[0], finite)
    return got, ref


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6], ids=["no-clip", "clipped", "under-threshold"])
def test_fused_update_equals_the_optax_chain(clip, moments):
    """`optimizer.apply` (three passes per leaf) = optax's update + apply_updates + the
    non-finite guard: parameters, both moments and both step counts, over five steps with
    weight decay, a frozen leaf and a skipped (non-finite) step in the middle. bfloat16
    moments take optax's own path inside `apply`: the guard and the state layout still hold."""
    base = dict(model_name="llama-tiny", learning_rate=0.05, adam_weight_decay=0.3, steps=10)
    base |= dict(mu_dtype=moments, nu_dtype=moments)
    c = load_config(overrides={**base, "gradient_clipping_threshold": clip})
    tree = _small_tree()
    params = param.initialize(tree, jax.random.key(0), jnp.float32)
    got, ref = _five_steps(c, tree, params)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[0]["frozen_bias"], params["frozen_bias"])
    # Negative controls: the parameters moved, and the clip really acted.
    assert not np.allclose(got[0]["layers"]["w"], params["layers"]["w"], **tol())
    if clip == 0.5:
        no_clip = load_config(overrides={**base, "gradient_clipping_threshold": 0.0})
        unclipped, _ = _five_steps(no_clip, tree, params)
        assert not np.allclose(unclipped[0]["embed"], got[0]["embed"], rtol=1e-6, atol=1e-7)


def test_fused_update_leaves_a_non_finite_step_bitwise_unchanged():
    c = load_config(overrides={"model_name": "llama-tiny", "learning_rate": 0.05, "steps": 10})
    tree = _small_tree()
    params = param.initialize(tree, jax.random.key(0), jnp.float32)
    tx = optimizer.make(c, tree)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    kept = optimizer.apply(c, tx, tree, grads, state, params, jnp.bool_(False))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves((params, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Negative control: the same NaN gradients, let through, poison the parameters.
    let_through = optimizer.apply(c, tx, tree, grads, state, params, jnp.bool_(True))
    assert np.isnan(np.asarray(let_through[0]["layers"]["w"])).all()
