"""`expertax memory`: what the train step keeps, per device, before anything is allocated.

The train step is lowered with abstract state (ShapeDtypeStructs carrying their shardings) and
compiled for the configured mesh; nothing is placed on a device. The report has four parts:
- the persistent state per device (parameters, optimizer state, gradients) from the shardings;
- the residuals each layer saves for the backward pass, by checkpoint name, found by linearizing
  one layer under the layer policy with the per-device batch and reading the jaxpr that builds
  the linear function's residuals (`residual_sources`), multiplied by the number of layers in its
  stack (the scan stacks them);
- XLA's own figures for the compiled step (`compiled.memory_analysis()`): arguments, outputs,
  aliased bytes, temporaries, and their host-memory counterparts;
- with `moe_paged_stash`, the stash (`stash_report`): the MoE stack keeps per layer only its
  input, plus the shared buffers of the stashed names; the report gives the buffers' bytes, the
  bytes of the real rows they are sized for, and what the same names cost without the stash;
- with pipeline stages, the schedule (stages, microbatches, repeats, layers per stage, bubble
  fraction) and what one stage holds per device (`memory_pipeline.py`); the pipelined layers'
  residuals are what the pipeline's scan saves (`stack_residuals`);
- the peak estimate (arguments + outputs - aliased + temporaries) against an HBM budget;
- attribution: the largest buffers alive at the peak of XLA's buffer assignment (read from its
  text dumps, `xla_dump.py`), each with its HLO instruction, the file:line of our code that
  built it (the innermost stack frame under src/expertax) and its checkpoint name, if any.

Residual shapes split the batch over the data, fsdp and expert axes only; splits of heads, hidden
dims or experts (tensor parallelism, the [E, B, C, .] tensors of the dense MoE dispatch under
expert parallelism) are not applied, so those entries are upper bounds. XLA:CPU has one memory
for device and pinned host: its figures count offloaded tensors as device bytes, so the peak
estimate subtracts what the config itself places on host (offloaded parameters, optimizer state
and remat names) and says so.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import os
import tempfile
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from expertax.config.schema import Config
from expertax.models import decoder, pipeline, stashed_stack
from expertax.nn import param
from expertax.nn.moe import stash as stash_mod
from expertax.parallel import remat
from expertax.tools import memory_pipeline, xla_dump
from expertax.train.trainer import build_trainer

GIB = 1024**3
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor a layer saves for its backward pass (per device, per layer)."""

    name: str  # a checkpoint name, or "unnamed: <op> at <file:line>" (remat_policy=none)
    shape: tuple[int, ...]
    dtype: str
    placement: str  # "device" or "host"
    stack: str  # "dense" or "moe"
    layers: int  # layers in the stack; the total is bytes * layers

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "placement": self.placement,
            "stack": self.stack,
            "layers": self.layers,
            "total_bytes": self.bytes * self.layers,
        }


@dataclasses.dataclass(frozen=True)
class ResidualSource:
    """Where one residual of a linearized function comes from.

    kind: "argument" (flat input `index`), "constant", "named" (the output of a `name` equation,
    i.e. of `checkpoint_name`: `name` is its name) or "unnamed" (the output of any other
    equation: `name` is the primitive, or the jitted function's name, and `where` the innermost
    expertax file:line that built it).
    """

    kind: str
    aval: jax.ShapeDtypeStruct
    name: str = ""
    index: int = -1
    where: str = ""
    host: bool = False  # kept in host memory (a remat policy's offload)


def _where(eqn) -> str:
    """file:line of the innermost expertax frame that built `eqn` ("unknown" when none)."""
    tb = eqn.source_info.traceback
    for frame in tb.frames if tb is not None else ():
        if os.path.abspath(frame.file_name).startswith(_PACKAGE_DIR + os.sep):
            return f"{os.path.basename(frame.file_name)}:{frame.line_num}"
    return "unknown"


