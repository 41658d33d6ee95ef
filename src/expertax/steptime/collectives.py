"""A collective of a compiled program: its kind, the bytes each device moves, and its time by a
stated model on the placement's links.

Bytes per device (the payload each device holds, as nccl-tests sizes a collective):
- all-gather: the gathered output; reduce-scatter: the input before scattering; all-reduce:
  the array; all-to-all: the array each device sends and receives; ragged-all-to-all: the
  smaller of its send buffer (operand 0) and its receive buffer (what the rows sent are bounded
  by: the routed rows of a device under balanced routing, where the experts' side is a buffer
  sized for the worst case); collective-permute: the array sent to one peer.

Models (B the bytes per device, n the group, W a link's rate one way times its achieved share,
alpha a latency per collective; links.py):
- TPU, dimension by dimension over the torus axes a group spans (extent e, ring or line):
  all-gather and reduce-scatter B (n-1)/n / (W * sum over spanned axes of c), c = 2 on a ring
  (a device receives from both neighbours), 1 on a line (an end device has one link on that
  axis); all-reduce twice a reduce-scatter; all-to-all, one stage per spanned axis, each the
  most loaded link of that axis's exchange of B among e devices (shortest routes, a tie split
  both ways): on a ring (m(m+1)/2 + [e even] e/4) B / e with m = floor((e-1)/2), on a line
  max_k (k (e-k)) B / e; collective-permute B x the longest route in links / W.
- GPU, NVLink inside a node (switched: every GPU at full rate) and one network card per GPU
  across nodes, as NCCL runs them: inside a node all-gather and reduce-scatter B (n-1)/n / W_nvl,
  all-reduce twice that, all-to-all B (n-1)/n / W_nvl; across nodes the ring is limited by the
  cards: B (n-1)/n / (g W_nic) (all-reduce twice), and an all-to-all sends B (n-g)/n through each
  GPU's card (g the group's GPUs per node) while B (g-1)/n crosses NVLink; a permute B / W of
  its link. Inside a node all-gather and reduce-scatter run at NVLink's achieved rate, an
  all-reduce of the whole node at NVLink SHARP's (links.py); across nodes NCCL's rings run one
  per card, so the group's g GPUs of a node move g cards' worth (g W_nic, at most W_nvl).
"""

from __future__ import annotations

import dataclasses
import re

from expertax.planner.hlo import Instruction, Module
from expertax.steptime import groups as groups_mod
from expertax.steptime.links import Links
from expertax.steptime.topology import Placement, Span, hops, span
from expertax.targets import GPUS_PER_HOST

KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY_RE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple's elements summed; f8 types 1 byte)."""
    total = 0.0
    for dtype, dims in _ARRAY_RE.findall(shape):
        size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += size * n
    return int(total)


def kind_of(ins: Instruction) -> str | None:
    """The collective an instruction starts or is (None for other ops and for `-done`s)."""
    op = ins.opcode
    if op.endswith("-done"):
        return None
    base = op.removesuffix("-start")
    return base if base in KINDS else None


def is_sync(ins: Instruction) -> bool:
    """Whether a collective blocks the compute stream: a plain (not `-start`) op, or a GPU
    `-start` the scheduler marked synchronous (nothing scheduled between it and its done)."""
    if not ins.opcode.endswith("-start"):
        return True
    return bool(re.search(r'"is_sync":\s*true', ins.attrs))


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    bytes: int  # per device (module docstring)
    group_size: int
    span: str  # what the largest group spans physically
    mesh_axes: tuple[str, ...]
    seconds: float
    model: str  # the formula's name

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def payload(m: Module, ins: Instruction, kind: str, n: int) -> int:
    ops = [m.instructions[o] for o in ins.operands if o in m.instructions]
    inputs = sum(array_bytes(o.shape) for o in ops)
    if kind == "ragged-all-to-all":  # at most the smaller of the send and receive buffers
        return min(array_bytes(ops[0].shape), array_bytes(ins.shape)) if ops else 0
    if kind == "all-gather":
        return inputs * n
    return inputs


def _ring_load(e: int) -> float:
    """Most loaded link direction of an all-to-all among e devices on a ring, per byte a device
    holds (shortest routes; at distance e/2 half each way)."""
    m = (e - 1) // 2
    return (m * (m + 1) / 2 + (e / 4 if e % 2 == 0 else 0)) / e


