"""Overhead of TensorBoard and the per-layer expert loads on the train step (issue 13).

deepseek3-tiny trained `--steps` steps at log_period=10 on 1 and 8 simulated devices, three
variants run alternately for `--rounds` rounds: `baseline` (the code at `--baseline-src`, a
checkout from before evaluation/TensorBoard/per-layer loads existed; skipped if not given),
`tb_off` (this code, enable_tensorboard=false: per-layer loads still go to metrics.jsonl),
`tb_on` (this code, the default). Median step time of each run over steps >= `--skip`, the
median over rounds, and the ratios to the baseline (or to tb_off).

Run: python benchmarks/observe.py [--baseline-src /path/to/old/src] [--rounds 3] [--steps 120]
Prints JSON lines, then a Markdown table. Measure alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(out: Path, name: str, devices: int, src: str | None, args, extra: list[str]) -> float:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if src:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, "-m", "expertax.cli", "train", "model_name=deepseek3-tiny"]
    cmd += [f"steps={args.steps}", "log_period=10", "enable_checkpointing=false"]
    cmd += [f"ici_fsdp_parallelism={devices}", f"base_output_directory={out}"]
    cmd += [f"run_name={name}", *extra]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out / name / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    return statistics.median(r["step_time_s"] for r in recs[args.skip :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip", type=int, default=5)
    args = ap.parse_args()
    variants = {
        "tb_off": (None, ["enable_tensorboard=false"]),
        "tb_on": (None, ["enable_tensorboard=true"]),
    }
    if args.baseline_src:
        variants = {"baseline": (args.baseline_src, []), **variants}
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (1, 8):
            med: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                for v, (src, extra) in variants.items():
                    t = run(Path(tmp), f"{v}-{devices}-{r}", devices, src, args, extra)
                    med[v].append(t)
                    print(
                        json.dumps(
                            {"devices": devices, "variant": v, "round": r, "median_step_s": t}
                        ),
                        flush=True,
                    )
            rows.append({"devices": devices, **{v: statistics.median(x) for v, x in med.items()}})
    print(f"load average after: {os.getloadavg()}")
    ref = "baseline" if args.baseline_src else "tb_off"
    print(f"\n| devices | {' | '.join(variants)} (median s/step) | tb_on / {ref} |")
    print("|---|" + "---:|" * (len(variants) + 1))
    for r in rows:
        cells = " | ".join(f"{r[v]:.4f}" for v in variants)
        print(f"| {r['devices']} | {cells} | {r['tb_on'] / r[ref]:.3f} |")


if __name__ == "__main__":
    main()
