"""FLOPs of grouped-matmul kernels in a compiled program: custom calls XLA cannot cost.

A grouped-matmul kernel (nn/moe/gmm_kernels.py) covers the M rows of its buffer in row blocks of
b rows; a block computes only where it holds rows of a group, so its work depends on the group
sizes, known at run time only. From the kernel's tiling, read from the program, it is counted as
- `worst`: the most its grid can compute for any group sizes summing to at most M: every group
  boundary can add one partial block, so at most min(G ceil(M/b), ceil(M/b) + G - 1) blocks (G:
  the kernel's groups) — the cost for the *buffer*, labelled worst case wherever it is reported;
- `expected`: for the balanced group sizes the program names (a `rows~R` scope, R rows per group,
  from `tiles.expected_group_rows`): the blocks those groups touch. Kernels whose blocks are
  aligned to multiples of b (Mosaic GPU, megablox) touch cdiv(end, b) - floor(start, b) blocks
  per group; Triton's start at the group's first row (cdiv(rows, b); its weight-gradient kernel
  runs one masked block even for an empty group).
A block costs 2 b K N flops (K: contracted, N: output columns; for the weight gradient, b rows
of the contraction for one [K, N] output).

Recognised (the libraries' own metadata; anything else stays `opaque` in planner/flops.py):
- tokamax: its op and arguments as JSON in the custom call's op_name (`tokamax:{...}`): the
  implementation (Pallas Triton, Mosaic GPU or Mosaic TPU), its config (row block: block_m for
  the forward and input gradient, block_k for the weight gradient; tile_m on TPU), the shapes and
  the dimension numbers;
- megablox (TPU): a `tpu_custom_call` traced under `jit(gmm)` / `jit(tgmm)`, whose first
  operands are its group metadata: the group starts [G + 1], then two tile lists of
  (M / b) + G - 1 entries, which give b.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from expertax import scopes

_MEGABLOX_RE = re.compile(r"jit\((t?gmm)\)")
_TOKAMAX_KINDS = {
    "PallasTritonRaggedDot": "triton",
    "PallasMosaicGpuRaggedDot": "mosaic_gpu",
    "PallasMosaicTpuRaggedDot": "mosaic_tpu",
}


@dataclasses.dataclass(frozen=True)
class GroupedKernel:
    """One grouped-matmul kernel call: what it is and what it costs (one execution)."""

    instruction: str
    library: str  # "tokamax" | "megablox"
    impl: str  # "triton" | "mosaic_gpu" | "mosaic_tpu" | "megablox"
    op: str  # "gmm" (forward, input gradient) | "tgmm" (weight gradient)
    rows: int  # M, the buffer's rows (ragged dimension)
    groups: int  # G
    contracted: int  # K
    columns: int  # N
    block: int  # b, rows per block
    aligned: bool  # blocks at multiples of b (else at each group's first row)
    expected_rows: int | None  # R from the program's `rows~R` scope

    @property
    def worst_flops(self) -> int:
        tiles = math.ceil(self.rows / self.block)
        blocks = min(self.groups * tiles, tiles + self.groups - 1)
        return 2 * blocks * self.block * self.contracted * self.columns

    @property
    def expected_flops(self) -> int | None:
        r, b = self.expected_rows, self.block
        if r is None:
            return None
        if self.aligned:
            blocks = sum(-(-(g + 1) * r // b) - (g * r) // b for g in range(self.groups) if r)
        elif self.impl == "triton" and self.op == "tgmm":
            blocks = self.groups * max(1, -(-r // b))
        else:
            blocks = self.groups * -(-r // b)
        return 2 * blocks * b * self.contracted * self.columns

    @property
    def flops(self) -> int:
        """What the program's count uses: expected where named, else the worst case."""
        expected = self.expected_flops
        return self.worst_flops if expected is None else expected

    def describe(self) -> str:
        return f"{self.library}:{self.impl} {self.op} (row block {self.block})"


