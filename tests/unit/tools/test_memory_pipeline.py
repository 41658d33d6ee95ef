"""`expertax memory` with pipeline stages: the schedule, per-stage state bytes, the report."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from expertax import cli
from expertax.config import load_config
from expertax.tools import memory_pipeline
from expertax.tools.memory import _fmt, format_report, memory_report
from expertax.train.state import TrainState

MIXTRAL = ["model_name=mixtral-tiny", "max_target_length=16", "per_device_batch_size=1"]


def _cfg(*overrides: str):
    return load_config(overrides=[*MIXTRAL, *overrides])


def test_stack_layers_per_device():
    """One stage's share of the pipelined layers plus the stack's layers after the pipeline;
    the other stack and unpipelined configs keep all their layers."""
    assert memory_pipeline.stack_layers_per_device(_cfg(), moe=True) == 2
    c = _cfg("base_num_decoder_layers=8", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
    assert memory_pipeline.stack_layers_per_device(c, moe=True) == 4
    c = _cfg(
        "base_num_decoder_layers=8",
        "ici_pipeline_parallelism=4",
        "num_pipeline_repeats=2",
        "pipeline_parallel_layers=8",
    )
    assert memory_pipeline.stack_layers_per_device(c, moe=True) == 2
    c = _cfg(
        "base_num_decoder_layers=7", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=4"
    )
    assert memory_pipeline.stack_layers_per_device(c, moe=True) == 2 + 3  # 4 / 2 + the other 3
    deepseek = load_config(overrides=["model_name=deepseek3-tiny", "ici_pipeline_parallelism=2"])
    assert memory_pipeline.stack_layers_per_device(deepseek, moe=True) == 1
    assert memory_pipeline.stack_layers_per_device(deepseek, moe=False) == 1  # outside it
    llama = load_config(overrides=["model_name=llama-tiny", "ici_pipeline_parallelism=2"])
    assert memory_pipeline.stack_layers_per_device(llama, moe=False) == 1


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
    p = memory_pipeline.pipeline_report(c, state)
    assert p is not None
    assert (p["stages"], p["microbatches"], p["repeats"], p["stack"]) == (2, 2, 2, "moe")
    assert (p["pipelined_layers"], p["layers_per_stage"], p["layers_per_stage_per_repeat"]) == (
        8,
        4,
        2,
    )
    assert p["unpipelined_layers"] == 0 and p["shift"] == "roll"
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
    assert "no parameter is sharded over the pipeline axis" not in text
    # Negative control: nothing over the pipeline axis is said to be so.
    flat = jax.tree.map(lambda x: _abstract(mesh, x.shape, (), x.dtype), params)
    p = memory_pipeline.pipeline_report(c, TrainState(None, flat, {}, None))
    assert p is not None and p["stage_parameter_bytes"] == 0 and not p["sharded_over_stages"]
    assert "no parameter is sharded over the pipeline axis" in "\n".join(
        memory_pipeline.format_pipeline(p, _fmt)
    )
    assert memory_pipeline.pipeline_report(_cfg(), state) is None


@pytest.fixture(scope="module")
def pp_report():
    c = _cfg("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "sparse_matmul=false")
    return c, memory_report(c, top=0)


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
    assert {res["layers"] for res in r["residuals"]} == {1}  # one of the 2 layers per stage
    text = format_report(r)
    assert (
        "pipeline: 2 stages x 2 microbatches, shift=roll; 2 pipelined MoE layers, 1 per stage"
        in (text)
    )
    assert "bubble fraction (S - 1) / (M R + S - 1) = 0.333" in text
    assert json.loads(json.dumps(r["pipeline"])) == p


def test_report_without_stages_has_no_pipeline_part(pp_report):
    r = {**pp_report[1], "pipeline": None}
    assert "pipeline:" not in format_report(r) and "bubble" not in format_report(r)


def test_cli_json_has_the_pipeline(tmp_path, capsys, monkeypatch, pp_report):
    """The CLI prints the pipeline lines and writes its fields to --json (the report is the
    fixture's: no second compile)."""
    from expertax.tools import memory

    monkeypatch.setattr(memory, "memory_report", lambda *a, **k: dict(pp_report[1]))
    path = tmp_path / "memory.json"
    assert cli.main(["memory", *MIXTRAL, "--top", "0", "--json", str(path)]) == 0
    assert "bubble fraction (S - 1) / (M R + S - 1) = 0.333" in capsys.readouterr().out
    assert json.loads(path.read_text())["pipeline"] == pp_report[1]["pipeline"]
