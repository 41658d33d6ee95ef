"""Context parallelism for DeepSeek-V3's MLA attention (docs/design/context.md), compiled for a
TPU target, not run: what crosses devices, the temporaries, and the balance of the causal work.

Every program is the forward+backward (gradients of the queries, latent, RoPE key and `wkv_b`)
of `mla.context_attend`, DeepSeek-V3 671B's attention dims (H 128, Qn 128, Qr 64, O 128, Rkv
512), bfloat16, B=1, packed-document segment ids, `attention_impl=blockwise` (default blocks of
512), load balance on, under a mesh whose only axis above 1 is `context`, with the default rules
(the inputs split along T over `context`, `wkv_b` by its FSDP dim, which the rules give to
`context` too). `ring`: `context_parallel_strategy=ring` (latent_ring.py: the latent passed
round the context axis, never gathered); `fused`: gathered, then the latent kernel
(latent_blockwise.py, keys and values one key block at a time); `expanded`: the gathered
latent up-projected for the whole sequence, then the blockwise kernel (what `dot` does);
`splash`: gathered and up-projected whole, then the splash kernel (splash.attend_context: the
block maps of the load-balanced rows, each device its share).

(a) `--bytes`: the all-gathers and reduce-scatters in the optimized HLO at cp=8 on
`--target` (default tpu:v5p-16, 8 chips), each op's full (gathered) size in bytes, split into
the sequence's (an operand with a dim of T/cp rows) and the weights'; against what gathering the
per-head keys and values would move (T x H x (Qn+Qr+O) x 2 bytes, and the same again for the
reduce-scatter of their gradients).
(b) `--temps`: `memory_analysis()` temp bytes at T/cp fixed (`--per-device`, default 4096)
for cp in 2, 8, 32: the first cp chips of tpu:v5p-64 (libtpu describes one slice per process and
no slice of 2 v5p chips), in a process of its own (`--parts temps`).
(c) `--balance`: the block pairs each device's query chunks visit at cp=8, T=32K, from the
blockwise kernel's trip formula (`blockwise._num_key_blocks`, the forward's; the backward visits
the same pairs), load balance on and off: max/min over the devices. A count, no compile.

Run: PYTHONPATH=src python benchmarks/context_parallel.py [--parts balance bytes] [--length 32768]
     [--json benchmarks/results/context_parallel.json]; then `--parts temps [--per-device 4096]`
     with the same `--json` (appended).
Needs the TPU compiler (expertax[tpu]). Prints one JSON line per program, then the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from expertax import targets

H, NOPE, QR, VD, R = 128, 128, 64, 128, 512  # DeepSeek-V3 671B (VD: the value head dim)
BYTES = 2  # bfloat16
TEMPS_CP = (2, 8, 32)
# libtpu describes one slice per process, and none of 2 chips (v5p-4): every cp of (b) takes the
# first cp chips of one 32-chip slice
TEMPS_TARGET = "tpu:v5p-64"
KINDS = "all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all"
# `%x = <result shape or tuple> kind(` or `kind-start(`, not `-done`
COLLECTIVE = re.compile(rf"= (.*?) ({KINDS})(?:-start)?\(")
SHAPE = re.compile(r"\b(bf16|f32|s32|u32|f16|s8|pred)\[([\d,]*)\]")
SIZES = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "pred": 1}


def _config(cp: int, length: int, strategy: str = "all_gather", impl: str = "blockwise"):
    from expertax.preflight import load_config

    return load_config(
        overrides={
            "model_name": "deepseek3-671b",
            "max_target_length": length,
            "per_device_batch_size": 1,
            "ici_context_parallelism": cp,
            "ici_fsdp_parallelism": 1,
            "ici_data_parallelism": 1,
            "ici_expert_parallelism": 1,
            "ici_tensor_parallelism": 1,
            "attention_impl": impl,
            "context_parallel_load_balance": True,
            "context_parallel_strategy": strategy,
        }
    )


def compile_attention(spec: str, cp: int, length: int, path: str, options=None):
    """The compiled forward+backward of `mla.context_attend` on `spec`'s first cp devices;
    `path`: ring (context_parallel_strategy=ring), fused, expanded or splash (all_gather)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from expertax import platform
    from expertax.config.loader import config_rules
    from expertax.config.schema import MESH_AXES
    from expertax.nn import rope
    from expertax.nn.attention import mla
    from expertax.sharding import named_sharding, use_rules

    t = targets.parse_target(spec)
    impl = "splash" if path == "splash" else "blockwise"
    c = _config(cp, length, "ring" if path == "ring" else "all_gather", impl)
    fused = path != "expanded"
    rules = config_rules(c)
    shape = [cp if a == "context" else 1 for a in MESH_AXES]
    mesh = Mesh(np.array(t.devices()[:cp]).reshape(shape), MESH_AXES)
    bf16 = jnp.bfloat16

    def arg(shape, axes, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=named_sharding(mesh, axes, rules, shape))

    args = (
        arg((1, length, H, NOPE + QR), ("batch", "length", "act_heads", None)),
        arg((1, length, R), ("batch", "length", None)),
        arg((1, length, QR), ("batch", "length", None)),
        arg((R, H, NOPE + VD), ("kv_lora", "heads", "kv")),
        arg((1, length), ("batch", "length"), jnp.int32),
        arg((1, length), ("batch", "length"), jnp.int32),
    )
    scale = rope.softmax_scale(c)

    def loss(q, lat, k_rope, wkv_b, positions, segments):
        out = mla.context_attend(
            q, lat, k_rope, wkv_b, c, positions_BT=positions, segment_ids_BT=segments,
            scale=scale, fused=fused,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    with platform.use(t.platform), jax.set_mesh(mesh), use_rules(rules):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args)
        return lowered.compile(compiler_options=options)


