"""The named scopes nn writes into a compiled program for the planner to read back.

XLA keeps `jax.named_scope` names in every instruction's `op_name` metadata; the planner reads a
few of them to count what the program text cannot say: the trips of a loop whose count is known
only on the device (`trips~N`), the balanced rows per group of a grouped-matmul kernel call
(`rows~N`), the idle iterations of a pipeline's loop (`idle~N`), the row tile of the Hopper fp8
kernel (`fp8_tile~N`), and which products are the fp8
GEMMs' forward, input-gradient and weight-gradient ones. Each name is declared here once, with
its writer's label and its reader's pattern side by side, so renaming one cannot silently stop
the planner from finding it; `tests/unit/test_scopes.py` fails when a scope the planner or the
tools read has no writer in nn (or the other way round), or when one is spelled out elsewhere.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Valued:
    """A scope `prefix~N` carrying one number."""

    prefix: str
    number: str = r"\d+"  # the pattern of N

    def label(self, value: object) -> str:
        """The scope's name for `value` (the writer formats it)."""
        return f"{self.prefix}~{value}"

    @property
    def pattern(self) -> re.Pattern[str]:
        """Finds the scope in an op_name; group 1 is N."""
        return re.compile(rf"{self.prefix}~({self.number})")


# a data-dependent loop's expected trip count (nn/attention blockwise kernels, nn/moe/tiles.py;
# planner/flops.py multiplies the loop's body by it)
TRIPS = Valued("trips", r"\d+(?:\.\d+)?")
# the balanced rows per group of a grouped-matmul kernel call (nn/moe/gmm_kernels.py and the fp8
# grouped GEMM; planner/kernels.py and planner/flops.py cost the call at it)
ROWS = Valued("rows")
# a pipeline's loop over its iterations: the S - 1 of them each stage runs idle, the bubble
# (models/pipeline.py; steptime/simulate.py reports the loop's idle iterations apart)
IDLE = Valued("idle")
# the Hopper fp8 kernel's row tile (its kernel module; planner/flops.py)
FP8_TILE = Valued("fp8_tile")
# the fp8 GEMMs' three products: forward, input gradient, weight gradient
PRODUCTS = ("fprop", "dgrad", "wgrad")
# the dense fp8 GEMM's scopes (fp8/compiled.py, planner/flops.py), one per product
FP8_DENSE = tuple(f"fp8_{p}" for p in PRODUCTS)
# the routed experts' fp8 grouped GEMM's, in the same order
FP8_GROUPED = tuple(f"fp8_gmm_{p}" for p in PRODUCTS)
_FP8_PRODUCT = re.compile("|".join(rf"\b{s}\b" for s in FP8_DENSE + FP8_GROUPED))


def fp8_product(op_name: str) -> str | None:
    """Which product ("fprop", "dgrad" or "wgrad") of an fp8 GEMM `op_name` lies under, if any."""
    found = _FP8_PRODUCT.search(op_name)
    return found.group(0).rsplit("_", 1)[1] if found else None
