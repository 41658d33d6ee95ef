"""`expertax memory` with pipeline stages: the schedule, per-stage state bytes, the report."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from expertax import cli
from expertax.parallel import remat
from expertax.planner import pipeline as memory_pipeline
from expertax.planner.format import _fmt, format_report
from expertax.planner.plan import memory_report
from expertax.planner.residuals import iteration_residual_bytes, layer_residuals, stack_residuals
from expertax.preflight import load_config
from expertax.train.state import TrainState

MIXTRAL = ["model_name=mixtral-tiny", "max_target_length=16", "per_device_batch_size=1"]


def _cfg(*overrides: str):
    return load_config(overrides=[*MIXTRAL, *overrides])


def test_layers_in_and_outside_the_pipeline():
    """The pipelined stack's first pipeline_parallel_layers run in the pipeline, its others and
    the other stack outside; without stages nothing is pipelined."""

    def split(c, moe=True):
        return (
            memory_pipeline.pipelined_layers(c, moe=moe),
            memory_pipeline.layers_outside(c, moe=moe),
        )

    assert split(_cfg()) == (0, 2)
    assert split(_cfg("base_num_decoder_layers=8", "ici_pipeline_parallelism=2")) == (8, 0)
    c = _cfg(
        "base_num_decoder_layers=7", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=4"
    )
    assert split(c) == (4, 3)
    deepseek = load_config(overrides=["model_name=deepseek3-tiny", "ici_pipeline_parallelism=2"])
    assert split(deepseek) == (2, 0) and split(deepseek, moe=False) == (0, 1)
    llama = load_config(overrides=["model_name=llama-tiny", "ici_pipeline_parallelism=2"])
    assert split(llama, moe=False) == (2, 0)


def test_iterations_and_microbatch_rows():
    c = _cfg("base_num_decoder_layers=8", "ici_pipeline_parallelism=4", "num_pipeline_repeats=2")
    assert memory_pipeline.iterations(c) == 4 * 2 + 4 - 1  # M = S = 4
    c = _cfg("ici_pipeline_parallelism=2", "num_pipeline_microbatches=4")
    assert memory_pipeline.iterations(c) == 4 + 1
    assert memory_pipeline.microbatch_rows(c, 32, 4) == 2  # 32 / 4 microbatches / 4 shards
    assert memory_pipeline.microbatch_rows(c, 8, 4) == 1  # rounded up


def _abstract(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def test_pipeline_report_splits_state_by_the_pipeline_axis():
    """Leaves sharded over `pipeline` (alone or with another axis) are one stage's; the rest
    every stage holds; bytes are per device. Numbers by hand."""
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("pipeline", "fsdp"))
    params = {
        "stack": _abstract(mesh, (4, 64, 32), ("pipeline", "fsdp")),  # 4*64*32*4 / 8 = 4096
        "stack_b": _abstract(mesh, (8, 32), (("pipeline", "fsdp"),), jnp.bfloat16),  # 64 B
        "embed": _abstract(mesh, (128, 16), ("fsdp",)),  # 128*16*4 / 4 = 2048
        "norm": _abstract(mesh, (16,), ()),  # 64
    }
    opt = {"mu": params["stack"], "count": _abstract(mesh, (), (), jnp.int32)}
    state = TrainState(step=None, params=params, opt_state=opt, rng=None)
    assert memory_pipeline.stage_split(params) == (4096 + 64, 2048 + 64)
    c = _cfg("base_num_decoder_layers=8", "ici_pipeline_parallelism=2", "num_pipeline_repeats=2")
    p = memory_pipeline.pipeline_report(c, state, 3, 5000)
    assert p is not None
    assert (p["stages"], p["microbatches"], p["repeats"], p["stack"]) == (2, 2, 2, "moe")
    assert (p["pipelined_layers"], p["layers_per_stage"], p["layers_per_stage_per_repeat"]) == (
        8,
        4,
        2,
    )
    assert p["unpipelined_layers"] == 0 and p["shift"] == "roll" and p["iterations"] == 5
    assert p["saved_inputs"] == 4
    assert p["microbatch_rows_per_device"] == 3 and p["iteration_residual_bytes"] == 5000
    assert p["iteration_input_bytes"] == 3 * 16 * 128 * 4  # rows x T x D x float32
    assert p["bubble_fraction"] == pytest.approx(1 / (2 * 2 + 1))
    assert (p["stage_parameter_bytes"], p["shared_parameter_bytes"]) == (4160, 2112)
    assert (p["stage_optimizer_state_bytes"], p["shared_optimizer_state_bytes"]) == (4096, 4)
    assert p["sharded_over_stages"]
    text = "\n".join(memory_pipeline.format_pipeline(p, _fmt))
    assert "pipeline: 2 stages x 2 microbatches (2 repeats, circular), shift=roll" in text
    assert "8 pipelined MoE layers, 4 per stage, 2 per repeat" in text
    assert "bubble fraction (S - 1) / (M R + S - 1) = 0.200" in text
    assert "parameters 6.12 KiB (4.06 KiB this stage's layers + 2.06 KiB held by every stage)" in (
        text
    )
    assert (
        "5 iterations (M R + S - 1); the 4 work items (M R) each save their stage input "
        "(3 rows per device, 24.00 KiB)" in text
    )
    assert "one iteration's backward holds 4.88 KiB" in text
    assert "no parameter is sharded over the pipeline axis" not in text
    # Negative control: nothing over the pipeline axis is said to be so.
    flat = jax.tree.map(lambda x: _abstract(mesh, x.shape, (), x.dtype), params)
    p = memory_pipeline.pipeline_report(c, TrainState(None, flat, {}, None), 3, None)
    assert p is not None and p["stage_parameter_bytes"] == 0 and not p["sharded_over_stages"]
    text = "\n".join(memory_pipeline.format_pipeline(p, _fmt))
    assert "no parameter is sharded over the pipeline axis" in text and "stage_layers" in text
    assert "iterations" not in text  # remat_policy=none: no per-iteration recompute
    assert memory_pipeline.pipeline_report(_cfg(), state, 1, None) is None


_PROGRAM: dict = {}  # pp_report's saved program


@pytest.fixture(scope="module")
def pp_report(tmp_path_factory):
    c = _cfg("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "sparse_matmul=false")
    _PROGRAM["path"] = tmp_path_factory.mktemp("pp") / "step.hlo"
    return c, memory_report(c, top=0, save_program=str(_PROGRAM["path"]))


def test_the_step_time_reports_the_pipeline_loops_idle_iterations(pp_report):
    """The pipeline's loops carry their S - 1 idle iterations (`idle~1` here), which the step
    time reports as the bubble: with M = 2 and S = 2, a third of each pipeline loop."""
    from expertax import scopes, targets
    from expertax.steptime import topology
    from expertax.steptime.report import estimate

    text = _PROGRAM["path"].read_text()
    assert set(scopes.IDLE.pattern.findall(text)) == {"1"}
    r = estimate(text, topology.default_placement(targets.parse_target("gpu:h100x8")))
    loops = [lp for lp in r["loops"] if scopes.IDLE.label(1) in lp["where"]]
    assert loops and r["bubble_seconds"] > 0
    assert r["bubble_seconds"] < r["seconds"]


def test_memory_report_with_stages(pp_report):
    """The compiled report of mixtral-tiny (2 layers) over 2 stages x FSDP 4: the schedule, one
    layer's residuals per device, the per-stage split adds up to the state per device."""
    c, r = pp_report
    p = r["pipeline"]
    assert r["mesh"]["pipeline"] == 2 and r["devices"] == 8
    assert (p["stages"], p["microbatches"], p["repeats"], p["pipelined_layers"]) == (2, 2, 1, 2)
    assert p["layers_per_stage"] == 1 and p["bubble_fraction"] == pytest.approx(1 / 3)
    assert p["stage_parameter_bytes"] + p["shared_parameter_bytes"] == r["parameter_bytes"]
    total_opt = p["stage_optimizer_state_bytes"] + p["shared_optimizer_state_bytes"]
    assert total_opt == r["optimizer_state_bytes"]
    # full remat: the pipeline's VJP keeps the stage input of each of its M R = 2 work items,
    # [1 row, 16, 128] per device (not the bubble iteration's)
    assert [(x["name"], x["shape"], x["layers"]) for x in r["residuals"]] == [
        (remat.PIPELINE_ITERATION_INPUT, [1, 16, 128], 2)
    ]
    # an iteration's backward: its one layer's input, and that layer's residuals without remat
    plain = c.model_copy(update={"remat_policy": "none"})
    one = layer_residuals(plain, moe=True, batch_local=1, layers=1)
    assert p["iteration_residual_bytes"] == 1 * 16 * 128 * 4 + sum(
        x.bytes for x in one if x.placement == "device"
    )
    text = format_report(r)
    assert (
        "pipeline: 2 stages x 2 microbatches, shift=roll; 2 pipelined MoE layers, 1 per stage"
        in (text)
    )
    assert "bubble fraction (S - 1) / (M R + S - 1) = 0.333" in text
    assert json.loads(json.dumps(r["pipeline"])) == p