def residual_sources(fn, *args) -> list[ResidualSource]:
    """The residuals that `jax.linearize(fn, *args)` keeps, with where each comes from.

    The linear function is a pytree whose leaves are its residuals, so they are the outputs of
    the jaxpr of `lambda *a: jax.linearize(fn, *a)[1]`; each output is a flat input, a constant,
    or the output of a top-level equation (the saved values of a remat policy are computed at
    the top level, the rest of a rematerialized function stays inside its `checkpoint`).
    Literal outputs (scalars folded into the program) take no memory and are left out.
    """
    closed = jax.make_jaxpr(lambda *a: jax.linearize(fn, *a)[1])(*args)
    jaxpr = closed.jaxpr
    # A saved value leaves its remat as reduce_precision(x) (the fence JAX puts around saved
    # values); look through it to the equation that produced x, as JAX's saved_residuals does.
    fence = {
        e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"
    }
    wanted = {fence.get(v, v) for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
    out = []
    for v in jaxpr.constvars:
        if v in wanted:
            out.append(_source("constant", v))
    for i, v in enumerate(jaxpr.invars):
        if v in wanted:
            out.append(_source("argument", v, index=i))
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v not in wanted:
                continue
            if eqn.primitive.name == "name":
                out.append(_source("named", v, name=eqn.params["name"]))
            elif eqn.primitive.name in ("jit", "pjit"):
                name = f"jitted function '{eqn.params['name']}'"
                out.append(_source("unnamed", v, name=name, where=_where(eqn)))
            else:
                name = eqn.primitive.name
                out.append(_source("unnamed", v, name=name, where=_where(eqn)))
    return out


def _source(kind: str, var, **fields) -> ResidualSource:
    aval = var.aval
    host = getattr(aval, "memory_space", None) == jax.memory.Space.Host
    struct = jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)
    return ResidualSource(kind, struct, host=host, **fields)


def layer_residuals(
    c: Config, *, moe: bool, batch_local: int, layers: int | None = None
) -> list[Residual]:
    """The residuals one layer of a stack saves, per device, by name.

    Offloaded names are traced as if kept on device (a device_put to host loses the name) and
    reported with placement "host". The layer input, when its own name is rematerialized, is the
    argument `x` of the layer and is reported as decoder_layer_input. `layers`: the count each
    entry is multiplied by (default: the layers of the stack).
    """
    place = remat.config_placements(c)
    host = {n for n, p in place.items() if p == remat.OFFLOAD}
    traced = c.model_copy(update={n: remat.DEVICE for n in host})
    dtype = jnp.dtype(c.dtype)
    block = param.abstract(decoder.block_spec(c, moe=moe), jnp.dtype(c.weight_dtype))
    t = c.max_target_length
    x = jax.ShapeDtypeStruct((batch_local, t, c.base_emb_dim), dtype)
    ids = jax.ShapeDtypeStruct((batch_local, t), jnp.int32)

    def loss(p, x, positions, segment_ids):
        body = lambda x, p: decoder.block_apply(p, x, traced, positions, segment_ids, dtype)
        y, stats = remat.wrap_layer(body, traced, prevent_cse=False)(x, p)
        lb = stats.lb_loss if stats is not None else 0.0
        return jnp.sum(y.astype(jnp.float32)) + lb

    stack = "moe" if moe else "dense"
    if layers is None:
        layers = c.num_moe_layers if moe else c.num_dense_layers
    x_index = len(jax.tree.leaves(block))  # the flat position of `x` among the inputs
    out = []
    for src in residual_sources(loss, block, x, ids, ids):
        if src.kind == "argument" and src.index == x_index:
            name = remat.DECODER_LAYER_INPUT
        elif src.kind == "argument":
            continue  # a parameter or the positions: persistent state, not a saved activation
        elif src.kind == "named":
            name = src.name
        elif src.kind == "unnamed":
            name = f"unnamed: {src.name} at {src.where}"
        else:
            name = "unnamed: a constant"
        placement = "host" if name in host else "device"
        shape, dtype_name = tuple(src.aval.shape), str(src.aval.dtype)
        out.append(Residual(name, shape, dtype_name, placement, stack, layers))
    return out


