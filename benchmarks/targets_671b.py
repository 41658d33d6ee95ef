"""DeepSeek-V3 671B for real accelerators, compiled on this machine: `expertax memory --fit
--target T` for each target (dropless, float32 master weights, 4096 tokens per sequence), then,
beside each layout found, the same layout's CPU plan (`--target cpu --devices N`: the XLA:CPU
proxy every figure came from before targets existed), and on TPU the layout with optimizer and
parameter host offload (device bytes saved, host bytes used).

Run: PYTHONPATH=src python benchmarks/targets_671b.py [--targets tpu:v5p-1024 gpu:h100x256
     gpu:h200x128] [--out benchmarks/results/targets] [--skip-cpu] [--skip-offload]
     [--extra key=value ...]
Prints one JSON line per measurement, then Markdown tables. Compiles only: no figure is a time of
the step; the wall times are those of the search on this machine (measure on a quiet one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
BASE = ["model_name=deepseek3-671b", "max_target_length=4096", "weight_dtype=float32"]
DEVICES = {"tpu:v5p-1024": 512, "gpu:h100x256": 256, "gpu:h200x128": 128}
LAYOUT_KEYS = (
    "ici_expert_parallelism",
    "ici_fsdp_parallelism",
    "ici_tensor_parallelism",
    "sharding_rules",
    "remat_policy",
    "num_moe_token_chunks",
    "num_vocab_tiling",
    "attention_impl",
    "mu_dtype",
    "nu_dtype",
    "optimizer_memory_host_offload",
    "parameter_memory_host_offload",
)


def run(args: list[str], log: Path) -> tuple[int, float]:
    """`expertax <args>` in a fresh process; (exit status, wall seconds); output to `log`."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "expertax.cli", *args], stdout=f, stderr=subprocess.STDOUT
        )
    return rc, time.perf_counter() - t0


def host_line() -> dict:
    """The host's description, printed as the first JSON line."""
    host = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps({"host": host}), flush=True)
    return host


def kv(overrides: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]


def emit(record: dict, rows: list[dict]) -> None:
    print(json.dumps(record), flush=True)
    rows.append(record)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", nargs="+", default=list(DEVICES))
    ap.add_argument("--out", default="benchmarks/results/targets")
    ap.add_argument("--skip-cpu", action="store_true", help="no CPU plan beside each layout")
    ap.add_argument("--skip-offload", action="store_true", help="no TPU host-offload rows")
    ap.add_argument(
        "--reuse-fit",
        action="store_true",
        help="take the fit from an earlier run's fit-<target>.json (its wall time included)",
    )
    ap.add_argument(
        "--extra", nargs="*", default=[], help="more key=value overrides (e.g. mtp_num_layers=1)"
    )
    args = ap.parse_args(argv)
    BASE.extend(args.extra)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = host_line()
    rows: list[dict] = []
    for target in args.targets:
        name = target.replace(":", "-")
        path = out / f"fit-{name}.json"
        if args.reuse_fit and path.exists():
            rc, wall = 0, json.loads(path.read_text())["fit"]["seconds"]
        else:
            rc, wall = run(
                ["memory", *BASE, "--target", target, "--fit", "--json", str(path), "--overwrite"],
                out / f"fit-{name}.txt",
            )
        fit = json.loads(path.read_text())["fit"] if path.exists() else {}
        best = fit.get("best") or {}
        emit(
            {
                "kind": "fit",
                "target": target,
                "fits": fit.get("fits"),
                "exit": rc,
                "seconds": round(wall, 1),
                "compiled": fit.get("compiled"),
                "searched": fit.get("searched"),
                "hbm_gib": fit.get("hbm_gib"),
                "peak_device_bytes": best.get("peak_device_bytes"),
                "headroom_percent": None
                if not best.get("peak_device_bytes")
                else 100 * (1 - best["peak_device_bytes"] / (fit["hbm_gib"] * GIB)),
                "compiled_flops": best.get("compiled_flops"),
                "model_flops": best.get("model_flops"),
                "roofline_seconds": best.get("roofline_seconds"),
                "mfu_bound": best.get("mfu_bound"),
                "overrides": best.get("overrides"),
                "train_line": fit.get("train_line"),
            },
            rows,
        )
        layout = {k: v for k, v in (best.get("overrides") or {}).items() if k in LAYOUT_KEYS}
        if not layout:
            continue
        if not args.skip_cpu:
            cpu_path = out / f"cpu-plan-{name}.json"
            cmd = ["memory", *BASE, *kv(layout), "--devices", str(DEVICES[target]), "--top", "0"]
            rc, wall = run([*cmd, "--json", str(cpu_path)], out / f"cpu-plan-{name}.txt")
            r = json.loads(cpu_path.read_text()) if cpu_path.exists() else {}
            emit(
                {
                    "kind": "cpu-plan",
                    "target": target,
                    "exit": rc,
                    "seconds": round(wall, 1),
                    "peak_device_bytes": r.get("peak_device_bytes"),
                    "xla": r.get("xla"),
                    "compiled_flops": r.get("compiled_flops"),
                },
                rows,
            )
        if target.startswith("tpu") and not args.skip_offload:
            for label, extra in (
                (
                    "no-offload",
                    {
                        "optimizer_memory_host_offload": False,
                        "parameter_memory_host_offload": False,
                    },
                ),
                (
                    "opt-offload",
                    {"optimizer_memory_host_offload": True, "parameter_memory_host_offload": False},
                ),
                (
                    "opt+params-offload",
                    {"optimizer_memory_host_offload": True, "parameter_memory_host_offload": True},
                ),
            ):
                p = out / f"offload-{name}-{label}.json"
                cmd = ["memory", *BASE, *kv({**layout, **extra}), "--target", target, "--top", "0"]
                rc, wall = run([*cmd, "--json", str(p)], out / f"offload-{name}-{label}.txt")
                r = json.loads(p.read_text()) if p.exists() else {}
                emit(
                    {
                        "kind": "offload",
                        "target": target,
                        "case": label,
                        "exit": rc,
                        "seconds": round(wall, 1),
                        "peak_device_bytes": r.get("peak_device_bytes"),
                        "host_bytes": r.get("host_bytes"),
                        "xla": r.get("xla"),
                    },
                    rows,
                )
    tag = "-".join(t.replace(":", "-") for t in args.targets)
    (out / f"results-{tag}.json").write_text(json.dumps({"host": host, "rows": rows}, indent=1))
    print(table(rows))
    return 0


