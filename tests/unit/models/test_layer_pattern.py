"""Per-layer attention kinds (`attention_layer_pattern`, `sliding_window_size`): refusals, the
cycle scan equal to the unrolled stack, each layer's window read (a control per kind), the
parameter tree unchanged by the keys, and decoding from the cache equal to the forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config, logits
from expertax.config.checks import ConfigError
from expertax.decoding import generate
from tests.tolerances import tol
from tests.unit.decoding.test_generate import oracle

OVER = dict(model_name="mixtral-tiny", dtype="float32", weight_dtype="float32",
            max_target_length=16, base_num_decoder_layers=2)  # fmt: skip
PATTERN = dict(sliding_window_size=3, attention_layer_pattern="sliding,full")


@pytest.mark.parametrize(
    "over, says",
    [
        ({"attention_layer_pattern": "sliding,local"}, "'local' is not a layer kind"),
        ({"attention_layer_pattern": "sliding,full"}, "sliding_window_size=0"),
        ({**PATTERN, "base_num_decoder_layers": 3}, "does not divide the 3 MoE layers"),
        ({**PATTERN, "ici_pipeline_parallelism": 2}, "pipeline parallelism"),
        ({**PATTERN, "moe_paged_stash": True}, "moe_paged_stash=true"),
        ({"sliding_window_size": 4, "model_name": "deepseek3-tiny"}, "attention_type=mla"),
    ],
)
def test_refusals(over, says):
    with pytest.raises(ConfigError, match=says):
        load_config(overrides={**OVER, **over})


def test_cycle_scan_equals_unrolled_and_each_window_is_read():
    """On the dense stack (num_experts=1: the attention kinds do not depend on the MLP, and
    four programs of a dense model compile in a fifth of the MoE model's time); the MoE stack's
    cycle scan is the decoding test's and GPT-OSS's parity test's."""
    dense = {**OVER, "num_experts": 1}
    c = load_config(overrides={**dense, **PATTERN})
    plain = load_config(overrides=dense)
    p = init_params(c)
    assert c.num_dense_layers == 2
    assert jax.tree.structure(p) == jax.tree.structure(init_params(plain))
    toks = jax.random.randint(jax.random.key(0), (2, 16), 0, c.vocab_size)
    forward = jax.jit(logits, static_argnums=2)  # one program per config, none op by op
    out = forward(p, toks, c)
    unrolled = load_config(overrides={**dense, **PATTERN, "scan_layers": False})
    np.testing.assert_allclose(out, forward(p, toks, unrolled), **tol(jnp.float32))
    # controls: the first positions see no difference, later ones do, and each layer's kind counts
    full = forward(p, toks, plain)
    np.testing.assert_allclose(out[:, :3], full[:, :3], **tol(jnp.float32))
    assert not np.allclose(out[:, 3:], full[:, 3:], atol=1e-4)
    swapped = load_config(overrides={**dense, **PATTERN, "attention_layer_pattern": "full,sliding"})
    assert not np.allclose(out[:, 3:], forward(p, toks, swapped)[:, 3:], atol=1e-4)


def test_decoding_with_sliding_layers_equals_the_forward():
    c = load_config(overrides={**OVER, **PATTERN, "attention_sinks": True})
    p = init_params(c)
    attn = dataclasses.replace(p.moe_layers.attn, sinks=p.moe_layers.attn.sinks + 0.5)
    p = dataclasses.replace(p, moe_layers=dataclasses.replace(p.moe_layers, attn=attn))
    prompt = [3, 1, 4, 1, 5, 9, 2]
    out = generate(p, c, [prompt], max_new_tokens=4, devices=jax.devices()[:1])
    tokens, lps = oracle(c, p, [prompt], 4)
    assert out.tokens == tokens
    np.testing.assert_allclose(out.logprobs, lps, **tol(jnp.float32))
