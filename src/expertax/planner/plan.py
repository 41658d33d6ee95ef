"""`expertax memory`: what the train step keeps, per device, before anything is allocated.

The train step is lowered with abstract state (ShapeDtypeStructs carrying their shardings) and
compiled for the configured mesh; nothing is placed on a device. The report has four parts:
- the persistent state per device (parameters, optimizer state, gradients) from the shardings;
- the residuals each layer saves for the backward pass, by checkpoint name, found by linearizing
  one layer under the layer policy with the per-device batch and reading the jaxpr that builds
  the linear function's residuals (`residuals.py`), multiplied by the number of layers in its
  stack (the scan stacks them);
- XLA's own figures for the compiled step (`compiled.memory_analysis()`): arguments, outputs,
  aliased bytes, temporaries, and their host-memory counterparts;
- with `moe_paged_stash`, the stash (`stash.py`): the MoE stack keeps per layer only its
  input, plus the shared buffers of the stashed names; the report gives the buffers' bytes, the
  bytes of the real rows they are sized for, and what the same names cost without the stash;
- with pipeline stages, the schedule (stages, microbatches, repeats, layers per stage, bubble
  fraction) and what one stage holds per device (`pipeline.py`); the pipelined layers'
  residuals are what the pipeline's scan saves (`stack_residuals`);
- the peak estimate (arguments + outputs - aliased + temporaries) against an HBM budget;
- attribution (`attribute.py`): the largest buffers alive at the peak of XLA's buffer
  assignment (read from its text dumps, `hlo.py`), each with its HLO instruction, the file:line
  of our code that built it (the innermost stack frame under src/expertax) and its checkpoint
  name, if any.

Residual shapes split the batch over the data, fsdp and expert axes, and their bytes each
sequence's tokens over the context axis; splits of heads, hidden dims or experts (tensor
parallelism, the [E, B, C, .] tensors of the dense MoE dispatch under expert parallelism) are not
applied, so those entries are upper bounds. XLA:CPU has one memory
for device and pinned host: its figures count offloaded tensors as device bytes, so the peak
estimate subtracts what the config itself places on host (offloaded parameters, optimizer state
and remat names) and says so.
"""

from __future__ import annotations

import math
import re

import jax
import jax.extend
import jax.numpy as jnp

from expertax import platform
from expertax.config.schema import Config
from expertax.parallel import remat
from expertax.planner import pipeline as memory_pipeline
from expertax.planner.attribute import compile_and_attribute
from expertax.planner.costs import step_costs
from expertax.planner.residuals import (
    iteration_residual_bytes,
    names_not_saved,
    residual_total,
    stack_residuals,
)
from expertax.planner.stash import stash_report
from expertax.steptime import program
from expertax.train.trainer import build_trainer

GIB = 1024**3


def _shard_bytes(abstract_tree, dtype=None) -> int:
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        # a PRNG key's dtype (key<fry>) is not a NumPy dtype; its own itemsize is its bytes
        itemsize = jnp.dtype(dtype).itemsize if dtype else leaf.dtype.itemsize
        total += math.prod(shape) * itemsize
    return total


def _unsharded(abstract_tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_tree)


def batch_shards(mesh) -> int:
    shape = dict(mesh.shape)
    return shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)


def context_shards(mesh) -> int:
    """How many ways each sequence's tokens are split: the context axis (build_trainer refuses
    rules that would not split `length` over it)."""
    return int(dict(mesh.shape).get("context", 1))


def _weight_sum_cost(c: Config, batch_local: int, context: int = 1) -> dict:
    """Extra temporaries of float32_weight_sum: the [N, D] combine accumulator in float32 instead
    of `dtype` (the K expert outputs are added one slot at a time, never upcast all at once)."""
    itemsize = jnp.dtype(c.dtype).itemsize
    rows = batch_local * c.max_target_length // context
    extra = rows * c.base_emb_dim * max(4 - itemsize, 0) if c.num_moe_layers else 0
    return {
        "enabled": c.float32_weight_sum,
        "extra_bytes_per_moe_layer": extra if c.float32_weight_sum else 0,
        "extra_bytes_if_enabled": extra,
    }


XLA_FIGURES = (
    "argument",
    "output",
    "alias",
    "temp",
    "generated_code",
    "host_argument",
    "host_output",
    "host_alias",
    "host_temp",
)


