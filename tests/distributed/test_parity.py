"""`expertax parity` on 8 simulated devices: every layout trains the same model as one device.

Models are shrunk (layers, length, steps) and each test runs a subset of the layout matrix so
that the compiles fit the suite's time budget; `expertax parity` without --layouts runs them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from expertax import cli
from expertax.config import ConfigError
from expertax.parallel import remat
from expertax.preflight import load_config
from expertax.tools.parity import run as parity_run
from expertax.tools.parity.layouts import (
    Layout,
    default_layouts,
    layout_config,
    parse_layout,
    pipeline_misfit,
)
from expertax.tools.parity.run import make_row, parity_table
from expertax.tools.parity.table import format_row
from expertax.train.trainer import build_trainer
from tests.xla_flags import TOLERANCE_ONLY_CODEGEN, with_devices

pytestmark = pytest.mark.distributed

SMALL = ["per_device_batch_size=1", "max_target_length=16"]


def _check_rows(rows, tol, ref_scale, n):
    assert len(rows) == n
    for r in rows:
        assert set(r) == {
            "mode",
            "ring",
            "a2a_impl",
            "pp",
            "cp",
            "load_balance",
            "cp_ring",
            "microbatches",
            "repeats",
            "ep",
            "fsdp",
            "tp",
            "data",
            "stash",
            "sharding_rules",
            "final_loss",
            "perplexity",
            "tokens_per_s_per_device",
            "max_abs_loss_diff",
            "routing_flips",
            "imposed_loss_diff",
        }
        assert r["max_abs_loss_diff"] <= tol * ref_scale, r
        assert r["tokens_per_s_per_device"] > 0


def parity_child(
    argv: list[str], json_path, codegen: str = TOLERANCE_ONLY_CODEGEN
) -> subprocess.CompletedProcess:
    """`expertax parity ARGV --json JSON_PATH` in a child on 8 devices, by default with the
    tolerance-only code generation (tests/xla_flags.py): parity compares losses within
    tolerance, and each layout compiles in about 0.6 x the time. Its stdout and stderr are
    captured (stderr also holds XLA's own warnings)."""
    return subprocess.run(
        [sys.executable, "-m", "expertax.cli", "parity", *argv, "--json", str(json_path)],
        env=dict(os.environ, XLA_FLAGS=with_devices(8, codegen)),
        capture_output=True,
        text=True,
    )


def one_row(model: list[str], layout: str, tmp_path) -> dict:
    """3 steps of one `layout` of a model (its `model_name=...` overrides) against the
    one-device run, in a child: the row, checked within tolerance (losses below 10, vocab 512)."""
    path = tmp_path / "parity.json"
    run = parity_child([*model, "--steps", "3", "--layouts", layout], path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Involuntary full rematerialization" not in run.stdout + run.stderr
    report = json.loads(path.read_text())
    assert report["ok"] and report["refused"] == []
    _check_rows(report["rows"], report["tolerance"], 10.0, 1)
    row = report["rows"][0]
    print(f"\n{model[0]} {layout}: max |dloss| {row['max_abs_loss_diff']:.3g}")
    return row


def layouts_with_control(c, good: list[str], bad: str, corrupt) -> None:
    """The `good` layouts equal the one-device run of `c`; `bad` with its state changed by
    `corrupt(state, trainer)` does not (100 x the tolerance off: the negative control)."""
    layouts = [parse_layout(n) for n in (*good, bad)]
    result = parity_table(
        c, steps=3, layout_list=layouts, corrupt={layouts[-1]: corrupt}, echo=lambda *_: None
    )
    scale = max(abs(x) for x in result["reference_losses"])
    for r in result["rows"]:
        print(f"\nep{r['ep']} fsdp{r['fsdp']} tp{r['tp']}: |dloss| {r['max_abs_loss_diff']:.3g}")
    _check_rows(result["rows"][: len(good)], result["tolerance"], scale, len(good))
    assert result["rows"][-1]["max_abs_loss_diff"] > 100 * result["tolerance"] * scale
    assert not result["ok"]


def with_moe_attn(state, name: str, fn):
    """`state` with the MoE layers' attention parameter `name` replaced by `fn` of it."""
    layers = state.params.moe_layers
    old = getattr(layers.attn, name)
    attn = dataclasses.replace(layers.attn, **{name: jax.device_put(fn(old), old.sharding)})
    params = dataclasses.replace(state.params, moe_layers=dataclasses.replace(layers, attn=attn))
    return dataclasses.replace(state, params=params)


def _swap_expert_shards(ep: int):
    """Test hook: each expert shard gets the next shard's wi_0 (a mis-sharded weight)."""

    def corrupt(state, trainer):
        moe = state.params.moe_layers.moe
        shift = trainer.c.num_experts // ep
        wi_0 = jax.device_put(jnp.roll(moe.wi_0, shift, axis=1), moe.wi_0.sharding)
        moe = dataclasses.replace(moe, wi_0=wi_0)
        layers = dataclasses.replace(state.params.moe_layers, moe=moe)
        return dataclasses.replace(
            state, params=dataclasses.replace(state.params, moe_layers=layers)
        )

    return corrupt


# 150 s on 2 cores, on demand: the same layout kinds train in the extended matrix sample, mixtral
# under EP/TP/CP in the context rows, and the default run has a table and a layer-level control
@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/distributed/test_parity_matrix.py::test_parity_matrix_sample",
    "tests/distributed/test_parity_context_mixtral.py::test_context_rows_mixtral_tiny",
    "tests/distributed/test_parity.py::test_parity_pipeline_with_negative_control",
    "tests/distributed/test_ep.py::test_negative_control_swapped_expert_shards_fail",
)
def test_parity_mixtral_tiny_with_negative_control():
    c = load_config(overrides=["model_name=mixtral-tiny", "base_num_decoder_layers=1", *SMALL])
    names = [
        "sparse-ring-ep8",
        "sparse-padded-fsdp8",
        "sparse-padded-ep2-tp2-data2",
        "dense-ep4-fsdp2",
        "sparse-ring-ep4-fsdp2-stash",
    ]
    good = [parse_layout(n) for n in names]
    bad = parse_layout("sparse-padded-ep4-fsdp2")
    result = parity_table(
        c,
        steps=3,
        layout_list=[*good, bad],
        corrupt={bad: _swap_expert_shards(4)},
        echo=lambda *_: None,
    )
    scale = max(abs(x) for x in result["reference_losses"])
    _check_rows(result["rows"][:5], result["tolerance"], scale, 5)
    assert result["rows"][5]["max_abs_loss_diff"] > 100 * result["tolerance"] * scale
    assert not result["ok"]  # the mis-sharded layout fails the table


def _swap_layers(state, trainer):
    """Test hook: the MoE stack's layers in the opposite order (a pipeline that ran its stages
    out of order)."""
    flip = lambda w: jax.device_put(jnp.flip(w, axis=0), w.sharding)
    layers = jax.tree.map(flip, state.params.moe_layers)
    return dataclasses.replace(state, params=dataclasses.replace(state.params, moe_layers=layers))


@pytest.mark.extended  # a parity table of two pipelines (27 s): CI's second run
def test_parity_pipeline_with_negative_control():
    """mixtral-tiny's 2 layers over 2 stages with EP x FSDP inside them give the reference's
    losses; the same pipeline with its stages' layers swapped does not."""
    c = load_config(overrides=["model_name=mixtral-tiny", *SMALL])
    good = parse_layout("sparse-ring-pp2-ep2-fsdp2")
    bad = parse_layout("dense-pp2-fsdp4")
    # The layouts really pipeline: the stack's layer axis is split over the stages.
    trainer = build_trainer(layout_config(c, good, 8))
    layer_shardings = jax.tree.leaves(trainer.state_shardings.params.moe_layers)
    assert all(sh.spec[0] == "pipeline" for sh in layer_shardings)
    result = parity_table(
        c, steps=3, layout_list=[good, bad], corrupt={bad: _swap_layers}, echo=lambda *_: None
    )
    assert result["refused"] == []
    scale = max(abs(x) for x in result["reference_losses"])
    _check_rows(result["rows"][:1], result["tolerance"], scale, 1)
    assert (result["rows"][0]["pp"], result["rows"][0]["microbatches"]) == (2, 2)
    assert result["rows"][1]["max_abs_loss_diff"] > 100 * result["tolerance"] * scale
    assert not result["ok"]


def test_parity_cli_exit_status_on_failure(monkeypatch, capsys):
    row = {
        "mode": "sparse",
        "ring": False,
        "a2a_impl": "padded",
        "ep": 8,
        "fsdp": 1,
        "tp": 1,
        "data": 1,
        "stash": False,
        "final_loss": 1.0,
        "perplexity": 2.7,
        "tokens_per_s_per_device": 1.0,
        "max_abs_loss_diff": 1.0,
    }
    fake = {"rows": [row], "tolerance": 1e-5, "reference_losses": [1.0], "ok": False}
    monkeypatch.setattr(parity_run, "parity_table", lambda *a, **k: fake)
    assert cli.main(["parity", "model_name=mixtral-tiny", "--layouts", "sparse-padded-ep8"]) == 1
    assert "| NO |" in capsys.readouterr().out


def test_layout_matrix_and_parsing():
    rows = default_layouts(8, "cpu")
    assert len(rows) == 30 and all(r.a2a_impl != "ragged" for r in rows)
    assert len(default_layouts(8, "gpu")) == 39
    assert [r.name for r in rows if r.cp > 1] == [
        "sparse-padded-cp2-ep2-fsdp2",
        "sparse-ring-cp4-ep2",
        "dense-cp8",
        "sparse-ring-pp2-cp2-ep2",
        "sparse-padded-cp2-ep2-tp2",
        "sparse-ring-cp4-ep2-nolb",
    ]
    assert (
        parse_layout("sparse-ring-cp4-ep2-nolb").overrides(8)["context_parallel_load_balance"]
        is False
    )
    stashed = [r.name for r in rows if r.stash]
    assert stashed == ["sparse-padded-ep4-fsdp2-stash", "sparse-ring-ep4-fsdp2-stash"]
    assert [r.name for r in default_layouts(4, "cpu") if r.stash] == [
        "sparse-padded-ep2-fsdp2-stash",
        "sparse-ring-ep2-fsdp2-stash",
    ]
    assert {(r.ep, r.fsdp, r.tp, r.data) for r in rows if r.pp == 1 and r.cp == 1} == {
        (8, 1, 1, 1),
        (1, 8, 1, 1),
        (4, 2, 1, 1),
        (2, 1, 2, 2),
        (2, 2, 2, 1),
    }
    eptp = [r.name for r in rows if r.rules == "ep-tp"]
    assert eptp == [
        "sparse-padded-ep2-fsdp2-tp2-eptp",
        "sparse-ring-ep2-fsdp2-tp2-eptp",
        "sparse-padded-ep2-tp2-data2-eptp",
        "sparse-ring-ep2-tp2-data2-eptp",
    ]
    assert parse_layout("sparse-ring-ep2-tp2-data2-eptp").overrides(8)["sharding_rules"] == "ep-tp"
    assert parse_layout("sparse-ring-ep2-tp2-data2").overrides(8)["sharding_rules"] == ("default")
    assert parse_layout("sparse-ring-ep2-tp2-data2") == Layout(
        "sparse", True, "-", ep=2, tp=2, data=2
    )
    with pytest.raises(ConfigError, match="unknown part 'xp2'.*ppN"):
        parse_layout("sparse-ep4-xp2")
    with pytest.raises(ConfigError, match="dense"):
        parse_layout("dense-ring-ep8")
    assert parse_layout("sparse-ring-ep4-fsdp2-stash") == Layout(
        "sparse", True, "-", ep=4, fsdp=2, stash=True
    )
    with pytest.raises(ConfigError, match="paged stash needs sparse"):
        parse_layout("dense-ep4-stash")


def test_stash_layout_config_keeps_moe_names():
    """A stash layout turns the stash on and, when the base keeps no MoE name, keeps them all;
    a base that already keeps one keeps its own policy. Other layouts leave both alone."""
    stash = parse_layout("sparse-padded-ep4-fsdp2-stash")
    plain = parse_layout("sparse-padded-ep4-fsdp2")
    base = load_config(overrides=["model_name=mixtral-tiny", "remat_policy=full", *SMALL])
    c = layout_config(base, stash, 8)
    assert c.moe_paged_stash and c.remat_policy == "custom"
    assert remat.stashed_names(c) == remat.STASHABLE
    c = layout_config(base, plain, 8)
    assert not c.moe_paged_stash and c.remat_policy == "full"
    own = load_config(
        overrides=["model_name=mixtral-tiny", "remat_policy=custom", "moe_mlpwo=device", *SMALL]
    )
    c = layout_config(own, stash, 8)
    assert c.moe_paged_stash and remat.stashed_names(c) == (remat.MOE_MLPWO,)


def _fake_run(base, layout, *, steps, global_batch, corrupt=None, routing=None, packed=False):
    """Stands in for training: every layout reproduces the reference losses exactly."""
    return {"losses": [2.0, 1.5][:steps], "tokens_per_s_per_device": 1.0}


MIXTRAL = ["model_name=mixtral-tiny", "base_num_decoder_layers=1", *SMALL, "--steps", "2"]


def test_refused_layout_fails_the_table_unless_skipped(monkeypatch, tmp_path, capsys):
    """ep3 does not divide mixtral-tiny's 8 experts: the config checks refuse it. The real
    refusal check runs; training is faked so that only the verdict logic is under test."""
    monkeypatch.setattr(parity_run, "run_layout", _fake_run)
    path = tmp_path / "parity.json"
    argv = ["parity", *MIXTRAL, "--layouts", "sparse-padded-ep2,sparse-padded-ep3"]
    assert cli.main([*argv, "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    assert (
        "| sparse | False | padded | 1 | 1 | 3 | 1 | 1 | 1 | no | default | - | - | - | - | - | "
        "- | NO (refused: " in out
    )
    assert "num_experts=8 is not divisible by the expert axis (3" in out
    assert "1 refused" in err
    saved = json.loads(path.read_text())
    assert [r["layout"] for r in saved["refused"]] == ["sparse-padded-ep3"]
    assert saved["ok"] is False and len(saved["rows"]) == 1

    assert cli.main([*argv, "--skip-refused", "--json", str(path), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "| - | skipped (refused: num_experts=8 is not divisible" in out
    assert "| sparse | False | padded | 1 | 1 | 2 | 1 | 1 | 1 | no | default | 1.500000 |" in out
    saved = json.loads(path.read_text())
    assert saved["ok"] is True and saved["skip_refused"] is True

    # Negative control: a row out of tolerance still fails with --skip-refused.
    bad = lambda *a, **k: {**_fake_run(*a, **k), "losses": [2.0, 1.6]}  # noqa: E731
    calls = iter([_fake_run, bad])
    monkeypatch.setattr(parity_run, "run_layout", lambda *a, **k: next(calls)(*a, **k))
    assert cli.main([*argv, "--skip-refused"]) == 1


def test_every_layout_refused_fails_even_when_skipped(monkeypatch, capsys):
    def no_training(*a, **k):
        raise AssertionError("nothing should train when every layout is refused")

    monkeypatch.setattr(parity_run, "run_layout", no_training)
    layouts = "sparse-padded-ep3,dense-tp3,sparse-padded-ep16"
    assert cli.main(["parity", *MIXTRAL, "--layouts", layouts]) == 1
    out, err = capsys.readouterr()
    assert out.count("NO (refused: ") == 3 and "0 layouts compared, 3 refused" in err
    assert "but 8 devices are available" in out  # ep16: more devices than visible
    assert cli.main(["parity", *MIXTRAL, "--layouts", layouts, "--skip-refused"]) == 1
    assert capsys.readouterr().out.count("skipped (refused: ") == 3


def test_layout_names_round_trip():
    for backend in ("cpu", "gpu"):
        for layout in default_layouts(8, backend):
            assert parse_layout(layout.name, backend) == layout, layout.name
    ring = parse_layout("sparse-ring-cp4-ep2-nolb-cpring")
    assert ring.cp_ring and not ring.balance and ring.name == "sparse-ring-cp4-ep2-nolb-cpring"
    assert ring.overrides(8)["context_parallel_strategy"] == "ring"
    with pytest.raises(ConfigError, match="add cpN"):
        parse_layout("sparse-ring-ep2-cpring")


def test_pipeline_layouts_in_the_matrix():
    """The pipelined rows: 2 stages with EP x FSDP inside (every sparse dispatch), 4 stages with EP,
    the dense dispatch over 2 stages x FSDP, a circular ring; scaled down, a mesh left with one
    stage is not a pipeline row, and no scaled mesh appears twice."""
    staged = [r.name for r in default_layouts(8, "cpu") if r.pp > 1 and r.cp == 1]
    assert staged == [
        "sparse-padded-pp2-ep2-fsdp2",
        "sparse-ring-pp2-ep2-fsdp2",
        "sparse-padded-pp4-ep2",
        "sparse-ring-pp4-ep2",
        "dense-pp2-fsdp4",
        "sparse-ring-pp2-r2-ep2-fsdp2",
    ]
    assert all(r.num_devices == 8 for r in default_layouts(8, "cpu"))
    assert [r.name for r in default_layouts(4, "gpu") if r.pp > 1 and r.cp == 1] == [
        "sparse-ragged-pp2-fsdp2",  # the pipeline is halved last among equal axes
        "sparse-padded-pp2-fsdp2",
        "sparse-ring-pp2-fsdp2",
        "sparse-ragged-pp2-ep2",
        "sparse-padded-pp2-ep2",
        "sparse-ring-pp2-ep2",
        "dense-pp2-fsdp2",
        "sparse-ring-pp2-r2-fsdp2",
    ]
    two = [r.name for r in default_layouts(2, "cpu")]
    assert len(two) == len(set(two))
    assert [n for n in two if "pp" in n and "cp" not in n] == [
        "sparse-padded-pp2",
        "sparse-ring-pp2",
        "dense-pp2",
        "sparse-ring-pp2-r2",
    ]
    assert not [r for r in default_layouts(1, "cpu") if r.pp > 1]


def test_pipeline_layout_names():
    layout = parse_layout("sparse-ring-pp2-ep2-fsdp2")
    assert layout == Layout("sparse", True, "-", pp=2, ep=2, fsdp=2)
    assert layout.num_devices == 8 and layout.pipeline_microbatches == 2
    o = layout.overrides(8)
    assert (o["ici_pipeline_parallelism"], o["num_pipeline_microbatches"]) == (2, -1)
    assert (o["num_pipeline_repeats"], o["per_device_batch_size"]) == (1, 1.0)
    # Parts in any order; the name puts the schedule after the dispatch.
    layout = parse_layout("dense-fsdp2-r2-mb4-pp2")
    assert layout == Layout("dense", False, "-", pp=2, fsdp=2, microbatches=4, repeats=2)
    assert layout.name == "dense-pp2-mb4-r2-fsdp2"
    assert layout.pipeline_microbatches == 4 and layout.num_devices == 4
    o = layout.overrides(8)
    assert (o["num_pipeline_microbatches"], o["num_pipeline_repeats"]) == (4, 2)
    assert parse_layout("sparse-padded-ep8").overrides(8)["ici_pipeline_parallelism"] == 1
    for name in ("sparse-ring-pp2-mb4-ep2", "dense-pp4-r2", "sparse-padded-pp2-ep2-fsdp2"):
        assert parse_layout(name).name == name
    with pytest.raises(ConfigError, match="'sparse-ring-mb4-ep2': mbM .*add ppN"):
        parse_layout("sparse-ring-mb4-ep2")
    with pytest.raises(ConfigError, match="rR .*add ppN"):
        parse_layout("sparse-ring-pp1-r2-ep2")
    with pytest.raises(ConfigError, match="'pp0' must be a positive pp size"):
        parse_layout("sparse-ring-pp0-ep2")
    with pytest.raises(ConfigError, match="unknown part 'ppx'"):
        parse_layout("sparse-ring-ppx")


def test_pipeline_misfit_per_model():
    """A layout's stages x repeats must divide the model's pipelined layers: mixtral-tiny (2
    layers) and deepseek3-tiny (2 MoE layers after its dense one) take 2 stages only."""
    mixtral = load_config(overrides=["model_name=mixtral-tiny", *SMALL])
    deepseek = load_config(overrides=["model_name=deepseek3-tiny", *SMALL])
    one_moe = load_config(overrides=["model_name=deepseek3-tiny", "base_num_decoder_layers=2"])
    four = load_config(overrides=["model_name=mixtral-tiny", "base_num_decoder_layers=4"])
    pp2, pp4 = parse_layout("sparse-ring-pp2-ep2"), parse_layout("sparse-ring-pp4")
    circular = parse_layout("sparse-ring-pp2-r2-ep2")
    for c in (mixtral, deepseek):
        assert pipeline_misfit(c, pp2) is None
        assert pipeline_misfit(c, parse_layout("sparse-ring-ep8")) is None
        assert "2 pipelined MoE layers do not divide into 4 stages x 1" in str(
            pipeline_misfit(c, pp4)
        )
        assert "into 2 stages x 2 repeats" in str(pipeline_misfit(c, circular))
    assert "1 pipelined MoE layers" in str(pipeline_misfit(one_moe, pp2))
    assert [pipeline_misfit(four, x) for x in (pp2, pp4, circular)] == [None] * 3
    llama = load_config(overrides=["model_name=llama-tiny", "base_num_decoder_layers=3"])
    assert "3 pipelined dense layers" in str(pipeline_misfit(llama, pp2))


def test_default_matrix_skips_pipelines_the_model_cannot_take(monkeypatch, tmp_path, capsys):
    """The default matrix lists a pipeline layout whose stages do not divide the model's layers
    as skipped, without failing the table or building it; named in --layouts, the same layout is
    refused by the config checks (training is faked: only the bookkeeping is under test)."""
    monkeypatch.setattr(parity_run, "run_layout", _fake_run)
    matrix = [parse_layout(n) for n in ("sparse-padded-ep2", "sparse-ring-pp4-ep2")]
    monkeypatch.setattr(parity_run, "default_layouts", lambda n, backend: matrix)
    path = tmp_path / "parity.json"
    assert cli.main(["parity", *MIXTRAL, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped sparse-ring-pp4-ep2: this model's 1 pipelined MoE layers" in out
    assert (
        "| sparse | True | - | 4 | 1 | 2 | 1 | 1 | 1 | no | default | - | - | - | - | - | - | "
        "skipped (model:" in out
    )
    saved = json.loads(path.read_text())
    assert saved["ok"] is True and saved["refused"] == []
    assert [r["layout"] for r in saved["skipped"]] == ["sparse-ring-pp4-ep2"]
    assert [(r["pp"], r["microbatches"], r["repeats"]) for r in saved["rows"]] == [(1, 1, 1)]
    # Negative control: asked for by name, the same layout is refused and fails the table.
    assert cli.main(["parity", *MIXTRAL, "--layouts", "sparse-ring-pp4-ep2"]) == 1
    out = capsys.readouterr().out
    assert "NO (refused: ici_pipeline_parallelism x dcn_pipeline_parallelism = 4 stages" in out


def test_pipeline_row_fields_and_pp_column():
    layout = parse_layout("sparse-ring-pp2-mb4-r2-ep2-fsdp2")
    row = make_row(layout, {"losses": [2.0, 1.5], "tokens_per_s_per_device": 3.0}, [2, 2])
    assert (row["pp"], row["microbatches"], row["repeats"]) == (2, 4, 2)
    assert format_row(row, 1e-5, [2.0, 1.5]).startswith(
        "| sparse | True | - | 2 mb4 r2 | 1 | 2 | 2 | 1 | 1 | no | default | 1.500000 |"
    )
    run = {"losses": [2.0, 1.5], "tokens_per_s_per_device": 3.0}
    plain = make_row(parse_layout("dense-pp2-fsdp4"), run, [2.0, 1.5])
    assert (plain["pp"], plain["microbatches"], plain["repeats"]) == (2, 2, 1)
    assert "| dense | False | - | 2 | 1 | 1 | 4 |" in format_row(plain, 1e-5, [2.0, 1.5])
    old = {k: v for k, v in row.items() if k not in ("pp", "microbatches", "repeats")}
    assert format_row(old, 1e-5, [2.0, 1.5]).startswith("| sparse | True | - | 1 | 1 | 2 |")
