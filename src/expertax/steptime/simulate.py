"""Walk a compiled program's schedule with a compute stream and a link stream, and add up what
the step spends where.

The optimized HLO of a scheduled module lists each computation's instructions in the order
they run. Per computation:
- an operation runs on the compute stream for its `compute.Costs` time;
- a synchronous collective (a plain op; a GPU `-start` marked `is_sync`) waits for the link
  stream, runs, and holds the compute stream the whole time: all of it is exposed;
- an asynchronous collective (`-start` ... `-done`; `async-start` of a computation holding one)
  starts on the link stream when the compute stream reaches it and the link is free; its `-done`
  waits for it: what the compute between them does not cover is exposed;
- a fusion holding a collective (TPU's async collective fusions) runs its collective beside its
  own compute: exposed only where the collective is the longer;
- a copy to or from host memory (`S(5)`) runs on the host link (one direction, targets.HOSTS),
  asynchronously from `copy-start` (GPU: the `fusion-start` of a slice of a host buffer) to its
  done; other async copies (on-chip prefetches) and async fusions cost nothing here;
- a while loop runs its body (simulated once) `trip count` times (planner/trips.py; a
  `trips~N` scope's N for a data-dependent loop; else once, listed); a conditional its longest
  branch; a call (and a TPU `call-start` on the SparseCore) its computation.
Collectives of different kinds share one link stream: overlapping two of them does not make
either faster.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from expertax import scopes
from expertax.planner.flops import _called
from expertax.planner.hlo import CALLS_RE, HOST_MEMORY_SPACE, Instruction, Module
from expertax.planner.trips import trip_count
from expertax.steptime.collectives import Collective, array_bytes, collective, is_sync
from expertax.steptime.compute import Costs
from expertax.steptime.topology import Placement

# The timeline's lanes: the compute stream, the link stream, the host link, the SparseCore.
LANES = ("compute", "link", "host", "core")


@dataclasses.dataclass
class Comm:
    """Collectives of one kind along the same mesh axes, weighted by how often they run."""

    kind: str
    mesh_axes: tuple[str, ...]
    span: str
    count: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    exposed_seconds: float = 0.0


@dataclasses.dataclass
class Segment:
    """What one run of a computation costs."""

    seconds: float = 0.0  # wall time on the compute stream
    matmul_seconds: float = 0.0
    memory_seconds: float = 0.0
    flops: float = 0.0
    comm: dict = dataclasses.field(default_factory=dict)  # (kind, axes, span) -> Comm
    host_seconds: float = 0.0
    host_exposed_seconds: float = 0.0
    beside_seconds: float = 0.0  # TPU SparseCore work beside the compute stream
    bubble_seconds: float = 0.0  # a pipeline loop's idle iterations (inside the other parts)
    events: list = dataclasses.field(default_factory=list)  # (lane, start, end, label)
    gemms: dict = dataclasses.field(default_factory=dict)  # (kernel, dtypes) -> [n, flops, s]

    def add(self, other: Segment, times: float = 1.0) -> None:
        self.matmul_seconds += other.matmul_seconds * times
        self.memory_seconds += other.memory_seconds * times
        self.flops += other.flops * times
        self.host_seconds += other.host_seconds * times
        self.host_exposed_seconds += other.host_exposed_seconds * times
        self.beside_seconds += other.beside_seconds * times
        self.bubble_seconds += other.bubble_seconds * times
        for key, (n, f, sec) in other.gemms.items():
            row = self.gemms.setdefault(key, [0.0, 0.0, 0.0])
            row[0] += n * times
            row[1] += f * times
            row[2] += sec * times
        for key, c in other.comm.items():
            mine = self.comm.setdefault(key, Comm(*key))
            mine.count += c.count * times
            mine.bytes += c.bytes * times
            mine.seconds += c.seconds * times
            mine.exposed_seconds += c.exposed_seconds * times

    def beside(self) -> Segment:
        """This run beside the compute stream (a SparseCore call): its work and collectives
        count, none of them exposed (the wait for its end is, at its done)."""
        copy = Segment(seconds=self.seconds)
        copy.add(self)
        for c in copy.comm.values():
            c.exposed_seconds = 0.0
        copy.beside_seconds += copy.matmul_seconds + copy.memory_seconds
        copy.matmul_seconds = copy.memory_seconds = 0.0
        return copy

    def expose(self, key, seconds: float) -> None:
        if key in self.comm:
            self.comm[key].exposed_seconds += seconds

    def record(self, c: Collective, exposed: float) -> None:
        key = (c.kind, c.mesh_axes, c.span)
        mine = self.comm.setdefault(key, Comm(*key))
        mine.count += 1
        mine.bytes += c.bytes
        mine.seconds += c.seconds
        mine.exposed_seconds += exposed


@dataclasses.dataclass(frozen=True)
class LoopRun:
    name: str
    op_name: str
    trips: float
    how: str  # "read" | "expected (trips~N)" | "unknown: once"
    body_seconds: float
    body: str = ""  # the body computation


class Simulator:
    def __init__(self, module: Module, placement: Placement, host_bytes_per_s: float = 0.0):
        self.m = module
        self.p = placement
        self.costs = Costs(module, placement.links)
        self.host_rate = host_bytes_per_s
        self.memo: dict[str, Segment] = {}
        self.loops: list[LoopRun] = []
        self.untimed: list[str] = []
        self.fused_by = self.costs.flops.fused_by
        self._collectives: dict[str, Collective | None] = {}

    def collective(self, ins: Instruction) -> Collective | None:
        if ins.name not in self._collectives:
            self._collectives[ins.name] = collective(self.m, ins, self.p)
        return self._collectives[ins.name]

    def _inner_collectives(self, comp: str) -> list[Collective]:
        out = []
        for sub in self.costs.comps.get(comp, []):
            if (c := self.collective(sub)) is not None:
                out.append(c)
            elif sub.opcode == "fusion" and (m := CALLS_RE.search(sub.attrs)):
                out += self._inner_collectives(m.group(1))
        return out

    def _host_copy(self, ins: Instruction) -> float | None:
        """Seconds of a copy to or from host memory; None for other copies. A `copy-start`
        moves its array; a GPU `fusion-start` of a dynamic-(update-)slice on a host buffer
        moves the slice: the arrays of its shape not in host memory, scalars aside."""
        space = f"S({HOST_MEMORY_SPACE})"
        src = self.m.instructions.get(ins.operands[0]) if ins.operands else None
        if space not in ins.shape and (src is None or space not in src.shape):
            return None
        if ins.opcode == "fusion-start":
            arrays = re.findall(r"\b[a-z]\w*\[[\d,]+\]\{[^}]*\}", ins.shape)
            nbytes = sum(array_bytes(a) for a in arrays if space not in a)
        else:
            nbytes = array_bytes(ins.shape.lstrip("(").split("}", 1)[0])
        return nbytes / self.host_rate if self.host_rate else 0.0

    def run(self, comp: str) -> Segment:
        if comp in self.memo:
            return self.memo[comp]
        self.memo[comp] = Segment()  # a recursive call graph: count nothing twice
        seg = Segment()
        t, link, host = 0.0, 0.0, 0.0  # compute clock; when the link / host link is free
        pending: dict[str, tuple[float, Collective | None, str]] = {}  # start -> (end, c, lane)
        beside_keys: dict[str, tuple | None] = {}  # a SparseCore call -> its longest collective
        for ins in self.costs.comps.get(comp, []):
            op = ins.opcode
            c = self.collective(ins)
            if c is None and op == "async-start":
                inner = [x for _, name in _called(ins) for x in self._inner_collectives(name)]
                c = max(inner, key=lambda x: x.seconds) if inner else None
            if c is not None and not (op.endswith("-start") and not is_sync(ins)):
                start = max(t, link)
                end = start + c.seconds
                seg.events.append(("link", start, end, c.kind))
                seg.record(c, end - t)
                t = link = end
                continue
            if c is not None:  # asynchronous
                start = max(t, link)
                link = start + c.seconds
                pending[ins.name] = (link, c, "link")
                seg.events.append(("link", start, link, c.kind))
                continue
            if op.endswith("-done") or op == "async-done":
                started = ins.operands[0] if ins.operands else ""
                if started in pending:
                    end, pc, lane = pending.pop(started)
                    wait = max(0.0, end - t)
                    if lane == "core":
                        seg.expose(beside_keys.get(started), wait)
                    elif pc is not None:
                        seg.record(pc, wait)
                    elif lane == "host":
                        seg.host_exposed_seconds += wait
                    t += wait
                continue
            if op in ("copy-start", "fusion-start"):
                seconds = self._host_copy(ins)
                if seconds is not None:
                    start = max(t, host)
                    host = start + seconds
                    seg.host_seconds += seconds
                    pending[ins.name] = (host, None, "host")
                    seg.events.append(("host", start, host, "host copy"))
                continue
            if op in ("call-start", "custom-call-start"):  # TPU SparseCore work, beside
                parts = [self.run(name).beside() for _, name in _called(ins)]
                for part in parts:
                    seg.add(part)
                comms = [(c.seconds, k) for part in parts for k, c in part.comm.items()]
                longest = max(comms)[1] if comms else None
                took = sum(x.seconds for x in parts)
                pending[ins.name] = (t + took, None, "core")
                beside_keys[ins.name] = longest
                seg.events.append(("link" if longest else "core", t, t + took, "SparseCore"))
                continue
            if op in ("send", "recv", "send-done", "recv-done"):
                self.untimed.append(f"{ins.name} ({op}): point-to-point transfers are not timed")
                continue
            if op == "while":
                took = self._loop(ins, seg)
                seg.events.append(("compute", t, t + took, ins.name))
                t += took
                continue
            called = _called(ins)
            if op == "conditional":
                branches = [self.run(name) for key, name in called if key != "calls"]
                if branches:
                    longest = max(branches, key=lambda s: s.seconds)
                    seg.add(longest)
                    seg.events.append(("compute", t, t + longest.seconds, ins.name))
                    t += longest.seconds
                continue
            if op in ("call", "async-start") or (op == "custom-call" and not ins.shape):
                for _, name in called:
                    sub = self.run(name)
                    seg.add(sub)
                    seg.events.append(("compute", t, t + sub.seconds, ins.name))
                    t += sub.seconds
                continue
            cost = self.costs.cost(ins)
            seg.flops += cost.flops
            if cost.flops:
                row = seg.gemms.setdefault(self.costs.kernel(ins), [0.0, 0.0, 0.0])
                row[0] += 1
                row[1] += cost.flops
                row[2] += cost.seconds
            if cost.bound == "matmul":
                seg.matmul_seconds += cost.seconds
            else:
                seg.memory_seconds += cost.seconds
            inner = []
            if op == "fusion" and (m := CALLS_RE.search(ins.attrs)):
                inner = self._inner_collectives(m.group(1))
            if inner:  # a collective fused beside compute: they overlap
                comm = sum(x.seconds for x in inner)
                start = max(t, link)
                end = max(t + cost.seconds, start + comm)
                for x in inner:
                    seg.record(x, 0.0)
                exposed = end - (t + cost.seconds)
                first = inner[0]
                seg.comm[(first.kind, first.mesh_axes, first.span)].exposed_seconds += exposed
                seg.events.append(("link", start, start + comm, inner[0].kind))
                seg.events.append(("compute", t, t + cost.seconds, ins.name))
                t = link = end
                continue
            if cost.seconds:
                seg.events.append(("compute", t, t + cost.seconds, ins.name))
            t += cost.seconds
        for end, _, _ in pending.values():  # started, never waited for here
            t = max(t, end)
        seg.seconds = t
        self.memo[comp] = seg
        return seg

    def _loop(self, ins: Instruction, seg: Segment) -> float:
        called = dict((k, v) for k, v in _called(ins))
        body = self.run(called["body"]) if "body" in called else Segment()
        n: float | None = trip_count(self.m, ins, self.fused_by)
        how = "read"
        if n is None and (hint := scopes.TRIPS.pattern.findall(ins.op_name)):
            n, how = float(hint[-1]), "expected (the loop's trip-count scope)"
        if n is None:
            n, how = 1.0, "unknown: once"
        self.loops.append(
            LoopRun(ins.name, ins.op_name, n, how, body.seconds, called.get("body", ""))
        )
        seg.add(body, n)
        idle = _idle_iterations(ins.op_name)
        if idle:  # a pipeline's loop: each stage runs `idle` of its n iterations on no data
            seg.bubble_seconds += body.seconds * min(idle, n)
        return body.seconds * n


def _idle_iterations(op_name: str) -> int:
    """The idle iterations a pipeline loop carries in its own scope (`idle~N` just above the
    while: a loop nested in the pipeline's body has the scope above its parent's body)."""
    found = list(scopes.IDLE.pattern.finditer(op_name))
    if not found or "/body" in op_name[found[-1].end() :]:
        return 0
    return int(found[-1].group(1))


def exposed_by_axis(seg: Segment) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for c in seg.comm.values():
        out[",".join(c.mesh_axes) or "-"] += c.exposed_seconds
    return dict(out)
