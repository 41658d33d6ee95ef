"""Multi-process (multi-host) start-up: `jax.distributed.initialize` before any other JAX use.

Each process runs the same command; JAX's multi-controller runtime connects them through the
coordinator (process 0) and XLA's collectives do the rest. The three settings come from the config
keys `coordinator_address`, `num_processes`, `process_id` (MaxText's names) or, where a key is left
at its default, from the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID. With none of them set the run is a single process and nothing is initialized.

On CPU, cross-process collectives need an implementation: gloo (bundled with jaxlib) is selected
before initialization (`jax_cpu_collectives_implementation`); on GPU/TPU JAX picks its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from expertax.config.checks import ConfigError
from expertax.config.schema import Config

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclass(frozen=True)
class ProcessLayout:
    coordinator_address: str
    num_processes: int
    process_id: int


def _env_int(name: str, key: str) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer; set {key}=N or fix it") from None


def resolve(c: Config) -> ProcessLayout | None:
    """The process layout from keys (first) and environment variables; None = single process."""
    address = c.coordinator_address or os.environ.get(ENV_COORDINATOR, "")
    n = c.num_processes if c.num_processes != -1 else _env_int(ENV_NUM_PROCESSES, "num_processes")
    i = c.process_id if c.process_id != -1 else _env_int(ENV_PROCESS_ID, "process_id")
    if not address and n in (-1, 1) and i in (-1, 0):
        return None
    if not address or n < 1 or i < 0:
        raise ConfigError(
            "a multi-process run needs coordinator_address, num_processes and process_id (or "
            f"${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}); got "
            f"coordinator_address={address!r}, num_processes={n}, process_id={i}"
        )
    if i >= n:
        raise ConfigError(f"process_id={i} must be below num_processes={n}")
    return ProcessLayout(address, n, i)


def initialize(c: Config) -> ProcessLayout | None:
    """Connect this process to the others if the config or environment asks for it.

    Call before anything touches a JAX backend (device lists, arrays): the runtime is fixed then.
    """
    layout = resolve(c)
    if layout is None:
        return None
    # Only the CPU client reads this; GPU/TPU collectives are chosen by JAX itself.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=layout.coordinator_address,
        num_processes=layout.num_processes,
        process_id=layout.process_id,
    )
    return layout
