"""DeepSeek-V3 671B's train step compiled for accelerator targets with the kernels `auto` picks
there, against the CPU-era choices: compiled FLOPs over model FLOPs, and the compiled peak.

For each target, the layout `expertax memory --fit` found (`benchmarks/targets_671b.py`, its
`fit-<target>.json`) is compiled with:
- `before`: `gmm_impl=tiled attention_impl=blockwise` (what `auto` meant on every platform
  before the accelerator kernels: a `while_loop` of per-item dots, XLA's blockwise attention);
- `after`: `gmm_impl=auto attention_impl=auto` (megablox and splash on TPU; tokamax's Triton
  grouped matmul and cuDNN attention where it applies on GPU);
each at the default `remat_policy=full` (one recomputed forward: 4/3 of the step without remat)
and at the policy the fit chose. Compiled FLOPs: the optimized program's matmuls and the
kernels' own (planner/flops.py, planner/kernels.py), each loop body times its trip count, at
balanced routing; model FLOPs: what `expertax train` counts (6 N per token + attention).

Run: PYTHONPATH=src python benchmarks/kernels_671b.py [--targets gpu:h100x256 tpu:v5p-1024]
     [--fits benchmarks/results/targets] [--out benchmarks/results/kernels-671b]
     [--cases before-full after-full after-fit]
Prints one JSON line per compile, then a Markdown table. Compiles only: nothing here is a time.
A TPU compile of this step takes minutes and ~11 GB of host memory: run it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from targets_671b import host_line, kv

GIB = 1024**3
BASE = ["model_name=deepseek3-671b", "max_target_length=4096", "weight_dtype=float32"]
LAYOUT_KEYS = (
    "ici_data_parallelism",
    "ici_expert_parallelism",
    "ici_fsdp_parallelism",
    "ici_tensor_parallelism",
    "sharding_rules",
    "num_moe_token_chunks",
    "num_vocab_tiling",
    "mu_dtype",
    "nu_dtype",
    "optimizer_memory_host_offload",
    "parameter_memory_host_offload",
)
KERNELS = {
    "before": {"gmm_impl": "tiled", "attention_impl": "blockwise"},
    "after": {"gmm_impl": "auto", "attention_impl": "auto"},
}
CASES = ("before-full", "after-full", "before-fit", "after-fit")


def compile_case(target: str, fit: dict, case: str, out: Path) -> dict:
    """`expertax memory` for one case in a fresh process; its JSON report's figures."""
    kernels, remat = case.split("-")
    layout = {k: v for k, v in fit["overrides"].items() if k in LAYOUT_KEYS}
    layout["remat_policy"] = "full" if remat == "full" else fit["overrides"]["remat_policy"]
    name = f"{target.replace(':', '-')}-{case}"
    path = out / f"{name}.json"
    cmd = ["memory", *BASE, *kv({**layout, **KERNELS[kernels]}), "--target", target]
    t0 = time.perf_counter()
    with (out / f"{name}.txt").open("w") as log:
        rc = subprocess.call(
            [sys.executable, "-m", "expertax.cli", *cmd, "--top", "5", "--json", str(path)]
            + ["--overwrite"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    r = json.loads(path.read_text()) if rc == 0 and path.exists() else {}
    flops, model = r.get("compiled_flops"), r.get("model_flops")
    return {
        "target": target,
        "case": case,
        **KERNELS[kernels],
        "remat_policy": layout["remat_policy"],
        "layout": {k: v for k, v in layout.items() if k != "remat_policy"},
        "exit": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_device_bytes": r.get("peak_device_bytes"),
        "hbm_bytes": r.get("hbm_bytes"),
        "compiled_flops": flops,
        "model_flops": model,
        "flops_ratio": None if not (flops and model) else flops / model,
        "compiled_flops_method": r.get("compiled_flops_method"),
        "command": "expertax " + " ".join(cmd),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| target | case | gmm_impl / attention_impl | remat | compiled / model FLOPs | "
        "compiled peak GiB | of HBM | compile s |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "-" if r["flops_ratio"] is None else f"{r['flops_ratio']:.3f}"
        peak = r["peak_device_bytes"]
        hbm = r["hbm_bytes"]
        lines.append(
            f"| {r['target']} | {r['case']} | {r['gmm_impl']} / {r['attention_impl']} "
            f"| {r['remat_policy']} | {ratio} | {'-' if peak is None else f'{peak / GIB:.2f}'} "
            f"| {'-' if not (peak and hbm) else f'{100 * peak / hbm:.1f} %'} | {r['seconds']} |"
            + ("" if r["exit"] == 0 else f" exit {r['exit']}")
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", nargs="+", default=["gpu:h100x256", "tpu:v5p-1024"])
    ap.add_argument("--fits", default="benchmarks/results/targets")
    ap.add_argument("--out", default="benchmarks/results/kernels-671b")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = host_line()
    rows = []
    for target in args.targets:
        fit_path = Path(args.fits) / f"fit-{target.replace(':', '-')}.json"
        fit = json.loads(fit_path.read_text())["fit"]["best"]
        for case in args.cases:
            rows.append(compile_case(target, fit, case, out))
            print(json.dumps(rows[-1]), flush=True)
            tag = "-".join(t.replace(":", "-") for t in args.targets)
            doc = {"host": host, "rows": rows}
            (out / f"results-{tag}.json").write_text(json.dumps(doc, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
