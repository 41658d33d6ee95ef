"""Projections as one 2D matmul: the leading (batch, length) axes flattened into one row axis.

Why not `jnp.einsum("btd,df->btf", ...)`: its transpose for the weight gradient contracts over
two axes (b and t) at once, and XLA:CPU lowers such a dot by first copying the [B, T, F] cotangent
into a transposed [F, B*T] layout, a strided pass over the largest activations of the step (a
quarter of a small Llama's step on CPU, benchmarks/step_vs_torch.py). With the row axes flattened
by a reshape (free: a bitcast) every dot, forward and backward, contracts one axis and runs in the
layout the operands already have. The numbers are the same products summed over the same axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def project(x: jax.Array, w: jax.Array, n_in: int = 1, **dot_kwargs) -> jax.Array:
    """Contract the last `n_in` axes of `x` with the first `n_in` axes of `w`.

    `x` is [..., *in], `w` is [*in, *out]; the result is [..., *out]. E.g. x_BTD @ wq_DHQ ->
    [B, T, H, Q] (n_in=1), or attention out_BTHO @ wo_HOD -> [B, T, D] (n_in=2). `dot_kwargs`
    go to `jnp.matmul` (preferred_element_type).
    """
    lead, inner = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :]
    if tuple(w.shape[:n_in]) != tuple(inner):
        raise ValueError(f"project: x {x.shape} and w {w.shape} disagree on {n_in} axes")
    out = w.shape[n_in:]
    x_NK = x.reshape(math.prod(lead), math.prod(inner))
    w_KM = w.reshape(math.prod(inner), math.prod(out))
    return jnp.matmul(x_NK, w_KM, **dot_kwargs).reshape(*lead, *out)