def collectives(text: str, rows: int) -> list[dict]:
    """The collectives of an optimized HLO text (all-gather, reduce-scatter, all-reduce,
    collective-permute, all-to-all; an async pair counted once at its start): kind, the shapes
    of its result (a combined op has several), their bytes (an all-gather's gathered side, a
    reduce-scatter's input), the computation it sits in (a loop body runs it per trip), and
    whether each moves the sequence (a dim of `rows` = T) or weights."""
    found, where = [], ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            where = line.split()[0 if not line.startswith("ENTRY") else 1]
        m = COLLECTIVE.search(line)
        if m is None:
            continue
        kind, result = m.group(2), m.group(1)
        if kind == "reduce-scatter":  # its result is the scattered side: take its operands
            result = line[line.index(m.group(0)) + len(m.group(0)) :]
        for dtype, dims_text in SHAPE.findall(result):
            dims = [int(d) for d in dims_text.split(",") if d]
            if kind == "collective-permute" and dtype == "u32" and not dims:
                continue
            nbytes = int(np.prod(dims)) * SIZES.get(dtype, 4)
            what = "sequence" if rows in dims else "weights"
            found.append(
                dict(
                    kind=kind,
                    dtype=dtype,
                    shape=dims,
                    bytes=nbytes,
                    moves=what,
                    computation=where,
                )
            )
    return found


def part_bytes(spec: str, length: int) -> list[dict]:
    rows = []
    full_kv = length * H * (NOPE + QR + VD) * BYTES  # the per-head keys and values of T tokens
    for fused in (True, False):
        t0 = time.perf_counter()
        path = "fused" if fused else "expanded"
        ops = collectives(compile_attention(spec, 8, length, path).as_text(), length)
        seq = [o for o in ops if o["moves"] == "sequence"]
        gathered = sum(o["bytes"] for o in seq if o["kind"] == "all-gather")
        rows.append(
            dict(
                part="bytes",
                target=spec,
                cp=8,
                T=length,
                path="fused" if fused else "expanded",
                gathered_sequence_bytes=gathered,
                other_sequence_bytes=sum(o["bytes"] for o in seq if o["kind"] != "all-gather"),
                weight_bytes=sum(o["bytes"] for o in ops if o["moves"] == "weights"),
                full_kv_bytes=full_kv,
                ratio=round(full_kv / gathered, 1) if gathered else None,
                in_loops=sorted({o["computation"] for o in ops if "main" not in o["computation"]}),
                ops=ops,
                compile_s=round(time.perf_counter() - t0, 1),
            )  # fmt: skip
        )
    return rows


