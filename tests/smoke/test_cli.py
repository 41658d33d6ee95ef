"""The command line as a user runs it."""

import json
import os
import shutil
import subprocess
import sys

from tests.xla_flags import with_devices

METRIC_KEYS = {
    "step",
    "loss",
    "perplexity",
    "step_time_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "lb_loss",
    "dropped_tokens",
}


def run_cli(*args, cwd):
    # the command as a user runs it: XLA's default fusions on 8 devices, whichever code
    # generation this test's worker has (tests/timing.py)
    env = dict(os.environ, XLA_FLAGS=with_devices(8))
    return subprocess.run(
        [sys.executable, "-m", "expertax.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_writes_metrics_and_config(tmp_path):
    r = run_cli("train", "steps=3", "run_name=smoke", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "smoke"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [rec["step"] for rec in records] == [0, 1, 2]
    for rec in records:
        assert METRIC_KEYS <= set(rec)
        assert rec["loss"] > 0 and rec["tokens_per_s_per_device"] > 0
    assert "model_name: deepseek3-tiny" in (run_dir / "config.yml").read_text()
    assert "done: loss" in r.stdout

    # The same command again resumes from the last checkpoint: here, nothing is left to do.
    again = run_cli("train", "steps=3", "run_name=smoke", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do: the run is at step 3" in again.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    # Another model in that folder is refused, nothing touched.
    other = run_cli("train", "steps=3", "run_name=smoke", "base_emb_dim=64", cwd=tmp_path)
    assert other.returncode == 2 and "run_name='smoke'" in other.stderr
    assert "base_emb_dim" in other.stderr
    # Without a complete checkpoint (as after a kill in the first minutes) the same command
    # restarts from step 0 and keeps the earlier metrics aside.
    shutil.rmtree(run_dir / "checkpoints")
    again = run_cli("train", "steps=3", "run_name=smoke", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "restarting from step 0" in again.stdout
    assert (run_dir / "metrics.jsonl.1").read_text() == "\n".join(lines) + "\n"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


# With the `gpu` extra on a machine without a GPU, loading the CUDA plugin makes jaxlib print
# these itself (absl's preamble and cudart_stub's notice), before any expertax code runs.
CUDA_PLUGIN_NOISE = ("WARNING: All log messages before absl::InitializeLog()", "cudart_stub.cc:")


def test_bad_key_is_one_line_error(tmp_path):
    r = run_cli("train", "num_expert=4", cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    ours = [x for x in lines if not any(n in x for n in CUDA_PLUGIN_NOISE)]
    assert ours == [
        "expertax: error: unknown key 'num_expert' in overrides; did you mean 'num_experts'?"
    ]
    assert not (tmp_path / "runs").exists()