def stack_residuals(
    c: Config, *, moe: bool, batch_local: int, microbatch_rows: int
) -> list[Residual]:
    """The residuals of the MoE (`moe`) or dense stack per device.

    Its layers outside a pipeline save `layer_residuals` at the per-device batch. Its pipelined
    layers (models/pipeline.py): with a remat policy, the pipeline's own VJP keeps only the
    stage input of each of the M R real work items (`pipeline_iteration_input`, [microbatch
    rows, T, D] per device: the stage axis is sharded over `pipeline`); with remat_policy=none,
    the residuals of a stage's layers of one visit at the microbatch size, for each of the
    M R + S - 1 iterations (bubbles included).
    """
    outside = memory_pipeline.layers_outside(c, moe=moe)
    out = layer_residuals(c, moe=moe, batch_local=batch_local, layers=outside) if outside else []
    inside = memory_pipeline.pipelined_layers(c, moe=moe)
    if not inside:
        return out
    if c.remat_policy == "none":
        per_visit = inside // (c.pipeline_stages * c.num_pipeline_repeats)
        copies = memory_pipeline.iterations(c) * per_visit
        return out + layer_residuals(c, moe=moe, batch_local=microbatch_rows, layers=copies)
    shape = (microbatch_rows, c.max_target_length, c.base_emb_dim)
    stack = "moe" if moe else "dense"
    dtype_name = str(jnp.dtype(c.dtype))
    items = memory_pipeline.work_items(c)
    return [*out, Residual(pipeline.ITERATION_INPUT, shape, dtype_name, "device", stack, items)]


def iteration_residual_bytes(c: Config, microbatch_rows: int) -> int | None:
    """Device bytes one pipeline iteration's backward holds for a stage (models/pipeline.py):
    the inputs of its layers of one visit, recomputed, and one layer's residuals without remat
    (alive during that layer's backward), at the microbatch size. None without stages or with
    remat_policy=none (then everything is saved)."""
    if c.pipeline_stages == 1 or c.remat_policy == "none":
        return None
    moe = c.pipelined_stack == "moe"
    per_visit = c.pipelined_layers // (c.pipeline_stages * c.num_pipeline_repeats)
    layer_input = microbatch_rows * c.max_target_length * c.base_emb_dim
    inputs = per_visit * layer_input * jnp.dtype(c.dtype).itemsize
    plain = c.model_copy(update={"remat_policy": "none"})
    one = layer_residuals(plain, moe=moe, batch_local=microbatch_rows, layers=1)
    return inputs + _residual_total(one, "device")


def _named_shapes(jaxpr, names: set[str], mult: int = 1) -> dict[str, int]:
    """name -> elements of every `checkpoint_name` of `names` in `jaxpr` and its sub-jaxprs (per
    device inside a `shard_map`), times the length of each enclosing scan; a `cond` counts its
    largest branch."""
    out: dict[str, int] = {}

    def add(found):
        for k, v in found.items():
            out[k] = out.get(k, 0) + v

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and eqn.params["name"] in names:
            add({eqn.params["name"]: math.prod(eqn.outvars[0].aval.shape) * mult})
        inner = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
        subs = []
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    subs.append(_named_shapes(sub, names, inner))
        if eqn.primitive.name == "cond" and subs:
            subs = [max(subs, key=lambda d: sum(d.values()))]
        for found in subs:
            add(found)
    return out


def worst_case_stash_rows(c: Config, trainer) -> dict[str, int]:
    """Stashed name -> elements one MoE layer saves per device without the stash: its grouped
    matmul outputs at their worst-case row count (the all-to-all receive buffer, the ring's
    gathered rows; per token chunk, times the chunks), traced on the trainer's mesh. With the
    fused routed FFN (`moe_fused_routed_ffn`, nn/moe/routed.py) there is no expert output to
    save: moe_mlpwo counts zero."""
    dtype = jnp.dtype(c.dtype)
    plain = c.model_copy(update={"moe_paged_stash": False})
    block = param.abstract(decoder.block_spec(plain, moe=True), jnp.dtype(c.weight_dtype))
    x = jax.ShapeDtypeStruct((trainer.global_batch, c.max_target_length, c.base_emb_dim), dtype)
    ids = jax.ShapeDtypeStruct(x.shape[:2], jnp.int32)
    fn = lambda p, x, ids: decoder.block_apply(p, x, plain, ids, ids, dtype)
    with trainer.context():
        closed = jax.make_jaxpr(fn)(block, x, ids)
    return _named_shapes(closed.jaxpr, set(remat.stashed_names(c)))


