"""The step-time model's collective times against published measurements (no accelerator: each
case is one collective written as the HLO XLA prints, timed by `expertax.steptime` on the
target's placement, and compared as the source reports it: nccl-tests' bus bandwidth, or a
time).

nccl-tests' bus bandwidth (doc/PERFORMANCE.md): busbw = S / t x factor, S = the full buffer for
all-reduce (factor 2(n-1)/n), the whole gathered output for all-gather and the whole input for
reduce-scatter ((n-1)/n), the send buffer per rank for all-to-all ((n-1)/n).

    python benchmarks/steptime_collectives.py [--json benchmarks/results/steptime/collectives.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from expertax import targets
from expertax.planner.hlo import parse_hlo
from expertax.steptime import collectives, topology

GB = 1e9


# (name, target, kind, group, bytes per device (nccl-tests' S), published, unit, source). The
# first three and the 128 KB one set constants (links.py: NVLink's achieved share, NVLink SHARP's
# rate, the TPU latency): they check the arithmetic; the others are held out.
SET_FROM = {0, 1, 2, 7}
CASES = [
    ("8 x H100 all-reduce (NVLink SHARP), 8 GiB", "gpu:h100x8", "all-reduce", "[1,8]<=[8]",
     8 * 2**30, 479.72, "busbw GB/s",
     "Voltage Park / GA Tech nccl-tests run: 479.72 GB/s at 8 GiB; nccl-tests#212: ~480"),
    ("8 x H100 all-gather, large", "gpu:h100x8", "all-gather", "[1,8]<=[8]",
     4 * 2**30, 370.0, "busbw GB/s",
     "nccl-tests#212 (maintainer): non-all-reduce collectives reach ~370 GB/s busbw on 8 H100"),
    ("8 x H100 reduce-scatter, large", "gpu:h100x8", "reduce-scatter", "[1,8]<=[8]",
     4 * 2**30, 370.0, "busbw GB/s", "nccl-tests#212 (maintainer), as above"),
    ("4 x H100 all-to-all, 500 MB", "gpu:h100x4", "all-to-all", "[1,4]<=[4]",
     524288000, 334.90, "busbw GB/s", "NVIDIA/nccl#2169: alltoall_perf 4 GPUs, 524288000 B"),
    ("32 x H100 (4 nodes) all-reduce", "gpu:h100x32", "all-reduce", "[1,32]<=[32]",
     8 * 2**30, 330.93, "busbw GB/s",
     "Voltage Park / GA Tech nccl-tests, 4 nodes x 8 H100, 3.2 Tb/s IB per node"),
    ("32 x H100 (4 nodes) all-gather", "gpu:h100x32", "all-gather", "[1,32]<=[32]",
     8 * 2**30, 323.53, "busbw GB/s", "Voltage Park / GA Tech nccl-tests, as above"),
    ("v5e 4x8, all-gather over 4 chips, 34 MB", "tpu:v5e-32", "all-gather", "[8,4]<=[32]",
     2048 * 8192 * 2, 680e-6, "seconds",
     "scaling book, 'Sharding', pop quiz 2: a profile of AllGather_Y on mesh {X: 8, Y: 4}, 680 us"),
    ("v5e 4x8, all-gather over 4 chips, 128 KB", "tpu:v5e-32", "all-gather",
     "[8,4]<=[32]", 256 * 256 * 2, 8e-6, "seconds",
     "scaling book, same quiz: E = F = 256, 'in practice, it's closer to 8us'"),
]  # fmt: skip


def _hlo(kind: str, groups: str, nbytes: int, n: int) -> str:
    """One collective of bf16 arrays whose nccl-tests size is `nbytes`."""
    elems = nbytes // 2
    per = {"all-gather": elems // n, "reduce-scatter": elems, "all-reduce": elems}.get(kind, elems)
    out = {"all-gather": elems, "reduce-scatter": elems // n}.get(kind, per)
    extra = ", to_apply=%add" if kind in ("all-reduce", "reduce-scatter") else ""
    dims = ", dimensions={0}" if kind != "all-reduce" else ""
    return (
        "HloModule bench, is_scheduled=true\n\nENTRY %main (a: bf16[1]) -> bf16[1] {\n"
        f"  %a = bf16[{per}]{{0}} parameter(0)\n"
        f"  %c = bf16[{out}]{{0}} {kind}(%a), channel_id=1, replica_groups={groups}{dims}"
        f", use_global_device_ids=true{extra}\n}}\n"
    )


def _factor(kind: str, n: int) -> float:
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


def run() -> list[dict]:
    rows = []
    for i, (name, spec, kind, groups, nbytes, published, unit, source) in enumerate(CASES):
        t = targets.parse_target(spec)
        p = topology.default_placement(t)
        m = parse_hlo(_hlo(kind, groups, nbytes, _n(groups)))
        ins = m.instructions["c"]
        c = collectives.collective(m, ins, p)
        n = c.group_size
        predicted = nbytes / c.seconds * _factor(kind, n) / GB if unit != "seconds" else c.seconds
        rows.append(
            {
                "case": name,
                "target": spec,
                "kind": kind,
                "group": n,
                "span": c.span,
                "model": c.model,
                "bytes": nbytes,
                "predicted": predicted,
                "published": published,
                "unit": unit,
                "error": predicted / published - 1,
                "role": "sets a constant" if i in SET_FROM else "held out",
                "source": source,
            }
        )
    return rows


def _n(groups: str) -> int:
    return int(groups.split(",")[1].split("]")[0])


def table(rows: list[dict]) -> str:
    lines = [
        f"| {'case':<44} | {'spans':<18} | {'predicted':>10} | {'published':>10} | unit | error "
        "| role |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        fmt = (lambda v: f"{v * 1e6:.1f} us") if r["unit"] == "seconds" else (lambda v: f"{v:.1f}")
        unit = "time" if r["unit"] == "seconds" else "busbw GB/s"
        lines.append(
            f"| {r['case']:<44} | {r['span']:<18} | {fmt(r['predicted']):>10} | "
            f"{fmt(r['published']):>10} | {unit} | {100 * r['error']:+.1f}% | {r['role']} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="append the rows as JSON lines to this file")
    args = ap.parse_args()
    rows = run()
    for r in rows:
        print(json.dumps(r))
    print(table(rows))
    held = [abs(r["error"]) for r in rows if r["role"] == "held out"]
    print(f"largest error of the held-out cases {100 * max(held):.1f}% (target: within 15%)")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
