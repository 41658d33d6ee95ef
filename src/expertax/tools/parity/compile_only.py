"""`expertax parity --compile-only [--target T]`: every layout of the parity matrix compiled for a
target, nothing run.

The layouts are the parity table's (`layouts.default_layouts` for the target's platform: the sparse
dispatches, ring and dense on each mesh, the paged stash, expert-as-TP rules, the pipelines; or
`--layouts`), each built with `layouts.layout_config` and compiled by `build_trainer(c,
devices).compile()` for the target's devices: `cpu` (this machine's CPU devices; the command
simulates 8), a TPU slice or GPUs (`expertax.targets`, compile-only devices). A row per layout:
- compiles: yes, the compiler's first line of error, or "does not fit" (the compiler refused
  the program for the chip's memory); the config checks' refusals are listed as in `parity`;
- the compiled peak per device (`plan.xla_figures` + `plan.device_peak`);
- compiled / model FLOPs (`planner.costs.step_costs`; "-" where the count is unavailable);
- a2a: the MoE exchange found in the program: `ragged` (the native `ragged-all-to-all`),
  `padded` (the stand-in of nn/moe/exchange.py: `all-to-all` of padded per-peer blocks in
  rounds, found by the call stack of its all-to-all), both, or `-`; a row fails where it differs
  from the exchange the layout asks for (`expected_exchange`: `a2a_impl=auto` is `ragged` on TPU
  and GPU, `padded` on CPU; none for ring, dense or a single expert shard);
- the collectives of the program text (instructions, not executions: a loop body's count once)
  and its kernels: custom-call targets (cuBLAS, cuDNN, Pallas/Mosaic, ...) and the GPU
  compiler's kernel fusions (Triton GEMMs, custom fusions), XLA's bookkeeping calls left out.
The table is ok when every layout compiled with the exchange it asks for and, unless refusals
are skipped (`--skip-refused`), none was refused (by the config checks or for memory).
"""

from __future__ import annotations

import collections
import math
import os
import re
import time

import jax

from expertax import jsonio, platform, progress
from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.nn.moe.strategy import resolve_a2a_impl
from expertax.parallel import remat
from expertax.planner import hlo, plan
from expertax.planner.costs import step_costs
from expertax.tools.parity import layouts
from expertax.train.trainer import build_trainer

# Collective opcodes (an async `-start` counts as its op, the `-done` not) and their short names.
COLLECTIVES = {
    "ragged-all-to-all": "ragged-a2a",
    "all-to-all": "a2a",
    "all-gather": "ag",
    "reduce-scatter": "rs",
    "all-reduce": "ar",
    "collective-permute": "cp",
}
# The functions of nn/moe/exchange.py whose all-to-all is the padded exchange.
PADDED_FUNCTIONS = frozenset(
    {"padded_all_to_all", "_padded", "_padded_fwd", "_padded_bwd", "_exchange_rounds", "one_round"}
)
EXCHANGE_FILE = os.path.join("nn", "moe", "exchange.py")
# Custom calls that are XLA's bookkeeping (buffers, index hints, async markers, sharding and
# host-transfer annotations), not kernels.
NOT_KERNELS = frozenset(
    {
        "AllocateBuffer",
        "AssumeGatherIndicesInBound",
        "GatherScatterIndicesBitpacked",
        "PrepareAsyncCallStart",
        "PrepareAsyncCallDone",
        "MoveToHost",
        "MoveToDevice",
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "LayoutConstraint",
        "PadToStatic",
        "SliceToDynamic",
    }
)
KERNEL_NAMES = {
    "__cublas$gemm": "cublas",
    "__cublas$lt$matmul": "cublasLt",
    "__cublas$lt$matmul$f8": "cublasLt-f8",
    "__triton_gemm": "triton-gemm",
    "__triton_nested_gemm_fusion": "triton-gemm",
    "__triton": "triton",
    "tpu_custom_call": "pallas",
    "__gpu$xla.gpu.triton": "pallas-triton",
    "__ynn_fusion": "ynnpack",  # XLA:CPU's dot fusions
    "__onednn$matmul": "onednn",
}
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_KIND_RE = re.compile(r'"kind":"(__[\w$.]+)"')
_CUSTOM_FUSION_RE = re.compile(r'"custom_fusion_config":\{"name":"([\w$.]+)"')


def _kernel_name(name: str) -> str:
    if name in KERNEL_NAMES:
        return KERNEL_NAMES[name]
    if name.startswith("__cudnn$"):
        return "cudnn:" + name.removeprefix("__cudnn$")
    return name.removeprefix("__")


_GROUPS_RE = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")


def group_size(attrs: str) -> int | None:
    """Devices per group of a collective's `replica_groups`, in the three spellings of XLA
    (`{{0,1},{2,3}}`, `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}`, `[4,2]<=[8]`); None when all
    devices form one group or the attribute is absent."""
    if m := _GROUPS_RE.search(attrs):
        return len(m.group(1).strip("{}").split(","))
    if m := _MESH_GROUPS_RE.search(attrs):
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'(\w+)'", m.group(2)))
    if m := _IOTA_GROUPS_RE.search(attrs):
        return int(m.group(1))
    return None


