"""One attention call compiled for TPU and GPU targets, per implementation: what the compiler
produced, not how fast it runs (compiled, not run).

For each target (one chip of it: the per-chip program of a batch- or head-split call), case and
`attention_impl`, the forward and the forward+backward (gradients of q, k, v) of
`kernel.attend` are lowered and compiled with bfloat16 inputs, causal, with packed-document
segment ids unless `--no-segments`. Per program:
- `counted_flops`: matmul FLOPs counted from the optimized HLO (`planner.flops.count_flops`, loops
  at their trip counts); custom calls without a cost estimate (the splash and cuDNN kernels) are
  not counted and are listed in `opaque`; loops whose trip count depends on data (blockwise's
  causal skip) are counted once and listed in `unknown_loops`;
- `kernel_flops_model`: splash and blockwise, the matmul FLOPs of the tiles their causal skip
  visits (`kernel_flops_model` below); a model of the code, not a compiler figure;
- `temp_bytes`, `argument_bytes`, `output_bytes`: `compiled.memory_analysis()`;
- `kernels`: the custom-call targets in the compiled program (`tpu_custom_call` is a Mosaic
  kernel, `__cudnn$fmha...` cuDNN's fused attention).
An implementation the library refuses for a case (cuDNN's head dim above what this process's JAX
accepts) is a row with `status: refused` and the reason.

`--hopper-head-dims`: JAX's cuDNN wrapper checks the head dim against the default backend's GPU,
which on a CPU machine is none, so it holds a compile for an H100 to 128 and refuses MLA's 192.
With this flag the benchmark answers that check as an H100 host would (compute capability 9.0),
by replacing a private JAX function in this process only; the rows say so (`hopper_check`).

Run: PYTHONPATH=src python benchmarks/attention_targets.py [--targets tpu:v5p-8 gpu:h100x8]
     [--cases deepseek3 mixtral] [--length 4096] [--batch 1] [--no-segments]
     [--hopper-head-dims] [--json benchmarks/results/attention/targets-DATE.jsonl]
Needs the TPU compiler (expertax[tpu]) and the GPU compiler with cuDNN (expertax[gpu]). Prints
one JSON line per program, then a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import time

from expertax import targets

# name: (H, G, Q, O, preset whose softmax scale is used)
CASES = {
    "deepseek3": (128, 128, 192, 128, "deepseek3-671b"),
    "mixtral": (32, 8, 128, 128, "mixtral-8x7b"),
}
IMPLS = {"tpu": ("dot", "blockwise", "splash"), "gpu": ("dot", "blockwise", "cudnn")}
MODES = ("fwd", "fwd+bwd")


def versions() -> str:
    names = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "nvidia-cudnn-cu12")
    found = []
    for n in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{n} {importlib.metadata.version(n)}")
    return ", ".join(found)


@contextlib.contextmanager
def hopper_check(enabled: bool):
    """Answer JAX's compute-capability check as a Hopper (9.0) host would (see the docstring)."""
    if not enabled:
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as fa  # private: benchmark only

    from expertax.nn.attention import cudnn

    saved = fa.check_compute_capability, cudnn.head_dim_limit
    fa.check_compute_capability = lambda c: tuple(map(int, c.split("."))) <= (9, 0)
    cudnn.head_dim_limit = lambda: cudnn.MAX_HEAD_DIM  # what the library reads on an H100
    try:
        yield
    finally:
        fa.check_compute_capability, cudnn.head_dim_limit = saved


def compile_one(impl, mode, shapes, scale, device, segments):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from expertax.nn.attention.kernel import attend

    one = NamedSharding(Mesh([device], ("one",)), PartitionSpec())
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for s in shapes]

    def call(q, k, v, seg):
        return attend(q, k, v, scale=scale, segment_ids_BT=seg if segments else None, impl=impl)

    def loss(q, k, v, seg):
        return jnp.sum(call(q, k, v, seg).astype(jnp.float32))

    fn = call if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(fn).lower(*args).compile()


