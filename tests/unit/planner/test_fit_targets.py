"""The fit search's new dimensions compiled for a TPU and a GPU target (compile only, skipped
without the compilers): the search finds a plan and records its estimate's error per compile;
offloaded state the GPU program keeps on device is not subtracted from its peak. (Offloaded
activations and state in the programs' pinned host memory: test_targets.py.)"""

from __future__ import annotations

import pytest

from expertax.planner import fit, fit_table, plan
from expertax.preflight import load_config
from expertax.targets import compiler_available, parse_target, prepare_process

SMALL = dict(
    model_name="deepseek3-tiny",
    base_num_decoder_layers=3,
    per_device_batch_size=2,
    max_target_length=128,
    dtype="bfloat16",
)
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


def test_state_the_gpu_program_keeps_on_device_is_not_subtracted():
    xla = {"argument": 5, "output": 0, "alias": 0, "temp": 1, "host_argument": 0, "host_temp": 0}
    offloaded = load_config(overrides={**SMALL, "optimizer_memory_host_offload": True})
    assert plan.device_peak(offloaded, None, xla, on="gpu")[0] == 6


# two or three compiles per target: CI's extended run (the targets' search spaces are tested in
# test_fit_space.py; the search on a target runs only here)
@pytest.mark.extended
@pytest.mark.parametrize("spec", TARGETS)
def test_fit_finds_the_fastest_plan_that_fits(spec):
    t = _target(spec)
    c = load_config(overrides={**SMALL, "per_device_batch_size": 8})
    hbm = 0.25
    r = fit.fit_search(c, t.count, hbm, hardware=t, max_compiles=3, minutes=5, log=lambda s: None)
    assert r["fits"], fit_table.format_fit(r)
    best = r["best"]
    assert best["peak_device_bytes"] <= r["target_bytes"]
    compiled = [x for x in r["candidates"] if x["peak_device_bytes"] is not None]
    assert 1 <= len(compiled) == r["compiled"] <= 3
    assert all(x["estimate_error"] is not None for x in compiled)
    # Ranked by the step time predicted from each compiled program (collectives included)
    assert all(x.get("predicted_step_s") for x in compiled if not x["error"])
    fitting = [x for x in compiled if x["fits"] and not x["error"]]
    assert best["predicted_step_s"] == min(x["predicted_step_s"] for x in fitting)
    # Stopped for want of candidates: none faster than the plan is estimated to fit (an estimate
    # scaled by what the compiled programs' predictions say it misses).
    if r["stopped"] == "no candidate left that may fit":
        faster = [
            x
            for x in r["candidates"]
            if x["peak_device_bytes"] is None
            and x["step"]["seconds"] * r["time_scale"] < best["predicted_step_s"]
        ]
        assert faster == []
    text = fit_table.format_fit(r)
    assert "FITS:" in text and "est err" in text and r["train_line"] in text
    assert "predicted from the compiled program, not measured" in text
