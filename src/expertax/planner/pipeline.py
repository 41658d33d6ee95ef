"""The pipeline part of `expertax memory`: the schedule and what one stage holds per device.

With `ici_pipeline_parallelism` x `dcn_pipeline_parallelism` = S > 1 stages, the first
`pipelined_layers` layers of the pipelined stack (the MoE stack of an MoE model, every layer of a
dense one) run as S stages over M microbatches, each stage holding R (`num_pipeline_repeats`)
groups of L / (S R) layers (models/pipeline.py). The report gives:
- the schedule: S, M, R, L, layers per stage and the bubble fraction (S - 1) / (M R + S - 1)
  (`Config.pipeline_bubble_fraction`; GPipe's idle share, Huang et al. 2019, with the circular
  schedule's R groups per stage as in Narayanan et al. 2021);
- per stage and device, from the shardings of the abstract train state: the parameters and
  optimizer state sharded over the `pipeline` mesh axis (one stage's share of the pipelined
  layers) apart from those every stage holds whole (embeddings, output head, the layers outside
  the pipeline, optimizer counters; a partly pipelined stack, whose weights the decoder keeps
  replicated over `pipeline`). XLA's compiled figures are per device already, and under SPMD
  every device of a stage runs the same program: they are one stage's;
- the activations: the pipeline's scan runs M R + S - 1 iterations (bubbles included); with a
  remat policy its own VJP saves the stage input of each of the M R real work items
  ([microbatch rows, T, D] per device), and one iteration's backward holds its layers' inputs and
  one layer's residuals (memory.stack_residuals, memory.iteration_residual_bytes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from expertax.config.schema import Config

PIPELINE_AXIS = "pipeline"  # the mesh axis of the stages (sharding/mesh.py)


def sharded_over(sharding, axis: str) -> bool:
    """Whether `sharding` (a NamedSharding; None or another kind: no) splits an array over the
    mesh axis `axis`."""
    spec = getattr(sharding, "spec", None)
    for entry in spec or ():
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            return True
    return False


def stage_split(tree, axis: str = PIPELINE_AXIS) -> tuple[int, int]:
    """(bytes per device of the leaves sharded over `axis`, bytes per device of the others) of
    an abstract tree whose leaves carry their shardings."""
    staged = shared = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        size = math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
        if sharded_over(sharding, axis):
            staged += size
        else:
            shared += size
    return staged, shared


def pipelined_layers(c: Config, *, moe: bool) -> int:
    """Layers of the MoE (`moe`) or dense stack that the pipeline runs (0: none)."""
    return c.pipelined_layers if c.pipelined_stack == ("moe" if moe else "dense") else 0


def layers_outside(c: Config, *, moe: bool) -> int:
    """Layers of the MoE (`moe`) or dense stack that run outside the pipeline."""
    stack = c.num_moe_layers if moe else c.num_dense_layers
    return stack - pipelined_layers(c, moe=moe)


def iterations(c: Config) -> int:
    """Iterations of the pipeline's scan: M R + S - 1 (models/pipeline.py)."""
    return c.pipeline_microbatches * c.num_pipeline_repeats + c.pipeline_stages - 1


def work_items(c: Config) -> int:
    """Work items of one stage, M R: the stage inputs the pipeline's VJP saves per device."""
    return c.pipeline_microbatches * c.num_pipeline_repeats


