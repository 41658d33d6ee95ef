"""Where a program's logical devices sit on the hardware, and what a collective among a group
of them spans: torus axes (and whether each closes into a ring) on TPU, the NVLink domain of a
node or the network cards across nodes on GPU.

A program's replica groups name logical devices: indices into its device assignment. For a
program compiled here that is `mesh.devices.flat` and each device has its coordinates; for a
saved program without them, logical id i is placed as the TPU runtime numbers chips (x fastest,
then y, then z) or the GPU runtime numbers GPUs (8 per node, node-major): say which in a report.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from expertax import targets
from expertax.steptime.links import LINKS, Links, torus_wraps


@dataclasses.dataclass(frozen=True)
class Placement:
    """Physical coordinates per logical device: TPU (x, y, z[, ...]); GPU (node, local)."""

    platform: str  # "tpu" | "gpu"
    links: Links
    coords: tuple[tuple[int, ...], ...]
    grid: tuple[int, ...]  # TPU chip grid; GPU (nodes, gpus per node)
    wraps: tuple[bool, ...]  # TPU: which grid axes close into a ring
    source: str  # how the coordinates were found
    mesh: tuple[tuple[str, int], ...] = ()  # the logical mesh, when known: (axis, size)

    @property
    def num_devices(self) -> int:
        return len(self.coords)

    def mesh_axes(self, group: list[int]) -> tuple[str, ...]:
        """The mesh axes along which a group's members differ ("?" when the mesh is unknown)."""
        if not self.mesh:
            return ("?",)
        shape = [n for _, n in self.mesh]
        if math.prod(shape) != self.num_devices:
            return ("?",)
        at = np.array(np.unravel_index(np.asarray(group), shape))
        return tuple(name for (name, _), row in zip(self.mesh, at) if len(set(row)) > 1)


def default_placement(target: targets.Target, mesh=()) -> Placement:
    """Logical id i at the runtime's i-th device (module docstring)."""
    chip = target.chip
    if chip is None:
        raise ValueError("a step time needs a TPU or GPU target, not the CPU")
    links = LINKS[_key(chip)]
    if target.platform == "tpu":
        grid = tuple(int(n) for n in target.topology.split(":")[1].split("x"))
        coords = [
            tuple(int(v) for v in np.unravel_index(i, grid[::-1]))[::-1]
            for i in range(target.count)
        ]
        return Placement(
            "tpu",
            links,
            tuple(coords),
            grid,
            torus_wraps(_key(chip), grid),
            "assumed: device i at the runtime's i-th chip (x fastest)",
            tuple(mesh),
        )
    per = min(target.count, targets.GPUS_PER_HOST)
    nodes = -(-target.count // per)
    coords = [(i // per, i % per) for i in range(target.count)]
    return Placement(
        "gpu",
        links,
        tuple(coords),
        (nodes, per),
        (False, False),
        f"assumed: device i on node i // {per}",
        tuple(mesh),
    )


def mesh_placement(target: targets.Target, mesh) -> Placement:
    """The placement of a jax `Mesh` of the target's devices (a program compiled here)."""
    base = default_placement(target, tuple(zip(mesh.axis_names, mesh.devices.shape)))
    devices = list(mesh.devices.flat)
    if base.platform == "tpu" and all(hasattr(d, "coords") for d in devices):
        coords = tuple(tuple(int(v) for v in d.coords) for d in devices)
        return dataclasses.replace(base, coords=coords, source="the mesh's device coordinates")
    per = base.grid[1]
    coords = tuple((int(d.id) // per, int(d.id) % per) for d in devices)
    return dataclasses.replace(base, coords=coords, source=f"the mesh's device ids, {per} per node")


def _key(chip: targets.Chip) -> str:
    return next(k for k, v in targets.CHIPS.items() if v.name == chip.name)


@dataclasses.dataclass(frozen=True)
class Span:
    """What one group of a collective spans physically."""

    size: int
    extents: tuple[int, ...]  # TPU: distinct coordinates per grid axis; GPU: (nodes, max per node)
    rings: tuple[bool, ...]  # TPU: per grid axis, whether the group uses its wraparound

    def describe(self, platform: str) -> str:
        if platform == "gpu":
            nodes, per = self.extents
            return f"{per} GPU NVLink" if nodes == 1 else f"{nodes} nodes x {per} GPUs"
        axes = [
            f"{'xyzw'[d]}{n}{'(ring)' if self.rings[d] else ''}"
            for d, n in enumerate(self.extents)
            if n > 1
        ]
        return "torus " + " ".join(axes) if axes else "one chip"


def span(p: Placement, group: list[int]) -> Span:
    pts = np.array([p.coords[i] for i in group])
    if p.platform == "gpu":
        nodes, counts = np.unique(pts[:, 0], return_counts=True)
        return Span(len(group), (len(nodes), int(counts.max())), (False, False))
    extents = tuple(len(set(pts[:, d])) for d in range(pts.shape[1]))
    rings = tuple(
        bool(p.wraps[d] and extents[d] == p.grid[d] and extents[d] > 2) for d in range(len(extents))
    )
    return Span(len(group), extents, rings)


def hops(p: Placement, a: int, b: int) -> int:
    """Links between two devices on the shortest route (TPU); 1 on GPU (switched)."""
    if p.platform == "gpu":
        return 0 if a == b else 1
    total = 0
    for d, (u, v) in enumerate(zip(p.coords[a], p.coords[b])):
        dist = abs(u - v)
        total += min(dist, p.grid[d] - dist) if p.wraps[d] else dist
    return total
