"""The devices a collective of a compiled XLA program talks among, read from its HLO attributes.

XLA prints `replica_groups` in four forms (all seen in TPU and GPU programs of jax 0.8):
- explicit: `{{0,1,2,3},{4,5,6,7}}`; `{}` means one group of every device;
- iota: `[G,S]<=[d0,d1,...]T(p0,p1,...)`: iota(prod(d)) reshaped to `d`, transposed by the
  permutation `p` (when given), flattened and cut into G groups of S;
- mesh axes: `mesh['axis_0'=8,'axis_1'=2] {'axis_0'}`: the devices laid out row-major over the
  named axes (the first the slowest), one group per position of the axes not listed, running
  over the listed ones (in the order listed); `device_ids=([2,2,2]T(0,2,1))` after the mesh lays
  the ids out in that iota's order instead, and a listed `'axis_0':(p)s` is a sub-axis: the
  axis split into (p, s, the rest), major to minor, and the group runs over the `s` part;
- `source_target_pairs={{0,1},{1,2}}` of a collective-permute.

Ids are logical: indices into the program's device assignment (for a jitted function over a
`Mesh`, `mesh.devices.flat`), not physical devices; `topology.Placement` places them.
"""

from __future__ import annotations

import re

import numpy as np


class GroupError(ValueError):
    """A replica-group attribute this reader does not know."""


_EXPLICIT_RE = re.compile(r"replica_groups=(\{(?:\{[\d,\s]*\},?)*\})")
_IOTA_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_RE = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
    r"\s*\{([^}]*)\}"
)
_LISTED_RE = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _explicit(text: str) -> list[list[int]]:
    return [
        [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text)
    ]


def iota_groups(groups: int, size: int, dims: list[int], perm: list[int] | None) -> list[list[int]]:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(groups, size).tolist()


def mesh_groups(
    axes: list[tuple[str, int]], listed: list[tuple[str, int, int]], ids: np.ndarray | None = None
) -> list[list[int]]:
    """Groups over `listed` axes, each (name, pre-size, size); a whole axis is (name, 1, n)."""
    names = [a for a, _ in axes]
    sizes = dict(axes)
    unknown = [a for a, _, _ in listed if a not in names]
    if unknown:
        raise GroupError(f"mesh replica groups name axes {unknown} not in the mesh {names}")
    total = int(np.prod([n for _, n in axes]))
    ids = np.arange(total) if ids is None else ids.reshape(-1)
    dims: list[int] = []
    where: dict[str, int] = {}  # a listed axis -> its dimension in the refined shape
    for name in names:
        part = [(p, s) for a, p, s in listed if a == name]
        if len(part) > 1:
            raise GroupError(f"mesh replica groups list two parts of axis {name!r}")
        if not part:
            dims.append(sizes[name])
            continue
        p, s = part[0]
        if sizes[name] % (p * s):
            raise GroupError(f"sub-axis ({p}){s} does not divide axis {name!r}={sizes[name]}")
        where[name] = len(dims) + 1
        dims += [p, s, sizes[name] // (p * s)]
    grouped = [where[a] for a, _, _ in listed]
    rest = [d for d in range(len(dims)) if d not in grouped]
    size = int(np.prod([dims[d] for d in grouped])) if grouped else 1
    return ids.reshape(dims).transpose(rest + grouped).reshape(-1, size).tolist()


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The groups of a collective's attributes; one group of every device when it names none
    (or `{}`), as XLA reads it."""
    if m := _IOTA_RE.search(attrs):
        dims = [int(x) for x in m.group(3).split(",")]
        perm = [int(x) for x in m.group(4).split(",")] if m.group(4) else None
        return iota_groups(int(m.group(1)), int(m.group(2)), dims, perm)
    if m := _MESH_RE.search(attrs):
        axes = [(name, int(n)) for name, n in re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))]
        if not axes:
            raise GroupError(f"unreadable mesh replica groups: {m.group(0)[:120]}")
        ids = None
        if m.group(2):
            shape = [int(x) for x in m.group(2).split(",")]
            ids = np.arange(int(np.prod(shape))).reshape(shape)
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        sizes = dict(axes)
        listed = [
            (name, int(p) if p else 1, int(n) if n else sizes.get(name, 1))
            for name, p, n in _LISTED_RE.findall(m.group(4))
        ]
        return mesh_groups(axes, listed, ids)
    if m := _EXPLICIT_RE.search(attrs):
        groups = [g for g in _explicit(m.group(1)[1:-1]) if g]
        return groups or [list(range(num_devices))]
    if "replica_groups=" in attrs:
        found = attrs.split("replica_groups=", 1)[1][:80]
        raise GroupError(f"unreadable replica groups: {found!r}")
    return [list(range(num_devices))]


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    m = _PAIRS_RE.search(attrs)
    if m is None:
        return []
    return [(g[0], g[1]) for g in _explicit(m.group(1))]