def _g(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| target | fits | layout | peak GiB | headroom | compiled / model FLOPs | "
        "roofline (est.) | MFU bound (est.) | --fit wall s | compiles |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] != "fit":
            continue
        o = r["overrides"] or {}
        layout = (
            f"e{o.get('ici_expert_parallelism')} f{o.get('ici_fsdp_parallelism')} "
            f"t{o.get('ici_tensor_parallelism')} {o.get('remat_policy')} "
            f"chunks={o.get('num_moe_token_chunks')} tiles={o.get('num_vocab_tiling')}"
            + (" bf16-moments" if o.get("mu_dtype") == "bfloat16" else "")
            + (" opt-offload" if o.get("optimizer_memory_host_offload") else "")
            + (" param-offload" if o.get("parameter_memory_host_offload") else "")
        )
        ratio = (
            "-"
            if not (r["compiled_flops"] and r["model_flops"])
            else f"{r['compiled_flops'] / r['model_flops']:.2f}"
        )
        roof = "-" if r["roofline_seconds"] is None else f"{r['roofline_seconds']:.2f} s"
        mfu = "-" if r["mfu_bound"] is None else f"{100 * r['mfu_bound']:.1f}%"
        room = "-" if r["headroom_percent"] is None else f"{r['headroom_percent']:.1f}%"
        lines.append(
            f"| {r['target']} | {r['fits']} | {layout} | {_g(r['peak_device_bytes'])} | {room} "
            f"| {ratio} | {roof} | {mfu} | {r['seconds']} | {r['compiled']} |"
        )
    cpu = [r for r in rows if r["kind"] == "cpu-plan"]
    if cpu:
        lines += [
            "",
            "| target | compiled peak GiB | CPU plan peak GiB | CPU - target GiB |",
            "|---|---|---|---|",
        ]
        fits = {r["target"]: r for r in rows if r["kind"] == "fit"}
        for r in cpu:
            a, b = fits[r["target"]]["peak_device_bytes"], r["peak_device_bytes"]
            diff = "-" if a is None or b is None else f"{(b - a) / GIB:+.2f}"
            lines.append(f"| {r['target']} | {_g(a)} | {_g(b)} | {diff} |")
    off = [r for r in rows if r["kind"] == "offload"]
    if off:
        lines += ["", "| target | case | device peak GiB | host GiB |", "|---|---|---|---|"]
        lines += [
            f"| {r['target']} | {r['case']} | {_g(r['peak_device_bytes'])} | "
            f"{_g(r['host_bytes'])} |"
            for r in off
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
