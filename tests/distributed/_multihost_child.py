"""One process of the multi-host test: `python _multihost_child.py LOCAL_DEVICES key=value ...`.

Runs `expertax train key=value ...` (the CLI path, which calls jax.distributed.initialize from the
coordinator_address / num_processes / process_id keys) on LOCAL_DEVICES simulated CPU devices.
"""

import os
import sys

# the repository root is on PYTHONPATH
from tests.xla_flags import TOLERANCE_ONLY_CODEGEN, with_devices

# the tolerance-only code generation: the test compares the losses within a tolerance
os.environ["XLA_FLAGS"] = with_devices(int(sys.argv[1]), codegen=TOLERANCE_ONLY_CODEGEN)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from expertax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[2:]]))
