"""The compute time of one operation of a compiled program on a chip: the larger of its
matmul FLOPs at the chip's peak (times the share a GEMM of its shape reaches) and the bytes it
reads and writes at the HBM rate (times the share a streaming kernel reaches).

- FLOPs are planner/flops.py's (dots and convolutions anywhere in a fusion, cuBLAS/cuDNN calls,
  the grouped-matmul, attention and fp8 kernels); a GEMM whose operands are fp8 runs at the
  chip's fp8 peak (links.py; TPU v5p has none: its bf16 peak);
- a GEMM's share: the achieved share of a large GEMM (links.py) times how much of its padded
  tiles are real: each of (rows, contraction, columns) rounded up to the chip's tile;
- bytes: every operand and result array, except that a fusion reading a parameter only through
  dynamic-slices reads the slices, and one updating a parameter in place (a dynamic-update-
  slice: a loop's stacked residuals; a scatter: the MoE's rows added into their buffer) moves
  the update, not the buffer; a grouped-matmul kernel reads the share of its buffer its FLOPs
  are counted at (the routed rows under balanced routing, planner/kernels.py).
"""

from __future__ import annotations

import dataclasses
import math
import re

from expertax.planner.flops import _Counter, _dims, _int_list
from expertax.planner.hlo import CALLS_RE, Instruction, Module
from expertax.steptime.collectives import array_bytes
from expertax.steptime.links import Links

FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OpCost:
    flops: float
    bytes: float
    seconds: float
    bound: str  # "matmul" | "memory" | "free"


def _tile_share(dims: tuple[int, int, int], tile: tuple[int, int, int]) -> float:
    share = 1.0
    for d, t in zip(dims, tile):
        if d > 0:
            share *= d / (math.ceil(d / t) * t)
    return share


