"""Error of the fp8 training GEMMs (fp8/matmul.py) against float32, per product of one linear.

For x [M, K] (normal, or with token magnitudes spread over 1e-3..1e3 along M), w [K, N] (normal
x 0.02) and an output gradient dy [M, N] (normal): the relative Frobenius error of fprop (y),
dgrad (dx) and wgrad (dw) of each recipe, and of bfloat16 operands (the baseline), against the
float32 products; and the worst row's relative error of y (a token's output). Numerics only
(a CPU computes what an fp8 GEMM with float32 accumulation computes, up to summation order):
no time is measured, so the machine's load does not matter.

Run: python benchmarks/fp8_gemm.py [--m 256 --k 7168 --n 512] [--json PATH]
Prints a JSON line per (operands, recipe), then a Markdown table.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from expertax.fp8 import matmul as fp8_matmul
from expertax.fp8 import recipes as fp8_recipes


def _rel(a, b, axis=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def _products(fn, x, w, dy):
    y, vjp = jax.vjp(fn, x, w)
    return (y, *vjp(dy))


def _bf16(x, w):
    return jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).astype(jnp.float32)


def measure(m: int, k: int, n: int, spread: bool) -> list[dict]:
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (m, k))
    if spread:
        x = x * jnp.logspace(-3, 3, m)[:, None]
    w = jax.random.normal(ks[1], (k, n)) * 0.02
    dy = jax.random.normal(ks[2], (m, n))
    with jax.default_matmul_precision("highest"):
        exact = _products(jnp.matmul, x, w, dy)
        rows = []
        cases = [("bfloat16", _bf16)] + [
            (r, lambda x, w, r=r: fp8_matmul.dense(x, w, r)) for r in fp8_recipes.RECIPES
        ]
        for name, fn in cases:
            got = _products(fn, x, w, dy)
            rec = {"operands": "spread 1e-3..1e3" if spread else "normal", "recipe": name,
                   "m": m, "k": k, "n": n}  # fmt: skip
            for label, g, e in zip(("fprop", "dgrad", "wgrad"), got, exact, strict=True):
                rec[label] = float(_rel(g, e))
            rec["worst_row_fprop"] = float(_rel(got[0], exact[0], axis=1).max())
            rows.append(rec)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    records = []
    for spread in (False, True):
        for rec in measure(args.m, args.k, args.n, spread):
            print(json.dumps(rec), flush=True)
            records.append(rec)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    print("| operands | recipe | fprop | dgrad | wgrad | worst row (fprop) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in records:
        cells = " | ".join(f"{100 * r[c]:.2f} %" for c in ("fprop", "dgrad", "wgrad"))
        print(f"| {r['operands']} | {r['recipe']} | {cells} | {100 * r['worst_row_fprop']:.2f} % |")


if __name__ == "__main__":
    main()
