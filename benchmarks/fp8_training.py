"""fp8 training against bfloat16: the same model, seed and data trained with each fp8 recipe
(`quantization`) and without, on this machine's CPU (the recipe's numerics exactly; no time).

Each run is `expertax train` with `dtype=bfloat16` (float32 master weights), synthetic data
with an entropy floor (`synthetic_noise`: a share of the targets replaced by uniform random
tokens, so the loss settles near the mixture's entropy, the `loss_floor` column, instead of
being memorized towards 0, where any two runs differ by a large fraction of it) and the model's
preset otherwise; its per-step metrics (metrics.jsonl) give, against the bfloat16 run: the mean
of |loss_fp8 - loss_bf16| / loss_bf16 over the last 50 steps (and of |loss_fp8 - loss_bf16|),
the number of non-finite steps, and the mean ratio of the gradient norms over all steps (and
its range over the last 50). A float32 run of the same model (no quantization) against the
bfloat16 one is the comparison's noise floor: how far two runs drift when only the products'
rounding differs.

Run: python benchmarks/fp8_training.py [--models deepseek3-tiny mixtral-tiny] [--steps 300]
       [--noise 0.3] [--out DIR] [--json PATH]
Prints a JSON line per (model, recipe), then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from expertax.data.synthetic import loss_floor
from expertax.preflight import load_config

RECIPES = ("", "fp8_tensorwise", "fp8_blockwise")
# the same model in float32 (no quantization) against bfloat16: how far two runs drift apart when
# only the rounding of the products differs (the noise floor of the comparison)
FLOAT32 = "float32"


def run(model: str, recipe: str, steps: int, noise: float, out: str) -> list[dict]:
    """The run's metrics (reused when `out` holds a finished run of the same name)."""
    name = f"{model}-{recipe or 'bf16'}-noise{noise}"
    path = os.path.join(out, name, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            done = [json.loads(line) for line in f if line.strip()]
        if len(done) == steps:
            return done
    dtype, quantization = ("float32", "") if recipe == FLOAT32 else ("bfloat16", recipe)
    cmd = [
        sys.executable, "-m", "expertax.cli", "train", f"model_name={model}", f"steps={steps}",
        f"dtype={dtype}", f"quantization={quantization}", f"run_name={name}",
        f"base_output_directory={out}", "checkpoint_period=100000", "log_period=100",
        f"synthetic_noise={noise}",
    ]  # fmt: skip
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(base: list[dict], other: list[dict], last: int = 50) -> dict:
    lb = np.array([m["loss"] for m in base])
    lo = np.array([m["loss"] for m in other])
    gb = np.array([m["grad_norm"] for m in base])
    go = np.array([m["grad_norm"] for m in other])
    ratio = go / gb
    return {
        "steps": len(lo),
        "rel_dloss_last": float(np.mean(np.abs(lo[-last:] - lb[-last:]) / lb[-last:])),
        "abs_dloss_last": float(np.mean(np.abs(lo[-last:] - lb[-last:]))),
        "nonfinite_steps": int(np.sum(~np.isfinite(lo)) + sum(m["nonfinite"] > 0 for m in other)),
        "grad_norm_ratio_mean": float(np.mean(ratio)),
        "grad_norm_ratio_min_last": float(np.min(ratio[-last:])),
        "grad_norm_ratio_max_last": float(np.max(ratio[-last:])),
        "loss_first": float(lo[0]),
        "loss_last50": float(np.mean(lo[-last:])),
        "bf16_loss_last50": float(np.mean(lb[-last:])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["deepseek3-tiny", "mixtral-tiny"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--noise", type=float, default=0.3, help="synthetic_noise of every run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="fp8-training-")
    rows = []
    for model in args.models:
        vocab = load_config(overrides={"model_name": model}).vocab_size
        base = run(model, "", args.steps, args.noise, out)
        for recipe in (*RECIPES[1:], FLOAT32):
            row = {
                "model": model,
                "recipe": recipe,
                "synthetic_noise": args.noise,
                "loss_floor": loss_floor(args.noise, vocab),
                **compare(base, run(model, recipe, args.steps, args.noise, out)),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print()
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """The Markdown table of `rows` (BENCHMARKS.md's)."""
    print(
        "| model | noise p (loss floor) | against bf16 | mean abs dloss / loss, last 50 "
        "| mean abs dloss, last 50 | non-finite steps | grad-norm ratio mean (last 50: min-max) "
        "| loss last 50 (bf16) |"
    )
    print("|---|---|---|---:|---:|---:|---|---|")
    for r in rows:
        against = "float32 (noise floor)" if r["recipe"] == FLOAT32 else r["recipe"]
        print(
            f"| {r['model']} | {r['synthetic_noise']} ({r['loss_floor']:.3f}) | {against} | "
            f"{100 * r['rel_dloss_last']:.2f} % | {r['abs_dloss_last']:.4f} | "
            f"{r['nonfinite_steps']} | {r['grad_norm_ratio_mean']:.3f} "
            f"({r['grad_norm_ratio_min_last']:.3f}-{r['grad_norm_ratio_max_last']:.3f}) | "
            f"{r['loss_last50']:.3f} ({r['bf16_loss_last50']:.3f}) |"
        )


if __name__ == "__main__":
    main()
