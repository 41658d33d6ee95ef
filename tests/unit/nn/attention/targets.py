"""Compile one attention call for one chip of a TPU or GPU target (compile-only: nothing runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from expertax import platform, targets
from expertax.nn.attention import cudnn

needs_tpu = pytest.mark.skipif(
    not targets.compiler_available("tpu"), reason="the TPU compiler (expertax[tpu]) is missing"
)
needs_cudnn = pytest.mark.skipif(
    not (targets.compiler_available("gpu") and cudnn.available()),
    reason="the GPU compiler with cuDNN (expertax[gpu], issue #35) is missing",
)


def compiled_text(spec: str, fn, *shapes) -> str:
    """The optimized HLO of `jax.jit(fn)` for the first device of target `spec`, traced for
    that target's platform."""
    t = targets.parse_target(spec)
    one = NamedSharding(Mesh(t.devices()[:1], ("one",)), PartitionSpec())
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for s in shapes]
    with platform.use(t.platform):
        return jax.jit(fn).lower(*args).compile().as_text()


def call_shapes(t: int, h: int = 4, g: int = 2, qd: int = 96, od: int = 64) -> tuple:
    """bfloat16 q [1, T, H, qd], k [1, T, G, qd], v [1, T, G, od] and int32 segment ids [1, T]."""
    bf = jnp.bfloat16
    return (
        jax.ShapeDtypeStruct((1, t, h, qd), bf),
        jax.ShapeDtypeStruct((1, t, g, qd), bf),
        jax.ShapeDtypeStruct((1, t, g, od), bf),
        jax.ShapeDtypeStruct((1, t), jnp.int32),
    )