def measure(t, case, impl, mode, args, device) -> dict:
    import jax
    import jax.numpy as jnp

    from expertax import platform
    from expertax.nn import rope
    from expertax.planner.flops import count_flops
    from expertax.preflight import load_config

    h, g, qd, vd, preset = CASES[case]
    b, n = args.batch, args.length
    scale = rope.softmax_scale(load_config(overrides={"model_name": preset}))
    bf16 = jnp.bfloat16
    shapes = [
        jax.ShapeDtypeStruct((b, n, h, qd), bf16),
        jax.ShapeDtypeStruct((b, n, g, qd), bf16),
        jax.ShapeDtypeStruct((b, n, g, vd), bf16),
        jax.ShapeDtypeStruct((b, n), jnp.int32),
    ]
    row = dict(target=t.spec, case=case, impl=impl, mode=mode, B=b, T=n, H=h, G=g, Q=qd, O=vd)
    row.update(dtype="bfloat16", segments=not args.no_segments, status="compiled, not run")
    # Only a cuDNN call with a head dim above 128 reads the check (`--hopper-head-dims`).
    row["hopper_check"] = bool(args.hopper_head_dims and impl == "cudnn" and max(qd, vd) > 128)
    t0 = time.perf_counter()
    try:
        with platform.use(t.platform), hopper_check(row["hopper_check"]):
            compiled = compile_one(impl, mode, shapes, scale, device, not args.no_segments)
    except (ValueError, NotImplementedError) as e:
        row.update(status="refused", reason=str(e).splitlines()[0])
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    text = compiled.as_text()
    count = count_flops(text)
    mem = compiled.memory_analysis()
    row["counted_flops"] = count.flops
    row["opaque"] = sorted({target for _, target, _ in count.opaque})
    row["unknown_loops"] = len(count.unknown_trip_counts)
    row["kernels"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    row["temp_bytes"] = mem.temp_size_in_bytes
    row["argument_bytes"] = mem.argument_size_in_bytes
    row["output_bytes"] = mem.output_size_in_bytes
    row["kernel_flops_model"] = kernel_flops_model(impl, mode, b, n, h, qd, vd)
    return row


def kernel_flops_model(impl, mode, b, n, h, qd, vd) -> int | None:
    """Matmul FLOPs of the tiles a causal kernel visits (n(n+1)/2 of n^2 tile pairs per head):
    splash forward 2(Q+O) per (query, key) pair, backward 2(4Q+3O) (its dq and dkv kernels
    both recompute QK^T and dO V^T); blockwise forward the same, backward 2(3Q+2O) (one pass,
    five matmuls). None for cuDNN (its tiles are its own) and dot (counted from the HLO)."""
    from expertax.nn.attention import blockwise, splash

    if impl == "splash":
        block, padded = splash.block_size(n), -(-n // splash.LANES) * splash.LANES
        backward = 2 * (4 * qd + 3 * vd)
    elif impl == "blockwise":
        block = blockwise.balanced_block(n, blockwise.DEFAULT_BLOCK)
        padded, backward = -(-n // block) * block, 2 * (3 * qd + 2 * vd)
    else:
        return None
    tiles = padded // block
    pairs = b * h * tiles * (tiles + 1) // 2 * block**2
    return pairs * (2 * (qd + vd) + (backward if mode == "fwd+bwd" else 0))


def table(rows: list[dict]) -> str:
    lines = [
        "| target | case | impl | mode | counted GFLOP | kernel GFLOP (model) | temp MiB "
        "| kernels in the program | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "refused":
            lines.append(
                f"| {r['target']} | {r['case']} | {r['impl']} | {r['mode']} | - | - | - | - "
                f"| refused: {r['reason']} |"
            )
            continue
        model = r.get("kernel_flops_model")
        flops = f"{r['counted_flops'] / 1e9:.1f}"
        if r["unknown_loops"]:
            flops += f" ({r['unknown_loops']} loops once)"
        status = r["status"] + (", Hopper check" if r["hopper_check"] else "")
        lines.append(
            f"| {r['target']} | {r['case']} | {r['impl']} | {r['mode']} | {flops} | "
            f"{'-' if model is None else f'{model / 1e9:.1f}'} | "
            f"{r['temp_bytes'] / 2**20:.1f} | {', '.join(r['kernels']) or '-'} | {status} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", nargs="+", default=["tpu:v5p-8", "gpu:h100x8"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--impls", nargs="*", default=None, help="default: per platform")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-segments", action="store_true")
    ap.add_argument("--hopper-head-dims", action="store_true")
    ap.add_argument("--json", default=None, help="append the JSON lines to this file")
    args = ap.parse_args(argv)
    parsed = [targets.parse_target(s) for s in args.targets]
    for t in parsed:
        targets.prepare_process(t)
    rows = []
    for t in parsed:
        device = t.devices()[0]
        for case in args.cases:
            for impl in args.impls or IMPLS[t.platform]:
                for mode in MODES:
                    row = measure(t, case, impl, mode, args, device)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(row) + "\n")
    load = os.getloadavg()
    print(
        f"\nOne chip of each target, B={args.batch}, T={args.length}, bfloat16, causal"
        f"{'' if args.no_segments else ' + segment ids'}; {versions()}; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