def microbatch_rows(c: Config, global_batch: int, batch_shards: int) -> int:
    """Sequences of one microbatch per device: the global batch / M, split over the batch axes
    (`batch_shards`, the stage axis aside); rounded up."""
    return -(-global_batch // (c.pipeline_microbatches * batch_shards))


def pipeline_report(
    c: Config, state, microbatch_rows: int, iteration_residual_bytes: int | None
) -> dict | None:
    """The schedule, per-stage state bytes and activation sizes of `c`'s pipeline (None without
    stages).

    `state`: the abstract train state (leaves carry their shardings; `Trainer.abstract_state`).
    `microbatch_rows`: sequences of one microbatch per device (`microbatch_rows`).
    `iteration_residual_bytes`: what one iteration's stage recomputes in its backward
    (memory.iteration_residual_bytes; None with remat_policy=none).
    """
    s = c.pipeline_stages
    if s == 1:
        return None
    layers, repeats = c.pipelined_layers, c.num_pipeline_repeats
    stack = c.num_moe_layers if c.pipelined_stack == "moe" else c.num_dense_layers
    params_staged, params_shared = stage_split(state.params)
    opt_staged, opt_shared = stage_split(state.opt_state)
    return {
        "stages": s,
        "microbatches": c.pipeline_microbatches,
        "repeats": repeats,
        "stack": c.pipelined_stack,
        "pipelined_layers": layers,
        "unpipelined_layers": stack - layers,
        "layers_per_stage": layers // s,
        "layers_per_stage_per_repeat": layers // (s * repeats),
        "bubble_fraction": c.pipeline_bubble_fraction,
        "shift": c.pipeline_shift,
        "iterations": iterations(c),
        "saved_inputs": work_items(c),
        "microbatch_rows_per_device": microbatch_rows,
        "iteration_input_bytes": microbatch_rows
        * c.max_target_length
        * c.base_emb_dim
        * jnp.dtype(c.dtype).itemsize,
        "iteration_residual_bytes": iteration_residual_bytes,
        "stage_parameter_bytes": params_staged,
        "stage_optimizer_state_bytes": opt_staged,
        "shared_parameter_bytes": params_shared,
        "shared_optimizer_state_bytes": opt_shared,
        "sharded_over_stages": params_staged > 0,
    }


def format_pipeline(p: dict, fmt) -> list[str]:
    """The report's pipeline lines; `fmt` formats a byte count."""
    circular = f" ({p['repeats']} repeats, circular)" if p["repeats"] > 1 else ""
    per_repeat = f", {p['layers_per_stage_per_repeat']} per repeat" if p["repeats"] > 1 else ""
    after = (
        f"; {p['unpipelined_layers']} more run after the pipeline"
        if p["unpipelined_layers"]
        else ""
    )
    stack = "MoE" if p["stack"] == "moe" else p["stack"]
    lines = [
        f"pipeline: {p['stages']} stages x {p['microbatches']} microbatches{circular}, "
        f"shift={p['shift']}; {p['pipelined_layers']} pipelined {stack} layers, "
        f"{p['layers_per_stage']} per stage{per_repeat}{after}",
        f"  bubble fraction (S - 1) / (M R + S - 1) = {p['bubble_fraction']:.3f} of the pipelined "
        "layers' time",
        "  per stage and device: parameters "
        f"{fmt(p['stage_parameter_bytes'] + p['shared_parameter_bytes'])} "
        f"({fmt(p['stage_parameter_bytes'])} this stage's layers + "
        f"{fmt(p['shared_parameter_bytes'])} held by every stage), optimizer state "
        f"{fmt(p['stage_optimizer_state_bytes'] + p['shared_optimizer_state_bytes'])} "
        f"({fmt(p['stage_optimizer_state_bytes'])} + {fmt(p['shared_optimizer_state_bytes'])})",
    ]
    if p["iteration_residual_bytes"] is not None:
        lines.append(
            f"  activations: {p['iterations']} iterations (M R + S - 1); the {p['saved_inputs']} "
            f"work items (M R) each save their stage input ({p['microbatch_rows_per_device']} "
            f"rows per device, {fmt(p['iteration_input_bytes'])}); one iteration's backward "
            f"holds {fmt(p['iteration_residual_bytes'])} (its layers' inputs and one layer's "
            "residuals)"
        )
    if p["sharded_over_stages"]:
        return lines
    why = (
        "the stack is partly pipelined (pipeline_parallel_layers): its weights are replicated "
        "over the stages, each using its slice"
        if p["unpipelined_layers"]
        else "check the sharding rules (stage_layers)"
    )
    lines.append(
        f"  note: no parameter is sharded over the pipeline axis, every stage holds all the "
        f"pipelined layers: {why}"
    )
    return lines