def stash_report(c: Config, trainer, batch_local: int) -> tuple[dict, list[Residual]]:
    """The paged stash per device (`moe_paged_stash`): ({buffer_bytes, routed_bytes,
    worst_case_bytes, ...}, the MoE stack's residuals).

    With the stash the MoE stack (models/stashed_stack.py) keeps per layer only its input;
    everything else the policy saves is recomputed in its backward pass, and the stashed names
    live in one buffer per name shared by all MoE layers, `capacity_rows + page` rows of the
    name's width (one `Residual` each, layers=1). buffer_bytes: those buffers. routed_bytes: the
    expected real rows (MoE layers x `stash.expected_rows` x the widths). worst_case_bytes: what
    the stashed names cost per layer without the stash (`worst_case_stash_rows`) x MoE layers.
    The per-layer offsets and flags (a few int32 per layer) are left out.
    """
    with trainer.context():
        sizes = stashed_stack.axis_sizes(c)
    layers, tokens = c.num_moe_layers, trainer.global_batch * c.max_target_length
    itemsize = jnp.dtype(c.dtype).itemsize
    widths = stash_mod.widths(c, sizes)
    capacity = stash_mod.capacity_rows(c, layers, tokens, sizes)
    expected = stash_mod.expected_rows(c, tokens, sizes)
    page = c.moe_paged_stash_page_rows
    worst = worst_case_stash_rows(c, trainer)
    width_sum = sum(widths.values())
    report = {
        "names": list(widths),
        "widths": widths,
        "capacity_factor": c.moe_paged_stash_capacity_factor,
        "capacity_rows": capacity,
        "page_rows": page,
        "expected_rows_per_layer": expected,
        "buffer_bytes": (capacity + page) * width_sum * itemsize,
        "routed_bytes": layers * expected * width_sum * itemsize,
        "worst_case_bytes": layers * sum(worst.values()) * itemsize,
    }
    dtype_name = str(jnp.dtype(c.dtype))
    x_shape = (batch_local, c.max_target_length, c.base_emb_dim)
    residuals = [Residual(remat.DECODER_LAYER_INPUT, x_shape, dtype_name, "device", "moe", layers)]
    residuals += [
        Residual(f"{STASH_PREFIX}{n}", (capacity + page, w), dtype_name, "device", "moe", 1)
        for n, w in widths.items()
    ]
    return report, residuals


STASH_PREFIX = "paged_stash:"  # the residual name of a stashed name's shared buffer


def _shard_bytes(abstract_tree, dtype=None) -> int:
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        itemsize = jnp.dtype(dtype or leaf.dtype).itemsize
        total += math.prod(shape) * itemsize
    return total


def _unsharded(abstract_tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_tree)


def _residual_total(residuals: list[Residual], placement: str) -> int:
    return sum(r.bytes * r.layers for r in residuals if r.placement == placement)


def batch_shards(mesh) -> int:
    shape = dict(mesh.shape)
    return shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)


def _weight_sum_cost(c: Config, batch_local: int) -> dict:
    """Extra temporaries of float32_weight_sum: the [N, D] combine accumulator in float32 instead
    of `dtype` (the K expert outputs are added one slot at a time, never upcast all at once)."""
    itemsize = jnp.dtype(c.dtype).itemsize
    rows = batch_local * c.max_target_length
    extra = rows * c.base_emb_dim * max(4 - itemsize, 0) if c.num_moe_layers else 0
    return {
        "enabled": c.float32_weight_sum,
        "extra_bytes_per_moe_layer": extra if c.float32_weight_sum else 0,
        "extra_bytes_if_enabled": extra,
    }