def xla_figures(compiled) -> dict[str, int]:
    """The compiled program's `memory_analysis()` as {figure: bytes} (XLA_FIGURES)."""
    ma = compiled.memory_analysis()
    return {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in XLA_FIGURES}


def device_peak(
    c: Config, state, xla: dict[str, int], residuals=(), on: str = "cpu"
) -> tuple[int, int, int]:
    """(peak device bytes, offloaded state bytes taken out, offloaded residual bytes taken out).

    The peak is arguments + outputs - aliased + temporaries, the compiled program's own figure
    for a TPU or GPU (`on`): what it places in pinned host memory it reports apart, and what it
    does not place there is device memory whatever the config asked (`not_honoured`). XLA:CPU
    has one memory and counts pinned-host arguments and offloaded residuals with the device
    ones: for a CPU plan, a proxy, the donated state the config offloads (counted once, as
    arguments + outputs - aliased) and the offloaded remat residuals (in its temporaries) are
    taken out once.
    """
    peak = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    if on != "cpu" or xla["host_argument"] or xla["host_temp"]:
        return peak, 0, 0
    offloaded = (_shard_bytes(state.params) if c.parameter_memory_host_offload else 0) + (
        _shard_bytes(state.opt_state) if c.optimizer_memory_host_offload else 0
    )
    offloaded_residuals = residual_total(residuals, "host")
    return peak - offloaded - offloaded_residuals, offloaded, offloaded_residuals


def host_bytes(xla: dict[str, int], offloaded: int, offloaded_residuals: int) -> int:
    """Pinned-host bytes per device: the compiler's own host figures where it reports them
    apart (TPU, GPU), else what the config places on host (a CPU plan)."""
    own = xla["host_argument"] + xla["host_output"] - xla["host_alias"] + xla["host_temp"]
    return own if own else offloaded + offloaded_residuals


def not_honoured(c: Config, xla: dict[str, int], on: str) -> list[str]:
    """The host placements a TPU or GPU program does not hold in pinned host memory (its host
    figures are zero where the config asks for some): the GPU compiler without a GPU keeps
    parameters and optimizer state in device memory (its devices list no memories, so the
    state's pinned-host shardings compile as device ones). Its peak counts them on device."""
    if on == "cpu":
        return []
    out = []
    state = [
        k
        for k in ("parameter_memory_host_offload", "optimizer_memory_host_offload")
        if getattr(c, k)
    ]
    if state and not xla["host_argument"]:
        out.append(
            f"{', '.join(f'{k}=true' for k in state)}: not honoured by this {on.upper()} "
            "program (no host arguments): the state is in device memory and counted there"
        )
    names = [n for n, p in remat.config_placements(c).items() if p == remat.OFFLOAD]
    if names and not xla["host_temp"]:
        out.append(
            f"{', '.join(f'{n}=offload' for n in names)}: not honoured by this {on.upper()} "
            "program (no host temporaries): counted in device memory"
        )
    return out


