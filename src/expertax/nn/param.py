"""Parameters declared once: shape, logical axes, initializer. Everything else is derived.

A layer's `spec(cfg)` returns its parameter dataclass filled with `ParamSpec` leaves. From that one
tree we derive the abstract shapes (`abstract`), the shardings (`shardings`), the logical axes
(`logical_axes`) and the initial values (`initialize`). Repeated layers are stacked along a
leading `layers` axis by `stack`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, dataclass_transform

import jax
import jax.numpy as jnp

from expertax.sharding.rules import named_sharding

# The type of a pytree dataclass field that holds an array in the model and, in the trees derived
# from the same dataclass, its ParamSpec, ShapeDtypeStruct, sharding, PartitionSpec or logical
# axes. `Param` is that for parameters (None where the config has no such parameter, e.g. `wq`
# of MLA with a query low rank).
Leaf = Any
Param = Leaf


_OPTIONAL = "expertax_optional"


class _Absent:
    """The value of an `optional()` field a model does not have."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


def optional() -> Any:
    """A parameter field that only some configs have (a q/k norm, attention sinks, biases):
    `ABSENT` by default, and then not in the pytree at all (no node), so that a model without it
    has the tree, and the checkpoints, it had before the field existed. Not None: trees derived
    by mapping leaves to None (JAX's own layouts, say) must keep the field's place. Optional
    fields come after the others; `given` reads one (None when absent)."""
    return dataclasses.field(default=ABSENT, metadata={_OPTIONAL: True})


def given(x: Any) -> Any:
    """An optional field's value, None when `ABSENT`."""
    return None if x is ABSENT else x


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, optional))
def params_dataclass(cls):
    """A frozen dataclass registered as a pytree whose fields are all data (arrays or None;
    an `optional()` field that is `ABSENT` is left out of the tree)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    if not any(f.metadata.get(_OPTIONAL) for f in fields):
        return jax.tree_util.register_dataclass(cls)
    names = tuple(f.name for f in fields)
    opt = frozenset(f.name for f in fields if f.metadata.get(_OPTIONAL))

    def present(x) -> tuple[str, ...]:
        return tuple(n for n in names if n not in opt or getattr(x, n) is not ABSENT)

    def flatten_with_keys(x):
        keep = present(x)
        return [(jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in keep], keep

    def flatten(x):
        keep = present(x)
        return [getattr(x, n) for n in keep], keep

    def unflatten(keep, children):
        return cls(**dict(zip(keep, children, strict=True)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, logical axes and initializer.

    `init` is "normal" (stddev `scale`), "zeros" or "ones". `trainable=False` parameters (the
    DeepSeek routing bias) are updated by the train step, never by the optimizer.
    `weight_decay`: whether AdamW decays it — true for matrices and embeddings, false for norm
    scales and biases, declared here so that stacking layers (a leading axis) never changes it.
    `fan_in`: for a projection, the size of its input (the product of the leading axes of its
    own matrix, after any stack or expert axes), which Muon reads as the matrix's rows; 0 for
    everything else.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    scale: float = 1.0
    trainable: bool = True
    weight_decay: bool = True
    fan_in: int = 0

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def projection(shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> ParamSpec:
    """A projection (matrix) weight: normal with stddev 1/sqrt(fan_in), weight-decayed."""
    return ParamSpec(tuple(shape), tuple(axes), "normal", 1.0 / math.sqrt(fan_in), fan_in=fan_in)


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def _map(fn: Callable[[ParamSpec], Any], tree):
    return jax.tree.map(fn, tree, is_leaf=is_spec)


def stack(tree, n: int, axis: str = "layers"):
    """Prepend a layer axis of size n, named `axis` (`stage_layers` for a pipelined stack), to
    every spec."""
    return _map(lambda s: dataclasses.replace(s, shape=(n, *s.shape), axes=(axis, *s.axes)), tree)


def abstract(tree, dtype) -> Any:
    return _map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), tree)


def logical_axes(tree) -> Any:
    return _map(lambda s: s.axes, tree)


def trainable_mask(tree) -> Any:
    return _map(lambda s: s.trainable, tree)


def weight_decay_mask(tree) -> Any:
    return _map(lambda s: s.weight_decay, tree)


def shardings(tree, mesh, rules) -> Any:
    return _map(lambda s: named_sharding(mesh, s.axes, rules, s.shape), tree)


def initialize(tree, key: jax.Array, dtype) -> Any:
    """Initial values; each leaf gets its own key from its position in the tree."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_spec)
    keys = jax.random.split(key, max(len(leaves), 1))
    values = []
    for s, k in zip(leaves, keys, strict=False):
        if s.init == "zeros":
            v = jnp.zeros(s.shape, dtype)
        elif s.init == "ones":
            v = jnp.ones(s.shape, dtype)
        elif s.init == "normal":
            v = (s.scale * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
        else:
            raise ValueError(f"unknown initializer {s.init!r}")
        values.append(v)
    return jax.tree.unflatten(treedef, values)


def count(tree) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(tree, is_leaf=is_spec))
