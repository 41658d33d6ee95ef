"""`attention_impl`: what `auto` picks per platform and the evidence table it reads, the dispatch's
refusals, and the config checks (cuDNN's padded head dims and dtype; a one-platform kernel asked
for on the other platforms, refused before anything is traced)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from expertax import platform, targets
from expertax.config import ConfigError
from expertax.nn.attention import cudnn, evidence, kernel
from expertax.nn.attention.kernel import attend, resolve
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer
from tests.unit.nn.attention.targets import needs_tpu

LONG = kernel.AUTO_BLOCKWISE_MIN_LENGTH


@pytest.mark.parametrize(
    "on, length, qk, v, dtype, cudnn_ok, want",
    [
        ("cpu", LONG - 1, 128, 128, jnp.bfloat16, True, "dot"),
        ("cpu", LONG, 128, 128, jnp.bfloat16, True, "blockwise"),
        ("gpu", 64, 128, 128, jnp.bfloat16, True, "cudnn"),  # at any length
        ("gpu", LONG, 192, 128, jnp.bfloat16, True, "cudnn"),  # MLA, v padded
        ("gpu", LONG, 128, 128, jnp.float32, True, "blockwise"),  # cuDNN takes 16-bit only
        ("gpu", LONG - 1, 128, 128, jnp.float32, True, "dot"),
        ("gpu", LONG, 128, 128, jnp.bfloat16, False, "blockwise"),  # no cuDNN installed
        ("tpu", LONG, 192, 128, jnp.bfloat16, True, "splash"),
        ("tpu", LONG, 32, 32, jnp.float32, True, "splash"),
        ("tpu", LONG - 1, 192, 128, jnp.bfloat16, True, "dot"),
    ],
)
def test_auto_per_platform(on, length, qk, v, dtype, cudnn_ok, want, monkeypatch):
    monkeypatch.setattr(cudnn, "available", lambda: cudnn_ok)
    monkeypatch.setattr(cudnn, "head_dim_limit", lambda: cudnn.MAX_HEAD_DIM)  # an H100 host
    assert resolve("auto", length=length, qk_dim=qk, v_dim=v, dtype=dtype, on=on) == want
    explicit = resolve("blockwise", length=length, qk_dim=qk, v_dim=v, dtype=dtype, on=on)
    assert explicit == "blockwise"


def test_gpu_target_compiled_from_a_cpu_machine_keeps_mla_off_cudnn(monkeypatch):
    """JAX holds cuDNN to 128 when its default backend is no Hopper GPU: MLA's 192 falls back."""
    monkeypatch.setattr(cudnn, "available", lambda: True)
    args = dict(length=LONG, v_dim=128, dtype=jnp.bfloat16, on="gpu")
    assert resolve("auto", qk_dim=192, **args) == "blockwise"
    assert resolve("auto", qk_dim=128, **args) == "cudnn"


def test_evidence_says_measured_only_where_a_time_was_taken():
    """CPU's choice was timed; GPU's and TPU's were compiled only, and their compiled rows name
    the kernel they picked, with fewer temporaries than dot's [T, S] scores."""
    assert evidence.AUTO["cpu"].basis == evidence.MEASURED
    for on in ("gpu", "tpu"):
        choice = evidence.AUTO[on]
        assert choice.basis == evidence.COMPILED and "measured" not in choice.evidence
        picked = choice.kernel or choice.long
        rows = {(r.case, r.impl): r for r in choice.compiled}
        for case in ("deepseek3", "mixtral"):
            assert rows[case, picked].kernel != "-" and rows[case, "dot"].kernel == "-"
            assert rows[case, picked].temp_mib < rows[case, "dot"].temp_mib / 8
            assert rows[case, picked].counted_gflop is None  # inside the kernel: not counted
    for choice in evidence.AUTO.values():
        assert {choice.short, choice.long} <= set(kernel.IMPLEMENTATIONS)


