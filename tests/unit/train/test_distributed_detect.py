"""Joining a launcher's processes without explicit settings (train/distributed.py, clusters.py).

The environment is cleared of every launcher variable and `jax.distributed.initialize` replaced by
a recorder, so each case sets exactly the variables of one launch and sees what expertax would
call. The last test is real: two processes with srun's variables join over loopback.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from expertax.config import ConfigError
from expertax.preflight import load_config
from expertax.train import clusters, distributed
from expertax.train.distributed import ProcessLayout

CHILD = Path(__file__).with_name("_slurm_child.py")
SRC = Path(__file__).resolve().parents[3] / "src"
JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def slurm(ntasks: int, procid: int, job: int = 1234) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_STEP_NODELIST": "node[001-004]",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": "0",
    }


def open_mpi(size: int, rank: int) -> dict[str, str]:
    return {
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    }


class Launch:
    """Sets a launch's variables; `run(**keys)` = expertax's initialize with those config keys."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch
        self.calls: list[dict] = []
        self.lines: list[str] = []
        for name in (*clusters.ALL_VARS, *JAX_VARS):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(clusters, "on_cloud_tpu_vm", lambda: False)
        monkeypatch.setattr(clusters, "kubernetes_client_installed", lambda: False)
        monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: self.calls.append(kw))

    def env(self, **variables: str | dict[str, str]) -> Launch:
        for name, value in variables.items():
            for k, v in value.items() if isinstance(value, dict) else [(name, value)]:
                self.mp.setenv(k, v)
        return self

    def run(self, **keys) -> ProcessLayout | None:
        return distributed.initialize(load_config(overrides=keys), echo=self.lines.append)


@pytest.fixture
def launch(monkeypatch):
    saved = jax.config.jax_cpu_collectives_implementation  # initialize selects gloo
    yield Launch(monkeypatch)
    jax.config.update("jax_cpu_collectives_implementation", saved)


def test_plain_environment_stays_one_process(launch):
    assert clusters.detect() == []
    assert launch.run() is None and launch.calls == [] and launch.lines == []


def test_slurm_job_of_four_tasks_joins_through_jax(launch):
    launch.env(s=slurm(4, 2))
    assert launch.run() == ProcessLayout("", 4, 2, "SLURM")
    assert launch.calls == [{}]  # no arguments: JAX derives the coordinator from SLURM too
    assert launch.lines == ["expertax: joined 4 processes (SLURM, process 2)"]


def test_slurm_of_one_task_or_outside_srun_stays_one_process(launch):
    launch.env(s=slurm(1, 0))
    assert launch.run() is None and launch.calls == []
    # An sbatch script (or an ssh into an allocation) lacks the step's variables: not a launch.
    launch.mp.delenv("SLURM_STEP_NODELIST")
    launch.env(SLURM_NTASKS="4")
    assert clusters.detect() == [] and launch.run() is None and launch.calls == []


def test_open_mpi_joins_through_jax(launch):
    launch.env(o=open_mpi(8, 5))
    assert launch.run() == ProcessLayout("", 8, 5, "Open MPI")
    assert launch.calls == [{}]
    assert launch.lines == ["expertax: joined 8 processes (Open MPI, process 5)"]


def test_slurm_and_open_mpi_at_once_is_refused(launch):
    launch.env(s=slurm(2, 1), o=open_mpi(8, 5))  # mpirun inside an sbatch allocation
    with pytest.raises(ConfigError) as e:
        launch.run()
    for said in ("SLURM (SLURM_NTASKS=2, SLURM_PROCID=1)", "Open MPI (OMPI_COMM_WORLD_SIZE=8"):
        assert said in str(e.value)
    assert "distributed_auto_detect=false" in str(e.value) and launch.calls == []


def test_mpirun_in_a_one_task_slurm_shell_joins_open_mpi(launch):
    # srun --pty bash, then mpirun -n 2: only Open MPI says several, and JAX reads it first.
    launch.env(s=slurm(1, 0), o=open_mpi(2, 1))
    assert launch.run() == ProcessLayout("", 2, 1, "Open MPI") and launch.calls == [{}]
    # The other way round JAX would still take Open MPI's single rank: refused.
    launch.env(s=slurm(4, 2), o=open_mpi(1, 0))
    with pytest.raises(ConfigError, match="more than one launcher"):
        launch.run()


def test_explicit_settings_win_only_when_they_agree(launch):
    launch.env(s=slurm(4, 2))
    keys = dict(coordinator_address="h:1", num_processes=4, process_id=2)
    assert launch.run(**keys) == ProcessLayout("h:1", 4, 2)
    assert launch.calls == [dict(coordinator_address="h:1", num_processes=4, process_id=2)]
    assert launch.lines == []  # the explicit path is silent, as before
    with pytest.raises(ConfigError) as e:
        launch.run(coordinator_address="h:1", num_processes=2, process_id=0)
    message = str(e.value)
    assert "num_processes=2, process_id=0 (2 processes, this one 0) contradict SLURM" in message
    assert "SLURM_NTASKS=4, SLURM_PROCID=2" in message
    assert "distributed_auto_detect=false" in message
    # From the JAX_* variables too, and the single-process shorthand.
    launch.env(JAX_COORDINATOR_ADDRESS="e:2", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="1")
    with pytest.raises(ConfigError, match=r"\$JAX_NUM_PROCESSES=4, \$JAX_PROCESS_ID=1 \(4 proc"):
        launch.run()
    for name in JAX_VARS:
        launch.mp.delenv(name)
    with pytest.raises(ConfigError, match=r"num_processes=1 \(1 process, this one 0\) contradict"):
        launch.run(num_processes=1)
    assert len(launch.calls) == 1


