"""`expertax report`: every plot from a real short run, the page, refusals, no JAX backend."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from tests.unit.train.test_observe import config

from expertax.cli import main
from expertax.config import ConfigError
from expertax.tools.report import _series, make_report, summarize
from expertax.train.loop import train

PLOTS = (
    "loss.png",
    "throughput.png",
    "expert_load_heatmap.png",
    "expert_load_layer1.png",
    "expert_load_balance.png",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, persistent_compile_cache) -> Path:
    """A real short run (the observe tests' config: its step is in the compilation cache)."""
    c = config(tmp_path_factory.mktemp("report"), run_name="reported", profiler="")
    return Path(train(c, echo=lambda *_: None)["run_dir"])


def distinct_colours(png: Path, crop: bool = False) -> int:
    """Distinct RGB colours of the image (`crop`: of its middle, inside the heatmap's axes)."""
    pixels = imread(png)[..., :3]
    if crop:
        h, w = pixels.shape[:2]
        pixels = pixels[int(0.3 * h) : int(0.7 * h), int(0.15 * w) : int(0.7 * w)]
    return len(np.unique(np.round(pixels.reshape(-1, 3) * 255).astype(np.uint8), axis=0))


def test_report_renders_every_plot_and_the_page(run_dir, tmp_path):
    result = make_report(run_dir, out_dir=tmp_path / "out", layer=1)
    out = result["out_dir"]
    assert sorted(p.name for p in result["plots"].values()) == sorted(PLOTS)
    for name in PLOTS:
        png = out / name
        assert png.stat().st_size > 5_000, name
        image = imread(png)
        assert image.shape[0] > 200 and image.shape[1] > 300, name
        assert distinct_colours(png) > 30, name  # curves, colour maps, text: not one colour
    page = (out / "index.html").read_text()
    for name in PLOTS:
        assert f'src="{name}"' in page
    assert "num_experts: 4" in page and "final eval loss" in page
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert result["summary"]["final loss"] == last["loss"]
    assert result["summary"]["final eval loss"] == last["eval_loss"]


def test_report_heatmap_has_the_loads_colour_range(run_dir, tmp_path):
    """Negative control for the pixel check: a run whose loads are all equal renders the heatmap
    cells in one colour; the real loads in many."""
    import shutil

    flat = tmp_path / "flat"
    shutil.copytree(run_dir, flat, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    lines = (flat / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        if "expert_load" in r:
            r["expert_load"] = [[7] * len(layer) for layer in r["expert_load"]]
    (flat / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    real = make_report(run_dir, out_dir=tmp_path / "real")["plots"]["expert_load_heatmap"]
    even = make_report(flat, out_dir=tmp_path / "even")["plots"]["expert_load_heatmap"]
    assert distinct_colours(even, crop=True) == 1
    assert distinct_colours(real, crop=True) >= 4


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(ConfigError, match="is not an expertax run folder: no metrics.jsonl"):
        make_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    assert "not an expertax run folder" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_report_refuses_a_layer_out_of_range(run_dir, tmp_path):
    with pytest.raises(ConfigError, match="--layer=2: the run has 2 MoE layers; use 0..1"):
        make_report(run_dir, out_dir=tmp_path, layer=2)


def test_report_needs_no_jax_backend(run_dir, tmp_path):
    """The command in a fresh interpreter whose JAX platform does not exist: any backend use
    would fail; the report is written all the same."""
    env = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[3] / "src"), *sys.path])
    out = tmp_path / "nojax"
    cmd = [sys.executable, "-m", "expertax.cli", "report", str(run_dir), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "expert_load_heatmap.png").stat().st_size > 5_000


def test_a_null_loss_is_reported_as_not_finite():
    """metrics.jsonl writes a non-finite loss as null (expertax/jsonio.py): the summary says nan,
    the curve has a gap there (NaN), the finite values are kept."""
    speed = {"step_time_s": 0.5, "tokens_per_s_per_device": 100.0}
    records = [{"step": s, "loss": loss, **speed} for s, loss in enumerate([3.0, None, 2.0])]
    summary = summarize({}, records)
    assert summary["first loss"] == 3.0 and summary["final loss"] == 2.0
    summary = summarize({}, records[:2])
    assert math.isnan(summary["final loss"])
    steps, values = _series(records, "loss")
    assert steps.tolist() == [0, 1, 2] and values[0] == 3.0 and math.isnan(values[1])
    # negative control: a record without the key is left out, not drawn as a gap
    steps, _ = _series([*records, {"step": 3, **speed}], "loss")
    assert steps.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "is empty"),
        ("key: [unclosed\n", "is damaged (not valid YAML)"),
        ("apiVersion: v1\nkind: Pod\n", "is not an expertax config"),
    ],
)
def test_report_names_a_damaged_config_file(tmp_path, text, words):
    """A run folder whose config.yml is empty, not YAML or someone else's is named as such (it was
    read as no settings and reported)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (run / "config.yml").write_text(text)
    with pytest.raises(ConfigError, match=f"config.yml {re.escape(words)}"):
        make_report(run, tmp_path / "out")
    assert not (tmp_path / "out" / "index.html").exists()


def test_report_names_a_damaged_metrics_file(tmp_path):
    """A metrics.jsonl that is not UTF-8 text (bytes overwritten) is named as damaged (it was a
    UnicodeDecodeError traceback), nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yml").write_text("model_name: mixtral-tiny\nsteps: 3\n")
    (run / "metrics.jsonl").write_bytes(b"\x8e\x00garbage\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl is not UTF-8 text \(byte 0x8e at offs"):
        make_report(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