def test_dispatch_refuses_unknown_and_other_platforms_kernels():
    q = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        attend(q, q, q, scale=0.5, impl="flash")
    assert jax.default_backend() == "cpu"
    for impl, needs in (("splash", "TPU"), ("cudnn", "GPU")):
        with pytest.raises(ValueError, match=f"attention_impl={impl} needs a {needs}"):
            attend(q, q, q, scale=0.5, impl=impl)
    with platform.use("gpu"), pytest.raises(ValueError, match="splash needs a TPU"):
        attend(q, q, q, scale=0.5, impl="splash")


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"model_name": "mixtral-tiny", "dtype": "float32"}, ["attention_impl=cudnn", "float32"]),
        ({"model_name": "mixtral-tiny", "head_dim": 260}, ["attention_impl=cudnn", "264", "256"]),
    ],
)
def test_cudnn_config_check_names_key_and_value(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides={**overrides, "attention_impl": "cudnn"})
    for w in words:
        assert w in str(err.value)
    load_config(overrides={**overrides, "attention_impl": "blockwise"})  # control


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_name": "deepseek3-tiny"},  # MLA: q/k 48, v 32 -> 48
        {"model_name": "mixtral-tiny", "head_dim": 20},  # -> 24
    ],
)
def test_cudnn_config_check_accepts_what_padding_fixes(overrides):
    c = load_config(overrides={**overrides, "dtype": "bfloat16", "attention_impl": "cudnn"})
    assert c.attention_impl == "cudnn"


@pytest.mark.parametrize(
    "impl, valid", [("splash", "auto, dot, blockwise"), ("cudnn", "blockwise")]
)
def test_one_platform_kernel_refused_on_cpu_devices(impl, valid):
    c = load_config(overrides={"model_name": "mixtral-tiny", "dtype": "bfloat16"})
    with pytest.raises(ConfigError) as err:
        build_trainer(c.model_copy(update={"attention_impl": impl}), jax.devices()[:1])
    assert f"attention_impl={impl}" in str(err.value) and "are cpu" in str(err.value)
    assert valid in str(err.value)
    build_trainer(c.model_copy(update={"attention_impl": "blockwise"}), jax.devices()[:1])


@needs_tpu
def test_tpu_devices_take_splash_and_refuse_cudnn():
    c = load_config(overrides={"model_name": "mixtral-tiny", "dtype": "bfloat16"})
    devices = targets.parse_target("tpu:v5p-16").devices()
    build_trainer(c.model_copy(update={"attention_impl": "splash"}), devices)
    with pytest.raises(ConfigError, match="valid here: auto, dot, blockwise, splash"):
        build_trainer(c.model_copy(update={"attention_impl": "cudnn"}), devices)


def test_evidence_rows_are_the_committed_benchmark_output():
    """evidence.COMPILED_ROWS are the fwd+bwd rows of the raw benchmark file, not retyped."""
    raw = Path(__file__).parents[4] / "benchmarks/results/attention"
    rows = [json.loads(line) for line in (raw / evidence.RAW_FILE).read_text().splitlines()]
    runs = {(r["target"].split(":")[0], r["case"], r["impl"], r["mode"]): r for r in rows}
    for on, compiled in evidence.COMPILED_ROWS.items():
        for row in compiled:
            r = runs[on, row.case, row.impl, "fwd+bwd"]
            assert r["segments"] and r["T"] == 4096 and r["status"] == evidence.COMPILED
            assert round(r["temp_bytes"] / 2**20, 1) == row.temp_mib
            model = r["kernel_flops_model"]
            assert row.model_gflop == (None if model is None else round(model / 1e9, 1))
            counted = None if r["unknown_loops"] or r["opaque"] else r["counted_flops"]
            assert row.counted_gflop == (None if counted is None else round(counted / 1e9, 1))
            assert (row.kernel == "-") == (not r["kernels"] or r["kernels"] == ["AllocateBuffer"])
