"""One process of the SLURM-launch test: `python _slurm_child.py`, with srun's variables only.

Calls expertax's `distributed.initialize` on a default config (no coordinator_address /
num_processes / process_id anywhere), then gathers every process's index over gloo and prints
what it sees.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from expertax.preflight import load_config  # noqa: E402
from expertax.train import distributed  # noqa: E402

if __name__ == "__main__":
    layout = distributed.initialize(load_config())
    assert layout is not None and layout.cluster == "SLURM", layout
    indices = multihost_utils.process_allgather(np.int32(jax.process_index()))
    print(
        f"process_count={jax.process_count()} process_index={jax.process_index()} "
        f"gathered={sorted(np.asarray(indices).tolist())}",
        flush=True,
    )
