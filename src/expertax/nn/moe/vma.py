"""Varying manual axes (`shard_map`'s vma types) of the arrays inside an expert-parallel body.

Inside `jax.shard_map` with vma checking every array carries the manual axes it varies over; a
`while_loop` carry, a custom VJP's cotangents and a kernel's outputs must carry the same axes as
the values they stand for. These helpers read and widen those types (outside a `shard_map` they
do nothing).
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """The manual (shard_map) axes `x` varies over (none outside a shard_map)."""
    return getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())


def varying_over(x, axes):
    """`x` marked as varying over the manual (shard_map) axes `axes` it does not vary over yet."""
    missing = frozenset(axes) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def varying_like(x, *refs):
    """`x` marked as varying over every manual (shard_map) axis any of `refs` varies over.

    A loop carry initialised with `jnp.zeros` is invariant inside `shard_map`, while the body's
    output varies with the local weights or `axis_index`; `while_loop` needs equal types.
    """
    return varying_over(x, frozenset().union(*(varying_axes(r) for r in refs)))


def varying_alike(*xs):
    """`xs`, each marked as varying over every manual axis any of them varies over."""
    return tuple(varying_like(x, *xs) for x in xs)
