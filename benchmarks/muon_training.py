"""Training with Muon against AdamW: deepseek3-tiny, the same synthetic data, each optimizer at
its best learning rate of a small sweep.

Data: `synthetic` (the default stream, learnable to a loss near 0.1: a race to memorise it) or
`corpus` (benchmarks/mtp.py's English corpus, byte-level BPE of 512 tokens; every 10th document
held out and evaluated after the last step: "eval"). Each run is
`expertax train model_name=deepseek3-tiny steps=STEPS opt_type=O learning_rate=LR`
(the schedule's warmup and cosine decay as the defaults; Muon with its defaults:
muon_consistent_rms=0.2, Nesterov, 5 Newton-Schulz steps in float32), one process each on the
devices JAX sees, its losses read from the run's metrics.jsonl. "final" is the mean loss of
the last 20 steps (the synthetic batches differ step to step). For each optimizer the learning
rate with the lowest final loss is its tuned one; the table has every run, and the two tuned
curves are written to --out as one JSON line per step.

Run: python benchmarks/muon_training.py [--data synthetic|corpus] [--steps 300]
     [--adamw-lrs 1e-3,3e-3,1e-2] [--muon-lrs 1e-3,3e-3,1e-2] [--set key=value ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAST = 20


def run(opt: str, lr: float, steps: int, extra: list[str], workdir: Path) -> dict:
    name = f"{opt}-{lr:g}"
    argv = [
        sys.executable,
        "-m",
        "expertax.cli",
        "train",
        "model_name=deepseek3-tiny",
        f"steps={steps}",
        f"opt_type={opt}",
        f"learning_rate={lr}",
        f"base_output_directory={workdir}",
        f"run_name={name}",
        *extra,
    ]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    metrics = workdir / name / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    losses = [float(x["loss"]) for x in lines if "loss" in x]
    final = sum(losses[-LAST:]) / len(losses[-LAST:])
    evals = [float(x["eval_loss"]) for x in lines if "eval_loss" in x]
    return {
        "optimizer": opt,
        "learning_rate": lr,
        "steps": len(losses),
        "first_loss": losses[0],
        "final_loss": final,
        "min_loss": min(losses),
        "eval_loss": evals[-1] if evals else None,
        "wall_s": round(time.perf_counter() - start, 1),
        "losses": losses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=["synthetic", "corpus"], default="synthetic")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--set", nargs="*", default=[], help="more key=value overrides for both")
    ap.add_argument("--out", help="directory for results.jsonl and curves.jsonl")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        extra = list(args.set)
        if args.data == "corpus":
            sys.path.insert(0, os.path.dirname(__file__))
            import mtp  # noqa: PLC0415 - benchmarks/mtp.py's corpus

            train_dir, eval_dir, tok, _ = mtp.write_corpus(Path(tmp))
            extra += [
                "dataset_type=files",
                f"dataset_path={train_dir}",
                f"eval_dataset_path={eval_dir}",
                f"tokenizer_path={tok}",
                f"eval_interval={args.steps}",
                "eval_steps=8",
            ]
        for opt, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
            for lr in (float(x) for x in lrs.split(",")):
                row = run(opt, lr, args.steps, extra, Path(tmp))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    best = {
        opt: min((r for r in rows if r["optimizer"] == opt), key=lambda r: r["final_loss"])
        for opt in ("adamw", "muon")
    }
    print(
        f"\n| optimizer | learning rate | first loss | final loss (last {LAST}) | min | eval "
        "| wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tuned = " (tuned)" if r is best[r["optimizer"]] else ""
        print(
            f"| {r['optimizer']}{tuned} | {r['learning_rate']:g} | {r['first_loss']:.4f} | "
            f"{r['final_loss']:.4f} | {r['min_loss']:.4f} | "
            f"{'-' if r['eval_loss'] is None else format(r['eval_loss'], '.4f')} | {r['wall_s']} |"
        )
    verdict = best["muon"]["final_loss"] <= best["adamw"]["final_loss"]
    print(
        f"\nMuon's tuned final loss {best['muon']['final_loss']:.4f} vs AdamW's "
        f"{best['adamw']['final_loss']:.4f}: {'no worse' if verdict else 'WORSE'}"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({k: v for k, v in r.items() if k != "losses"}) + "\n")
        with open(out / "curves.jsonl", "w") as f:
            a, m = best["adamw"]["losses"], best["muon"]["losses"]
            for i, (x, y) in enumerate(zip(a, m, strict=False)):
                f.write(json.dumps({"step": i, "adamw": x, "muon": y}) + "\n")


if __name__ == "__main__":
    main()
