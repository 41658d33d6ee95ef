"""Per-layer attention kinds (`attention_layer_pattern`): a layer stack scanned one cycle at a time.

GPT-OSS alternates sliding-window and full attention layers. The layers keep one stacked parameter
tree ([L, ...] leaves, as every other model's), and the scan runs over L / n cycles of the n-layer
pattern: its body unrolls one cycle, layer j of it with the j-th kind's mask (MaxText's way for
Gemma 3 and GPT-OSS), so every mask stays static and each kernel (splash's and cuDNN's local masks
included) sees its own window. A stack whose layers are all of one kind runs the plain scan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from expertax.config.schema import Config


def windows(c: Config) -> tuple[int | None, ...]:
    """The stack's cycle of sliding windows (None: full attention); one entry where every layer
    is of one kind."""
    cycle = c.attention_windows
    return cycle[:1] if len(set(cycle)) == 1 else cycle


def window_of(c: Config, layer: int) -> int | None:
    """The sliding window of layer `layer` of a stack (its index within the stack: each stack's
    length is a multiple of the cycle's, checks.check_layer_pattern)."""
    cycle = windows(c)
    return cycle[layer % len(cycle)]


def scan(bodies: Sequence[Callable], x, xs):
    """`lax.scan` over the layers `xs` ([L, ...] leaves) with layer l run by
    `bodies[l % len(bodies)]` (each `(x, layer) -> (x, stats or None)`); stats stacked [L, ...]."""
    n = len(bodies)
    if n == 1:
        return jax.lax.scan(bodies[0], x, xs)
    cycles = jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), xs)

    def cycle(x, layers):
        stats = []
        for j, body in enumerate(bodies):
            x, s = body(x, jax.tree.map(lambda a, j=j: a[j], layers))
            stats.append(s)
        return x, None if stats[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *stats)

    x, stats = jax.lax.scan(cycle, x, cycles)
    return x, jax.tree.map(lambda a: a.reshape(a.shape[0] * n, *a.shape[2:]), stats)
