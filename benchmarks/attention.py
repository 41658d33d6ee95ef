"""Blockwise vs dot attention: forward+backward time and compiled temp bytes per sequence length.

One attention call (no projections) with the head dims of a preset (default deepseek3-small: MLA,
H=16 heads, q/k head dim 96, v head dim 64, its softmax scale), causal, one document per
sequence. For each T: median wall time of a jitted forward+backward (gradients of q, k, v) over
--repeats runs after one warm-up, their ratio, and `memory_analysis().temp_size_in_bytes` of each
compiled step. This is the measurement behind `kernel.AUTO_BLOCKWISE_MIN_LENGTH`.

Run: PYTHONPATH=src python benchmarks/attention.py [--lengths 1024 2048 4096] [--repeats 5]
     [--batch 1] [--heads N] [--block 512] [--dtype float32] [--model deepseek3-small]
Prints one JSON line per T, then a Markdown table. Needs a quiet machine for the times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from expertax.nn import rope  # noqa: E402
from expertax.nn.attention.blockwise import attend_blockwise  # noqa: E402
from expertax.nn.attention.kernel import attend_dot  # noqa: E402
from expertax.preflight import load_config  # noqa: E402
from expertax.tools.bench_gmm import median_seconds  # noqa: E402


def compile_step(attend, shapes, scale):
    """Jitted gradients of sum(out * w) in q, k, v; returns (compiled, temp bytes)."""

    def loss(q, k, v, w):
        return jnp.sum(attend(q, k, v, scale=scale).astype(jnp.float32) * w)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile()
    return compiled, compiled.memory_analysis().temp_size_in_bytes


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=None, help="default: the preset's query heads")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="deepseek3-small")
    args = ap.parse_args(argv)
    c = load_config(overrides={"model_name": args.model})
    h = args.heads or c.base_num_query_heads
    g = (
        h
        if c.attention_type == "mla"
        else max(1, h * c.base_num_kv_heads // c.base_num_query_heads)
    )
    qd, vd, scale = c.qk_head_dim, c.attn_v_head_dim, rope.softmax_scale(c)
    dtype = jnp.dtype(args.dtype)

    def blockwise(q, k, v, *, scale):
        return attend_blockwise(q, k, v, scale=scale, block_q=args.block, block_k=args.block)

    rows = []
    for t in args.lengths:
        b = args.batch
        shapes = [
            jax.ShapeDtypeStruct((b, t, h, qd), dtype),
            jax.ShapeDtypeStruct((b, t, g, qd), dtype),
            jax.ShapeDtypeStruct((b, t, g, vd), dtype),
            jax.ShapeDtypeStruct((b, t, h, vd), jnp.float32),
        ]
        keys = jax.random.split(jax.random.key(t), len(shapes))
        inputs = [jax.random.normal(kk, s.shape, s.dtype) for kk, s in zip(keys, shapes)]
        row = dict(model=args.model, B=b, T=t, H=h, G=g, Q=qd, V=vd, dtype=args.dtype)
        row["block"] = args.block
        for name, fn in (("dot", attend_dot), ("blockwise", blockwise)):
            compiled, temp = compile_step(fn, shapes, scale)
            row[f"{name}_s"] = median_seconds(compiled, inputs, args.repeats)
            row[f"{name}_temp_bytes"] = temp
        row["blockwise_over_dot"] = row["blockwise_s"] / row["dot_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\n{args.model} head dims (H={h}, G={g}, Q={qd}, V={vd}), B={args.batch}, {args.dtype}, "
        f"block {args.block}, fwd+bwd, median of {args.repeats}; "
        f"{jax.default_backend()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores"
    )
    print("| T | dot s | blockwise s | blockwise / dot | dot temp MiB | blockwise temp MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['T']} | {r['dot_s']:.4f} | {r['blockwise_s']:.4f} | "
            f"{r['blockwise_over_dot']:.2f} | {r['dot_temp_bytes'] / 2**20:.1f} | "
            f"{r['blockwise_temp_bytes'] / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
