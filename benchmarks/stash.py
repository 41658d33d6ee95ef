"""Paged stash: step time with and without it, and how often a capacity factor overflows.

1. Step time: `expertax train` of a deepseek3-tiny with 8 MoE layers on 8 simulated devices
   (expert=4 fsdp=2, all-to-all and ring), a remat policy that keeps the routed experts'
   outputs, with `moe_paged_stash` false and true, run alternately (`--rounds`); the median step
   time of each run (steps after the first `--skip`), then the median over rounds and the ratio.
2. Overflow: the same model trained `--overflow-steps` steps with the stash at a capacity factor
   of `--factor`, with the DeepSeek bias-balanced router and with `use_random_routing`: steps in
   which some layer overflowed, overflowing layers in all, and the largest factor a step needed.

Run: python benchmarks/stash.py [--rounds 3] [--steps 40] [--overflow-steps 200]
Prints one JSON line per run, then Markdown tables. Measure alone (a quiet machine).
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

MODEL = [
    "model_name=deepseek3-tiny",
    "base_num_decoder_layers=9",  # 1 dense + 8 MoE layers
    "max_target_length=256",
    "per_device_batch_size=2",
    "remat_policy=custom",
    "decoder_layer_input=device",
    "moe_mlpwi_0=device",
    "moe_mlpwi_1=device",
    "moe_mlpwo=device",
    "ici_expert_parallelism=4",
    "ici_fsdp_parallelism=2",
    "enable_tensorboard=false",
    "log_period=1000",
]


def run(out: Path, name: str, steps: int, extra: list[str]) -> list[dict]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    cmd = [sys.executable, "-m", "expertax.cli", "train", *MODEL, f"steps={steps}"]
    cmd += [f"base_output_directory={out}", f"run_name={name}", *extra]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out / name / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def step_times(args, out: Path) -> list[dict]:
    rows = []
    for strategy in ("a2a", "ring"):
        ring = f"use_ring_of_experts={'true' if strategy == 'ring' else 'false'}"
        medians: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for stash in (False, True):
                name = f"time-{strategy}-{stash}-{r}"
                recs = run(out, name, args.steps, [ring, f"moe_paged_stash={str(stash).lower()}"])
                med = statistics.median(x["step_time_s"] for x in recs[args.skip :])
                medians[stash].append(med)
                print(
                    json.dumps(
                        {
                            "case": "step",
                            "strategy": strategy,
                            "stash": stash,
                            "round": r,
                            "median_step_s": med,
                        }
                    ),
                    flush=True,
                )
        off, on = statistics.median(medians[False]), statistics.median(medians[True])
        rows.append({"strategy": strategy, "off_s": off, "on_s": on, "ratio": on / off})
    return rows


def overflow(args, out: Path) -> list[dict]:
    rows = []
    routings = {"bias-balanced": [], "random": ["use_random_routing=true"]}
    for routing in args.routings.split(","):
        extra = routings[routing]
        name = f"overflow-{routing}"
        extra = [*extra, "moe_paged_stash=true", f"moe_paged_stash_capacity_factor={args.factor}"]
        recs = run(out, name, args.overflow_steps, extra)
        over = [int(x["stash_overflow_layers"]) for x in recs]
        steps_over = [x["step"] for x, o in zip(recs, over, strict=True) if o]
        row = {
            "routing": routing,
            "factor": args.factor,
            "steps": len(recs),
            "steps_with_overflow": len(steps_over),
            "overflowing_layers": sum(over),
            "last_overflow_step": steps_over[-1] if steps_over else None,
            "max_factor_needed": max(x["stash_capacity_factor_needed"] for x in recs),
            "median_factor_needed": statistics.median(
                x["stash_capacity_factor_needed"] for x in recs
            ),
        }
        print(json.dumps({"case": "overflow", **row}), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--overflow-steps", type=int, default=200)
    ap.add_argument("--factor", type=float, default=1.1)
    ap.add_argument("--only", choices=("time", "overflow"), default=None)
    ap.add_argument("--routings", default="bias-balanced,random")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        times = step_times(args, out) if args.only != "overflow" else []
        overs = overflow(args, out) if args.only != "time" else []
    print(f"load average after: {os.getloadavg()}")
    if times:
        print("\n| strategy | stash off (median s/step) | stash on | on / off |")
        print("|---|---:|---:|---:|")
        for r in times:
            print(f"| {r['strategy']} | {r['off_s']:.4f} | {r['on_s']:.4f} | {r['ratio']:.3f} |")
    if overs:
        print(
            "\n| routing | factor | steps | steps with overflow | overflowing layers | "
            "last overflow step | factor needed: median / max |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in overs:
            print(
                f"| {r['routing']} | {r['factor']} | {r['steps']} | {r['steps_with_overflow']} "
                f"| {r['overflowing_layers']} | {r['last_overflow_step']} "
                f"| {r['median_factor_needed']:.3f} / {r['max_factor_needed']:.3f} |"
            )


if __name__ == "__main__":
    main()
