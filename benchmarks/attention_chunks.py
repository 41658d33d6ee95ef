"""Attention token chunks (`num_attention_token_chunks`): compiled temporaries of one attention
layer's forward+backward, by kernel and chunk count, with one chunk (the unchunked layer) as the
baseline of the same run.

One layer of a preset (default deepseek3-small: MLA, 16 heads, q/k 96, v 64) at one sequence of
--length positions, float32, the layer under jax.checkpoint with --remat (as the decoder's layer
scan runs it), compiled by XLA:CPU; `memory_analysis().temp_size_in_bytes` of the jitted
gradients of the layer's parameters and input. A compile, not a run: no time is taken. With the
`dot` and `blockwise` kernels the chunks are a scan (`chunks.over_queries`); `--loop` compiles
the Python loop the splash kernel takes instead (with the same kernel), to compare the two.

Run: PYTHONPATH=src python benchmarks/attention_chunks.py [--model deepseek3-small]
     [--length 2048] [--chunks 1 2 4 8] [--kernels dot blockwise] [--remat full] [--loop]
Prints one JSON line per (kernel, chunks), then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from expertax.nn import param  # noqa: E402
from expertax.nn.attention import chunks, gqa, mla  # noqa: E402
from expertax.preflight import load_config  # noqa: E402


def temp_bytes(model: str, kernel: str, n: int, length: int, remat: str) -> int:
    c = load_config(
        overrides={
            "model_name": model,
            "max_target_length": length,
            "attention_impl": kernel,
            "num_attention_token_chunks": n,
            "remat_policy": remat,
        }
    )
    module = mla if c.attention_type == "mla" else gqa
    p = jax.eval_shape(lambda: param.initialize(module.spec(c), jax.random.key(0), jnp.float32))
    x = jax.ShapeDtypeStruct((1, length, c.base_emb_dim), jnp.float32)
    pos = jnp.arange(length)[None]

    def loss(p, x):
        return jnp.sum(module.apply(p, x, c, pos, None, jnp.float32))

    step = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))
    return step.lower(p, x).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek3-small")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--kernels", nargs="+", default=["dot", "blockwise"])
    ap.add_argument("--remat", default="full")
    ap.add_argument("--loop", action="store_true", help="the Python loop instead of the scan")
    args = ap.parse_args()
    if args.loop:
        chunks.scanned = lambda *a: False  # the loop splash takes, with these kernels
    rows = []
    for kernel in args.kernels:
        base = None
        for n in args.chunks:
            b = temp_bytes(args.model, kernel, n, args.length, args.remat)
            base = b if base is None else base
            row = {
                "model": args.model,
                "kernel": kernel,
                "length": args.length,
                "chunks": n,
                "loop": "python" if args.loop else "scan",
                "remat": args.remat,
                "temp_mib": round(b / 2**20, 2),
                "vs_one_chunk": round(b / base, 3),
                "host": platform.node(),
                "load": os.getloadavg()[0],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| kernel | chunks | loop | temporaries (MiB, compiled) | vs 1 chunk |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['chunks']} | {r['loop']} | {r['temp_mib']:.2f} | "
            f"{r['vs_one_chunk']:.3f} |"
        )


if __name__ == "__main__":
    main()