def test_stack_residuals_by_policy_and_partial_pipeline():
    """Layers outside the pipeline save their residuals at the per-device batch; pipelined ones,
    with remat, only each work item's stage input; with remat_policy=none every layer's residuals
    of every iteration (bubbles included) at the microbatch size."""
    c = _cfg(
        "base_num_decoder_layers=3", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=2"
    )
    res = stack_residuals(c, moe=True, batch_local=4, microbatch_rows=2)
    plain = layer_residuals(c, moe=True, batch_local=4, layers=1)
    assert [(x.name, x.shape, x.layers) for x in res] == [
        *((x.name, x.shape, 1) for x in plain),
        (remat.PIPELINE_ITERATION_INPUT, (2, 16, 128), 2),  # M R = 2 work items
    ]
    c = _cfg("ici_pipeline_parallelism=2", "remat_policy=none", "num_pipeline_microbatches=4")
    res = stack_residuals(c, moe=True, batch_local=4, microbatch_rows=1)
    per_layer = layer_residuals(c, moe=True, batch_local=1)
    # 5 iterations x 1 layer per stage
    assert [(x.name, x.shape, x.layers) for x in res] == [(x.name, x.shape, 5) for x in per_layer]
    assert remat.PIPELINE_ITERATION_INPUT not in {x.name for x in res}
    assert iteration_residual_bytes(c, 1) is None
    unstaged = stack_residuals(_cfg(), moe=True, batch_local=4, microbatch_rows=4)
    assert unstaged and {x.layers for x in unstaged} == {2}  # both layers, as before stages


def test_report_without_stages_has_no_pipeline_part(pp_report):
    r = {**pp_report[1], "pipeline": None}
    assert "pipeline:" not in format_report(r) and "bubble" not in format_report(r)


def test_cli_json_has_the_pipeline(tmp_path, capsys, monkeypatch, pp_report):
    """The CLI prints the pipeline lines and writes its fields to --json (the report is the
    fixture's: no second compile)."""
    from expertax.planner import plan

    monkeypatch.setattr(plan, "memory_report", lambda *a, **k: dict(pp_report[1]))
    path = tmp_path / "memory.json"
    assert cli.main(["memory", *MIXTRAL, "--top", "0", "--json", str(path)]) == 0
    assert "bubble fraction (S - 1) / (M R + S - 1) = 0.333" in capsys.readouterr().out
    assert json.loads(path.read_text())["pipeline"] == pp_report[1]["pipeline"]
