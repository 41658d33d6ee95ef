"""Sampling DeepSeek-V3 671B, compiled for accelerator targets on this machine (nothing runs).

For each target and layout, the greedy decoding program (`expertax.decoding.programs.
compile_for`: a batched prefill, then the jitted decode loop over the compressed MLA cache) is
compiled with the model's weights in bfloat16 or in fp8 (decoding/quantized.py), and the compiler's
memory analysis per device is printed: arguments (the weights and inputs), temporaries
(activations, one layer's dequantized weights, the KV cache, which lives inside the program), and
the total against the chip's memory. A TPU compile that does not fit is refused by the compiler
with the bytes it needs; that figure is reported.

Run: PYTHONPATH=src python benchmarks/generate_671b.py [--targets tpu:v5p-16 gpu:h200x8]
     [--layouts fsdp8 ep8] [--weights fp8 bfloat16] [--batch 32] [--prompt 1024] [--new 1024]
     [--prefill-chunk 512] [--out benchmarks/results/generate]
Each compile runs in its own process (about 10 GiB of host memory, minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
LAYOUTS = {
    # every weight sharded 8 ways over fsdp (the model's default mesh keys)
    "fsdp8": {"ici_fsdp_parallelism": 8},
    # routed experts 8 ways over expert (32 per device), the other weights replicated
    "ep8": {"ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8},
}


def one(args) -> dict:
    """One compile, in this process."""
    from expertax.targets import parse_target, prepare_process

    target = parse_target(args.one_target)
    prepare_process(target)
    from expertax import load_config
    from expertax.decoding import bytes_per_token, programs
    from expertax.decoding.loop import decoding_config
    from expertax.sharding.mesh import make_mesh

    over = {"model_name": "deepseek3-671b", "weight_dtype": "bfloat16", "dtype": "bfloat16"}
    over.update(LAYOUTS[args.one_layout])
    c = decoding_config(load_config(overrides=over))
    mesh = make_mesh(c, target.devices())
    record = {
        "target": target.spec,
        "layout": args.one_layout,
        "weights": args.one_weights,
        "batch": args.batch,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "prefill_chunk": args.prefill_chunk or programs.PREFILL_CHUNK,
        "kv_bytes_per_token": bytes_per_token(c, "compressed"),
        "kv_cache_gib_total": bytes_per_token(c, "compressed")
        * args.batch
        * (args.prompt + args.new)
        / GIB,
        "hbm_gib": target.hbm_gib,
        "label": "compiled, not run",
    }
    t0 = time.perf_counter()
    try:
        compiled = programs.compile_for(
            c,
            mesh,
            batch=args.batch,
            prompt_len=args.prompt,
            budget=args.new,
            fp8_weights=args.one_weights == "fp8",
            prefill_chunk=args.prefill_chunk,
        )
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the result
        text = str(e)
        need = re.search(r"([\d.]+)([GM])\s*of\s*([\d.]+)([GM])\s*hbm", text)
        record.update(fits=False, error=text.splitlines()[0][:300])
        if need:
            unit = {"G": 1.0, "M": 1 / 1024}
            record["needs_gib"] = float(need.group(1)) * unit[need.group(2)]
        record["compile_s"] = round(time.perf_counter() - t0, 1)
        return record
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    total -= m.alias_size_in_bytes
    record.update(
        arguments_gib=m.argument_size_in_bytes / GIB,
        temporaries_gib=m.temp_size_in_bytes / GIB,
        outputs_gib=m.output_size_in_bytes / GIB,
        total_gib=total / GIB,
        fits=total / GIB <= target.hbm_gib,
        compile_s=round(time.perf_counter() - t0, 1),
    )
    return record


def table(rows: list[dict]) -> str:
    head = (
        "| target | layout | weights | arguments GiB | temporaries GiB | total GiB / HBM | fits |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        if "total_gib" in r:
            total = f"{r['total_gib']:.1f} / {r['hbm_gib']:.0f}"
            args, temps = f"{r['arguments_gib']:.1f}", f"{r['temporaries_gib']:.1f}"
        else:
            need = r.get("needs_gib")
            total = f"needs {need:.1f} / {r['hbm_gib']:.0f}" if need else r.get("error", "?")
            args = temps = "-"
        fits = "yes" if r.get("fits") else "no"
        lines.append(
            f"| {r['target']} | {r['layout']} | {r['weights']} | {args} | {temps} | {total} "
            f"| {fits} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["tpu:v5p-16", "gpu:h200x8"])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--weights", nargs="+", default=["fp8", "bfloat16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: decoding's 512")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--one-target", help=argparse.SUPPRESS)
    p.add_argument("--one-layout", help=argparse.SUPPRESS)
    p.add_argument("--one-weights", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_target:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0
    rows = []
    host = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "loadavg": os.getloadavg()[0],
    }
    for target in args.targets:
        for layout in args.layouts:
            for weights in args.weights:
                cmd = [sys.executable, __file__, "--one-target", target, "--one-layout", layout,
                       "--one-weights", weights, "--batch", str(args.batch), "--prompt",
                       str(args.prompt), "--new", str(args.new)]  # fmt: skip
                if args.prefill_chunk:
                    cmd += ["--prefill-chunk", str(args.prefill_chunk)]
                try:
                    out = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=args.timeout
                    ).stdout
                    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
                    record = json.loads(line[-1][7:]) if line else {"error": out[-500:]}
                except subprocess.TimeoutExpired:
                    record = {"error": f"compile past {args.timeout} s"}
                record.setdefault("target", target)
                record.setdefault("layout", layout)
                record.setdefault("weights", weights)
                record.setdefault("hbm_gib", 0.0)
                record.update(host)
                print(json.dumps(record), flush=True)
                rows.append(record)
    print(table(rows))
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"generate-671b-{host['date']}.json"
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