def _line_load(e: int) -> float:
    return max(k * (e - k) for k in range(1, e)) / e if e > 1 else 0.0


def tpu_seconds(kind: str, b: float, s: Span, w: float, alpha: float) -> tuple[float, str]:
    n = s.size
    spanned = [(e, ring) for e, ring in zip(s.extents, s.rings) if e > 1]
    if n <= 1 or not spanned:
        return 0.0, "none"
    if kind in ("all-gather", "reduce-scatter", "all-reduce"):
        width = sum(2 if ring else 1 for _, ring in spanned)
        t = b * (n - 1) / n / (w * width)
        return alpha + (2 * t if kind == "all-reduce" else t), "torus ring"
    if kind in ("all-to-all", "ragged-all-to-all"):
        t = sum(b * (_ring_load(e) if ring else _line_load(e)) / w for e, ring in spanned)
        return alpha + t, "torus all-to-all, axis by axis"
    raise ValueError(kind)


def gpu_seconds(kind: str, b: float, s: Span, links: Links):
    n = s.size
    nodes, per = s.extents
    nvl = links.nvlink_bytes_per_s * links.link_share
    nic = links.nic_bytes_per_s * links.nic_share
    if n <= 1:
        return 0.0, "none"
    factor = 2 if kind == "all-reduce" else 1
    if kind == "all-reduce" and nodes == 1 and per == GPUS_PER_HOST and links.allreduce_bytes_per_s:
        return links.latency_s + 2 * b * (n - 1) / n / links.allreduce_bytes_per_s, "NVLink SHARP"
    if kind in ("all-gather", "reduce-scatter", "all-reduce"):
        if nodes == 1:
            return links.latency_s + factor * b * (n - 1) / n / nvl, "NVLink ring"
        # rings across nodes: the group's GPUs of a node each drive their own card
        rate = min(per * nic, nvl)
        return links.network_latency_s + factor * b * (n - 1) / n / rate, "rings across nodes"
    if kind in ("all-to-all", "ragged-all-to-all"):
        inside = b * (per - 1) / n / nvl
        if nodes == 1:
            return links.latency_s + inside, "NVLink all-to-all"
        return links.network_latency_s + max(inside, b * (n - per) / n / nic), "all-to-all, cards"
    raise ValueError(kind)


def collective(m: Module, ins: Instruction, p: Placement) -> Collective | None:
    kind = kind_of(ins)
    if kind is None:
        return None
    links = p.links
    if kind == "collective-permute":
        pairs = groups_mod.source_target_pairs(ins.attrs)
        b = payload(m, ins, kind, 1)
        far = max((hops(p, s, t) for s, t in pairs), default=0)
        if p.platform == "tpu":
            w = links.ici_bytes_per_s * links.link_share
            seconds = links.latency_s + b * far / w if far else 0.0
            where = f"{far} link(s)"
        else:
            cross = any(p.coords[s][0] != p.coords[t][0] for s, t in pairs)
            w = (
                links.nic_bytes_per_s * links.nic_share
                if cross
                else links.nvlink_bytes_per_s * links.link_share
            )
            seconds = (links.network_latency_s if cross else links.latency_s) + b / w if far else 0
            where = "across nodes" if cross else "NVLink"
        axes = p.mesh_axes(sorted({x for pr in pairs for x in pr})) if pairs else ()
        return Collective(ins.name, kind, b, 2, where, axes, seconds, "point to point")
    groups = groups_mod.replica_groups(ins.attrs, p.num_devices)
    biggest = max(groups, key=len)
    n = len(biggest)
    b = payload(m, ins, kind, n)
    spans = [span(p, g) for g in groups if all(i < p.num_devices for i in g)]
    if not spans:
        raise groups_mod.GroupError(
            f"{ins.name}: replica groups name devices past the target's {p.num_devices}"
        )
    if p.platform == "tpu":
        w = links.ici_bytes_per_s * links.link_share
        timed = [tpu_seconds(kind, b, s, w, links.latency_s) for s in spans]
    else:
        timed = [gpu_seconds(kind, b, s, links) for s in spans]
    i = max(range(len(timed)), key=lambda j: timed[j][0])  # groups run at once: the slowest
    seconds, model = timed[i]
    return Collective(
        ins.name,
        kind,
        b,
        n,
        spans[i].describe(p.platform),
        p.mesh_axes(biggest),
        seconds,
        model,
    )