@functools.lru_cache(maxsize=64)
def checkpoint_names(path: str) -> dict[int, str]:
    """line -> checkpoint name, for the lines of each `remat.tag(expr, remat.NAME)` in `path`.

    The tagged expression's lines map to the name (a nested tag's own lines to its own name), so
    an HLO instruction whose innermost frame is on one of them computes that named tensor.
    """
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return {}
    spans = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and len(node.args) == 2):
            continue
        fn, tag = node.func, node.args[1]
        is_tag = (
            isinstance(fn, ast.Attribute)
            and fn.attr == "tag"
            or (isinstance(fn, ast.Name) and fn.id == "tag")
        )
        if is_tag and isinstance(tag, ast.Attribute) and isinstance(tag.value, ast.Name):
            name = getattr(remat, tag.attr, None)
            if isinstance(name, str):
                expr = node.args[0]
                assert expr.end_lineno is not None and expr.end_col_offset is not None
                width = (expr.end_lineno - expr.lineno, expr.end_col_offset - expr.col_offset)
                spans.append((width, expr.lineno, expr.end_lineno, name))
    out = {}
    for _, first, last, name in sorted(spans, reverse=True):  # widest first, nested overwrite
        out.update(dict.fromkeys(range(first, last + 1), name))
    return out


def _our_frame(module: xla_dump.Module, frame: int) -> tuple[str, str]:
    """(file:line relative to src/expertax, absolute file) of the innermost expertax frame."""
    for f in xla_dump.call_stack(module, frame):
        path = os.path.abspath(f.file)
        if path.startswith(_PACKAGE_DIR + os.sep):
            return f"{os.path.relpath(path, _PACKAGE_DIR)}:{f.line}", path
        if f"{os.sep}src{os.sep}expertax{os.sep}" in path:  # traced from another checkout
            rel = path.split(f"{os.sep}src{os.sep}expertax{os.sep}", 1)[1]
            return f"{rel}:{f.line}", path
    return "", ""


_COLLECTIVES = {
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
}


def _describe(module, shapes, buf: xla_dump.LiveBuffer, host_names: set[str]) -> dict:
    """One live buffer as a top_buffers entry."""
    instr = module.instructions.get(buf.instruction)
    text = shapes.get((buf.instruction, buf.index)) or (instr.shape if instr else "")
    shape = xla_dump.parse_shape(text) if text else xla_dump.Shape("?", (), False)
    index = "{" + ",".join(map(str, buf.index)) + "}" if buf.index else ""
    entry: dict[str, Any] = {
        "bytes": buf.bytes,
        "shape": list(shape.dims),
        "dtype": shape.dtype,
        "op": f"{buf.instruction}{index}" + (f" ({instr.opcode})" if instr else ""),
        "source": "",
        "name": "",
        "op_name": "",
        "placement": "host" if shape.host else "device",
        "note": "",
    }
    if instr is None:
        entry["note"] = "not in the optimized HLO"
        return entry
    src = xla_dump.origin(module, buf.instruction, buf.index)
    entry["op_name"] = src.op_name
    entry["source"], path = _our_frame(module, src.frame)
    collective = instr.opcode.split("-start")[0].split("-done")[0] in _COLLECTIVES
    if path and not collective:  # SPMD's collectives carry their consumer's metadata
        entry["name"] = checkpoint_names(path).get(int(entry["source"].rsplit(":", 1)[1]), "")
    if src.opcode == "parameter" and src.computation not in module.callers and not src.frame:
        entry["name"] = entry["name"] or f"argument {src.op_name}".replace("\\'", "'")
    loop = module.callers.get(instr.computation) if instr.opcode == "parameter" else None
    if instr.opcode == "while":
        loop = instr.name
    if loop and buf.index:
        entry["note"] = f"while-loop tuple element {index} of {loop}"
    elif collective:
        entry["note"] = f"{instr.opcode} for {'/'.join(src.op_name.split('/')[-2:])}"
    elif src is not instr:
        entry["note"] = f"{instr.opcode} of {src.name}"
    if entry["name"] in host_names or any(
        entry["name"].startswith(f"argument {p}") for p in host_names
    ):
        entry["placement"] = "host"
    return entry


