"""One process of the multi-host test: `python _multihost_child.py LOCAL_DEVICES key=value ...`.

Runs `expertax train key=value ...` (the CLI path, which calls jax.distributed.initialize from the
coordinator_address / num_processes / process_id keys) on LOCAL_DEVICES simulated CPU devices.
"""

import os
import sys

# the test processes' flags (tests/xla_flags.py; this script runs without the package on its path)
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={int(sys.argv[1])} --xla_backend_optimization_level=0"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from expertax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[2:]]))
