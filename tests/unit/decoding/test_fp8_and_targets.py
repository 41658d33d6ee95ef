"""fp8 decoding weights (decoding/quantized.py) and the decoding program compiled for a TPU target.

The fp8 path must compute exactly what the same model computes with the dequantized weights
(the quantization is the only difference), its rounding must stay within e4m3's 3 mantissa bits
of each 128-value block's largest magnitude, and it must quantize the layers' matrices only
(not the embedding, the output head, the norms or the router)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import generate, init_params, load_config
from expertax.decoding import programs, quantized
from expertax.decoding.loop import decoding_config
from expertax.fp8 import quant
from expertax.models import decoder
from expertax.nn.attention import mla
from expertax.nn.param import is_spec
from tests.tolerances import tol


@pytest.fixture(scope="module")
def deepseek():
    c = load_config(
        overrides=dict(
            model_name="deepseek3-tiny", mtp_num_layers=1, dtype="float32", weight_dtype="float32"
        )
    )
    return c, init_params(c)


def test_rounding_within_e4m3_precision():
    w = jax.random.normal(jax.random.key(0), (3, 256, 64), jnp.float32)
    w = w * jnp.logspace(-3, 1, 256)[None, :, None]  # blocks of very different magnitudes
    q = quant.quantize_array(w)
    # Blocks of 128 along the input axis K, the scales [E, K / 128, N] (a wide minor axis).
    assert q.q.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 2, 64)
    back = quant.dequantize_array(q, jnp.float32)
    amax = jnp.max(jnp.abs(w.reshape(3, 2, 128, 64)), axis=-2, keepdims=True)
    err = jnp.abs(back - w).reshape(3, 2, 128, 64)
    # e4m3: 3 mantissa bits, half an ulp of relative error for normal values; the smallest
    # values of a block (subnormal after scaling) err by at most 2^-10 of the block's max.
    bound = jnp.maximum(jnp.abs(w.reshape(3, 2, 128, 64)) * 2.0**-4, amax * 2.0**-10)
    assert bool(jnp.all(err <= bound * 1.0001))
    odd = quant.quantize_array(jnp.ones((576, 5)))  # not a multiple of 128: one block per column
    assert odd.scale.shape == (1, 5)


def test_only_layer_matrices_are_quantized(deepseek):
    c, _ = deepseek
    tree = quantized.spec(decoder.spec(c))
    held = jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: quant.is_fp8(x) or is_spec(x)
    )
    names = {jax.tree_util.keystr(k): quant.is_fp8(v) for k, v in held}
    assert names[".moe_layers.moe.wi_0"] and names[".moe_layers.attn.wkv_b"]
    assert names[".dense_layers.mlp.wo"] and names[".moe_layers.moe.shared.wi_1"]
    assert names[".mtp.eh_proj"] and names[".mtp.block.moe.wo"]
    kept = [".embed", ".lm_head", ".final_norm", ".moe_layers.moe.router.w"]
    kept += [".moe_layers.moe.router.bias", ".moe_layers.attn.kv_norm", ".mtp.enorm"]
    assert not any(names[k] for k in kept)


def _round_trip_absorbed(wkv_b_LRHZ, nope):
    """MLA's wkv_b through decoding's fp8 form: its absorbed halves quantized (their own last
    axes, nn/attention/mla.Absorbed), dequantized, and put back in the [Rkv, H, Z] layout."""

    def one(w):
        uk, uv = (
            quant.dequantize_array(quant.quantize_array(h), jnp.float32)
            for h in mla.absorb(w, nope)
        )
        return jnp.concatenate([uk.transpose(2, 0, 1), uv.transpose(1, 0, 2)], -1)

    return jax.vmap(one)(wkv_b_LRHZ)


def test_fp8_decoding_equals_the_dequantized_model(deepseek):
    c, params = deepseek
    ref, _ = quant.dequantize(quantized.quantize(params), jnp.float32, None)
    nope = c.qk_nope_head_dim
    for stack in ("dense_layers", "moe_layers"):
        layers = getattr(params, stack)
        attn = getattr(ref, stack).attn
        attn = dataclasses.replace(attn, wkv_b=_round_trip_absorbed(layers.attn.wkv_b, nope))
        stacked = dataclasses.replace(getattr(ref, stack), attn=attn)
        ref = dataclasses.replace(ref, **{stack: stacked})
    mtp_attn = dataclasses.replace(
        ref.mtp.block.attn, wkv_b=_round_trip_absorbed(params.mtp.block.attn.wkv_b, nope)
    )
    block = dataclasses.replace(ref.mtp.block, attn=mtp_attn)
    ref = dataclasses.replace(ref, mtp=dataclasses.replace(ref.mtp, block=block))
    prompts = [[1, 5, 9, 3, 7], [2, 4]]
    want = generate(ref, c, prompts, max_new_tokens=5, devices=jax.devices()[:1])
    got = generate(
        params, c, prompts, max_new_tokens=5, devices=jax.devices()[:1], fp8_weights=True
    )
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.array(got.logprobs), np.array(want.logprobs), **tol())


def test_decoding_compiles_for_a_tpu_target(deepseek):
    """The decoding program (prefill + decode loop, fp8 weights, MoE expert-parallel over the
    slice) compiles for a v5p slice; its memory analysis is what benchmarks/generate_671b.py
    reads."""
    from expertax.sharding.mesh import make_mesh
    from expertax.targets import compiler_available, parse_target, prepare_process

    if not compiler_available("tpu"):
        pytest.skip("libtpu (expertax[tpu]) is not installed")
    target = parse_target("tpu:v5p-16")
    prepare_process(target)
    c, _ = deepseek
    dc = decoding_config(
        load_config(
            overrides=dict(
                model_name="deepseek3-tiny", ici_fsdp_parallelism=2, ici_expert_parallelism=4
            )
        )
    )
    compiled = programs.compile_for(
        dc, make_mesh(dc, target.devices()), batch=3, prompt_len=16, budget=8, fp8_weights=True
    )
    m = compiled.memory_analysis()
    assert m.argument_size_in_bytes > 0 and m.temp_size_in_bytes > 0
    text = compiled.as_text()
    assert "f8e4m3fn" in text and "while" in text