def gemm_dims(m: Module, ins: Instruction) -> tuple[int, int, int] | None:
    """(rows, contraction, columns) of a dot or convolution, batch dimensions in the rows."""
    try:
        if ins.opcode == "dot":
            lhs = _dims(m.instructions[ins.operands[0]].shape)
            out = _dims(ins.shape)
            k = math.prod(lhs[d] for d in _int_list(ins.attrs, "lhs_contracting_dims"))
            n = out[-1] if out else 1
            return (max(math.prod(out) // max(n, 1), 1), k, n)
        if ins.opcode == "convolution":
            labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
            rhs = _dims(m.instructions[ins.operands[1]].shape)
            if labels is None:
                return None
            k, n = rhs[labels.group(1).index("i")], rhs[labels.group(1).index("o")]
            return (max(math.prod(_dims(ins.shape)) // max(n, 1), 1), k, n)
    except (KeyError, ValueError, IndexError):
        return None
    return None


_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_DTYPE_RE = re.compile(r"^\(?\s*([a-z]\w*)\[")
_CUSTOM = (  # custom-call target prefix -> the kernel's name in reports
    ("__cublas$lt$matmul$f8", "cuBLASLt fp8"),
    ("__cublas$lt", "cuBLASLt"),
    ("__cublas$gemm", "cuBLAS"),
    ("__cudnn$fmha", "cuDNN attention"),
    ("__cudnn$conv", "cuDNN convolution"),
    ("mosaic_gpu", "Mosaic GPU"),
    ("__gpu$xla.gpu.triton", "Triton"),
)


def _dtype(shape: str) -> str:
    m = _DTYPE_RE.match(shape.strip())
    return m.group(1) if m else "?"


def _updates_in_place(use: Instruction, name: str) -> bool:
    """Whether `use` writes part of `name` (its operand 0) in place: a dynamic-update-slice
    or a scatter."""
    if not use.operands or use.operands[0] != name:
        return False
    if use.opcode == "scatter":
        return True
    return use.opcode == "dynamic-update-slice" and len(use.operands) >= 2


def _update_of(use: Instruction) -> str:
    """The operand an in-place update writes: a scatter's updates (last), a dynamic-update-
    slice's update (operand 1)."""
    return use.operands[-1] if use.opcode == "scatter" else use.operands[1]


class Costs:
    """Per-instruction compute costs of one module on one chip (memoized)."""

    def __init__(self, module: Module, links: Links, counter: _Counter | None = None):
        self.m = module
        self.links = links
        self.flops = counter or _Counter(module)
        self.comps = self.flops.comps
        self.memo: dict[str, OpCost] = {}

    def _gemms(self, ins: Instruction) -> list[Instruction]:
        """The dots and convolutions an instruction is or fuses."""
        if ins.opcode in ("dot", "convolution"):
            return [ins]
        c = CALLS_RE.search(ins.attrs) if ins.opcode == "fusion" else None
        if c is None:
            return []
        out = []
        for sub in self.comps.get(c.group(1), []):
            out += self._gemms(sub)
        return out

    def kernel(self, ins: Instruction) -> tuple[str, str]:
        """(the kernel a matmul runs on, its operands' dtypes) for the report's GEMM table."""
        gemms = self._gemms(ins)
        dtypes = ""
        if gemms:
            ops = [self.m.instructions.get(o) for o in gemms[0].operands[:2]]
            dtypes = " x ".join(_dtype(o.shape) if o is not None else "?" for o in ops)
        if ins.opcode == "custom-call":
            target = (t.group(1) if (t := _TARGET_RE.search(ins.attrs)) else "").lower()
            kernel = self.flops.kernels.get(ins.name)
            if kernel is not None:
                name = kernel.describe()
            elif target == "tpu_custom_call":
                name = "Mosaic TPU " + (ins.name.split(".")[0] or "kernel")
            else:
                name = next((label for k, label in _CUSTOM if target.startswith(k)), target)
            fp8 = "f8e4m3fn[" in ins.attrs[:4000] or _dtype(ins.shape).startswith("f8")
            floats = [
                _dtype(self.m.instructions[o].shape)
                for o in ins.operands
                if o in self.m.instructions
                and re.match(r"\s*(bf16|f16|f32|f8\w*)\[", self.m.instructions[o].shape)
            ]
            dtypes = " x ".join(floats[:2]) or ("f8e4m3fn" if fp8 else "?")
            return name, dtypes
        if ins.opcode == "fusion":
            if "__triton_gemm" in ins.attrs or '"kind":"__triton' in ins.attrs:
                return "XLA Triton GEMM", dtypes
            if "__cublas" in ins.attrs:
                return "XLA cuBLAS fusion", dtypes
            return "XLA fusion", dtypes
        return f"XLA {ins.opcode}", dtypes

    def _fp8(self, ins: Instruction, gemms: list[Instruction]) -> bool:
        shapes = [self.m.instructions[o].shape for g in gemms for o in g.operands[:2]]
        if ins.opcode == "custom-call":
            shapes.append(ins.attrs[:2000])
        return any(s.lstrip("(").startswith("f8") or "f8e4m3fn[" in s for s in shapes)

    def _bytes(self, ins: Instruction) -> float:
        ops = [self.m.instructions[o] for o in ins.operands if o in self.m.instructions]
        out = array_bytes(ins.shape)
        reads = [array_bytes(o.shape) for o in ops]
        c = CALLS_RE.search(ins.attrs) if ins.opcode == "fusion" else None
        if c is None:
            if ins.opcode == "dynamic-update-slice" and len(ops) > 1:
                return 2 * array_bytes(ops[1].shape)
            if ins.opcode == "scatter" and len(ops) > 2:
                return 2 * array_bytes(ops[-1].shape) + array_bytes(ops[1].shape)
            if ins.opcode == "dynamic-slice":
                return 2 * out
            return out + sum(reads)
        body = self.comps.get(c.group(1), [])
        params = {s.name: int(s.args) for s in body if s.opcode == "parameter" and s.args.isdigit()}
        users: dict[str, list[Instruction]] = {}
        for s in body:
            for o in s.operands:
                users.setdefault(o, []).append(s)
        in_place = 0
        for name, k in params.items():
            use = users.get(name, [])
            if k >= len(reads) or not use:
                continue
            if all(u.opcode == "dynamic-slice" and u.operands[0] == name for u in use):
                reads[k] = sum(array_bytes(u.shape) for u in use)
            elif all(_updates_in_place(u, name) for u in use):
                update = sum(
                    array_bytes(self.m.instructions[_update_of(u)].shape)
                    for u in use
                    if _update_of(u) in self.m.instructions
                )
                in_place += max(reads[k] - update, 0)
                reads[k] = update
        return max(out - in_place, 0) + sum(reads)

    def cost(self, ins: Instruction) -> OpCost:
        if ins.name in self.memo:
            return self.memo[ins.name]
        if ins.opcode in FREE or ins.opcode.endswith(("-done", "-start")):
            result = OpCost(0.0, 0.0, 0.0, "free")
        else:
            flops = float(self.flops.own(ins))
            if ins.opcode == "fusion" and (c := CALLS_RE.search(ins.attrs)):
                flops += self.flops.cost(c.group(1))[0]
            nbytes = float(self._bytes(ins))
            kernel = self.flops.kernels.get(ins.name)
            if kernel is not None and kernel.worst_flops:  # reads the routed rows of its buffer
                nbytes *= min(1.0, kernel.flops / kernel.worst_flops)
            gemms = self._gemms(ins)
            peak = self.links.fp8_flops if self._fp8(ins, gemms) else self.links.peak
            share = self.links.matmul_share
            dims = [d for g in gemms if (d := gemm_dims(self.m, g)) is not None]
            if dims:  # the largest GEMM's padding
                share *= _tile_share(max(dims, key=math.prod), self.links.tile)
            t_flops = flops / (peak * share) if flops else 0.0
            t_bytes = nbytes / (self.links.hbm * self.links.memory_share)
            bound = "matmul" if t_flops >= t_bytes and flops else "memory"
            result = OpCost(flops, nbytes, max(t_flops, t_bytes), bound)
        self.memo[ins.name] = result
        return result
