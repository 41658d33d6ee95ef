"""Which multi-process launcher started this process, read from its environment variables.

`train/distributed.py` asks this when no explicit process layout is given. Each reader below
looks for what JAX's own cluster detection (`jax.distributed.initialize()` with no arguments,
jax/_src/clusters/) needs for the same launcher, so that a launcher found here and marked
`joinable` is one JAX finds and joins too. Launchers JAX cannot join by itself (Open MPI 5,
MPICH/Intel MPI's Hydra, a Kubernetes Job without the `kubernetes` package) are found all the same,
so that such a job is refused with a hint instead of running one independent training per process.

Detection is instant and local: environment variables, `find_spec`s, and the TPU chips on this
machine's PCI bus (what JAX checks before it looks for a TPU pod). Nothing here opens a
connection or touches a JAX backend; the metadata-server and Kubernetes-API lookups that some
launchers need are JAX's, during `jax.distributed.initialize()`, and only where the launcher was
found.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from expertax import startup
from expertax.errors import ConfigError

# SLURM (srun): JAX needs all five; the coordinator is the step's first node, its port derived
# from the job id (or $JAX_COORDINATOR_PORT).
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
# Open MPI's mpirun: the launcher's URI (Open MPI up to 4) gives JAX the coordinator host.
OMPI_URI = "OMPI_MCA_orte_hnp_uri"
OMPI_SIZE, OMPI_RANK = "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"
# MPICH and Intel MPI (Hydra), also srun --mpi=pmi2: JAX has no reader for these.
PMI_SIZE, PMI_RANK = "PMI_SIZE", "PMI_RANK"
# Cloud TPU on GKE: the slice's hosts, this host's index, and the slices of a multislice job.
TPU_HOSTS_VARS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
TPU_WORKER_ID, TPU_NUM_SLICES, TPU_SLICE_ID = (
    "TPU_WORKER_ID",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
)
TPU_SKIP_MDS = "TPU_SKIP_MDS_QUERY"  # `import jax` sets it where it finds no TPU chips
# Kubernetes: a pod of an Indexed Job (JobSets are made of them); JAX asks the API for its size.
K8S_HOST, K8S_INDEX = "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"

# Every variable a reader looks at (tests clear them to get a plain environment).
ALL_VARS = (
    *SLURM_VARS,
    OMPI_URI,
    OMPI_SIZE,
    OMPI_RANK,
    PMI_SIZE,
    PMI_RANK,
    *TPU_HOSTS_VARS,
    TPU_WORKER_ID,
    TPU_NUM_SLICES,
    TPU_SLICE_ID,
    TPU_SKIP_MDS,
    K8S_HOST,
    K8S_INDEX,
)

EXPLICIT_HINT = (
    "set coordinator_address=HOST:PORT (process 0's host), num_processes and process_id yourself"
)


@dataclass(frozen=True)
class Found:
    """One launcher seen in the environment and the layout it implies."""

    name: str
    num_processes: int | None  # None: only JAX can tell (it asks a metadata server or an API)
    process_id: int | None
    evidence: str  # the variables that say so, for messages
    joinable: bool = True  # jax.distributed.initialize() with no arguments joins it
    hint: str = ""  # why not, and what to do, when it is not joinable

    @property
    def multi(self) -> bool:
        """More than one process (or a count only JAX can find out)."""
        return self.num_processes != 1

    def says(self) -> str:
        return f"{self.name} ({self.evidence})"

    def agrees(self, num_processes: int, process_id: int) -> bool:
        """Whether an explicit layout is the one this launcher started (unknowns agree)."""
        return (self.num_processes in (None, num_processes)) and (
            self.process_id in (None, process_id)
        )


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"${name}={raw!r} is not an integer; the launcher sets it to a number (fix or unset "
            "it, or distributed_auto_detect=false)"
        ) from None


def _slurm(env: Mapping[str, str]) -> Found | None:
    if not all(v in env for v in SLURM_VARS):
        return None  # e.g. an sbatch script outside srun, or a shell in an allocation
    n, i = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID")
    _int(env, "SLURM_JOB_ID")  # JAX derives the coordinator port from it
    return Found("SLURM", n, i, f"SLURM_NTASKS={n}, SLURM_PROCID={i}")


def _open_mpi(env: Mapping[str, str]) -> Found | None:
    if OMPI_URI not in env and OMPI_SIZE not in env:
        return None
    n = _int(env, OMPI_SIZE) if OMPI_SIZE in env else None
    i = _int(env, OMPI_RANK) if OMPI_RANK in env else None
    evidence = f"{OMPI_SIZE}={n}, {OMPI_RANK}={i}" if n is not None else f"${OMPI_URI}"
    if OMPI_URI in env:
        return Found("Open MPI", n, i, evidence)
    return Found(
        "Open MPI",
        n,
        i,
        evidence + f", no ${OMPI_URI}",
        joinable=False,
        hint=f"this mpirun (Open MPI 5 or later) does not set ${OMPI_URI}, from which JAX "
        f"derives the coordinator: {EXPLICIT_HINT} (num_processes=${OMPI_SIZE} "
        f"process_id=${OMPI_RANK})",
    )


def _hydra(env: Mapping[str, str]) -> Found | None:
    if PMI_SIZE not in env or PMI_RANK not in env:
        return None
    n, i = _int(env, PMI_SIZE), _int(env, PMI_RANK)
    return Found(
        "MPICH/Intel MPI",
        n,
        i,
        f"{PMI_SIZE}={n}, {PMI_RANK}={i}",
        joinable=False,
        hint=f"JAX cannot find the coordinator of an MPICH or Intel MPI launch: {EXPLICIT_HINT} "
        f"(num_processes=${PMI_SIZE} process_id=${PMI_RANK}), or launch with srun or Open MPI",
    )


def _cloud_tpu(env: Mapping[str, str]) -> Found | None:
    if not on_cloud_tpu_vm():
        return None  # JAX looks for TPU pods only on TPU VMs: no metadata queries elsewhere
    hosts_var = next((v for v in TPU_HOSTS_VARS if v in env), None)
    if hosts_var is None:
        if TPU_SKIP_MDS in env:
            return None
        # A TPU VM created on GCE: the slice's hosts are in the metadata server, which JAX reads.
        return Found("Cloud TPU", None, None, "a TPU VM; its slice's hosts from the metadata")
    hosts = len(env[hosts_var].split(","))
    slices = _int(env, TPU_NUM_SLICES) if env.get(TPU_NUM_SLICES) else 1
    slice_id = _int(env, TPU_SLICE_ID) if env.get(TPU_SLICE_ID) else 0
    worker = _int(env, TPU_WORKER_ID) if TPU_WORKER_ID in env else None
    i = None if worker is None else worker + slice_id * hosts
    evidence = f"{hosts} hosts in ${hosts_var}, {TPU_WORKER_ID}={worker}"
    if slices > 1:
        evidence += f", {TPU_NUM_SLICES}={slices}, {TPU_SLICE_ID}={slice_id}"
    return Found("Cloud TPU", hosts * slices, i, evidence)


def _kubernetes(env: Mapping[str, str]) -> Found | None:
    if K8S_HOST not in env or K8S_INDEX not in env:
        return None  # a plain pod (no Indexed Job): nothing to join
    i = _int(env, K8S_INDEX)
    if kubernetes_client_installed():
        return Found("Kubernetes", None, i, f"an Indexed Job, {K8S_INDEX}={i}")
    return Found(
        "Kubernetes",
        None,
        i,
        f"an Indexed Job, {K8S_INDEX}={i}",
        joinable=False,
        hint="JAX reads the Job's size from the Kubernetes API through the `kubernetes` "
        "package, which is not installed: install it (pip install 'jax[k8s]'), or "
        f"{EXPLICIT_HINT}",
    )


def on_cloud_tpu_vm() -> bool:
    """What JAX's own detection requires before it looks for a TPU pod: libtpu is installed and
    TPU chips are attached to this machine (read from its PCI devices, `startup.accelerators`)."""
    return importlib.util.find_spec("libtpu") is not None and "tpu" in startup.accelerators()


def kubernetes_client_installed() -> bool:
    return importlib.util.find_spec("kubernetes") is not None


def detect(env: Mapping[str, str] | None = None) -> list[Found]:
    """The launchers present, in the order JAX's detection tries them (Open MPI, SLURM, Cloud
    TPU, Kubernetes); MPICH/Intel MPI only when none of those is (srun --mpi=pmi2 sets PMI_* too).
    """
    env = os.environ if env is None else env
    tpu = _cloud_tpu(env)
    # A TPU pod on GKE is a Kubernetes pod too; JAX takes the TPU reading (it comes first).
    k8s = None if tpu else _kubernetes(env)
    found = [f for f in (_open_mpi(env), _slurm(env), tpu, k8s) if f is not None]
    if not found and (hydra := _hydra(env)) is not None:
        found.append(hydra)
    return found
