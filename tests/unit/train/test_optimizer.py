"""Weight decay is declared per parameter: matrices and embeddings decay, norms and biases never."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol

from expertax.config import load_config
from expertax.models import decoder
from expertax.nn import norm, param
from expertax.nn.moe import router
from expertax.train import optimizer

PRESETS = sorted(p.stem for p in (Path(__file__).parents[3] / "configs" / "models").glob("*.yml"))
NO_DECAY_NAMES = {"attn_norm", "ffn_norm", "final_norm", "q_norm", "kv_norm", "bias"}
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