def test_some_explicit_settings_with_a_launcher_are_refused(launch):
    launch.env(s=slurm(4, 2))
    with pytest.raises(ConfigError) as e:
        launch.run(coordinator_address="h:1")
    message = str(e.value)
    assert "needs coordinator_address, num_processes and process_id" in message
    assert "SLURM (SLURM_NTASKS=4, SLURM_PROCID=2)" in message
    assert "unset coordinator_address='h:1'" in message and launch.calls == []


def test_auto_detect_off_keeps_each_process_alone(launch):
    launch.env(s=slurm(4, 2), o=open_mpi(8, 5))
    assert launch.run(distributed_auto_detect=False) is None and launch.calls == []
    layout = launch.run(
        distributed_auto_detect=False, coordinator_address="h:1", num_processes=2, process_id=1
    )
    assert layout == ProcessLayout("h:1", 2, 1) and len(launch.calls) == 1


def test_launchers_jax_cannot_join_are_refused_unless_explicit(launch):
    launch.env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3")  # Open MPI 5: no hnp URI
    with pytest.raises(ConfigError, match="Open MPI 5 or later.*num_processes=\\$OMPI_COMM"):
        launch.run()
    keys = dict(coordinator_address="h:1", num_processes=4, process_id=3)
    assert launch.run(**keys) == ProcessLayout("h:1", 4, 3)
    for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        launch.mp.delenv(name)
    launch.env(PMI_SIZE="2", PMI_RANK="0")  # MPICH / Intel MPI
    with pytest.raises(ConfigError, match="MPICH/Intel MPI \\(PMI_SIZE=2, PMI_RANK=0\\)"):
        launch.run()
    launch.env(s=slurm(2, 0))  # srun --mpi=pmi2 sets PMI_* as well: SLURM it is
    assert launch.run() == ProcessLayout("", 2, 0, "SLURM")


def test_kubernetes_indexed_job(launch):
    launch.env(KUBERNETES_SERVICE_HOST="10.0.0.1")  # any pod: nothing to join
    assert launch.run() is None
    launch.env(JOB_COMPLETION_INDEX="3")
    with pytest.raises(ConfigError, match="`kubernetes` package, which is not installed"):
        launch.run()
    launch.mp.setattr(clusters, "kubernetes_client_installed", lambda: True)
    assert launch.run() == ProcessLayout("", -1, 3, "Kubernetes") and launch.calls == [{}]
    assert launch.lines == ["expertax: joined ? processes (Kubernetes, process 3)"]
    with pytest.raises(ConfigError, match="contradict Kubernetes"):  # the index is known
        launch.run(coordinator_address="h:1", num_processes=4, process_id=0)


def test_cloud_tpu(launch):
    hosts = dict(TPU_WORKER_HOSTNAMES="t0,t1,t2,t3", TPU_WORKER_ID="1")
    launch.env(h=hosts, KUBERNETES_SERVICE_HOST="10.0.0.1", JOB_COMPLETION_INDEX="1")
    launch.mp.setattr(clusters, "kubernetes_client_installed", lambda: True)
    # Not a TPU VM (JAX would not look for a TPU pod): only the Kubernetes pod counts.
    assert launch.run() == ProcessLayout("", -1, 1, "Kubernetes")
    launch.mp.setattr(clusters, "on_cloud_tpu_vm", lambda: True)
    assert launch.run() == ProcessLayout("", 4, 1, "Cloud TPU")  # a GKE TPU pod: the TPU wins
    launch.env(MEGASCALE_NUM_SLICES="2", MEGASCALE_SLICE_ID="1")
    assert launch.run() == ProcessLayout("", 8, 5, "Cloud TPU")
    for name in (*hosts, "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"):
        launch.mp.delenv(name)
    # A TPU VM on GCE: its hosts are in the metadata server, which only JAX reads.
    assert launch.run() == ProcessLayout("", -1, -1, "Cloud TPU")
    assert len(launch.calls) == 4 and all(call == {} for call in launch.calls)
    launch.env(TPU_SKIP_MDS_QUERY="1")
    assert launch.run() is None


def test_bad_launcher_variable_names_itself(launch):
    launch.env(s=slurm(4, 2), SLURM_NTASKS="four")
    with pytest.raises(ConfigError, match=r"\$SLURM_NTASKS='four' is not an integer"):
        launch.run()


def free_slurm_port() -> tuple[int, int]:
    """A free port among those JAX derives from a SLURM job id, and such a job id."""
    base = 65535 - 2**12 + 1
    for port in random.sample(range(base, 65536), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, 7 * 2**12 + port - base
    pytest.skip("no free port in JAX's SLURM range")


@pytest.mark.slow
def test_two_srun_tasks_join_over_loopback():
    port, job = free_slurm_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*clusters.ALL_VARS, *JAX_VARS, "XLA_FLAGS", "JAX_COORDINATOR_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD)],
            env={
                **env,
                **slurm(2, i, job),
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_LOCALID": str(i),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        outputs = [child.communicate(timeout=180)[0] for child in children]
    finally:
        for child in children:
            child.kill()
    for i, (child, out) in enumerate(zip(children, outputs, strict=True)):
        assert child.returncode == 0, out
        assert f"expertax: joined 2 processes (SLURM, process {i})" in out, out
        assert f"process_count=2 process_index={i} gathered=[0, 1]" in out, out
