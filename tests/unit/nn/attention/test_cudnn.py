"""The cuDNN wrapper: head-dim padding, the packed-document mask and gradients, checked on the CPU
with a stand-in for the kernel (the same `jax.nn.dot_product_attention` call with its XLA
implementation, behind a guard that asserts what cuDNN would be given); what the library lets
through to cuDNN; and, compile-only for an H100, the cuDNN fused-attention custom calls in the
program (forward and backward, padded MLA dims, the bias variant for packed documents)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.attention import cudnn
from expertax.nn.attention.kernel import attend, attend_dot
from tests.tolerances import tol
from tests.unit.nn.attention.targets import call_shapes, compiled_text, needs_cudnn

# name: (B, T, H, G, Q, O, packed, dtype)
CASES = {
    "mla_v_padded": (1, 40, 2, 2, 48, 32, True, jnp.float32),  # deepseek3-tiny dims
    "gqa_dim_20_odd_length": (2, 45, 4, 2, 20, 20, True, jnp.float32),  # 20 -> 24, T 45 -> 46
    "mla_bfloat16_no_segments": (1, 32, 2, 2, 24, 16, False, jnp.bfloat16),
}


def _inputs(b, t, h, g, q, o, packed, dtype, seed=0):
    kq, kk, kv, ks, kc = jax.random.split(jax.random.key(seed), 5)
    seg = None
    if packed:
        seg = jnp.cumsum(jax.random.bernoulli(ks, 0.15, (b, t)), axis=1).astype(jnp.int32)
    arrays = [
        jax.random.normal(key, shape, jnp.float32).astype(dtype)
        for key, shape in (
            (kq, (b, t, h, q)),
            (kk, (b, t, g, q)),
            (kv, (b, t, g, o)),
            (kc, (b, t, h, o)),
        )
    ]
    return (*arrays[:3], seg, arrays[3])


def stand_in(calls):
    """The XLA implementation of the same call, refusing what cuDNN would refuse."""

    def flash(q, k, v, mask, scale, window=None):
        d = q.shape[-1]
        assert k.shape[-1] == d and v.shape == k.shape, (q.shape, k.shape, v.shape)
        assert d % 8 == 0 and d <= cudnn.MAX_HEAD_DIM, d
        if mask is not None:  # the bias path trains only on even lengths
            assert mask.dtype == jnp.bool_ and q.shape[1] % 2 == 0, (mask.dtype, q.shape)
        calls.append((q.shape, v.shape, None if mask is None else mask.shape))
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=True, implementation="xla",
            local_window_size=None if window is None else (window - 1, 0),
        )  # fmt: skip

    return flash


@functools.partial(jax.jit, static_argnums=0)
def _out_and_grads(fn, q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))


@pytest.mark.parametrize("case", CASES)
def test_padded_wrapper_matches_dot_kernel(case):
    b, t, h, g, qd, od, packed, dtype = CASES[case]
    q, k, v, seg, d_out = _inputs(b, t, h, g, qd, od, packed, dtype)
    scale, calls = 0.3, []

    def wrapped(q, k, v):
        return cudnn.attend_cudnn(q, k, v, scale=scale, segment_ids_BT=seg, flash=stand_in(calls))

    want = _out_and_grads(
        lambda q, k, v: attend_dot(q, k, v, scale=scale, segment_ids_BT=seg), q, k, v, d_out
    )
    got = _out_and_grads(wrapped, q, k, v, d_out)
    d = cudnn.padded_head_dim(qd, od)
    padded_t = t + t % 2 if packed else t
    mask = (b, 1, padded_t, padded_t) if packed else None
    assert calls[0] == ((b, padded_t, h, d), (b, padded_t, g, d), mask)
    for name, w, x in zip(("out", "dq", "dk", "dv"), want, got):
        assert x.shape == w.shape and x.dtype == w.dtype, name
        np.testing.assert_allclose(
            x.astype(jnp.float32), w.astype(jnp.float32), **tol(dtype), err_msg=name
        )


def test_negative_control_unpadded_scale_or_mask_fails():
    """The comparison can fail: the default scale of the padded dim (1/sqrt(48), not the given
    one), or no document mask, moves the outputs."""
    b, t, h, g, qd, od, _, dtype = CASES["mla_v_padded"]
    q, k, v, seg, _ = _inputs(b, t, h, g, qd, od, True, dtype)
    want = attend_dot(q, k, v, scale=0.3, segment_ids_BT=seg)

    def flash_default_scale(q, k, v, mask, scale, window=None):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    bad = cudnn.attend_cudnn(q, k, v, scale=0.3, segment_ids_BT=seg, flash=flash_default_scale)
    unmasked = cudnn.attend_cudnn(q, k, v, scale=0.3, flash=stand_in([]))
    for x in (bad, unmasked):
        assert float(jnp.max(jnp.abs(x - want))) > 100 * tol()["atol"]


@pytest.mark.parametrize(
    "qk, v, dtype, limit, refused",
    [
        (192, 128, jnp.bfloat16, 256, None),  # DeepSeek-V3 on an H100 host: v padded to 192
        (192, 128, jnp.bfloat16, 128, "pad to 192, above the 128"),  # a CPU host
        (128, 128, jnp.float16, 128, None),
        (264, 264, jnp.bfloat16, 256, "pad to 264"),
        (128, 128, jnp.float32, 256, "bfloat16 or float16"),
    ],
)
def test_what_the_library_lets_through(qk, v, dtype, limit, refused, monkeypatch):
    monkeypatch.setattr(cudnn, "available", lambda: True)
    why = cudnn.unusable_because(qk, v, dtype, limit=limit)
    assert why is None if refused is None else refused in why
    monkeypatch.setattr(cudnn, "available", lambda: False)  # no cuDNN: nothing goes through
    assert "expertax[gpu]" in cudnn.unusable_because(qk, v, dtype, limit=limit)


def test_head_dim_limit_on_this_cpu_process():
    assert jax.default_backend() == "cpu" and cudnn.head_dim_limit() == 128


def test_refused_off_gpu():
    q = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="attention_impl=cudnn needs a GPU"):
        attend(q, q, q, scale=0.5, impl="cudnn")


def _fmha_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if 'custom_call_target="__cudnn$fmha' in line]


def _fwd_bwd(impl, segments):
    def loss(q, k, v, seg):
        out = attend(q, k, v, scale=0.1, segment_ids_BT=seg if segments else None, impl=impl)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


@needs_cudnn
def test_compiles_for_h100_with_mla_dims_padded():
    """q/k 96, v 64 (deepseek3-small): v padded to 96 into cuDNN's forward and backward calls,
    the packed-document mask as the bias variant; the dot program (control) has none."""
    text = compiled_text("gpu:h100x8", _fwd_bwd("cudnn", True), *call_shapes(128, 4, 4, 96, 64))
    targets = {re.search(r'custom_call_target="([^"]+)"', line)[1] for line in _fmha_lines(text)}
    assert targets == {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}
    assert all(",96]" in line and ",64]" not in line for line in _fmha_lines(text))
    control = compiled_text("gpu:h100x8", _fwd_bwd("dot", True), *call_shapes(128, 4, 4, 96, 64))
    assert not _fmha_lines(control)


@needs_cudnn
def test_compiles_for_h100_gqa_causal_without_bias():
    text = compiled_text("gpu:h100x8", _fwd_bwd("cudnn", False), *call_shapes(128, 4, 2, 64, 64))
    targets = {re.search(r'custom_call_target="([^"]+)"', line)[1] for line in _fmha_lines(text)}
    assert targets == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
