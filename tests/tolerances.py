"""One tolerance table per dtype. Loosening an entry is a reviewed decision, not a fix."""

import jax.numpy as jnp

TOLERANCES = {
    # reorderings of float32 sums (sort vs einsum vs loop, sharded reductions)
    jnp.float32: {"atol": 1e-5, "rtol": 1e-5},
    jnp.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def tol(dtype=jnp.float32) -> dict:
    return TOLERANCES[jnp.dtype(dtype).type]
