"""Per-layer attention kinds (`attention_layer_pattern`): a layer stack scanned one cycle at a time.

GPT-OSS alternates sliding-window and full attention layers. The layers keep one stacked parameter
tree ([L, ...] leaves, as every other model's), and the scan runs over L / n cycles of the n-layer
pattern: its body unrolls one cycle, layer j of it with the j-th kind's mask (MaxText's way for
Gemma 3 and GPT-OSS), so every mask stays static and each kernel (splash's and cuDNN's local masks
included) sees its own window. A stack whose layers are all of one kind runs the plain scan.
The same cycle scan runs a pipeline stage's layers (models/pipeline.py: a stage visit is whole
cycles) and the paged-stash stack's forward and backward (models/stashed_stack.py).
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


def scan(bodies: Sequence[Callable], x, xs, *, reverse: bool = False):
    """`lax.scan` over the layers `xs` ([L, ...] leaves, L a multiple of n = len(bodies)) with
    layer l run by `bodies[l % n]` (each `(x, layer) -> (x, out)`, `out` any tree or None);
    the outs stacked [L, ...] in layer order. `reverse`: the layers from the last to the first
    (a backward pass), as `lax.scan(..., reverse=True)`."""
    n = len(bodies)
    if n == 1:
        return jax.lax.scan(bodies[0], x, xs, reverse=reverse)
    cycles = jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), xs)
    order = range(n - 1, -1, -1) if reverse else range(n)

    def cycle(x, layers):
        outs = [None] * n
        for j in order:
            x, outs[j] = bodies[j](x, jax.tree.map(lambda a, j=j: a[j], layers))
        return x, None if outs[0] is None else jax.tree.map(lambda *o: jnp.stack(o), *outs)

    x, outs = jax.lax.scan(cycle, x, cycles, reverse=reverse)
    return x, jax.tree.map(lambda a: a.reshape(a.shape[0] * n, *a.shape[2:]), outs)