def attribute_peak(dump_dir: str, top: int, host_names=()) -> dict:
    """The `top` largest buffers alive at the peak of the module dumped in `dump_dir`.

    `host_names`: checkpoint names and argument paths (e.g. "state.opt_state") the config places
    on host, for the placement column (XLA:CPU prints no host memory space). Never raises for an
    unreadable dump: {"unavailable": why} instead.
    """
    try:
        files = xla_dump.module_files(dump_dir)
        with open(files["live_range"]) as f:
            peak = xla_dump.parse_live_range(f.read())
        with open(files["buffers"]) as f:
            shapes = xla_dump.parse_value_shapes(f.read())
        with open(files["hlo"]) as f:
            module = xla_dump.parse_hlo(f.read())
        ranked = sorted(peak.buffers, key=lambda b: -b.bytes)[:top]
        buffers = [_describe(module, shapes, b, set(host_names)) for b in ranked]
    except (OSError, ValueError, KeyError, IndexError) as e:
        return {"unavailable": f"{type(e).__name__}: {e}", "top_buffers": []}
    return {
        "unavailable": None,
        "peak_step": peak.step,
        "peak_instruction": peak.instruction,
        "peak_buffers": len(peak.buffers),
        "peak_live_bytes": sum(b.bytes for b in peak.buffers),
        "top_buffers": buffers,
    }


def compile_and_attribute(trainer, top: int, host_names=()):
    """Compile the train step abstractly; with `top` > 0, also attribute its peak (XLA's dumps
    go to a temporary folder, removed afterwards)."""
    with trainer.context():
        lowered = trainer.jitted_step().lower(trainer.abstract_state(), trainer.abstract_batch())
    if top <= 0:
        with trainer.context():
            return lowered.compile(), {"unavailable": "not asked for (--top 0)", "top_buffers": []}
    with tempfile.TemporaryDirectory(prefix="expertax-xla-dump-") as tmp:
        options = {"xla_dump_to": tmp, "xla_dump_hlo_as_text": True}
        with trainer.context():
            compiled = lowered.compile(compiler_options=options)
        return compiled, attribute_peak(tmp, top, host_names)


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


def device_peak(c: Config, state, xla: dict[str, int], residuals=()) -> tuple[int, int, int]:
    """(peak device bytes, offloaded state bytes taken out, offloaded residual bytes taken out).

    The peak is arguments + outputs - aliased + temporaries. XLA:CPU has one memory: it counts
    pinned-host arguments with the device ones, so with host offload the donated state (counted
    once, as arguments + outputs - aliased) and the offloaded remat residuals (in its
    temporaries) are taken out once; a backend with a host memory space reports them apart.
    """
    peak = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    if xla["host_argument"] or xla["host_temp"]:
        return peak, 0, 0
    offloaded = (_shard_bytes(state.params) if c.parameter_memory_host_offload else 0) + (
        _shard_bytes(state.opt_state) if c.optimizer_memory_host_offload else 0
    )
    offloaded_residuals = _residual_total(residuals, "host")
    return peak - offloaded - offloaded_residuals, offloaded, offloaded_residuals