def _padded(module: hlo.Module, ins: hlo.Instruction) -> bool:
    return any(
        f.file.endswith(EXCHANGE_FILE) and f.function in PADDED_FUNCTIONS
        for f in hlo.call_stack(module, ins.frame)
    )


def program_summary(text: str) -> dict:
    """The collectives, the padded exchange's all-to-alls and the kernels of an optimized-HLO
    text (`compiled.as_text()`): {"collectives": {op: n}, "padded_exchange": n,
    "kernels": {name: n}}, counts of instructions."""
    module = hlo.parse_hlo(text)
    ops: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    padded = own = 0
    for ins in module.instructions.values():
        op = ins.opcode.removesuffix("-start")
        if op in COLLECTIVES and not ins.opcode.endswith("-done"):
            ops[op] += 1
            if op == "all-to-all" and _padded(module, ins):
                padded += 1
            if op == "ragged-all-to-all" and group_size(ins.attrs) == 1:
                own += 1
        elif ins.opcode == "custom-call" and (m := _TARGET_RE.search(ins.attrs)):
            if m.group(1) not in NOT_KERNELS:
                kernels[_kernel_name(m.group(1))] += 1
        elif ins.opcode == "fusion" and (m := _KIND_RE.search(ins.attrs)):
            custom = _CUSTOM_FUSION_RE.search(ins.attrs)
            kernels[custom.group(1) if custom else _kernel_name(m.group(1))] += 1
    return {
        "collectives": {op: ops[op] for op in COLLECTIVES if ops[op]},
        "padded_exchange": padded,
        "ragged_within_one_device": own,
        "kernels": dict(kernels.most_common()),
    }


def exchange_found(summary: dict) -> str:
    """`ragged`, `padded`, `ragged+padded` or `-`: the MoE exchange between devices in the
    program (ragged all-to-alls whose groups are single devices are not an exchange)."""
    ragged = summary["collectives"].get("ragged-all-to-all", 0)
    ragged -= summary.get("ragged_within_one_device", 0)
    found = [name for name, n in (("ragged", ragged), ("padded", summary["padded_exchange"])) if n]
    return "+".join(found) or "-"


def expected_exchange(c: Config, on: str, ep: int) -> str:
    """The exchange `c` asks for on platform `on` with `ep` expert shards (`-`: none)."""
    if not (c.is_moe and c.sparse_matmul and ep > 1 and not c.use_ring_of_experts):
        return "-"
    return resolve_a2a_impl(c, on)


def first_line(error: Exception) -> str:
    """The error's first line, without MLIR's location prefix (`<unknown>:0: error: `)."""
    line = next((ln for ln in str(error).splitlines() if ln.strip()), repr(error))
    return re.sub(r"<[^>]*>:\d+: error: ", "", line).strip().rstrip(":")


def compile_layout(
    base: Config, layout: layouts.Layout, devices: list, *, global_batch: int, target=None
) -> dict:
    """Compile `base` under `layout` for the first `layout.num_devices` of `devices`; its row.
    Raises ConfigError when the config checks refuse the layout (nothing compiled)."""
    c = layouts.layout_config(base, layout, global_batch)
    trainer = build_trainer(c, devices=list(devices)[: layout.num_devices])
    on = platform.of_mesh(trainer.mesh)
    expected = expected_exchange(c, on, int(trainer.mesh.shape.get("expert", 1)))
    row: dict = {"layout": layout.name, "status": "yes", "error": None, "a2a_expected": expected}
    t0 = time.perf_counter()
    try:
        compiled = trainer.compile()
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the row's result
        why = plan.refused_for_memory(e)
        row["status"] = "does not fit" if why else "error"
        row["error"] = why or first_line(e)
        row.update(seconds=round(time.perf_counter() - t0, 1), ok=False)
        return row
    row["seconds"] = round(time.perf_counter() - t0, 1)
    xla = plan.xla_figures(compiled)
    offloads = remat.OFFLOAD in remat.config_placements(c).values()
    residuals = plan.layer_residuals(c, trainer)[0] if offloads else ()
    on = platform.of_mesh(trainer.mesh)
    row["peak_device_bytes"] = plan.device_peak(c, trainer.abstract_state(), xla, residuals, on)[0]
    try:
        costs = step_costs(compiled, c, trainer, target)
    except Exception as e:  # noqa: BLE001 - an informational column: say why it is missing
        costs = {"compiled_flops_method": f"unavailable: {type(e).__name__}: {e}"[:200]}
    row.update({k: costs.get(k) for k in ("compiled_flops", "model_flops", "flops_ratio")})
    row["flops_method"] = costs.get("compiled_flops_method")
    summary = program_summary(compiled.as_text())
    row.update(summary, a2a=exchange_found(summary))
    row["ok"] = row["a2a"] == expected
    return row


