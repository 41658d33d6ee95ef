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
`spmd_axis_name="pipeline"` of the ordinary stacked-layer function (scan + per-layer remat, the
expert-parallel MoE `shard_map` inside unchanged), so each device computes its own stage. At
iteration t, stage s works on k = t - s (microbatch k mod M, repeat k // M) when 0 <= k < M * R;
the other (bubble) slots compute on stale data and are masked out of the outputs and statistics.
Bubble fraction: (S - 1) / (M * R + S - 1).

Stage-to-stage shift (`pipeline_shift`): `roll` moves stage s's output to stage s + 1 with a
slice + concatenate on the stage axis, which the SPMD partitioner lowers to one
collective-permute of local data; `ppermute` does the same explicitly in a `shard_map`. Seed 3922
found MaxText's shard_map+ppermute shifts inside the scan grew temporaries (their buffers were
hoisted into the loop); both are kept so that `expertax memory` can compare them.

Remat per iteration: with a `remat_policy` other than `none`, one iteration's stage computation
is a `jax.checkpoint` whose only residual is its input (the `pipeline_iteration_input`); the
layers inside keep their own policy, but their residuals live only while that iteration's
backward runs, so a layer input is never saved twice across iterations. With `none` every
activation is kept, except the stage's weights indexed per iteration
(`pipeline_stage_weights`), which would otherwise be saved once per iteration.

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

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.moe import router
from expertax.nn.moe.router import MoEStats
from expertax.parallel import remat
from expertax.sharding import constrain, logical_to_spec
from expertax.sharding.rules import current_rules, use_rules

PIPELINE = "pipeline"
ITERATION_INPUT = remat.PIPELINE_ITERATION_INPUT
STATE_AXES = ("stage", "batch", "length", "act_embed")

# stack_fn(stacked [n, ...], x [b, T, D], positions [b, T], segment_ids [b, T] | None)
#   -> (x, per-layer MoEStats [n, ...] or None)
StackFn = Callable[..., tuple[jax.Array, MoEStats | None]]


