"""The activations each layer saves for its backward pass, by checkpoint name, per device.

Found by linearizing one layer under the layer's remat policy with the per-device batch and
reading the jaxpr that builds the linear function's residuals (`residual_sources`); a stack's
figure is one layer's times the layers the scan stacks (`layer_residuals`, `stack_residuals`).
Residual shapes split the batch over the data, fsdp and expert axes and their bytes each
sequence's tokens over the context axis (`Residual.context`); splits of heads, hidden
dims or experts (tensor parallelism, the [E, B, C, .] tensors of the dense MoE dispatch under
expert parallelism) are not applied, so those entries are upper bounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import jax
import jax.extend
import jax.numpy as jnp

from expertax import platform
from expertax.config.schema import Config
from expertax.models import decoder
from expertax.nn import param
from expertax.nn.attention.kernel import ATTENTION_PLATFORMS
from expertax.parallel import remat
from expertax.planner import pipeline as memory_pipeline
from expertax.sharding.rules import current_rules

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor a layer saves for its backward pass (per device, per layer)."""

    name: str  # a checkpoint name, or "unnamed: <op> at <file:line>" (remat_policy=none)
    shape: tuple[int, ...]
    dtype: str
    placement: str  # "device" or "host"
    stack: str  # "dense" or "moe"
    layers: int  # layers in the stack; the total is bytes * layers
    # The context axis's split of each sequence's tokens: `shape` is traced with whole
    # sequences, a device keeps 1 / context of them (nn/attention/context.py).
    context: int = 1

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize // self.context

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "placement": self.placement,
            "stack": self.stack,
            "layers": self.layers,
            "context": self.context,
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
        if os.path.abspath(frame.file_name).startswith(PACKAGE_DIR + os.sep):
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
            inner = _named_inside(eqn, eqn.outvars.index(v))
            if eqn.primitive.name == "name":
                out.append(_source("named", v, name=eqn.params["name"]))
            elif inner is not None:
                out.append(_source("named", inner[1], name=inner[0]))
            elif eqn.primitive.name in ("jit", "pjit"):
                name = f"jitted function '{eqn.params['name']}'"
                out.append(_source("unnamed", v, name=name, where=_where(eqn)))
            else:
                name = eqn.primitive.name
                out.append(_source("unnamed", v, name=name, where=_where(eqn)))
    return out


def _named_inside(eqn, i: int):
    """(name, per-device var) when output `i` of a `shard_map` equation is a `checkpoint_name`
    made inside its body (a remat policy's saved value leaves the shard_map as an output; the
    MoE layer under expert parallelism), else None."""
    if eqn.primitive.name != "shard_map":
        return None
    body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
    var = body.outvars[i]
    fence = {e.outvars[0]: e.invars[0] for e in body.eqns if e.primitive.name == "reduce_precision"}
    var = fence.get(var, var)
    for e in body.eqns:
        if e.primitive.name == "name" and var in e.outvars:
            return e.params["name"], var
    return None


def _source(kind: str, var, **fields) -> ResidualSource:
    aval = var.aval
    host = getattr(aval, "memory_space", None) == jax.memory.Space.Host
    struct = jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)
    return ResidualSource(kind, struct, host=host, **fields)


def layer_residuals(
    c: Config, *, moe: bool, batch_local: int, layers: int | None = None, context: int = 1
) -> list[Residual]:
    """The residuals one layer of a stack saves, per device, by name.

    Offloaded names are traced as if kept on device (a device_put to host loses the name) and
    reported with placement "host". The layer input, when its own name is rematerialized, is the
    argument `x` of the layer and is reported as decoder_layer_input. `layers`: the count each
    entry is multiplied by (default: the layers of the stack); `context`: the context axis's
    split of each sequence (`Residual.context`).
    """
    place = remat.config_placements(c)
    host = {n for n, p in place.items() if p == remat.OFFLOAD}
    traced = c.model_copy(update={n: remat.DEVICE for n in host})
    stack = "moe" if moe else "dense"
    if layers is None:
        layers = c.num_moe_layers if moe else c.num_dense_layers
    # A placement on host traces as one on device: the fit search's ladders, which differ in
    # where the same names go, share one trace. The trace also reads the platform, the device
    # and the mesh and rules it is traced under.
    ambient = (platform.current(), platform.device(), jax.sharding.get_abstract_mesh())
    key = (traced.model_dump_json(), moe, batch_local, repr(ambient), repr(current_rules()))
    if key not in _TRACED:
        if len(_TRACED) >= _TRACED_MAX:
            _TRACED.clear()
        _TRACED[key] = _trace_layer(traced, moe, batch_local)
    return [
        Residual(name, shape, dtype, "host" if name in host else "device", stack, layers, context)
        for name, shape, dtype in _TRACED[key]
    ]


