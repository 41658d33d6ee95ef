"""Matrix products at decode shapes on CPU: the read bandwidth of `x[M, K] @ w[K, N]`.

A decode step on one CPU device is a chain of products of one to a few rows by weights it
reads once, so its speed is the bandwidth these products reach. Each case jits a chain of
products by distinct float32 weights (about 200-400 MB in all, more than this host's caches
keep from one call to the next; each product's output summed into the next input so that none
is skipped) and reports `K x N x 4 bytes / time per product`, the minimum over 5 rounds, for
three libraries in the same run: XLA:CPU's dot, torch's `linear` (as many threads as cores),
and expertax's own kernel (decoding/rowdot.py, an XLA FFI custom call in the same jitted chain).

Rows 1, 2, 4, 8 (batch 1, speculative steps, batch 8) at the shapes of deepseek3-small's decode
step: routed and shared expert SwiGLU [1024, 512] (wi_0|wi_1 joined) and [256, 1024], MLA
projections, the dense MLP, the output head; and shapes around 2 MiB of weights, where XLA:CPU
starts to split a matrix-vector product over the cores.

Run: PYTHONPATH=src python benchmarks/cpu_products.py [--json PATH]. Measure alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = [
    (1024, 512),
    (1024, 520),
    (256, 1024),
    (1024, 672),
    (384, 1536),
    (1024, 1024),
    (4096, 1024),
    (1024, 8192),
    (1024, 32000),
]
ROWS = (1, 2, 4, 8)


def _best(fn, calls: int = 3) -> float:
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return min(times)


def _xla(ws, rows: int, k: int) -> float:
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k), np.float32))

    def chain(x, ws):
        for w in ws:
            x = x + jnp.sum(jnp.dot(x, w), axis=1, keepdims=True) * 1e-9
        return x

    f = jax.jit(chain)
    return _best(lambda: f(x, ws).block_until_ready()) / len(ws)


def _rowdot(ws, rows: int, k: int) -> float:
    from expertax.decoding import rowdot

    if not rowdot.available():
        raise SystemExit(f"expertax's CPU kernel is unavailable: {rowdot.reason()}")
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k), np.float32))

    def chain(x, ws):
        for w in ws:
            x = x + jnp.sum(rowdot.rows(x, [w]), axis=1, keepdims=True) * 1e-9
        return x

    f = jax.jit(chain)
    return _best(lambda: f(x, ws).block_until_ready()) / len(ws)


def _torch(ws_np, rows: int, k: int) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    ws = [torch.from_numpy(w.T.copy()) for w in ws_np]  # linear's [N, K]
    x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, k), np.float32))

    def chain():
        y = x
        with torch.no_grad():
            for w in ws:
                y = y + torch.nn.functional.linear(y, w).sum(1, keepdim=True) * 1e-9
        return y

    return _best(chain) / len(ws)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    out = open(args.json, "a") if args.json else None  # noqa: SIM115

    def emit(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit(
        {
            "host": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load": os.getloadavg(),
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
    )
    rng = np.random.default_rng(0)
    table = []
    for k, n in SHAPES:
        count = max(4, 300_000_000 // (k * n * 4))
        ws_np = [rng.standard_normal((k, n), np.float32) for _ in range(count)]
        ws = [jnp.asarray(w) for w in ws_np]
        row = {"shape": f"{k}x{n}", "mib": k * n * 4 / 2**20}
        for m in ROWS:
            for lib, fn in (("xla", _xla), ("torch", _torch), ("rowdot", _rowdot)):
                s = fn(ws_np if lib == "torch" else ws, m, k)
                gbs = k * n * 4 / s / 1e9
                emit({"shape": [k, n], "rows": m, "lib": lib, "ms": s * 1e3, "gb_s": gbs})
                row[f"{lib}{m}"] = gbs
        table.append(row)
        del ws, ws_np
    libs = "xla / torch / rowdot"
    print("\n| weights [K, N] | MiB | " + " | ".join(f"{m} row(s) {libs} GB/s" for m in ROWS))
    print("|---|---:|" + "---:|" * len(ROWS))
    for r in table:
        cells = " | ".join(
            f"{r[f'xla{m}']:.1f} / {r[f'torch{m}']:.1f} / {r[f'rowdot{m}']:.1f}" for m in ROWS
        )
        print(f"| {r['shape']} | {r['mib']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
