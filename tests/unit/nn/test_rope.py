"""Partial RoPE (`partial_rotary_factor`, GLM-4.5): the first head_dim x factor dims rotated in
half-split pairs with that many dims' frequencies, the rest passed as they are (by hand, after
transformers' rotate-half form); decoding with it equals the training forward; the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import ConfigError, init_params, load_config
from expertax.decoding import generate
from expertax.nn import rope
from tests.tolerances import tol
from tests.unit.decoding.test_generate import oracle


def test_partial_rotation_by_hand():
    c = load_config(overrides={"model_name": "mixtral-tiny", "partial_rotary_factor": 0.5})
    q, rot = c.head_dim, rope.rotary_dim(c)
    assert rot == q // 2
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, 5, 2, q)))
    pos = np.arange(5)
    cos, sin = rope.cos_sin(c, jnp.asarray(pos)[None], rot)
    got = np.asarray(rope.apply(jnp.asarray(x), cos, sin))
    inv = 1.0 / (c.rope_max_timescale ** (np.arange(0, rot, 2) / rot))
    ang = pos[:, None] * inv[None]  # [T, rot/2]
    c_, s_ = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    h = rot // 2
    rotated = np.concatenate([-x_rot[..., h:], x_rot[..., :h]], axis=-1)  # rotate_half
    want = np.concatenate(
        [x_rot * np.concatenate([c_, c_], -1) + rotated * np.concatenate([s_, s_], -1), x_pass],
        axis=-1,
    )
    np.testing.assert_allclose(got, want, **tol(jnp.float32))
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])  # the rest as it was
    whole = rope.apply(jnp.asarray(x), *rope.cos_sin(c, jnp.asarray(pos)[None], q))
    assert not np.allclose(np.asarray(whole), want)  # control: rotating every dim differs


def test_decoding_equals_the_training_forward():
    over = dict(model_name="mixtral-tiny", dtype="float32", weight_dtype="float32")
    c = load_config(overrides={**over, "partial_rotary_factor": 0.5})
    params = init_params(c)
    g = generate(params, c, [[3, 1, 4, 1, 5]], max_new_tokens=4, devices=jax.devices()[:1])
    tokens, lps = oracle(c, params, [[3, 1, 4, 1, 5]], 4)
    assert g.tokens == tokens
    np.testing.assert_allclose(g.logprobs, lps, **tol(jnp.float32))


@pytest.mark.parametrize(
    "over, says",
    [
        ({"model_name": "deepseek3-tiny", "partial_rotary_factor": 0.5}, "attention_type=mla"),
        ({"model_name": "mixtral-tiny", "partial_rotary_factor": 0.01}, "an even count"),
    ],
)
def test_refusals(over, says):
    with pytest.raises(ConfigError, match=says):
        load_config(overrides=over)
