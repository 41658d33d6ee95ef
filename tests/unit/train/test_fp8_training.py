"""fp8 training (`quantization`): which products of a model the recipe takes, the model's loss
and gradients near the unquantized ones, refusals, decoding left in dtype, and the quantizers'
counts as train metrics (fp8/stats.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.conftest import TINY_MOE
from tests.unit.train.test_resume import read_metrics

from expertax import init_params, load_config, logits
from expertax.config import ConfigError
from expertax.fp8 import kernel as fp8_kernel
from expertax.train.loop import train
from expertax.train.trainer import build_trainer

SMALL = {"max_target_length": 16, "per_device_batch_size": 1}


def _config(model, recipe="", **kw):
    return load_config(overrides={"model_name": model, "quantization": recipe, **SMALL, **kw})


def _calls(c, p, toks):
    text = str(jax.make_jaxpr(lambda p: logits(p, toks, c))(p))
    return re.findall(r"custom_vjp_call\[[^\]]*?name=(\w+)", text)


# per scanned layer kind, once each (a scan's body is one jaxpr), fp8/matmul.py's one VJP
# (`_matmul`): the dense linears and the routed experts' grouped GEMMs (gate, up, and wo with the
# activation). mixtral-tiny: q, k, v, o + 3; deepseek3-tiny: MLA's wq_a, wq_b, wkv_a, wkv_b, wo in
# its dense and its MoE layer, the dense layer's MLP (3) and the shared expert (3) + 3
EXPECTED = {"mixtral-tiny": 4 + 3, "deepseek3-tiny": 16 + 3}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_the_recipe_takes_every_layer_linear_and_expert_gemm(model):
    toks = jnp.zeros((2, SMALL["max_target_length"]), jnp.int32)
    c = _config(model, "fp8_blockwise")
    p = init_params(c)
    calls = _calls(c, p, toks)
    assert calls.count("_matmul") == EXPECTED[model]
    plain = _calls(_config(model), p, toks)
    assert "_matmul" not in plain


def test_loss_and_gradients_near_the_unquantized_model():
    c0 = _config("mixtral-tiny")
    p = init_params(c0)
    toks = jax.random.randint(jax.random.key(1), (2, 16), 0, c0.vocab_size)

    def loss(p, c):
        lp = jax.nn.log_softmax(logits(p, toks, c)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(lp, toks[:, 1:, None], -1))

    def norm(g):
        return float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g))))

    l0, g0 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p, c0)
    for recipe in ("fp8_blockwise",):  # (tensorwise's: test_fp8_gemm, test_fp8_gmm)
        c8 = _config("mixtral-tiny", recipe)
        l8, g8 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p, c8)
        assert 0 < abs(float(l8 - l0)) / float(l0) < 0.01, recipe
        assert np.isfinite(norm(g8)) and 0.9 < norm(g8) / norm(g0) < 1.1, recipe


def test_dense_capacity_path_refused():
    with pytest.raises(ConfigError, match="quantization=fp8_blockwise.*sparse_matmul"):
        _config("mixtral-tiny", "fp8_blockwise", sparse_matmul=False, capacity_factor=1.0)


def test_unknown_recipe_refused_naming_the_key():
    with pytest.raises(ConfigError, match="quantization"):
        _config("mixtral-tiny", "fp8")


# deepseek3-tiny with the experts' D and F in whole 128-tiles (benchmarks/fp8_targets.py)
WHOLE_TILES = {"base_emb_dim": 256, "base_moe_mlp_dim": 128}


def test_the_hopper_kernel_is_refused_off_hopper_and_taken_where_it_runs():
    """`gmm_impl=fp8_hopper` on the CPU's mesh: refused before compiling, naming the devices;
    inside `fp8_kernel.interpret()` (the CPU standing in for a Hopper GPU) it is taken, so is
    `auto`'s choice with the tiny model's F=64 (64-wide tiles), and `auto` with F=96 (not a
    multiple of 64) keeps the dequantized products, saying why."""

    c = _config("deepseek3-tiny", "fp8_blockwise", gmm_impl="fp8_hopper", **WHOLE_TILES)
    with pytest.raises(ConfigError, match="gmm_impl=fp8_hopper: .*not on the cpu devices"):
        build_trainer(c, jax.devices()[:1])
    with fp8_kernel.interpret():
        assert "fp8_hopper kernel" in build_trainer(c, jax.devices()[:1]).fp8_experts
        tiny = build_trainer(_config("deepseek3-tiny", "fp8_blockwise"), jax.devices()[:1])
        assert "fp8_hopper kernel" in tiny.fp8_experts
        odd = _config("deepseek3-tiny", "fp8_blockwise", base_moe_mlp_dim=96)
        odd = build_trainer(odd, jax.devices()[:1])
    assert "F per shard=96" in odd.fp8_experts and "dequantized" in odd.fp8_experts


def _metric_names(c) -> set[str]:
    trainer = build_trainer(c)
    with trainer.context():
        _, metrics = jax.eval_shape(
            trainer.jitted_step(), trainer.abstract_state(), trainer.abstract_batch()
        )
    return set(metrics)


FP8_METRICS = {f"fp8_{d}_{k}" for d in ("fwd", "bwd") for k in ("underflow", "subnormal")}


@pytest.mark.distributed
def test_the_step_reports_the_counts_only_under_quantization():
    c = load_config(overrides={**TINY_MOE, "quantization": "fp8_blockwise"})
    assert FP8_METRICS <= _metric_names(c)
    assert not FP8_METRICS & _metric_names(load_config(overrides=TINY_MOE))


@pytest.mark.distributed
@pytest.mark.extended  # the only test that runs an fp8 train step and reads its metrics
def test_a_run_logs_the_quantizers_counts(tmp_path):
    overrides = dict(TINY_MOE, steps=2, base_output_directory=str(tmp_path))
    c = load_config(overrides={**overrides, "quantization": "fp8_tensorwise"})
    summary = train(c, echo=lambda *_: None)
    records = read_metrics(summary["run_dir"])
    assert len(records) == 2
    for r in records:
        values = np.array([r[k] for k in sorted(FP8_METRICS)])
        assert np.all(np.isfinite(values)) and np.all((values >= 0) & (values <= 1)), r
    # the backward's gradients are small: some flush under one scale per tensor
    assert records[0]["fp8_bwd_underflow"] > 0
