"""The mask spec and the mask built from positions (nn/attention/mask.py), and the `dot` kernel
under every kind against a loop over queries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.attention import blockwise, kernel, mask
from expertax.nn.attention.mask import MaskSpec
from tests.tolerances import tol


def _by_hand(spec: MaskSpec, q_pos, kv_pos, q_seg=None, kv_seg=None) -> np.ndarray:
    out = np.zeros((len(q_pos), len(kv_pos)), bool)
    for i, qp in enumerate(q_pos):
        for j, kp in enumerate(kv_pos):
            ok = kp <= qp if spec.causal else True
            near = True
            if spec.window is not None:
                near = qp - kp < spec.window
            if spec.chunk is not None:
                near = near and qp // spec.chunk == kp // spec.chunk
            if spec.window is not None or spec.chunk is not None:
                near = near or kp < spec.sinks
            same = q_seg is None or q_seg[i] == kv_seg[j]
            out[i, j] = ok and near and same
    return out


SPECS = [
    MaskSpec(),
    MaskSpec(causal=False),
    MaskSpec(window=3),
    MaskSpec(chunk=4),
    MaskSpec(window=3, sinks=2),
    MaskSpec(chunk=4, sinks=1),
    MaskSpec(window=5, chunk=4),
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_allowed_is_the_rule_by_hand(spec):
    q_pos = np.array([3, 4, 5, 9, 10])  # a chunk of queries (a cache step, a sequence shard)
    kv_pos = np.arange(11)
    got = mask.allowed(spec, jnp.asarray(q_pos)[None], jnp.asarray(kv_pos)[None])
    np.testing.assert_array_equal(np.asarray(got[0]), _by_hand(spec, q_pos, kv_pos))


def test_segments_separate_packed_documents():
    pos = np.array([0, 1, 2, 0, 1, 0])  # three documents, positions from each one's start
    seg = np.array([1, 1, 1, 2, 2, 3])
    got = mask.allowed(mask.CAUSAL, pos[None], pos[None], seg[None], seg[None])
    np.testing.assert_array_equal(np.asarray(got[0]), _by_hand(mask.CAUSAL, pos, pos, seg, seg))
    # the same as causality by index within each document
    idx = np.arange(6)
    by_index = (idx[None, :] <= idx[:, None]) & (seg[:, None] == seg[None, :])
    np.testing.assert_array_equal(np.asarray(got[0]), by_index)


def _loop_attention(q, k, v, allowed, scale):
    """Each query's softmax over the keys it reads, one query at a time (float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, h, _ = q.shape
    g = k.shape[2]
    out = np.zeros((b, t, h, v.shape[-1]))
    for bi in range(b):
        for ti in range(t):
            keys = np.nonzero(allowed[bi, ti])[0]
            for hi in range(h):
                gi = hi // (h // g)
                s = q[bi, ti, hi] @ k[bi, keys, gi].T * scale
                p = np.exp(s - s.max())
                out[bi, ti, hi] = (p / p.sum()) @ v[bi, keys, gi]
    return out


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_dot_kernel_under_every_kind_equals_a_loop_over_queries(spec):
    b, t, s, h, g, dq, dv = 2, 5, 9, 4, 2, 8, 6
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, h, dq))
    k = jax.random.normal(ks[1], (b, s, g, dq))
    v = jax.random.normal(ks[2], (b, s, g, dv))
    q_pos = jnp.array([[4, 5, 6, 7, 8], [2, 3, 4, 5, 6]])  # each row its own offset (a cache)
    kv_pos = jnp.arange(s)[None]
    out = kernel.attend(
        q, k, v, scale=0.3, impl="dot", q_positions_BT=q_pos, kv_positions_BS=kv_pos,
        mask_spec=spec,
    )  # fmt: skip
    allowed = np.asarray(mask.allowed(spec, q_pos, kv_pos))
    np.testing.assert_allclose(out, _loop_attention(q, k, v, allowed, 0.3), **tol("float32"))


def test_positions_default_to_where_the_rows_sit():
    """Without positions, the queries are the last T of the S keys: the same output as the
    positions said outright."""
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (1, 4, 2, 8))
    k = jax.random.normal(ks[1], (1, 6, 2, 8))
    v = jax.random.normal(ks[2], (1, 6, 2, 8))
    implicit = kernel.attend_dot(q, k, v, scale=0.5)
    explicit = kernel.attend_dot(
        q, k, v, scale=0.5, q_positions_BT=jnp.arange(2, 6)[None],
        kv_positions_BS=jnp.arange(6)[None],
    )  # fmt: skip
    np.testing.assert_array_equal(implicit, explicit)


CAUSAL_SPECS = [spec for spec in SPECS if spec.causal]