def memory_report(
    c: Config,
    devices=None,
    hbm_gib: float | None = None,
    *,
    top: int = 15,
    target=None,
    save_program: str | None = None,
) -> dict:
    """Compile the train step abstractly for `c` on `devices` and report bytes per device, with
    the `top` largest buffers alive at XLA's peak (0: no attribution, a faster compile).
    `target` (targets.Target): the hardware `devices` stand for, named in the report; on a TPU
    or GPU target the step time predicted from the program (`step_time`; its simulator as
    `_steptime`, for a plot). `save_program`: write the program for `expertax steptime`."""
    trainer = build_trainer(c, devices)
    remat.check_offload_supported(remat.config_placements(c), list(trainer.mesh.devices.flat))
    state = trainer.abstract_state()
    local_batch = trainer.global_batch // batch_shards(trainer.mesh)
    mb_rows = memory_pipeline.microbatch_rows(c, trainer.global_batch, batch_shards(trainer.mesh))
    residuals, stash = layer_residuals(c, trainer)
    place = remat.config_placements(c)
    host_names = {n for n, p in place.items() if p == remat.OFFLOAD}
    host_names |= {"state.params"} if c.parameter_memory_host_offload else set()
    host_names |= {"state.opt_state"} if c.optimizer_memory_host_offload else set()
    stacks = [(r.name, r.dtype, r.shape, r.layers) for r in residuals]
    compiled, attribution = compile_and_attribute(trainer, top, host_names, stacks)
    xla = xla_figures(compiled)
    on = platform.of_mesh(trainer.mesh)
    peak, offloaded, offloaded_residuals = device_peak(c, state, xla, residuals, on)
    report = {
        **_identity(c, trainer, target),
        "global_batch": trainer.global_batch,
        "batch_per_device": local_batch,
        "max_target_length": c.max_target_length,
        "remat_policy": c.remat_policy,
        "placements": remat.config_placements(c),
        "parameter_bytes": _shard_bytes(state.params),
        "ideal_parameter_bytes": -(-_shard_bytes(_unsharded(state.params)) // trainer.num_devices),
        "optimizer_state_bytes": _shard_bytes(state.opt_state),
        "gradient_bytes": _shard_bytes(state.params, c.grad_dtype),
        "pipeline": memory_pipeline.pipeline_report(
            c, state, mb_rows, iteration_residual_bytes(c, mb_rows)
        ),
        "parameter_memory_host_offload": c.parameter_memory_host_offload,
        "optimizer_memory_host_offload": c.optimizer_memory_host_offload,
        "names_kept": remat.names_kept(c),
        "names_not_saved": names_not_saved(c, residuals),
        "residuals": [r.as_json() for r in residuals],
        "residual_bytes_device": residual_total(residuals, "device"),
        "residual_bytes_host": residual_total(residuals, "host"),
        "stash": stash,
        "context_shards": context_shards(trainer.mesh),
        "float32_weight_sum": _weight_sum_cost(c, local_batch, context_shards(trainer.mesh)),
        "xla": xla,
        "offloaded_state_bytes": offloaded,
        "offloaded_residual_bytes": offloaded_residuals,
        "peak_device_bytes": peak,
        "host_bytes": host_bytes(xla, offloaded, offloaded_residuals),
        **host_budget(target, host_bytes(xla, offloaded, offloaded_residuals)),
        "not_honoured": not_honoured(c, xla, on),
        "hbm_gib": hbm_gib,
        "hbm_bytes": None if hbm_gib is None else int(hbm_gib * GIB),
        "fits": None if hbm_gib is None else bool(peak <= hbm_gib * GIB),
        "attribution": {k: v for k, v in attribution.items() if k != "top_buffers"},
        "top_buffers": attribution["top_buffers"],
        "plan_notes": plan_notes(c, trainer),
    }
    report.update(step_costs(compiled, c, trainer, target))
    if save_program or (target is not None and target.chip is not None):
        text = compiled.as_text()
        if save_program:
            program.save(save_program, text, c, trainer, target)
        predicted = program.predict(text, c, trainer, target)
        report["step_time"] = program.summary(predicted)
        report["_steptime"] = None if predicted is None else predicted["_simulator"]
    return report


def host_budget(target, host_bytes_per_device: int) -> dict:
    """Pinned host bytes per host (bytes per device x the chips a host holds) against the
    host's memory, for a TPU or GPU target (targets.HOSTS); empty for the CPU."""
    host = getattr(getattr(target, "chip", None), "host", None)
    if host is None:
        return {}
    per_host = host_bytes_per_device * host.chips
    return {
        "host_bytes_per_host": per_host,
        "host_ram_bytes": int(host.ram_gib * GIB),
        "host_fits": per_host <= host.ram_gib * GIB,
        "host_link": f"{host.link}, {host.link_bytes_per_s / 1e9:g} GB/s per chip",
    }


def layer_residuals(c: Config, trainer) -> tuple[list, dict | None]:
    """What each layer stack saves for the backward pass (`residuals.py`; the MoE stack's under
    the paged stash from `stash.py`), and the stash report (None without the stash). The layers
    are traced for the mesh's platform (its grouped-matmul backend), without its mesh."""
    on = platform.use(platform.of_mesh(trainer.mesh), trainer.mesh.devices.flat[0])
    with on:
        return _layer_residuals(c, trainer)


def _layer_residuals(c: Config, trainer) -> tuple[list, dict | None]:
    local_batch = trainer.global_batch // batch_shards(trainer.mesh)
    mb_rows = memory_pipeline.microbatch_rows(c, trainer.global_batch, batch_shards(trainer.mesh))
    device = trainer.mesh.devices.flat[0]  # `auto` picks as in the step's trace
    with platform.use(platform.of_mesh(trainer.mesh), device):
        return _stack_residuals(c, trainer, local_batch, mb_rows)


def _stack_residuals(c: Config, trainer, local_batch: int, mb_rows: int):
    residuals = []
    kw = {"batch_local": local_batch, "microbatch_rows": mb_rows}
    kw["context"] = context_shards(trainer.mesh)
    if c.num_dense_layers:
        residuals += stack_residuals(c, moe=False, **kw)
    stash = None
    if c.num_moe_layers and c.moe_paged_stash:
        stash, moe_residuals = stash_report(c, trainer, local_batch)
        residuals += moe_residuals
    elif c.num_moe_layers:
        residuals += stack_residuals(c, moe=True, **kw)
    return residuals, stash


def plan_notes(c: Config, trainer) -> list[str]:
    """What the compiled plan can and cannot tell, per platform of the mesh: XLA:CPU's buffer
    assignment is a proxy for an accelerator's; a GPU compile without the GPU has no autotuning;
    no compile-only figure is a time."""
    on = platform.of_mesh(trainer.mesh)
    if on == "gpu":
        return [
            "compiled by the CUDA compiler without a GPU: no autotuning, so its kernels and "
            "fusions are XLA's defaults, not the ones a run on the GPU would pick; no time is "
            "measured"
        ]
    if on == "tpu":
        return [
            "compiled by the TPU compiler (libtpu) for the slice's topology; no time is measured"
        ]
    if on != "cpu":
        return []
    notes = ["compiled by XLA:CPU: its buffer assignment is a proxy for a GPU's"]
    ep = int(trainer.mesh.shape.get("expert", 1))
    if c.is_moe and c.sparse_matmul and ep > 1 and not c.use_ring_of_experts:
        notes.append(
            "the MoE all-to-all is compiled as its padded stand-in (XLA:CPU has no "
            "ragged_all_to_all, not even to compile): per-peer blocks of twice the mean rows "
            "a peer gets, sent in rounds, that a GPU's ragged exchange does not hold"
        )
    if c.is_moe and jnp.dtype(c.dtype) != jnp.float32:
        notes.append(
            f"XLA:CPU runs {c.dtype} collectives in float32: exchanged and gathered MoE rows "
            "count twice their size here"
        )
    return notes


def refused_for_memory(error: Exception) -> str | None:
    """The compiler's own refusal of a program larger than the chip's memory (TPU: "Ran out of
    memory on HBM ... required for HLO temporaries (100.50G) exceeds available HBM (95.74G)"),
    or None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    return " ".join(text.split())[:400]


def refused_peak(why: str, state) -> int | None:
    """A refused program's least device peak: the state per device plus the temporaries the
    compiler's message asked for (its first "(N.NNG)" figure, GiB); None without one."""
    figures = [float(x) for x in re.findall(r"\(([\d.]+)G\)", why)]
    return int(figures[0] * GIB) + _shard_bytes(state) if figures else None


def _identity(c: Config, trainer, target) -> dict:
    """The report's first keys: the model, the target and its mesh."""
    on = platform.of_mesh(trainer.mesh)
    return {
        "model_name": c.model_name,
        "target": target.spec if target is not None else on,
        "target_description": target.describe() if target is not None else on,
        "devices": trainer.num_devices,
        "backend": on,
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
    }


def compile_report(c: Config, devices=None, hbm_gib: float | None = None, **options) -> dict:
    """`memory_report`, or where the compiler refuses the program for memory a "does not fit"
    report: the compiler's words, the bytes it says the temporaries need, and the state per
    device (parameters, optimizer state) beside them."""
    try:
        return memory_report(c, devices, hbm_gib, **options)
    except Exception as e:
        why = refused_for_memory(e)
        if why is None:
            raise
    trainer = build_trainer(c, devices)
    state = trainer.abstract_state()
    peak = refused_peak(why, state)
    return {
        "refused": why,
        **_identity(c, trainer, options.get("target")),
        "parameter_bytes": _shard_bytes(state.params),
        "optimizer_state_bytes": _shard_bytes(state.opt_state),
        "required_temp_bytes": None if peak is None else peak - _shard_bytes(state),
        "peak_device_bytes": peak,
        "host_bytes": None,
        "hbm_gib": hbm_gib,
        "hbm_bytes": None if hbm_gib is None else int(hbm_gib * GIB),
        "fits": False,
        "model_flops": None,
        "compiled_flops": None,
    }
