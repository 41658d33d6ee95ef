"""Pipeline parallelism: temporaries of the compiled train step at pp = 1, 2, 4, and step time.

Same model, same global batch, 8 (simulated) devices; the pipeline axis takes devices from FSDP
(pp1 = fsdp8, pp2 = pp2 x fsdp4, pp4 = pp4 x fsdp2). For each layout XLA's memory analysis of the
compiled step gives, per device: temporaries (`temp`), arguments (parameters, optimizer state and
batch) and the generated code. The issue's target: temporaries at pp=2 and pp=4 no larger than at
pp=1 (the stage-to-stage shifts add nothing). Both shift methods (`roll`, `ppermute`) are
compiled; the bubble fraction is the formula's (S - 1) / (M * R + S - 1). With `--time`, each
layout also runs a few steps (median ms; on simulated CPU devices this is indicative only: the
8 "devices" share the host's cores, so a pipeline's idle stages are not free time here).

Run: python benchmarks/pipeline_memory.py [--json PATH] [--time] [--set key=value ...]
Prints one JSON line per layout and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402

from expertax.data.synthetic import SyntheticData  # noqa: E402
from expertax.preflight import load_config  # noqa: E402
from expertax.train.trainer import build_trainer  # noqa: E402

# A mid-size Mixtral-style model: 8 MoE layers, so that pp=4 holds 2 layers per stage.
MID = dict(
    model_name="mixtral-tiny",
    base_emb_dim=512,
    base_num_decoder_layers=8,
    base_num_query_heads=8,
    base_num_kv_heads=4,
    head_dim=64,
    base_moe_mlp_dim=768,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=8192,
    max_target_length=256,
    per_device_batch_size=2,  # global batch 16 on 8 devices
    dtype="float32",
    weight_dtype="float32",
    remat_policy="full",
    steps=100,
)

LAYOUTS = [
    ("pp1-fsdp8", dict()),
    ("pp2-fsdp4", dict(ici_pipeline_parallelism=2)),
    ("pp2-fsdp4-mb4", dict(ici_pipeline_parallelism=2, num_pipeline_microbatches=4)),
    ("pp2-fsdp4-ppermute", dict(ici_pipeline_parallelism=2, pipeline_shift="ppermute")),
    ("pp2-fsdp4-r2-mb4", dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2,
                              num_pipeline_microbatches=4)),
    ("pp4-fsdp2", dict(ici_pipeline_parallelism=4)),
    ("pp4-fsdp2-mb8", dict(ici_pipeline_parallelism=4, num_pipeline_microbatches=8)),
    ("pp4-fsdp2-ppermute", dict(ici_pipeline_parallelism=4, pipeline_shift="ppermute")),
]  # fmt: skip


def measure(name: str, over: dict, extra: dict, timed: bool, iters: int) -> dict:
    c = load_config(overrides={**MID, **extra, **over})
    tr = build_trainer(c, devices=jax.devices()[:8])
    t0 = time.perf_counter()
    compiled = tr.compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row = dict(
        layout=name,
        pp=c.pipeline_stages,
        microbatches=c.pipeline_microbatches if c.pipeline_stages > 1 else 1,
        repeats=c.num_pipeline_repeats,
        shift=c.pipeline_shift if c.pipeline_stages > 1 else "-",
        bubble=round(c.pipeline_bubble_fraction, 4),
        temp_mib=round(mem.temp_size_in_bytes / 2**20, 1),
        args_mib=round(mem.argument_size_in_bytes / 2**20, 1),
        code_mib=round(mem.generated_code_size_in_bytes / 2**20, 1),
        compile_s=round(compile_s, 1),
        collective_permutes=compiled.as_text().count("collective-permute-start")
        or compiled.as_text().count(" collective-permute("),
    )
    if timed:
        state = tr.init_state()
        data = SyntheticData(
            vocab_size=c.vocab_size,
            seq_len=c.max_target_length,
            global_batch=tr.global_batch,
            seed=0,
        )
        batch = tr.put_batch(data.batch_at(0))
        with tr.context():
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                state, m = compiled(state, batch)
                jax.block_until_ready(m)
                times.append((time.perf_counter() - t0) * 1e3)
        row["step_ms"] = round(statistics.median(times), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="also append the JSON lines to this file")
    ap.add_argument("--time", action="store_true", help="also time a few steps per layout")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layouts", help="comma list of layout names (default: all)")
    ap.add_argument("--set", action="append", default=[], help="extra config key=value")
    args = ap.parse_args()
    extra = {}
    for s in args.set:
        k, v = s.split("=", 1)
        extra[k] = int(v) if v.lstrip("-").isdigit() else v
    chosen = set(args.layouts.split(",")) if args.layouts else None
    rows = []
    for name, over in LAYOUTS:
        if chosen and name not in chosen:
            continue
        row = measure(name, over, extra, args.time, args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    base = next((r["temp_mib"] for r in rows if r["pp"] == 1), None)
    cols = ["layout", "pp", "microbatches", "repeats", "shift", "bubble", "temp_mib"]
    cols += ["temp/pp1", "args_mib", "collective_permutes", "compile_s"]
    cols += ["step_ms"] if args.time else []
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        r = dict(r)
        r["temp/pp1"] = round(r["temp_mib"] / base, 2) if base else "-"
        print("| " + " | ".join(str(r.get(k, "-")) for k in cols) + " |")


if __name__ == "__main__":
    main()
