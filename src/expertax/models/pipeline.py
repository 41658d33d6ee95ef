"""Pipeline parallelism over a layer stack: an SPMD schedule of stages, microbatches and repeats.

The pipelined layers (`Config.pipelined_layers`, stacked `[L, ...]`) are split into S stages
(the `pipeline` mesh axis) and R repeats (`num_pipeline_repeats`, the circular schedule): layer
`l = (r * S + s) * Lps + j` runs on stage s in its r-th visit, Lps = L / (S * R) layers per
visit. The batch is split into M microbatches (`num_pipeline_microbatches`). Microbatch m passes
stage 0, 1, ..., S-1, then (with repeats) stage 0 again for its next layer group, R times.

One `lax.scan` over M * R + S - 1 iterations; its carry is the stages' inputs `[S, mb, T, D]`
(sharded over `pipeline`), the last stage's outputs by microbatch `[M, mb, T, D]` (the loop-back
buffer of the circular schedule and, at the end, the result) and the MoE statistics summed so far.
An iteration runs every stage at once: a `vmap` over the stage axis with
`spmd_axis_name="pipeline"` of a scan over the stage's layers (the ordinary decoder layer, the
expert-parallel MoE `shard_map` inside unchanged), so each device computes its own stage. At
iteration t, stage s works on k = t - s (microbatch k mod M, repeat k // M) when 0 <= k < M * R;
the other (bubble) slots compute on stale data and are masked out of the outputs and statistics.
Bubble fraction: (S - 1) / (M * R + S - 1).

Layer kinds (`attention_layer_pattern`): one layer function per kind of the cycle, a stage's
layer scan one cycle per step (models/pipeline_stages.py, which runs an iteration's stages).

Stage-to-stage shift (`pipeline_shift`): `roll` moves stage s's output to stage s + 1 with a
slice + concatenate on the stage axis, which the SPMD partitioner lowers to one
collective-permute of local data; `ppermute` does the same explicitly in a `shard_map`. Seed 3922
found MaxText's shard_map+ppermute shifts inside the scan grew temporaries (their buffers were
hoisted into the loop); both are kept so that `expertax memory` can compare them.

Backward (any `remat_policy` but `none`): the scan has its own VJP (`_pipeline_vjp`). The
forward keeps only each stage's input of each real work item (`[M * R, S, mb, T, D]`, bubble
slots not kept). The backward is a reverse scan over the iterations whose carry holds the
cotangents of the stage inputs and of the output buffer, and the stage weights' gradient
`[R, S, Lps, ...]`: each stage runs its layers forward again from the saved input (keeping their
inputs), then backward layer by layer, adding layer j's gradient into the carry at [r, s, j] in
place. Autodiff of the plain scan kept the weight gradient twice (the scan's accumulator and each
iteration's stacked layer gradients, ~40 MiB per device in the mid benchmark). The layers' own
remat policy does not apply inside the pipeline: a layer's residuals live only for its own
backward. With `none` plain autodiff runs (every activation kept) except the stage weights
indexed per iteration (`pipeline_stage_weights`), which would otherwise be saved per iteration.

Statistics: each MoE layer's balancing sums (assignments and normalized scores per expert, and
dropped assignments) are summed over the microbatches (bubbles excluded) and the load-balance loss
is recomputed from the whole batch's sums (`router.balance_stats`), exactly as without a pipeline:
the loss is bilinear in the two sums, so the mean of per-microbatch losses would not be.

Parameters keep their `[L, ...]` layout (checkpoints do not depend on the pipeline), with the
layer axis sharded over `pipeline` (logical axis `stage_layers`): for R = 1 stage s holds exactly
its layers; with R > 1 a stage's layers are not contiguous and the partitioner moves them to
their stage once per step (weights and gradients), not per microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from expertax import platform, scopes
from expertax.config.schema import Config
from expertax.models.pipeline_stages import (
    PIPELINE,
    LayerFn,
    Stages,
    spmd_axis,
    without_pipeline,
)
from expertax.nn.moe import router
from expertax.nn.moe.router import MoEStats
from expertax.parallel import remat
from expertax.sharding import constrain, logical_to_spec
from expertax.sharding.rules import current_rules

STATE_AXES = ("stage", "batch", "length", "act_embed")
SAVED_AXES = (None, *STATE_AXES)


def run(
    stacked, x_BTD, positions_BT, segment_ids_BT, c: Config, layers: Sequence[LayerFn], layer_axes,
    probes=None,
):  # fmt: skip
    """The layers `stacked` ([L, ...] leaves, L = c.pipelined_layers) as a pipeline.

    `layers`: the layer function of each kind of the stack's cycle (models/layer_pattern.py),
    layer l running `layers[l % len(layers)]`. `layer_axes`: the logical axes of one layer's
    parameters (the leaves without the layer axis). `probes` ([L, ...], fp8/stats.py): the
    layers' fp8 probes; the layer functions then take `(params, probe)` where they take params,
    carried like the weights (their cotangents, the quantizer counts, summed like the weight
    gradients), and zero in the bubbles: a bubble slot computes on stale data, and a probe's
    cotangent does not scale with the output gradient that is zero there.
    Returns (x [B, T, D], per-layer MoEStats [L, ...] in layer order, or None).
    """
    if probes is not None:
        stacked = (stacked, probes)
        layer_axes = (layer_axes, jax.tree.map(lambda a: (None,) * (a.ndim - 1), probes))
    s_n, r_n, m_n = c.pipeline_stages, c.num_pipeline_repeats, c.pipeline_microbatches
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    per_visit = num_layers // (s_n * r_n)
    b, t, d = x_BTD.shape
    if b % m_n:
        raise ValueError(f"batch {b} does not divide into num_pipeline_microbatches={m_n}")
    if per_visit % len(layers):  # (checks.check_layer_pattern refuses it)
        raise ValueError(f"{per_visit} layers per stage visit: not whole cycles of {len(layers)}")

    # [L, ...] -> [R, S, Lps, ...], the stage axis on `pipeline`.
    def on_stages(w):
        return jax.tree.map(
            lambda a, axes: constrain(a, (None, "stage", None, *axes)), w, layer_axes
        )

    w = on_stages(jax.tree.map(lambda a: a.reshape(r_n, s_n, per_visit, *a.shape[1:]), stacked))

    # Microbatch m holds rows m, m + M, m + 2M, ...: with the batch sharded in contiguous blocks
    # whose size M divides, every microbatch is spread over all batch shards (a local reshape).
    def microbatches(a):
        a = a.reshape(b // m_n, m_n, *a.shape[1:]).swapaxes(0, 1)
        return constrain(a, (None, "batch", "length", "act_embed")[: a.ndim])

    x_MBTD = microbatches(x_BTD)
    pos_MBT = microbatches(positions_BT)
    seg_MBT = None if segment_ids_BT is None else microbatches(segment_ids_BT)
    sched = _Schedule(s_n, r_n, m_n)
    inner = without_pipeline(current_rules())
    stages = Stages(tuple(layers), s_n, r_n, inner, probes is not None)
    acc0 = stages.zero_stats(w, x_MBTD, pos_MBT, seg_MBT)

    if c.remat_policy == "none":
        # autodiff: every activation kept, except the stage weights indexed per iteration
        policy = jax.checkpoint_policies.save_anything_except_these_names(
            remat.PIPELINE_STAGE_WEIGHTS
        )
        fwd = jax.checkpoint(stages.forward, policy=policy)
        out_MBTD, acc = _scan(sched, c, fwd, w, x_MBTD, pos_MBT, seg_MBT, acc0)[0]
    else:
        args = (w, x_MBTD, pos_MBT, seg_MBT, acc0)
        out_MBTD, acc = _pipeline_vjp(sched, c, stages, on_stages, *args)
    y_BTD = out_MBTD.swapaxes(0, 1).reshape(b, t, d)
    y_BTD = constrain(y_BTD, ("batch", "length", "act_embed"))
    if acc is None:
        return y_BTD, None
    flat = jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[3:]), acc)
    load, prob, dropped = flat
    stats = jax.vmap(lambda cnt, p, dr: router.balance_stats(cnt, p, b * t, c, dr))(
        load, prob, dropped
    )
    return y_BTD, stats


class _Schedule:
    """Who works on what at iteration `it` (S stages, R repeats, M microbatches)."""

    def __init__(self, s_n: int, r_n: int, m_n: int):
        self.s_n, self.r_n, self.m_n = s_n, r_n, m_n
        self.iterations = m_n * r_n + s_n - 1

    def stages(self, it):
        """(valid_S, m_S, r_S): stage s works on k = it - s (microbatch k mod M, repeat k // M)
        when 0 <= k < M * R; the other (bubble) slots compute on stale data and are masked."""
        k_S = it - jnp.arange(self.s_n, dtype=jnp.int32)
        valid_S = (k_S >= 0) & (k_S < self.m_n * self.r_n)
        return valid_S, jnp.mod(k_S, self.m_n), jnp.clip(k_S // self.m_n, 0, self.r_n - 1)

    def items(self, it):
        """The work item index k of each stage, clipped into [0, M * R) (bubbles: any item)."""
        k_S = it - jnp.arange(self.s_n, dtype=jnp.int32)
        return jnp.clip(k_S, 0, self.m_n * self.r_n - 1)

    def last(self, it):
        """(ok, m): whether the last stage finishes a real item at `it`, and its microbatch."""
        k = it - (self.s_n - 1)
        return (k >= 0) & (k < self.m_n * self.r_n), jnp.mod(k, self.m_n)


def _feed(sched: _Schedule, it, state_SBTD, x_MBTD, out_MBTD):
    """The stages' inputs at `it`: stage 0 takes a new microbatch in the first repeat, its own
    last-stage output after; the others keep what the shift brought."""
    m0 = jnp.mod(it, sched.m_n)
    first = jax.lax.dynamic_index_in_dim(x_MBTD, m0, 0, keepdims=True)
    again = jax.lax.dynamic_index_in_dim(out_MBTD, m0, 0, keepdims=True)
    stage0 = jnp.where(it < sched.m_n, first, again).astype(state_SBTD.dtype)
    return constrain(jnp.concatenate([stage0, state_SBTD[1:]], 0), STATE_AXES)


def _scan(sched: _Schedule, c: Config, forward, w, x_MBTD, pos_MBT, seg_MBT, acc0, keep=False):
    """The pipeline's forward: ((out [M, mb, T, D], stats sums), saved). With `keep`, `saved` is
    every stage's input of every real work item `[M * R, S, mb, T, D]` (item k of stage s at
    [k, s]; bubble slots are not kept), else None."""
    s_n = sched.s_n
    _, b_mb, t, d = x_MBTD.shape
    items = sched.m_n * sched.r_n

    def body(carry, it):
        state_SBTD, out_MBTD, acc, saved = carry
        valid_S, m_S, r_S = sched.stages(it)
        state_SBTD = _feed(sched, it, state_SBTD, x_MBTD, out_MBTD)
        if keep:
            saved = _per_stage(_put, saved, state_SBTD, sched.items(it), valid_S)
        pos_SBT = jnp.take(pos_MBT, m_S, axis=0)
        seg_SBT = None if seg_MBT is None else jnp.take(seg_MBT, m_S, axis=0)
        y_SBTD, stats = forward(w, r_S, state_SBTD, pos_SBT, seg_SBT, valid_S)
        y_SBTD = constrain(y_SBTD, STATE_AXES)
        # the last stage's output, by microbatch
        last_ok, m_last = sched.last(it)
        old = jax.lax.dynamic_index_in_dim(out_MBTD, m_last, 0, keepdims=True)
        new = jnp.where(last_ok, y_SBTD[s_n - 1 :], old)
        out_MBTD = jax.lax.dynamic_update_index_in_dim(out_MBTD, new, m_last, 0)
        if stats is not None:
            acc = _accumulate(acc, stats, valid_S, r_S, sched.r_n)
        return (_shift(y_SBTD, c), out_MBTD, acc, saved), None

    state0 = constrain(jnp.zeros((s_n, b_mb, t, d), x_MBTD.dtype), STATE_AXES)
    out0 = jnp.zeros_like(x_MBTD)
    saved0 = None
    if keep:
        saved0 = constrain(jnp.zeros((items, s_n, b_mb, t, d), x_MBTD.dtype), SAVED_AXES)
    its = jnp.arange(sched.iterations, dtype=jnp.int32)
    with jax.named_scope(scopes.IDLE.label(s_n - 1)):  # the bubble, for the step-time report
        (_, out_MBTD, acc, saved), _ = jax.lax.scan(body, (state0, out0, acc0, saved0), its)
    return (out_MBTD, acc), saved


def _per_stage(fn, buf_KS, *args_S, out_axes=1):
    """`fn(buf_K, *args)` for each stage (buf's axis 1 and the args' axis 0), on its device."""
    in_axes = (1,) + (0,) * len(args_S)
    fn = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, spmd_axis_name=spmd_axis())
    return fn(buf_KS, *args_S)


def _put(buf_K, x, k, ok):
    """buf[k] = x where `ok` (one stage). On GPU as a select over the K slots: the vmapped
    dynamic update becomes a scatter that XLA:GPU (jax-cuda12-plugin 0.10.2) rejects once the
    stage axis is partitioned ("Bounds of the window dimensions of updates must not exceed the
    bounds of the corresponding dimensions of operand")."""
    if platform.current() == "gpu":
        hit = (jnp.arange(buf_K.shape[0]) == k) & ok
        return jnp.where(hit.reshape((-1,) + (1,) * x.ndim), x[None].astype(buf_K.dtype), buf_K)
    old = jax.lax.dynamic_index_in_dim(buf_K, k, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf_K, jnp.where(ok, x, old), k, 0)


def _get(buf_K, k):
    return jax.lax.dynamic_index_in_dim(buf_K, k, 0, keepdims=False)


def _pipeline_vjp(
    sched: _Schedule, c: Config, stages: Stages, on_stages, w, x_MBTD, pos_MBT, seg_MBT, acc0
):
    """`_scan` with its own VJP: the residuals are the stage inputs of every iteration; the
    backward is a reverse scan over the iterations whose carry holds the weight gradient,
    added into in place layer by layer (`pipeline_stages.Stages.backward`)."""
    s_n, m_n = sched.s_n, sched.m_n

    @jax.custom_vjp
    def pipe(w, x_MBTD, pos_MBT, seg_MBT):
        return _scan(sched, c, stages.forward, w, x_MBTD, pos_MBT, seg_MBT, acc0)[0]

    def pipe_fwd(w, x_MBTD, pos_MBT, seg_MBT):
        out, saved = _scan(sched, c, stages.forward, w, x_MBTD, pos_MBT, seg_MBT, acc0, keep=True)
        return out, (w, saved, pos_MBT, seg_MBT)

    def pipe_bwd(res, cts):
        w, saved, pos_MBT, seg_MBT = res
        dout_MBTD, dacc = cts
        dsums = None if dacc is None else (dacc[0], dacc[1])  # [R, S, Lps, E] each
        stage_ids = jnp.arange(s_n)

        def body(carry, it):
            dnext_SBTD, dout_MBTD, dw, dx_MBTD = carry
            valid_S, m_S, r_S = sched.stages(it)
            state_SBTD = constrain(_per_stage(_get, saved, sched.items(it), out_axes=0), STATE_AXES)
            # stage s's output went to stage s + 1 of the next iteration (the last one's was
            # overwritten by stage 0's new input) and, for the last stage, to the output buffer
            dy_SBTD = _shift(dnext_SBTD.at[0].set(0), c, back=True)
            last_ok, m_last = sched.last(it)
            dlast = jax.lax.dynamic_index_in_dim(dout_MBTD, m_last, 0, keepdims=True)
            dy_SBTD = dy_SBTD.at[s_n - 1 :].add(jnp.where(last_ok, dlast, 0))
            dout_MBTD = jax.lax.dynamic_update_index_in_dim(
                dout_MBTD, jnp.where(last_ok, 0, dlast), m_last, 0
            )
            dsums_S = None
            if dsums is not None:

                def pick(a):  # a [R, S, Lps, E] -> [S, Lps, E], zero in the bubbles
                    v = a[r_S, stage_ids]
                    return jnp.where(valid_S[:, None, None], v, 0)

                dsums_S = jax.tree.map(pick, dsums)
            pos_SBT = jnp.take(pos_MBT, m_S, axis=0)
            seg_SBT = None if seg_MBT is None else jnp.take(seg_MBT, m_S, axis=0)
            dy_SBTD = constrain(dy_SBTD, STATE_AXES)
            dx_SBTD, dw = stages.backward(
                w, dw, r_S, state_SBTD, pos_SBT, seg_SBT, dy_SBTD, dsums_S, valid_S
            )
            dx_SBTD = constrain(dx_SBTD, STATE_AXES)
            # stage 0's input came from the microbatches (first repeat) or the output buffer
            m0 = jnp.mod(it, m_n)
            d0 = dx_SBTD[:1].astype(dx_MBTD.dtype)
            first = it < m_n
            dx_MBTD = _add_index(dx_MBTD, jnp.where(first, d0, 0), m0)
            dout_MBTD = _add_index(dout_MBTD, jnp.where(first, 0, d0), m0)
            return (dx_SBTD, dout_MBTD, dw, dx_MBTD), None

        dw0 = on_stages(jax.tree.map(jnp.zeros_like, w))
        dnext0 = jnp.zeros_like(saved[0])
        its = jnp.arange(sched.iterations, dtype=jnp.int32)
        carry0 = (dnext0, dout_MBTD, dw0, jnp.zeros_like(dout_MBTD))
        with jax.named_scope(scopes.IDLE.label(s_n - 1)):
            (_, _, dw, dx_MBTD), _ = jax.lax.scan(body, carry0, its, reverse=True)
        return dw, dx_MBTD, None, None

    pipe.defvjp(pipe_fwd, pipe_bwd)
    return pipe(w, x_MBTD, pos_MBT, seg_MBT)


def _add_index(a, v, i):
    """a[i] += v[0] along axis 0 (in place)."""
    old = jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(a, old + v, i, 0)


def _accumulate(acc, stats: MoEStats, valid_S, r_S, r_n: int):
    """acc[r_S[s], s] += stats[s] for the stages doing real work (`valid_S`)."""
    hit_RS = (jnp.arange(r_n)[:, None] == r_S[None, :]) & valid_S[None, :]

    def add(a, v):
        mask = hit_RS.reshape(hit_RS.shape + (1,) * (v.ndim - 1))
        return a + jnp.where(mask, v[None].astype(a.dtype), 0)

    load, prob, dropped = acc
    return (add(load, stats.load_E), add(prob, stats.prob_sum_E), add(dropped, stats.dropped))


def _shift(y_SBTD, c: Config, *, back: bool = False):
    """Stage s's output becomes stage s + 1's input (the last stage's wraps to stage 0, where it
    is overwritten by the next microbatch or used as its next repeat's input). `back`: the
    opposite direction (the shift's transpose, for the backward pass)."""
    if c.pipeline_shift == "ppermute" and spmd_axis() is not None:
        return _ppermute_shift(y_SBTD, back)
    return constrain(_roll(y_SBTD, back), STATE_AXES)


def _roll(y_SBTD, back: bool):
    if back:
        return jnp.concatenate([y_SBTD[1:], y_SBTD[:1]], axis=0)
    return jnp.concatenate([y_SBTD[-1:], y_SBTD[:-1]], axis=0)


def _ppermute_shift(y_SBTD, back: bool):
    mesh = jax.sharding.get_abstract_mesh()
    rules = current_rules()
    spec = logical_to_spec(STATE_AXES, rules, mesh, y_SBTD.shape) if rules else None
    if spec is None or not spec or spec[0] != PIPELINE:
        return _roll(y_SBTD, back)
    n = mesh.shape[PIPELINE]
    step = -1 if back else 1

    def shift(local):
        return jax.lax.ppermute(local, PIPELINE, [(i, (i + step) % n) for i in range(n)])

    return jax.shard_map(shift, in_specs=spec, out_specs=spec)(y_SBTD)
