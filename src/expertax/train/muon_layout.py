"""Where Muon's matrices are orthogonalised: each whole on one device, the devices sharing them.

Newton-Schulz needs each matrix whole; a stored leaf splits its matrices over the mesh (FSDP
splits the model dim, TP the heads, EP the experts). `apply` runs a function of whole matrices
inside one `shard_map` over the leaf's storage layout (`plan`), with explicit collectives:
each device flattens its local stack and expert dims into one batch of matrices, then
- for every mesh axis that splits a matrix dim (the minor one first), pads the batch with zero
  matrices to a multiple of the axis and `all_to_all`s it there: the matrix dim is whole
  again, and the batch is split further;
- for every mesh axis the leaf is replicated over, pads the same way and keeps its own slice
  (no communication);
then orthogonalises its ceil(batch / devices) matrices, and undoes each step in reverse order
(all-to-alls back, gathers for the slices, the padding cut off). Which matrices a device gets
does not matter: each is orthogonalised alone, and the way back is the exact inverse.

Why explicit: left to the partitioner, moving part of a dim's split from a matrix dim to a
batch dim is done by gathering the whole leaf on every device and slicing ("involuntary full
rematerialization"), which a 671B expert stack cannot afford; and a stack of 61 layers, or 58
x 32 local experts against a 64-way axis, divides by no axis until it is flattened and padded
here, locally.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from expertax.sharding.rules import current_rules, logical_to_spec


def _dim_axes(entry) -> list[str]:
    if entry is None:
        return []
    return [entry] if isinstance(entry, str) else list(entry)


def _entry(axes: list[str]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """stored: the leaf's PartitionSpec; batch: its leading dims that index matrices; steps:
    ("move", axis, dim) for an axis that splits matrix dim `dim`, ("slice", axis) for one the
    leaf is replicated over, in order."""

    stored: P
    batch: int
    steps: tuple[tuple, ...]


def plan(shape: tuple[int, ...], axes: tuple[str | None, ...], batch: int) -> Layout | None:
    """The layout of a leaf of `shape` and logical `axes` whose first `batch` dims index its
    matrices, on the ambient mesh under the rules in use; None without a mesh of more than
    one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    auto = zip(mesh.axis_names, mesh.axis_types, strict=True)
    sizes = {n: mesh.shape[n] for n, t in auto if t == AxisType.Auto and mesh.shape[n] > 1}
    if not sizes:
        return None
    rules = current_rules()
    stored: list = [] if rules is None else list(logical_to_spec(axes, rules, mesh, shape))
    stored += [None] * (len(shape) - len(stored))
    stored = [_entry([a for a in _dim_axes(e) if a in sizes]) for e in stored]
    steps: list[tuple] = [
        ("move", a, j) for j in range(batch, len(shape)) for a in reversed(_dim_axes(stored[j]))
    ]
    used = {a for e in stored for a in _dim_axes(e)}
    steps += [("slice", a) for a in sizes if a not in used]
    return Layout(P(*stored), batch, tuple(steps))


def _padded(x: jax.Array, multiple: int) -> tuple[jax.Array, int]:
    pad = -x.shape[0] % multiple
    return (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x), pad


def _there(y: jax.Array, layout: Layout) -> tuple[jax.Array, list[int]]:
    """The local batch [B, *matrix dims] in the orthogonalising layout, and each step's pad."""
    pads = []
    for step in layout.steps:
        y, pad = _padded(y, jax.lax.axis_size(step[1]))
        pads.append(pad)
        if step[0] == "move":
            concat = 1 + step[2] - layout.batch
            y = jax.lax.all_to_all(y, step[1], split_axis=0, concat_axis=concat, tiled=True)
        else:
            n = y.shape[0] // jax.lax.axis_size(step[1])
            y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(step[1]) * n, n, 0)
    return y, pads


def _back(z: jax.Array, layout: Layout, pads: list[int]) -> jax.Array:
    for step, pad in reversed(list(zip(layout.steps, pads, strict=True))):
        if step[0] == "move":
            split = 1 + step[2] - layout.batch
            z = jax.lax.all_to_all(z, step[1], split_axis=split, concat_axis=0, tiled=True)
        else:
            z = jax.lax.all_gather(z, step[1], axis=0, tiled=True)
        z = z[: z.shape[0] - pad]
    return z


def apply(
    fn: Callable[[jax.Array], jax.Array], x: jax.Array, batch: int, layout: Layout | None
) -> jax.Array:
    """`fn` of whole matrices [B, *matrix dims] -> same shape, applied to every matrix of leaf
    `x` (its first `batch` dims index them) in `layout` (module docstring; the whole leaf on
    every device without a layout); the result in the storage layout."""

    def local(block: jax.Array) -> jax.Array:
        lead = block.shape[:batch]
        y = block.reshape(math.prod(lead), *block.shape[batch:])
        if layout is None:
            return fn(y).reshape(block.shape)
        y, pads = _there(y, layout)
        return _back(fn(y), layout, pads).reshape(block.shape)

    if layout is None:
        return local(x)
    mapped = jax.shard_map(local, in_specs=layout.stored, out_specs=layout.stored, check_vma=False)
    return mapped(x)
