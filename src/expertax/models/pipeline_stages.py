"""One iteration of the pipeline (models/pipeline.py) on every stage at once: a `vmap` over the
stage axis (spmd_axis_name `pipeline`, so each device computes its own stage) of a scan over the
stage's layers, forward and backward.

Layer kinds (`attention_layer_pattern`, models/layer_pattern.py): the caller passes one layer
function per kind of the n-layer cycle. Lps (layers per stage visit) is a multiple of n
(checks.check_layer_pattern), so layer l's kind l mod n is j mod n on every stage and in every
visit, and a stage's layer scan runs one cycle per step (`layer_pattern.scan`), each layer's
attention mask static.

The backward (`Stages.backward`) runs a stage's layers forward again from its saved input
(keeping their inputs), then backward layer by layer, adding layer j's weight gradient into the
caller's accumulator at [r, s, j] in place; a layer's residuals live only for its own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from expertax.models import layer_pattern
from expertax.nn.moe.router import MoEStats
from expertax.parallel import remat
from expertax.sharding.rules import use_rules

PIPELINE = "pipeline"

# layer(x [b, T, D], one layer's params, positions [b, T], segment_ids [b, T] | None)
#   -> (x, MoEStats or None): one decoder layer, without remat (the pipeline places it)
LayerFn = Callable[..., tuple[jax.Array, MoEStats | None]]


class Stages:
    """All stages of one iteration at once: a `vmap` over the stage axis (spmd_axis_name
    `pipeline`, so each device computes its own stage) of a scan over the stage's layers, one
    cycle of the layer kinds per step (`layers`: one function per kind; layer j of a visit is of
    kind j mod n, the visit's length a multiple of n)."""

    def __init__(
        self, layers: tuple[LayerFn, ...], s_n: int, r_n: int, inner_rules, probed: bool = False
    ):
        self.layers, self.s_n, self.r_n, self.inner_rules = layers, s_n, r_n, inner_rules
        self.probed = probed  # the weights are (params, fp8 probes): `pipeline.run`

    def _rules(self):
        # Inside a stage `pipeline` is the vmapped stage axis: no constraint or shard_map spec
        # in the layers may name it (outside the pipeline it is one more batch/FSDP axis).
        if self.inner_rules is None:
            return contextlib.nullcontext()
        return use_rules(self.inner_rules)

    def _visit(self, r):
        """The repeat index to use: a constant 0 without repeats (no gather under the vmap)."""
        return 0 if self.r_n == 1 else r

    def _layer_params(self, w_s, r, j):
        """Layer j of a stage's visit r, [R, Lps, ...] -> [...]: one layer's slice per step, never
        a copy of the visit's [Lps, ...] weights."""

        def index(a):
            a = jax.lax.dynamic_index_in_dim(a, self._visit(r), 0, False)
            return remat.tag(
                jax.lax.dynamic_index_in_dim(a, j, 0, False), remat.PIPELINE_STAGE_WEIGHTS
            )

        return jax.tree.map(index, w_s)

    def _masked(self, p, valid):
        """A layer's params with its fp8 probe times `valid` (the stage's slot is real work, not
        a bubble), inside what is differentiated: the probe's cotangent is then masked too."""
        if not self.probed:
            return p
        params, probe = p
        return params, jax.tree.map(lambda a: a * valid.astype(a.dtype), probe)

    def _layers(self, w_s):
        return jnp.arange(jax.tree.leaves(w_s)[0].shape[1], dtype=jnp.int32)

    def _vmap(self, fn, in_axes, out_axes=0):
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, spmd_axis_name=spmd_axis())

    def forward(self, w, r_S, x_SBTD, pos_SBT, seg_SBT, valid_S):
        """(y [S, mb, T, D], per-layer stats [S, Lps, ...] or None)."""

        def stage(w_s, r, x, pos, seg, valid):
            def body(layer):
                return lambda x, j: layer(
                    x, self._masked(self._layer_params(w_s, r, j), valid), pos, seg
                )

            with self._rules():
                bodies = [body(layer) for layer in self.layers]
                return layer_pattern.scan(bodies, x, self._layers(w_s))

        x_SBTD = remat.tag(x_SBTD, remat.PIPELINE_ITERATION_INPUT)
        in_axes = (1, 0, 0, 0, None if seg_SBT is None else 0, 0)
        return self._vmap(stage, in_axes)(w, r_S, x_SBTD, pos_SBT, seg_SBT, valid_S)

    def backward(self, w, dw, r_S, x_SBTD, pos_SBT, seg_SBT, dy_SBTD, dsums_S, valid_S):
        """The VJP of `forward` at x: (dx [S, mb, T, D], dw + the weights' gradient).

        Each stage runs its layers forward again keeping their inputs, then backward layer by
        layer (each layer's forward once more, all of its residuals alive only for its own
        backward), adding layer j's weight gradient into `dw[r, s, j]` in place: the stage's
        weight gradient exists once (the caller's accumulator), not once more per iteration.
        `dsums_S`: the cotangents of the stats sums (load_E, prob_sum_E) [S, Lps, E] or None.
        """

        def stage(w_s, dw_s, r, x, pos, seg, dy, dsums, valid):
            def sums(stats):
                return None if stats is None else (stats.load_E, stats.prob_sum_E)

            def kind(fn):
                def layer(p, x):
                    y, stats = fn(x, self._masked(p, valid), pos, seg)
                    return y, sums(stats)

                return layer

            def again(layer):
                return lambda x, j: (layer(self._layer_params(w_s, r, j), x)[0], x)

            def back(layer, xs):
                def body(carry, j):
                    dx, dw_s = carry
                    x_j = jax.lax.dynamic_index_in_dim(xs, j, 0, False)
                    ds = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False), dsums)
                    _, vjp = jax.vjp(layer, self._layer_params(w_s, r, j), x_j)
                    dp, dx = vjp((dx, ds))
                    dw_s = jax.tree.map(lambda a, g: _add_at(a, g, self._visit(r), j), dw_s, dp)
                    return (dx, dw_s), None

                return body

            with self._rules():
                layers = self._layers(w_s)
                kinds = [kind(fn) for fn in self.layers]
                _, xs = layer_pattern.scan([again(k) for k in kinds], x, layers)
                backs = [back(k, xs) for k in kinds]
                (dx, dw_s), _ = layer_pattern.scan(backs, (dy, dw_s), layers, reverse=True)
            return dx, dw_s

        seg_axis = None if seg_SBT is None else 0
        sums_axis = None if dsums_S is None else 0
        in_axes = (1, 1, 0, 0, 0, seg_axis, 0, sums_axis, 0)
        fn = self._vmap(stage, in_axes, out_axes=(0, 1))
        return fn(w, dw, r_S, x_SBTD, pos_SBT, seg_SBT, dy_SBTD, dsums_S, valid_S)

    def zero_stats(self, w, x_MBTD, pos_MBT, seg_MBT):
        """Zero sums `(load [R, S, Lps, E], prob_sum [R, S, Lps, E], dropped [R, S, Lps])`, or
        None for a stack without MoE layers (found from the shapes of the stages' statistics)."""
        seg = None if seg_MBT is None else seg_MBT[:1]
        r0 = jnp.zeros((self.s_n,), jnp.int32)
        x = jnp.broadcast_to(x_MBTD[:1], (self.s_n, *x_MBTD.shape[1:]))
        pos = jnp.broadcast_to(pos_MBT[:1], (self.s_n, *pos_MBT.shape[1:]))
        seg = None if seg is None else jnp.broadcast_to(seg, pos.shape)
        _, stats = jax.eval_shape(self.forward, w, r0, x, pos, seg, r0 == 0)
        if stats is None:
            return None
        lead = (self.r_n,)
        return (
            jnp.zeros(lead + stats.load_E.shape, jnp.float32),
            jnp.zeros(lead + stats.prob_sum_E.shape, jnp.float32),
            jnp.zeros(lead + stats.dropped.shape, jnp.int32),
        )


def _add_at(acc, g, r, j):
    """acc[r, j] += g, in place (acc [R, Lps, ...] of one stage)."""
    idx = (r, j) + (0,) * g.ndim
    old = jax.lax.dynamic_slice(acc, idx, (1, 1, *g.shape))
    return jax.lax.dynamic_update_slice(acc, old + g[None, None].astype(acc.dtype), idx)


def without_pipeline(rules):
    """`rules` with the `pipeline` mesh axis removed from every entry (None stays None)."""
    if rules is None:
        return None
    return {k: tuple(a for a in v if a != PIPELINE) for k, v in rules.items()}


def spmd_axis():
    """`pipeline` when running under a mesh that has it, else None (a plain vmap)."""
    mesh = jax.sharding.get_abstract_mesh()
    return PIPELINE if PIPELINE in getattr(mesh, "axis_names", ()) else None
