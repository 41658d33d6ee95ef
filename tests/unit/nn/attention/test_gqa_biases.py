"""GQA's attention biases (`attention_qkv_bias`, `attention_out_bias`: GLM-4.5's and GPT-OSS's),
with sinks as GPT-OSS has them: the parameters' shapes and axes, greedy decoding from the cache
equal to the training forward with random biases, a gradient for each bias, and the biases
read at all (zero biases give the model without them; random ones differ)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from expertax import init_params, load_config, logits
from expertax.decoding import generate
from expertax.nn import param
from tests.tolerances import tol
from tests.unit.decoding.test_generate import oracle

OVER = dict(model_name="mixtral-tiny", dtype="float32", weight_dtype="float32")
BIASES = ("bq", "bk", "bv", "bo")


def _with_attn(params, **fields):
    attn = dataclasses.replace(params.moe_layers.attn, **fields)
    return dataclasses.replace(params, moe_layers=dataclasses.replace(params.moe_layers, attn=attn))


def test_biases_decode_train_and_gradient():
    c = load_config(
        overrides={**OVER, "attention_qkv_bias": True, "attention_out_bias": True,
                   "attention_sinks": True}
    )  # fmt: skip
    params = init_params(c)
    attn = params.moe_layers.attn
    n, h, g, q, d = (c.num_moe_layers, c.base_num_query_heads, c.base_num_kv_heads, c.head_dim,
                     c.base_emb_dim)  # fmt: skip
    shapes = {"bq": (n, h, q), "bk": (n, g, q), "bv": (n, g, q), "bo": (n, d)}
    assert {b: getattr(attn, b).shape for b in BIASES} == shapes
    keys = jax.random.split(jax.random.key(7), len(BIASES))
    random = {b: 0.5 * jax.random.normal(k, shapes[b]) for b, k in zip(BIASES, keys)}
    params = _with_attn(params, **random)

    prompt = [3, 1, 4, 1, 5]
    out = generate(params, c, [prompt], max_new_tokens=4, devices=jax.devices()[:1])
    tokens, lps = oracle(c, params, [prompt], 4)
    assert out.tokens == tokens
    np.testing.assert_allclose(out.logprobs, lps, **tol(jnp.float32))

    seq = jnp.asarray([prompt + out.tokens[0]])
    grad = jax.grad(lambda p: jnp.sum(logits(p, seq, c)[0, -1] ** 2))(params).moe_layers.attn
    for b in BIASES:
        assert float(jnp.max(jnp.abs(getattr(grad, b)))) > 1e-6, b

    plain_c = load_config(overrides={**OVER, "attention_sinks": True})
    plain = _with_attn(params, **dict.fromkeys(BIASES, param.ABSENT))
    zero = _with_attn(params, **{b: jnp.zeros(shapes[b]) for b in BIASES})
    np.testing.assert_allclose(
        logits(zero, seq, c), logits(plain, seq, plain_c), **tol(jnp.float32)
    )
    assert not np.allclose(logits(params, seq, c), logits(plain, seq, plain_c))
