"""num_vocab_tiling: the tiled cross-entropy equals the whole-logits one (value and gradients),
and the compiled step holds no whole-sequence [B, T, V] float32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.config import ConfigError
from expertax.models import init_params
from expertax.preflight import load_config
from expertax.train.step import loss_fn
from tests.tolerances import tol

# vocab_size differs from every other width of llama-tiny, so a [.., V] shape is a logits shape.
BASE = dict(
    model_name="llama-tiny", vocab_size=320, max_target_length=48, base_num_decoder_layers=2
)


def batch(c, seed=0):
    rng = np.random.default_rng(seed)
    b, t = 2, c.max_target_length
    weights = (rng.random((b, t)) > 0.2).astype(np.float32)
    return {
        "inputs": jnp.asarray(rng.integers(0, c.vocab_size, (b, t)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, c.vocab_size, (b, t)), jnp.int32),
        "weights": jnp.asarray(weights),
    }


def value_and_grads(c, params, data):
    (total, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, data, c)
    ce = parts.ce
    return ce, grads


@pytest.mark.parametrize("tiles", [2, 3, 6])
def test_tiled_loss_equals_whole_logits(tiles):
    whole = load_config(overrides=BASE)
    tiled = load_config(overrides={**BASE, "num_vocab_tiling": tiles})
    params, data = init_params(whole), batch(whole)
    ce0, g0 = value_and_grads(whole, params, data)
    ce1, g1 = value_and_grads(tiled, params, data)
    np.testing.assert_allclose(float(ce1), float(ce0), **tol())
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), **tol())
    # Negative control: other targets give another loss.
    other = dict(data, targets=(data["targets"] + 1) % whole.vocab_size)
    ce2, _ = value_and_grads(tiled, params, other)
    assert abs(float(ce2) - float(ce0)) > 1e-3


def f32_logit_shapes(c, params, data) -> set[str]:
    """The float32 shapes ending in V that the compiled value-and-grad produces."""
    text = jax.jit(lambda p, d: value_and_grads(c, p, d)).lower(params, data).compile().as_text()
    v = c.vocab_size
    return {s for s in _shapes(text) if s.startswith("f32[") and s.endswith(f",{v}]")}


def _shapes(text: str) -> set[str]:
    import re

    return set(re.findall(r"f32\[[0-9,]+\]", text))


def test_tiled_step_has_no_whole_sequence_logits():
    whole = load_config(overrides=BASE)
    tiled = load_config(overrides={**BASE, "num_vocab_tiling": 4})
    params, data = init_params(whole), batch(whole)
    b, t, v = 2, whole.max_target_length, whole.vocab_size
    assert f"f32[{b},{t},{v}]" in f32_logit_shapes(whole, params, data)  # control
    shapes = f32_logit_shapes(tiled, params, data)
    assert f"f32[{b},{t},{v}]" not in shapes
    assert f"f32[{b},{t // 4},{v}]" in shapes


def test_tiling_must_divide_the_sequence():
    with pytest.raises(
        ConfigError, match="num_vocab_tiling=5 does not divide max_target_length=48"
    ):
        load_config(overrides={**BASE, "num_vocab_tiling": 5})


def _plain_nll_sum(logits_BTV, targets_BT, weights_BT):
    """The cross-entropy as JAX derives it (the loss before the fused VJP)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(nll_BT * weights_BT)


def test_fused_nll_sum_equals_plain_jax_value_and_gradients():
    from expertax.nn.vocab_loss import nll_sum

    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, 12, 40)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 12)), jnp.int32)
    weights = jnp.asarray((rng.random((2, 12)) > 0.3).astype(np.float32))
    loss = lambda f: lambda lg, w: 0.7 * f(lg, targets, w)
    np.testing.assert_allclose(
        nll_sum(logits, targets, weights), _plain_nll_sum(logits, targets, weights), rtol=1e-6
    )
    g_new = jax.grad(loss(nll_sum), argnums=(0, 1))(logits, weights)
    g_ref = jax.grad(loss(_plain_nll_sum), argnums=(0, 1))(logits, weights)
    for a, b in zip(g_new, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # negative control: other targets give other gradients (the comparison can fail)
    g_other = jax.grad(lambda lg: nll_sum(lg, (targets + 1) % 40, weights))(logits)
    assert not np.allclose(g_other, g_ref[0] / 0.7, atol=1e-3)