def memory_report(c: Config, devices=None, hbm_gib: float | None = None, *, top: int = 15) -> dict:
    """Compile the train step abstractly for `c` on `devices` and report bytes per device, with
    the `top` largest buffers alive at XLA's peak (0: no attribution, a faster compile)."""
    trainer = build_trainer(c, devices)
    remat.check_offload_supported(remat.config_placements(c), list(trainer.mesh.devices.flat))
    state = trainer.abstract_state()
    local_batch = trainer.global_batch // batch_shards(trainer.mesh)
    mb_rows = memory_pipeline.microbatch_rows(c, trainer.global_batch, batch_shards(trainer.mesh))
    residuals = []
    if c.num_dense_layers:
        residuals += stack_residuals(c, moe=False, batch_local=local_batch, microbatch_rows=mb_rows)
    stash = None
    if c.num_moe_layers and c.moe_paged_stash:
        stash, moe_residuals = stash_report(c, trainer, local_batch)
        residuals += moe_residuals
    elif c.num_moe_layers:
        residuals += stack_residuals(c, moe=True, batch_local=local_batch, microbatch_rows=mb_rows)
    place = remat.config_placements(c)
    host_names = {n for n, p in place.items() if p == remat.OFFLOAD}
    host_names |= {"state.params"} if c.parameter_memory_host_offload else set()
    host_names |= {"state.opt_state"} if c.optimizer_memory_host_offload else set()
    compiled, attribution = compile_and_attribute(trainer, top, host_names)
    xla = xla_figures(compiled)
    peak, offloaded, offloaded_residuals = device_peak(c, state, xla, residuals)
    report = {
        "model_name": c.model_name,
        "devices": trainer.num_devices,
        "backend": jax.default_backend(),
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
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
        "residuals": [r.as_json() for r in residuals],
        "residual_bytes_device": _residual_total(residuals, "device"),
        "residual_bytes_host": _residual_total(residuals, "host"),
        "stash": stash,
        "float32_weight_sum": _weight_sum_cost(c, local_batch),
        "xla": xla,
        "offloaded_state_bytes": offloaded,
        "offloaded_residual_bytes": offloaded_residuals,
        "peak_device_bytes": peak,
        "hbm_gib": hbm_gib,
        "fits": None if hbm_gib is None else bool(peak <= hbm_gib * GIB),
        "attribution": {k: v for k, v in attribution.items() if k != "top_buffers"},
        "top_buffers": attribution["top_buffers"],
        "plan_notes": plan_notes(c, trainer),
    }
    return report


def plan_notes(c: Config, trainer) -> list[str]:
    """What the compiled plan shows that a GPU's would not (it is XLA:CPU's buffer assignment)."""
    if jax.default_backend() != "cpu":
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


