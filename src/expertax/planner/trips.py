"""How many times a while loop of an optimized XLA program runs, read from its HLO text
(`trip_count`, for planner/flops.py's multipliers).

The trip count is `known_trip_count` in the while's backend config when present (GPU), else read
from the loop: the condition compares an induction variable (an element of the loop state, maybe
through a fusion) with a constant, the body adds a constant to it, and its initial value is a
constant in the while's init tuple (TPU: `wide.` loops that XLA widened, sunk constants into or
unrolled). None where it cannot be read (a data-dependent bound).
"""

from __future__ import annotations

import re

from expertax.planner.hlo import CALLS_RE, Instruction, Module


def _int_literal(ins: Instruction) -> int | None:
    return int(ins.args) if re.fullmatch(r"\s*-?\d+\s*", ins.args) else None


def fusion_callers(m: Module) -> dict[str, list[Instruction]]:
    """Fused computation -> the fusion instructions that call it."""
    out: dict[str, list[Instruction]] = {}
    for ins in m.instructions.values():
        if ins.opcode == "fusion" and (c := CALLS_RE.search(ins.attrs)):
            out.setdefault(c.group(1), []).append(ins)
    return out


Affine = tuple[int | None, int]


def _affine(m: Module, fused_by: dict, name: str, hops: int = 32) -> Affine | None:
    """`name` as (None, c): the constant c, or (i, c): element i of the loop state plus c; the
    loop state is the parameter of a while body or condition, reached through fusions, copies,
    converts and tuple plumbing."""
    ins = m.instructions.get(name)
    if ins is None or hops == 0:
        return None
    op, ops = ins.opcode, ins.operands
    if op == "constant":
        v = _int_literal(ins)
        return None if v is None else (None, v)
    if op in ("copy", "bitcast", "convert", "reshape") and ops:
        return _affine(m, fused_by, ops[0], hops - 1)
    if op == "get-tuple-element" and ops:
        index = int(re.search(r"\bindex=(\d+)", ins.attrs).group(1))  # type: ignore[union-attr]
        src = m.instructions.get(ops[0])
        if src is not None and src.opcode == "parameter" and src.computation in m.callers:
            return index, 0
        if src is not None and src.opcode == "tuple" and index < len(src.operands):
            return _affine(m, fused_by, src.operands[index], hops - 1)
        return None
    if op == "parameter" and ins.computation not in m.callers:
        # a fused computation's parameter: the operand of the one fusion that calls it
        callers = fused_by.get(ins.computation, [])
        number = _int_literal(ins)
        if len(callers) == 1 and number is not None and number < len(callers[0].operands):
            return _affine(m, fused_by, callers[0].operands[number], hops - 1)
        return None
    if op == "fusion":
        c = CALLS_RE.search(ins.attrs)
        root = m.roots.get(c.group(1)) if c else None
        return _affine(m, fused_by, root, hops - 1) if root else None
    if op in ("add", "subtract") and len(ops) == 2:
        a, b = _affine(m, fused_by, ops[0], hops - 1), _affine(m, fused_by, ops[1], hops - 1)
        if a is None or b is None or (a[0] is not None and b[0] is not None):
            return None
        if op == "subtract":
            return (a[0], a[1] - b[1]) if b[0] is None else None
        return (a[0] if a[0] is not None else b[0], a[1] + b[1])
    return None


def _find_compare(m: Module, name: str, hops: int = 8) -> Instruction | None:
    ins = m.instructions.get(name)
    while ins is not None and ins.opcode in ("fusion", "copy", "bitcast") and hops:
        c = CALLS_RE.search(ins.attrs) if ins.opcode == "fusion" else None
        nxt = m.roots.get(c.group(1)) if c else (ins.operands[0] if ins.operands else None)
        ins, hops = (m.instructions.get(nxt) if nxt else None), hops - 1
    return ins if ins is not None and ins.opcode == "compare" else None


_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def trip_count(m: Module, loop: Instruction, fused_by: dict | None = None) -> int | None:
    """How many times a while loop's body runs, or None when that cannot be read."""
    fused_by = fusion_callers(m) if fused_by is None else fused_by
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    comps = dict(re.findall(r"\b(body|condition)=%?([\w.\-]+)", loop.attrs))
    cmp = _find_compare(m, m.roots.get(comps.get("condition", ""), ""))
    direction = re.search(r"direction=(\w+)", cmp.attrs) if cmp else None
    if cmp is None or direction is None or len(cmp.operands) != 2:
        return None
    left, right = (_affine(m, fused_by, o) for o in cmp.operands)
    d = direction.group(1)
    if left is None or right is None or (left[0] is None) == (right[0] is None):
        return None
    if left[0] is None:
        left, right, d = right, left, _FLIP.get(d, d)
    index, bound = left[0], right[1] - left[1]  # state[index] <d> bound
    if index is None:
        return None
    init_tuple = m.instructions.get(loop.operands[0]) if loop.operands else None
    body_root = m.instructions.get(m.roots.get(comps.get("body", ""), ""))
    if init_tuple is None or init_tuple.opcode != "tuple" or body_root is None:
        return None
    if body_root.opcode != "tuple" or index >= len(body_root.operands):
        return None
    init = _affine(m, fused_by, init_tuple.operands[index])
    step = _affine(m, fused_by, body_root.operands[index])
    if init is None or init[0] is not None or step is None or step[0] != index or not step[1]:
        return None
    start, s = init[1], step[1]
    if d in ("LE", "GE"):
        bound, d = bound + (1 if d == "LE" else -1), d[0] + "T"
    if d == "LT" and s > 0:
        return max(0, -((start - bound) // s))
    if d == "GT" and s < 0:
        return max(0, -((bound - start) // -s))
    if d == "NE" and (bound - start) % s == 0 and (bound - start) // s >= 0:
        return (bound - start) // s
    return None
