"""Matmul and convolution FLOPs of a compiled XLA program, read from its optimized HLO text.

`count_flops(compiled.as_text())` works for the TPU and GPU compilers, and where XLA's own
`compiled.cost_analysis()` falls short: that counts a while loop's body once (a scanned 61-layer
step reports about one layer), and on the GPU compile-only path it returns None.

What is counted (per device: the HLO of an SPMD program has shard shapes), 2 flops per
multiply-add:
- `dot` (anywhere, fusions included): 2 x output elements x contracted size;
- `convolution` (TPU writes every matmul as one, `dim_labels=bf_io->bf`; batched matmuls as a
  base-dilated window): 2 x output features x input features (per group) x batch x the
  (output, kernel) position pairs that touch real input, as XLA's cost analysis counts them;
- cuBLAS custom calls (`__cublas$gemm`, `__cublas$lt$matmul...`: the dot dimension numbers in
  the backend config) and cuDNN forward convolutions (window and dim_labels; the backward
  ones are listed in `opaque`);
- grouped-matmul kernels (tokamax's Triton / Mosaic GPU / Mosaic TPU, megablox) from their
  tiling and, for the group sizes only known at run time, at the balanced rows per group the
  program names (`rows~R`) or else the worst case for the buffer (planner/kernels.py; both are
  in `kernels`, and `worst_flops` counts every kernel at its worst case);
- `tpu_custom_call` (Mosaic kernels: TPU's native `ragged_dot` is one) by the kernel's own
  `cost_estimate.flops`; a ragged dot without one as 2 x M x K x N of its rows (M = lhs rows);
  other kernels without an estimate are listed in `opaque`, not counted.
Elementwise work, reductions and collectives are not counted.

Multipliers: a while body counts `trip count` times (nested loops multiply); fusions, calls and
async computations count at their caller's multiplier; a conditional counts its most expensive
branch (what XLA's cost analysis does; which branch runs is data). The trip count is read
from the loop (planner/trips.py; an unrolled body holds its copies of the layer and runs fewer
times). A loop whose count cannot be read (a data-dependent bound) counts once and is listed
in `unknown_trip_counts`, unless the program names its expected count: a loop traced under
`jax.named_scope("trips~N")` (the grouped matmul's tile loops, at the count balanced routing
gives: `nn/moe/gmm.py`) counts N times and is listed in `expected_trip_counts`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

from expertax import scopes
from expertax.planner.hlo import Instruction, Module, parse_hlo
from expertax.planner.kernels import GroupedKernel, grouped_kernel
from expertax.planner.trips import fusion_callers, trip_count


@dataclasses.dataclass(frozen=True)
class Loop:
    name: str  # the while instruction
    trip_count: float | None  # None: could not be read (counted once); a `trips~N` mean
    op_name: str
    body_flops: float  # flops of one trip through the body (nested loops at their counts)
    expected: bool = False  # a data-dependent count, taken from the loop's `trips~N` scope


@dataclasses.dataclass
class FlopCount:
    flops: int  # every computation weighted by how many times it runs
    flops_once: int  # every loop body counted once (XLA's cost analysis convention)
    loops: list[Loop]
    unknown_trip_counts: list[Loop]
    expected_trip_counts: list[Loop]  # data-dependent loops counted at their expected count
    by_op_name: dict[str, int]  # weighted flops by the op_name metadata of the dot/convolution
    opaque: list[tuple[str, str, str]]  # (instruction, custom-call target, op_name) not counted
    kernels: list[GroupedKernel] = dataclasses.field(default_factory=list)  # each call once
    # loops of unknown trip count without a matmul in their body (data-dependent row loops):
    # their count does not change `flops`
    flop_free_loops: list[Loop] = dataclasses.field(default_factory=list)
    worst_flops: int = 0  # `flops` with every grouped kernel at its worst case for the buffer

    def matching(self, substring: str) -> int:
        """Weighted flops of the instructions whose op_name contains `substring`."""
        return sum(f for name, f in self.by_op_name.items() if substring in name)

    def by_scope(self, depth: int = 1) -> dict[str, int]:
        """Weighted flops by the first `depth` components of the op_name, transformations
        unwrapped (`transpose(jvp(moe))` -> `moe`, `jvp()` dropped), so that a scope's forward
        and backward pass add up; `jit(f)` components are kept."""
        out: Counter[str] = Counter()
        for name, f in self.by_op_name.items():
            parts = [_unwrap(p) for p in name.split("/")]
            out["/".join([p for p in parts if p][:depth])] += f
        return dict(out)


def _unwrap(part: str) -> str:
    while (m := re.fullmatch(r"(?:jvp|transpose|vmap|remat|checkpoint)\((.*)\)", part)) is not None:
        part = m.group(1)
    return part


_CALLED_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLED_LIST_RE = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_DIMS_RE = re.compile(r"^\(?\s*[a-z]\w*\[([^\]]*)\]")


def _dims(shape: str) -> tuple[int, ...]:
    """Dimensions of an array shape, or of a tuple's first element (`<=N` bounds read as N)."""
    m = _DIMS_RE.match(shape.strip())
    if m is None:
        raise ValueError(f"not an array shape: {shape[:80]!r}")
    return tuple(int(d.strip().lstrip("<=")) for d in m.group(1).split(",") if d.strip())


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,\s]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def _called(ins: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction calls (an async op's `-start` only)."""
    if ins.opcode.endswith(("-done", "-update")):
        return []
    attrs = ins.attrs.split("backend_config=", 1)[0]
    out = [(k, v) for k, v in _CALLED_RE.findall(attrs)]
    for key, names in _CALLED_LIST_RE.findall(attrs):
        out += [(key, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
    return out


def _dot_flops(out: tuple[int, ...], lhs: tuple[int, ...], contracting: list[int]) -> int:
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _conv_flops(ins: Instruction, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> int:
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if labels is None:
        raise ValueError(f"{ins.name}: a convolution without dim_labels")
    lhs_l, rhs_l, out_l = labels.groups()
    out = _dims(ins.shape)
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}

    def per_dim(key: str, default: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * 8

    stride, base, dilate = per_dim("stride", 1), per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * 8
    positions = 1
    for d in sorted(c for c in lhs_l if c.isdigit()):
        n_in, n_k, n_out = lhs[lhs_l.index(d)], rhs[rhs_l.index(d)], out[out_l.index(d)]
        i = int(d)
        positions *= _valid_pairs(n_in, n_k, n_out, stride[i], pads[i], base[i], dilate[i])
    bgc = re.search(r"batch_group_count=(\d+)", ins.attrs)
    batch = lhs[lhs_l.index("b")] // (int(bgc.group(1)) if bgc else 1)
    return 2 * rhs[rhs_l.index("i")] * rhs[rhs_l.index("o")] * batch * positions


def _valid_pairs(n_in: int, n_k: int, n_out: int, stride: int, pad: int, base: int, dil: int):
    """(output, kernel) position pairs of one spatial dimension that read a real input element:
    not padding, not a hole of the base (lhs) dilation."""
    total, last = 0, (n_in - 1) * base  # the dilated input spans [0, last]
    for k in range(n_k):
        a = k * dil - pad  # output position o reads dilated input position o * stride + a
        lo, hi = max(0, -(a // stride)), min(n_out - 1, (last - a) // stride)
        if lo > hi:
            continue
        if base == 1:
            total += hi - lo + 1
            continue
        # o * stride + a must be a multiple of base: o = o0 (mod period) when solvable
        g = math.gcd(stride, base)
        if a % g:
            continue
        period = base // g
        o0 = (-a // g) * pow(stride // g, -1, period) % period
        first = lo + (o0 - lo) % period
        total += (hi - first) // period + 1 if first <= hi else 0
    return total


class _Counter:
    def __init__(self, module: Module):
        self.m = module
        self.comps: dict[str, list[Instruction]] = {}
        for ins in module.instructions.values():
            self.comps.setdefault(ins.computation, []).append(ins)
        self.memo: dict[str, tuple[float, int, dict[str, float], float]] = {}
        self.trips: dict[str, float | None] = {}
        self.body_flops: dict[str, float] = {}
        self.opaque: list[tuple[str, str, str]] = []
        self.expected: dict[str, float] = {}  # loops counted by their `trips~N` scope
        self.kernels: dict[str, GroupedKernel] = {}
        self.fused_by = fusion_callers(module)

    def shape(self, name: str) -> tuple[int, ...]:
        return _dims(self.m.instructions[name].shape)

    def operand_dims(self, ins: Instruction) -> list[tuple[int, ...]]:
        out = []
        for op in ins.operands:
            try:
                out.append(self.shape(op))
            except (KeyError, ValueError):
                out.append(())
        return out

    def float_operand_dims(self, ins: Instruction) -> list[tuple[int, ...]]:
        """Dimensions of the floating-point array operands (a kernel's data, not its masks)."""
        out = []
        for op in ins.operands:
            ref = self.m.instructions.get(op)
            if ref is not None and re.match(r"\s*(bf16|f16|f32|f64|f8\w*)\[", ref.shape):
                out.append(_dims(ref.shape))
        return out

    def own(self, ins: Instruction) -> int:
        op = ins.opcode
        if op == "dot":
            lhs = self.shape(ins.operands[0])
            return _dot_flops(_dims(ins.shape), lhs, _int_list(ins.attrs, "lhs_contracting_dims"))
        if op == "convolution":
            return _conv_flops(ins, self.shape(ins.operands[0]), self.shape(ins.operands[1]))
        if op == "ragged-dot":  # 2 x lhs elements x the rhs dimensions that reach the output
            lhs, rhs = self.shape(ins.operands[0]), self.shape(ins.operands[1])
            keys = ("rhs_contracting_dims", "rhs_batch_dims", "rhs_group_dims")
            skip = {d for k in keys for d in _int_list(ins.attrs, k)}
            return 2 * math.prod(lhs) * math.prod(n for i, n in enumerate(rhs) if i not in skip)
        if op != "custom-call":
            return 0
        target = (m.group(1) if (m := _TARGET_RE.search(ins.attrs)) else "").lower()
        kernel = grouped_kernel(
            ins.name, target, ins.op_name, _dims(ins.shape), self.operand_dims(ins)
        )
        if kernel is not None:
            self.kernels[ins.name] = kernel
            return kernel.flops
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
        if target.startswith("__cublas$") and contracting:
            dims = [int(x.strip('" ')) for x in contracting.group(1).split(",") if x.strip()]
            return _dot_flops(_dims(ins.shape), self.shape(ins.operands[0]), dims)
        if target in ("__cudnn$convforward", "__cudnn$convbiasactivationforward"):
            return _conv_flops(ins, self.shape(ins.operands[0]), self.shape(ins.operands[1]))
        attention = _attention_kernel_flops(ins, target, self.float_operand_dims(ins))
        if attention is not None:
            return attention
        fp8 = _fp8_hopper_flops(ins, target)
        if fp8 is not None:
            return fp8
        if target == "tpu_custom_call":
            est = re.search(r'"cost_estimate":\{"flops":"?(\d+)', ins.attrs)
            if est:
                return int(est.group(1))
            if "ragged-dot" in ins.name or "ragged_dot" in ins.attrs:
                if ins.shape.startswith("("):
                    return 0  # the group metadata kernel
                return 2 * math.prod(_dims(ins.shape)) * self.shape(ins.operands[-2])[-1]
        if re.search(r"tpu_custom_call|mosaic|triton|cublas|cudnn", target):
            self.opaque.append((ins.name, target, ins.op_name))
        return 0

    def cost(self, comp: str) -> tuple[float, int, dict[str, float], float]:
        """(weighted flops, flops with loop bodies once, weighted flops by op_name, weighted
        flops the grouped kernels add at their worst case beyond what they are counted at)."""
        if comp in self.memo:
            return self.memo[comp]
        self.memo[comp] = (0, 0, {}, 0)  # a recursive call graph: count nothing twice
        total: float = 0
        extra: float = 0
        once, by_op = 0, defaultdict[str, float](float)
        for ins in self.comps.get(comp, []):
            f = self.own(ins)
            total, once = total + f, once + f
            if f:
                by_op[ins.op_name] += f
            if (kernel := self.kernels.get(ins.name)) is not None:
                extra += kernel.worst_flops - kernel.flops
            called = _called(ins)
            if ins.opcode == "while":
                n: float | None = trip_count(self.m, ins, self.fused_by)
                self.trips[ins.name] = n
                if n is None and (hint := scopes.TRIPS.pattern.findall(ins.op_name)):
                    n = float(hint[-1])  # the program's own count: balanced routing, a mean
                    self.expected[ins.name] = n
                parts = [(self.cost(c), 1 if n is None else n) for _, c in called]
                self.body_flops[ins.name] = sum(self.cost(c)[0] for k, c in called if k == "body")
            elif ins.opcode == "conditional":  # the most expensive branch
                costs = [self.cost(c) for k, c in called if k != "calls"]
                parts = [(max(costs, key=lambda t: t[0]), 1)] if costs else []
            else:
                parts = [(self.cost(c), 1) for _, c in called]
            for (t, o, ops, x), mult in parts:
                total, once, extra = total + t * mult, once + o, extra + x * mult
                for name, g in ops.items():
                    by_op[name or ins.op_name] += g * mult
        self.memo[comp] = (total, once, by_op, extra)
        return self.memo[comp]


# Flash-attention kernels, by the matmuls per (query, key) pair each computes: 2 x (Q + V)
# forward (scores, values); splash's backward is two kernels, dq (scores again, dO V^T, dS K:
# 2Q + V) and dk/dv (scores, dO V^T, P^T dO, dS^T Q: 2Q + 2V); cuDNN's backward is one kernel
# (scores, dO V^T, P^T dO, dS K, dS^T Q: 3Q + 2V).
_SPLASH_RE = re.compile(r"splash_mha_(fwd|dq|dkv)")


# The fp8 Hopper kernels (fp8/hopper/) by the named scope of their product
# (`scopes.FP8_DENSE`, `scopes.FP8_GROUPED`), and their row tile by the kernel call's own
# (fp8/hopper/layout.tile_scope; 128 where it is absent)
_F8_OPERAND_RE = re.compile(r"f8e4m3fn\[(\d+,\d+)\]")
_F8_WEIGHT_RE = re.compile(r"f8e4m3fn\[(\d+),\d+,\d+\]")


def _fp8_hopper_flops(ins: Instruction, target: str) -> int | None:
    """FLOPs of an fp8 Hopper kernel call (a Mosaic GPU custom call under an fp8 product's
    scope) from its shapes: the fprop and dgrad multiply [Mp, C] e4m3 rows by each group's
    [C, N] weight into [Mp, N], the wgrad [G, K, N] from x^T [K, Mp] and dy^T [N, Mp]. The
    wrapper lays out Mp = the rows plus up to a row tile per group (each group starts at a row
    tile, hopper/layout.padded_rows; the tile T is 64 or 128 rows for the fprop and dgrad, 128 for
    the wgrad, named in the op_name as `fp8_tile~T`), and the kernel skips the tiles past the
    last group: it computes the rows rounded up per group, counted here at one group's rows
    exactly (Mp - T), at the balanced rows per group the program names (`rows~R`, as the
    bfloat16 kernels are counted, planner/kernels.py: G ceil(R / T) tiles), or else at
    several groups' on average (half a tile of padding each: Mp - T / 2 G). None for other
    calls."""
    scope = scopes.fp8_product(ins.op_name)
    if not target.startswith("mosaic_gpu") or scope is None:
        return None
    named = scopes.FP8_TILE.pattern.search(ins.op_name)
    tile = int(named.group(1)) if named else 128
    found = _F8_OPERAND_RE.findall(ins.attrs)
    if not found:
        return None
    out = _dims(ins.shape)
    (rows,) = [tuple(int(d) for d in f.split(",")) for f in found[:1]]
    if scope == "wgrad":  # [G, K, N] <- x^T [K, Mp], dy^T [N, Mp]
        g, mp, width = out[0], rows[1], math.prod(out[1:])
    else:  # [Mp, N] <- [Mp, C] x [G, ., .]
        weight = _F8_WEIGHT_RE.search(ins.attrs)
        g = int(weight.group(1)) if weight else 1
        mp, width = out[0], rows[1] * math.prod(out[1:])
    balanced = scopes.ROWS.pattern.search(ins.op_name)
    if g == 1:
        computed = mp - tile
    elif balanced:
        computed = min(mp, g * -(-int(balanced.group(1)) // tile) * tile)
    else:
        computed = mp - tile // 2 * g
    return 2 * max(computed, 0) * width


def _attention_kernel_flops(ins: Instruction, target: str, operands) -> int | None:
    """FLOPs of a flash-attention kernel (Pallas TPU splash, cuDNN fused attention) from its
    operand shapes, counting the causal pairs (T(T+1)/2 per sequence and head: expertax's
    attention is causal; masked blocks a kernel skips are not work, as the model counts them),
    or the full T x S pairs for a cuDNN call whose mask is not causal; None for other calls."""
    splash = _SPLASH_RE.search(ins.name) if target == "tpu_custom_call" else None
    cudnn = target.startswith("__cudnn$fmha")
    if splash is None and not cudnn:
        return None
    qkv = [d for d in operands if len(d) >= 3][:3]
    if len(qkv) < 3:
        return None
    q, k, v = qkv
    if splash is not None:  # [..., heads, T, head dim]
        t, s, qd, vd = q[-2], k[-2], q[-1], v[-1]
        heads = math.prod(q[:-2])
        per_pair = {"fwd": qd + vd, "dq": 2 * qd + vd, "dkv": 2 * qd + 2 * vd}[splash.group(1)]
        causal = True
    else:  # [B, T, heads, head dim]
        t, s, qd, vd = q[1], k[1], q[-1], v[-1]
        heads = q[0] * q[2]
        per_pair = 3 * qd + 2 * vd if "backward" in target else qd + vd
        # A boolean (bias) mask, packed documents' form, is applied to every pair computed.
        causal = re.search(r'"mask_type":\s*"(CAUSAL|PADDING_CAUSAL)', ins.attrs) is not None
    pairs = t * (t + 1) // 2 if causal and t == s else t * s
    return 2 * heads * pairs * per_pair


def count_flops(hlo_text: str) -> FlopCount:
    """The FLOPs of one compiled program, per device, from its optimized HLO text."""
    module = parse_hlo(hlo_text)
    counter = _Counter(module)
    total, once, by_op, worst_extra = counter.cost(module.entry)
    loops = [
        Loop(
            name,
            counter.expected.get(name, n),
            module.instructions[name].op_name,
            counter.body_flops[name],
            name in counter.expected,
        )
        for name, n in counter.trips.items()
    ]
    return FlopCount(
        flops=round(total),  # a `trips~N` mean may be fractional
        flops_once=once,
        loops=loops,
        # A loop whose body has no matmul leaves the count the same whatever its trips.
        unknown_trip_counts=[lp for lp in loops if lp.trip_count is None and lp.body_flops],
        flop_free_loops=[lp for lp in loops if lp.trip_count is None and not lp.body_flops],
        expected_trip_counts=[lp for lp in loops if lp.expected],
        by_op_name={k: round(v) for k, v in by_op.items()},
        opaque=counter.opaque,
        kernels=list(counter.kernels.values()),
        worst_flops=round(total + worst_extra),
    )
