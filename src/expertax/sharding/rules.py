"""Logical axis names -> mesh axes, through a rules table that is data (configs/parallel/*.yml,
read by `expertax.config.load_rules`; this layer only applies a table it is given).

`constrain(x, axes)` is the one helper that places activations at block boundaries. It reads the
mesh from `jax.set_mesh` and the rules from `use_rules`; outside both it does nothing, so layers
stay plain functions usable on one device. Two of seed 3922's temp-memory reductions live here:
mesh axes of size one are dropped from every spec, and an all-None spec emits no constraint.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

Rules = Mapping[str, tuple[str, ...]]
_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar(
    "expertax_rules", default=None
)


@contextlib.contextmanager
def use_rules(rules: Rules):
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> Rules | None:
    return _RULES.get()


def _axis_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules, mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Map logical axes to a PartitionSpec: size-one mesh axes dropped, each mesh axis used once.

    With `shape`, a mesh axis that does not divide its dimension is dropped too (that dimension
    is replicated over it rather than sharded unevenly).
    """
    sizes = _axis_sizes(mesh)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for i, name in enumerate(axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        kept: list[str] = []
        dim = None if shape is None else shape[i]
        for axis in rules[name]:
            size = sizes.get(axis, 1)
            if size == 1 or axis in used:
                continue
            prod = size
            for k in kept:
                prod *= sizes[k]
            if dim is not None and dim % prod:
                continue
            kept.append(axis)
            used.add(axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(mesh, axes, rules: Rules, shape=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))


def constrain(x: jax.Array, axes: Sequence[str | None], *, replicated: bool = False) -> jax.Array:
    """Constrain an activation's sharding by logical axes; a no-op without mesh and rules.
    `replicated`: emit the constraint even where every dim is replicated (a weight gathered
    whole before a lookup), which is otherwise left to the partitioner."""
    rules = _RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    spec = logical_to_spec(axes, rules, mesh, x.shape)
    if all(s is None for s in spec) and not replicated:
        return x
    return jax.lax.with_sharding_constraint(x, spec)
