"""A sliding window in the library kernels (splash, cuDNN), which build it by row: on the CPU
against `dot` building it from each document's positions (packed documents, values and
gradients; splash in Pallas' interpreter, cuDNN through its wrapper with the same API's XLA
implementation in its place), the tiles splash skips, and, compile-only, the window in the
v5p and H100 programs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.nn.attention import cudnn, kernel, splash
from expertax.nn.attention.mask import MaskSpec
from tests.tolerances import tol
from tests.unit.nn.attention.targets import call_shapes, compiled_text, needs_cudnn, needs_tpu
from tests.unit.nn.attention.test_cudnn import stand_in


def _documents(seg_BT: np.ndarray) -> np.ndarray:
    """Each document's positions from 0 (what the data pipeline passes with packed rows)."""
    idx = np.arange(seg_BT.shape[1])
    starts = np.where(np.diff(seg_BT, axis=1, prepend=-1) != 0, idx, 0)
    return idx - np.maximum.accumulate(starts, axis=1)


def _inputs(b, t, h, g, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    seg = np.asarray(jnp.cumsum(jax.random.bernoulli(ks[4], 0.01, (b, t)), axis=1), np.int32)
    arrays = [
        jax.random.normal(key, shape)
        for key, shape in zip(ks[:4], ((b, t, h, d), (b, t, g, d), (b, t, g, d), (b, t, h, d)))
    ]
    return (*arrays, jnp.asarray(seg), jnp.asarray(_documents(seg)))


def _out_and_grads(fn, q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(ct))


def _by_positions(seg, pos, window):
    spec = MaskSpec(window=window)
    return jax.jit(
        lambda q, k, v: kernel.attend_dot(
            q, k, v, scale=0.3, segment_ids_BT=seg, q_positions_BT=pos, kv_positions_BS=pos,
            mask_spec=spec,
        )
    )  # fmt: skip


def _compare(got, want, dtype=jnp.float32):
    for name, w, x in zip(("out", "dq", "dk", "dv"), want, got, strict=True):
        assert x.shape == w.shape, name
        np.testing.assert_allclose(x, w, **tol(dtype), err_msg=name)


def test_splash_window_by_row_equals_dot_by_positions(monkeypatch):
    """Three tiles of 128 rows, a window of 100: tile pairs wholly before the window skipped,
    partial ones masked; documents packed (their positions restart) in both sequences."""
    monkeypatch.setattr(splash, "MAX_BLOCK", 128)
    q, k, v, ct, seg, pos = _inputs(2, 384, 2, 1, 16)
    assert int(seg.max()) > 0 and int(pos.max()) >= 100  # several documents, window reached
    want = _out_and_grads(_by_positions(seg, pos, 100), q, k, v, ct)

    def run(window):
        return jax.jit(
            lambda q, k, v: splash.attend_splash(
                q, k, v, scale=0.3, segment_ids_BT=seg, window=window, interpret=True
            )
        )

    _compare(_out_and_grads(run(100), q, k, v, ct), want)
    # negative control: the causal kernel without the window reads keys the window drops
    assert float(jnp.max(jnp.abs(run(None)(q, k, v) - want[0]))) > 10 * tol()["atol"]


@pytest.mark.parametrize("window, visited", [(None, 10), (128, 7), (129, 7), (300, 10), (1, 4)])
def test_splash_skips_the_tiles_before_the_window(window, visited):
    """4 x 4 tiles of 128 rows: causal computes 10; a window of up to 128 positions reaches only
    the tile left of the diagonal (7); 300 reaches back three tiles (10); 1, the diagonal (4)."""
    kernel_ = splash._kernel(1, 512, 512, 0, 128, True, window)
    blocks = np.asarray(kernel_.fwd_mask_info.block_mask)
    assert int(np.count_nonzero(blocks)) == visited


def test_cudnn_window_equals_dot_by_positions():
    q, k, v, ct, seg, pos = _inputs(2, 64, 4, 2, 16)
    calls = []

    def wrapped(window):
        return lambda q, k, v: cudnn.attend_cudnn(
            q, k, v, scale=0.3, segment_ids_BT=seg, window=window, flash=stand_in(calls)
        )

    want = _out_and_grads(_by_positions(seg, pos, 9), q, k, v, ct)
    _compare(_out_and_grads(wrapped(9), q, k, v, ct), want)
    assert float(jnp.max(jnp.abs(wrapped(None)(q, k, v) - want[0]))) > 10 * tol()["atol"]


def _fwd_bwd(impl, window):
    spec = MaskSpec(window=window)

    def loss(q, k, v, seg):
        out = kernel.attend(q, k, v, scale=0.1, segment_ids_BT=seg, impl=impl, mask_spec=spec)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


@needs_tpu
def test_splash_window_compiles_for_v5p():
    text = compiled_text("tpu:v5p-8", _fwd_bwd("splash", 128), *call_shapes(512, qd=64, od=64))
    assert text.count('custom_call_target="tpu_custom_call"') >= 3


@needs_cudnn
def test_cudnn_window_compiles_for_h100():
    """cuDNN's forward and backward calls carry the window as their sliding-window length."""
    text = compiled_text("gpu:h100x8", _fwd_bwd("cudnn", 64), *call_shapes(256, qd=64, od=64))
    calls = [line for line in text.splitlines() if "__cudnn$fmha" in line and "custom_call" in line]
    assert len(calls) == 2
    assert all(re.search(r'"sliding_window_length":\s*64\b', line) for line in calls)
