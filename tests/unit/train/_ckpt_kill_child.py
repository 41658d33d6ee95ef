"""Child process of the killed-during-save test: save step 1, start saving step 2, SIGKILL itself.

Usage: python _ckpt_kill_child.py DIRECTORY. Step 1 is saved completely; the step-2 save (64 MiB of
random bits, so writing it takes a while) is started asynchronously, and the process kills itself as
soon as Orbax's temporary step-2 directory exists, that is, during the save.
"""

import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from expertax.train.checkpoint import Checkpointer  # noqa: E402

N = 1 << 24  # float32 elements: 64 MiB


def state(step: int) -> dict:
    """Step 1: all ones (checked by the parent); step 2: random bits, which do not compress."""
    if step == 1:
        w = jnp.ones((N,), jnp.float32)
    else:
        w = jax.lax.bitcast_convert_type(jax.random.bits(jax.random.key(2), (N,)), jnp.float32)
    return {"w": w, "step": jnp.int32(step)}


def main(directory: str) -> None:
    ckpt = Checkpointer(directory, period_steps=1, max_to_keep=3, enable_async=True)
    ckpt.maybe_save(1, state(1), {"position": 1})
    ckpt.wait()
    ckpt.maybe_save(2, state(2), {"position": 2})
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if any(name.startswith("2.") and "tmp" in name for name in os.listdir(directory)):
            break
        time.sleep(0.001)
    print("killing", sorted(os.listdir(directory)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
