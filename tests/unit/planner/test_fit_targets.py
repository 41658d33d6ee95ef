"""The fit search's new dimensions compiled for a TPU and a GPU target (compile only, skipped
without the compilers): offloaded activations are held in pinned host memory and counted from
the program; offloaded state the GPU compile does not hold is reported, not subtracted; the
search finds a plan and records its estimate's error per compile."""

from __future__ import annotations

import pytest

from expertax.config import load_config
from expertax.planner import fit, plan
from expertax.planner.estimate import Estimator
from expertax.targets import compiler_available, parse_target, prepare_process

SMALL = dict(
    model_name="deepseek3-tiny",
    base_num_decoder_layers=3,
    per_device_batch_size=2,
    max_target_length=128,
    dtype="bfloat16",
)
OFFLOAD_2 = dict(remat_policy="custom", decoder_layer_input="offload", out_proj="offload")
SHAPE = {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
TARGETS = [
    pytest.param(
        "tpu:v5p-16",
        marks=pytest.mark.skipif(not compiler_available("tpu"), reason="expertax[tpu] missing"),
    ),
    pytest.param(
        "gpu:h100x8",
        marks=pytest.mark.skipif(not compiler_available("gpu"), reason="expertax[gpu] missing"),
    ),
]


def _target(spec):
    t = parse_target(spec)
    prepare_process(t)
    return t


@pytest.mark.parametrize("spec", TARGETS)
def test_offloaded_activations_are_the_programs_host_bytes(spec):
    t = _target(spec)
    c = load_config(overrides={**SMALL, **OFFLOAD_2})
    peak, extra = fit.default_compile(c, t.hbm_gib, t.devices(), t)
    measured = extra["measured"]
    assert extra["not_honoured"] == []
    terms = Estimator(c, t.platform).terms(
        {"sharding_rules": "default", "num_vocab_tiling": 1, **OFFLOAD_2}, SHAPE
    )
    # The two saved [B, T, D] names of every layer but the first (outside the scan) on host.
    assert 0.5 * terms.residual_host <= measured.host <= 1.5 * terms.residual_host
    assert measured.peak == peak and measured.args + measured.temp == peak


def test_state_offload_the_gpu_compile_does_not_hold_is_reported():
    if not compiler_available("gpu"):
        pytest.skip("expertax[gpu] missing")
    t = _target("gpu:h100x8")
    plain = load_config(overrides=SMALL)
    offloaded = load_config(overrides={**SMALL, "optimizer_memory_host_offload": True})
    peak, _ = fit.default_compile(plain, t.hbm_gib, t.devices(), t)
    peak_off, extra = fit.default_compile(offloaded, t.hbm_gib, t.devices(), t)
    assert extra["measured"].host == 0
    assert "optimizer_memory_host_offload=true: not honoured" in extra["not_honoured"][0]
    # The program's own figure: nothing taken out for state it keeps on device.
    assert peak_off >= 0.95 * peak
    assert (
        plan.device_peak(
            offloaded,
            None,
            {"argument": 5, "output": 0, "alias": 0, "temp": 1, "host_argument": 0, "host_temp": 0},
            on="gpu",
        )[0]
        == 6
    )


@pytest.mark.extended  # two or three compiles per target
@pytest.mark.parametrize("spec", TARGETS)
def test_fit_finds_the_fastest_plan_that_fits(spec):
    t = _target(spec)
    c = load_config(overrides={**SMALL, "per_device_batch_size": 8})
    hbm = 0.25
    r = fit.fit_search(c, t.count, hbm, hardware=t, max_compiles=3, minutes=5, log=lambda s: None)
    assert r["fits"], fit.format_fit(r)
    best = r["best"]
    assert best["peak_device_bytes"] <= r["target_bytes"]
    compiled = [x for x in r["candidates"] if x["peak_device_bytes"] is not None]
    assert 1 <= len(compiled) == r["compiled"] <= 3
    assert all(x["estimate_error"] is not None for x in compiled)
    # Stopped for want of candidates: none faster than the plan is estimated to fit.
    if r["stopped"] == "no candidate left that may fit":
        faster = [
            x
            for x in r["candidates"]
            if x["peak_device_bytes"] is None and x["step"]["seconds"] < best["step"]["seconds"]
        ]
        assert faster == []
    text = fit.format_fit(r)
    assert "FITS:" in text and "est err" in text and r["train_line"] in text