def run(stacked, x_BTD, positions_BT, segment_ids_BT, c: Config, stack_fn: StackFn, layer_axes):
    """The layers `stacked` ([L, ...] leaves, L = c.pipelined_layers) as a pipeline.

    `layer_axes`: the logical axes of one layer's parameters (the leaves without the layer axis).
    Returns (x [B, T, D], per-layer MoEStats [L, ...] in layer order, or None).
    """
    s_n, r_n, m_n = c.pipeline_stages, c.num_pipeline_repeats, c.pipeline_microbatches
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    per_visit = num_layers // (s_n * r_n)
    b, t, d = x_BTD.shape
    if b % m_n:
        raise ValueError(f"batch {b} does not divide into num_pipeline_microbatches={m_n}")
    iterations = m_n * r_n + s_n - 1

    # [L, ...] -> [R, S, Lps, ...], the stage axis on `pipeline`.
    def by_stage(a, axes):
        a = a.reshape(r_n, s_n, per_visit, *a.shape[1:])
        return constrain(a, (None, "stage", None, *axes))

    w = jax.tree.map(by_stage, stacked, layer_axes)

    # Microbatch m holds rows m, m + M, m + 2M, ...: with the batch sharded in contiguous blocks
    # whose size M divides, every microbatch is spread over all batch shards (a local reshape).
    def microbatches(a):
        a = a.reshape(b // m_n, m_n, *a.shape[1:]).swapaxes(0, 1)
        return constrain(a, (None, "batch", "length", "act_embed")[: a.ndim])

    x_MBTD = microbatches(x_BTD)
    pos_MBT = microbatches(positions_BT)
    seg_MBT = None if segment_ids_BT is None else microbatches(segment_ids_BT)

    stage_ids = jnp.arange(s_n, dtype=jnp.int32)
    inner_rules = _without_pipeline(current_rules())

    def stage(w_s, r, x, pos, seg):
        def index(a):
            a = a[0] if r_n == 1 else jax.lax.dynamic_index_in_dim(a, r, 0, False)
            return remat.tag(a, remat.PIPELINE_STAGE_WEIGHTS)

        # Inside a stage `pipeline` is the vmapped stage axis: no constraint or shard_map spec
        # in the layers may name it (outside the pipeline it is one more batch/FSDP axis).
        with use_rules(inner_rules) if inner_rules is not None else contextlib.nullcontext():
            return stack_fn(jax.tree.map(index, w_s), x, pos, seg)

    def all_stages(w, r_S, x_SBTD, pos_SBT, seg_SBT):
        x_SBTD = _name(x_SBTD)
        in_axes = (1, 0, 0, 0, None if seg_SBT is None else 0)
        fn = jax.vmap(stage, in_axes=in_axes, spmd_axis_name=_spmd_axis())
        return fn(w, r_S, x_SBTD, pos_SBT, seg_SBT)

    if c.remat_policy != "none":
        policy = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT)
    else:  # keep every activation, but not a per-iteration copy of the stage's weights
        policy = jax.checkpoint_policies.save_anything_except_these_names(
            remat.PIPELINE_STAGE_WEIGHTS
        )
    all_stages = jax.checkpoint(all_stages, policy=policy)

    def body(carry, it):
        state_SBTD, out_MBTD, acc = carry
        k_S = it - stage_ids  # work item of each stage
        valid_S = (k_S >= 0) & (k_S < m_n * r_n)
        m_S = jnp.mod(k_S, m_n)
        r_S = jnp.clip(k_S // m_n, 0, r_n - 1)
        # stage 0 takes a new microbatch in the first repeat, its own last-stage output after
        m0 = jnp.mod(it, m_n)
        first = jax.lax.dynamic_index_in_dim(x_MBTD, m0, 0, keepdims=True)
        again = jax.lax.dynamic_index_in_dim(out_MBTD, m0, 0, keepdims=True)
        stage0 = jnp.where(it < m_n, first, again).astype(state_SBTD.dtype)
        state_SBTD = constrain(jnp.concatenate([stage0, state_SBTD[1:]], 0), STATE_AXES)
        pos_SBT = jnp.take(pos_MBT, m_S, axis=0)
        seg_SBT = None if seg_MBT is None else jnp.take(seg_MBT, m_S, axis=0)
        y_SBTD, stats = all_stages(w, r_S, state_SBTD, pos_SBT, seg_SBT)
        y_SBTD = constrain(y_SBTD, STATE_AXES)
        # the last stage's output, by microbatch
        k_last = it - (s_n - 1)
        last_ok = (k_last >= 0) & (k_last < m_n * r_n)
        m_last = jnp.mod(k_last, m_n)
        old = jax.lax.dynamic_index_in_dim(out_MBTD, m_last, 0, keepdims=True)
        new = jnp.where(last_ok, y_SBTD[s_n - 1 :], old)
        out_MBTD = jax.lax.dynamic_update_index_in_dim(out_MBTD, new, m_last, 0)
        if stats is not None:
            acc = _accumulate(acc, stats, valid_S, r_S, r_n)
        return (_shift(y_SBTD, c), out_MBTD, acc), None

    state0 = constrain(jnp.zeros((s_n, b // m_n, t, d), x_BTD.dtype), STATE_AXES)
    out0 = jnp.zeros_like(x_MBTD)
    acc0 = _zero_stats(stage, w, x_MBTD, pos_MBT, seg_MBT, r_n, s_n)
    (_, out_MBTD, acc), _ = jax.lax.scan(
        body, (state0, out0, acc0), jnp.arange(iterations, dtype=jnp.int32)
    )
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


def _without_pipeline(rules):
    """`rules` with the `pipeline` mesh axis removed from every entry (None stays None)."""
    if rules is None:
        return None
    return {k: tuple(a for a in v if a != PIPELINE) for k, v in rules.items()}


def _spmd_axis():
    """`pipeline` when running under a mesh that has it, else None (a plain vmap)."""
    mesh = jax.sharding.get_abstract_mesh()
    return PIPELINE if PIPELINE in getattr(mesh, "axis_names", ()) else None


def _name(x):
    return remat.tag(x, ITERATION_INPUT)


def _zero_stats(stage, w, x_MBTD, pos_MBT, seg_MBT, r_n: int, s_n: int):
    """Zero sums `(load [R, S, Lps, E], prob_sum [R, S, Lps, E], dropped [R, S, Lps])`, or None
    for a stack without MoE layers (found from the shapes of one stage's statistics)."""
    seg = None if seg_MBT is None else seg_MBT[0]
    w0 = jax.tree.map(lambda a: a[:, 0], w)
    _, stats = jax.eval_shape(stage, w0, jnp.int32(0), x_MBTD[0], pos_MBT[0], seg)
    if stats is None:
        return None
    lead = (r_n, s_n)
    return (
        jnp.zeros(lead + stats.load_E.shape, jnp.float32),
        jnp.zeros(lead + stats.prob_sum_E.shape, jnp.float32),
        jnp.zeros(lead + stats.dropped.shape, jnp.int32),
    )


def _accumulate(acc, stats: MoEStats, valid_S, r_S, r_n: int):
    """acc[r_S[s], s] += stats[s] for the stages doing real work (`valid_S`)."""
    hit_RS = (jnp.arange(r_n)[:, None] == r_S[None, :]) & valid_S[None, :]

    def add(a, v):
        mask = hit_RS.reshape(hit_RS.shape + (1,) * (v.ndim - 1))
        return a + jnp.where(mask, v[None].astype(a.dtype), 0)

    load, prob, dropped = acc
    return (add(load, stats.load_E), add(prob, stats.prob_sum_E), add(dropped, stats.dropped))


def _shift(y_SBTD, c: Config):
    """Stage s's output becomes stage s + 1's input (the last stage's wraps to stage 0, where it
    is overwritten by the next microbatch or used as its next repeat's input)."""
    if c.pipeline_shift == "ppermute" and _spmd_axis() is not None:
        return _ppermute_shift(y_SBTD)
    rolled = jnp.concatenate([y_SBTD[-1:], y_SBTD[:-1]], axis=0)
    return constrain(rolled, STATE_AXES)


def _ppermute_shift(y_SBTD):
    mesh = jax.sharding.get_abstract_mesh()
    rules = current_rules()
    spec = logical_to_spec(STATE_AXES, rules, mesh, y_SBTD.shape) if rules else None
    if spec is None or not spec or spec[0] != PIPELINE:
        return jnp.concatenate([y_SBTD[-1:], y_SBTD[:-1]], axis=0)
    n = mesh.shape[PIPELINE]

    def shift(local):
        return jax.lax.ppermute(local, PIPELINE, [(i, (i + 1) % n) for i in range(n)])

    return jax.shard_map(shift, in_specs=spec, out_specs=spec)(y_SBTD)
