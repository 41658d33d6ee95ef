"""fp8 training compiled for an accelerator target without the hardware: which GEMMs of a whole
training step are fp8 and which kernel runs each, against the bfloat16 step.

For each recipe ('' = bfloat16, fp8_tensorwise, fp8_blockwise) it builds the trainer for the
target (`dtype=bfloat16`, float32 master weights), compiles one step and reads the optimized
program: the GEMM custom calls by target (cuBLASLt fp8 `__cublas$lt$matmul$f8`, cuBLASLt bf16,
XLA's Triton fusions, Pallas kernels), each with the scope of its first call site, the
compiled FLOPs (planner/flops.py: loop bodies times their trip counts) and the temporaries
(`memory_analysis`). COMPILED ONLY: no time.

`--hopper`: deepseek3-tiny with its dims in whole 128-tiles (fp8/compiled.HOPPER_DIMS),
where the Hopper kernel (fp8/kernel.py) takes the products `gmm_impl=auto` and the
blockwise recipe give it; the table then says which kernel runs each product (routed
experts, shared experts, dense linears: fprop, dgrad, wgrad; fp8/compiled.py), against
the bfloat16 step.

Run: python benchmarks/fp8_targets.py [--target gpu:h100x8] [--models mixtral-tiny deepseek3-tiny]
       [--hopper] [--json PATH]
Prints a JSON line per (model, recipe), then a Markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from expertax import targets  # noqa: E402
from expertax.fp8 import compiled as fp8_kernels  # noqa: E402
from expertax.planner.flops import count_flops  # noqa: E402
from expertax.preflight import load_config  # noqa: E402
from expertax.train.trainer import build_trainer  # noqa: E402

RECIPES = ("", "fp8_tensorwise", "fp8_blockwise")
_CALL = re.compile(r'custom_call_target="([^"]+)"')
_OP = re.compile(r'op_name="([^"]+)"')


def _scope(op_name: str, target: str) -> str:
    """What a GEMM call multiplies, from its op_name (and its kernel: the routed experts'
    grouped GEMMs are the Pallas kernels and the cuBLAS calls inside their fp8 wrapper)."""
    if "nd,de->ne" in op_name:
        return "router"
    if "triton" in target or "mosaic" in target or "gmm" in op_name or "fp8_gmm" in op_name:
        return "routed experts"
    if "/moe/" in op_name:
        return "shared experts"
    if "while/body" in op_name:
        return "layer linears"
    return "heads, embedding, MTP projection"


def measure(model: str, recipe: str, target: str, **over) -> dict:
    devices = targets.parse_target(target).devices()
    keys = {"model_name": model, "quantization": recipe, "dtype": "bfloat16", **over}
    trainer = build_trainer(load_config(overrides=keys), devices)
    compiled = trainer.compile()
    text = compiled.as_text()
    kernels: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        call = _CALL.search(line)
        if not call or not any(k in call.group(1) for k in ("cublas", "triton", "mosaic", "gmm")):
            continue
        op = _OP.search(line)
        where = _scope(op.group(1) if op else "", call.group(1))
        kernels[f"{call.group(1)} ({where})"] += 1
    flops = count_flops(text)
    return {
        "model": model,
        "recipe": recipe or "bf16",
        "target": target,
        "fp8_gemms": sum(n for k, n in kernels.items() if "$f8" in k),
        "kernels": dict(sorted(kernels.items())),
        "compiled_gflop": flops.flops / 1e9,
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "routed_fp8": trainer.fp8_experts,
        "by_product": {
            f"{p}: {k}": n for (p, k), n in sorted(fp8_kernels.by_product(text).items())
        },
        "over": over,
    }


def product_table(rows: list[dict]) -> None:
    """Per product, the kernels that run it in each recipe's step (calls in the program)."""
    print("\n| product | " + " | ".join(r["recipe"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for product in fp8_kernels.PRODUCTS:
        cells = [
            ", ".join(
                f"{k.split(': ')[1]} x{n}" for k, n in r["by_product"].items()
                if k.startswith(product + ":")
            ) or "-"
            for r in rows
        ]  # fmt: skip
        print(f"| {product} | " + " | ".join(cells) + " |")
    print("| temporaries MiB | " + " | ".join(f"{r['temp_mib']:.1f}" for r in rows) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gpu:h100x8")
    ap.add_argument("--models", nargs="+", default=["mixtral-tiny", "deepseek3-tiny"])
    ap.add_argument(
        "--hopper", action="store_true", help="deepseek3-tiny in fp8_kernels.HOPPER_DIMS"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    models = ["deepseek3-tiny"] if args.hopper else args.models
    over = {"max_target_length": 256, **(fp8_kernels.HOPPER_DIMS if args.hopper else {})}
    for model in models:
        for recipe in RECIPES:
            row = measure(model, recipe, args.target, **over)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{args.target}, COMPILED ONLY (no time)\n")
    print(
        "| model | recipe | fp8 GEMMs | GEMM kernels (where) | compiled GFLOP | temporaries MiB |"
    )
    print("|---|---|---:|---|---:|---:|")
    for r in rows:
        kernels = "; ".join(f"{k} x{n}" for k, n in r["kernels"].items())
        print(
            f"| {r['model']} | {r['recipe']} | {r['fp8_gemms']} | {kernels} | "
            f"{r['compiled_gflop']:.4f} | {r['temp_mib']:.1f} |"
        )
    if args.hopper:
        product_table(rows)


if __name__ == "__main__":
    main()
