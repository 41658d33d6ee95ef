"""The paged stash in the memory plan (`moe_paged_stash`, nn/moe/stash.py): its shared buffers,
the rows they are sized for, and what the stashed names cost per layer without it.
"""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.models import decoder, stashed_stack
from expertax.nn import param
from expertax.nn.moe import stash as stash_mod
from expertax.parallel import remat
from expertax.planner.residuals import STASH_PREFIX, Residual


def _named_shapes(jaxpr, names: set[str], mult: int = 1, nbytes: bool = False) -> dict[str, int]:
    """name -> elements (`nbytes`: bytes) of every `checkpoint_name` of `names` in `jaxpr` and
    its sub-jaxprs (per device inside a `shard_map`), times the length of each enclosing scan; a
    `cond` counts its largest branch."""
    out: dict[str, int] = {}

    def add(found):
        for k, v in found.items():
            out[k] = out.get(k, 0) + v

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and eqn.params["name"] in names:
            aval = eqn.outvars[0].aval
            size = math.prod(aval.shape) * (aval.dtype.itemsize if nbytes else 1)
            add({eqn.params["name"]: size * mult})
        inner = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
        subs = []
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    subs.append(_named_shapes(sub, names, inner, nbytes))
        if eqn.primitive.name == "cond" and subs:
            subs = [max(subs, key=lambda d: sum(d.values()))]
        for found in subs:
            add(found)
    return out


def worst_case_stash_rows(c: Config, trainer, nbytes: bool = False) -> dict[str, int]:
    """Stashed name -> elements (`nbytes`: bytes) one MoE layer saves per device without the
    stash: its grouped matmul outputs at their worst-case row count (the all-to-all receive
    buffer, the ring's gathered rows; per token chunk, times the chunks), traced on the
    trainer's mesh. The path is the stashed one's (fused or separate): both tag the same kept
    names (under fp8 the gate's and up's names tag their e4m3 tiles and scales)."""
    dtype = jnp.dtype(c.dtype)
    plain = c.model_copy(update={"moe_paged_stash": False})
    block = param.abstract(decoder.block_spec(plain, moe=True), jnp.dtype(c.weight_dtype))
    x = jax.ShapeDtypeStruct((trainer.global_batch, c.max_target_length, c.base_emb_dim), dtype)
    ids = jax.ShapeDtypeStruct(x.shape[:2], jnp.int32)
    fn = lambda p, x, ids: decoder.block_apply(p, x, plain, ids, ids, dtype)
    with trainer.context():
        closed = jax.make_jaxpr(fn)(block, x, ids)
    return _named_shapes(closed.jaxpr, set(remat.stashed_names(c)), nbytes=nbytes)


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
    widths = stash_mod.widths(c, sizes)
    buffers = stash_mod.buffers(c, sizes, c.dtype)  # (fp8: gate and up as e4m3 and scales)
    row_bytes = stash_mod.row_bytes(c, sizes, c.dtype)
    capacity = stash_mod.capacity_rows(c, layers, tokens, sizes)
    expected = stash_mod.expected_rows(c, tokens, sizes)
    page = c.moe_paged_stash_page_rows
    worst = worst_case_stash_rows(c, trainer, nbytes=True)
    report = {
        "names": list(widths),
        "widths": widths,
        "buffers": {n: [w, t.name] for n, (w, t) in buffers.items()},
        "capacity_factor": c.moe_paged_stash_capacity_factor,
        "capacity_rows": capacity,
        "page_rows": page,
        "expected_rows_per_layer": expected,
        "buffer_bytes": (capacity + page) * row_bytes,
        "routed_bytes": layers * expected * row_bytes,
        "worst_case_bytes": layers * sum(worst.values()),
    }
    dtype_name = str(jnp.dtype(c.dtype))
    x_shape = (batch_local, c.max_target_length, c.base_emb_dim)
    residuals = [Residual(remat.DECODER_LAYER_INPUT, x_shape, dtype_name, "device", "moe", layers)]
    residuals += [
        Residual(f"{STASH_PREFIX}{n}", (capacity + page, w), t.name, "device", "moe", 1)
        for n, (w, t) in buffers.items()
    ]
    return report, residuals