_TRACED: dict[tuple, list[tuple[str, tuple[int, ...], str]]] = {}
_TRACED_MAX = 512


def _trace_layer(traced: Config, moe: bool, batch_local: int) -> list[tuple]:
    """(name, shape, dtype) of what one layer of config `traced` saves, per device."""
    c = traced
    dtype = jnp.dtype(c.dtype)
    block = param.abstract(decoder.block_spec(c, moe=moe), jnp.dtype(c.weight_dtype))
    t = c.max_target_length
    x = jax.ShapeDtypeStruct((batch_local, t, c.base_emb_dim), dtype)
    ids = jax.ShapeDtypeStruct((batch_local, t), jnp.int32)

    def loss(p, x, positions, segment_ids):
        body = lambda x, p: decoder.block_apply(p, x, traced, positions, segment_ids, dtype)[:2]
        y, stats = remat.wrap_layer(body, traced, prevent_cse=False)(x, p)
        lb = stats.lb_loss if stats is not None else 0.0
        return jnp.sum(y.astype(jnp.float32)) + lb

    x_index = len(jax.tree.leaves(block))  # the flat position of `x` among the inputs
    # An attention kernel for one platform is traced for it (a trace only: nothing compiles).
    kernel_platform = ATTENTION_PLATFORMS.get(c.attention_impl)
    kernel_ctx = platform.use(kernel_platform, platform.device()) if kernel_platform else None
    with kernel_ctx or contextlib.nullcontext():
        sources = residual_sources(loss, block, x, ids, ids)
    out = []
    for src in sources:
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
        out.append((name, tuple(src.aval.shape), str(src.aval.dtype)))
    return out


def stack_residuals(
    c: Config, *, moe: bool, batch_local: int, microbatch_rows: int, context: int = 1
) -> list[Residual]:
    """The residuals of the MoE (`moe`) or dense stack per device.

    Its layers outside a pipeline save `layer_residuals` at the per-device batch. Its pipelined
    layers (models/pipeline.py): with a remat policy, the pipeline's own VJP keeps only the
    stage input of each of the M R real work items (`pipeline_iteration_input`, [microbatch
    rows, T, D] per device: the stage axis is sharded over `pipeline`); with remat_policy=none,
    the residuals of a stage's layers of one visit at the microbatch size, for each of the
    M R + S - 1 iterations (bubbles included). `context`: the context axis's split of each
    sequence (`Residual.context`).
    """
    outside = memory_pipeline.layers_outside(c, moe=moe)
    out = (
        layer_residuals(c, moe=moe, batch_local=batch_local, layers=outside, context=context)
        if outside
        else []
    )
    inside = memory_pipeline.pipelined_layers(c, moe=moe)
    if not inside:
        return out
    if c.remat_policy == "none":
        per_visit = inside // (c.pipeline_stages * c.num_pipeline_repeats)
        copies = memory_pipeline.iterations(c) * per_visit
        return out + layer_residuals(
            c, moe=moe, batch_local=microbatch_rows, layers=copies, context=context
        )
    shape = (microbatch_rows, c.max_target_length, c.base_emb_dim)
    stack = "moe" if moe else "dense"
    dtype_name = str(jnp.dtype(c.dtype))
    items = memory_pipeline.work_items(c)
    it = Residual(
        remat.PIPELINE_ITERATION_INPUT, shape, dtype_name, "device", stack, items, context
    )
    return [*out, it]


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
    return inputs + residual_total(one, "device")


def residual_total(residuals: list[Residual], placement: str) -> int:
    return sum(r.bytes * r.layers for r in residuals if r.placement == placement)


def names_not_saved(c: Config, residuals: list[Residual]) -> dict[str, str]:
    """Name -> why, for every name the config places on `device` or `offload` that no reported
    residual carries (none but the unavoidable after config checks: a name whose tensor the
    backward reads through another kept name, or one a stack cannot keep while another does)."""
    if c.remat_policy == "none":
        return {}
    saved = {r.name.removeprefix(STASH_PREFIX) for r in residuals}
    out = {}
    for name, place in remat.config_placements(c).items():
        if place == remat.REMAT or name in saved:
            continue
        why = remat.unkept(c).get(name)
        if why is None:
            why = "the backward pass reads another kept name instead (as mla_q when query_proj "
            why += "is kept: it reads their concat)"
        out[name] = f"{name}={place}: {why}"
    return out


STASH_PREFIX = "paged_stash:"  # the residual name of a stashed name's shared buffer