def target_devices(target) -> list:
    """The devices a target compiles for (compile-only ones for TPU and GPU targets)."""
    return list(jax.devices() if target is None or target.is_cpu else target.devices())


def compile_table(
    base: Config,
    *,
    target=None,
    layout_list: list[layouts.Layout] | None = None,
    skip_refused: bool = False,
    echo=print,
) -> dict:
    """Compile every layout (default: the parity matrix for the target's platform and devices).

    Returns {"target", "platform", "devices", "rows", "refused", "skipped", "skip_refused",
    "ok"}: `rows` for the layouts compiled (or that the compiler refused), `refused` and
    `skipped` as `run.parity_table`'s. The global batch is per_device_batch_size x the
    devices of the largest layout (the default matrix's 8), as `parity` sets it on 8 devices.
    """
    devices = target_devices(target)
    on = platform.of_devices(devices)
    skipped = []
    if layout_list is None:
        layout_list = []
        for layout in layouts.default_layouts(len(devices), on):
            misfit = layouts.pipeline_misfit(base, layout)
            if misfit is None:
                layout_list.append(layout)
            else:
                skipped.append({"layout": layout.name, "reason": misfit})
                echo(f"skipped {layout.name}: {misfit}")
    largest = max((layout.num_devices for layout in layout_list), default=1)
    global_batch = int(base.per_device_batch_size * min(largest, len(devices)))
    rows, refused = [], []
    bar = progress.bar(len(layout_list), "parity --compile-only", unit="layout")
    say = progress.say_above(bar, echo)
    for layout in layout_list:
        bar.set_postfix_str(layout.name)
        try:
            row = compile_layout(base, layout, devices, global_batch=global_batch, target=target)
        except ConfigError as e:
            refused.append({"layout": layout.name, "reason": str(e)})
            say(f"{'skipped' if skip_refused else 'REFUSED'} {layout.name}: {e}")
        else:
            rows.append(row)
            say(format_row(row))
        bar.update(1)
    bar.close()
    too_big = any(r["status"] == "does not fit" for r in rows)
    failed = any(not r["ok"] and r["status"] != "does not fit" for r in rows)
    ok = bool(rows) and not failed and (skip_refused or not (refused or too_big))
    return {
        "target": "cpu" if target is None else target.spec,
        "target_description": "cpu" if target is None else target.describe(),
        "platform": on,
        "devices": len(devices),
        "model_name": base.model_name,
        "rows": rows,
        "refused": refused,
        "skipped": skipped,
        "skip_refused": skip_refused,
        "ok": ok,
    }


HEADER = ("layout", "compiles", "peak/device", "flops ratio", "a2a", "collectives", "kernels", "s")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _counts(counts: dict, names: dict | None = None, top: int = 4) -> str:
    items = list(counts.items())
    cells = [f"{(names or {}).get(k, k)} {n}" for k, n in items[:top]]
    more = len(items) - top
    return ", ".join(cells + ([f"+{more} more"] if more > 0 else [])) or "-"


def format_row(r: dict) -> str:
    if r["status"] != "yes":
        error = r["error"] if len(r["error"]) <= 200 else r["error"][:197] + "..."
        cells = [r["layout"], f"NO ({r['status']}: {error})", *["-"] * 5, r["seconds"]]
        return "| " + " | ".join(str(x).replace("|", "/") for x in cells) + " |"
    a2a = r["a2a"]
    if a2a != r["a2a_expected"]:
        a2a += f" (expected {r['a2a_expected']}) FAIL"
    if r.get("ragged_within_one_device"):
        a2a += f" ({r['ragged_within_one_device']} ragged-a2a in 1-device groups)"
    cells = [
        r["layout"],
        "yes",
        _mib(r["peak_device_bytes"]),
        "-" if r["flops_ratio"] is None else f"{r['flops_ratio']:.2f}",
        a2a,
        _counts(r["collectives"], COLLECTIVES, top=len(COLLECTIVES)),
        _counts(r["kernels"]),
        r["seconds"],
    ]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def format_table(result: dict) -> str:
    on = result["target_description"]
    if result["target"] == "cpu":
        on = f"{result['devices']} {result['platform']} devices"
    lines = [
        f"expertax parity --compile-only: {result['model_name']} for {on}, nothing run",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += [format_row(r) for r in result["rows"]]
    for r in result["refused"]:
        word = "skipped" if result["skip_refused"] else "NO"
        cells = [r["layout"], f"{word} (refused: {r['reason']})", *["-"] * 6]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    for r in result["skipped"]:
        cells = [r["layout"], f"skipped (model: {r['reason']})", *["-"] * 6]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    legend = ", ".join(f"{short} = {op}" for op, short in COLLECTIVES.items())
    lines.append(f"collectives: instructions in the program text ({legend})")
    methods = {str(r.get("flops_method")) for r in result["rows"] if r["status"] == "yes"}
    missing = sorted(m for m in methods if m.startswith("unavailable"))
    if missing:
        lines.append(f"flops ratio (compiled / model FLOPs): {missing[0]}")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        jsonio.dump(result, f, indent=1)
