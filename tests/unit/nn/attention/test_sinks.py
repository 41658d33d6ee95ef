"""Learned attention sinks (one logit per query head, GPT-OSS): `dot` against a loop over
queries in NumPy with the sink as one more softmax column; `blockwise` and `splash` (Pallas'
interpreter) against `dot`, values and gradients (the sinks' own included), with packed
documents, GQA and a sliding window; cuDNN refused with the reason."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.attention import blockwise, kernel, splash
from expertax.nn.attention.mask import CAUSAL, MaskSpec
from tests.tolerances import tol

B, T, H, G, Q, DV = 2, 40, 4, 2, 8, 6


def _inputs(t=T, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, t, H, Q))
    k = jax.random.normal(ks[1], (B, t, G, Q))
    v = jax.random.normal(ks[2], (B, t, G, DV))
    ct = jax.random.normal(ks[3], (B, t, H, DV))
    sinks = jnp.array([2.0, -1.0, 0.5, 4.0])  # from nearly ignored to taking most weight
    seg = np.zeros((B, t), np.int32)
    seg[0, t // 3 :] = 1  # two documents in the first sequence
    pos = np.stack([np.r_[np.arange(t // 3), np.arange(t - t // 3)], np.arange(t)])
    return q, k, v, ct, sinks, jnp.asarray(seg), jnp.asarray(pos)


def _loop(q, k, v, sinks, seg, pos, scale, window=None):
    """Each query row by hand: its readable keys' logits and the head's sink, softmax, the
    values' weighted sum (the sink has no value)."""
    q, k, v, sinks, seg, pos = (np.asarray(x, np.float64) for x in (q, k, v, sinks, seg, pos))
    out = np.zeros((B, q.shape[1], H, DV))
    for b in range(B):
        for t in range(q.shape[1]):
            keys = [
                s
                for s in range(k.shape[1])
                if seg[b, s] == seg[b, t]
                and pos[b, s] <= pos[b, t]
                and (window is None or pos[b, t] - pos[b, s] < window)
            ]
            for h in range(H):
                g = h // (H // G)
                logits = np.array([q[b, t, h] @ k[b, s, g] * scale for s in keys] + [sinks[h]])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[b, t, h] = p[:-1] @ v[b, keys, g]
    return out


@pytest.mark.parametrize("window", [None, 7])
def test_dot_equals_a_loop_over_queries(window):
    q, k, v, _, sinks, seg, pos = _inputs()
    got = kernel.attend_dot(
        q, k, v, scale=0.3, segment_ids_BT=seg, q_positions_BT=pos, kv_positions_BS=pos,
        mask_spec=MaskSpec(window=window), sink_logits_H=sinks,
    )  # fmt: skip
    want = _loop(q, k, v, sinks, seg, pos, 0.3, window)
    np.testing.assert_allclose(got, want, **tol(jnp.float32))
    # negative control: without the sinks every row's weights sum to 1, and the output moves
    plain = kernel.attend_dot(
        q, k, v, scale=0.3, segment_ids_BT=seg, q_positions_BT=pos, kv_positions_BS=pos,
        mask_spec=MaskSpec(window=window),
    )  # fmt: skip
    assert not np.allclose(plain, want, **tol(jnp.float32))


def _out_and_grads(impl, q, k, v, ct, sinks, seg, pos, spec=CAUSAL):
    def f(q, k, v, sinks):
        return kernel.attend(
            q, k, v, scale=0.3, impl=impl, segment_ids_BT=seg, q_positions_BT=pos,
            kv_positions_BS=pos, mask_spec=spec, sink_logits_H=sinks,
        )  # fmt: skip

    out, vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
    return (out, *vjp(ct))


NAMES = ("out", "dq", "dk", "dv", "d_sinks")


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec(window=9)], ids=str)
def test_blockwise_equals_dot(spec, monkeypatch):
    """Blocks of 8 over 40 positions: several key blocks per row, so the sink's place in the
    running max and sum matters."""
    args = _inputs()
    want = _out_and_grads("dot", *args, spec=spec)
    real = blockwise.attend_blockwise
    monkeypatch.setattr(
        kernel, "attend_blockwise", lambda *a, **kw: real(*a, **kw, block_q=8, block_k=8)
    )
    got = _out_and_grads("blockwise", *args, spec=spec)
    for name, w, x in zip(NAMES, want, got, strict=True):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)
    assert float(jnp.max(jnp.abs(want[4]))) > 1e-3  # the sinks' gradient is not trivially 0


def test_splash_equals_dot(monkeypatch):
    """Two tiles of 128 rows in Pallas' interpreter; the kernel's own sinks."""
    monkeypatch.setattr(splash, "MAX_BLOCK", 128)
    args = _inputs(t=256)
    q, k, v, ct, sinks, seg, pos = args
    # splash builds the mask by row: each document's positions count up from its first row
    want = _out_and_grads("dot", *args)

    def f(q, k, v, sinks):
        return splash.attend_splash(
            q, k, v, scale=0.3, segment_ids_BT=seg, sink_logits_H=sinks, interpret=True
        )

    out, vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
    for name, w, x in zip(NAMES, want, (out, *vjp(ct)), strict=True):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)


def test_cudnn_refuses_sinks_and_auto_avoids_it():
    kw = dict(length=64, qk_dim=64, v_dim=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="no learned attention sinks"):
        kernel.resolve("cudnn", sinks=True, **kw)
    assert kernel.resolve("auto", on="gpu", sinks=True, **kw) != "cudnn"


def test_layer_sinks_are_read_and_learned():
    """mixtral-tiny with `attention_sinks`: the sinks are per-layer [H] parameters; the loss has
    a gradient for them; sinks of -1e9 give the model without sinks, random ones differ (they
    are read at all). Decoding with them: test_gqa_biases.py (sinks and biases together)."""
    from expertax import init_params, load_config, logits
    from expertax.nn import param
    from tests.unit.nn.attention.test_gqa_biases import OVER, _with_attn

    c = load_config(overrides={**OVER, "attention_sinks": True})
    params = init_params(c)
    shape = params.moe_layers.attn.sinks.shape
    assert shape == (c.num_moe_layers, c.base_num_query_heads)
    params = _with_attn(params, sinks=2.0 * jax.random.normal(jax.random.key(5), shape))
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
    grad = jax.grad(lambda p: jnp.sum(logits(p, tokens, c)[0, -1] ** 2))(params)
    assert float(jnp.max(jnp.abs(grad.moe_layers.attn.sinks))) > 1e-6

    plain_c = load_config(overrides=OVER)
    far = _with_attn(params, sinks=jnp.full(shape, -1e9))
    plain = _with_attn(params, sinks=param.ABSENT)
    np.testing.assert_allclose(
        logits(far, tokens, c), logits(plain, tokens, plain_c), **tol(jnp.float32)
    )
    assert not np.allclose(logits(params, tokens, c), logits(plain, tokens, plain_c))
