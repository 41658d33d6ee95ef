"""The device check (benchmarks/device/) runs on the CPU as a dry run: every section, tiny
shapes, its JSON and tables written; GPU-only kernels listed as skipped, not silently absent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.xla_flags import TOLERANCE_ONLY_CODEGEN

ROOT = Path(__file__).resolve().parents[3]
CHECK = ROOT / "benchmarks" / "device" / "check.py"


@pytest.mark.extended  # a child runs every section of the device check (28 s): CI's second run
def test_the_dry_run_measures_every_section(tmp_path):
    # one CPU device, the tolerance-only code generation (a dry run times nothing it compares)
    env = dict(os.environ, XLA_FLAGS=TOLERANCE_ONLY_CODEGEN, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--out", str(tmp_path), "--budget-s", "600"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "device-check.json").read_text())
    records = doc["records"]
    sections = {r["section"] for r in records}
    assert {"host", "dense", "gmm_check", "gmm", "attention", "train", "decode", "fp8"} <= sections
    failed = [r for r in records if r["section"] == "status" and "note" in r]
    assert failed == []
    host = records[0]
    assert host["section"] == "host" and host["dry_run"] and host["platform"] == "cpu"
    gmm = [r for r in records if r["section"] == "gmm"]
    timed = {r["backend"] for r in gmm if "seconds" in r}
    assert {"dense", "ragged_dot", "tiled"} <= timed
    assert {r["backend"] for r in gmm if r.get("skipped")} == {
        "tokamax_triton",
        "tokamax_mosaic_gpu",
    }
    assert all(r["vs_dense"] > 0 for r in gmm if "vs_dense" in r)
    check = [r for r in records if r["section"] == "gmm_check"]
    assert check and all(r["max_rel_err_vs_tiled"] < 1e-5 for r in check)
    attention = [r for r in records if r["section"] == "attention" and "seconds" in r]
    assert {r["impl"] for r in attention} == {"dot", "blockwise"}
    assert {r["qk_dim"] for r in attention} == {16, 24}  # GQA and MLA's unequal head dims
    train = next(r for r in records if r["section"] == "train")
    assert train["step_s"] > 0 and train["compiled_peak_bytes"] > 0
    assert all(v == v and v < 20 for v in train["losses"])  # finite, a real model's loss
    assert next(r for r in records if r["section"] == "decode")["tokens_per_s"] > 0
    md = (tmp_path / "device-check.md").read_text()
    assert "DRY RUN" in md and "Grouped matmul" in md and "decode batch" in md
