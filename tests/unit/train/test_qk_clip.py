"""QK-clip (`use_qk_clip`, MuonClip with Muon): the largest logits it measures, how they leave
the layers, and the clip that brings a head over the threshold back to it on the same batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol

from expertax.config import ConfigError
from expertax.data.synthetic import SyntheticData
from expertax.models import decoder
from expertax.nn import param
from expertax.nn.attention import qk_clip as measure
from expertax.nn.attention.mask import CAUSAL, allowed
from expertax.preflight import load_config
from expertax.train import qk_clip
from expertax.train import step as step_lib

MODEL = {
    "model_name": "deepseek3-tiny",
    "opt_type": "muon",
    "use_qk_clip": True,
    "max_target_length": 32,
    "per_device_batch_size": 2,
}


@pytest.mark.parametrize("block", [256, 8, 12])
def test_max_logits_are_the_largest_allowed_score(monkeypatch, block):
    """Per head, the largest `scale q . k` over causal, same-document pairs, whatever the query
    block (12 does not divide 30: the padded queries read nothing)."""
    monkeypatch.setattr(measure, "BLOCK", block)
    kq, kk = jax.random.split(jax.random.key(0))
    q = jax.random.normal(kq, (2, 30, 3, 8))
    k = jax.random.normal(kk, (2, 30, 3, 8))
    positions = jnp.tile(jnp.concatenate([jnp.arange(12), jnp.arange(18)]), (2, 1))
    segments = jnp.tile(jnp.concatenate([jnp.ones(12, int), 2 * jnp.ones(18, int)]), (2, 1))
    got = measure.max_logits(q, k, 0.5, positions, segments)
    scores = 0.5 * jnp.einsum("bthq,bshq->bhts", q, k)
    ok = allowed(CAUSAL, positions, positions, segments, segments)[:, None]
    want = jnp.max(jnp.where(ok, scores, -jnp.inf), axis=(0, 2, 3))
    np.testing.assert_allclose(got, want, **tol())
    # Negative control: without the document mask a query would read the other document.
    unmasked = jnp.max(jnp.where(jnp.tril(jnp.ones((30, 30), bool)), scores, -jnp.inf), (0, 2, 3))
    assert not np.allclose(want, unmasked)


def test_emit_carries_the_value_as_the_probes_gradient():
    out = jnp.arange(6.0).reshape(2, 3)
    value = jnp.array([3.0, -1.0])
    f = lambda o, p: jnp.sum(measure.emit(o, p, value) * 2.0)
    (g_out, g_probe) = jax.grad(f, argnums=(0, 1))(out, jnp.zeros(2))
    np.testing.assert_array_equal(g_out, 2.0 * jnp.ones_like(out))
    np.testing.assert_array_equal(g_probe, value)
    assert float(f(out, jnp.zeros(2))) == float(jnp.sum(out * 2.0))


def _maxima(c, params, batch):
    probes = qk_clip.merge(None, qk_clip.probes(c))
    grad = jax.jit(
        jax.grad(lambda p, pr: step_lib.loss_fn(p, batch, c, fp8_probes=pr)[0], argnums=1)
    )(params, probes)
    return qk_clip.split(grad, True)[1]


def test_clipped_heads_reach_the_threshold_on_the_same_batch():
    """deepseek3-tiny (MLA with a query low rank): the train step's probes give each layer's
    and head's largest logit; after the clip the first layer's heads that were over tau give
    tau on the same batch (their no-RoPE query and key parts scaled by sqrt(gamma), the RoPE
    query part by gamma), and the heads below it are unchanged. Metrics count the clipped
    heads of every layer."""
    c0 = load_config(overrides=MODEL)
    params = param.initialize(decoder.spec(c0), jax.random.key(3), jnp.float32)
    data = SyntheticData(
        vocab_size=c0.vocab_size, seq_len=c0.max_target_length, global_batch=2, seed=0
    )
    batch = {k: jnp.asarray(v) for k, v in data.batch_at(0).items()}
    before = _maxima(c0, params, batch)
    assert set(before) == {"dense", "moe"}
    assert before["moe"].shape == (c0.num_moe_layers, c0.base_num_query_heads)
    values = np.concatenate([np.ravel(v) for v in before.values()])
    tau = float(np.median(values))  # about half the heads over it
    c = load_config(overrides={**MODEL, "qk_clip_threshold": tau})
    clipped, metrics = qk_clip.clip(params, before, jnp.bool_(True), c)
    after = _maxima(c, clipped, batch)
    # The first layer sees the same input: its clipped heads give tau exactly (every score of
    # a head scales by gamma), the others what they gave. Later layers see what the clipped
    # first layer gives them (another input).
    b, a = np.asarray(before["dense"][0]), np.asarray(after["dense"][0])
    over = b > tau
    assert over.any() and (~over).any()
    np.testing.assert_allclose(a[over], tau, rtol=1e-5)
    np.testing.assert_allclose(a[~over], b[~over], rtol=1e-5)
    assert int(metrics["qk_clipped_heads"]) == int((values > tau).sum()) > 0
    np.testing.assert_allclose(float(metrics["qk_max_logit"]), values.max(), rtol=1e-6)
    # a non-finite step clips nothing
    kept, _ = qk_clip.clip(params, before, jnp.bool_(False), c)
    for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"model_name": "mixtral-tiny"}, "attention_type=gqa"),
        ({"ici_pipeline_parallelism": 2, "ici_fsdp_parallelism": 4}, "ici_pipeline_parallelism=2"),
        ({"ici_context_parallelism": 2}, "ici_context_parallelism=2"),
        ({"num_attention_token_chunks": 2}, "num_attention_token_chunks=2"),
    ],
)
def test_refused_where_the_maxima_would_add(overrides, named):
    with pytest.raises(ConfigError, match=f"use_qk_clip=true: {named}"):
        load_config(overrides={**MODEL, **overrides})
