"""The devices `expertax memory` and `expertax parity` compile for: `--target` and simulated CPU
devices."""

from __future__ import annotations

import sys


def target(spec: str, devices: int | None = None):
    """The parsed `--target`; a TPU or GPU target (compiled for, not run on) makes this process
    compile with the CPU as JAX's backend. Refused: a missing compiler, or `--devices` with it."""
    from expertax.config import ConfigError
    from expertax.targets import parse_target, prepare_process

    parsed = parse_target(spec)
    if not parsed.is_cpu:
        if devices is not None:
            raise ConfigError(
                f"--devices={devices} sets the simulated CPU devices of --target=cpu; "
                f"--target={spec} has {parsed.count} devices of its own"
            )
        prepare_process(parsed)
    return parsed


def use_simulated_devices(n: int, argv: list[str]) -> None:
    """Make JAX see `n` simulated CPU devices: configure them before its backend starts, or
    re-execute this command in a fresh interpreter when a backend already runs with others."""
    import jax

    try:  # JAX refuses this once a backend is initialized
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if jax.default_backend() == "cpu" and len(jax.devices()) == n:
            return
        import os
        import subprocess

        cmd = [sys.executable, "-m", "expertax.cli", *argv]
        sys.exit(subprocess.call(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}))
    jax.config.update("jax_platforms", "cpu")
