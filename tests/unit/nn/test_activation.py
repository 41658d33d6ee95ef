"""The gated activations (nn/activation.py): GPT-OSS's clamped SwiGLU by hand, and the config's
activation honoured by every path that runs one: the MoE layer's sparse paths (the fused routed
FFN, the tiled grouped matmul's prologue, XLA's ragged_dot), its dense path and the shared
expert, against the loop-over-experts oracle; and decoding (unstacked experts, joined matrices)
against the training forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config
from expertax.decoding import generate
from expertax.nn import activation
from expertax.nn.moe import layer
from expertax.nn.moe.reference import moe_reference
from tests.tolerances import tol
from tests.unit.decoding.test_generate import oracle
from tests.unit.nn.moe.test_moe import assert_trees_close, case

LIMIT = 0.5  # small, so that random activations hit both clamps


def test_clamped_swiglu_by_hand():
    gate = np.array([-3.0, -0.2, 0.0, 0.3, 0.9, 8.0], np.float32)
    up = np.array([-9.0, -0.7, 0.1, 0.4, 2.0, -0.3], np.float32)
    g = np.minimum(gate, LIMIT)
    u = np.clip(up, -LIMIT, LIMIT)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    got = activation.swiglu_clamped(jnp.asarray(gate), jnp.asarray(up), limit=LIMIT)
    np.testing.assert_allclose(got, want, **tol(jnp.float32))
    assert not np.allclose(activation.swiglu(jnp.asarray(gate), jnp.asarray(up)), want)


def test_of_names_the_configured_function_once_per_limit():
    c = load_config(overrides={"mlp_activation": "swiglu_clamped", "mlp_activation_limit": 3.0})
    assert activation.of(c) is activation.of(c)  # one static argument for the custom VJPs
    assert activation.of(c)(jnp.float32(9.0), jnp.float32(0.0)) == pytest.approx(
        3.0 / (1 + np.exp(-1.702 * 3.0)), rel=1e-6
    )
    assert activation.of(load_config()) is activation.swiglu


PATHS = {  # name: overrides of the sparse path
    "fused_routed": {"gmm_impl": "tiled", "moe_fused_routed_ffn": True},
    "tiled_prologue": {"gmm_impl": "tiled", "moe_fused_routed_ffn": False},
    "ragged_dot": {"gmm_impl": "ragged_dot"},
}


@pytest.mark.parametrize("path", [*PATHS, "dense"])
def test_moe_paths_equal_the_oracle(path):
    """deepseek3-tiny's MoE layer (routed and shared experts), forward and gradients."""
    over = {"model_name": "deepseek3-tiny", "mlp_activation": "swiglu_clamped"}
    c, p, x = case({**over, "mlp_activation_limit": LIMIT, **PATHS.get(path, {})})
    sparse = path != "dense"
    cc = c.model_copy(update={"sparse_matmul": sparse, "capacity_factor": -1.0})
    ct = jax.random.normal(jax.random.key(4), x.shape)

    def out_and_grads(fn):
        out, vjp = jax.vjp(fn, p, x)
        return out, vjp(ct)

    want = out_and_grads(lambda p, x: moe_reference(p, x, c))
    got = out_and_grads(lambda p, x: layer.apply(p, x, cc, jnp.float32)[0])
    assert_trees_close(got, want, **tol(jnp.float32))
    # negative control: the plain SwiGLU's oracle differs
    plain = moe_reference(p, x, c.model_copy(update={"mlp_activation": "swiglu"}))
    assert not np.allclose(plain, want[0], **tol(jnp.float32))


def test_decoding_equals_the_training_forward():
    """Greedy decoding (unstacked experts, joined `wi_0 | wi_1`, the dense and shared MLPs) of
    deepseek3-tiny with the clamped activation: the same tokens and log-probabilities as the
    whole forward pass re-run on the growing sequence."""
    c = load_config(
        overrides=dict(
            model_name="deepseek3-tiny", dtype="float32", weight_dtype="float32",
            mlp_activation="swiglu_clamped", mlp_activation_limit=LIMIT,
        )
    )  # fmt: skip
    params = init_params(c)
    g = generate(params, c, [[3, 1, 4, 1, 5]], max_new_tokens=4, devices=jax.devices()[:1])
    tokens, lps = oracle(c, params, [[3, 1, 4, 1, 5]], 4)
    assert g.tokens == tokens
    np.testing.assert_allclose(g.logprobs, lps, **tol(jnp.float32))
