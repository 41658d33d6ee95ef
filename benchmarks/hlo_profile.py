"""What a compiled XLA program moves and where its time goes, for the benchmarks.

`collective_bytes`: the bytes each device sends per collective kind, from the compiled
(per-device) HLO text. `profile_shares`: the shares of the profiled instruction time per
category. The XLA:CPU runtime records one event per executed HLO instruction, loop bodies'
instructions included, on every device's thread; each event is attributed to its instruction in
the compiled HLO (`hlo_categories`): `sort` (a sort, or a fusion whose computation sorts),
`gather` (a gather or scatter, or a fusion holding one), `collective` (their waiting time
included), or other; control flow (while, conditional, call) is left out, its body's
instructions are counted instead. Shares are of the summed event time of all devices.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np

DISPATCH_OPS = ("all-to-all", "all-gather", "reduce-scatter", "collective-permute")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


def _group_size(line: str) -> int:
    """Devices per replica group, from any of XLA's three printed forms."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        names = re.findall(r"'([^']+)'", m.group(2))
        return int(np.prod([int(sizes[n]) for n in names])) if names else 1
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    return len(m.group(1).split(",")) if m else 1


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes each device sends, per collective kind, in a compiled (per-device) HLO module.

    From result shapes and the group size S: all-gather and all-to-all send (S-1)/S of the
    result, reduce-scatter (S-1) x the result, all-reduce 2(S-1)/S of it (ring algorithm).
    """
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(
            r"=\s*(.*?)\s(all-to-all|all-gather|reduce-scatter|all-reduce|"
            r"collective-permute)(-start)?\(",
            line,
        )
        if not m:
            continue
        total = 0
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            n = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
            total += n * _BYTES.get(dt, 4)
        s = _group_size(line)
        factor = {
            "all-gather": (s - 1) / s,
            "all-to-all": (s - 1) / s,
            "reduce-scatter": s - 1,
            "all-reduce": 2 * (s - 1) / s,
        }.get(m.group(2), 1)
        out[m.group(2)] = out.get(m.group(2), 0) + int(total * factor)
    return out


CONTROL_FLOW = ("while", "conditional", "call")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([a-z][\w\-]*)\((.*)$")


def hlo_categories(hlo: str) -> dict[str, str]:
    """Instruction name -> `sort` | `gather` | `other` | `control` in compiled HLO text; a
    fusion takes the category of what its computation (and the ones it calls) contains."""
    comps: dict[str, list[tuple[str, str, list[str]]]] = {}
    current = None
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and " = " not in line:
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[current] = []
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            called = re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", m.group(3))
            comps[current].append((m.group(1), m.group(2), called))

    def contains(comp: str, seen=()) -> str:
        kinds = set()
        for _, op, called in comps.get(comp, []):
            kinds.add(_kind(op))
            for c in called:
                if c not in seen:
                    kinds.add(contains(c, (*seen, comp)))
        return "sort" if "sort" in kinds else "gather" if "gather" in kinds else "other"

    out = {}
    for instrs in comps.values():
        for name, op, called in instrs:
            if op in CONTROL_FLOW:
                out[name] = "control"
            elif op == "fusion":
                out[name] = contains(called[0]) if called else "other"
            else:
                out[name] = _kind(op)
    return out


COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def _kind(op: str) -> str:
    if op == "sort":
        return "sort"
    if op.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
        return "collective"
    return "gather" if op in ("gather", "scatter") else "other"


def profile_shares(compiled, args, iters: int) -> dict[str, float]:
    """Shares of the profiled instruction time per category (the module docstring)."""
    from jax._src.lib import _profiler

    cats = hlo_categories(compiled.as_text())
    session = _profiler.ProfilerSession()
    for _ in range(iters):
        jax.block_until_ready(compiled(*args))
    data = session.stop_and_get_profile_data()
    time_ns: Counter[str] = Counter()
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                cat = cats.get(ev.name)
                if cat is not None and cat != "control":
                    time_ns[cat] += ev.duration_ns
    total = sum(time_ns.values()) or 1.0
    return {f"{k}_share": time_ns[k] / total for k in ("sort", "gather", "collective")}