def part_temps(per_device: int, paths) -> list[dict]:
    rows = []
    spec = TEMPS_TARGET
    for cp in TEMPS_CP:
        for path in paths:
            t0 = time.perf_counter()
            mem = compile_attention(spec, cp, cp * per_device, path).memory_analysis()
            rows.append(
                dict(
                    part="temps",
                    target=spec,
                    cp=cp,
                    T=cp * per_device,
                    path=path,
                    temp_bytes=mem.temp_size_in_bytes,
                    argument_bytes=mem.argument_size_in_bytes,
                    compile_s=round(time.perf_counter() - t0, 1),
                )  # fmt: skip
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def pairs_per_device(cp: int, length: int, balanced: bool) -> list[int]:
    """The (query block, key block) pairs each device's query chunks visit: the blockwise
    kernel's trip formula per query block, with the kernel's own block sizes and offsets."""
    from expertax.nn.attention import blockwise, context

    pieces = 2 * cp if balanced else cp
    chunk = length // pieces
    order = context.chunk_order(cp) if balanced else list(range(cp))
    per = pieces // cp
    bq = blockwise.balanced_block(chunk, blockwise.DEFAULT_BLOCK)
    bk = blockwise.balanced_block(length, blockwise.DEFAULT_BLOCK)
    nq, nk = -(-chunk // bq), -(-length // bk)
    counts = []
    for d in range(cp):
        n = 0
        for which in order[d * per : (d + 1) * per]:
            n += sum(
                int(blockwise._num_key_blocks(i, bq, bk, nk, which * chunk)) for i in range(nq)
            )
        counts.append(n)
    return counts


def part_balance(length: int) -> list[dict]:
    rows = []
    for balanced in (True, False):
        counts = pairs_per_device(8, length, balanced)
        rows.append(
            dict(
                part="balance",
                cp=8,
                T=length,
                load_balance=balanced,
                pairs=counts,
                max_over_min=round(max(counts) / min(counts), 3),
            )  # fmt: skip
        )
    return rows


def tables(rows: list[dict]) -> str:
    out = []
    by = [r for r in rows if r["part"] == "bytes"]
    if by:
        out += [
            "(a) collectives per layer, forward+backward, cp=8 (MiB, the gathered/reduced size)",
            "| path | all-gathered, sequence | other collectives, sequence | weights "
            "| K/V of the sequence | K/V / all-gathered |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['path']} | {r['gathered_sequence_bytes'] / 2**20:.1f} "
            f"| {r['other_sequence_bytes'] / 2**20:.1f} | {r['weight_bytes'] / 2**20:.1f} "
            f"| {r['full_kv_bytes'] / 2**20:.1f} | {r['ratio']} |"
            for r in by
        ]
    te = [r for r in rows if r["part"] == "temps"]
    if te:
        out += ["", "(b) temp bytes at fixed T/cp", "| target | cp | T | path | temp MiB |"]
        out += ["|---|---|---|---|---|"]
        out += [
            f"| {r['target']} | {r['cp']} | {r['T']} | {r['path']} "
            f"| {r['temp_bytes'] / 2**20:.1f} |"
            for r in te
        ]
    ba = [r for r in rows if r["part"] == "balance"]
    if ba:
        out += ["", "(c) block pairs per device, cp=8", "| load balance | pairs | max/min |"]
        out += ["|---|---|---|"]
        out += [f"| {r['load_balance']} | {r['pairs']} | {r['max_over_min']} |" for r in ba]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["balance", "bytes"])
    ap.add_argument("--target", default="tpu:v5p-16")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--per-device", type=int, default=4096)
    ap.add_argument(
        "--paths", nargs="+", default=["ring", "fused", "expanded"],
        help="(b)'s programs: ring (the latent passed round), fused (gathered, latent kernel), "
        "expanded (gathered and up-projected whole), splash (gathered, up-projected, splash)",
    )  # fmt: skip
    ap.add_argument("--json", default=None, help="append the rows to this file (one JSON list)")
    args = ap.parse_args(argv)
    if {"bytes", "temps"} <= set(args.parts):
        ap.error("--parts bytes and temps compile for different slices: run them one at a time")
    if {"bytes", "temps"} & set(args.parts):
        spec = args.target if "bytes" in args.parts else TEMPS_TARGET
        targets.prepare_process(targets.parse_target(spec))
    rows: list[dict] = []
    if "balance" in args.parts:
        rows += part_balance(args.length)
        for r in rows:
            print(json.dumps(r), flush=True)
    if "bytes" in args.parts:
        for r in part_bytes(args.target, args.length):
            rows.append(r)
            print(json.dumps(r), flush=True)
    if "temps" in args.parts:
        rows += part_temps(args.per_device, args.paths)
    if args.json:
        kept = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else []
        Path(args.json).write_text(json.dumps(kept + rows, indent=1) + "\n")
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; compiled, not run")
    print(tables(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
