"""Multi-process (multi-host) start-up: `jax.distributed.initialize` before any other JAX use.

Each process runs the same command; JAX's multi-controller runtime connects them through the
coordinator (process 0) and XLA's collectives do the rest. Who is who comes from one of two places:

- Explicit settings: the config keys `coordinator_address`, `num_processes`, `process_id`
  (MaxText's names) or, where a key is left at its default, the environment variables
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID. All three are needed, except
  that num_processes=1 / process_id=0 alone mean one process.
- The launcher, when none of those is set and `distributed_auto_detect` is on (the default): a job
  that srun (SLURM), Open MPI's mpirun, a Cloud TPU slice or a Kubernetes Indexed Job started as
  several processes is recognized from its environment variables (`train/clusters.py`), and
  `jax.distributed.initialize()` is called with no arguments, so that JAX itself derives the
  coordinator, the count and this process's index from the same launcher. Every process then
  prints one line ("expertax: joined 4 processes (SLURM, process 2)"). A launch of a single task
  stays one process and nothing is initialized.

Refused with a ConfigError, before anything connects: two launchers that both claim the job (SLURM
and Open MPI variables at once); a launcher JAX cannot join by itself (Open MPI 5, MPICH/Intel MPI,
Kubernetes without the `kubernetes` package); explicit settings that contradict the launcher's
layout (when they agree they are used, silently); some explicit settings without the others.
distributed_auto_detect=false keeps only the explicit path (a launcher's processes then each run
alone, as before detection existed).

Two JAX behaviours of the launcher path: on SLURM and Open MPI each process gets only the GPU of
its node-local rank (one process per GPU); a process per node that drives all its GPUs needs
$JAX_LOCAL_DEVICE_IDS=0,1,... And $JAX_COORDINATOR_PORT replaces the port JAX derives.

On CPU, cross-process collectives need an implementation: gloo (bundled with jaxlib) is selected
before initialization (`jax_cpu_collectives_implementation`); on GPU/TPU JAX picks its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

from expertax import startup
from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.train import clusters
from expertax.train.clusters import Found

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

_THREE = (
    f"coordinator_address, num_processes and process_id (or ${ENV_COORDINATOR}, "
    f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})"
)


@dataclass(frozen=True)
class ProcessLayout:
    coordinator_address: str
    num_processes: int
    process_id: int
    cluster: str = ""  # the launcher JAX joined through; "" = explicit settings


@dataclass(frozen=True)
class _Settings:
    """The explicit settings, -1 / "" where unset, and how each was given (for messages)."""

    address: str
    num_processes: int
    process_id: int
    given: tuple[str, ...]


def _env_int(name: str, key: str) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer; set {key}=N or fix it") from None


def _settings(c: Config) -> _Settings:
    given = []
    address = c.coordinator_address
    if address:
        given.append(f"coordinator_address={address!r}")
    elif address := os.environ.get(ENV_COORDINATOR, ""):
        given.append(f"${ENV_COORDINATOR}={address!r}")
    counts = []
    for key, env, value in (
        ("num_processes", ENV_NUM_PROCESSES, c.num_processes),
        ("process_id", ENV_PROCESS_ID, c.process_id),
    ):
        if value != -1:
            given.append(f"{key}={value}")
        elif (value := _env_int(env, key)) != -1:
            given.append(f"${env}={value}")
        counts.append(value)
    return _Settings(address, counts[0], counts[1], tuple(given))


def _layout(s: _Settings) -> ProcessLayout | None:
    address, n, i = s.address, s.num_processes, s.process_id
    if not address and n in (-1, 1) and i in (-1, 0):
        return None
    if not address or n < 1 or i < 0:
        raise ConfigError(
            f"a multi-process run needs {_THREE}; got coordinator_address={address!r}, "
            f"num_processes={n}, process_id={i}"
        )
    if i >= n:
        raise ConfigError(f"process_id={i} must be below num_processes={n}")
    return ProcessLayout(address, n, i)


def resolve(c: Config) -> ProcessLayout | None:
    """The layout from the explicit settings, keys first; None = single process (or nothing
    explicit: see `plan` for the launcher)."""
    return _layout(_settings(c))


def _names(found: Sequence[Found]) -> str:
    return " and ".join(f.says() for f in found)


def _processes(n: int | None) -> str:
    if n is None:
        return "a number of processes only JAX can read"
    return f"{n} process" + ("es" if n != 1 else "")


def _checked(s: _Settings, multi: Sequence[Found]) -> ProcessLayout | None:
    """The explicit layout, unless a multi-process launcher says otherwise."""
    try:
        layout = _layout(s)
    except ConfigError as e:
        if not multi:
            raise
        raise ConfigError(
            f"{e}. The launcher says {_names(multi)}: set all three to its layout, or unset "
            f"{', '.join(s.given)} to join it as it says"
        ) from None
    n, i = (layout.num_processes, layout.process_id) if layout else (1, 0)
    if multi and not any(f.agrees(n, i) for f in multi):
        launchers = " or ".join(f.name for f in multi)
        raise ConfigError(
            f"the explicit settings {', '.join(s.given)} ({_processes(n)}, this one {i}) "
            f"contradict {_names(multi)}: set {_THREE} to the launcher's layout, or unset "
            f"them all to join as {launchers} says, or distributed_auto_detect=false to ignore "
            f"{launchers}"
        )
    return layout


def plan(c: Config, found: Sequence[Found] | None = None) -> ProcessLayout | Found | None:
    """How this process starts: an explicit layout, a launcher for JAX to join, or None (alone).

    `found`: the launchers present (default: `clusters.detect()` on this environment).
    """
    if not c.distributed_auto_detect:
        return resolve(c)
    found = clusters.detect() if found is None else found
    multi = [f for f in found if f.multi]
    settings = _settings(c)
    if settings.given:
        return _checked(settings, multi)
    if not multi:
        return None
    # JAX joins the first launcher it recognizes (in `found`'s order); it must be this one.
    first = next((f for f in found if f.joinable), None)
    if len(multi) > 1 or (multi[0].joinable and first is not multi[0]):
        raise ConfigError(
            f"found more than one launcher: {_names(found)}; start the job with one of them "
            "only (e.g. srun, or mpirun outside a SLURM allocation), or set "
            f"{_THREE} to the layout of the one that started it, or distributed_auto_detect="
            "false to run each process alone"
        )
    f = multi[0]
    if not f.joinable:
        raise ConfigError(
            f"found {f.says()}, a launch of {_processes(f.num_processes)}: {f.hint}; or "
            "distributed_auto_detect=false to run each process alone"
        )
    return f


def _joined(f: Found) -> ProcessLayout:
    """The layout JAX joined through launcher `f`: JAX's own count and index, which are the ones
    in effect (the backends start here, as they would at the next use of JAX)."""
    if jax.distributed.is_initialized():
        startup.start_backends()
        address = os.environ.get(ENV_COORDINATOR, "")  # JAX keeps the one it derived to itself
        return ProcessLayout(address, jax.process_count(), jax.process_index(), f.name)
    n, i = f.num_processes, f.process_id  # (jax.distributed.initialize was replaced: tests)
    return ProcessLayout("", -1 if n is None else n, -1 if i is None else i, f.name)


def initialize(c: Config, echo: Callable[[str], object] = print) -> ProcessLayout | None:
    """Connect this process to the others if the config, the environment or the launcher asks
    for it; `echo` gets the line that says which launcher was joined.

    Call before anything touches a JAX backend (device lists, arrays): the runtime is fixed then.
    """
    how = plan(c)
    if how is None:
        return None
    # Only the CPU client reads this; GPU/TPU collectives are chosen by JAX itself.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if isinstance(how, ProcessLayout):
        jax.distributed.initialize(
            coordinator_address=how.coordinator_address,
            num_processes=how.num_processes,
            process_id=how.process_id,
        )
        return how
    jax.distributed.initialize()  # JAX reads the same launcher: coordinator, count, index
    layout = _joined(how)
    count = "?" if layout.num_processes < 0 else str(layout.num_processes)
    plural = "" if layout.num_processes == 1 else "es"
    index = "?" if layout.process_id < 0 else str(layout.process_id)
    echo(f"expertax: joined {count} process{plural} ({how.name}, process {index})")
    return layout
