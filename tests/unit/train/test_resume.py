"""Resuming a run: stop + resume is bitwise an uninterrupted run; the run folder stays consistent.

The train() runs share one compiled step through JAX's persistent compilation cache (same model,
same mesh), so only the first of them pays the compile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.conftest import TINY_MOE
from tests.xla_flags import with_devices

from expertax.config import ConfigError
from expertax.preflight import load_config
from expertax.train import checkpoint
from expertax.train.loop import prepare, train
from expertax.train.trainer import build_trainer

pytestmark = pytest.mark.distributed

# A shrunk Mixtral with DeepSeek's sigmoid routing and balancing bias, so the bias (a parameter
# updated outside the optimizer) is part of what must resume exactly.
TINY = dict(TINY_MOE, steps=20, checkpoint_period=5)


def prepare_run_dir(c):
    """The checks and the opened run folder of `c`, as `train` does them before compiling."""
    p = prepare(c)
    return p.c, p.run


@pytest.fixture(scope="module", autouse=True)
def _cache(persistent_compile_cache):
    yield


def tiny(tmp_path, **overrides):
    return load_config(overrides={**TINY, "base_output_directory": str(tmp_path), **overrides})


def leaves(state) -> list[np.ndarray]:
    """All arrays of a train state as host numpy (typed keys as their key data)."""
    out = []
    for x in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(jax.device_get(x)))
    return out


def assert_bitwise_equal(a, b) -> None:
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_stop_and_resume_is_bitwise_an_uninterrupted_run(tmp_path):
    """With a multi-token-prediction module (models/mtp.py), so that its weights, optimizer
    state and routing bias resume exactly too."""
    quiet = dict(echo=lambda *_: None)
    tiny_mtp = lambda **kw: tiny(tmp_path, mtp_num_layers=1, **kw)
    straight = train(tiny_mtp(run_name="straight"), **quiet)
    first = train(tiny_mtp(run_name="resumed"), stop_after_step=10, **quiet)
    run_dir = tmp_path / "resumed"
    assert int(first["state"].step) == 10 and first["resumed_from"] is None
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["10", "5", checkpoint.MARKER_FILE]

    # What a process killed during the step-15 save and after writing metrics leaves behind: a
    # temporary step directory and records past the last complete checkpoint (one cut off).
    (run_dir / "checkpoints" / "15.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 10, "loss": 99.0}) + "\n" + '{"step": 11, "lo')

    second = train(tiny_mtp(run_name="resumed"), **quiet)
    assert second["resumed_from"] == 10
    assert_bitwise_equal(second["state"], straight["state"])
    assert second["data_state"] == straight["data_state"] == {"step": 20}
    # Negative control: the state at the stop differs from the final one (so equality means
    # something), and the balancing bias really moved away from its zero init.
    assert not np.array_equal(leaves(first["state"].params)[0], leaves(straight["state"].params)[0])
    bias = np.asarray(straight["state"].params.moe_layers.moe.router.bias)
    assert np.any(bias != 0)
    assert np.any(np.asarray(straight["state"].params.mtp.block.moe.router.bias) != 0)

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(20))
    want = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    assert [r["loss"] for r in records] == want
    want_mtp = [r["mtp_loss"] for r in read_metrics(tmp_path / "straight")]
    assert [r["mtp_loss"] for r in records] == want_mtp
    assert not any("tmp" in p for p in os.listdir(run_dir / "checkpoints"))

    # Re-running a finished run does nothing and keeps the metrics.
    third = train(tiny_mtp(run_name="resumed"), **quiet)
    assert third["resumed_from"] == 20 and "final_loss" not in third
    assert len(read_metrics(run_dir)) == 20


def _fake_checkpoint(run_dir, step: int) -> None:
    with checkpoint.Checkpointer(run_dir / "checkpoints", period_steps=1, max_to_keep=2) as ck:
        ck.maybe_save(step, {"x": jnp.zeros(2)}, {"step": step})


def test_run_dir_without_a_checkpoint_restarts_or_refuses(tmp_path):
    c, run = prepare_run_dir(tiny(tmp_path, run_name="r"))
    assert run.resume_step is None and not run.restarted
    run.checkpointer.close()
    first = '{"step": 0, "loss": 1.0}\n'
    (run.path / "metrics.jsonl").write_text(first)
    # Another model in the same folder: refused, nothing touched.
    with pytest.raises(ConfigError, match=r"holds a run \(no checkpoint yet\).*base_emb_dim"):
        prepare_run_dir(tiny(tmp_path, run_name="r", base_emb_dim=32))
    assert (run.path / "metrics.jsonl").read_text() == first
    assert not (run.path / "metrics.jsonl.1").exists()
    # The same run (a layout key may differ): restarted from step 0, the old metrics kept aside.
    _, again = prepare_run_dir(tiny(tmp_path, run_name="r", ici_expert_parallelism=2))
    again.checkpointer.close()
    assert again.resume_step is None and again.restarted
    assert (run.path / "metrics.jsonl.1").read_text() == first
    assert not (run.path / "metrics.jsonl").exists()
    # A second restart keeps both earlier files.
    (run.path / "metrics.jsonl").write_text(first)
    prepare_run_dir(tiny(tmp_path, run_name="r"))[1].checkpointer.close()
    assert (run.path / "metrics.jsonl.2").read_text() == first
    # Metrics without the config.yml that says whose run they are: refused.
    (run.path / "metrics.jsonl").write_text(first)
    (run.path / "config.yml").unlink()
    with pytest.raises(ConfigError, match="no config.yml"):
        prepare_run_dir(tiny(tmp_path, run_name="r"))


# 73 s, on demand: the same restart logic (prepare()), the CLI's restart from step 0 and a
# bitwise resume run by default; only the real SIGKILL is this test's own
@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/unit/train/test_resume.py::test_run_dir_without_a_checkpoint_restarts_or_refuses",
    "tests/smoke/test_cli.py::test_train_writes_metrics_and_config",
    "tests/unit/train/test_resume.py::test_stop_and_resume_is_bitwise_an_uninterrupted_run",
)
def test_a_run_killed_before_its_first_checkpoint_restarts_with_the_same_command(tmp_path):
    """SIGKILL during the first steps (no checkpoint yet), then the same command: it trains
    from step 0 to the end, with the losses of the killed attempt, and keeps its metrics."""
    args = [f"{k}={v}" for k, v in {**TINY, "steps": 400, "checkpoint_period": 1000}.items()]
    args += [f"base_output_directory={tmp_path}", "run_name=r"]
    env = dict(os.environ, XLA_FLAGS=with_devices(1))
    cmd = [sys.executable, "-m", "expertax.cli", "train", *args]
    metrics = tmp_path / "r" / "metrics.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = read_metrics(tmp_path / "r")
    assert 3 <= len(killed) < 400
    assert checkpoint.latest_step(tmp_path / "r" / "checkpoints") is None
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarting from step 0" in done.stdout
    records = read_metrics(tmp_path / "r")
    assert [r["step"] for r in records] == list(range(400))
    assert [r["loss"] for r in records[: len(killed)]] == [r["loss"] for r in killed]
    kept = (tmp_path / "r" / "metrics.jsonl.1").read_text().splitlines()
    assert [json.loads(line) for line in kept] == killed
    assert checkpoint.latest_step(tmp_path / "r" / "checkpoints") == 400


def test_resume_refuses_keys_that_change_the_model_or_data(tmp_path):
    _, run = prepare_run_dir(tiny(tmp_path, run_name="r"))
    run.checkpointer.close()
    _fake_checkpoint(run.path, 3)
    records = [{"step": i, "loss": 1.0} for i in range(5)]
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ConfigError, match=r"step 3\) saved with different values") as err:
        prepare_run_dir(tiny(tmp_path, run_name="r", base_emb_dim=32, data_shuffle_seed=1))
    assert "base_emb_dim: 64 -> 32" in str(err.value)
    assert "data_shuffle_seed: 0 -> 1" in str(err.value)
    assert "steps" not in str(err.value).split("(")[2]  # only the differing keys are named
    assert len(read_metrics(run.path)) == 5  # refused: nothing touched
    # Run-time keys may change: more steps, another mesh, logging, checkpoint settings.
    c, run = prepare_run_dir(
        tiny(tmp_path, run_name="r", steps=40, ici_expert_parallelism=4, log_period=7,
             checkpoint_period=2, skip_nonfinite_steps=True)
    )  # fmt: skip
    run.checkpointer.close()
    assert run.resume_step == 3 and c.steps == 40
    assert [r["step"] for r in read_metrics(run.path)] == [0, 1, 2]


def test_checkpoint_restores_on_another_mesh(tmp_path):
    """fsdp=8 -> expert=4 x fsdp=2 -> one device, through Trainer.abstract_state; bitwise."""
    meshes = [
        (tiny(tmp_path), None),
        (tiny(tmp_path, ici_expert_parallelism=4, ici_fsdp_parallelism=2), None),
        (tiny(tmp_path, per_device_batch_size=8), jax.devices()[:1]),
    ]
    trainers = [build_trainer(c, devices) for c, devices in meshes]
    assert [dict(t.mesh.shape)["expert"] for t in trainers] == [1, 4, 1]
    state = trainers[0].init_state()
    # Make the optimizer moments non-trivial (they start at zero).
    state = jax.tree.map(lambda x: x + 0.5 if x.dtype == jnp.float32 else x, state)
    original = leaves(state)
    ck = checkpoint.Checkpointer(tmp_path / "ck", period_steps=1, max_to_keep=3)
    for i, trainer in enumerate(trainers[1:], start=1):
        ck.maybe_save(i, state, {"step": i})
        ck.wait()
        state, _ = ck.restore(i, trainer.abstract_state())
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.abstract_state())):
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        assert all(np.array_equal(a, b) for a, b in zip(leaves(state), original, strict=True))
    ck.close()
    assert len(trainers[2].mesh.devices.flatten()) == 1


def test_run_resumes_on_another_mesh_with_the_same_global_batch(tmp_path):
    quiet = dict(echo=lambda *_: None)
    train(tiny(tmp_path, run_name="m"), stop_after_step=2, **quiet)  # fsdp=8
    # One device with per_device_batch_size=1 would change the global batch (8 -> 1): refused.
    with pytest.raises(ConfigError, match="global batch of 8 sequences; this run has 1"):
        train(tiny(tmp_path, run_name="m"), devices=jax.devices()[:1], **quiet)
    moved = train(
        tiny(tmp_path, run_name="m", ici_expert_parallelism=4, ici_fsdp_parallelism=2),
        stop_after_step=4,
        **quiet,
    )
    assert moved["resumed_from"] == 2 and int(moved["state"].step) == 4
    assert dict(moved["state"].params.embed.sharding.mesh.shape)["expert"] == 4
    records = read_metrics(tmp_path / "m")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in records)


def test_a_checkpoint_with_missing_files_falls_back_to_the_previous_one(tmp_path, capsys):
    """Step 10's state loses a file: the run resumes from step 5, says so on stderr, keeps the
    damaged step aside and trains on with one metrics record per step."""
    quiet = dict(echo=lambda *_: None)
    train(tiny(tmp_path, run_name="d"), stop_after_step=10, **quiet)
    ckpts = tmp_path / "d" / "checkpoints"
    assert checkpoint.latest_intact_step(ckpts) == (10, {})  # negative control: nothing damaged
    (ckpts / "10" / "state" / "_METADATA").unlink()
    capsys.readouterr()
    resumed = train(tiny(tmp_path, run_name="d"), stop_after_step=12, **quiet)
    assert resumed["resumed_from"] == 5 and int(resumed["state"].step) == 12
    err = capsys.readouterr().err
    assert f"the checkpoint of step 10 in {tmp_path / 'd'} is damaged" in err
    assert "state/_METADATA" in err and "resuming from step 5" in err
    assert (tmp_path / "d" / "damaged_checkpoints" / "10" / "state").is_dir()
    assert checkpoint.latest_intact_step(ckpts) == (12, {})
    assert [r["step"] for r in read_metrics(tmp_path / "d")] == list(range(12))


def test_a_checkpoint_that_cannot_be_read_falls_back_to_the_previous_one(tmp_path, capsys):
    """Step 10's array chunks are cut short (its files all there): the restore fails, the run
    says so on stderr, sets step 10 aside and resumes from step 5 with one metrics record per
    step. With no checkpoint that reads: one error naming the folder, nothing moved."""
    from tests.unit.train.test_checkpoint import cut_array_chunks

    quiet = dict(echo=lambda *_: None)
    train(tiny(tmp_path, run_name="c"), stop_after_step=10, **quiet)
    ckpts = tmp_path / "c" / "checkpoints"
    assert cut_array_chunks(ckpts / "10") > 0
    assert checkpoint.latest_intact_step(ckpts) == (10, {})  # no file is missing or empty
    capsys.readouterr()
    resumed = train(tiny(tmp_path, run_name="c"), stop_after_step=11, **quiet)
    assert resumed["resumed_from"] == 5 and int(resumed["state"].step) == 11
    err = capsys.readouterr().err
    assert f"the checkpoint of step 10 in {tmp_path / 'c'} is damaged (it cannot be read: " in err
    assert "resuming from step 5" in err and "Traceback" not in err
    assert (tmp_path / "c" / "damaged_checkpoints" / "10" / "state").is_dir()
    assert checkpoint.intact_steps(ckpts) == ([11, 10, 5], {})  # step 10 trained again
    assert [r["step"] for r in read_metrics(tmp_path / "c")] == list(range(11))
    for step in (5, 10, 11):
        cut_array_chunks(ckpts / str(step))
    with pytest.raises(ConfigError) as e:
        train(tiny(tmp_path, run_name="c"), stop_after_step=12, **quiet)
    assert str(e.value).startswith(f"no checkpoint in {ckpts} can be read (step 5: "), e.value
    assert "step 10: " in str(e.value) and "step 11: " in str(e.value) and "move" in str(e.value)
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [5, 10, 11]
