"""The fit search's estimate of what a candidate layout's collectives take per step, before
anything compiles: the bytes each mesh axis moves (by what expertax's layouts exchange) timed
by the step-time model's formulas (steptime/collectives.py) on the physical span of that axis
in the mesh the target lays out. Counted as exposed: the compiled program's prediction
(steptime/), which sees what overlaps, ranks the candidates that compile.

Per step and device (16-bit activations and gathered weights, `grad_dtype` gradients):
- fsdp f: every weight the device computes with (the dense ones over tensor, the experts over
  expert) gathered forward and again for the backward pass, its gradient reduce-scattered;
- expert e: each MoE layer's routed token rows (tokens x K x D) sent and returned forward,
  twice again backward, and forward once more where the backward replays the layer;
- tensor t, context c: `steptime.exchange_bytes` (the activations' all-reduces, the key/value
  gathers);
- data d: the gradients all-reduced.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from expertax.config.schema import MESH_AXES, Config
from expertax.planner.steptime import DTYPE_BYTES, exchange_bytes, weights


@dataclasses.dataclass(frozen=True)
class Exchange:
    seconds: float
    by_axis: dict  # axis -> seconds

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def axis_bytes(c: Config, shape: dict[str, int], recompute_share: float) -> dict:
    """(collective kind, bytes per device) per mesh axis that moves something."""
    dense, experts = weights(c)
    t, e = shape.get("tensor", 1), shape.get("expert", 1)
    local = dense / t + experts / max(e, 1)
    grad = DTYPE_BYTES.get(str(c.grad_dtype), 4)
    out: dict[str, list[tuple[str, float]]] = {}
    if shape.get("fsdp", 1) > 1:
        out["fsdp"] = [("all-gather", 2 * 2 * local), ("reduce-scatter", grad * local)]
    if e > 1 and c.is_moe:
        tokens = c.per_device_batch_size * c.max_target_length
        rows = tokens * c.num_experts_per_tok * c.base_emb_dim * 2
        exchanges = 2 * (1 + 2 + min(1.0, recompute_share * 3))
        out["expert"] = [("all-to-all", exchanges * rows * c.num_moe_layers)]
    if t > 1 or shape.get("context", 1) > 1:
        moved = exchange_bytes(c, t, shape.get("context", 1))
        out["tensor" if t > 1 else "context"] = [("all-reduce", moved / 2)]
    if shape.get("data", 1) > 1:
        out["data"] = [("all-reduce", grad * local)]
    return out


def estimate(c: Config, shape: dict[str, int], devices, target, recompute_share: float):
    """The candidate's collectives in seconds (`Exchange`), or None where the target has no
    links to time (the CPU)."""
    from jax.sharding import Mesh

    from expertax.sharding.mesh import lay_out
    from expertax.steptime import collectives, topology

    if target is None or target.chip is None:
        return None
    sizes = tuple(shape.get(a, 1) for a in MESH_AXES)
    grid = np.asarray(lay_out(sizes, list(devices)))
    placement = topology.mesh_placement(target, Mesh(grid, MESH_AXES))
    links = placement.links
    index = {d: i for i, d in enumerate(grid.flat)}
    by_axis = {}
    for axis, moves in axis_bytes(c, shape, recompute_share).items():
        k = MESH_AXES.index(axis)
        line = np.moveaxis(grid, k, 0).reshape(grid.shape[k], -1)[:, 0]
        s = topology.span(placement, [index[d] for d in line])
        total = 0.0
        for kind, nbytes in moves:
            if placement.platform == "tpu":
                w = links.ici_bytes_per_s * links.link_share
                total += collectives.tpu_seconds(kind, nbytes, s, w, 0.0)[0]
            else:
                total += collectives.gpu_seconds(kind, nbytes, s, links)[0]
        by_axis[axis] = total
    return Exchange(sum(by_axis.values()), by_axis)