@pytest.mark.parametrize("spec", CAUSAL_SPECS, ids=str)
@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_builds_every_causal_kind_from_positions(spec, packed, monkeypatch):
    """`blockwise` (blocks of 8 rows over 21 positions: padded blocks, skipped block pairs)
    equals `dot` under every causal kind, values and gradients, with packed documents whose
    positions restart at each document."""
    b, t, h, g, dq, dv = 2, 21, 4, 2, 8, 6
    ks = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(ks[0], (b, t, h, dq))
    k = jax.random.normal(ks[1], (b, t, g, dq))
    v = jax.random.normal(ks[2], (b, t, g, dv))
    ct = jax.random.normal(ks[3], (b, t, h, dv))
    if packed:
        seg = np.array([[1] * 9 + [2] * 7 + [3] * 5, [1] * 16 + [0] * 5])  # 0: padding tokens
        pos = np.concatenate([np.arange(9), np.arange(7), np.arange(5)])
        pos = np.stack([pos, np.concatenate([np.arange(16), np.zeros(5, int)])])
        seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    else:
        seg, pos = None, jnp.arange(t)[None]

    def run(impl):
        def f(q, k, v):
            out = kernel.attend(
                q, k, v, scale=0.3, impl=impl, segment_ids_BT=seg, q_positions_BT=pos,
                kv_positions_BS=pos, mask_spec=spec,
            )  # fmt: skip
            return jnp.sum(out * ct), out

        return jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    grads_dot, out_dot = run("dot")
    real = blockwise.attend_blockwise
    monkeypatch.setattr(
        kernel, "attend_blockwise", lambda *a, **kw: real(*a, **kw, block_q=8, block_k=8)
    )
    grads_bw, out_bw = run("blockwise")
    np.testing.assert_allclose(out_bw, out_dot, **tol("float32"))
    for got, want in zip(grads_bw, grads_dot, strict=True):
        np.testing.assert_allclose(got, want, **tol("float32"))
    # negative control: a plain causal mask differs wherever the spec narrows it
    if not spec.plain_causal:
        plain_out = kernel.attend(
            q, k, v, scale=0.3, impl="dot", segment_ids_BT=seg, q_positions_BT=pos,
            kv_positions_BS=pos,
        )  # fmt: skip
        assert not np.allclose(plain_out, out_bw, **tol("float32"))


@pytest.mark.parametrize("impl", ["splash", "cudnn"])
@pytest.mark.parametrize("spec", [MaskSpec(chunk=8), MaskSpec(window=8, sinks=2)], ids=str)
def test_library_kernels_refuse_a_spec_they_cannot_build(impl, spec):
    """Chunks and sinks are not row rules: splash and cuDNN refuse them; a window they take."""
    kw = dict(length=64, qk_dim=8, v_dim=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match=f"attention_impl={impl} builds its mask by row"):
        kernel.resolve(impl, mask_spec=spec, **kw)
    assert kernel.resolve(impl, mask_spec=MaskSpec(window=8), **kw) == impl
    assert kernel.resolve(impl, **kw) == impl


def test_blockwise_refuses_a_mask_that_is_not_causal():
    with pytest.raises(ValueError, match="blockwise skips the keys after each query"):
        kernel.resolve(
            "blockwise", length=64, qk_dim=8, v_dim=8, dtype=jnp.float32,
            mask_spec=MaskSpec(causal=False),
        )  # fmt: skip
    spec = MaskSpec(window=8, sinks=2)
    assert kernel.resolve("blockwise", length=64, qk_dim=8, v_dim=8, dtype=jnp.float32,
                          mask_spec=spec) == "blockwise"  # fmt: skip


def test_auto_picks_a_kernel_that_builds_the_spec():
    spec = MaskSpec(chunk=16)
    kw = dict(qk_dim=8, v_dim=8, dtype=jnp.float32, on="tpu")
    assert kernel.resolve("auto", length=4096, mask_spec=spec, **kw) == "blockwise"
    assert kernel.resolve("auto", length=64, mask_spec=spec, **kw) == "dot"
    assert kernel.resolve("auto", length=4096, mask_spec=MaskSpec(causal=False), **kw) == "dot"
    # a sliding window is a row rule: the platform's own choice stands
    window = MaskSpec(window=128)
    assert kernel.resolve("auto", length=4096, mask_spec=window, **kw) == "splash"
    assert kernel.resolve("auto", length=64, mask_spec=window, **kw) == "dot"


@pytest.mark.parametrize(
    "kw, says", [({"window": 0}, "window=0"), ({"chunk": -1}, "chunk=-1"), ({"sinks": -2}, "sinks")]
)
def test_bad_specs_are_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        MaskSpec(**kw)