def _fmt(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_report(r: dict) -> str:
    """The human-readable report."""
    lines = [
        f"expertax memory: {r['model_name']} on {r['devices']} {r['backend']} devices, "
        f"mesh {r['mesh']}, batch {r['global_batch']} ({r['batch_per_device']} per device) x "
        f"{r['max_target_length']}, remat_policy={r['remat_policy']}",
        "per device:",
        f"  parameters       {_fmt(r['parameter_bytes']):>12}"
        + ("  (pinned host)" if r["parameter_memory_host_offload"] else "")
        + (
            f"  (ideal: all parameters / {r['devices']} devices = "
            f"{_fmt(r['ideal_parameter_bytes'])})"
            if "ideal_parameter_bytes" in r
            else ""
        ),
        f"  optimizer state  {_fmt(r['optimizer_state_bytes']):>12}"
        + ("  (pinned host)" if r["optimizer_memory_host_offload"] else ""),
        f"  gradients        {_fmt(r['gradient_bytes']):>12}",
    ]
    if r.get("pipeline"):
        lines += memory_pipeline.format_pipeline(r["pipeline"], _fmt)
    lines.append("saved residuals per layer (name, shape, bytes, placement, x layers = total):")
    for res in r["residuals"]:
        shape = "x".join(map(str, res["shape"])) or "scalar"
        lines.append(
            f"  [{res['stack']:5}] {res['name']:<22} {res['dtype']:>8}[{shape}] "
            f"{_fmt(res['bytes']):>11} {res['placement']:<6} x {res['layers']} = "
            f"{_fmt(res['total_bytes'])}"
        )
    lines.append(
        f"  total residuals: {_fmt(r['residual_bytes_device'])} device, "
        f"{_fmt(r['residual_bytes_host'])} host"
    )
    if r.get("stash"):
        lines.append(_format_stash(r["stash"]))
    ws = r["float32_weight_sum"]
    lines.append(
        f"float32_weight_sum={str(ws['enabled']).lower()}: "
        f"{_fmt(ws['extra_bytes_if_enabled'])} of float32 combine temporaries per MoE layer"
        + ("" if ws["enabled"] else " (saved: off)")
    )
    x = r["xla"]
    lines += [
        "XLA (compiled train step, per device):",
        f"  arguments {_fmt(x['argument'])}, outputs {_fmt(x['output'])}, aliased "
        f"{_fmt(x['alias'])}, temporaries {_fmt(x['temp'])}",
        f"  host: arguments {_fmt(x['host_argument'])}, outputs {_fmt(x['host_output'])}, "
        f"temporaries {_fmt(x['host_temp'])}",
        "  peak estimate (arguments + outputs - aliased + temporaries"
        + (
            f" - {_fmt(r['offloaded_state_bytes'])} offloaded state"
            if r["offloaded_state_bytes"]
            else ""
        )
        + (
            f" - {_fmt(r['offloaded_residual_bytes'])} offloaded residuals"
            if r.get("offloaded_residual_bytes")
            else ""
        )
        + f"): {_fmt(r['peak_device_bytes'])}",
    ]
    if r["offloaded_state_bytes"] or r.get("offloaded_residual_bytes"):
        lines.append(
            "  (XLA:CPU has one memory and counts pinned-host bytes as device bytes; the estimate"
            " takes out what this config places on host)"
        )
    lines += _format_top_buffers(r)
    lines += [f"note: {n}" for n in r.get("plan_notes", [])]
    if r["hbm_gib"] is not None:
        verdict = "FITS" if r["fits"] else "DOES NOT FIT"
        lines.append(
            f"{verdict}: {_fmt(r['peak_device_bytes'])} of {r['hbm_gib']:g} GiB per device "
            f"({100 * r['peak_device_bytes'] / (r['hbm_gib'] * GIB):.1f}%)"
        )
    return "\n".join(lines)


def _format_stash(s: dict) -> str:
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"
    return (
        f"paged stash ({', '.join(s['names'])}; {s['capacity_rows']} + {s['page_rows']} rows, "
        f"factor {s['capacity_factor']:g}): buffer {_fmt(s['buffer_bytes'])}, routed rows "
        f"{_fmt(s['routed_bytes'])}, worst case without the stash {_fmt(s['worst_case_bytes'])} "
        f"(buffer / routed {ratio(s['buffer_bytes'], s['routed_bytes'])}, worst case / buffer "
        f"{ratio(s['worst_case_bytes'], s['buffer_bytes'])})"
    )


def _format_top_buffers(r: dict) -> list[str]:
    a = r.get("attribution", {"unavailable": "not computed"})
    if a.get("unavailable"):
        return [f"attribution unavailable: {a['unavailable']}"]
    lines = [
        f"largest buffers alive at XLA's peak (schedule step {a['peak_step']}, "
        f"{a['peak_instruction'] or '?'}; {a['peak_buffers']} buffers, "
        f"{_fmt(a['peak_live_bytes'])} in all):",
        f"  {'bytes':>11}  {'dtype[shape]':<26} {'HLO instruction':<34} "
        f"{'source (src/expertax)':<28} name / note",
    ]
    for b in r["top_buffers"]:
        shape = f"{b['dtype']}[{','.join(map(str, b['shape']))}]"
        extra = "; ".join(
            x for x in (b["name"], b["note"], "host" if b["placement"] == "host" else "") if x
        )
        extra = extra if len(extra) <= 80 else extra[:77] + "..."
        lines.append(
            f"  {_fmt(b['bytes']):>11}  {shape:<26} {b['op']:<34} {b['source'] or '-':<28} {extra}"
        )
    return lines


def to_json_ready(r: dict) -> dict:
    """The report with numpy scalars turned into Python numbers."""
    return jax.tree.map(lambda v: v.item() if isinstance(v, np.generic) else v, r)
