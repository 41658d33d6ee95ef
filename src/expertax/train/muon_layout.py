"""Where Muon's matrices are orthogonalised: each whole on one device, the devices sharing them.

Newton-Schulz needs each matrix whole; a stored leaf splits its matrices over the mesh (FSDP
splits the model dim, TP the heads, EP the experts). `Layout` plans, for one leaf, a layout in
which the stack and expert dims (the batch of matrices) carry every mesh axis that divides
them and the matrices are whole, and `apply` runs a function of the local matrices there
inside one `shard_map` with explicit collectives, then puts the result back in the storage
layout:
- a mesh axis that splits a matrix dim and divides a batch dim moves there (`all_to_all`);
- one that divides no batch dim is gathered (`all_gather`; those devices then orthogonalise
  the same matrices);
- a mesh axis the leaf is replicated over takes a slice of a batch dim it divides (no
  communication; gathered back after).
Going back runs the inverse of each step in reverse order. The explicit steps are what make
this cheap: left to the partitioner, moving part of a dim's split from a matrix dim to a
batch dim is done by gathering the whole leaf on every device and slicing ("involuntary full
rematerialization"), which a 671B expert stack cannot afford.

A batch dim no axis divides (a stack of 61 layers) is not padded: padding changes the dim's
size, and the reshard back is then the same whole-leaf gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
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
    """stored: the leaf's PartitionSpec (one entry per dim); target: its spec while the
    matrices are orthogonalised; steps: ("move", axis, batch dim, matrix dim), ("gather",
    axis, matrix dim) or ("slice", axis, batch dim), in order."""

    stored: P
    target: P
    steps: tuple[tuple, ...]

    @property
    def devices_sharing(self) -> tuple[str, ...]:
        """The mesh axes that split the batch of matrices in the target layout."""
        return tuple(a for e in self.target for a in _dim_axes(e))


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
    split = [list(_dim_axes(e)) for e in stored]
    fits = lambda a, i: shape[i] % (math.prod(sizes[b] for b in split[i]) * sizes[a]) == 0
    steps: list[tuple] = []
    for j in range(batch, len(shape)):
        for a in reversed(_dim_axes(stored[j])):  # minor first: the local blocks stay in order
            dest = next((i for i in range(batch) if fits(a, i)), None)
            if dest is None:
                steps.append(("gather", a, j))
            else:
                steps.append(("move", a, dest, j))
                split[dest].append(a)
            split[j].remove(a)
    used = {a for e in stored for a in _dim_axes(e)}
    for a in (a for a in sizes if a not in used):
        dest = next((i for i in range(batch) if fits(a, i)), None)
        if dest is not None:
            steps.append(("slice", a, dest))
            split[dest].append(a)
    return Layout(P(*stored), P(*(_entry(d) for d in split)), tuple(steps))


def _local_slice(x: jax.Array, axis: str, dim: int) -> jax.Array:
    n = x.shape[dim] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * n, n, dim)


def _there(x: jax.Array, steps) -> jax.Array:
    for step in steps:
        if step[0] == "move":
            _, a, i, j = step
            x = jax.lax.all_to_all(x, a, split_axis=i, concat_axis=j, tiled=True)
        elif step[0] == "gather":
            x = jax.lax.all_gather(x, step[1], axis=step[2], tiled=True)
        else:
            x = _local_slice(x, step[1], step[2])
    return x


def _back(x: jax.Array, steps) -> jax.Array:
    for step in reversed(steps):
        if step[0] == "move":
            _, a, i, j = step
            x = jax.lax.all_to_all(x, a, split_axis=j, concat_axis=i, tiled=True)
        elif step[0] == "gather":
            x = _local_slice(x, step[1], step[2])
        else:
            x = jax.lax.all_gather(x, step[1], axis=step[2], tiled=True)
    return x


def apply(fn: Callable[[jax.Array], jax.Array], x: jax.Array, layout: Layout | None) -> jax.Array:
    """`fn` (shape-preserving, per matrix) of leaf `x`, run on the local matrices of
    `layout`'s target (the whole leaf without a layout); the result in the storage layout."""
    if layout is None:
        return fn(x)
    body = lambda local: _back(fn(_there(local, layout.steps)), layout.steps)
    mapped = jax.shard_map(body, in_specs=layout.stored, out_specs=layout.stored, check_vma=False)
    return mapped(x)
