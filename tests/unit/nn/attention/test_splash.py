"""Splash attention (Pallas TPU kernel) run on the CPU in Pallas' interpreter, against the dot
kernel: outputs and gradients with packed documents, GQA, MQA, MLA's unequal head dims, lengths
that need padding and several tiles per sequence (the causal tile skip); the shard_map under a
mesh that replicates over one axis; negative controls; the tile sizes; and, compile-only for a
v5p chip, the Mosaic kernels in the program `auto` builds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import targets
from expertax.config import config_rules
from expertax.nn.attention import kernel, splash
from expertax.nn.attention.kernel import attend, attend_dot
from expertax.preflight import load_config
from expertax.sharding import make_mesh, use_rules
from expertax.train.trainer import build_trainer
from tests.tolerances import tol
from tests.unit.nn.attention.targets import call_shapes, compiled_text, needs_tpu

# name: (B, T, H, G, Q, O, packed, max block)
CASES = {
    # 2 x 2 tiles of 128: the tile above the diagonal skipped
    "packed_gqa_two_tiles": (2, 256, 4, 2, 32, 32, True, 128),
    # DeepSeek-V3's q/k 192 and v 128; T = 200 padded to 256 (one tile)
    "mla_dims_padded_length": (1, 200, 2, 2, 192, 128, True, 512),
}
EXTENDED_CASES = {"mqa_no_segments": (2, 128, 4, 1, 16, 24, False, 512)}


def _inputs(b, t, h, g, q, o, packed, seed=0):
    kq, kk, kv, ks, kc = jax.random.split(jax.random.key(seed), 5)
    seg = None
    if packed:  # documents of random lengths
        seg = jnp.cumsum(jax.random.bernoulli(ks, 0.03, (b, t)), axis=1).astype(jnp.int32)
    return (
        jax.random.normal(kq, (b, t, h, q), jnp.float32),
        jax.random.normal(kk, (b, t, g, q), jnp.float32),
        jax.random.normal(kv, (b, t, g, o), jnp.float32),
        seg,
        jax.random.normal(kc, (b, t, h, o), jnp.float32),
    )


def _out_and_grads(fn, q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))


def _max_err(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))


def _splash(seg, scale=0.25):
    return jax.jit(
        lambda q, k, v: splash.attend_splash(
            q, k, v, scale=scale, segment_ids_BT=seg, interpret=True
        )
    )


def _dot(seg, scale=0.25):
    return jax.jit(lambda q, k, v: attend_dot(q, k, v, scale=scale, segment_ids_BT=seg))


@pytest.mark.parametrize(
    "case",
    [*CASES, *(pytest.param(c, marks=pytest.mark.extended) for c in EXTENDED_CASES)],
)
def test_matches_dot_kernel(case, monkeypatch):
    b, t, h, g, qd, od, packed, max_block = {**CASES, **EXTENDED_CASES}[case]
    monkeypatch.setattr(splash, "MAX_BLOCK", max_block)
    q, k, v, seg, d_out = _inputs(b, t, h, g, qd, od, packed)
    if packed:
        assert int(seg.max()) > 0  # several documents: the mask matters
    want = _out_and_grads(_dot(seg, qd**-0.5), q, k, v, d_out)
    got = _out_and_grads(_splash(seg, qd**-0.5), q, k, v, d_out)
    for name, w, x in zip(("out", "dq", "dk", "dv"), want, got):
        assert x.shape == w.shape and x.dtype == w.dtype, name
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)


def test_negative_controls_fail_the_comparison(monkeypatch):
    """A missing document mask, or a perturbed key in the second tile, moves the output."""
    monkeypatch.setattr(splash, "MAX_BLOCK", 128)
    q, k, v, seg, _ = _inputs(*CASES["packed_gqa_two_tiles"][:7])
    want = _dot(seg)(q, k, v)
    k_bad = k.at[0, 200, 0, 0].add(1e-2)
    for got in (_splash(None)(q, k, v), _splash(seg)(q, k_bad, v)):
        assert float(jnp.max(jnp.abs(got - want))) > 10 * tol()["atol"]


@pytest.mark.extended  # 5-7 s in the interpreter; float32 covers the kernel's logic
def test_bfloat16_matches_dot_kernel():
    q, k, v, seg, d_out = _inputs(1, 128, 4, 2, 32, 32, True)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, d_out)]
    want = _out_and_grads(_dot(seg), *bf)
    got = _out_and_grads(_splash(seg), *bf)
    for w, x in zip(want, got):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            x.astype(jnp.float32), w.astype(jnp.float32), **tol(jnp.bfloat16)
        )


@pytest.mark.distributed
def test_sharded_call_equals_one_device(monkeypatch):
    """Under a data x fsdp x tensor mesh with the default rules: the batch splits over `data`
    only (2 sequences: `fsdp` does not divide them, so every fsdp pair computes the same
    sequences) and the heads over `tensor`. Gradients must still equal the dot kernel's (a
    transpose that summed over the replicating axis would double them)."""
    monkeypatch.setattr(splash, "MAX_BLOCK", 128)
    c = load_config(
        overrides={
            "ici_data_parallelism": 2,
            "ici_fsdp_parallelism": 2,
            "ici_tensor_parallelism": 2,
        }
    )
    mesh = make_mesh(c, jax.devices()[:8])
    q, k, v, seg, d_out = _inputs(2, 128, 4, 2, 16, 16, True, seed=1)
    want = _out_and_grads(_dot(seg), q, k, v, d_out)
    fn = functools.partial(splash.attend_splash, scale=0.25, segment_ids_BT=seg, interpret=True)
    with jax.set_mesh(mesh), use_rules(config_rules(c)):
        got = _out_and_grads(jax.jit(fn), q, k, v, d_out)
        text = jax.jit(fn).lower(q, k, v).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    for name, w, x in zip(("out", "dq", "dk", "dv"), want, got):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)


@pytest.mark.parametrize(
    "length, block, visited, tiles",
    [(128, 128, 1, 1), (200, 256, 1, 1), (512, 512, 1, 1), (640, 128, 15, 25), (4096, 512, 36, 64)],
)
def test_block_size_and_visited_tiles(length, block, visited, tiles):
    assert splash.block_size(length) == block
    assert splash.visited_tiles(length) == (visited, tiles)


def test_refuses_fewer_keys_than_queries():
    q = jnp.zeros((1, 128, 2, 8))
    with pytest.raises(ValueError, match="128 query positions after only 64 key positions"):
        splash.attend_splash(q, q[:, :64], q[:, :64], scale=1.0, interpret=True)


def _fwd_bwd(impl):
    def loss(q, k, v, seg):
        return jnp.sum(attend(q, k, v, scale=0.1, segment_ids_BT=seg, impl=impl))

    return jax.grad(loss, argnums=(0, 1, 2))


@needs_tpu
def test_auto_compiles_the_kernel_for_tpu_from_the_threshold():
    """For a v5p chip, `auto` at AUTO_BLOCKWISE_MIN_LENGTH positions is splash: the forward,
    dq and dkv Mosaic kernels in the program (GQA, q/k 96 and v 64, packed documents); one
    position fewer is the dot kernel, with none (the control)."""
    t = kernel.AUTO_BLOCKWISE_MIN_LENGTH
    text = compiled_text("tpu:v5p-8", _fwd_bwd("auto"), *call_shapes(t))
    assert text.count('custom_call_target="tpu_custom_call"') >= 3
    short = compiled_text("tpu:v5p-8", _fwd_bwd("auto"), *call_shapes(t - 1))
    assert "tpu_custom_call" not in short


@needs_tpu
@pytest.mark.extended  # 10 s: a whole train step compiled for v5p
def test_train_step_for_tpu_runs_auto_splash_in_a_sharded_model():
    """The train step of a bfloat16 model at 512 positions, heads split over `tensor` and the
    batch over `fsdp`: `auto` puts the Mosaic kernels in the program (forward, and the backward's
    dq and dkv) through the shard_map."""
    c = load_config(
        overrides={
            "model_name": "llama-tiny",
            "dtype": "bfloat16",
            "max_target_length": kernel.AUTO_BLOCKWISE_MIN_LENGTH,
            "base_num_decoder_layers": 1,
            "ici_fsdp_parallelism": 4,
            "ici_tensor_parallelism": 2,
        }
    )
    trainer = build_trainer(c, targets.parse_target("tpu:v5p-16").devices())
    assert trainer.compile().as_text().count('custom_call_target="tpu_custom_call"') >= 3
