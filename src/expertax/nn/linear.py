"""Projections as one 2D matmul: the leading (batch, length) axes flattened into one row axis.

Why not `jnp.einsum("btd,df->btf", ...)`: its transpose for the weight gradient contracts over
two axes (b and t) at once, and XLA:CPU lowers such a dot by first copying the [B, T, F] cotangent
into a transposed [F, B*T] layout, a strided pass over the largest activations of the step (a
quarter of a small Llama's step on CPU, benchmarks/step_vs_torch.py). With the row axes flattened
by a reshape (free: a bitcast) every dot, forward and backward, contracts one axis and runs in the
layout the operands already have. The numbers are the same products summed over the same axis.

The seams: a program may name a kernel for products of few rows (`row_kernel`: decoding's CPU
kernel, decoding/rowdot.py, serves a decode step's matrix-vector products), used by every
`project` traced inside it where the kernel applies; and matrices that read the same input may be
held side by side (`Joint`, decoding/joint.py's relayout), which the layers split after one
product.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from expertax.fp8 import matmul as fp8_matmul
from expertax.fp8 import stats as fp8_stats


class RowKernel(NamedTuple):
    """A kernel for products of few rows: `rows(x [R, K], ws, ids [R])` -> float32 [R, N], row r
    times matrix `ids[r]` of the matrices `ws` (each [K, N] or [G, K, N]) numbered in order;
    `applies(r, *arrays)`: whether it serves products of `r` rows (per matrix) of these
    arrays."""

    applies: Callable[..., bool]
    rows: Callable[[jax.Array, list, jax.Array], jax.Array]


def current_row_kernel() -> RowKernel | None:
    return _ROW_KERNEL.get()


_ROW_KERNEL: contextvars.ContextVar[RowKernel | None] = contextvars.ContextVar(
    "row_kernel", default=None
)


_FP8: contextvars.ContextVar[tuple[str, fp8_stats.Probe | None]] = contextvars.ContextVar(
    "fp8_recipe", default=("", None)
)


def current_fp8() -> str:
    """The fp8 recipe `project` multiplies by ('' for none)."""
    return _FP8.get()[0]


def current_fp8_probe() -> fp8_stats.Probe | None:
    """The probe the fp8 GEMMs traced now count into (fp8/stats.py), or None."""
    return _FP8.get()[1]


@contextlib.contextmanager
def fp8(recipe: str, probe: fp8_stats.Probe | None = None):
    """`project`s traced inside (without `dot_kwargs`: not the float32 heads) multiply fp8
    operands under `recipe` (fp8/matmul.py; '' for none): the decoder layers' linears
    (`decoder.block_apply`, training's config key `quantization`). `probe`: the layer's, which
    its fp8 GEMMs count their quantizers into (fp8/stats.py)."""
    token = _FP8.set((recipe, probe if recipe else None))
    try:
        yield
    finally:
        _FP8.reset(token)


@contextlib.contextmanager
def row_kernel(kernel: RowKernel | None):
    """Programs traced inside run `project`'s and `per_head`'s products by `kernel` where it
    applies, else by XLA's."""
    token = _ROW_KERNEL.set(kernel)
    try:
        yield
    finally:
        _ROW_KERNEL.reset(token)


class Joint(NamedTuple):
    """Matrices [D, F_1], [D, F_2], ... that read the same input, concatenated along the output
    axis: [D, F_1 + F_2 + ...] (one product in place of several)."""

    w: Any


def join(*ws) -> Joint:
    return Joint(jnp.concatenate(ws, axis=-1))


def is_joint(x) -> bool:
    return isinstance(x, Joint)


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
    kernel = _ROW_KERNEL.get()
    if kernel is not None and kernel.applies(x_NK.shape[0], x_NK, w_KM):
        ids_N = jnp.zeros((x_NK.shape[0],), jnp.int32)
        return kernel.rows(x_NK, [w_KM], ids_N).reshape(*lead, *out)
    recipe, probe = _FP8.get()
    if recipe and not dot_kwargs:
        lanes = None if probe is None else probe.lanes
        return fp8_matmul.dense(x_NK, w_KM, recipe, lanes).reshape(*lead, *out)
    return jnp.matmul(x_NK, w_KM, **dot_kwargs).reshape(*lead, *out)


def per_head(x_BTHI, w_HIO, preferred=None) -> jax.Array:
    """[B, T, H, I] x [H, I, O] -> [B, T, H, O], one matrix product per head over the B x T
    rows, the heads leading: XLA:CPU runs the batched product with the heads as its batch and
    canonical row-major operands in one library call, where the same einsum with the heads in
    the middle took 3-4 x longer at 8 rows (deepseek3-small, batch 8: 0.36 -> 0.10 ms)."""
    b, t, h, i = x_BTHI.shape
    x_HMI = x_BTHI.reshape(b * t, h, i).transpose(1, 0, 2)
    kernel, m = _ROW_KERNEL.get(), b * t
    if kernel is not None and kernel.applies(m, x_HMI, w_HIO):
        ids = jnp.repeat(jnp.arange(h, dtype=jnp.int32), m)
        y_HMO = kernel.rows(x_HMI.reshape(h * m, i), [w_HIO], ids).reshape(h, m, -1)
    else:
        y_HMO = jnp.einsum("hmi,hio->hmo", x_HMI, w_HIO, preferred_element_type=preferred)
    return y_HMO.transpose(1, 0, 2).reshape(b, t, h, -1)