def grouped_kernel(name: str, target: str, op_name: str, shape, operand_shapes):
    """The GroupedKernel a custom call is, or None. `shape`: its output dims; `operand_shapes`:
    its operands' dims (as planner/flops.py reads them)."""
    rows = scopes.ROWS.pattern.findall(op_name)
    expected = int(rows[-1]) if rows else None
    at = op_name.find("tokamax:{")
    if at >= 0 and re.search(r"triton|mosaic|tpu_custom_call", target):
        return _tokamax(name, op_name[at + len("tokamax:") :], shape, expected)
    found = _MEGABLOX_RE.findall(op_name)
    if target == "tpu_custom_call" and found:
        return _megablox(name, found[-1], shape, operand_shapes, expected)
    return None


def _tokamax(name: str, text: str, shape, expected: int | None) -> GroupedKernel | None:
    try:
        spec, _ = json.JSONDecoder().raw_decode(text.replace('\\"', '"'))
    except ValueError:
        return None
    op, args = spec.get("op", {}), spec.get("arguments", {})
    impl = _TOKAMAX_KINDS.get(str(op.get("__type", "")).rsplit(".", 1)[-1])
    config = op.get("config") or {}
    try:
        lhs, rhs = _dims(args["lhs"]), _dims(args["rhs"])
        dims = args["ragged_dot_dimension_numbers"]
        (lhs_c, rhs_c), _ = dims["dot_dimension_numbers"]
        rhs_group = dims["rhs_group_dimensions"]
    except (KeyError, TypeError, ValueError):
        return None
    if impl is None:
        return None
    sizes = args.get("group_sizes")
    tgmm = not rhs_group
    if tgmm:  # [M, K] x [M, N] -> [G, K, N], rows contracted per group
        groups = _num_groups(sizes)
        m, k, n = lhs[0], lhs[1], rhs[1]
        if math.prod(shape) != groups * k * n:  # [G, K, N] ([K, N] where XLA drops G = 1)
            return None
        block = config.get("block_k") or config.get("tile_m")
    else:  # [M, K] x [G, ..] -> [M, N]
        groups = rhs[rhs_group[0]]
        m, k = lhs[0], math.prod(lhs[d] for d in lhs_c)
        n = math.prod(s for d, s in enumerate(rhs) if d not in (*rhs_c, *rhs_group))
        if tuple(shape) != (m, n):
            return None
        block = config.get("block_m") or config.get("tile_m")
    if not block:
        return None
    aligned = impl != "triton"
    op_kind = "tgmm" if tgmm else "gmm"
    return GroupedKernel(
        name, "tokamax", impl, op_kind, m, groups, k, n, int(block), aligned, expected
    )


def _megablox(name, op: str, shape, operands, expected: int | None) -> GroupedKernel | None:
    # operands: num_tiles [], group starts [G+1], group ids [T], tile ids [T], offset [1], lhs, rhs
    if len(operands) < 7 or len(operands[1]) != 1 or len(operands[2]) != 1:
        return None
    total_groups, slots = operands[1][0] - 1, operands[2][0]
    lhs, rhs = operands[5], operands[6]
    if op == "gmm":  # lhs [M, K], rhs [X, K, N] (or [X, N, K]), out [M, N]
        m, k, n, groups = lhs[0], lhs[1], shape[1], rhs[0]
    else:  # lhs [K, M] (XLA may pass it as [M, K] with a transposed layout), rhs [M, N]
        m, n, groups, k = rhs[0], rhs[1], shape[0], shape[1]
    tiles = slots - total_groups + 1
    if tiles < 1 or m % tiles:
        return None
    return GroupedKernel(
        name, "megablox", "megablox", op, m, groups, k, n, m // tiles, True, expected
    )


def _num_groups(sizes) -> int:
    """tokamax's group sizes as serialized: {"num_groups": G, ...}, "i32[G]" or a list."""
    if isinstance(sizes, dict):
        return int(sizes["num_groups"])
    if isinstance(sizes, str):
        return _dims(sizes)[0]
    return len(sizes or ())


def _dims(text: str) -> tuple[int, ...]:
    m = re.match(r"\w+\[([\d,\s]*)\]", text)
    if m is None:
        raise ValueError(text)
    return tuple(int(d) for d in m.group(1).split(",") if d.strip())
