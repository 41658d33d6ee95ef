"""Two processes x 4 CPU devices (jax.distributed over loopback, gloo) train like 1 process x 8.

The children run the real command line (`expertax train ... coordinator_address=...`); the
reference runs in this process on its 8 simulated devices. Same mesh (fsdp=8), same global
batches (each process makes its half of the rows), so the losses agree to float32 rounding, and
the checkpoint the two processes wrote together restores here onto one process's 8 devices.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from expertax.config import ConfigError
from expertax.preflight import load_config
from expertax.train import checkpoint, distributed
from expertax.train.loop import train
from expertax.train.trainer import build_trainer
from tests.conftest import TINY_MOE

pytestmark = pytest.mark.distributed

CHILD = Path(__file__).with_name("_multihost_child.py")
SRC = Path(__file__).resolve().parents[2] / "src"
MODEL = dict(TINY_MOE, steps=4, checkpoint_period=2)
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    port = free_port()
    keys = {**MODEL, "base_output_directory": str(tmp_path), "run_name": "multi"}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(SRC), str(SRC.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("XLA_FLAGS", None)
    children = [
        subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                "4",
                *(f"{k}={v}" for k, v in keys.items()),
                f"coordinator_address=127.0.0.1:{port}",
                "num_processes=2",
                f"process_id={i}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        # The reference, while the children compile.
        ref = train(load_config(overrides={**keys, "run_name": "single"}), echo=lambda *_: None)
        outputs = [child.communicate(timeout=300)[0] for child in children]
    finally:
        for child in children:
            child.kill()
    for child, out in zip(children, outputs, strict=True):
        assert child.returncode == 0, out
    assert "on 8 cpu devices" in outputs[0] and "expertax:" not in outputs[1]  # one console

    multi, single = losses(tmp_path / "multi"), losses(tmp_path / "single")
    assert len(multi) == len(single) == MODEL["steps"]
    np.testing.assert_allclose(multi, single, rtol=RTOL, atol=0)
    assert single[-1] < single[0]  # it trains: equal losses are not two constant curves

    # The checkpoint written by both processes restores on this one (another process layout).
    c = load_config(overrides=keys)
    trainer = build_trainer(c)
    with checkpoint.Checkpointer(
        tmp_path / "multi" / "checkpoints", period_steps=2, max_to_keep=3
    ) as ck:
        assert ck.all_steps() == [2, 4]
        state, data = ck.restore(4, trainer.abstract_state())
    assert data["iterators"] == [{"step": 4}] and int(state.step) == 4
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref["state"].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_process_layout_from_keys_or_environment(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.resolve(load_config()) is None  # nothing set: one process, no init
    keys = dict(coordinator_address="h:1", num_processes=4, process_id=3)
    assert distributed.resolve(load_config(overrides=keys)) == distributed.ProcessLayout(
        "h:1", 4, 3
    )
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "e:2")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert distributed.resolve(load_config()) == distributed.ProcessLayout("e:2", 2, 1)
    # Keys win over the environment.
    layout = distributed.resolve(load_config(overrides={"process_id": 0}))
    assert layout == distributed.ProcessLayout("e:2", 2, 0)
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(
        ConfigError, match="needs coordinator_address, num_processes and process_id"
    ):
        distributed.resolve(load_config())
    monkeypatch.setenv("JAX_PROCESS_ID", "x")
    with pytest.raises(ConfigError, match=r"\$JAX_PROCESS_ID='x' is not an integer"):
        distributed.resolve(load_config())
    with pytest.raises(ConfigError, match="process_id=2 must be below num_processes=2"):
        load_config(overrides={"num_processes": 2, "process_id": 2})
