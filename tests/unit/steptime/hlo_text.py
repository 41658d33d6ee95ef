"""Small hand-written optimized-HLO programs for the step-time tests: what XLA prints, cut to
the lines the estimator reads."""

from __future__ import annotations


def module(entry: list[str], *others: tuple[str, list[str]]) -> str:
    """A scheduled module: `others` (name, instruction lines) first, then the ENTRY."""
    out = ["HloModule jit_step, is_scheduled=true", ""]
    for name, lines in others:
        out += [f"%{name} (p: f32[]) -> f32[] {{", *[f"  {x}" for x in lines], "}", ""]
    out += ["ENTRY %main (a: bf16[1024,1024]) -> bf16[1024,1024] {"]
    out += [f"  {x}" for x in entry]
    out += ["}"]
    return "\n".join(out) + "\n"


PARAM = "%a = bf16[1024,1024]{1,0} parameter(0)"
W = "%w = bf16[1024,1024]{1,0} parameter(1)"


def dot(name: str, lhs: str = "a", rhs: str = "w", n: int = 1024) -> str:
    return (
        f"%{name} = bf16[{n},{n}]{{1,0}} dot(%{lhs}, %{rhs}), lhs_contracting_dims={{1}}, "
        "rhs_contracting_dims={0}"
    )


def all_gather(name: str, operand: str, groups: str, start: bool = False, sync=False) -> str:
    op = "all-gather-start" if start else "all-gather"
    shape = "bf16[8192,1024]{1,0}"
    if start:
        shape = f"(bf16[1024,1024]{{1,0}}, {shape})"
    flag = "true" if sync else "false"
    config = ', backend_config={"collective_backend_config":{"is_sync":' + flag + "}}"
    config = config if start else ""
    return (
        f"%{name} = {shape} {op}(%{operand}), channel_id=1, replica_groups={groups}, "
        f"dimensions={{0}}, use_global_device_ids=true{config}"
    )


def done(name: str, start: str, op: str = "all-gather", shape="bf16[8192,1024]{1,0}") -> str:
    return f"%{name} = {shape} {op}-done(%{start})"
